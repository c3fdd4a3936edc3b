"""Matrix products: ``matmul`` with NumPy's rules (1-D operands, batched broadcasting), and
the fused ``linear`` of ``nn.Linear``."""

from __future__ import annotations

import numpy as np

from .. import inplace, memory
from ..autograd.function import ABSENT, Function
from ..backend import get_array_module
from .broadcast import astype, sum_axes, sum_to
from .matmul_gpu import matmul as _mm

# PyTorch's matmul dispatches on the dims; its last op names the node (batched: a view)
_MATMUL_NAMES = {(2, 2): "MmBackward0", (1, 1): "DotBackward0", (2, 1): "MvBackward0", (1, 2): "SqueezeBackward4"}


def _elements(strides, itemsize) -> tuple:
    return tuple(s // itemsize for s in strides)


def _only(name, value):
    """A ``saved_attrs`` getter: ``value(node)`` on nodes PyTorch names ``name``."""
    return lambda c: value(c) if c.node_name in name else ABSENT


_MM, _PRODUCTS = ("MmBackward0",), ("MmBackward0", "DotBackward0", "MvBackward0")


class Matmul(Function):
    saves = ("x", "y")
    saved_when = {"x": (1,), "y": (0,)}
    saved_as = {"x": "self", "y": "mat2"}  # PyTorch's mm; dot and mv name the second operand otherwise
    saved_attrs = {
        "self": _only(_PRODUCTS, lambda c: c.saved_value("self")),
        "mat2": _only(_MM, lambda c: c.saved_value("mat2")),
        "tensor": _only(("DotBackward0",), lambda c: c.saved_value("mat2")),
        "vec": _only(("MvBackward0",), lambda c: c.saved_value("mat2")),
        "self_sym_sizes": _only(_MM, lambda c: c.xshape),
        "self_sym_strides": _only(_MM, lambda c: c.xstrides),
        "mat2_sym_sizes": _only(_MM, lambda c: c.yshape),
        "mat2_sym_strides": _only(_MM, lambda c: c.ystrides),
    }

    def forward(ctx, x, y):
        if x.ndim == 0 or y.ndim == 0:
            raise RuntimeError("both arguments to matmul need to be at least 1D")
        ctx.xshape, ctx.yshape = x.shape, y.shape
        ctx.xstrides, ctx.ystrides = _elements(x.strides, x.itemsize), _elements(y.strides, y.itemsize)
        ctx.xdtype, ctx.ydtype = x.dtype, y.dtype
        ctx.node_name = _MATMUL_NAMES.get((x.ndim, y.ndim), "UnsafeViewBackward0")
        return _mm(x, y, get_array_module(x))

    def backward(ctx, g):
        xp = get_array_module(g)
        x1, y1 = len(ctx.xshape) == 1, len(ctx.yshape) == 1
        # Promote 1-D operands to matrices so one pair of formulas covers every case.
        g2 = g
        if y1:  # before x1: with both 1-D, g is 0-d and becomes (1,) then (1, 1)
            g2 = xp.expand_dims(g2, -1)
        if x1:
            g2 = xp.expand_dims(g2, -2)
        gx = gy = None
        if ctx.needs_input_grad[0]:
            y = ctx.y
            y2 = y[:, None] if y1 else y
            gx = _mm(g2, xp.swapaxes(y2, -1, -2), xp)
            gx = sum_to(gx[..., 0, :] if x1 else gx, ctx.xshape, ctx.xdtype)
        if ctx.needs_input_grad[1]:
            x = ctx.x
            x2 = x[None, :] if x1 else x
            gy = _mm(xp.swapaxes(x2, -1, -2), g2, xp)
            gy = sum_to(gy[..., 0] if y1 else gy, ctx.yshape, ctx.ydtype)
        return gx, gy


def _rows(a, xp):
    """``a`` as a matrix of rows ``(-1, a.shape[-1])``: a view when the strides allow one,
    else a counted copy."""
    rows = a.reshape(-1, a.shape[-1]) if a.ndim != 2 else a
    if rows is not a and hasattr(rows, "base") and rows.base is None:
        memory.track(rows, "workspace")
    return rows


_LINEAR_NAMES = {
    (True, True): "AddmmBackward0",
    (True, False): "MmBackward0",
    (False, True): "ViewBackward0",
    (False, False): "UnsafeViewBackward0",
}


_LINEAR_2D = ("AddmmBackward0", "MmBackward0")


class Linear(Function):
    """``y = x @ weight.T (+ bias)`` for ``x`` of shape ``(*, in_features)``: one node.

    Backward computes ``grad_weight = grad.T @ x`` directly in the weight's own (C)
    layout, so the engine can adopt it as ``weight.grad`` without a transposing copy
    (``matmul(x, weight.t())`` would hand back the transpose of ``x.T @ grad``).
    ``add_bias_inplace`` (the inplace policy's decision, :func:`framework.nn.functional.
    linear`) adds the bias into the fresh product instead of into a new array: the same
    values either way.
    """

    saves = ("x", "weight")
    saved_when = {"x": (1,), "weight": (0,)}
    # PyTorch's addmm(bias, x, weight.T) (mm without a bias) on 2-d input: mat1 (self) is x,
    # mat2 the transposed weight; with more dims, a view of that product
    saved_attrs = {
        "alpha": _only(("AddmmBackward0",), lambda c: 1),
        "beta": _only(("AddmmBackward0",), lambda c: 1),
        "mat1": _only(("AddmmBackward0",), lambda c: c.saved_value("self")),
        "mat1_sym_sizes": _only(("AddmmBackward0",), lambda c: c.xshape),
        "mat1_sym_strides": _only(("AddmmBackward0",), lambda c: c.xstrides),
        "self": _only(_MM, lambda c: c.saved_value("self")),
        "self_sym_sizes": lambda c: {"MmBackward0": c.xshape, "AddmmBackward0": ABSENT}.get(
            c.node_name, c.product_shape
        ),
        "self_sym_strides": _only(_MM, lambda c: c.xstrides),
        "mat2": _only(_LINEAR_2D, lambda c: None if c.saved_value("weight") is None else c.saved_value("weight").T),
        "mat2_sym_sizes": _only(_LINEAR_2D, lambda c: c.wshape[::-1]),
        "mat2_sym_strides": _only(_LINEAR_2D, lambda c: c.wstrides[::-1]),
        "weight": lambda c: ABSENT,
    }

    def forward(ctx, x, weight, bias=None, add_bias_inplace=True):
        xp = get_array_module(x)
        if x.ndim == 2:
            out = memory.track(_mm(x, weight.T, xp), "activations")
        else:  # (*, in) -> (*, out) written in its final shape: an array that owns its memory
            out = memory.empty(
                x.shape[:-1] + (weight.shape[0],), np.result_type(x.dtype, weight.dtype), xp, "activations"
            )
            _mm(_rows(x, xp), weight.T, xp, out=out.reshape(-1, weight.shape[0]))
        if bias is not None:
            if add_bias_inplace and out.dtype == bias.dtype:
                out += bias
                inplace.count_owned("linear_bias", out.nbytes)
            else:
                out = memory.track(out + bias, "activations")
        ctx.xshape, ctx.dtypes = x.shape, (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.wshape, ctx.wstrides = weight.shape, _elements(weight.strides, weight.itemsize)
        ctx.xstrides = _elements(x.strides, x.itemsize)
        ctx.product_shape = (out.size // weight.shape[0], weight.shape[0])  # the 2-d product's
        # PyTorch's linear: addmm (mm without bias) on 2-d input, then a view for more dims
        ctx.node_name = _LINEAR_NAMES[x.ndim == 2, bias is not None]
        # Never a reshaped view of the product: the inplace policy writes only over tensors
        # that own their memory (a Transformer's dropouts and residual adds over (B, T, C)).
        return out

    def backward(ctx, g):
        xp = get_array_module(g)
        g2 = _rows(g, xp)
        gx = gw = gb = None
        need_x, need_w, need_b = ctx.needs_input_grad
        if need_x:
            gx = astype(_mm(g2, ctx.weight, xp), ctx.dtypes[0])
            if len(ctx.xshape) != 2:
                gx = gx.reshape(ctx.xshape)
        if need_w:
            gw = astype(_mm(g2.T, _rows(ctx.x, xp), xp), ctx.dtypes[1])
        if need_b:
            gb = astype(sum_axes(g2, (0,)), ctx.dtypes[2])
        return gx, gw, gb
