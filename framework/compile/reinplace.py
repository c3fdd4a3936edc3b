"""Pass 2: re-inplace. An out-of-place node writes into its first input's buffer when it may.

Conditions for node ``n: out = op(x, ...)`` (all of them, checked on the program):

- the op has a free inplace form: its kernel writes through ``out=`` and stays exact
  when ``out`` is ``x``'s buffer (:func:`framework.compile.kernels.has_inplace_form`).
  That backward never reads the overwritten ``x`` (the op's ``saves``) needs no separate
  test here: a saved ``x`` is a value that ``n``'s backward node reads later, which the
  next condition already refuses;
- no value of ``x``'s class is read after ``n`` (forward, backward and saved reads all
  count), and the class is not returned or written back;
- ``out`` and ``x`` have the same shape, dtype and layout (byte strides), and no other
  input of ``n`` lives in ``x``'s class (NumPy would copy an overlapping operand);
- ``x``'s class is not a program input, except when the node is on the way to that
  input's write-back: then ``out`` is the new version of the input's own buffer and the
  write-back disappears (a parameter updated out of place under policy ``off`` ends bound
  back to its buffer).

The same rules turn the backward of an elementwise op whose kernel runs lowered into
one that writes its result over the incoming gradient, and a copy whose source dies at
the copy into the source itself (all reads of the copy are redirected; DCE then removes
the copy). No copy is ever added.
"""

from __future__ import annotations

from .alias import UnionFind, alias_classes, input_index, source_key
from .kernels import REUSES_GRAD, has_inplace_form
from .program import Ref

_REINPLACE_BACKWARD = (
    "ReluBackward0",
    "ExpBackward0",
    "TanhBackward0",
    "SigmoidBackward0",
    "NegBackward0",
    "MulBackward0",
)


def _layout(v):
    return v.shape, v.dtype, v.strides


def reinplace(program) -> list[int]:
    """Rewrites nodes in place where the rules allow; returns the indices rewritten."""
    classes = alias_classes(program)
    values, nodes = program.values, program.nodes
    end = len(nodes)
    # union-find over class ids, with per-root facts updated as classes merge
    ids = {c: i for i, c in enumerate(classes.members)}
    uf = UnionFind(len(ids))
    last_use = [-1] * len(ids)
    pinned = [False] * len(ids)  # returned, written back or external: never a target
    external = [None] * len(ids)  # the input value of an external class
    for c, i in ids.items():
        if values[c].source is not None:
            pinned[i] = True
            external[i] = c
    for n in nodes:
        for vid in n.value_refs():
            i = ids[classes.of[vid]]
            last_use[i] = max(last_use[i], n.index)
    for vid in program.sink_refs():
        i = ids[classes.of[vid]]
        pinned[i] = True
        last_use[i] = end
    wb_class = {}  # class index of a write-back's value -> the external class it must reach
    inputs = input_index(program)
    for wb in program.writebacks:
        if wb.how in ("scalar", "const", "grad") or wb.value is None or not wb.source.mutable_state:
            continue
        inp = inputs.get(source_key(wb.source))
        if inp is not None:
            wb_class[ids[classes.of[wb.value]]] = ids[classes.of[inp]]

    def cls(vid):
        return uf.find(ids[classes.of[vid]])

    def merge(a, b):
        ra, rb = uf.find(a), uf.find(b)
        r = uf.union(ra, rb)
        last_use[r] = max(last_use[ra], last_use[rb])
        pinned[r] = pinned[ra] or pinned[rb]
        external[r] = external[ra] if external[ra] is not None else external[rb]
        return r

    done = []
    redirect = {}
    candidates = []  # (node, x, out) that pass the static rules, in program order
    for n in nodes:
        if n.kind == "copy":
            src, out = n.inputs[0].id, n.outputs[0]
            s = cls(src)
            if (
                not pinned[s]
                and last_use[s] <= n.index
                and _layout(values[src]) == _layout(values[out])
                and values[out].edge is None
            ):
                redirect[out] = src
                merge(s, cls(out))
                n.info["elided"] = True
                done.append(n.index)
            continue
        if n.kind == "backward":
            target = _backward_target(n, program)
            if target is None:
                continue
            x, out = target
        elif has_inplace_form(n) and n.inputs and isinstance(n.inputs[0], Ref):
            x, out = n.inputs[0].id, n.outputs[0]
        else:
            continue
        vx, vo = values[x], values[out]
        if vo.edge is not None or not vo.dense or not vx.writable or _layout(vx) != _layout(vo):
            continue
        candidates.append((n, x, out))

    def try_rewrite(n, x, out, into_input: bool) -> bool:
        cx, co = cls(x), cls(out)
        if last_use[cx] > n.index or cx == co:
            return False
        if any(cls(v) == cx for v in n.value_refs() if v != x):
            return False  # another operand in the same buffer: NumPy would copy it first
        if pinned[cx] and not into_input:
            return False
        values[out].edge = ("write", x)
        n.inplace = n.kind == "call"
        n.reinplaced = True
        if n.kind == "backward" and not n.info.get("lowered"):
            n.info["reuse_grad"] = n.info["planned_reuse"] = True
        merge(cx, co)
        done.append(n.index)
        return True

    # Phase 1: buffers made inside the step.
    for n, x, out in candidates:
        if not pinned[cls(x)]:
            try_rewrite(n, x, out, False)
    # Phase 2: an updated input's chain. Its new value lives in a class whose first value
    # was made from the input by a node with an inplace form: that node writes into the
    # input's buffer instead, and with it the whole chain (the write-back disappears).
    by_out = {out: (n, x) for n, x, out in candidates}
    owners = {}  # union-find root -> the value that owns the buffer
    for c in classes.members:
        if values[c].edge is None:
            owners.setdefault(uf.find(ids[c]), c)
    sinks: dict = {}  # union-find root -> write-backs of state that end in it (-1: something else pins it)
    for vid in program.output_refs():
        sinks[cls(vid)] = -1
    for wb in program.writebacks:
        if wb.value is None or wb.how in ("scalar", "const"):
            continue
        r = cls(wb.value)
        if wb.how == "grad" or not wb.source.mutable_state or sinks.get(r) == -1:
            sinks[r] = -1
        else:
            sinks[r] = sinks.get(r, 0) + 1
    for wcls, ecls in wb_class.items():
        c = uf.find(wcls)
        if uf.find(ecls) == c or sinks.get(c) != 1:
            continue  # already bound, or the class must also survive as something else
        owner = owners.get(c)
        hit = by_out.get(owner)
        if hit is None or uf.find(ids[classes.of[hit[1]]]) != uf.find(ecls):
            continue
        try_rewrite(hit[0], hit[1], owner, True)
    if redirect:
        replace_uses(program, redirect)
    return done


def _backward_target(n, program):
    """(incoming gradient, output) of a backward that may write its result over the gradient:
    a lowered elementwise one, or an op's own backward that does so when allowed
    (kernels.REUSES_GRAD: its first output then IS the gradient's buffer)."""
    if n.info.get("reuse_grad"):
        return None  # the capture already saw it write over its gradient
    # REUSES_GRAD describes the ops' NumPy code: on a GPU their backward kernels differ
    on_gpu = program.device is not None and program.device.type == "cuda"
    reuses = None if on_gpu else REUSES_GRAD.get(n.op)
    if reuses is not None and not n.info.get("lowered") and not n.info.get("copyslices"):
        if n.outputs and n.outputs[0] is not None and reuses(n, program):
            return n.info["grad"], n.outputs[0]
        return None
    if not n.info.get("lowered") or n.info.get("label") not in _REINPLACE_BACKWARD:
        return None
    outs = [o for o in n.outputs if o is not None]
    if len(outs) != 1 or outs[0] != n.outputs[0]:
        return None
    return n.info["grad"], outs[0]


def replace_uses(program, redirect: dict) -> None:
    """Points every read of value ``old`` at ``redirect[old]`` (templates, saved values,
    incoming gradients, returned values, write-backs)."""
    from dataclasses import replace  # noqa: PLC0415

    def fix(t):
        if isinstance(t, Ref):
            if t.id in redirect:
                t.id = redirect[t.id]
        elif isinstance(t, (tuple, list)):
            for x in t:
                fix(x)
        elif isinstance(t, dict):
            for x in t.values():
                fix(x)

    for n in program.nodes:
        for t in n.inputs:
            fix(t)
        for t in n.params.values():
            fix(t)
        info = n.info
        if "saved" in info:
            info["saved"] = {k: redirect.get(v, v) for k, v in info["saved"].items()}
        if "grad" in info:
            info["grad"] = redirect.get(info["grad"], info["grad"])
        if "saved_values" in info:
            info["saved_values"] = [redirect.get(v, v) for v in info["saved_values"]]
    fix(program.outputs)
    program.writebacks = [
        replace(wb, value=redirect.get(wb.value, wb.value)) if wb.how != "scalar" else wb for wb in program.writebacks
    ]
