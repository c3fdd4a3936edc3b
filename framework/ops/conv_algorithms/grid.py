"""Convolution as im2col over the padded grid, one GEMM per chunk; for stride 1 its input
gradient as the transposed convolution, computed by the same forward.

Why a different im2col: with stride 1, the window of output ``(h, w)`` starts at
``h*Wp + w`` in the flattened padded image (``Wp`` its padded width), so the ``C*kh*kw``
rows of the columns matrix are contiguous runs of the flattened image:
``cols[(c, i, j), q] = xpad_flat[c, q + i*Wp + j]`` for ``q < L = (Ho-1)*Wp + Wo``. The
copy into ``cols`` moves runs of ``L`` elements (hundreds) instead of runs of ``Wo`` (8 to
32 on ResNet-20), 3x to 5x faster; the price is ``Wp - Wo`` columns per output row that
straddle the right border and are thrown away (6% of the product at 32x32, 12% at
16x16, 22% at 8x8). The images of a chunk sit side by side (``cols`` is
``(C*kh*kw, n*L)``), so each pass is ONE matrix product per chunk.

Stride ``s > 1``: the padded image is first split into its ``sh*sw`` phases
``phase[a, b][y, x] = xpad[s*y + a, s*x + b]`` (each ``Hq x Wq``, ``Hq = ceil(Hp/sh)``).
Kernel offset ``(i, j)`` reads phase ``(i % sh, j % sw)`` shifted by
``(i // sh, j // sw)`` with stride 1, so the same construction holds on the phases'
grid: ``cols[(c, i, j), q] = phase_flat[i % sh, j % sw][c, q + (i // sh)*Wq + j // sw]``
with ``L = (Ho-1)*Wq + Wo``. The phase split reads the input once with stride ``s``;
every copy into ``cols`` then moves runs of ``L`` (ResNet-20's 16->32 strided forward
measured 1.3-2.2x faster than with im2col's ``gemm``; docs/BENCHMARKS.md).

* forward: ``out(Co, n*L) = w(Co, C*kh*kw) @ cols``, then the valid columns are copied
  into the NCHW output;
* weight gradient: the output gradient is laid out on the same grid (zeros in the
  straddling columns, so they add nothing) and ``gw = g_grid @ cols.T``, computed as its
  transpose ``cols @ g_grid.T`` (the orientation BLAS runs faster);
* input gradient, stride 1: ``grad_x = conv2d(g padded by kh-1-ph, w flipped and
  transposed)``, a stride-1 convolution of the output gradient, computed by the forward
  above: no col2im, no per-offset products, no scatter-adds. Under policy ``on`` (the
  engine proved the output gradient dead) a chunk's result is written back over that
  chunk of the output gradient when the shapes allow, as in :mod:`.im2col`. Strided:
  im2col's (``gemm``), which handles every geometry.

Workspace per image (counted, category ``workspace``, allocated once per call at the
chunk size): the padded image (its phases) ``C*sh*sw*Hq*Wq`` + ``cols`` ``C*kh*kw*L`` +
the product's output ``Co*L`` (weight gradient: the gridded output gradient ``Co*L``
instead). On top of the limit: one weight-sized buffer (the flipped weight of the input
gradient, the weight gradient's transposed sum, or a contiguous copy of a strided weight).
"""

from __future__ import annotations

from ... import memory
from .im2col import GEMM
from .workspace import ChunkSum, chunks, contiguous, reach_1d, reshaped, strided


class _Chunked:
    """The buffers one call reuses for every chunk, and their views (made once per call:
    ``as_strided`` and reshapes cost microseconds each, and a call has dozens of chunks).

    ``xpad`` the padded chunk split into phases ``(rows, C, sh, sw, Hq, Wq)`` (one phase
    for stride 1; borders zeroed once, never written again); ``cols``
    ``(C*kh*kw, rows, L)``; ``grid`` ``(grid_rows, rows, L)``, a product's output or the
    output gradient on the grid (``zero_grid``: its straddling columns stay 0).
    """

    def __init__(self, x, geom, rows, grid_rows, xp, zero_grid=False):
        c, h, w = geom.x_shape[1:]
        kh, kw = geom.kernel
        sh, sw = geom.stride
        self.geom, self.xp, self.rows = geom, xp, rows
        self.hq, self.wq, self.length = hq, wq, length = _grid(geom)
        self.copy = _Chunked.copies_input(x, geom)
        self.xpad = memory.zeros((rows, c, sh, sw, hq, wq), x.dtype, xp, "workspace") if self.copy else None
        self.cols = memory.empty((c * kh * kw, rows, length), x.dtype, xp, "workspace")
        make = memory.zeros if zero_grid else memory.empty
        self.grid = make((grid_rows, rows, length), x.dtype, xp, "workspace")
        self.cols5 = reshaped(self.cols, (c, kh, kw, rows, length))
        # per phase (a, b): the kernel offsets i = a + sh*ii, j = b + sw*jj it serves, as a
        # window view of that phase and the rows of cols it fills
        self.phases = []
        for a in range(sh):
            for b in range(sw):
                src = self.xpad[:, :, a, b] if self.copy else x  # x: stride 1, unpadded, C-contiguous
                sn, sc = src.strides[0] // src.itemsize, src.strides[1] // src.itemsize
                shape = (c, -(-(kh - a) // sh), -(-(kw - b) // sw), src.shape[0], length)
                window = strided(xp, src, shape, (sc, wq, 1, sn, 1))
                self.phases.append((window, self.cols5[:, a::sh, b::sw]))
        # per phase, where the chunk's images land in it: phase[y] = xpad[s*y + a] =
        # x[s*y + a - pad], the map of output to input of kernel offset a (reach_1d)
        ph, pw = geom.padding
        self.fills = []
        for a in range(sh):
            span_h = reach_1d(a, ph, sh, hq, h)
            for b in range(sw):
                span_w = reach_1d(b, pw, sw, wq, w)
                if span_h is not None and span_w is not None:  # else the image misses this phase
                    self.fills.append((a, b, span_h, span_w))
        self.grid_valid = strided(xp, self.grid, (rows, grid_rows) + tuple(geom.out_hw), (length, rows * length, wq, 1))
        self._flat = {}

    @staticmethod
    def copies_input(x, geom):
        """Whether images are copied into a padded buffer (padding, a stride, or a strided
        input)."""
        return geom.padding != (0, 0) or geom.stride != (1, 1) or not x.flags.c_contiguous

    @staticmethod
    def per_image_bytes(x, geom, grid_rows):
        """Workspace bytes per image: padded image, ``cols`` and ``grid_rows`` rows of ``L``."""
        c = geom.x_shape[1]
        hq, wq, length = _grid(geom)
        kh, kw = geom.kernel
        padded = c * geom.stride[0] * geom.stride[1] * hq * wq if _Chunked.copies_input(x, geom) else 0
        return (padded + (c * kh * kw + grid_rows) * length) * x.itemsize

    def flat(self, k):
        """``cols`` as ``(C*kh*kw, k*L)`` and ``grid`` as ``(grid_rows, k*L)``, for k images."""
        views = self._flat.get(k)
        if views is None:
            n_l = k * self.length
            views = self._flat[k] = (
                reshaped(self.cols[:, :k], (self.cols.shape[0], n_l)),
                reshaped(self.grid[:, :k], (self.grid.shape[0], n_l)),
            )
        return views

    def columns(self, x, sl):
        """Fills ``cols`` from images ``x[sl]``; returns ``(cols, grid)`` as :meth:`flat`."""
        k = sl.stop - sl.start
        if self.copy:
            xs = x[sl]
            for a, b, (rows_to, rows_from), (cols_to, cols_from) in self.fills:
                self.xpad[:k, :, a, b, rows_to, cols_to] = xs[:, :, rows_from, cols_from]
            for window, dst in self.phases:
                self.xp.copyto(dst[:, :, :, :k], window[:, :, :, :k])
        else:
            window, dst = self.phases[0]
            self.xp.copyto(dst[:, :, :, :k], window[:, :, :, sl])
        return self.flat(k)


def _grid(geom):
    """``(Hq, Wq, L)``: height and width of the padded image's phases (the padded image
    itself for stride 1), and grid positions per image."""
    h, w = geom.x_shape[2:]
    (sh, sw), (ph, pw) = geom.stride, geom.padding
    hq, wq = -(-(h + 2 * ph) // sh), -(-(w + 2 * pw) // sw)
    return hq, wq, (geom.out_hw[0] - 1) * wq + geom.out_hw[1]


def _forward_into(x, w2, geom, limit, xp, out):
    """``out[:] = conv2d(x, w)``, ``w2`` the ``(Co, C*kh*kw)`` weight."""
    co = w2.shape[0]
    parts = chunks(geom.x_shape[0], _Chunked.per_image_bytes(x, geom, co), limit)
    if not parts:
        return out
    bufs = _Chunked(x, geom, parts[0].stop, co, xp)
    for sl in parts:
        cols, res = bufs.columns(x, sl)
        xp.matmul(w2, cols, out=res)
        xp.copyto(out[sl], bufs.grid_valid[: sl.stop - sl.start])
    return out


class Grid:
    """im2col over the padded grid (of its phases, when strided); the input gradient as the
    transposed convolution for stride 1, im2col's otherwise."""

    name = "grid"

    def __repr__(self):
        return f"<conv2d algorithm {self.name!r}>"

    @staticmethod
    def unsupported(geom):
        """Why this algorithm cannot run ``geom`` (None: it runs every geometry)."""
        return None

    def forward(self, x, w, geom, limit, xp):
        co = w.shape[0]
        out = memory.empty((x.shape[0], co) + tuple(geom.out_hw), w.dtype, xp, "activations")
        return _forward_into(x, contiguous(w, xp).reshape(co, -1), geom, limit, xp, out)

    def grad_weight(self, x, g, geom, limit, xp):
        n, c = geom.x_shape[:2]
        co = geom.w_shape[0]
        k = c * geom.kernel[0] * geom.kernel[1]
        parts = chunks(n, _Chunked.per_image_bytes(x, geom, co), limit)
        if not parts:
            return memory.zeros(geom.w_shape, g.dtype, xp, "gradients")
        # The product is made transposed, gw.T = cols @ g_grid.T: BLAS runs a product with
        # a long inner dimension and few rows (Co) 1.1x (AVX2 kernels) to 2x (AVX-512)
        # slower than its transpose (docs/BENCHMARKS.md).
        acc = ChunkSum(memory.empty((co, k), g.dtype, xp, "gradients"), xp, transposed=True)
        # The output gradient on the grid; the straddling columns are never written: 0.
        bufs = _Chunked(x, geom, parts[0].stop, co, xp, zero_grid=True)
        for sl in parts:
            cols, ggrid = bufs.columns(x, sl)
            xp.copyto(bufs.grid_valid[: sl.stop - sl.start], g[sl])
            xp.matmul(cols, ggrid.T, out=acc.out())
            acc.add()
        return acc.finish().reshape(geom.w_shape)

    def grad_input(self, g, w, geom, limit, xp, overwrite):
        if geom.stride != (1, 1):
            return GEMM.grad_input(g, w, geom, limit, xp, overwrite)
        tgeom, (ch, cw) = geom.transposed()
        g_in = g[:, :, ch : g.shape[2] - ch, cw : g.shape[3] - cw] if ch or cw else g
        co, c, kh, kw = w.shape
        w2t = memory.empty((c, co, kh, kw), w.dtype, xp, "workspace")
        xp.copyto(w2t, w.transpose(1, 0, 2, 3)[:, :, ::-1, ::-1])
        gx = g if overwrite else memory.empty(geom.x_shape, g.dtype, xp, "gradients")
        return _forward_into(g_in, w2t.reshape(c, -1), tgeom, limit, xp, gx)


GRID = Grid()
