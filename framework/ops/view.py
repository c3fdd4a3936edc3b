"""View ops (the output shares the input's storage and version counter) and indexing.

A view op's forward returns a view of its input array (``is_view = True``): the array
module keeps the shape, strides and offset, the apply path makes the output share the
input's version counter and records how to replay the view from the base. Indexing
with integer or boolean tensors returns a copy, as in PyTorch; writing with them is
:class:`IndexPut`, an inplace op on the indexed tensor.

Ops that return several views (``unbind``, ``split``, ``chunk``) produce each output
with its own node here (:class:`Unbind`, :class:`Split`, :class:`SplitWithSizes`); the
entry points in ``framework.ops`` mark those outputs so that, as in PyTorch, they
refuse inplace ops while autograd records (``framework.autograd.view_meta``).
"""

from __future__ import annotations

import numpy as np

from .. import backend, memory
from ..autograd.function import Function
from ..backend import device_of, get_array_module, to_device
from .broadcast import copy, sum_to

# ``array`` reshaped without copying, or None (NumPy and CuPy need different calls).
reshape_view = backend.reshape_view


_SIZES = {"self_sym_sizes": lambda c: c.shape}


def _select_dim(c) -> int:
    """The dim of a select written as ``(slice(None),) * dim + (i, Ellipsis)``."""
    return len(c.index) - 2


class View(Function):
    is_view = True
    saved_attrs = _SIZES

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

    node_name = "UnsafeViewBackward0"
    saved_attrs = _SIZES

    def forward(ctx, x, shape=None):
        ctx.shape = x.shape
        xp = get_array_module(x)
        return xp.ascontiguousarray(x).reshape(shape)

    def backward(ctx, g):
        return g.reshape(ctx.shape)


class Permute(Function):
    is_view = True
    saved_attrs = {"dims": lambda c: c.dims}

    def forward(ctx, x, dims=None):
        ctx.dims = dims
        ctx.inverse = tuple(sorted(range(len(dims)), key=dims.__getitem__))  # argsort, in Python ints
        return x.transpose(dims)

    def backward(ctx, g):
        return get_array_module(g).transpose(g, ctx.inverse)


def broadcast_view(x, shape):
    """``x`` expanded to ``shape``: a view with PyTorch's strides that can be written.

    NumPy marks a broadcast read-only; PyTorch lets a write through an expanded tensor
    reach one element (``t.expand(5, 5)[2, 2] = 0`` writes the shared element). Writes
    that would hit one memory location twice are refused by the inplace check first.
    The strides are PyTorch's (``inferExpandGeometry``): 0 only where a dim is
    repeated; a new dim of size 1 gets the stride it would have if contiguous.
    """
    shape = tuple(shape)
    strides = [0] * len(shape)
    lead = len(shape) - x.ndim
    for i in reversed(range(len(shape))):
        d = i - lead
        if d >= 0:
            strides[i] = 0 if x.shape[d] != shape[i] else x.strides[d]
        else:
            strides[i] = 0 if shape[i] != 1 else (shape[i + 1] * strides[i + 1] if i + 1 < len(shape) else x.itemsize)
    return get_array_module(x).lib.stride_tricks.as_strided(x, shape, tuple(strides))


class Expand(Function):
    is_view = True
    saved_attrs = _SIZES

    def forward(ctx, x, shape=None):
        ctx.shape = x.shape
        return broadcast_view(x, shape)

    def backward(ctx, g):
        return sum_to(g, ctx.shape)


class GetItem(Function):
    """Basic indexing (ints, slices, None, Ellipsis): a view."""

    is_view = True

    def forward(ctx, x, index=None):
        ctx.shape, ctx.dtype, ctx.index = x.shape, x.dtype, index
        return x[index]

    def name(self) -> str:
        if type(self) is not GetItem:
            return self.node_name  # select, unbind, split: one op each, as in PyTorch
        # PyTorch indexes one element of the index at a time: its last op names the node
        index = self.index if isinstance(self.index, tuple) else (self.index,)
        for i in reversed(index):
            if i is None:
                return "UnsqueezeBackward0"
            if isinstance(i, slice):
                return "SliceBackward0"
            if i is not Ellipsis:
                return "SelectBackward0"
        return "AliasBackward0"

    def backward(ctx, g):
        gx = memory.zeros(ctx.shape, ctx.dtype, get_array_module(g), "gradients")
        gx[ctx.index] = g
        return gx


class Select(GetItem):
    """``x.select(dim, i)``: basic indexing at one position of one dim (a view)."""

    node_name = "SelectBackward0"
    saved_attrs = {"dim": _select_dim, "index": lambda c: c.index[-2], "self_sym_sizes": lambda c: c.shape}


class Unbind(GetItem):
    """One output of ``unbind``: a ``select`` (the outputs refuse inplace, see ops.unbind)."""

    node_name = "UnbindBackward0"
    saved_attrs = {"dim": _select_dim}


class Split(GetItem):
    """One output of ``split``/``chunk``: a slice of one dim."""

    node_name = "SplitBackward0"


class SplitWithSizes(GetItem):
    """One output of ``split_with_sizes`` (or ``split`` with a list of sizes)."""

    node_name = "SplitWithSizesBackward0"


class AsStrided(Function):
    """``as_strided``: any geometry over the storage of the input's base (a view).

    ``size``/``stride``/``offset`` are in elements from the first element of the base
    tensor, as PyTorch counts them from the start of the storage; ``source_offset`` is
    where the input itself starts, so that the same call replayed on another array of
    the base's layout (a view chain replay in backward) lands at the same place.
    """

    is_view = True

    def forward(ctx, x, size=None, stride=None, offset=0, source_offset=0):
        ctx.xshape, ctx.dtype = x.shape, x.dtype
        ctx.xstride = tuple(b // x.itemsize for b in x.strides)
        ctx.size, ctx.stride, ctx.offset, ctx.source_offset = size, stride, offset, source_offset
        return strided_view(x, (offset - source_offset) * x.itemsize, size, tuple(s * x.itemsize for s in stride))

    def backward(ctx, g):
        # PyTorch's as_strided_backward: scatter-add the gradient into a buffer laid out
        # like the storage, then read the input's elements back; where the input itself
        # sees one location several times (an expanded input), share it evenly.
        mine = (ctx.source_offset, ctx.xshape, ctx.xstride)
        return _strided_transfer(g, (ctx.offset, ctx.size, ctx.stride), mine, mine, ctx.xshape)


def _strided_transfer(g, scatter, gather, count, shape):
    """``g`` scattered (added) into a storage at the positions of geometry ``scatter``,
    divided by how often geometry ``count`` sees each position, read back at the positions
    of ``gather`` (each geometry: ``(offset, shape, stride)`` in elements). Linear in
    ``g``; under create_graph it is the op :class:`StridedTransfer`."""
    if hasattr(g, "_grad_fn"):
        return StridedTransfer.apply(g, scatter=scatter, gather=gather, count=count, shape=shape)
    xp = get_array_module(g)
    out_pos, in_pos = _positions(xp, *scatter), _positions(xp, *gather)
    seen_pos = in_pos if count == gather else _positions(xp, *count)
    gx = memory.zeros(shape, g.dtype, xp, "gradients")
    if not in_pos.size:
        return gx
    every = [p for p in (out_pos, in_pos) + (() if seen_pos is in_pos else (seen_pos,)) if p.size]
    lo = min(int(p.min()) for p in every)
    hi = max(int(p.max()) for p in every)
    storage = xp.zeros(hi - lo + 1, dtype=g.dtype)
    if out_pos.size:
        backend.scatter_add(storage, (out_pos - lo,), xp.ascontiguousarray(g).reshape(-1))
    seen = xp.zeros(hi - lo + 1, dtype=g.dtype)
    backend.scatter_add(seen, (seen_pos - lo,), xp.ones(seen_pos.size, dtype=g.dtype))
    storage /= xp.maximum(seen, 1)
    gx[...] = storage[in_pos - lo].reshape(shape)
    return gx


class StridedTransfer(Function):
    """:func:`_strided_transfer` as an op: as_strided's backward, differentiable. It is
    linear, and its backward is itself with ``scatter`` and ``gather`` swapped (the
    transpose of gather . divide . scatter-add)."""

    def forward(ctx, g, scatter=None, gather=None, count=None, shape=None):
        ctx.geometry, ctx.gshape = (scatter, gather, count), g.shape
        return _strided_transfer(g, scatter, gather, count, shape)

    def backward(ctx, h):
        scatter, gather, count = ctx.geometry
        return _strided_transfer(h, gather, scatter, count, ctx.gshape)


def _positions(xp, offset, shape, stride):
    """The storage position of every element of a (shape, stride, offset) geometry, flat in C order."""
    pos = xp.full(tuple(shape), offset, dtype=np.int64)
    for d, (n, s) in enumerate(zip(shape, stride)):
        pos += (xp.arange(n, dtype=np.int64) * s).reshape((-1,) + (1,) * (len(shape) - d - 1))
    return pos.reshape(-1)


def strided_view(x, delta_bytes: int, shape, strides_bytes):
    """A view of ``x``'s memory that starts ``delta_bytes`` after ``x`` (may be negative)."""
    if not isinstance(x, np.ndarray):  # CuPy: a pointer into the same allocation
        xp = get_array_module(x)
        return xp.ndarray(tuple(shape), x.dtype, memptr=x.data + delta_bytes, strides=tuple(strides_bytes))
    owner = memory.root_buffer(x)
    start = x.__array_interface__["data"][0] - owner.__array_interface__["data"][0] + delta_bytes
    return np.ndarray(tuple(shape), x.dtype, buffer=owner, offset=start, strides=tuple(strides_bytes))


def _split_index(index):
    """Index arrays out of an index tuple (kept as saved tensors) and the rest of it."""
    arrays = {f"index{i}": it for i, it in enumerate(index) if hasattr(it, "shape") and hasattr(it, "dtype")}
    rest = tuple(None if f"index{i}" in arrays else it for i, it in enumerate(index))
    return arrays, rest


def _kept_index(ctx):
    """The index tuple of an indexing node; its arrays were saved for backward, so a
    second backward without ``retain_graph`` raises, as in PyTorch."""
    return tuple(getattr(ctx, f"index{i}") if it is None else it for i, it in enumerate(ctx.index_rest))


class IndexGet(Function):
    """Advanced indexing (integer or boolean arrays): a copy; duplicates accumulate."""

    node_name = "IndexBackward0"

    def forward(ctx, x, index=None):
        ctx.shape, ctx.dtype = x.shape, x.dtype
        arrays, ctx.index_rest = _split_index(index)
        ctx.keep(**arrays)
        return x[index]

    def backward(ctx, g):
        gx = memory.zeros(ctx.shape, ctx.dtype, get_array_module(g), "gradients")
        index = _kept_index(ctx)
        if hasattr(gx, "_grad_fn"):  # create_graph: the same scatter-add, as an op
            return IndexAdd.apply(gx, g, index=tuple(getattr(i, "_data", i) for i in index))
        backend.scatter_add(gx, index, g)  # np.add.at; cupyx.scatter_add on a GPU
        return gx


class IndexAdd(Function):
    """``x[index] += value`` with duplicates accumulating (``index_put_(accumulate=True)``):
    the backward of advanced indexing, as an op, so that it has a backward itself (of
    ``x``: the gradient; of ``value``: the gradient indexed, an :class:`IndexGet`)."""

    def forward(ctx, x, value, index=None):
        arrays, ctx.index_rest = _split_index(index)
        ctx.keep(**arrays)
        ctx.vshape, ctx.vdtype = getattr(value, "shape", ()), getattr(value, "dtype", None)
        out = ctx.out if ctx.out is not None else x.copy()
        backend.scatter_add(out, index, value)
        return out

    def backward(ctx, g):
        gv = sum_to(g[_kept_index(ctx)], ctx.vshape, ctx.vdtype) if ctx.needs_input_grad[1] else None
        return (g if ctx.needs_input_grad[0] else None), gv


class IndexPut(Function):
    """``x[index] = value`` with advanced indexing, in place on x."""

    inplace_name = "index_put_ (x[index] = value)"

    def forward(ctx, x, value, index=None):
        arrays, ctx.index_rest = _split_index(index)
        ctx.keep(**arrays)
        ctx.vshape, ctx.vdtype = getattr(value, "shape", ()), getattr(value, "dtype", None)
        out = ctx.out if ctx.out is not None else x.copy()
        out[index] = value
        return out

    def backward(ctx, g):
        index = _kept_index(ctx)
        gx = gv = None
        if ctx.needs_input_grad[0]:
            gx = copy(g)
            gx[index] = 0
        if ctx.needs_input_grad[1]:
            gv = sum_to(g[index], ctx.vshape, ctx.vdtype)
        return gx, gv


class Clone(Function):
    def forward(ctx, x, contiguous=False):
        # PyTorch's preserve_format: a dense input's strides (a transposed tensor clones
        # transposed), else contiguous; contiguous(): always C order
        return x.copy(order="C" if contiguous else memory.layout_order(x))

    def backward(ctx, g):
        return g


class Cat(Function):
    saved_attrs = {"dim": lambda c: c.dim}

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
    saved_attrs = {"dim": lambda c: c.dim}

    def forward(ctx, *xs, dim=0):
        ctx.dim = dim
        return get_array_module(xs[0]).stack(xs, axis=dim)

    def backward(ctx, g):
        xp = get_array_module(g)
        return tuple(xp.take(g, i, axis=ctx.dim) if need else None for i, need in enumerate(ctx.needs_input_grad))


class ToDevice(Function):
    node_name = "ToCopyBackward0"

    def forward(ctx, x, device=None):
        ctx.source = device_of(x)
        return to_device(x, device)

    def backward(ctx, g):
        if hasattr(g, "_grad_fn"):  # create_graph: the tensor's own (differentiable) move
            return g.to(ctx.source)
        return to_device(g, ctx.source)
