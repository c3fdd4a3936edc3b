"""Winograd convolution F(m x m, 3 x 3) for 3x3 stride-1 layers (Lavin and Gray, "Fast
Algorithms for Convolutional Neural Networks", CVPR 2016).

Each ``m x m`` block of outputs is computed from an ``a x a`` tile of the padded input
(``a = m + 2``; tiles overlap by 2) as ``Y = A^T [(G w G^T) * (B^T d B)] A``: the elementwise
product in the transformed domain takes ``a*a`` multiplications per tile and channel pair
instead of ``9*m*m``: 2.25x fewer for F(2x2, 3x3), 4x fewer for F(4x4, 3x3). Summed over
input channels, the ``a*a`` elementwise products become ``a*a`` independent matrix
products, and those carry almost all the arithmetic.

Layouts (chosen by measurement, ``benchmarks/bench_conv.py``): tiles x channels, channels
last. Per chunk of ``n`` images with ``T = n * ceil(Ho/m) * ceil(Wo/m)`` tiles:

1. the chunk is copied into a zero-padded channels-last buffer ``(n, Hq, Wq, C)``;
2. one copy gathers the ``a*a`` tile elements ``D (a, a, T*C)`` (runs of ``C`` elements);
3. the input transform ``V = kron(B^T, B^T) D`` as two 1-D transforms along each tile
   axis: batched products with the ``a x a`` ``B^T`` (F(4x4)), or add and subtract passes
   (F(2x2), whose ``B^T`` holds only 0 and +-1);
4. the transformed weight ``U (a*a, C, Co)`` is made once per call; ``M[k] = V[k] @ U[k]``
   are ``a*a`` products ``(T, C) @ (C, Co)``, batched in one ``matmul``;
5. the output transform ``Y = kron(A^T, A^T) M``, likewise two 1-D transforms; ``Y`` goes
   to NCHW through a channels-last staging copy (two copies that move runs of ``Co``
   elements beat one scattered copy 2x to 4x).

Every step works on whole chunk-sized arrays, never on a tile or a channel at a time; the
views and the calls of a chunk are made once per call and chunk size.

Backward:

* input gradient: the transposed convolution (``w`` flipped and transposed, padding
  ``2 - p``, see :meth:`ConvGeometry.transposed`), by the forward above;
* weight gradient, by transposing the forward's algebra: ``dU[k] = Mg[k]^T @ V[k]``
  summed over tiles, with ``V`` the input transform of the saved input and
  ``Mg = kron(A, A) @ (output-gradient tiles)``; then ``dw = G^T dU G``, one small product.

Precision: the transforms add rounding. Against a float64 reference, float32 results of
F(2x2) carry about the error of im2col (2-6e-7 relative to the largest value on a
ResNet-20 layer), those of F(4x4) 3-6x more (1-2e-6 with the points above, 2.5-5e-6 with
Lavin and Gray's); ``tests/framework/ops/test_conv.py`` holds each to its bound.

Workspace per image (counted, ``workspace``, allocated once per call at the chunk size):
the padded channels-last image ``Hq*Wq*C``, two buffers of ``a*a*P*max(C, Co)`` elements
(``P`` tiles per image) used in turn by D, the transforms' intermediates, V, M, Y and the
staging copies, and for the weight gradient the output-gradient tiles ``m*m*P*Co``. On top
of the limit: the transformed weight ``a*a/9`` weight sizes (4x for F(4x4), 1.8x for F(2x2)) with one weight-sized copy
while it is made; the weight gradient's ``dU`` and a partial ``dU`` of a chunk, as large.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from ... import memory
from ...backend import device_of, to_device
from .workspace import ChunkSum, chunks, reshaped, strided

# F(2x2, 3x3) of Lavin and Gray (2016), section 4.1 (interpolation points 0, 1, -1, inf).
# F(4x4, 3x3) from the points 0, 1, -1, 2, -1/2, inf rather than their 0, +-1, +-2, inf:
# the same algebra (Toom-Cook; B^T solved from A^T and G, the identity checked exactly in
# tests/framework/ops/test_conv.py), but A^T's largest entry meets 1/8 where it met 8, and
# float32 results carry about 3x less error at the largest output and 1.5x less on
# average (ResNet-20's 32- and 64-channel layers against float64; docs/BENCHMARKS.md).
_MATRICES = {
    2: dict(
        BT=[[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]],
        G=[[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]],
        AT=[[1, 1, 1, 0], [0, 1, -1, -1]],
    ),
    4: dict(
        BT=[
            [1, 3 / 2, -2, -3 / 2, 1, 0],
            [0, -1, -5 / 2, -1 / 2, 1, 0],
            [0, 1, 1 / 2, -5 / 2, 1, 0],
            [0, -1 / 2, -1, 1 / 2, 1, 0],
            [0, 2, -1, -2, 1, 0],
            [0, 1, 3 / 2, -2, -3 / 2, 1],
        ],
        G=[
            [1, 0, 0],
            [-1 / 3, -1 / 3, -1 / 3],
            [1 / 3, -1 / 3, 1 / 3],
            [1 / 15, 2 / 15, 4 / 15],
            [-16 / 15, 8 / 15, -4 / 15],
            [0, 0, 1],
        ],
        AT=[[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -1 / 2, 0], [0, 1, 1, 4, 1 / 4, 0], [0, 1, -1, 8, -1 / 8, 1]],
    ),
}


class _Transforms(NamedTuple):
    """The transform matrices of F(m x m, 3 x 3): 1-D ``B^T`` and ``A^T`` (for the
    separable transforms) and 2-D ``kron(B^T, B^T)``, ``kron(A^T, A^T)``, ``kron(G, G)``;
    ``bt_terms`` / ``at_terms``: when every entry of the 1-D matrix is 0 or +-1 (F(2x2)),
    its rows as ``((column, sign), ...)`` for add/subtract passes, else None."""

    bt: object
    at: object
    bt2: object
    at2: object
    g2: object
    bt_terms: tuple | None
    at_terms: tuple | None


def _unit_terms(mat):
    if not np.isin(mat, (-1, 0, 1)).all():
        return None
    return tuple(tuple((j, int(v)) for j, v in enumerate(row) if v) for row in mat)


@functools.cache
def _host_transforms(m: int, dtype_str: str) -> _Transforms:
    mats = {k: np.array(v, dtype=np.float64) for k, v in _MATRICES[m].items()}
    dtype = np.dtype(dtype_str)
    return _Transforms(
        mats["BT"].astype(dtype),
        mats["AT"].astype(dtype),
        *(np.kron(mats[k], mats[k]).astype(dtype) for k in ("BT", "AT", "G")),
        _unit_terms(mats["BT"]),
        _unit_terms(mats["AT"]),
    )


_device_transforms: dict = {}


def _transforms(m, like) -> _Transforms:
    """The transforms in ``like``'s dtype on ``like``'s device (tiny constants, cached)."""
    host = _host_transforms(m, like.dtype.str)
    dev = device_of(like)
    if dev.type == "cpu":
        return host
    key = (m, like.dtype.str, dev)
    if key not in _device_transforms:
        _device_transforms[key] = host._replace(**{f: to_device(getattr(host, f), dev) for f in host._fields[:5]})
    return _device_transforms[key]


def _transform_1d(mat, terms, src, dst, axis, xp):
    """The calls that compute ``dst[i] = sum_j mat[i, j] src[j]`` along ``axis`` (0 or 1):
    a list of ``(function, args, out)`` for :func:`_run` (made once per call and chunk size,
    so a chunk pays only for the calls themselves).

    One batched product with ``mat``, or, for a matrix of 0 and +-1 (``terms``), add and
    subtract passes over whole slices: measured ~35% faster for F(2x2)'s 4x4 ``B^T``,
    where a product with 4-term sums is bound by memory, not arithmetic.
    """
    if terms is None:
        if axis == 1:
            return [(xp.matmul, (mat, src), dst)]  # batched over axis 0
        return [(xp.matmul, (mat, src.reshape(src.shape[0], -1)), dst.reshape(dst.shape[0], -1))]
    rows = [src[:, j] if axis == 1 else src[j] for j in range(src.shape[axis])]
    calls = []
    for i, row in enumerate(terms):
        out = dst[:, i] if axis == 1 else dst[i]
        (j0, s0), rest = row[0], row[1:]
        if not rest:
            calls.append((xp.multiply, (rows[j0], s0), out))
            continue
        (j1, s1), rest = rest[0], rest[1:]
        if s0 > 0 and s1 > 0:
            calls.append((xp.add, (rows[j0], rows[j1]), out))
        elif s0 > 0:
            calls.append((xp.subtract, (rows[j0], rows[j1]), out))
        elif s1 > 0:
            calls.append((xp.subtract, (rows[j1], rows[j0]), out))
        else:
            calls += [(xp.add, (rows[j0], rows[j1]), out), (xp.negative, (out,), out)]
        calls += [(xp.add if sign > 0 else xp.subtract, (out, rows[j]), out) for j, sign in rest]
    return calls


def _run(calls):
    for function, args, out in calls:
        function(*args, out=out)


class _Tiles:
    """Tiling of one geometry: ``Th x Tw`` tiles of ``m x m`` outputs per image."""

    def __init__(self, geom, m):
        self.m, self.a = m, m + 2
        self.out_hw = tuple(geom.out_hw)
        ho, wo = self.out_hw
        self.th, self.tw = -(-ho // m), -(-wo // m)
        self.hq, self.wq = m * self.th + 2, m * self.tw + 2  # the input the tiles read
        self.per_image = self.th * self.tw  # P
        self.exact = ho == m * self.th and wo == m * self.tw

    def scatter(self, y, stage, out, xp):
        """Writes output tiles ``y (m, m, n, Th, Tw, Co)`` into the NCHW ``out``, cropping
        partial tiles, through ``stage`` ``(n, Th, m, Tw, m, Co)``: channels-last, so both
        copies move runs (measured 2x to 4x faster than one scattered copy)."""
        xp.copyto(stage, y.transpose(2, 3, 0, 4, 1, 5))
        n, co = stage.shape[0], stage.shape[-1]
        nhwc = stage.reshape(n, self.th * self.m, self.tw * self.m, co)  # a view: stage is contiguous
        xp.copyto(out, nhwc[:, : self.out_hw[0], : self.out_hw[1]].transpose(0, 3, 1, 2))

    def gather(self, g, stage, tiles, xp):
        """Fills ``tiles (m, m, n, Th, Tw, Co)`` from the NCHW ``g`` (zeros past its edges)
        through the channels-last ``stage`` ``(n, Th, m, Tw, m, Co)``."""
        n, co = stage.shape[0], stage.shape[-1]
        nhwc = stage.reshape(n, self.th * self.m, self.tw * self.m, co)
        ho, wo = self.out_hw
        if not self.exact:
            nhwc[:, ho:] = 0
            nhwc[:, :, wo:] = 0
        xp.copyto(nhwc[:, :ho, :wo], g.transpose(0, 2, 3, 1))
        xp.copyto(tiles, stage.transpose(2, 4, 0, 1, 3, 5))


def _weight_transform(w, m, xp):
    """``U (a*a, C, Co)`` with ``U[k] = (G w G^T)[k]`` of the ``(Co, C, 3, 3)`` (view) ``w``."""
    co, c = w.shape[:2]
    a = m + 2
    w9 = memory.empty((3, 3, c, co), w.dtype, xp, "workspace")  # w9[i, j, c, o] = w[o, c, i, j]
    xp.copyto(w9, w.transpose(2, 3, 1, 0))
    u = memory.empty((a * a, c, co), w.dtype, xp, "workspace")
    xp.matmul(_transforms(m, w).g2, w9.reshape(9, c * co), out=u.reshape(a * a, c * co))
    return u


class _Workspace:
    """The chunk-sized buffers of one call, reused by every chunk.

    ``xh`` the zero-padded channels-last chunk (borders zeroed once, never written again);
    ``one`` and ``two``, flat, ``a*a*rows*P*max(C, Co)`` elements each, hold in turn the
    tile elements D, the transforms' intermediates, V, M and Y; ``gt`` (weight gradient
    only) the output-gradient tiles, ``m*m*rows*P*Co``. Views of them for a chunk of ``k``
    images are made once per call and size (``as_strided`` and reshapes cost microseconds
    each, and a call has a dozen chunks or more).
    """

    def __init__(self, tiles, rows, c, co, dtype, xp, tf, with_grad_tiles=False):
        a, m, p = tiles.a, tiles.m, tiles.per_image
        self.tiles, self.c, self.co, self.xp, self.tf = tiles, c, co, xp, tf
        self.xh = memory.zeros((rows, tiles.hq, tiles.wq, c), dtype, xp, "workspace")
        self.one = memory.empty((a * a * rows * p * max(c, co),), dtype, xp, "workspace")
        self.two = memory.empty((a * a * rows * p * max(c, co),), dtype, xp, "workspace")
        self.gt = memory.empty((m * m * rows * p * co,), dtype, xp, "workspace") if with_grad_tiles else None
        self.windows = strided(
            xp,
            self.xh,
            (a, a, rows, tiles.th, tiles.tw, c),
            (tiles.wq * c, c, tiles.hq * tiles.wq * c, m * tiles.wq * c, m * c, 1),
        )  # every input tile of the chunk
        self._views = {}

    @staticmethod
    def per_image_bytes(tiles, c, co, itemsize, with_grad_tiles=False):
        a2, p = tiles.a * tiles.a, tiles.per_image
        n = tiles.hq * tiles.wq * c + 2 * a2 * p * max(c, co) + (tiles.m**2 * p * co if with_grad_tiles else 0)
        return n * itemsize

    def views(self, k):
        """A namespace of the views for a chunk of ``k`` images (cached by ``k``)."""
        v = self._views.get(k)
        if v is None:
            v = self._views[k] = _ChunkViews(self, k)
        return v


class _ChunkViews:
    """Views of a :class:`_Workspace` for ``k`` images (``T = k*P`` tiles); the names say
    what each holds at its step (see :func:`_forward_into` and ``grad_weight``)."""

    def __init__(self, ws, k):
        tl, c, co = ws.tiles, ws.c, ws.co
        a, m = tl.a, tl.m
        t = k * tl.per_image
        r, rc = t * c, t * co

        def one(*shape):
            return _prefix(ws.one, shape)

        def two(*shape):
            return _prefix(ws.two, shape)

        self.windows = ws.windows[:, :, :k]
        self.d = one(a, a, k, tl.th, tl.tw, c)  # tile elements
        self.d_rows, self.e_rows, self.v_rows = one(a, a, r), two(a, a, r), one(a, a, r)  # D, E, V by rows
        self.v = one(a * a, t, c)  # V, the transformed input
        self.m = two(a * a, t, co)  # M = V @ U
        self.m_rows, self.z = two(a, a, rc), one(a, m, rc)  # M by rows; Z[xi1, p2]
        self.y_rows = two(m, m, rc)  # Y[p1, p2]
        self.y = two(m, m, k, tl.th, tl.tw, co)  # output tiles
        self.out_stage = one(k, tl.th, m, tl.tw, m, co)  # output tiles, channels last
        tf, xp = ws.tf, ws.xp
        # the four 1-D transforms: E[k1, xi2] = sum_k2 BT[xi2, k2] D[k1, k2], then
        # V[xi1, xi2] = sum_k1 BT[xi1, k1] E[k1, xi2]; Z[xi1, p2] = sum_xi2 AT[p2, xi2] M[xi1, xi2],
        # then Y[p1, p2] = sum_xi1 AT[p1, xi1] Z[xi1, p2]
        self.b_calls = _transform_1d(tf.bt, tf.bt_terms, self.d_rows, self.e_rows, 1, xp) + _transform_1d(
            tf.bt, tf.bt_terms, self.e_rows, self.v_rows, 0, xp
        )
        self.a_calls = _transform_1d(tf.at, tf.at_terms, self.m_rows, self.z, 1, xp) + _transform_1d(
            tf.at, tf.at_terms, self.z, self.y_rows, 0, xp
        )
        if ws.gt is not None:
            self.g_stage = two(k, tl.th, m, tl.tw, m, co)  # output-gradient tiles, channels last
            self.gt_flat = _prefix(ws.gt, (m * m, rc))  # output-gradient tiles
            self.gt = _prefix(ws.gt, (m, m, k, tl.th, tl.tw, co))
            self.mg_flat, self.mg = two(a * a, rc), two(a * a, t, co)  # their transform


def _prefix(flat, shape):
    """The first ``prod(shape)`` elements of a flat buffer viewed as ``shape``."""
    size = 1
    for d in shape:
        size *= d
    return reshaped(flat[:size], shape)


def _input_transform(x, sl, geom, ws, v, xp):
    """Fills ``v.v`` (in ``one``) with V of images ``x[sl]``; ``two`` is free after.

    ``V = kron(B^T, B^T) D`` is done as two 1-D transforms (3x fewer operations than one
    product with the Kronecker matrix; measured ~25% faster).
    """
    h, w = geom.x_shape[2:]
    ph, pw = geom.padding
    k = sl.stop - sl.start
    ws.xh[:k, ph : ph + h, pw : pw + w, :] = x[sl].transpose(0, 2, 3, 1)
    xp.copyto(v.d, v.windows)
    _run(v.b_calls)


def _forward_into(x, u, geom, m, limit, xp, out):
    """``out[:] = conv2d(x, w)`` for a 3x3 stride-1 ``geom``, ``u`` the transformed weight."""
    n, c = geom.x_shape[:2]
    co = u.shape[2]
    tiles = _Tiles(geom, m)
    parts = chunks(n, _Workspace.per_image_bytes(tiles, c, co, x.itemsize), limit)
    if not parts:
        return out
    ws = _Workspace(tiles, parts[0].stop, c, co, x.dtype, xp, _transforms(m, x))
    for sl in parts:
        v = ws.views(sl.stop - sl.start)
        _input_transform(x, sl, geom, ws, v, xp)
        xp.matmul(v.v, u, out=v.m)  # M[xi] = V[xi] @ U[xi]
        _run(v.a_calls)  # Y = kron(A^T, A^T) M
        tiles.scatter(v.y, v.out_stage, out[sl], xp)
    return out


class Winograd:
    """F(m x m, 3 x 3) for 3x3 stride-1 convolutions (m = 2 or 4)."""

    def __init__(self, m):
        self.m = m
        self.name = f"winograd{m}"

    def __repr__(self):
        return f"<conv2d algorithm {self.name!r}>"

    @staticmethod
    def unsupported(geom):
        """Why this algorithm cannot run ``geom`` (None: it can)."""
        if geom.kernel != (3, 3) or geom.stride != (1, 1):
            return f"needs a 3x3 kernel and stride 1, this conv has kernel {geom.kernel}, stride {geom.stride}"
        return None

    def forward(self, x, w, geom, limit, xp):
        out = memory.empty((x.shape[0], w.shape[0]) + tuple(geom.out_hw), w.dtype, xp, "activations")
        return _forward_into(x, _weight_transform(w, self.m, xp), geom, self.m, limit, xp, out)

    def grad_input(self, g, w, geom, limit, xp, overwrite):
        tgeom, (ch, cw) = geom.transposed()
        g_in = g[:, :, ch : g.shape[2] - ch, cw : g.shape[3] - cw] if ch or cw else g
        # the transposed convolution's weight: w'[c, o, i, j] = w[o, c, 2 - i, 2 - j]
        u = _weight_transform(w.transpose(1, 0, 2, 3)[:, :, ::-1, ::-1], self.m, xp)
        gx = g if overwrite else memory.empty(geom.x_shape, g.dtype, xp, "gradients")
        return _forward_into(g_in, u, tgeom, self.m, limit, xp, gx)

    def grad_weight(self, x, g, geom, limit, xp):
        m = self.m
        n, c = geom.x_shape[:2]
        co = geom.w_shape[0]
        tiles = _Tiles(geom, m)
        a2 = tiles.a * tiles.a
        du = memory.zeros((a2, co, c), g.dtype, xp, "workspace")
        parts = chunks(n, _Workspace.per_image_bytes(tiles, c, co, g.itemsize, True), limit)
        if parts:
            ws = _Workspace(tiles, parts[0].stop, c, co, g.dtype, xp, _transforms(m, g), with_grad_tiles=True)
            a_of_g = ws.tf.at2.T  # kron(A, A): (a*a, m*m)
            acc = ChunkSum(du, xp)
            for sl in parts:
                v = ws.views(sl.stop - sl.start)
                _input_transform(x, sl, geom, ws, v, xp)
                tiles.gather(g[sl], v.g_stage, v.gt, xp)
                xp.matmul(a_of_g, v.gt_flat, out=v.mg_flat)  # Mg = kron(A, A) @ g tiles
                mg = v.mg.transpose(0, 2, 1)  # (a*a, Co, T)
                xp.matmul(mg, v.v, out=acc.out())
                acc.add()
            del acc, ws, v, mg  # free the chunk buffers (and the partial sum) before dw is made
        # dw[(i, j), o, c] = sum_k G[k, (i, j)] du[k, o, c], then (Co, C, 3, 3)
        dw = memory.empty((9, co, c), g.dtype, xp, "workspace")
        xp.matmul(_transforms(m, g).g2.T, du.reshape(a2, co * c), out=dw.reshape(9, co * c))
        del du
        gw = memory.empty(geom.w_shape, g.dtype, xp, "gradients")
        xp.copyto(gw, dw.reshape(3, 3, co, c).transpose(2, 3, 0, 1))
        return gw


WINOGRAD2 = Winograd(2)
WINOGRAD4 = Winograd(4)
