"""im2col convolution for every geometry: a window view, one copy into ``cols``, products.

How it computes (the same code runs on NumPy and CuPy), chunk by chunk (see
:mod:`.workspace`):

* forward: a chunk is padded into a workspace buffer, ``as_strided`` gives a
  ``(n, C, kh, kw, Ho, Wo)`` window view of it without copying, the view is copied once
  into an im2col workspace ``cols`` and ONE matrix product with the weight writes the
  chunk's slice of the output. Which product is the **contraction** (the classes below).
* weight gradient: rebuilds ``cols`` chunk by chunk from the saved input (rather than
  keeping a 9x larger buffer alive between forward and backward) and accumulates
  ``gw += g_chunk @ cols_chunk.T`` (``gemm`` computes its transpose, ``cols_chunk @ g_chunk.T``).
* input gradient: a col2im fused with the product: for each chunk and each of the kh*kw
  kernel offsets one matrix product ``w[:, :, i, j].T @ g_chunk`` into one reused
  ``(n, C, Ho, Wo)`` workspace, added into the part of the input gradient that offset
  reaches (clipped at the borders, so the gradient is allocated at the input's exact
  shape: no padded buffer stays alive behind it). Python loops run over chunks and
  kernel offsets, never over pixels or channels.

What the workspace limit bounds here: the sum of the live ``workspace`` buffers that grow
with the batch (the padded chunk, ``cols``, the GEMM output before its transpose to NCHW,
the transposed or contiguous output-gradient chunk, the per-offset col2im buffer). On top
of it comes at most one weight-sized buffer (a transposed copy of the weight for the input
gradient, the partial weight gradient of a chunk, or a contiguous copy of a strided
weight): ``workspace peak <= max(limit, one image's workspace) + weight bytes``.

The ``tensordot`` and ``einsum`` contractions are kept for comparison: they work on the
window view directly and let the array module make its own (uncounted) copies; the
chunking bounds those copies as well (their chunk size is reckoned as if they built
``cols``), though the counter cannot see them.
"""

from __future__ import annotations

from ... import memory
from .workspace import ChunkSum, chunks, contiguous, pad, padded_image_bytes, reaches, windows

# Each contraction works on one chunk of the batch:
#   forward(view, w2, out, xp): view (n, C, kh, kw, Ho, Wo) windows, w2 (Co, C*kh*kw)
#       contiguous; writes the chunk's output into ``out`` (n, Co, Ho, Wo), contiguous.
#   grad_weight(g, view, out, xp): writes sum over the chunk of g (x) windows into ``out``
#       (Co, C*kh*kw), contiguous; transposed, (C*kh*kw, Co), when the contraction's
#       ``weight_grad_transposed`` is True.
#   prep_input(g, xp) -> the chunk's output gradient as grad_input_offset wants it;
#   grad_input_offset(gp, wt_ij (C, Co), tmp (n, C, Ho, Wo), xp) -> (n, C, Ho, Wo).
#   *_bytes(k, c, co, p, itemsize, g_strided): counted (or, for tensordot / einsum, hidden)
#       workspace per image of each step, padding excluded; k = C*kh*kw, p = Ho*Wo.


class _Batched:
    """cols ``(n, C*kh*kw, Ho*Wo)``; ``matmul(w2, cols)`` batched over n gives NCHW directly."""

    weight_grad_transposed = False

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
        return contiguous(g, xp).reshape(n, co, ho * wo)

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
    (none for a chunk of one image: the product is then that image's NCHW output).

    The weight gradient is made transposed, ``cols @ g.T``: BLAS runs a product with a
    long inner dimension and few rows (Co) up to 2x slower than its transpose (see
    :mod:`.grid`)."""

    weight_grad_transposed = True

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
        xp.matmul(cls.cols(view, xp), gt.T, out=out)

    # grad input: the per-offset products batched over n, as in _Batched. Measured: a
    # (C, n*Ho*Wo) product per offset needs a transposed slice-add that costs more than
    # the one large GEMM saves.
    prep_input = _Batched.prep_input
    grad_input_offset = _Batched.grad_input_offset


class _Tensordot:
    """``tensordot`` on the window view (the array module copies it internally)."""

    weight_grad_transposed = False

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

    weight_grad_transposed = False

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


class Im2col:
    """The im2col algorithm with one of the contractions above; handles every geometry."""

    def __init__(self, name, contraction):
        self.name = name
        self.impl = contraction

    def __repr__(self):
        return f"<conv2d algorithm {self.name!r}>"

    def unsupported(self, geom):
        return None

    def forward(self, x, w, geom, limit, xp):
        impl = self.impl
        n, co = x.shape[0], w.shape[0]
        out = memory.empty((n, co) + geom.out_hw, w.dtype, xp, "activations")
        w2 = contiguous(w, xp).reshape(co, -1)
        per_image = padded_image_bytes(x.shape, geom.padding, x.itemsize) + impl.forward_bytes(
            *geom.dims(x.itemsize), False
        )
        for sl in chunks(n, per_image, limit):
            xpad = pad(x[sl], geom.padding, 0, xp)
            impl.forward(windows(xpad, geom.kernel, geom.stride, geom.out_hw), w2, out[sl], xp)
            del xpad
        return out

    def grad_weight(self, x, g, geom, limit, xp):
        impl = self.impl
        n, c = geom.x_shape[:2]
        co, kernel = geom.w_shape[0], geom.kernel
        g_strided = not g.flags.c_contiguous
        per_image = padded_image_bytes(geom.x_shape, geom.padding, g.itemsize) + impl.grad_weight_bytes(
            *geom.dims(g.itemsize), g_strided
        )
        parts = chunks(n, per_image, limit)
        if not parts:
            return memory.zeros(geom.w_shape, g.dtype, xp, "gradients")
        k = c * kernel[0] * kernel[1]
        gw = memory.empty((co, k), g.dtype, xp, "gradients")  # the first chunk writes all of it
        acc = ChunkSum(gw, xp, transposed=impl.weight_grad_transposed)
        for sl in parts:
            xpad = pad(x[sl], geom.padding, 0, xp)
            view = windows(xpad, kernel, geom.stride, geom.out_hw)
            impl.grad_weight(g[sl], view, acc.out(), xp)
            acc.add()
            del view, xpad
        return acc.finish().reshape(geom.w_shape)

    def grad_input(self, g, w, geom, limit, xp, overwrite):
        impl = self.impl
        x_shape, kernel = geom.x_shape, geom.kernel
        n, c, h, wd = x_shape
        co = w.shape[0]
        # (kh, kw, C, Co): wt[i, j] = w[:, :, i, j].T, contiguous for the products
        wt = memory.empty((kernel[0], kernel[1], c, co), w.dtype, xp, "workspace")
        xp.copyto(wt, w.transpose(2, 3, 1, 0))
        reach = reaches(kernel, geom.stride, geom.padding, geom.out_hw, (h, wd))
        per_image = impl.grad_input_bytes(*geom.dims(g.itemsize), not g.flags.c_contiguous)
        parts = chunks(n, per_image, limit)
        tmp = memory.empty((parts[0].stop, c) + geom.out_hw, g.dtype, xp, "workspace") if parts else None
        if overwrite:
            gx = g
            acc = memory.empty((parts[0].stop,) + tuple(x_shape[1:]), g.dtype, xp, "workspace") if parts else None
        else:
            gx = memory.zeros(x_shape, g.dtype, xp, "gradients")
        for sl in parts:
            gp = impl.prep_input(g[sl], xp)
            t = tmp[: sl.stop - sl.start]
            if overwrite:
                gxs = acc[: sl.stop - sl.start]
                gxs.fill(0)
            else:
                gxs = gx[sl]
            for k, src, dst in reach:
                gxs[dst] += impl.grad_input_offset(gp, wt[k // kernel[1], k % kernel[1]], t, xp)[src]
            del gp
            if overwrite:
                g[sl] = gxs  # this chunk of g is read by nothing after this point
        return gx


BATCHED = Im2col("batched", _Batched)
GEMM = Im2col("gemm", _Gemm)
TENSORDOT = Im2col("tensordot", _Tensordot)
EINSUM = Im2col("einsum", _Einsum)
