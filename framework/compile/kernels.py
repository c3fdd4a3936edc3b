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

from ..ops import conv as C
from ..ops import dropout as D
from ..ops import elementwise as E
from ..ops import linalg as L
from ..ops import norm as N
from ..ops import reduce as R
from ..ops.view import Permute, View, reshape_view
from .program import Ref, ScalarRef

OUT_CAPABLE = frozenset(
    {
        E.Add,
        E.AddScaled,
        E.Sub,
        E.Mul,
        E.Div,
        E.Pow,
        E.Maximum,
        E.Neg,
        E.Abs,
        E.Exp,
        E.Log,
        E.Sqrt,
        E.Sin,
        E.Cos,
        E.Tanh,
        E.Sigmoid,
        E.Relu,
        E.LeakyRelu,
        E.LeakyReluInplace,
        E.Clamp,
        R.Softmax,
        R.LogSoftmax,
        N.BatchNorm,
        N.BatchNormEval,
        N.InPlaceABN,
        D.Dropout,
    }
)
INPLACE_FORM = OUT_CAPABLE


def _conv_overwrites(node, program) -> bool:
    """Conv2d's backward writes its input gradient over the incoming one when it may reuse it
    and that gradient has the input's shape and is C-contiguous (framework/ops/conv.py)."""
    fnode = program.nodes[node.info["fwd"]]
    g = program.values[node.info["grad"]]
    x = program.values[fnode.inputs[0].id]
    return fnode.info.get("needs", (False,))[0] and g.shape == x.shape and _c_contig(g)


# Ops whose own backward writes its (first) gradient over the incoming one when the engine
# lets it (``ctx.reuse_grad``), and when exactly: the re-inplace pass grants that where the
# incoming gradient is dead, and replay checks at every call that the kernel did so.
REUSES_GRAD = {
    C.Conv2d: _conv_overwrites,
    D.Dropout: lambda node, program: node.outputs[0] is not None,
}


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


# --- direct kernels: each emits the NumPy calls of one node as lines of Python -------------------
#
# An emitter gets the node and a code generator ``g`` (framework/compile/replay.py) and
# writes statements with ``g.line``. Operands are names that ``g`` gives: ``g.a(vid)`` an
# array (a global bound to an arena buffer or an input, or ``env[vid]`` for an array a
# kernel makes at run time), ``g.s(template)`` a scalar or constant. ``g.call(node, vid,
# expr_without_out, ...)`` writes a call into the output's buffer. Every emitter runs the
# same NumPy functions, with the same operands in the same order, as the op's own
# forward/backward: only where the result goes differs (``out=``). (``np_add_reduce`` is
# ``np.add.reduce``, which ``np.sum`` and ``ndarray.sum`` call; ``sum_axes`` and
# ``relu_array`` are the ops' own functions, framework/ops/broadcast.py and elementwise.py.) An emitter returns
# False to leave the node to the op's own code; ``g.dry`` is set while annotate() asks.


def _emit_binary(ufunc):
    def emit(node, g):
        x, y = g.s(node.inputs[0]), g.s(node.inputs[1])
        alpha = node.params.get("alpha", 1)
        if isinstance(alpha, ScalarRef):
            al = g.s(alpha)
            y = f"({y} * {al} if {al} != 1 else {y})"  # the op's `if alpha != 1: y = y * alpha`
        elif alpha != 1:
            y = f"({y} * {g.const(alpha)})"
        return g.call(node, node.outputs[0], ufunc, [x, y])

    return emit


def _emit_unary(ufunc, *extra):
    def emit(node, g):
        return g.call(node, node.outputs[0], ufunc, [g.s(node.inputs[0]), *extra])

    return emit


def _emit_sigmoid(node, g):
    # 1 / (1 + exp(-x)) through one buffer; a new one (empty_like) when not given, as the op
    x = g.s(node.inputs[0])
    o = g.buffer(node, node.outputs[0], f"np.empty_like({x})")
    g.line(f"np.negative({x}, out={o})")
    g.line(f"np.exp({o}, out={o})")
    g.line(f"np.add({o}, 1, out={o})")
    g.line(f"np.reciprocal({o}, out={o})")
    g.done(node.outputs[0], o)
    return True


def _emit_sum(node, g):
    shape = node.info["in_shapes"][0]
    axes = R._axes(node.params.get("dim"), len(shape)) if len(shape) else ()
    keep = node.params.get("keepdim", False)
    return g.call(node, node.outputs[0], "np_add_reduce", [g.s(node.inputs[0])], f"axis={axes!r}, keepdims={keep!r}")


def _emit_linear(node, g):
    # x @ weight.T, then the bias added into the product (the op's add_bias_inplace form);
    # 2-D inputs only: other shapes go through the op's own reshapes
    shapes = node.info["in_shapes"]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    out_dtype = g.program.values[node.outputs[0]].dtype
    if len(shapes[0]) != 2:
        return False
    if bias is not None:
        if not node.params.get("add_bias_inplace", True) or _meta_of(bias, g.program)[1] != out_dtype:
            return False
    x, w = g.s(node.inputs[0]), g.s(node.inputs[1])
    if not g.call(node, node.outputs[0], "np.matmul", [x, f"{w}.T"]):
        return False
    if bias is not None:
        o = g.a(node.outputs[0])
        g.line(f"np.add({o}, {g.s(bias)}, out={o})")
    return True


# Div has a direct forward only: with a backward (which reads x and y and divides
# again) the pair runs through the op's own code.
FORWARD_ONLY = frozenset({E.Div})
FORWARD = {
    E.Add: _emit_binary("np.add"),
    E.Sub: _emit_binary("np.subtract"),
    E.Mul: _emit_unary("np.multiply"),
    E.Div: _emit_unary("np.true_divide"),
    E.Neg: _emit_unary("np.negative"),
    E.Exp: _emit_unary("np.exp"),
    E.Tanh: _emit_unary("np.tanh"),
    E.Relu: _emit_unary("relu_array"),
    E.Sigmoid: _emit_sigmoid,
    L.Matmul: _emit_unary("np.matmul"),
    L.Linear: _emit_linear,
    R.Sum: _emit_sum,
}
# Mul, Div and Matmul are binary, but their operands need no alpha: _emit_unary passes both.
FORWARD[E.Mul] = lambda node, g: g.call(node, node.outputs[0], "np.multiply", [g.s(t) for t in node.inputs[:2]])
FORWARD[E.Div] = lambda node, g: g.call(node, node.outputs[0], "np.true_divide", [g.s(t) for t in node.inputs[:2]])
FORWARD[L.Matmul] = lambda node, g: g.call(node, node.outputs[0], "np.matmul", [g.s(t) for t in node.inputs[:2]])


def _emit_view(node, g):
    x, o = node.inputs[0].id, node.outputs[0]
    if node.op is View:
        return g.view(
            o, x, lambda a: reshape_view(a, node.params["shape"]), f"reshape_view({{}}, {node.params['shape']!r})"
        )
    dims = node.params["dims"]
    return g.view(o, x, lambda a: a.transpose(dims), f"{{}}.transpose({dims!r})")


# --- backward ---------------------------------------------------------------------------------


def _meta_of(template, program):
    if isinstance(template, Ref):
        v = program.values[template.id]
        return v.shape, v.dtype
    return (), None


def _sum_axes(gshape, shape):
    """The axes and keepdims shape of ``sum_to(g, shape)`` (framework/ops/broadcast.py)."""
    lead = len(gshape) - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape) if n == 1 and gshape[lead + i] != 1)
    return axes, (1,) * lead + tuple(shape)


def _emit_add_like(negate_second):
    def emit(node, g):
        program, fnode = g.program, g.fnode(node)
        alpha = fnode.params.get("alpha", 1)
        if not (isinstance(alpha, (int, float)) and alpha == 1):
            return False
        gv = program.values[node.info["grad"]]
        gname = g.a(gv.id)
        for k, o in enumerate(node.outputs[:2]):
            if o is None:
                continue
            shape, dtype = _meta_of(fnode.inputs[k], program)
            if dtype is not None and dtype != gv.dtype:
                return False
            neg = negate_second and k == 1
            src = f"np.negative({gname})" if neg else gname
            if shape == gv.shape:
                if not neg:
                    ov = program.values[o]
                    if o != gv.id and not (
                        ov.edge is not None and ov.edge[1] == gv.id and (ov.shape, ov.strides) == (gv.shape, gv.strides)
                    ):
                        return False  # captured as something else than the gradient itself
                    if o != gv.id:
                        g.done(o, gname)  # the gradient passes on (the capture saw it as a write)
                    continue
                if not g.call(node, o, "np.negative", [gname]):
                    return False
            else:
                axes, keep = _sum_axes(gv.shape, shape)
                if not g.call(node, o, "sum_axes", [src], f"axis={axes!r}, keepdims=True", reshape=keep):
                    return False
        return True

    return emit


def _emit_mul_backward(node, g):
    program, fnode = g.program, g.fnode(node)
    gv = program.values[node.info["grad"]]
    saved = fnode.info.get("saved", {})
    ox, oy = node.outputs[0], (node.outputs[1] if len(node.outputs) > 1 else None)
    for o, t in ((ox, fnode.inputs[0]), (oy, fnode.inputs[1])):
        if o is not None and _meta_of(t, program) != (gv.shape, gv.dtype):
            return False  # broadcasting or casting: the op's own code
    if oy is not None:
        if "x" not in saved or not g.call(node, oy, "np.multiply", [g.a(gv.id), g.a(saved["x"])]):
            return False
    if ox is not None:
        y = g.a(saved["y"]) if "y" in saved else g.s(fnode.inputs[1])
        if isinstance(fnode.inputs[1], Ref) and "y" not in saved:
            return False
        if not g.call(node, ox, "np.multiply", [g.a(gv.id), y]):
            return False
    return True


def _emit_result_backward(kind):
    def emit(node, g):
        fnode = g.fnode(node)
        o = node.outputs[0]
        if o is None or len([x for x in node.outputs if x is not None]) != 1:
            return False
        gname = g.a(node.info["grad"])
        r = g.a(fnode.info["saved"]["result"])
        if kind == "relu":
            return g.call(node, o, "np.multiply", [gname, f"({r} > 0)"])
        if kind == "exp":
            return g.call(node, o, "np.multiply", [gname, r])
        # tanh: g * (1 - y * y); sigmoid: g * ((1 - y) * y). The factor gets a buffer of its
        # own (as the op's) unless the output's buffer is a new one, distinct from g's.
        out = g.target(node, o)
        fresh = out is not None and out != gname
        if kind == "tanh":
            d = out if fresh else g.temp(f"np.empty_like({r})")
            g.line(f"np.multiply({r}, {r}, out={d})")
            g.line(f"np.subtract(1, {d}, out={d})")
        else:
            d = out if fresh else g.temp(f"np.empty_like({r})")
            g.line(f"np.subtract(1, {r}, out={d})")
            g.line(f"np.multiply({d}, {r}, out={d})")
        return g.call(node, o, "np.multiply", [gname, d], out_override=out if out is not None else d)

    return emit


def _emit_view_backward(node, g):
    fnode = g.fnode(node)
    o = node.outputs[0]
    gid = node.info["grad"]
    if o is None or g.program.values[o].edge is None:
        return False  # reshape had to copy: the op's own code
    if fnode.op is View:
        shape = fnode.info["in_shapes"][0]
        return g.view(o, gid, lambda a: a.reshape(shape), f"{{}}.reshape({shape!r})")
    dims = fnode.params["dims"]
    inverse = tuple(sorted(range(len(dims)), key=dims.__getitem__))
    return g.view(o, gid, lambda a: a.transpose(inverse), f"{{}}.transpose({inverse!r})")


def _emit_sum_backward(node, g):
    fnode = g.fnode(node)
    o = node.outputs[0]
    if o is None:
        return False
    shape = fnode.info["in_shapes"][0]
    axes = R._axes(fnode.params.get("dim"), len(shape)) if len(shape) else ()
    keep = R._keep_shape(shape, axes)
    return g.view(
        o,
        node.info["grad"],
        lambda a: np.broadcast_to(a.reshape(keep), shape),
        f"np.broadcast_to({{}}.reshape({keep!r}), {shape!r})",
    )


def _emit_matmul_backward(node, g):
    fnode = g.fnode(node)
    xs, ys = fnode.info["in_shapes"][:2]
    gv = g.program.values[node.info["grad"]]
    if len(xs) != 2 or len(ys) != 2:
        return False
    saved = fnode.info.get("saved", {})
    ox, oy = node.outputs[0], (node.outputs[1] if len(node.outputs) > 1 else None)
    for o, shape in ((ox, xs), (oy, ys)):
        if o is not None and (g.program.values[o].shape != shape or g.program.values[o].dtype != gv.dtype):
            return False
    gname = g.a(gv.id)
    if ox is not None and not g.call(node, ox, "np.matmul", [gname, f"{g.a(saved['y'])}.swapaxes(-1, -2)"]):
        return False
    if oy is not None and not g.call(node, oy, "np.matmul", [f"{g.a(saved['x'])}.swapaxes(-1, -2)", gname]):
        return False
    return True


def _emit_linear_backward(node, g):
    # grad @ weight, grad.T @ x (in the weight's layout) and grad summed over the rows,
    # as the op's backward for a 2-D input; its casts are no-ops when every dtype matches
    fnode = g.fnode(node)
    gv = g.program.values[node.info["grad"]]
    if len(fnode.info["in_shapes"][0]) != 2 or len(gv.shape) != 2:
        return False
    for o in node.outputs:
        if o is not None and g.program.values[o].dtype != gv.dtype:
            return False
    saved = fnode.info.get("saved", {})
    ox, ow, ob = (list(node.outputs) + [None, None, None])[:3]
    gname = g.a(gv.id)
    if ox is not None and ("weight" not in saved or not g.call(node, ox, "np.matmul", [gname, g.a(saved["weight"])])):
        return False
    if ow is not None and ("x" not in saved or not g.call(node, ow, "np.matmul", [f"{gname}.T", g.a(saved["x"])])):
        return False
    if ob is not None and not g.call(node, ob, "sum_axes", [gname], "axis=(0,)"):
        return False
    return True


def _emit_neg_backward(node, g):
    o = node.outputs[0]
    return o is not None and g.call(node, o, "np.negative", [g.a(node.info["grad"])])


BACKWARD = {
    E.Add: _emit_add_like(False),
    E.Sub: _emit_add_like(True),
    E.Mul: _emit_mul_backward,
    E.Neg: _emit_neg_backward,
    E.Sigmoid: _emit_result_backward("sigmoid"),
    E.Relu: _emit_result_backward("relu"),
    E.Exp: _emit_result_backward("exp"),
    E.Tanh: _emit_result_backward("tanh"),
    View: _emit_view_backward,
    Permute: _emit_view_backward,
    R.Sum: _emit_sum_backward,
    L.Matmul: _emit_matmul_backward,
    L.Linear: _emit_linear_backward,
}


# --- which nodes run on direct kernels ---------------------------------------------------------


def _c_contig(v) -> bool:
    expect = v.dtype.itemsize
    for n, st in zip(reversed(v.shape), reversed(v.strides)):
        if n != 1 and st != expect:
            return False
        expect *= n
    return True


def _f_contig(v) -> bool:
    expect = v.dtype.itemsize
    for n, st in zip(v.shape, v.strides):
        if n != 1 and st != expect:
            return False
        expect *= n
    return True


def forward_ok(node, program) -> bool:
    op = node.op
    if node.kind != "call" or node.info.get("saved_copies") or node.info.get("kept"):
        return False
    if any(isinstance(t, (tuple, list, dict)) for t in node.inputs):
        return False
    if op.is_view:
        return op in (View, Permute)
    v = program.values[node.outputs[0]]
    return op in FORWARD and (_c_contig(v) or _f_contig(v))


def emit(node, g) -> bool:
    """Writes the direct kernel of ``node``; False when it runs through the op's own code."""
    kind = node.kind
    if kind == "grad_sum":
        a, b = (g.a(t.id) for t in node.inputs)
        return g.call(node, node.outputs[0], "np.add", [a, b])
    if kind == "copy":
        o = g.buffer(node, node.outputs[0], None)
        if o is None:
            src = g.a(node.inputs[0].id)
            g.line(
                f"env[{node.outputs[0]}] = track({src}.astype("
                f"{np.dtype(g.program.values[node.outputs[0]].dtype).name!r}, order='C'), 'gradients')"
            )
            return True
        g.line(f"np.copyto({o}, {g.a(node.inputs[0].id)}, casting='unsafe')")
        g.done(node.outputs[0], o)
        return True
    if kind == "fill":
        o = g.buffer(node, node.outputs[0], None)
        v = g.program.values[node.outputs[0]]
        if o is None:
            g.line(
                f"env[{v.id}] = track(np.full({v.shape!r}, {node.info['fill_value']!r}, "
                f"dtype={np.dtype(v.dtype).name!r}), 'gradients')"
            )
            return True
        g.line(f"{o}.fill({node.info['fill_value']!r})")
        g.done(v.id, o)
        return True
    if not node.info.get("lowered"):
        return False
    if kind == "call":
        if node.op.is_view:
            return _emit_view(node, g)
        return FORWARD[node.op](node, g)
    if kind == "backward":
        return BACKWARD[g.fnode(node).op](node, g)
    return False


__all__ = [
    "OUT_CAPABLE",
    "INPLACE_FORM",
    "FORWARD",
    "FORWARD_ONLY",
    "BACKWARD",
    "REUSES_GRAD",
    "emit",
    "writes_out",
    "can_write_into",
    "has_inplace_form",
]
