"""Capture: run a step eagerly while recording every op into a :class:`Program`.

The :class:`Recorder` is installed as ``framework.autograd.node.capture`` for the
duration of one call. The eager core calls it from lines that each check that global
first (``None`` when nothing is captured): one at the top of the apply path of every op
(``function._apply``), four in the backward engine (the root gradient, each node's
backward, gradient sums, the accumulation into a leaf's ``.grad``), one in the
creation recipes (``creation._filled``) and one in the losses' target check
(``loss._check_class_inputs``). Each hook runs the real eager code with the
recorder switched off (so nothing nested inside a recorded event, such as the view ops a
``CopySlices`` backward makes, is recorded twice), then records what happened.

Reading a tensor's value into Python (``.item()``, ``bool(t)``, ...) is refused by
conversions installed on ``Tensor`` for the duration of the capture (here, not in
tensor.py, so that they cost nothing when no step is captured).

Arrays are identified by object (a weak reference each, so capture does not keep
anything alive that eager would free) and by their root buffer. Every write into a
root bumps its version: an array read after a write through another view of the same
buffer gets a new value (SSA), defined by that write.
"""

from __future__ import annotations

import sys
import weakref

import numpy as np

from .. import memory
from ..autograd import engine as _engine
from ..autograd import function as _function
from ..autograd import node as _node
from ..autograd.function import CopySlices
from ..backend import is_array
from ..callsite import call_site
from ..tensor import Tensor
from .program import Program, Ref, ScalarRef, Source, StatsOut, WriteBack
from .scalars import Sym, Tape


class CaptureError(RuntimeError):
    """A step that cannot be captured faithfully (the message names the line)."""


def _where(site) -> str:
    return f"{site[0]}:{site[1]}"


def is_dense(arr) -> bool:
    """Whether ``arr`` covers exactly ``size * itemsize`` bytes without overlap (any order)."""
    if arr.flags.c_contiguous or arr.flags.f_contiguous:
        return True
    dims = sorted((abs(s), n) for s, n in zip(arr.strides, arr.shape) if n != 1)
    expect = arr.itemsize
    for stride, n in dims:
        if stride != expect:
            return False
        expect *= n
    return True


class _Root:
    """A buffer seen during capture: its version and the node that wrote it last."""

    __slots__ = ("ref", "version", "writer", "latest")

    def __init__(self, root, latest: int):
        self.ref = weakref.ref(root)
        self.version = 0
        self.writer = None
        self.latest = latest  # the most recent value living in this buffer


# --- refusing reads of tensor values ------------------------------------------------------

_REFUSED = ("item", "numpy", "tolist", "__bool__", "__float__", "__int__", "__index__", "__array__")


def _refusing(name):
    what = {
        "__bool__": "bool(tensor)",
        "__float__": "float(tensor)",
        "__int__": "int(tensor)",
        "__index__": "using a tensor as an index",
        "__array__": "converting a tensor to a NumPy array",
    }.get(name, f"tensor.{name}()")

    def refuse(self, *args, **kwargs):
        site = call_site()
        raise CaptureError(
            f"fw.compile: {what} at {_where(site)} reads a tensor's value into Python while the step is "
            "being captured; a compiled step replays its ops without running the step's Python, so it "
            "cannot depend on tensor values. Read the value outside the step (e.g. from the returned "
            "loss), or run this step eagerly."
        )

    refuse.__name__ = name
    return refuse


class _RefuseValueReads:
    """Installs the refusing conversions on Tensor for the duration of a capture."""

    def __enter__(self):
        self.saved = {name: Tensor.__dict__[name] for name in _REFUSED if name in Tensor.__dict__}
        for name in self.saved:
            setattr(Tensor, name, _refusing(name))
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(Tensor, name, fn)


# --- the recorder ---------------------------------------------------------------------------


class Recorder:
    """Records one eager run of a step (see the module docstring).

    Args:
        externals: ``(tensor, Source)`` for every external tensor the step may read
            (arguments, parameters and their gradients, buffers, optimizer state).
        tape: the scalar tape (traced hyperparameters).
    """

    def __init__(self, externals: list, tape: Tape, name: str = "step"):
        self.program = Program(name=name)
        # weak references: capture must not keep alive what the step frees (old gradients)
        self.externals = [(weakref.ref(t), src) for t, src in externals]
        self.sources = {id(t): (r, src) for (t, _), (r, src) in zip(externals, self.externals)}
        self.tape = tape
        self.arrays: dict = {}  # id(array) -> (weakref(array), value id)
        self.roots: dict = {}  # id(root buffer) -> _Root
        self.vroot: dict = {}  # value id -> _Root of its buffer
        self.pending = {id(t._data): (weakref.ref(t._data), weakref.ref(t)) for t, _ in externals}
        self.ctx_nodes: dict = {}  # id(ctx) -> (ctx, forward node index)
        self.leaf_grads: dict = {}  # id(leaf) -> (leaf, value id of its accumulated gradient)
        self.unknown: list = []  # external tensors no source describes (checked at the end)
        self.timeline = None  # memory timeline of the capture (set by the caller)

    # --- values ---------------------------------------------------------------------
    def _root(self, arr):
        """The record of ``arr``'s buffer, None when no value lives in it yet."""
        root = memory.root_buffer(arr)
        rec = self.roots.get(id(root))
        if rec is not None and rec.ref() is root:
            return rec
        return None

    def lookup(self, arr):
        """The current value of a known array (a new version after a write), else None."""
        entry = self.arrays.get(id(arr))
        if entry is None or entry[0]() is not arr:
            pend = self.pending.get(id(arr))
            if pend is not None and pend[0]() is arr and pend[1]() is not None:
                return self.external(pend[1]())
            return None
        vid = entry[1]
        rec = self.vroot[vid]
        if rec.version > self.program.values[vid].version:
            # The buffer was written through another array since this one was last seen.
            return self._new_value(arr, producer=rec.writer, edge=("alias", vid), rec=rec)
        return vid

    def _new_value(self, arr, producer=None, edge=None, source=None, name="", rec=None) -> int:
        v = self.program.new_value(arr.shape, arr.dtype, arr.strides, producer, edge, source, is_dense(arr), name)
        v.writable = bool(getattr(arr.flags, "writeable", True))
        if rec is None:
            root = memory.root_buffer(arr)
            rec = self.roots.get(id(root))
            if rec is None or rec.ref() is not root:
                rec = self.roots[id(root)] = _Root(root, v.id)
        v.version = rec.version
        rec.latest = v.id
        self.arrays[id(arr)] = (weakref.ref(arr), v.id)
        self.vroot[v.id] = rec
        return v.id

    def value_of(self, t: Tensor) -> int:
        """The value of a tensor an op reads (a new program input when it is external)."""
        vid = self.lookup(t._data)
        if vid is None:
            vid = self.external(t)
        return vid

    def external(self, t: Tensor) -> int:
        """A new program input for tensor ``t`` (read from its source at replay)."""
        entry = self.sources.get(id(t))
        src = entry[1] if entry is not None and entry[0]() is t else None
        arr = t._data
        if src is None:
            rec = self._root(arr)
            if rec is not None and self.program.values[rec.latest].source is None:
                raise CaptureError(
                    f"fw.compile: a tensor at {_where(call_site())} views a buffer of the step through a path "
                    "that is not an op (a raw array view); it cannot be replayed"
                )
            src = Source("tensor", f"tensor@{_where(call_site())}", t)
            self.unknown.append(t)
        edge = None
        rec = self._root(arr)
        if rec is not None:
            edge = ("view", rec.latest)  # another input in the same buffer (e.g. a view of it)
        vid = self._new_value(arr, edge=edge, source=src, name=src.name)
        self.pending.pop(id(arr), None)
        self.program.inputs.append(vid)
        return vid

    def _out_value(self, arr, producer: int, inputs: list) -> int:
        """The value of a node's output array: a view of an input it shares memory with, else new."""
        rec = self._root(arr)
        if rec is None:
            return self._new_value(arr, producer=producer)
        src = rec.latest
        for vid in inputs:
            if vid is not None and self.vroot.get(vid) is rec:
                src = vid
                break
        return self._new_value(arr, producer=producer, edge=("view", src), rec=rec)

    def _write(self, arr, producer: int, src_vid: int) -> int:
        """A new version of ``arr``'s buffer (that of value ``src_vid``), written by ``producer``."""
        rec = self.vroot[src_vid]
        rec.version += 1
        rec.writer = producer
        return self._new_value(arr, producer=producer, edge=("write", src_vid), rec=rec)

    # --- templates ------------------------------------------------------------------------
    def _template(self, x):
        """(template, concrete object) of an op argument that is not a tensor."""
        if isinstance(x, Sym):
            return ScalarRef(x._slot), x.value
        if isinstance(x, Tensor):
            return Ref(self.value_of(x)), x
        if is_array(x):
            vid = self.lookup(x)
            return (x if vid is None else Ref(vid)), x
        if type(x) in (tuple, list):
            items = [self._template(i) for i in x]
            if all(t is c for t, c in items):
                return x, x
            return type(x)(t for t, _ in items), type(x)(c for _, c in items)
        return x, x

    # --- hooks -------------------------------------------------------------------------------
    def _run(self, fn, *args):
        """Calls eager code with the recorder switched off."""
        _node.capture = None
        try:
            return fn(*args)
        finally:
            _node.capture = self

    def _events(self) -> int:
        return len(self.timeline.events) if self.timeline is not None else 0

    def apply(self, cls, inputs, params, inplace):
        """Hook of the apply path: runs the op eagerly, records a ``call`` node."""
        site = call_site()
        in_templates, concrete = [], []
        in_vids = []
        for x in inputs:
            if isinstance(x, Tensor):
                vid = self.value_of(x)
                in_templates.append(Ref(vid))
                concrete.append(x)
                in_vids.append(vid)
            else:
                t, c = self._template(x)
                in_templates.append(t)
                concrete.append(c)
                in_vids.append(t.id if isinstance(t, Ref) else None)
        p_templates, p_concrete, stats_keys = {}, {}, None
        for k, x in params.items():
            if type(x) is dict:  # an out-parameter forward fills (BatchNorm's stats)
                stats_keys = k
                p_concrete[k] = x
                continue
            t, c = self._template(x)
            p_templates[k], p_concrete[k] = t, c
        before = None
        if inplace and isinstance(concrete[0], Tensor):
            t0 = concrete[0]
            before = (t0._grad_fn, t0._base._grad_fn if t0._base is not None else None)
        e0 = self._events()
        out = self._run(_function._apply, cls, tuple(concrete), p_concrete, inplace)
        e1 = self._events()
        program = self.program
        node = program.add_node("call", op=cls, inputs=in_templates, params=p_templates, inplace=inplace, site=site)
        idx = node.index
        if inplace:
            # ``out`` is the written tensor (the target itself today; read from what the apply
            # path returned, so that a tensor object standing for the new version works too)
            ovid = self._write(out._data, idx, in_vids[0])
            ctx = out._grad_fn if out._grad_fn is not before[0] else None
            base = out._base
            if base is not None and base._grad_fn is not before[1] and isinstance(base._grad_fn, CopySlices):
                ctx = base._grad_fn.fn
        else:
            ovid = self._out_value(out._data, idx, in_vids[:1] if cls.is_view else in_vids)
            if cls.is_view and program.values[ovid].edge is None:
                raise CaptureError(f"fw.compile: view op {cls.__name__} at {_where(site)} returned a new buffer")
            ctx = out._grad_fn
        node.outputs = [ovid]
        if stats_keys is not None:
            stats = p_concrete[stats_keys]
            side = {k: self._new_value(a, producer=idx) for k, a in stats.items() if is_array(a)}
            p_templates[stats_keys] = StatsOut(side)
        info = node.info
        info["events"] = (e0, e1)
        if ctx is not None and type(ctx) is cls and id(ctx) not in self.ctx_nodes:
            self.ctx_nodes[id(ctx)] = (ctx, idx)
            info["needs"] = ctx.needs_input_grad
            saved, copies, kept = {}, {}, []
            names = {name: i for name, i, _ in cls._save_plan}
            for name, st in (ctx.__dict__.get("_saved") or {}).items():
                if name in names and st.vc is None and names[name] >= 0:
                    copies[name] = names[name]  # an input the inplace kernel overwrote: a copy
                elif name in names:
                    vid = self.lookup(st.array)
                    if vid is None:
                        raise CaptureError(f"fw.compile: {cls.__name__} at {_where(site)} saved an unknown array")
                    saved[name] = vid
                else:
                    kept.append((name, st.array.nbytes if hasattr(st.array, "nbytes") else 0))
            # saved inputs that are not arrays (a Python scalar, None) are plain attributes
            consts = {
                name: i
                for name, i, _ in cls._save_plan
                if i >= 0 and name in ctx.__dict__ and not hasattr(concrete[i], "shape")
            }
            info["saved"], info["saved_copies"], info["kept"] = saved, copies, kept
            info["saved_consts"] = consts
        else:
            info["needs"] = (False,) * len(inputs)
        return out

    def run_backward(self, node, g):
        """Hook of the engine: runs one node's backward, records a ``backward`` node."""
        if node.__dict__.get("_pre_hooks"):
            raise CaptureError(
                f"fw.compile: a hook on a non-leaf tensor (register_hook or retain_grad on the output of "
                f"{node.name()}) runs Python on gradients; a compiled step cannot replay it"
            )
        is_cs = isinstance(node, CopySlices)
        ctx = node.fn if is_cs else node
        entry = self.ctx_nodes.get(id(ctx))
        if entry is None or entry[0] is not ctx:
            raise CaptureError(
                f"fw.compile: backward reached {node.name()}, made before the step began; the whole graph "
                "a step backpropagates through must be built inside the step"
            )
        fwd = entry[1]
        gvid = self.lookup(g)
        if gvid is None:
            raise CaptureError(
                f"fw.compile: the gradient reaching {node.name()} was not made by a recorded op "
                "(several backward roots feeding one node?)"
            )
        reuse = bool(node.reuse_grad)
        e0 = self._events()
        outs = self._run(node.run_backward, g)
        e1 = self._events()
        program = self.program
        fnode = program.nodes[fwd]
        bnode = program.add_node("backward", op=type(ctx), site=fnode.site)
        idx = bnode.index
        grec = self._root(g)
        out_vids = []
        for o in outs:
            if o is None:
                vid = None
            elif o is g:  # the incoming gradient itself: passed through, or written over (reuse)
                vid = self._write(o, idx, gvid) if reuse else gvid
            else:
                vid = self.lookup(o)  # an array the backward passed through unchanged
                if vid is None and grec is not None and self._root(o) is grec:
                    vid = self._write(o, idx, gvid) if reuse else self._new_value(o, producer=idx, edge=("view", gvid))
                elif vid is None:
                    vid = self._out_value(o, idx, [gvid])
            out_vids.append(vid)
        bnode.outputs = out_vids
        saved_values = list(fnode.info.get("saved", {}).values())
        bnode.info.update(
            fwd=fwd, grad=gvid, reuse_grad=reuse, saved_values=saved_values, events=(e0, e1), label=node.name()
        )
        if is_cs:
            bnode.info["copyslices"] = node.view_fn
            bnode.info["base_order"] = node.base_order
        return outs

    def sum_into(self, store, key, new):
        """Hook of the engine's gradient sum (``store[key] += new``, in place when allowed)."""
        existing = store[key]
        a, b = self.lookup(existing), self.lookup(new)
        if a is None or b is None:
            raise CaptureError("fw.compile: a gradient sum read a gradient no recorded op made")
        e0 = self._events()
        self._run(_engine._sum_into, store, key, new)
        r = store[key]
        node = self.program.add_node("grad_sum", inputs=[Ref(a), Ref(b)], inplace=r is existing)
        node.info["events"] = (e0, self._events())
        node.outputs = [self._write(r, node.index, a) if r is existing else self._out_value(r, node.index, [])]

    def accumulate_leaf(self, leaf, box):
        """Hook of the engine's accumulation into ``leaf.grad`` (the gradient is ``box[-1]``)."""
        if leaf._hooks or leaf._post_acc_hooks:
            raise CaptureError(
                "fw.compile: a gradient hook on a leaf (register_hook / register_post_accumulate_grad_hook) "
                "runs Python on gradients; a compiled step cannot replay it"
            )
        grad = box[-1]
        gvid = self.lookup(grad)
        if gvid is None:
            raise CaptureError("fw.compile: a leaf received a gradient no recorded op made")
        before = leaf._grad
        bvid = None if before is None else self.value_of(before)
        barr = None if before is None else before._data
        bver = None if before is None else before._vc.value
        e0 = self._events()
        self._run(_engine._accumulate_leaf, leaf, box)
        e1 = self._events()
        after = leaf._grad
        if after is before and (after is None or after._data is barr and after._vc.value == bver):
            return  # the gradient went nowhere (a leaf without an accumulator)
        arr = after._data
        program = self.program
        if before is None:
            if arr is grad:
                final = gvid
            else:  # not provably exclusive (or another dtype): eager copied it
                node = program.add_node("copy", inputs=[Ref(gvid)], site=("<autograd engine>", 0))
                node.info["events"] = (e0, e1)
                node.outputs = [final := self._new_value(arr, producer=node.index)]
        else:
            node = program.add_node(
                "grad_sum", inputs=[Ref(bvid), Ref(gvid)], inplace=arr is barr, site=("<autograd engine>", 0)
            )
            node.info["events"] = (e0, e1)
            final = self._write(arr, node.index, bvid) if arr is barr else self._out_value(arr, node.index, [])
            node.outputs = [final]
        self.leaf_grads[id(leaf)] = (leaf, final)

    def check(self, check, t, *args):
        """Hook of a check a step makes on a tensor's values outside the ops (``cross_entropy``'s
        target range): runs it (``check(array, *args)``), records a ``check`` node that runs
        it again at every call (an effect: never removed)."""
        vid = self.value_of(t)
        e0 = self._events()
        self._run(check, t._data, *args)
        node = self.program.add_node("check", inputs=[Ref(vid)], site=call_site())
        node.info.update(check=check, args=args, label=check.label, events=(e0, self._events()))

    def root_grad(self, g):
        """Hook of ``backward()``'s implicit gradient of a scalar: ones."""
        node = self.program.add_node("fill", site=call_site())
        node.info["fill_value"] = 1
        node.outputs = [self._new_value(g, producer=node.index)]

    def created(self, t, recipe, shape, dtype, device):
        """Hook of the creation functions: a tensor made by a recipe inside the step."""
        label = getattr(recipe, "__qualname__", "create").split(".")[0]
        node = self.program.add_node("create", site=call_site())
        node.info.update(recipe=recipe, shape=tuple(shape), dtype=np.dtype(dtype), device=device, label=label)
        node.outputs = [self._new_value(t._data, producer=node.index)]

    # --- the end of the step ------------------------------------------------------------------------
    def output_template(self, result):
        """The template of what the step returned (tensors become value references)."""
        if result is None or isinstance(result, (bool, int, float, str)):
            return result
        if isinstance(result, Sym):
            return ScalarRef(result._slot)
        if isinstance(result, Tensor):
            vid = self.lookup(result._data)
            if vid is None:
                vid = self.external(result)
            return Ref(vid)
        if type(result) in (tuple, list):
            return type(result)(self.output_template(r) for r in result)
        if type(result) is dict:
            return {k: self.output_template(v) for k, v in result.items()}
        raise CaptureError(
            f"fw.compile: the step returned a {type(result).__name__}; return tensors (the loss), numbers, "
            "or tuples, lists or dicts of them"
        )

    def check_unknown(self) -> None:
        """Refuses tensors that were made inside the step by code that is not an op.

        Such a tensor (``fw.argmax(...)``, a ``fw.tensor`` built from Python data) is an
        input no source can read again: only the step's Python made it. Found as a tensor
        nothing holds any more once the step has returned (the list below, the source and
        ``getrefcount``'s argument are the only references left).
        """
        for t in self.unknown:
            if sys.getrefcount(t) <= 4:
                name = next(v.name for v in self.program.values if v.source is not None and v.source.obj is t)
                raise CaptureError(
                    f"fw.compile: a tensor used at {name.split('@', 1)[1]} was made inside the step by code that "
                    "is not a recorded op (e.g. fw.argmax, fw.tensor, fw.from_numpy, a raw NumPy result); its "
                    "value cannot be replayed. Pass it as an argument of the step, make it outside the step, "
                    "or compute it from the step's result after the call."
                )

    def writeback(self, source: Source, t, entry_array) -> None:
        """Records that external tensor ``t`` (``source``) must hold its final value after replay."""
        if t is None:
            return
        vid = self.lookup(t._data)
        if vid is None:
            return  # never read nor written by the step
        v = self.program.values[vid]
        if v.source is not None and t._data is entry_array:
            return  # read only
        self.program.writebacks.append(WriteBack(source, vid))
