"""2-D convolution and pooling on NCHW arrays: ``conv2d``, ``max_pool2d``, ``avg_pool2d``,
``adaptive_avg_pool2d``.

How conv2d computes (the same code runs on NumPy and CuPy):

* the batch is cut into chunks of whole images, as many per chunk as fit in the
  **workspace limit** (:func:`set_workspace_limit`; at least one image per chunk even
  when one image alone needs more). Every step below runs chunk by chunk, so its
  workspaces are chunk-sized, never batch-sized. The default, ``"auto"``, is half the
  input's bytes, at most 4 MiB (like cuDNN's workspace limits): a workspace then never
  outweighs the activations around it, so what a step's peak shows is activations, which
  is what inplace changes. (With a fixed 4 MiB, ResNet-20 at batch 32 peaked inside a
  conv's workspace under both inplace policies alike.)
* forward: a chunk is padded into a workspace buffer, ``as_strided`` gives a
  ``(n, C, kh, kw, Ho, Wo)`` window view of it without copying, the view is copied once
  into an im2col workspace ``cols`` and ONE matrix product with the weight writes the
  chunk's slice of the output. Which product is the ``contraction`` (see
  :data:`CONTRACTIONS`); ``benchmarks/bench_conv.py`` measures them.
* backward: ``grad_weight`` rebuilds ``cols`` chunk by chunk from the saved input (rather
  than keeping a 9x larger buffer alive between forward and backward) and accumulates
  ``gw += g_chunk @ cols_chunk.T``; ``grad_input`` is a col2im fused with the product:
  for each chunk and each of the kh*kw kernel offsets one matrix product
  ``w[:, :, i, j].T @ g_chunk`` into one reused ``(n, C, Ho, Wo)`` workspace, added into
  the part of the input gradient that offset reaches (clipped at the borders, so the
  gradient is allocated at the input's exact shape: no padded buffer stays alive behind
  it). Python loops run over chunks and kernel offsets, never over pixels or channels.
* saved for backward: ``x`` only when the weight needs a gradient, ``w`` only when the
  input does; nothing else (the bias gradient needs only the output gradient).

What the workspace limit bounds: the sum of conv2d's live ``workspace`` buffers that grow
with the batch (the padded chunk, ``cols``, the GEMM output before its transpose to NCHW,
the transposed or contiguous output-gradient chunk, the per-offset col2im buffer). On top
of it come at most one weight-sized buffer (a transposed copy of the weight for the input
gradient, the partial weight gradient of a chunk, or a contiguous copy of a strided
weight): ``workspace peak <= max(limit, one image's workspace) + weight bytes``. Outputs
and gradients are not workspace: the output (``activations``) and the input and weight
gradients (``gradients``) are allocated once, at their exact shapes. The limit in effect
when conv2d is called applies to its backward as well (it is recorded with the node, like
the contraction). ``set_workspace_limit(None)`` removes the bound (the whole batch in one
chunk).

Every padding buffer, im2col buffer and temporary goes through :mod:`framework.memory`
(category ``workspace``), so the counter sees them. The ``tensordot`` and ``einsum``
contractions are kept for comparison: they work on the window view directly and let the
array module make its own (uncounted) copies, which is one reason they are not the default;
the chunking bounds those copies as well (their chunk size is reckoned as if they built
``cols``), though the counter cannot see them.

Pooling is chunked by the same limit where it needs workspace that grows with the batch:
max pooling's comparison masks and ``-inf`` padded input in forward, its mask and masked
gradient in backward, average pooling's zero-padded input. Their gradients are likewise
allocated at the input's exact shape. Max pooling saves the argmax of each window as a
window offset in the smallest unsigned dtype that holds ``kh*kw`` offsets (``uint8`` for
every usual kernel): one byte per output element, instead of the whole input (4 bytes per
input element for float32, 16x more for a 2x2 pool). It is a private array, so an inplace
op on the pooled input after the pool (a later ``relu_``) costs nothing and cannot break
its backward.
"""

from __future__ import annotations

import contextlib
import math

from .. import memory
from ..autograd.function import Function
from ..backend import get_array_module

CONTRACTIONS = ("batched", "gemm", "tensordot", "einsum")
# Fastest of CONTRACTIONS forward+backward in benchmarks/bench_conv.py (CPU, one thread,
# batch 128, under the default workspace limit), tied with "batched" within the noise.
_default = ["gemm"]


def get_contraction() -> str:
    """The contraction conv2d uses now (one of :data:`CONTRACTIONS`)."""
    return _default[-1]


def set_contraction(name: str) -> None:
    """Makes ``name`` (one of :data:`CONTRACTIONS`) the contraction conv2d uses."""
    _default[0] = _check_contraction(name)


@contextlib.contextmanager
def contraction(name: str):
    """``with contraction("gemm"): ...``: conv2d calls inside use that contraction."""
    _default.append(_check_contraction(name))
    try:
        yield
    finally:
        _default.pop()


def _check_contraction(name):
    if name not in CONTRACTIONS:
        raise ValueError(f"unknown conv2d contraction {name!r}; use one of {', '.join(CONTRACTIONS)}")
    return name


# --- workspace limit ----------------------------------------------------------------------

AUTO_WORKSPACE_CAP = 4 * 2**20
DEFAULT_WORKSPACE_LIMIT = "auto"
_limit: list = [DEFAULT_WORKSPACE_LIMIT]


def get_workspace_limit() -> int | str | None:
    """Bytes of batch-sized workspace conv2d and pooling may hold at once (None: no bound;
    ``"auto"``: half the op's input bytes, at most 4 MiB)."""
    return _limit[-1]


def _resolve_limit(limit, input) -> int | None:
    """The byte limit for one call: ``"auto"`` resolved against this call's input."""
    if limit == "auto":
        return min(AUTO_WORKSPACE_CAP, input._data.nbytes // 2)
    return limit


def set_workspace_limit(nbytes: int | str | None) -> None:
    """Bounds the workspace of conv2d and pooling to ``nbytes`` (None: no bound; ``"auto"``:
    half the input's bytes, at most 4 MiB; the default).

    The batch is processed in chunks of as many whole images as fit in ``nbytes`` (at
    least one, even when one image needs more). 0 means one image per chunk. See the
    module docstring for exactly what the bound covers.

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


def _chunks(n: int, per_image: int, limit) -> list[slice]:
    """Slices of a batch of ``n``: as few chunks as keep ``per_image`` bytes per image within
    ``limit`` (at least one image each), their sizes as equal as possible."""
    if n <= 0:
        return []
    step = n if limit is None or per_image <= 0 else max(1, min(n, limit // per_image))
    count = -(-n // step)
    step = -(-n // count)
    return [slice(s, min(s + step, n)) for s in range(0, n, step)]


# --- argument and geometry helpers ------------------------------------------------------

def _pair(value, name: str, fn: str, minimum: int) -> tuple[int, int]:
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{fn}: {name} must be an int or a pair of ints, got {value!r}")
        pair = tuple(value)
    else:
        pair = (value, value)
    for v in pair:
        if isinstance(v, bool) or not isinstance(v, int) and not hasattr(v, "__index__"):
            raise TypeError(f"{fn}: {name} must be an int or a pair of ints, got {value!r}")
    pair = (int(pair[0]), int(pair[1]))
    if min(pair) < minimum:
        raise ValueError(f"{fn}: {name} must be >= {minimum}, got {value!r}")
    return pair


def _out_size(fn, hw, kernel, stride, padding):
    """Output (Ho, Wo); raises when the kernel does not fit in the padded input."""
    ph, pw = hw[0] + 2 * padding[0], hw[1] + 2 * padding[1]
    if kernel[0] > ph or kernel[1] > pw:
        raise RuntimeError(
            f"{fn}: calculated padded input size per channel: ({ph} x {pw}). Kernel size: "
            f"({kernel[0]} x {kernel[1]}). Kernel size can't be greater than actual input size; "
            "use a smaller kernel, more padding, or a larger input"
        )
    return (ph - kernel[0]) // stride[0] + 1, (pw - kernel[1]) // stride[1] + 1


def _check_4d(fn, x, what="input"):
    if x.ndim != 4:
        raise RuntimeError(f"{fn}: expected a 4-D {what} (N, C, H, W), got shape {tuple(x.shape)}")


def _padded_image_bytes(x_shape, padding, itemsize):
    """Bytes :func:`_pad` allocates per image (0 without padding: it returns the input)."""
    if padding == (0, 0):
        return 0
    return x_shape[1] * (x_shape[2] + 2 * padding[0]) * (x_shape[3] + 2 * padding[1]) * itemsize


def _pad(x, padding, value, xp, category="workspace"):
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
        buf[:, :, ph:-ph or None, :pw] = value
        buf[:, :, ph:-ph or None, -pw:] = value
    buf[:, :, ph : ph + h, pw : pw + w] = x
    return buf


def _windows(xpad, kernel, stride, out_hw):
    """The ``(N, C, kh, kw, Ho, Wo)`` view of every window of ``xpad`` (no copy)."""
    xp = get_array_module(xpad)
    sn, sc, sh, sw = xpad.strides
    n, c = xpad.shape[:2]
    return xp.lib.stride_tricks.as_strided(
        xpad,
        shape=(n, c, kernel[0], kernel[1], out_hw[0], out_hw[1]),
        strides=(sn, sc, sh, sw, sh * stride[0], sw * stride[1]),
    )


def _offset(i, j, stride, out_hw):
    """The (rows, cols) slices of the padded input that kernel offset (i, j) touches."""
    return (
        slice(None),
        slice(None),
        slice(i, i + stride[0] * (out_hw[0] - 1) + 1, stride[0]),
        slice(j, j + stride[1] * (out_hw[1] - 1) + 1, stride[1]),
    )


def _reach_1d(i, pad, stride, out_len, in_len):
    """(output slice, input slice): the outputs whose kernel offset ``i`` falls inside the
    unpadded input, and the input positions they touch; None when there are none."""
    lo = max(0, -((i - pad) // stride))  # first r with i - pad + stride*r >= 0
    hi = min(out_len - 1, (in_len - 1 - i + pad) // stride)  # last r with it <= in_len - 1
    if hi < lo:
        return None
    start = i - pad + stride * lo
    return slice(lo, hi + 1), slice(start, start + stride * (hi - lo) + 1, stride)


def _reaches(kernel, stride, padding, out_hw, in_hw):
    """For each kernel offset ``k = i*kw + j`` reaching the unpadded input:
    ``(k, output index, input index)``, for :func:`_scatter_add` without a padded buffer."""
    out = []
    for i in range(kernel[0]):
        rows = _reach_1d(i, padding[0], stride[0], out_hw[0], in_hw[0])
        if rows is None:
            continue
        for j in range(kernel[1]):
            cols = _reach_1d(j, padding[1], stride[1], out_hw[1], in_hw[1])
            if cols is None:
                continue
            out.append((i * kernel[1] + j, (Ellipsis, rows[0], cols[0]), (Ellipsis, rows[1], cols[1])))
    return out


def _contiguous(a, xp):
    """``a`` itself when C-contiguous, else a counted contiguous copy (BLAS needs strides)."""
    if a.flags.c_contiguous:
        return a
    out = memory.empty(a.shape, a.dtype, xp, "workspace")
    xp.copyto(out, a)
    return out


# --- conv2d contractions ------------------------------------------------------------------
# Each works on one chunk of the batch:
#   forward(view, w2, out, xp): view (n, C, kh, kw, Ho, Wo) windows, w2 (Co, C*kh*kw)
#       contiguous; writes the chunk's output into ``out`` (n, Co, Ho, Wo), contiguous.
#   grad_weight(g, view, out, xp): writes sum over the chunk of g (x) windows into ``out``
#       (Co, C*kh*kw), contiguous.
#   prep_input(g, xp) -> the chunk's output gradient as grad_input_offset wants it;
#   grad_input_offset(gp, wt_ij (C, Co), tmp (n, C, Ho, Wo), xp) -> (n, C, Ho, Wo).
#   *_bytes(k, c, co, p, itemsize, g_strided): counted (or, for tensordot / einsum, hidden)
#       workspace per image of each step, padding excluded; k = C*kh*kw, p = Ho*Wo.

class _Batched:
    """cols ``(n, C*kh*kw, Ho*Wo)``; ``matmul(w2, cols)`` batched over n gives NCHW directly."""

    @staticmethod
    def forward_bytes(k, c, co, p, isz, g_strided):
        return k * p * isz

    @staticmethod
    def grad_weight_bytes(k, c, co, p, isz, g_strided):
        return (k * p + co * k + (co * p if g_strided else 0)) * isz

    @staticmethod
    def grad_input_bytes(k, c, co, p, isz, g_strided):
        return (c * p + (co * p if g_strided else 0)) * isz

    @staticmethod
    def cols(view, xp):
        cols = memory.empty(view.shape, view.dtype, xp, "workspace")
        xp.copyto(cols, view)
        n, c, kh, kw, ho, wo = view.shape
        return cols.reshape(n, c * kh * kw, ho * wo)

    @classmethod
    def forward(cls, view, w2, out, xp):
        n, co = out.shape[:2]
        xp.matmul(w2, cls.cols(view, xp), out=out.reshape(n, co, -1))

    @staticmethod
    def prep_input(g, xp):
        n, co, ho, wo = g.shape
        return _contiguous(g, xp).reshape(n, co, ho * wo)

    @classmethod
    def grad_weight(cls, g, view, out, xp):
        g3 = cls.prep_input(g, xp)
        cols = cls.cols(view, xp)
        n, co, k = g3.shape[0], g3.shape[1], cols.shape[1]
        per_image = memory.empty((n, co, k), g3.dtype, xp, "workspace")
        xp.matmul(g3, cols.transpose(0, 2, 1), out=per_image)
        del cols
        per_image.sum(axis=0, out=out)

    @staticmethod
    def grad_input_offset(g3, wt_ij, tmp, xp):
        n, c = g3.shape[0], wt_ij.shape[0]
        xp.matmul(wt_ij, g3, out=tmp.reshape(n, c, -1))
        return tmp


class _Gemm:
    """cols ``(C*kh*kw, n*Ho*Wo)``: one large GEMM per chunk, then a transpose to NCHW
    (none for a chunk of one image: the product is then that image's NCHW output)."""

    @staticmethod
    def forward_bytes(k, c, co, p, isz, g_strided):
        return (k + co) * p * isz

    @staticmethod
    def grad_weight_bytes(k, c, co, p, isz, g_strided):
        return (k + co) * p * isz

    grad_input_bytes = _Batched.grad_input_bytes

    @staticmethod
    def cols(view, xp):
        n, c, kh, kw, ho, wo = view.shape
        cols = memory.empty((c, kh, kw, n, ho, wo), view.dtype, xp, "workspace")
        xp.copyto(cols, view.transpose(1, 2, 3, 0, 4, 5))
        return cols.reshape(c * kh * kw, n * ho * wo)

    @classmethod
    def forward(cls, view, w2, out, xp):
        n, co, ho, wo = out.shape
        cols = cls.cols(view, xp)
        if n == 1:
            xp.matmul(w2, cols, out=out.reshape(co, ho * wo))
            return
        flat = memory.empty((co, n * ho * wo), w2.dtype, xp, "workspace")
        xp.matmul(w2, cols, out=flat)
        del cols
        xp.copyto(out, flat.reshape(co, n, ho, wo).transpose(1, 0, 2, 3))

    @classmethod
    def grad_weight(cls, g, view, out, xp):
        n, co, ho, wo = g.shape
        if n == 1 and g.flags.c_contiguous:
            gt = g.reshape(co, ho * wo)
        else:
            gt = memory.empty((co, n, ho, wo), g.dtype, xp, "workspace")
            xp.copyto(gt, g.transpose(1, 0, 2, 3))
            gt = gt.reshape(co, n * ho * wo)
        xp.matmul(gt, cls.cols(view, xp).T, out=out)

    # grad input: the per-offset products batched over n, as in _Batched. Measured: a
    # (C, n*Ho*Wo) product per offset needs a transposed slice-add that costs more than
    # the one large GEMM saves.
    prep_input = _Batched.prep_input
    grad_input_offset = _Batched.grad_input_offset


class _Tensordot:
    """``tensordot`` on the window view (the array module copies it internally)."""

    forward_bytes = grad_weight_bytes = _Gemm.forward_bytes  # the copies it makes, unseen
    grad_input_bytes = _Batched.grad_input_bytes

    @staticmethod
    def forward(view, w2, out, xp):
        co = w2.shape[0]
        t = xp.tensordot(w2.reshape((co,) + view.shape[1:4]), view, axes=([1, 2, 3], [1, 2, 3]))
        xp.copyto(out, t.transpose(1, 0, 2, 3))  # t: (Co, n, Ho, Wo)

    @staticmethod
    def prep_input(g, xp):
        return g

    @staticmethod
    def grad_weight(g, view, out, xp):
        t = xp.tensordot(g, view, axes=([0, 2, 3], [0, 4, 5]))  # (Co, C, kh, kw)
        xp.copyto(out, t.reshape(out.shape))

    @staticmethod
    def grad_input_offset(g, wt_ij, tmp, xp):
        return xp.tensordot(wt_ij, g, axes=([1], [1])).transpose(1, 0, 2, 3)


class _Einsum:
    """``einsum(..., optimize=True)`` on the window view."""

    forward_bytes = grad_weight_bytes = _Gemm.forward_bytes
    grad_input_bytes = _Batched.grad_input_bytes

    @staticmethod
    def forward(view, w2, out, xp):
        w = w2.reshape((w2.shape[0],) + view.shape[1:4])
        xp.copyto(out, xp.einsum("ocij,ncijhw->nohw", w, view, optimize=True))

    @staticmethod
    def prep_input(g, xp):
        return g

    @staticmethod
    def grad_weight(g, view, out, xp):
        t = xp.einsum("nohw,ncijhw->ocij", g, view, optimize=True)
        xp.copyto(out, t.reshape(out.shape))

    @staticmethod
    def grad_input_offset(g, wt_ij, tmp, xp):
        return xp.einsum("co,nohw->nchw", wt_ij, g, optimize=True)


_IMPLS = {"batched": _Batched, "gemm": _Gemm, "tensordot": _Tensordot, "einsum": _Einsum}


class Conv2d(Function):
    """2-D cross-correlation (PyTorch's conv2d) of NCHW ``x`` with ``w`` (Co, C, kh, kw)."""

    saves = ("x", "w")
    saved_when = {"x": (1,), "w": (0,)}  # x only for w's gradient, w only for x's

    def forward(ctx, x, w, b=None, stride=(1, 1), padding=(0, 0), contraction="batched", limit=None):
        fn = "conv2d"
        _check_4d(fn, x)
        if w.ndim != 4:
            raise RuntimeError(f"{fn}: expected a 4-D weight (C_out, C_in, kh, kw), got shape {tuple(w.shape)}")
        if x.shape[1] != w.shape[1]:
            raise RuntimeError(
                f"{fn}: input has {x.shape[1]} channels (shape {tuple(x.shape)}) but the weight "
                f"{tuple(w.shape)} expects {w.shape[1]} input channels; check C_in of the layer"
            )
        if x.dtype != w.dtype or x.dtype.kind != "f":
            raise TypeError(
                f"{fn}: input ({x.dtype}) and weight ({w.dtype}) must have the same floating dtype"
            )
        if b is not None and (b.shape != (w.shape[0],) or b.dtype != w.dtype):
            raise RuntimeError(
                f"{fn}: bias must be a {w.dtype} vector of shape ({w.shape[0]},), got "
                f"{b.dtype} {tuple(b.shape)}"
            )
        xp = get_array_module(x)
        out_hw = _out_size(fn, x.shape[2:], w.shape[2:], stride, padding)
        ctx.geom = (x.shape, w.shape, stride, padding, out_hw, limit)
        ctx.impl = impl = _IMPLS[contraction]
        n, co, kernel = x.shape[0], w.shape[0], w.shape[2:]
        out = memory.empty((n, co) + out_hw, w.dtype, xp, "activations")
        w2 = _contiguous(w, xp).reshape(co, -1)
        per_image = _padded_image_bytes(x.shape, padding, x.itemsize) + impl.forward_bytes(
            *_dims(x.shape, w.shape, out_hw, x.itemsize), False
        )
        for sl in _chunks(n, per_image, limit):
            xpad = _pad(x[sl], padding, 0, xp)
            impl.forward(_windows(xpad, kernel, stride, out_hw), w2, out[sl], xp)
            del xpad
        if b is not None:
            out += b.reshape(1, -1, 1, 1)
        return out

    def backward(ctx, g):
        xp = get_array_module(g)
        x_shape, w_shape, stride, padding, out_hw, limit = ctx.geom
        impl = ctx.impl
        need_x, need_w, need_b = ctx.needs_input_grad
        gx = gw = gb = None
        if need_b:
            gb = g.sum(axis=(0, 2, 3))
        if not (need_x or need_w):
            return gx, gw, gb
        n, c, h, wd = x_shape
        co, kernel = w_shape[0], w_shape[2:]
        dims = _dims(x_shape, w_shape, out_hw, g.itemsize)
        g_strided = not g.flags.c_contiguous
        if need_w:
            x = ctx.x
            per_image = _padded_image_bytes(x_shape, padding, g.itemsize) + impl.grad_weight_bytes(*dims, g_strided)
            make = memory.empty if n else memory.zeros  # the first chunk writes all of gw
            gw = make((co, c * kernel[0] * kernel[1]), g.dtype, xp, "gradients")
            part = None
            for sl in _chunks(n, per_image, limit):
                xpad = _pad(x[sl], padding, 0, xp)
                view = _windows(xpad, kernel, stride, out_hw)
                if sl.start == 0:
                    impl.grad_weight(g[sl], view, gw, xp)
                else:
                    if part is None:
                        part = memory.empty(gw.shape, gw.dtype, xp, "workspace")
                    impl.grad_weight(g[sl], view, part, xp)
                    gw += part
                del view, xpad
            del part
            gw = gw.reshape(w_shape)
        if need_x:
            w = ctx.w
            # (kh, kw, C, Co): wt[i, j] = w[:, :, i, j].T, contiguous for the products
            wt = memory.empty((kernel[0], kernel[1], c, co), w.dtype, xp, "workspace")
            xp.copyto(wt, w.transpose(2, 3, 1, 0))
            # A policy site: under 'on', when the engine proved g dead and g has the input's
            # shape (stride-1 convs that keep the channel count: most of a ResNet), each
            # image's input gradient depends only on that image's output gradient. It is
            # built chunk by chunk in a chunk-sized workspace and written back over the
            # chunk of g it came from (the weight and bias gradients are done by then), so
            # no second activation-sized gradient exists at this step's peak.
            overwrite = ctx.reuse_grad and g.shape == tuple(x_shape) and g.flags.c_contiguous
            reaches = _reaches(kernel, stride, padding, out_hw, (h, wd))
            per_image = impl.grad_input_bytes(*dims, g_strided)
            chunks = _chunks(n, per_image, limit)
            tmp = memory.empty((chunks[0].stop,) + (c,) + out_hw, g.dtype, xp, "workspace") if chunks else None
            if overwrite:
                gx = g
                acc = memory.empty((chunks[0].stop,) + tuple(x_shape[1:]), g.dtype, xp, "workspace") if chunks else None
            else:
                gx = memory.zeros(x_shape, g.dtype, xp, "gradients")
            for sl in chunks:
                gp = impl.prep_input(g[sl], xp)
                t = tmp[: sl.stop - sl.start]
                if overwrite:
                    gxs = acc[: sl.stop - sl.start]
                    gxs.fill(0)
                else:
                    gxs = gx[sl]
                for k, src, dst in reaches:
                    gxs[dst] += impl.grad_input_offset(gp, wt[k // kernel[1], k % kernel[1]], t, xp)[src]
                del gp
                if overwrite:
                    g[sl] = gxs  # this chunk of g is read by nothing after this point
        return gx, gw, gb


def _dims(x_shape, w_shape, out_hw, itemsize):
    """(k, c, co, p, itemsize) of the per-image workspace formulas of the contractions."""
    c, co = x_shape[1], w_shape[0]
    return c * w_shape[2] * w_shape[3], c, co, out_hw[0] * out_hw[1], itemsize


def conv2d(input, weight, bias=None, stride=1, padding=0):  # noqa: A002  (PyTorch's names)
    """2-D convolution (cross-correlation, as PyTorch's ``conv2d``) over NCHW input.

    Args:
        input: ``(N, C_in, H, W)`` float tensor.
        weight: ``(C_out, C_in, kh, kw)`` tensor of the same dtype.
        bias: optional ``(C_out,)`` tensor.
        stride: int or (sh, sw), >= 1.
        padding: int or (ph, pw) zeros on each side, >= 0.

    Returns:
        ``(N, C_out, Ho, Wo)`` with ``Ho = (H + 2 ph - kh) // sh + 1`` (same for W).

    The batch is processed in chunks that keep the workspace within
    :func:`get_workspace_limit` (forward and this call's backward).
    """
    stride = _pair(stride, "stride", "conv2d", 1)
    padding = _pair(padding, "padding", "conv2d", 0)
    return Conv2d.apply(
        input, weight, bias, stride=stride, padding=padding, contraction=get_contraction(),
        limit=_resolve_limit(get_workspace_limit(), input),
    )


# --- pooling ----------------------------------------------------------------------------------

def _pool_args(fn, kernel_size, stride, padding):
    kernel = _pair(kernel_size, "kernel_size", fn, 1)
    stride = kernel if stride is None or stride == () or stride == [] else _pair(stride, "stride", fn, 1)
    padding = _pair(padding, "padding", fn, 0)
    if padding[0] > kernel[0] // 2 or padding[1] > kernel[1] // 2:
        raise ValueError(f"{fn}: pad should be at most half of kernel size, but got pad={padding} and kernel_size={kernel}")
    return kernel, stride, padding


def _index_dtype(xp, n_offsets):
    for dt in (xp.uint8, xp.uint16, xp.uint32):
        if n_offsets <= xp.iinfo(dt).max + 1:
            return dt
    return xp.int64


class MaxPool2d(Function):
    """Max over each window; saves the window offset of each max (one byte per output)."""

    def forward(ctx, x, kernel=(2, 2), stride=(2, 2), padding=(0, 0), limit=None):
        fn = "max_pool2d"
        _check_4d(fn, x)
        xp = get_array_module(x)
        out_hw = _out_size(fn, x.shape[2:], kernel, stride, padding)
        ctx.geom = (x.shape, kernel, stride, padding, out_hw, limit)
        low = -xp.inf if x.dtype.kind == "f" else (xp.iinfo(x.dtype).min if x.dtype.kind in "iu" else False)
        shape = x.shape[:2] + out_hw
        out = memory.empty(shape, x.dtype, xp, "activations")
        track_index = any(ctx.needs_input_grad)
        idx = memory.zeros(shape, _index_dtype(xp, kernel[0] * kernel[1]), xp, "activations") if track_index else None
        is_float = x.dtype.kind == "f"
        per_out = math.prod(shape[1:])
        per_image = _padded_image_bytes(x.shape, padding, x.itemsize) + per_out * (2 if is_float else 1)
        chunks = _chunks(x.shape[0], per_image, limit)
        rows = chunks[0].stop if chunks else 0
        better = memory.empty((rows,) + shape[1:], bool, xp, "workspace")
        nan = memory.empty((rows,) + shape[1:], bool, xp, "workspace") if is_float else None
        for sl in chunks:
            m = sl.stop - sl.start
            xpad = _pad(x[sl], padding, low, xp)
            o, bt = out[sl], better[:m]
            ix = idx[sl] if track_index else None
            nn = nan[:m] if nan is not None else None
            for k in range(kernel[0] * kernel[1]):
                v = xpad[_offset(k // kernel[1], k % kernel[1], stride, out_hw)]
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
        if track_index:
            ctx.keep(indices=idx)
        return out

    def backward(ctx, g):
        xp = get_array_module(g)
        x_shape, kernel, stride, padding, out_hw, limit = ctx.geom
        idx = ctx.indices
        gx = memory.zeros(x_shape, g.dtype, xp, "gradients")
        reaches = _reaches(kernel, stride, padding, out_hw, x_shape[2:])
        chunks = _chunks(x_shape[0], math.prod(idx.shape[1:]) * (1 + g.itemsize), limit)
        rows = chunks[0].stop if chunks else 0
        hit = memory.empty((rows,) + idx.shape[1:], bool, xp, "workspace")
        tmp = memory.empty((rows,) + idx.shape[1:], g.dtype, xp, "workspace")
        for sl in chunks:
            m = sl.stop - sl.start
            ix, gs, gxs, h, t = idx[sl], g[sl], gx[sl], hit[:m], tmp[:m]
            for k, src, dst in reaches:
                xp.equal(ix, k, out=h)
                xp.multiply(gs, h, out=t)
                gxs[dst] += t[src]
        return gx


class AvgPool2d(Function):
    """Mean over each window, padding zeros included in the count (PyTorch's default)."""

    def forward(ctx, x, kernel=(2, 2), stride=(2, 2), padding=(0, 0), limit=None):
        fn = "avg_pool2d"
        _check_4d(fn, x)
        if x.dtype.kind != "f":
            raise TypeError(f"{fn}: expected a floating input, got {x.dtype}")
        xp = get_array_module(x)
        out_hw = _out_size(fn, x.shape[2:], kernel, stride, padding)
        ctx.geom = (x.shape, kernel, stride, padding, out_hw)
        out = memory.empty(x.shape[:2] + out_hw, x.dtype, xp, "activations")
        for sl in _chunks(x.shape[0], _padded_image_bytes(x.shape, padding, x.itemsize), limit):
            xpad = _pad(x[sl], padding, 0, xp)
            o = out[sl]
            for k in range(kernel[0] * kernel[1]):
                v = xpad[_offset(k // kernel[1], k % kernel[1], stride, out_hw)]
                if k == 0:
                    xp.copyto(o, v)
                else:
                    o += v
            del xpad, v  # v views xpad: the next chunk's padded buffer must not meet this one
        out *= 1.0 / (kernel[0] * kernel[1])
        return out

    def backward(ctx, g):
        # Each output's gradient is shared equally by its window: add g where each kernel
        # offset reaches the input (not the padding), then divide once. No workspace.
        xp = get_array_module(g)
        x_shape, kernel, stride, padding, out_hw = ctx.geom
        gx = memory.zeros(x_shape, g.dtype, xp, "gradients")
        for _, src, dst in _reaches(kernel, stride, padding, out_hw, x_shape[2:]):
            gx[dst] += g[src]
        gx *= 1.0 / (kernel[0] * kernel[1])
        return gx


def _adaptive_matrix(xp, n_in, n_out, dtype):
    """(n_out, n_in): row i averages PyTorch's bin [floor(i n_in / n_out), ceil((i+1) n_in / n_out))."""
    i = xp.arange(n_out)
    start = (i * n_in) // n_out
    end = ((i + 1) * n_in + n_out - 1) // n_out
    pos = xp.arange(n_in)
    inside = (pos[None, :] >= start[:, None]) & (pos[None, :] < end[:, None])
    return (inside / (end - start)[:, None]).astype(dtype)


class AdaptiveAvgPool2dSeparable(Function):
    """Adaptive mean pooling for any sizes: ``Ph @ x @ Pw.T`` (bins overlap when sizes do not divide)."""

    def forward(ctx, x, output_size=(1, 1)):
        xp = get_array_module(x)
        ph = _adaptive_matrix(xp, x.shape[2], output_size[0], x.dtype)
        pw = _adaptive_matrix(xp, x.shape[3], output_size[1], x.dtype)
        ctx.ph, ctx.pw = ph, pw  # tiny (out x in) matrices, not inputs: plain attributes
        rows = xp.matmul(ph, x)  # (N, C, oh, W)
        return xp.matmul(rows, pw.T)

    def backward(ctx, g):
        xp = get_array_module(g)
        return xp.matmul(xp.matmul(ctx.ph.T, g), ctx.pw)


def max_pool2d(input, kernel_size, stride=None, padding=0):  # noqa: A002
    """Max pooling over NCHW input (PyTorch's ``max_pool2d``, ``ceil_mode=False``).

    Args:
        input: ``(N, C, H, W)`` tensor.
        kernel_size: int or (kh, kw).
        stride: int or pair; defaults to ``kernel_size``.
        padding: int or pair of implicit ``-inf`` padding, at most half the kernel.

    Backward routes each output's gradient to the first maximum of its window (NaN counts
    as the maximum). Saves one small index per output, not the input.
    """
    kernel, stride, padding = _pool_args("max_pool2d", kernel_size, stride, padding)
    return MaxPool2d.apply(input, kernel=kernel, stride=stride, padding=padding, limit=_resolve_limit(get_workspace_limit(), input))


def avg_pool2d(input, kernel_size, stride=None, padding=0):  # noqa: A002
    """Average pooling over NCHW input (PyTorch's ``avg_pool2d``: ``count_include_pad=True``).

    Args:
        input: ``(N, C, H, W)`` float tensor.
        kernel_size: int or (kh, kw).
        stride: int or pair; defaults to ``kernel_size``.
        padding: int or pair of implicit zero padding, at most half the kernel; the zeros
            count in each window's mean.
    """
    kernel, stride, padding = _pool_args("avg_pool2d", kernel_size, stride, padding)
    return AvgPool2d.apply(input, kernel=kernel, stride=stride, padding=padding, limit=_resolve_limit(get_workspace_limit(), input))


def adaptive_avg_pool2d(input, output_size):  # noqa: A002
    """Averages NCHW input down to ``output_size`` (int, or (oh, ow) where None keeps that size).

    When the input size is a multiple of the output size this is ``avg_pool2d`` with
    kernel = stride = H // oh (W likewise); otherwise each output averages PyTorch's bin
    ``[floor(i H / oh), ceil((i + 1) H / oh))``, computed as two small matrix products.
    """
    fn = "adaptive_avg_pool2d"
    _check_4d(fn, input)
    if isinstance(output_size, (tuple, list)):
        if len(output_size) != 2:
            raise ValueError(f"{fn}: output_size must be an int or a pair, got {output_size!r}")
        size = tuple(input.shape[2 + k] if s is None else s for k, s in enumerate(output_size))
    else:
        size = (output_size, output_size)
    size = _pair(size, "output_size", fn, 1)
    h, w = input.shape[2:]
    if h == 0 or w == 0:
        raise RuntimeError(f"{fn}: input of shape {tuple(input.shape)} has an empty spatial dimension")
    if h % size[0] == 0 and w % size[1] == 0:
        kernel = (h // size[0], w // size[1])
        return AvgPool2d.apply(input, kernel=kernel, stride=kernel, padding=(0, 0), limit=_resolve_limit(get_workspace_limit(), input))
    if input.dtype.kind != "f":
        raise TypeError(f"{fn}: expected a floating input, got {input.dtype}")
    return AdaptiveAvgPool2dSeparable.apply(input, output_size=size)
