"""Pooling kernels on NCHW arrays: max and average pooling, forward and backward.

They are chunked by the workspace limit (:mod:`.workspace`) where they need workspace
that grows with the batch: max pooling's comparison masks and ``-inf`` padded input in
forward, its mask and masked gradient in backward, average pooling's zero-padded input.
Gradients are allocated at the input's exact shape. On a GPU other kernels run (below:
a constant number of calls, no chunks), chosen in :func:`.choice.pooling`. Max pooling records the argmax of
each window as a window offset in the smallest unsigned dtype that holds ``kh*kw``
offsets (``uint8`` for every usual kernel): one byte per output element, instead of the
whole input (4 bytes per input element for float32, 16x more for a 2x2 pool).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from ... import memory
from .. import kernels as K
from ..promotion import is_floating  # bfloat16 too (ml_dtypes' kind is "V"): -inf padding, NaN maxima
from .workspace import chunks, offset, pad, padded_image_bytes, reaches, windows


def index_dtype(xp, n_offsets):
    """The smallest unsigned dtype that holds ``n_offsets`` window offsets."""
    for dt in (xp.uint8, xp.uint16, xp.uint32):
        if n_offsets <= xp.iinfo(dt).max + 1:
            return dt
    return xp.int64


def max_pool_forward(x, kernel, stride, padding, out_hw, limit, track_index, xp):
    """``(out, idx)``: the max of each window, and (when ``track_index``) the offset
    ``i*kw + j`` of its first maximum (NaN counts as the maximum), else None."""
    low = -xp.inf if is_floating(x.dtype) else (xp.iinfo(x.dtype).min if x.dtype.kind in "iu" else False)
    shape = x.shape[:2] + tuple(out_hw)
    out = memory.empty(shape, x.dtype, xp, "activations")
    idx = memory.zeros(shape, index_dtype(xp, kernel[0] * kernel[1]), xp, "activations") if track_index else None
    is_float = is_floating(x.dtype)
    per_out = math.prod(shape[1:])
    per_image = padded_image_bytes(x.shape, padding, x.itemsize) + per_out * (2 if is_float else 1)
    parts = chunks(x.shape[0], per_image, limit)
    rows = parts[0].stop if parts else 0
    better = memory.empty((rows,) + shape[1:], bool, xp, "workspace")
    nan = memory.empty((rows,) + shape[1:], bool, xp, "workspace") if is_float else None
    for sl in parts:
        m = sl.stop - sl.start
        xpad = pad(x[sl], padding, low, xp)
        o, bt = out[sl], better[:m]
        ix = idx[sl] if track_index else None
        nn = nan[:m] if nan is not None else None
        for k in range(kernel[0] * kernel[1]):
            v = xpad[offset(k // kernel[1], k % kernel[1], stride, out_hw)]
            if k == 0:
                xp.copyto(o, v)
                continue
            xp.greater(v, o, out=bt)
            if nn is not None:  # NaN wins, so it propagates as in PyTorch
                xp.isnan(v, out=nn)
                xp.logical_or(bt, nn, out=bt)
            xp.copyto(o, v, where=bt)
            if track_index:
                xp.copyto(ix, idx.dtype.type(k), where=bt)  # a typed scalar: CuPy checks casts
        del xpad, v  # v views xpad: the next chunk's padded buffer must not meet this one
    return out, idx


def max_pool_backward(g, idx, x_shape, kernel, stride, padding, out_hw, limit, xp):
    """Routes each output's gradient to the input position its window's max came from."""
    gx = memory.zeros(x_shape, g.dtype, xp, "gradients")
    reach = reaches(kernel, stride, padding, out_hw, x_shape[2:])
    parts = chunks(x_shape[0], math.prod(idx.shape[1:]) * (1 + g.itemsize), limit)
    rows = parts[0].stop if parts else 0
    hit = memory.empty((rows,) + idx.shape[1:], bool, xp, "workspace")
    tmp = memory.empty((rows,) + idx.shape[1:], g.dtype, xp, "workspace")
    for sl in parts:
        m = sl.stop - sl.start
        ix, gs, gxs, h, t = idx[sl], g[sl], gx[sl], hit[:m], tmp[:m]
        for k, src, dst in reach:
            xp.equal(ix, k, out=h)
            xp.multiply(gs, h, out=t)
            gxs[dst] += t[src]
    return gx


def avg_pool_forward(x, kernel, stride, padding, out_hw, limit, xp):
    """The mean of each window, padding zeros included in the count."""
    out = memory.empty(x.shape[:2] + tuple(out_hw), x.dtype, xp, "activations")
    for sl in chunks(x.shape[0], padded_image_bytes(x.shape, padding, x.itemsize), limit):
        xpad = pad(x[sl], padding, 0, xp)
        o = out[sl]
        for k in range(kernel[0] * kernel[1]):
            v = xpad[offset(k // kernel[1], k % kernel[1], stride, out_hw)]
            if k == 0:
                xp.copyto(o, v)
            else:
                o += v
        del xpad, v  # v views xpad: the next chunk's padded buffer must not meet this one
    out *= 1.0 / (kernel[0] * kernel[1])
    return out


def avg_pool_backward(g, x_shape, kernel, stride, padding, out_hw, xp):
    """Each output's gradient shared equally by its window: g added where each kernel
    offset reaches the input (not the padding), then divided once. No workspace."""
    gx = memory.zeros(x_shape, g.dtype, xp, "gradients")
    for _, src, dst in reaches(kernel, stride, padding, out_hw, x_shape[2:]):
        gx[dst] += g[src]
    gx *= 1.0 / (kernel[0] * kernel[1])
    return gx


def adaptive_matrix(xp, n_in, n_out, dtype):
    """(n_out, n_in): row i averages PyTorch's bin [floor(i n_in / n_out), ceil((i+1) n_in / n_out))."""
    i = xp.arange(n_out)
    start = (i * n_in) // n_out
    end = ((i + 1) * n_in + n_out - 1) // n_out
    pos = xp.arange(n_in)
    inside = (pos[None, :] >= start[:, None]) & (pos[None, :] < end[:, None])
    return (inside / (end - start)[:, None]).astype(dtype)


# --- the GPU's: a constant number of calls whatever the batch and the kernel ------------------
#
# On a GPU each call costs 7-10 µs, so the kernels above (a loop over chunks and over the
# kh*kw window offsets) would cost dozens of launches a pool. Here a pool's forward is one
# padded copy, one strided copy or reduction of the window view, and a reduction or two; its
# backward is ONE fused kernel that gathers, for every input element, the gradients of the
# windows covering it in a fixed order (``kernels.max_pool_backward`` /
# ``avg_pool_backward``): deterministic, unlike a scatter-add whose atomics add overlapping
# windows in a different order each call. No chunks (the forward's workspace is batch-sized:
# the windows, ``kh*kw`` values per output), no host synchronization. Which kernels run is
# decided in :func:`.choice.pooling`.


def _padded(x, padding, value, xp):
    """``x`` padded by ``value``: one fill and one copy (``x`` itself without padding)."""
    (ph, pw), (n, c, h, w) = padding, x.shape
    if ph == 0 and pw == 0:
        return x
    buf = memory.empty((n, c, h + 2 * ph, w + 2 * pw), x.dtype, xp, "workspace")
    buf.fill(value)
    buf[:, :, ph : ph + h, pw : pw + w] = x
    return buf


def _gather_windows(kernel, g, extra, x_shape, window, stride, padding, out_hw, xp):
    """The input gradient of a pool, by one of the gather kernels: ``extra`` is ``(idx,)`` for
    max pooling and ``(scale,)`` for average pooling (after the geometry)."""
    (kh, kw), (sh, sw), (ph, pw) = window, stride, padding
    g = g if g.flags.c_contiguous else memory.track(xp.ascontiguousarray(g), "workspace")
    gx = memory.empty(x_shape, g.dtype, xp, "gradients")
    geometry = (x_shape[2], x_shape[3], out_hw[0], out_hw[1], kh, kw, sh, sw, ph, pw)
    if kernel is K.max_pool_backward:
        kernel(g, *extra, *geometry, gx)
    else:
        kernel(g, *geometry, *extra, gx)
    return gx


def max_pool_forward_gpu(x, kernel, stride, padding, out_hw, limit, track_index, xp):
    """:func:`max_pool_forward` in a constant number of calls: the windows copied once,
    then a max (and an argmax: the first maximum, NaN counting as the maximum)."""
    low = -xp.inf if is_floating(x.dtype) else (xp.iinfo(x.dtype).min if x.dtype.kind in "iu" else False)
    shape = x.shape[:2] + tuple(out_hw)
    n_off = kernel[0] * kernel[1]
    xpad = _padded(x, padding, low, xp)  # named: the window view alone may not keep it counted
    view = windows(xpad, kernel, stride, out_hw)  # (N, C, kh, kw, Ho, Wo)
    cols = memory.empty(shape + tuple(kernel), x.dtype, xp, "workspace")
    xp.copyto(cols, view.transpose(0, 1, 4, 5, 2, 3))
    del view, xpad
    flat = cols.reshape(shape + (n_off,))
    out = memory.empty(shape, x.dtype, xp, "activations")
    flat.max(axis=-1, out=out)
    idx = None
    if track_index:
        arg = memory.empty(shape, np.int64, xp, "workspace")
        flat.argmax(axis=-1, out=arg)
        idx = memory.empty(shape, index_dtype(xp, n_off), xp, "activations")
        xp.copyto(idx, arg, casting="unsafe")  # offsets < kh*kw: the small dtype holds them
    return out, idx


def max_pool_backward_gpu(g, idx, x_shape, kernel, stride, padding, out_hw, limit, xp):
    """Each output's gradient to its window's first maximum (one gather kernel)."""
    return _gather_windows(K.max_pool_backward, g, (idx,), x_shape, kernel, stride, padding, out_hw, xp)


def avg_pool_forward_gpu(x, kernel, stride, padding, out_hw, limit, xp):
    """:func:`avg_pool_forward` as one sum over the window view (no copy of the windows)
    and one scaling (the CPU's rounding: sum, then times 1/(kh*kw))."""
    xpad = _padded(x, padding, 0, xp)
    out = memory.empty(x.shape[:2] + tuple(out_hw), x.dtype, xp, "activations")
    windows(xpad, kernel, stride, out_hw).sum(axis=(2, 3), out=out)
    del xpad
    out *= 1.0 / (kernel[0] * kernel[1])
    return out


def avg_pool_backward_gpu(g, x_shape, kernel, stride, padding, out_hw, xp):
    """Each output's gradient divided among its window (one gather kernel): ``g * 1/(kh*kw)``
    rounded to g's dtype, then added (the CPU divides the sums once instead)."""
    scale = g.dtype.type(1.0 / (kernel[0] * kernel[1]))
    return _gather_windows(K.avg_pool_backward, g, (scale,), x_shape, kernel, stride, padding, out_hw, xp)


class Kernels(NamedTuple):
    """One device's four pooling kernels (same signatures on both)."""

    max_pool_forward: Callable
    max_pool_backward: Callable
    avg_pool_forward: Callable
    avg_pool_backward: Callable


CPU = Kernels(max_pool_forward, max_pool_backward, avg_pool_forward, avg_pool_backward)
GPU = Kernels(max_pool_forward_gpu, max_pool_backward_gpu, avg_pool_forward_gpu, avg_pool_backward_gpu)
