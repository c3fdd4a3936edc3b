"""Masks: ``masked_fill`` and the triangular ``tril`` / ``triu``, as PyTorch's.

All three are free in place: backward reads the mask (or nothing), never the values
written over, so ``masked_fill_``, ``tril_`` and ``triu_`` keep no copy, and policy
``auto`` runs the ordinary forms in place over a dead input (a causal mask over fresh
attention scores: ``att.masked_fill(mask, -inf)``).
"""

from __future__ import annotations

import numpy as np

from ..autograd.function import Function
from ..backend import get_array_module
from ..tensor import Tensor
from . import kernels_transformer as KT
from .broadcast import shape_of, sum_to
from .kernels import launch, on_gpu


class MaskedFill(Function):
    """``input`` with ``value`` where ``mask`` is True; saves the mask. A 0-d tensor
    ``value`` gets the sum of the gradient where the mask is True."""

    inplace_name = "masked_fill_"
    saves = ("mask",)
    auto_inplace = True

    def forward(ctx, x, mask, value):
        xp = get_array_module(x)
        ctx.xshape = x.shape  # the result may be larger: a mask broadcast beyond the input
        ctx.mv, ctx.vdtype = shape_of(value), getattr(value, "dtype", None)
        if hasattr(value, "shape"):
            value = value.astype(x.dtype, copy=False)
        else:
            value = x.dtype.type(value)
        if ctx.out is not None:
            xp.copyto(ctx.out, value, where=xp.broadcast_to(mask, x.shape))
            return ctx.out
        return xp.where(mask, value, x)

    def backward(ctx, g):
        xp = get_array_module(g)
        mask = ctx.mask
        gx = gv = None
        if ctx.needs_input_grad[0]:
            gx = xp.where(mask, 0, g)
            gx = sum_to(gx, ctx.xshape)
        if ctx.needs_input_grad[2]:
            gv = sum_to(xp.where(mask, g, 0).sum(), ctx.mv, ctx.vdtype)
        return gx, None, gv


def _check_mask(x, mask, name, inplace):
    """A bool mask on ``x``'s device that broadcasts with ``x``: to ``x``'s own shape when
    written into ``x`` (``masked_fill_``); the ordinary form's result takes the broadcast
    shape, as PyTorch's (a mask wider than the input widens the result)."""
    if not isinstance(mask, Tensor) or mask.dtype != np.bool_:
        got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise RuntimeError(f"{name} only supports boolean masks, but got mask with dtype {got}")
    try:
        shape = np.broadcast_shapes(mask.shape, x.shape)
    except ValueError:
        raise RuntimeError(
            f"{name}: the mask of shape {tuple(mask.shape)} does not broadcast with the input's shape {tuple(x.shape)}"
        ) from None
    if inplace and shape != tuple(x.shape):
        raise RuntimeError(f"output with shape {list(x.shape)} doesn't match the broadcast shape {list(shape)}")
    if mask.device != x.device:
        raise RuntimeError(f"{name}: expected the mask on the input's device {x.device}, got {mask.device}")


def _check_value(x, value, name):
    if isinstance(value, Tensor):
        if value.ndim != 0:
            raise RuntimeError(
                f"{name} only supports a 0-dimensional value tensor, but got tensor with {value.ndim} dimension(s)."
            )
        return value if value.dtype == x.dtype else value.to(dtype=x.dtype)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: value must be a number or a 0-d tensor, got {type(value).__name__}")
    return value


def masked_fill(input, mask, value):
    """``value`` where ``mask`` (bool) is True, ``input`` elsewhere, the two broadcast
    together (the result takes their broadcast shape)."""
    _check_mask(input, mask, "masked_fill", inplace=False)
    return MaskedFill.apply(input, mask, _check_value(input, value, "masked_fill"))


def masked_fill_(input, mask, value):
    """``masked_fill`` written into ``input`` (returned); free: backward reads only the mask."""
    _check_mask(input, mask, "masked_fill_", inplace=True)
    return MaskedFill.apply_(input, mask, _check_value(input, value, "masked_fill_"))


class _Triangle(Function):
    """The lower (``tril``) or upper (``triu``) triangle of the last two dims; saves nothing."""

    upper = False
    auto_inplace = True

    def forward(ctx, x, diagonal=0):
        ctx.diagonal = diagonal
        return _triangle(x, diagonal, type(ctx).upper, ctx.out)

    def backward(ctx, g):
        return _triangle(g, ctx.diagonal, type(ctx).upper, g if ctx.reuse_grad else None)


def _triangle(x, k, upper, out=None):
    if x.__class__ is Tensor:  # create_graph: the same op again (it is linear)
        return (Triu if upper else Tril).apply(x, diagonal=k)
    if on_gpu(x):
        return launch(KT.triu if upper else KT.tril, x, x.shape[-2], x.shape[-1], k, out=out)
    xp = get_array_module(x)
    rows, cols = xp.arange(x.shape[-2])[:, None], xp.arange(x.shape[-1])[None, :]
    keep = (cols - rows >= k) if upper else (cols - rows <= k)  # (rows, cols): small
    if out is None:
        return xp.where(keep, x, x.dtype.type(0))
    if out is not x:
        xp.copyto(out, x)
    xp.copyto(out, x.dtype.type(0), where=xp.broadcast_to(~keep, x.shape))  # no full-size temporary
    return out


class Tril(_Triangle):
    inplace_name = "tril_"


class Triu(_Triangle):
    inplace_name = "triu_"
    upper = True


def _check_matrix(input, name):
    if input.ndim < 2:
        raise RuntimeError(f"{name}: input tensor must have at least 2 dimensions")


def tril(input, diagonal: int = 0):
    """Elements on and below the ``diagonal``-th diagonal of the last two dims; others 0."""
    _check_matrix(input, "tril")
    return Tril.apply(input, diagonal=int(diagonal))


def triu(input, diagonal: int = 0):
    """Elements on and above the ``diagonal``-th diagonal of the last two dims; others 0."""
    _check_matrix(input, "triu")
    return Triu.apply(input, diagonal=int(diagonal))


def tril_(input, diagonal: int = 0):
    _check_matrix(input, "tril_")
    return Tril.apply_(input, diagonal=int(diagonal))


def triu_(input, diagonal: int = 0):
    _check_matrix(input, "triu_")
    return Triu.apply_(input, diagonal=int(diagonal))
