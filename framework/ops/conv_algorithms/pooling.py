"""Pooling kernels on NCHW arrays: max and average pooling, forward and backward.

They are chunked by the workspace limit (:mod:`.workspace`) where they need workspace
that grows with the batch: max pooling's comparison masks and ``-inf`` padded input in
forward, its mask and masked gradient in backward, average pooling's zero-padded input.
Gradients are allocated at the input's exact shape. Max pooling records the argmax of
each window as a window offset in the smallest unsigned dtype that holds ``kh*kw``
offsets (``uint8`` for every usual kernel): one byte per output element, instead of the
whole input (4 bytes per input element for float32, 16x more for a 2x2 pool).
"""

from __future__ import annotations

import math

from ... import memory
from .workspace import chunks, offset, pad, padded_image_bytes, reaches


def index_dtype(xp, n_offsets):
    """The smallest unsigned dtype that holds ``n_offsets`` window offsets."""
    for dt in (xp.uint8, xp.uint16, xp.uint32):
        if n_offsets <= xp.iinfo(dt).max + 1:
            return dt
    return xp.int64


def max_pool_forward(x, kernel, stride, padding, out_hw, limit, track_index, xp):
    """``(out, idx)``: the max of each window, and (when ``track_index``) the offset
    ``i*kw + j`` of its first maximum (NaN counts as the maximum), else None."""
    low = -xp.inf if x.dtype.kind == "f" else (xp.iinfo(x.dtype).min if x.dtype.kind in "iu" else False)
    shape = x.shape[:2] + tuple(out_hw)
    out = memory.empty(shape, x.dtype, xp, "activations")
    idx = memory.zeros(shape, index_dtype(xp, kernel[0] * kernel[1]), xp, "activations") if track_index else None
    is_float = x.dtype.kind == "f"
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
