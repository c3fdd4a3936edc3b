"""Reductions (sum, mean, var, amax, max) and softmax / log_softmax over a dim."""

from __future__ import annotations

from ..autograd.function import ABSENT, Function
from ..backend import get_array_module
from ..tensor import _wrap
from .broadcast import astype, sum_axes


def _axes(dim, ndim):
    """Normalizes ``dim`` (None, int or tuple, negatives allowed) to a tuple of axes.

    An empty ``dim`` (``()``, ``[]``) reduces every dim, as None does (PyTorch 2.x).
    """
    dims = (dim,) if isinstance(dim, int) else tuple(dim) if dim is not None else ()
    if not dims:
        return tuple(range(ndim))
    out = []
    for d in dims:
        if not -max(ndim, 1) <= d < max(ndim, 1):
            raise IndexError(
                f"Dimension out of range (expected to be in range of [{-max(ndim, 1)}, {max(ndim, 1) - 1}], "
                f"but got {d})"
            )
        out.append(d % max(ndim, 1) if ndim else 0)
    return tuple(out)


def _keep_shape(shape, axes):
    """``shape`` with the reduced axes set to 1 (what keepdim=True gives)."""
    return tuple(1 if i in axes else n for i, n in enumerate(shape))


def _dims(dim):
    """A reduction's ``dim`` as PyTorch saves it (``_saved_dim``): a tuple, ABSENT for None."""
    if dim is None:
        return ABSENT
    return (dim,) if isinstance(dim, int) else tuple(dim)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# PyTorch's saved attributes of a reduction over ``dim`` (absent without one)
_REDUCED = {
    "dim": lambda c: _dims(c.dim),
    "keepdim": lambda c: ABSENT if c.dim is None else c.keepdim,
    "self_sym_sizes": lambda c: c.shape,
}


def _expand_grad(g, shape, axes):
    xp = get_array_module(g)
    return xp.broadcast_to(g.reshape(_keep_shape(shape, axes)), shape)


class Sum(Function):
    saved_attrs = _REDUCED

    def forward(ctx, x, dim=None, keepdim=False):
        ctx.shape, ctx.axes = x.shape, _axes(dim, x.ndim) if x.ndim else ()
        ctx.dim, ctx.keepdim = dim, keepdim
        if dim is not None:
            ctx.node_name = "SumBackward1"  # sum(dim): PyTorch's second overload
        return get_array_module(x).sum(x, axis=ctx.axes, keepdims=keepdim)

    def backward(ctx, g):
        return _expand_grad(g, ctx.shape, ctx.axes)


class Mean(Function):
    saved_attrs = {**_REDUCED, "self_sym_numel": lambda c: _numel(c.shape)}

    def forward(ctx, x, dim=None, keepdim=False):
        ctx.shape, ctx.axes = x.shape, _axes(dim, x.ndim) if x.ndim else ()
        ctx.dim, ctx.keepdim = dim, keepdim
        if dim is not None:
            ctx.node_name = "MeanBackward1"
        n = 1
        for a in ctx.axes:
            n *= x.shape[a]
        ctx.n = n
        return get_array_module(x).mean(x, axis=ctx.axes, keepdims=keepdim)

    def backward(ctx, g):
        return _expand_grad(g / ctx.n, ctx.shape, ctx.axes)


class Var(Function):
    saves = ("x",)

    def forward(ctx, x, dim=None, correction=1, keepdim=False):
        ctx.shape, ctx.axes = x.shape, _axes(dim, x.ndim) if x.ndim else ()
        n = 1
        for a in ctx.axes:
            n *= x.shape[a]
        ctx.denom = max(n - correction, 0)
        return get_array_module(x).var(x, axis=ctx.axes, ddof=correction, keepdims=keepdim)

    def backward(ctx, g):
        xp = get_array_module(g)
        x = ctx.x
        centered = x - xp.mean(x, axis=ctx.axes, keepdims=True)
        centered *= _expand_grad(g, ctx.shape, ctx.axes)
        centered *= 2.0 / ctx.denom if ctx.denom else float("nan")
        return centered


class Amax(Function):
    """Max over dims; ties share the gradient evenly (PyTorch's amax convention)."""

    saves = ("x", "result")
    saved_attrs = {"dim": lambda c: () if c.dim is None else _dims(c.dim), "keepdim": lambda c: c.keepdim}

    def forward(ctx, x, dim=None, keepdim=False):
        ctx.shape, ctx.axes, ctx.keepdim = x.shape, _axes(dim, x.ndim) if x.ndim else (), keepdim
        ctx.dim = dim
        return get_array_module(x).amax(x, axis=ctx.axes, keepdims=keepdim)

    def backward(ctx, g):
        keep = _keep_shape(ctx.shape, ctx.axes)
        mask = ctx.x == ctx.result.reshape(keep)
        count = mask.sum(axis=ctx.axes, keepdims=True)
        return mask * astype(g.reshape(keep) / count, g.dtype)


class MaxDim(Function):
    """``max(dim)``: values and indices; the gradient goes to the index that was picked."""

    node_name = "MaxBackward0"
    saved_attrs = {
        "dim": lambda c: c.given_dim,  # as the caller wrote it (-1 stays -1), as PyTorch saves it
        "keepdim": lambda c: c.keepdim,
        "self_sym_sizes": lambda c: c.shape,
        "indices": lambda c: _wrap(c.indices if c.keepdim else c.indices.squeeze(c.dim)),
    }

    def forward(ctx, x, dim=0, keepdim=False):
        xp = get_array_module(x)
        ctx.shape, ctx.dim, ctx.keepdim = x.shape, _axes(dim, x.ndim)[0], keepdim
        ctx.given_dim = int(dim)
        idx = xp.expand_dims(xp.argmax(x, axis=ctx.dim), ctx.dim)
        ctx.indices = idx
        values = xp.take_along_axis(x, idx, axis=ctx.dim)
        return values if keepdim else values.squeeze(ctx.dim)

    def backward(ctx, g):
        # g where the picked index is, 0 elsewhere: one where() over a mask of the picks
        xp = get_array_module(g)
        gk = g if ctx.keepdim else xp.expand_dims(g, ctx.dim)
        n = ctx.shape[ctx.dim]
        pos = get_array_module(ctx.indices).arange(n).reshape((n,) + (1,) * (len(ctx.shape) - ctx.dim - 1))
        return xp.where(pos == ctx.indices, xp.broadcast_to(gk, ctx.shape), 0)


def _out(ctx, x):
    # The buffer to write: x's when inplace, else a new one (NumPy would return a scalar
    # instead of a 0-d array for 0-d x, and the inplace steps below need an array).
    return ctx.out if ctx.out is not None else get_array_module(x).empty_like(x)


def _softmax_axis(dim, ndim):
    """The array axis of softmax over ``dim``: checked as PyTorch does (``-1`` and ``0`` are
    allowed on a 0-d tensor), and None on a 0-d tensor, whose one element is the whole
    reduction (CuPy refuses any axis on a 0-d array, where NumPy lets -1 and 0 through)."""
    (axis,) = _axes(dim, ndim)
    return axis if ndim else None


_DIM = {"dim": lambda c: c.dim}


class Softmax(Function):
    inplace_name = "softmax_"
    saves = ("result",)
    saved_attrs = _DIM
    auto_inplace = True  # backward reads the result only: policy auto may write over a dead input

    def forward(ctx, x, dim=-1):
        xp = get_array_module(x)
        ctx.dim = dim = _softmax_axis(dim, x.ndim)
        out = xp.subtract(x, xp.amax(x, axis=dim, keepdims=True), out=_out(ctx, x))
        xp.exp(out, out=out)
        out /= sum_axes(out, dim, keepdims=True)
        return out

    def backward(ctx, g):
        # y (g - sum(g y)), as PyTorch's kernel: written through out= and the values
        # returned (in place on arrays; new tensors under create_graph)
        xp = get_array_module(g)
        y = ctx.result
        gx = xp.multiply(g, y, out=xp.empty_like(g))  # out=: an array also for 0-d
        s = sum_axes(gx, ctx.dim, keepdims=True)
        gx = xp.subtract(g, s, out=gx)
        return xp.multiply(gx, y, out=gx)


class LogSoftmax(Function):
    inplace_name = "log_softmax_"
    saves = ("result",)
    saved_attrs = _DIM
    auto_inplace = True

    def forward(ctx, x, dim=-1):
        xp = get_array_module(x)
        ctx.dim = dim = _softmax_axis(dim, x.ndim)
        out = xp.subtract(x, xp.amax(x, axis=dim, keepdims=True), out=_out(ctx, x))
        lse = xp.log(sum_axes(xp.exp(out), dim, keepdims=True))
        out -= lse
        return out

    def backward(ctx, g):
        xp = get_array_module(g)
        gx = xp.exp(ctx.result, out=xp.empty_like(g))  # out=: an array also for 0-d
        gx = xp.multiply(gx, sum_axes(g, ctx.dim, keepdims=True), out=gx)
        return xp.subtract(g, gx, out=gx)
