"""The kernel table: which ops can write into a given buffer, and direct replay instructions.

Two facts per op, kept here (the one place compilation decides them) and tested op by
op against the eager op in ``tests/framework/compile/test_kernels.py``:

- :data:`OUT_CAPABLE`: the op's ``forward`` writes its whole result through ``ctx.out``
  when it is given a buffer of the result's shape, dtype and layout (a planned buffer,
  or its first input's own buffer for re-inplacing). For any other op the kernel
  allocates its output and the plan says so.
- :data:`INPLACE_FORM`: of those, the ops whose forward stays exact when ``ctx.out`` is
  its first input's buffer (elementwise, or reads everything it needs from the input
  before writing, like BatchNorm). Whether the inplace form is *free* (backward never
  reads the overwritten input: the op's ``saves``) is checked on the program itself by
  the re-inplace pass, where a saved input is simply a value read later.

:func:`lower` turns a node into one closure that calls NumPy directly (``out=`` into the
planned buffer) for the ops listed in :data:`FORWARD` and :data:`BACKWARD`, computing
exactly what the op's own ``forward``/``backward`` computes, operation for operation, so
results are bitwise the same. A forward is lowered only together with its backward
(the lowered pair shares no context object); other ops run through the op's own code.
"""

from __future__ import annotations

import numpy as np

from .. import memory
from ..autograd.function import _as_array
from ..ops import dropout as D
from ..ops import elementwise as E
from ..ops import linalg as L
from ..ops import norm as N
from ..ops import reduce as R
from ..ops.view import Permute, View, reshape_view
from ..ops.broadcast import sum_to
from .program import Ref, ScalarRef

OUT_CAPABLE = frozenset({
    E.Add, E.Sub, E.Mul, E.Div, E.Pow, E.Maximum, E.Neg, E.Abs, E.Exp, E.Log, E.Sqrt, E.Sin, E.Cos,
    E.Tanh, E.Sigmoid, E.Relu, E.LeakyRelu, E.Clamp, R.Softmax, R.LogSoftmax, N.BatchNorm,
    N.BatchNormEval, N.InPlaceABN, D.Dropout,
})
INPLACE_FORM = OUT_CAPABLE


def writes_out(op) -> bool:
    """Whether the op's forward writes its result through ``ctx.out`` (see :data:`OUT_CAPABLE`)."""
    return op in OUT_CAPABLE


def can_write_into(node) -> bool:
    """Whether replay can hand ``node`` a buffer for its (first) output."""
    kind = node.kind
    if kind in ("grad_sum", "copy", "fill"):
        return True
    if kind == "call":
        return not node.inplace and not node.op.is_view and (node.op in OUT_CAPABLE or node.info.get("lowered", False))
    if kind == "backward":
        return node.info.get("lowered", False)
    return False


def has_inplace_form(node) -> bool:
    """Whether the re-inplace pass may point ``node``'s output at its first input's buffer."""
    if node.kind == "call":
        return not node.inplace and not node.op.is_view and node.op in INPLACE_FORM
    return False


# --- operands -----------------------------------------------------------------------------

def _getter(template, env, scal):
    """A function returning the operand now (arrays from env, traced scalars, constants)."""
    if isinstance(template, Ref):
        i = template.id
        return lambda: env[i]
    if isinstance(template, ScalarRef):
        s = template.slot
        return lambda: scal[s]
    return lambda: template


def _static(template) -> bool:
    return not isinstance(template, (Ref, ScalarRef))


class _Out:
    """Where a lowered kernel writes one output: the planned buffer, its input's buffer
    (re-inplaced), or a new array (allocated and counted at each replay)."""

    def __init__(self, vid, program, plan, env, alias_of=None):
        self.vid = vid
        v = program.values[vid]
        self.shape, self.dtype = v.shape, v.dtype
        self.order = "F" if (len(v.shape) > 1 and v.strides and not _c_contig(v) and _f_contig(v)) else "C"
        self.planned = vid in plan.offsets
        self.alias_of = alias_of
        self.env = env
        self.category = "gradients"

    def get(self):
        if self.planned:
            return self.env[self.vid]
        if self.alias_of is not None:
            return self.env[self.alias_of]
        return memory.track(np.empty(self.shape, dtype=self.dtype, order=self.order), self.category)


def _c_contig(v) -> bool:
    expect = v.dtype.itemsize
    for n, s in zip(reversed(v.shape), reversed(v.strides)):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def _f_contig(v) -> bool:
    expect = v.dtype.itemsize
    for n, s in zip(v.shape, v.strides):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def _layout_ok(vid, program) -> bool:
    v = program.values[vid]
    return _c_contig(v) or _f_contig(v)


# --- forward kernels ----------------------------------------------------------------------

def _binary(ufunc):
    def build(node, get, out):
        x, y = get(node.inputs[0]), get(node.inputs[1])
        alpha = node.params.get("alpha", 1)
        a = (lambda: alpha) if _static(alpha) else get(alpha)

        def run():
            yv, al = y(), a()
            if al != 1:
                yv = yv * al  # as the op's forward (a Python scalar stays one)
            return ufunc(x(), yv, out=out())

        return run

    return build


def _plain_binary(ufunc):
    def build(node, get, out):
        x, y = get(node.inputs[0]), get(node.inputs[1])
        return lambda: ufunc(x(), y(), out=out())

    return build


def _unary(ufunc):
    def build(node, get, out):
        x = get(node.inputs[0])
        return lambda: ufunc(x(), out=out())

    return build


def _relu(node, get, out):
    x = get(node.inputs[0])
    return lambda: np.maximum(x(), 0, out=out())


def _sigmoid(node, get, out):
    x = get(node.inputs[0])

    def run():
        o = np.negative(x(), out=out())
        np.exp(o, out=o)
        o += 1
        return np.reciprocal(o, out=o)

    return run


def _matmul(node, get, out):
    x, y = get(node.inputs[0]), get(node.inputs[1])
    return lambda: np.matmul(x(), y(), out=out())


def _sum(node, get, out):
    x = get(node.inputs[0])
    dim, keepdim = node.params.get("dim"), node.params.get("keepdim", False)
    shape = node.info["in_shapes"][0]
    axes = R._axes(dim, len(shape)) if len(shape) else ()

    def run():
        return np.sum(x(), axis=axes, keepdims=keepdim, out=out())

    return run


FORWARD = {
    E.Add: _binary(np.add), E.Sub: _binary(np.subtract), E.Mul: _plain_binary(np.multiply),
    E.Div: _plain_binary(np.true_divide), E.Neg: _unary(np.negative), E.Exp: _unary(np.exp),
    E.Tanh: _unary(np.tanh), E.Relu: _relu, E.Sigmoid: _sigmoid, L.Matmul: _matmul, R.Sum: _sum,
}


def _view_forward(node, get, env, o):
    x = get(node.inputs[0])
    op = node.op
    if op is View:
        shape = node.params["shape"]
        reshape = reshape_view

        def run():
            env[o] = reshape(x(), shape)
    elif op is Permute:
        dims = node.params["dims"]

        def run():
            env[o] = x().transpose(dims)
    else:
        return None
    return run


# --- backward kernels -----------------------------------------------------------------------
#
# Each builder gets (node, fnode, get, outs) where outs[i] is an _Out or None (no gradient),
# and returns a closure, or None to leave the node to the op's own backward.

def _meta_of(template, program):
    if isinstance(template, Ref):
        v = program.values[template.id]
        return v.shape, v.dtype
    return (), None


def _sum_into(g, o, shape):
    """``sum_to(g, shape)`` into ``o``: the keepdims sum of the op's helper, written with out=."""
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape) if n == 1 and g.shape[lead + i] != 1)
    keep = o.reshape((1,) * lead + tuple(shape)) if lead else o.reshape(shape)
    np.sum(g, axis=axes, keepdims=True, out=keep)
    return o


def _add_like(sign):
    def build(node, fnode, get, outs, program):
        g = get(Ref(node.info["grad"]))
        alpha = fnode.params.get("alpha", 1)
        if not _static(alpha) or alpha != 1:
            return None
        mx, my = (_meta_of(t, program) for t in fnode.inputs[:2])
        env = outs[0].env if outs[0] is not None else outs[1].env if outs[1] is not None else None
        gshape = program.values[node.info["grad"]].shape
        steps = []
        for k, (meta, o) in enumerate(zip((mx, my), outs)):
            if o is None:
                continue
            shape, dtype = meta
            if dtype is not None and dtype != program.values[node.info["grad"]].dtype:
                return None
            negate = sign < 0 and k == 1
            if shape == gshape and not negate:
                steps.append(("alias", o.vid))
            elif shape == gshape:
                steps.append(("neg", o))
            else:
                steps.append(("negsum" if negate else "sum", o, shape))

        def run():
            gv = g()
            for st in steps:
                kind = st[0]
                if kind == "alias":
                    env[st[1]] = gv
                elif kind == "neg":
                    env[st[1].vid] = np.negative(gv, out=st[1].get())
                elif kind == "sum":
                    env[st[1].vid] = _sum_into(gv, st[1].get(), st[2])
                else:
                    env[st[1].vid] = _sum_into(-gv, st[1].get(), st[2])

        return run

    return build


def _mul_backward(node, fnode, get, outs, program):
    g = get(Ref(node.info["grad"]))
    gshape = program.values[node.info["grad"]].shape
    saved = fnode.info.get("saved", {})
    mx, my = (_meta_of(t, program) for t in fnode.inputs[:2])
    ox, oy = outs[0], outs[1] if len(outs) > 1 else None
    if oy is not None and (my[0] != gshape or my[1] != program.values[node.info["grad"]].dtype):
        return None
    if ox is not None and (mx[0] != gshape or mx[1] != program.values[node.info["grad"]].dtype):
        return None
    xg = get(Ref(saved["x"])) if "x" in saved else None
    yt = fnode.inputs[1]
    yg = get(Ref(saved["y"])) if "y" in saved else (get(yt) if not isinstance(yt, Ref) else None)
    if ox is not None and yg is None or oy is not None and xg is None:
        return None
    env = (ox or oy).env

    def run():
        gv = g()
        if oy is not None:
            env[oy.vid] = np.multiply(gv, xg(), out=oy.get())
        if ox is not None:
            env[ox.vid] = np.multiply(gv, yg(), out=ox.get())

    return run


def _elementwise_backward(kind):
    def build(node, fnode, get, outs, program):
        o = outs[0]
        if o is None:
            return None
        g = get(Ref(node.info["grad"]))
        saved = fnode.info.get("saved", {})
        r = get(Ref(saved["result"]))
        env = o.env
        if kind == "relu":
            def run():
                env[o.vid] = np.multiply(g(), r() > 0, out=o.get())
        elif kind == "exp":
            def run():
                env[o.vid] = np.multiply(g(), r(), out=o.get())
        else:  # tanh: g * (1 - y * y), with (1 - y * y) in its own buffer when o is g's
            def run():
                gv, y, ov = g(), r(), o.get()
                d = np.multiply(y, y, out=np.empty_like(y) if ov is gv else ov)
                np.subtract(1, d, out=d)
                env[o.vid] = np.multiply(gv, d, out=ov)
        return run

    return build


def _view_backward(node, fnode, get, outs, program):
    o = outs[0]
    if o is None:
        return None
    g = get(Ref(node.info["grad"]))
    env = o.env
    if fnode.op is View:
        shape = fnode.info["in_shapes"][0]

        def run():
            env[o.vid] = g().reshape(shape)
    else:
        dims = fnode.params["dims"]
        inverse = tuple(sorted(range(len(dims)), key=dims.__getitem__))

        def run():
            env[o.vid] = g().transpose(inverse)
    return run


def _sum_backward(node, fnode, get, outs, program):
    o = outs[0]
    if o is None:
        return None
    g = get(Ref(node.info["grad"]))
    shape = fnode.info["in_shapes"][0]
    dim = fnode.params.get("dim")
    axes = R._axes(dim, len(shape)) if len(shape) else ()
    keep = R._keep_shape(shape, axes)
    env = o.env

    def run():
        env[o.vid] = np.broadcast_to(g().reshape(keep), shape)

    return run


def _matmul_backward(node, fnode, get, outs, program):
    xs, ys = fnode.info["in_shapes"][:2]
    if len(xs) != 2 or len(ys) != 2:
        return None
    gval = program.values[node.info["grad"]]
    saved = fnode.info.get("saved", {})
    ox, oy = outs[0], outs[1] if len(outs) > 1 else None
    for o, shape in ((ox, xs), (oy, ys)):
        if o is not None and (o.shape != shape or o.dtype != gval.dtype):
            return None
    g = get(Ref(node.info["grad"]))
    yg = get(Ref(saved["y"])) if ox is not None else None
    xg = get(Ref(saved["x"])) if oy is not None else None
    env = (ox or oy).env

    def run():
        gv = g()
        if ox is not None:
            env[ox.vid] = np.matmul(gv, np.swapaxes(yg(), -1, -2), out=ox.get())
        if oy is not None:
            env[oy.vid] = np.matmul(np.swapaxes(xg(), -1, -2), gv, out=oy.get())

    return run


BACKWARD = {
    E.Add: _add_like(1), E.Sub: _add_like(-1), E.Mul: _mul_backward, E.Relu: _elementwise_backward("relu"),
    E.Exp: _elementwise_backward("exp"), E.Tanh: _elementwise_backward("tanh"), View: _view_backward,
    Permute: _view_backward, R.Sum: _sum_backward, L.Matmul: _matmul_backward,
}


# --- lowering ------------------------------------------------------------------------------------

def lowerable_pair(node, program) -> bool:
    """Whether a forward node has a direct kernel (its backward is checked by :func:`annotate`)."""
    op = node.op
    if node.kind != "call" or node.info.get("saved_copies") or node.info.get("kept"):
        return False
    if op.is_view:
        return op in (View, Permute)
    return op in FORWARD and all(_layout_ok(v, program) for v in node.outputs)


def annotate(program) -> None:
    """Marks which forward/backward pairs run lowered (``info["lowered"]``), before planning.

    A backward is lowered when its op is in :data:`BACKWARD`, its forward is lowered too,
    and its builder accepts the shapes (checked by a dry build at executor time; a
    refusal there falls back to the op's own code for both).
    """
    backward_of: dict = {}
    for n in program.nodes:
        if n.kind == "backward":
            backward_of[n.info["fwd"]] = n
    for n in program.nodes:
        if n.kind == "call":
            n.info["in_shapes"] = [program.values[t.id].shape if isinstance(t, Ref) else () for t in n.inputs]
    for n in program.nodes:
        if n.kind != "call":
            continue
        ok = lowerable_pair(n, program)
        b = backward_of.get(n.index)
        if ok and b is not None:
            ok = n.op in BACKWARD and not b.info.get("copyslices") and _backward_accepts(b, n, program)
        n.info["lowered"] = ok
        if b is not None:
            b.info["lowered"] = ok


def _backward_accepts(bnode, fnode, program) -> bool:
    class _Probe:
        env = None

        def __init__(self, vid):
            v = program.values[vid]
            self.vid, self.shape, self.dtype = vid, v.shape, v.dtype
            self.env = []

        def get(self):  # pragma: no cover - never called by a dry build
            raise AssertionError

    outs = [None if vid is None else _Probe(vid) for vid in bnode.outputs]
    return BACKWARD[fnode.op](bnode, fnode, lambda t: (lambda: None), outs, program) is not None


def lower(node, program, plan, env, scal, ctxs):
    """One closure that replays ``node``, or None for the op's own forward/backward."""
    kind = node.kind

    def get(t):
        return _getter(t, env, scal)

    if kind == "grad_sum":
        return _lower_grad_sum(node, program, plan, env)
    if kind == "copy":
        src, o = node.inputs[0].id, _Out(node.outputs[0], program, plan, env)

        def run():
            dst = o.get()
            np.copyto(dst, env[src], casting="unsafe")
            env[o.vid] = dst

        return run
    if kind == "fill":
        o = _Out(node.outputs[0], program, plan, env)
        value = node.info["fill_value"]

        def run():
            dst = o.get()
            dst.fill(value)
            env[o.vid] = dst

        return run
    if kind == "create":
        recipe, shape, dtype = node.info["recipe"], node.info["shape"], node.info["dtype"]
        from .. import backend  # noqa: PLC0415

        dev = node.info["device"]
        xp = backend.xp_for(dev)
        vid = node.outputs[0]

        def run():
            with backend.device_context(dev):
                env[vid] = memory.track(recipe(xp, shape, dtype))

        return run
    if not node.info.get("lowered"):
        return None
    if kind == "call":
        o = node.outputs[0]
        if node.op.is_view:
            return _view_forward(node, get, env, o)
        if node.inplace:
            target = node.inputs[0].id
            out = lambda: env[target]  # noqa: E731
        elif o in plan.offsets:
            out = lambda: env[o]  # noqa: E731
        else:
            spec = _Out(o, program, plan, env)
            spec.category = "activations"
            out = spec.get
        compute = FORWARD[node.op](node, get, out)

        def run():
            env[o] = _as_array(compute())

        return run
    if kind == "backward":
        fnode = program.nodes[node.info["fwd"]]
        outs = []
        for vid in node.outputs:
            if vid is None:
                outs.append(None)
                continue
            v = program.values[vid]
            alias = v.edge[1] if v.edge is not None and v.edge[0] == "write" else None
            outs.append(_Out(vid, program, plan, env, alias_of=alias))
        return BACKWARD[fnode.op](node, fnode, get, outs, program)
    return None


def _lower_grad_sum(node, program, plan, env):
    a, b = node.inputs[0].id, node.inputs[1].id
    o = node.outputs[0]
    if node.inplace:
        def run():
            x = env[a]
            np.add(x, env[b], out=x)
            env[o] = x
        return run
    spec = _Out(o, program, plan, env)

    def run():
        env[o] = _as_array(np.add(env[a], env[b], out=spec.get()))

    return run


__all__ = ["OUT_CAPABLE", "INPLACE_FORM", "FORWARD", "BACKWARD", "annotate", "lower", "writes_out",
           "can_write_into", "has_inplace_form", "sum_to"]
