"""View ops (the output shares the input's storage and version counter) and indexing.

A view op's forward returns a view of its input array (``is_view = True``): the array
module keeps the shape, strides and offset, the apply path makes the output share the
input's version counter and records how to replay the view from the base. Indexing
with integer or boolean tensors returns a copy, as in PyTorch; writing with them is
:class:`IndexPut`, an inplace op on the indexed tensor.
"""

from __future__ import annotations

from .. import backend, memory
from ..autograd.function import Function
from ..backend import get_array_module
from .broadcast import sum_to

# ``array`` reshaped without copying, or None (NumPy and CuPy need different calls).
reshape_view = backend.reshape_view


class View(Function):
    is_view = True

    def forward(ctx, x, shape=None):
        ctx.shape = x.shape
        out = reshape_view(x, shape)
        if out is None:
            raise RuntimeError(
                f"view size is not compatible with input tensor's size and stride (shape {x.shape}, "
                f"strides {x.strides}) for the target shape {tuple(shape)}. Use .reshape(...) instead."
            )
        return out

    def backward(ctx, g):
        return g.reshape(ctx.shape)


class ReshapeCopy(Function):
    """reshape where the strides do not allow a view: a contiguous copy, as in PyTorch."""

    def forward(ctx, x, shape=None):
        ctx.shape = x.shape
        xp = get_array_module(x)
        return xp.ascontiguousarray(x).reshape(shape)

    def backward(ctx, g):
        return g.reshape(ctx.shape)


class Permute(Function):
    is_view = True

    def forward(ctx, x, dims=None):
        ctx.inverse = tuple(sorted(range(len(dims)), key=dims.__getitem__))  # argsort, in Python ints
        return x.transpose(dims)

    def backward(ctx, g):
        return g.transpose(ctx.inverse)


class Expand(Function):
    is_view = True

    def forward(ctx, x, shape=None):
        ctx.shape = x.shape
        return get_array_module(x).broadcast_to(x, shape)

    def backward(ctx, g):
        return sum_to(g, ctx.shape)


class GetItem(Function):
    """Basic indexing (ints, slices, None, Ellipsis): a view."""

    is_view = True

    def forward(ctx, x, index=None):
        ctx.shape, ctx.dtype, ctx.index = x.shape, x.dtype, index
        return x[index]

    def backward(ctx, g):
        gx = memory.zeros(ctx.shape, ctx.dtype, get_array_module(g), "gradients")
        gx[ctx.index] = g
        return gx


class IndexGet(Function):
    """Advanced indexing (integer or boolean arrays): a copy; duplicates accumulate."""

    def forward(ctx, x, index=None):
        ctx.shape, ctx.dtype, ctx.index = x.shape, x.dtype, index
        return x[index]

    def backward(ctx, g):
        gx = memory.zeros(ctx.shape, ctx.dtype, get_array_module(g), "gradients")
        backend.scatter_add(gx, ctx.index, g)  # np.add.at; cupyx.scatter_add on a GPU
        return gx


class IndexPut(Function):
    """``x[index] = value`` with advanced indexing, in place on x."""

    inplace_name = "index_put_ (x[index] = value)"

    def forward(ctx, x, value, index=None):
        ctx.index = index
        ctx.vshape, ctx.vdtype = getattr(value, "shape", ()), getattr(value, "dtype", None)
        out = ctx.out if ctx.out is not None else x.copy()
        out[index] = value
        return out

    def backward(ctx, g):
        gx = gv = None
        if ctx.needs_input_grad[0]:
            gx = g.copy()
            gx[ctx.index] = 0
        if ctx.needs_input_grad[1]:
            gv = sum_to(g[ctx.index], ctx.vshape, ctx.vdtype)
        return gx, gv


class Clone(Function):
    def forward(ctx, x):
        return x.copy()

    def backward(ctx, g):
        return g


class Cat(Function):
    def forward(ctx, *xs, dim=0):
        ctx.dim = dim
        ctx.sizes = [x.shape[dim] for x in xs]
        return get_array_module(xs[0]).concatenate(xs, axis=dim)

    def backward(ctx, g):
        out, start = [], 0
        index = [slice(None)] * g.ndim
        for n, need in zip(ctx.sizes, ctx.needs_input_grad):
            if need:
                index[ctx.dim] = slice(start, start + n)
                out.append(g[tuple(index)])
            else:
                out.append(None)
            start += n
        return tuple(out)


class Stack(Function):
    def forward(ctx, *xs, dim=0):
        ctx.dim = dim
        return get_array_module(xs[0]).stack(xs, axis=dim)

    def backward(ctx, g):
        xp = get_array_module(g)
        return tuple(
            xp.take(g, i, axis=ctx.dim) if need else None for i, need in enumerate(ctx.needs_input_grad)
        )


class ToDevice(Function):
    def forward(ctx, x, device=None):
        from ..backend import device_of, to_device  # noqa: PLC0415

        ctx.source = device_of(x)
        return to_device(x, device)

    def backward(ctx, g):
        from ..backend import to_device  # noqa: PLC0415

        return to_device(g, ctx.source)
