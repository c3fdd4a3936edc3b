"""The workspace limit, chunking of the batch, and the counted buffers every kernel uses.

A kernel of :mod:`framework.ops.conv_algorithms` processes the batch in chunks of whole
images, as many per chunk as keep its batch-sized workspace within the **workspace
limit** (at least one image per chunk even when one image alone needs more). Its
workspaces are then chunk-sized, never batch-sized, and allocated once per call and
reused by every chunk. The default limit, ``"auto"``, is half the input's bytes, at most
4 MiB (like cuDNN's workspace limits): a workspace then never outweighs the activations
around it, so what a training step's peak shows is activations, which is what inplace
changes. ``None`` removes the bound (the whole batch in one chunk).

Every buffer here is allocated through :mod:`framework.memory` (category ``workspace``
unless said otherwise), so the memory counter sees it.
"""

from __future__ import annotations

import contextlib

from ... import memory
from ...backend import get_array_module, reshape_view

AUTO_WORKSPACE_CAP = 4 * 2**20
DEFAULT_WORKSPACE_LIMIT = "auto"
_limit: list = [DEFAULT_WORKSPACE_LIMIT]


def get_workspace_limit() -> int | str | None:
    """Bytes of batch-sized workspace conv2d and pooling may hold at once (None: no bound;
    ``"auto"``: half the op's input bytes, at most 4 MiB)."""
    return _limit[-1]


def resolve_limit(limit, input) -> int | None:
    """The byte limit for one call: ``"auto"`` resolved against this call's input."""
    if limit == "auto":
        return min(AUTO_WORKSPACE_CAP, input._data.nbytes // 2)
    return limit


def set_workspace_limit(nbytes: int | str | None) -> None:
    """Bounds the workspace of conv2d and pooling to ``nbytes`` (None: no bound; ``"auto"``:
    half the input's bytes, at most 4 MiB; the default).

    The batch is processed in chunks of as many whole images as fit in ``nbytes`` (at
    least one, even when one image needs more). 0 means one image per chunk. See
    :mod:`framework.ops.conv` for exactly what the bound covers.

    Raises:
        TypeError: ``nbytes`` is not an int or None.
        ValueError: ``nbytes`` is negative.
    """
    _limit[0] = _check_limit(nbytes)


@contextlib.contextmanager
def workspace_limit(nbytes: int | None):
    """``with workspace_limit(2**20): ...``: conv2d and pooling calls inside use that limit."""
    _limit.append(_check_limit(nbytes))
    try:
        yield
    finally:
        _limit.pop()


def _check_limit(nbytes):
    if nbytes is None or nbytes == "auto":
        return nbytes
    if isinstance(nbytes, bool) or not hasattr(nbytes, "__index__"):
        raise TypeError(f"workspace limit must be an int number of bytes, 'auto' or None, got {nbytes!r}")
    nbytes = int(nbytes)
    if nbytes < 0:
        raise ValueError(f"workspace limit must be >= 0 bytes, got {nbytes}")
    return nbytes


def chunks(n: int, per_image: int, limit) -> list[slice]:
    """Slices of a batch of ``n``: as few chunks as keep ``per_image`` bytes per image within
    ``limit`` (at least one image each), their sizes as equal as possible."""
    if n <= 0:
        return []
    step = n if limit is None or per_image <= 0 else max(1, min(n, limit // per_image))
    count = -(-n // step)
    step = -(-n // count)
    return [slice(s, min(s + step, n)) for s in range(0, n, step)]


class ChunkSum:
    """The sum of one product per chunk, the way every weight gradient here is made.

    The first chunk's product is written into the sum's buffer itself; each later one
    into one counted ``partial`` buffer of its shape (allocated at the second chunk,
    reused after) and added::

        acc = ChunkSum(gw, xp)
        for sl in parts:
            xp.matmul(a, b, out=acc.out())
            acc.add()
        gw = acc.finish()

    ``transposed``: the products are ``result.T``'s, ``(k, Co)`` for a ``(Co, k)`` weight
    gradient (the orientation BLAS runs faster, see :mod:`.grid`). The sum then builds in
    one counted ``(k, Co)`` buffer, ``result``'s own buffer (viewed ``(k, Co)``) holds the
    later chunks' products, and :meth:`finish` copies the sum over it: one weight-sized
    workspace buffer either way.
    """

    def __init__(self, result, xp, transposed=False):
        self.result, self.xp, self.transposed = result, xp, transposed
        if transposed:
            shape = result.shape[::-1]
            self.total = memory.empty(shape, result.dtype, xp, "workspace")
            self.partial = reshaped(result, shape)
        else:
            self.total, self.partial = result, None
        self._first = True

    def out(self):
        """Where the next chunk's product goes."""
        if self._first:
            return self.total
        if self.partial is None:
            self.partial = memory.empty(self.total.shape, self.total.dtype, self.xp, "workspace")
        return self.partial

    def add(self) -> None:
        """Adds the product just written (the first one is already in the sum)."""
        if self._first:
            self._first = False
        else:
            self.total += self.partial

    def finish(self):
        """The sum, in ``result``."""
        if self.transposed:
            self.xp.copyto(self.result, self.total.T)
        return self.result


# --- counted buffers and window views -------------------------------------------------------


def padded_image_bytes(x_shape, padding, itemsize):
    """Bytes :func:`pad` allocates per image (0 without padding: it returns the input)."""
    if padding == (0, 0):
        return 0
    return x_shape[1] * (x_shape[2] + 2 * padding[0]) * (x_shape[3] + 2 * padding[1]) * itemsize


def pad(x, padding, value, xp, category="workspace"):
    """``x`` padded by ``value`` in a counted buffer (``x`` itself when there is no padding)."""
    ph, pw = padding
    if ph == 0 and pw == 0:
        return x
    n, c, h, w = x.shape
    buf = memory.empty((n, c, h + 2 * ph, w + 2 * pw), x.dtype, xp, category)
    # Fill only the border: the interior is overwritten by x right after.
    if ph:
        buf[:, :, :ph] = value
        buf[:, :, -ph:] = value
    if pw:
        buf[:, :, ph : -ph or None, :pw] = value
        buf[:, :, ph : -ph or None, -pw:] = value
    buf[:, :, ph : ph + h, pw : pw + w] = x
    return buf


def windows(xpad, kernel, stride, out_hw):
    """The ``(N, C, kh, kw, Ho, Wo)`` view of every window of ``xpad`` (no copy)."""
    xp = get_array_module(xpad)
    sn, sc, sh, sw = xpad.strides
    n, c = xpad.shape[:2]
    return xp.lib.stride_tricks.as_strided(
        xpad,
        shape=(n, c, kernel[0], kernel[1], out_hw[0], out_hw[1]),
        strides=(sn, sc, sh, sw, sh * stride[0], sw * stride[1]),
    )


def offset(i, j, stride, out_hw):
    """The (rows, cols) slices of the padded input that kernel offset (i, j) touches."""
    return (
        slice(None),
        slice(None),
        slice(i, i + stride[0] * (out_hw[0] - 1) + 1, stride[0]),
        slice(j, j + stride[1] * (out_hw[1] - 1) + 1, stride[1]),
    )


def reach_1d(i, pad, stride, out_len, in_len):
    """(output slice, input slice): the outputs whose kernel offset ``i`` falls inside the
    unpadded input, and the input positions they touch; None when there are none.
    (Output ``r`` reads input ``stride*r + i - pad``: the same map places the input in
    phase ``i`` of a strided padded image, :mod:`.grid`.)"""
    lo = max(0, -((i - pad) // stride))  # first r with i - pad + stride*r >= 0
    hi = min(out_len - 1, (in_len - 1 - i + pad) // stride)  # last r with it <= in_len - 1
    if hi < lo:
        return None
    start = i - pad + stride * lo
    return slice(lo, hi + 1), slice(start, start + stride * (hi - lo) + 1, stride)


def reaches(kernel, stride, padding, out_hw, in_hw):
    """For each kernel offset ``k = i*kw + j`` reaching the unpadded input:
    ``(k, output index, input index)``, for a scatter-add without a padded buffer."""
    out = []
    for i in range(kernel[0]):
        rows = reach_1d(i, padding[0], stride[0], out_hw[0], in_hw[0])
        if rows is None:
            continue
        for j in range(kernel[1]):
            cols = reach_1d(j, padding[1], stride[1], out_hw[1], in_hw[1])
            if cols is None:
                continue
            out.append((i * kernel[1] + j, (Ellipsis, rows[0], cols[0]), (Ellipsis, rows[1], cols[1])))
    return out


def contiguous(a, xp):
    """``a`` itself when C-contiguous, else a counted contiguous copy (BLAS needs strides)."""
    if a.flags.c_contiguous:
        return a
    out = memory.empty(a.shape, a.dtype, xp, "workspace")
    xp.copyto(out, a)
    return out


def reshaped(array, shape):
    """``array`` reshaped WITHOUT a copy; the callers' layouts always allow one, so failing
    is a bug (an AssertionError), never a silent (uncounted) copy."""
    out = reshape_view(array, shape)
    if out is None:  # pragma: no cover - a bug in a caller's layout, not a user error
        raise AssertionError(f"cannot view {array.shape} {array.strides} as {shape} without a copy")
    return out


def strided(xp, array, shape, strides):
    """``as_strided`` with ``strides`` counted in elements (a view; no copy)."""
    isz = array.itemsize
    return xp.lib.stride_tricks.as_strided(array, shape=shape, strides=tuple(s * isz for s in strides))
