"""Matrix products: ``matmul`` with NumPy's rules (1-D operands, batched broadcasting)."""

from __future__ import annotations

from ..autograd.function import Function
from ..backend import get_array_module
from .broadcast import sum_to


class Matmul(Function):
    saves = ("x", "y")
    saved_when = {"x": (1,), "y": (0,)}

    def forward(ctx, x, y):
        if x.ndim == 0 or y.ndim == 0:
            raise RuntimeError("both arguments to matmul need to be at least 1D")
        ctx.xshape, ctx.yshape = x.shape, y.shape
        ctx.xdtype, ctx.ydtype = x.dtype, y.dtype
        return get_array_module(x).matmul(x, y)

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
            gx = xp.matmul(g2, xp.swapaxes(y2, -1, -2))
            gx = sum_to(gx[..., 0, :] if x1 else gx, ctx.xshape, ctx.xdtype)
        if ctx.needs_input_grad[1]:
            x = ctx.x
            x2 = x[None, :] if x1 else x
            gy = xp.matmul(xp.swapaxes(x2, -1, -2), g2)
            gy = sum_to(gy[..., 0] if y1 else gy, ctx.yshape, ctx.ydtype)
        return gx, gy
