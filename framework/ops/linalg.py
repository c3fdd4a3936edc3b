"""Matrix products: ``matmul`` with NumPy's rules (1-D operands, batched broadcasting), and
the fused ``linear`` of ``nn.Linear``."""

from __future__ import annotations

import numpy as np

from .. import inplace, memory
from ..autograd.function import Function
from ..backend import get_array_module
from .broadcast import astype, sum_to
from .matmul_gpu import matmul as _mm


class Matmul(Function):
    saves = ("x", "y")
    saved_when = {"x": (1,), "y": (0,)}
    saved_as = {"x": "self", "y": "mat2"}  # PyTorch's mm and bmm

    def forward(ctx, x, y):
        if x.ndim == 0 or y.ndim == 0:
            raise RuntimeError("both arguments to matmul need to be at least 1D")
        ctx.xshape, ctx.yshape = x.shape, y.shape
        ctx.xdtype, ctx.ydtype = x.dtype, y.dtype
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
            gb = astype(g2.sum(axis=0), ctx.dtypes[2])
        return gx, gw, gb
