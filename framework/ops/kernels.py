"""The fused GPU kernels, each defined once: its CUDA source and its NumPy reference.

On a GPU every call from Python costs 7-10 µs whatever it does (a reduction about
28 µs), so the GPU paths of activations, BatchNorm and InPlace-ABN run as single
``cupy.ElementwiseKernel`` / ``cupy.ReductionKernel`` launches instead of chains of
ufuncs. :func:`on_gpu` is the one test an op makes to pick them; the op's ``Function``,
what it saves and its inplace rules are the same on every device.

A kernel here is a pair: CuPy's constructor arguments (the CUDA source, which real CuPy
compiles) and a NumPy function computing the same thing, which the CuPy stand-in runs in
place of the source (it cannot compile CUDA; see ``cupy_standin/_kernels.py``). Keep the
two in step: same operations, same order, same dtypes.

BatchNorm's per-channel statistics travel as ONE complex128 array ``s`` of C values,
``(sum x, sum x^2)`` of the batch (with ``inv_m = 1 / count > 0``), or ``(mean, invstd)``
given (``inv_m == 0``: eval mode); one reduction makes the former in one pass, summing in
double precision, and every later kernel derives mean and inverse std from it per
element (:data:`_BN_PREAMBLE`), so no kernel is spent on per-channel arithmetic.
"""

from __future__ import annotations

import numpy as np

from .. import backend

__all__ = ["on_gpu", "launch"]


def on_gpu(a) -> bool:
    """True for a CuPy (or stand-in) array: its op runs the fused kernels below."""
    return a.__class__ is not np.ndarray and backend.get_array_module(a) is not np


class _Kernel:
    """One kernel: CuPy's class name and constructor arguments, plus the NumPy reference.

    Built on first use for the CuPy that :mod:`framework.backend` loaded, then cached.
    """

    def __init__(self, cls: str, args: tuple, kwargs: dict, reference):
        self.cls, self.args, self.kwargs, self.reference = cls, args, kwargs, reference
        self._built = None

    def _kernel(self):
        cp = backend.cupy_module()
        if self._built is None or self._built[0] is not cp:
            k = getattr(cp, self.cls)(*self.args, **self.kwargs)
            if backend.cupy_choice() == "standin":  # the stand-in runs NumPy, not CUDA
                k.reference = self.reference
            self._built = (cp, k)
        return self._built[1]

    def __call__(self, *args, **kwargs):
        return self._kernel()(*args, **kwargs)


def elementwise(in_params, out_params, operation, name, reference, preamble=""):
    """A ``cupy.ElementwiseKernel``; ``reference(*inputs, *outputs)`` writes the outputs."""
    return _Kernel("ElementwiseKernel", (in_params, out_params, operation, name), {"preamble": preamble}, reference)


def reduction(in_params, out_params, map_expr, reduce_expr, post_map_expr, identity, name, reference, **kwargs):
    """A ``cupy.ReductionKernel``; ``reference(*inputs, axis=...)`` returns the reduced values."""
    args = (in_params, out_params, map_expr, reduce_expr, post_map_expr, identity, name)
    return _Kernel("ReductionKernel", args, kwargs, reference)


def launch(kernel, *args, out=None):
    """``kernel(*args)``, writing into ``out`` when given (an inplace op's buffer, a reused gradient)."""
    return kernel(*args) if out is None else kernel(*args, out)


def _put(out, value):
    out[...] = value


# --- activations: one launch each way ----------------------------------------------------------

relu = elementwise(
    "T x",
    "T y",
    "y = (x > (T)0 || x != x) ? x : (T)0;",  # NaN passes through, as cupy.maximum
    "fused_relu",
    lambda x, y: _put(y, np.where((x > 0) | np.isnan(x), x, x.dtype.type(0))),
)
relu_backward = elementwise(
    "T g, T y",
    "T gx",
    "gx = y > (T)0 ? g : (T)0;",
    "fused_relu_backward",
    lambda g, y, gx: _put(gx, np.where(y > 0, g, g.dtype.type(0))),
)
leaky_relu = elementwise(
    "T x, T slope",
    "T y",
    "y = x > (T)0 ? x : x * slope;",
    "fused_leaky_relu",
    lambda x, slope, y: _put(y, np.where(x > 0, x, x * slope)),
)
leaky_relu_backward = elementwise(
    "T g, T y, T slope",
    "T gx",
    "gx = y > (T)0 ? g : g * slope;",
    "fused_leaky_relu_backward",
    lambda g, y, slope, gx: _put(gx, np.where(y > 0, g, g * slope)),
)
sigmoid = elementwise(
    "T x",
    "T y",
    "y = (T)1 / ((T)1 + exp(-x));",
    "fused_sigmoid",
    lambda x, y: _put(y, x.dtype.type(1) / (x.dtype.type(1) + np.exp(-x))),
)
sigmoid_backward = elementwise(
    "T g, T y",
    "T gx",
    "gx = g * (((T)1 - y) * y);",
    "fused_sigmoid_backward",
    lambda g, y, gx: _put(gx, g * ((y.dtype.type(1) - y) * y)),
)
tanh = elementwise("T x", "T y", "y = tanh(x);", "fused_tanh", lambda x, y: _put(y, np.tanh(x)))
tanh_backward = elementwise(
    "T g, T y",
    "T gx",
    "gx = g * ((T)1 - y * y);",
    "fused_tanh_backward",
    lambda g, y, gx: _put(gx, g * (y.dtype.type(1) - y * y)),
)


# --- BatchNorm and InPlace-ABN: one reduction + one elementwise kernel each way -----------------

_BN_PREAMBLE = r"""
__device__ void bn_stats(const complex<double>& s, double inv_m, double eps, double& mean, double& invstd) {
    if (inv_m > 0) {
        mean = s.real() * inv_m;
        invstd = rsqrt(max(s.imag() * inv_m - mean * mean, 0.0) + eps);
    } else {
        mean = s.real();
        invstd = s.imag();
    }
}
template <typename T>
__device__ T bn_xhat(T x, const complex<double>& s, double inv_m, double eps) {
    double mean, invstd;
    bn_stats(s, inv_m, eps, mean, invstd);
    return (x - (T)mean) * (T)invstd;
}
"""


def _bn_stats(s, inv_m, eps, dtype):
    """NumPy's ``bn_stats``: (mean, invstd) in ``dtype`` from the complex statistics."""
    if inv_m > 0:
        mean = s.real * inv_m
        invstd = 1.0 / np.sqrt(np.maximum(s.imag * inv_m - mean * mean, 0.0) + eps)
    else:
        mean, invstd = s.real, s.imag
    return mean.astype(dtype), invstd.astype(dtype)


def _bn_xhat(x, s, inv_m, eps):
    mean, invstd = _bn_stats(s, inv_m, eps, x.dtype)
    return (x - mean) * invstd


def _moments(x, axis):
    xd = x.astype(np.float64)
    return xd.sum(axis) + 1j * (xd * xd).sum(axis)


bn_moments = reduction(
    "T x",
    "complex128 s",
    "complex<double>(x, (double)x * x)",
    "a + b",
    "s = a",
    "0",
    "fused_bn_moments",
    _moments,
    reduce_type="complex<double>",
)
bn_eval_stats = elementwise(
    "T mean, T var, float64 eps",
    "complex128 s",
    "s = complex<double>(mean, 1.0 / sqrt((double)var + eps));",
    "fused_bn_eval_stats",
    lambda mean, var, eps, s: _put(s, mean + 1j * (1.0 / np.sqrt(var.astype(np.float64) + eps))),
)


running_stat_update = elementwise(
    "T r, U batch, float64 keep, float64 w",
    "T out",
    "out = (T)(keep * (double)r + w * (double)batch);",
    "fused_running_stat_update",
    lambda r, batch, keep, w, out: _put(out, keep * r.astype(np.float64) + w * batch.astype(np.float64)),
)


def _running_from_moments(r, s, inv_m, keep, w, var, out):
    mu = s.real * inv_m
    batch = (np.maximum(s.imag * inv_m - mu * mu, 0.0) if var else mu).astype(r.dtype)
    _put(out, keep * r.astype(np.float64) + w * batch.astype(np.float64))


# The running-stat update from BatchNorm's kept sums: the batch mean (or biased variance)
# made from them and rounded to T, then running_stat_update's arithmetic, in one kernel
running_stat_from_moments = elementwise(
    "T r, complex128 s, float64 inv_m, float64 keep, float64 w, bool var",
    "T out",
    "double mu = s.real() * inv_m; T b = var ? (T)max(s.imag() * inv_m - mu * mu, 0.0) : (T)mu; "
    "out = (T)(keep * (double)r + w * (double)b);",
    "fused_running_stat_from_moments",
    _running_from_moments,
)


def _bn_forward(x, s, inv_m, eps, w, b, y):
    mean, invstd = _bn_stats(s, inv_m, eps, x.dtype)
    y[...] = (x - mean) * (invstd * w) + b


bn_forward = elementwise(
    "T x, complex128 s, float64 inv_m, float64 eps, T w, T b",
    "T y",
    "double mean, invstd; bn_stats(s, inv_m, eps, mean, invstd); y = (x - (T)mean) * ((T)invstd * w) + b;",
    "fused_bn_forward",
    _bn_forward,
    preamble=_BN_PREAMBLE,
)


def _bn_grad_sums(g, x, s, inv_m, eps, axis):
    gd = g.astype(np.float64)
    return gd.sum(axis) + 1j * (gd * _bn_xhat(x, s, inv_m, eps).astype(np.float64)).sum(axis)


bn_grad_sums = reduction(
    "T g, T x, complex128 s, float64 inv_m, float64 eps",
    "C r",
    "complex<double>(g, (double)g * (double)bn_xhat(x, s, inv_m, eps))",
    "a + b",
    "r = C(a.real(), a.imag())",
    "0",
    "fused_bn_grad_sums",
    _bn_grad_sums,
    reduce_type="complex<double>",
    preamble=_BN_PREAMBLE,
)


def _bn_backward(g, x, s, inv_m, eps, w, r, gx):
    mean, invstd = _bn_stats(s, inv_m, eps, x.dtype)
    xhat = (x - mean) * invstd
    mg = (r.real * inv_m).astype(x.dtype)
    mgx = (r.imag * inv_m).astype(x.dtype)
    gx[...] = (invstd * w) * (g - (xhat * mgx + mg))


bn_backward = elementwise(
    "T g, T x, complex128 s, float64 inv_m, float64 eps, T w, C r",
    "T gx",
    "double mean, invstd; bn_stats(s, inv_m, eps, mean, invstd);"
    " T xhat = (x - (T)mean) * (T)invstd;"
    " gx = ((T)invstd * w) * (g - (xhat * (T)(r.imag() * inv_m) + (T)(r.real() * inv_m)));",
    "fused_bn_backward",
    _bn_backward,
    preamble=_BN_PREAMBLE,
)


def _bn_scale(g, s, inv_m, eps, w, gx):
    _, invstd = _bn_stats(s, inv_m, eps, g.dtype)
    gx[...] = g * (invstd * w)


bn_scale = elementwise(
    "T g, complex128 s, float64 inv_m, float64 eps, T w",
    "T gx",
    "double mean, invstd; bn_stats(s, inv_m, eps, mean, invstd); gx = g * ((T)invstd * w);",
    "fused_bn_scale",
    _bn_scale,
    preamble=_BN_PREAMBLE,
)


# InPlace-ABN: y = leaky_relu((x - mean) * invstd * a + b + r), a = |w| + aeps (aeps = eps, or
# w = 1 and aeps = 0 without a weight); backward rebuilds x_hat from y (see ops/norm.py).

_ABN_PREAMBLE = (
    _BN_PREAMBLE
    + r"""
template <typename T>
__device__ T abn_factor(T y, T slope) { return y > (T)0 ? (T)1 : slope; }
template <typename T>
__device__ T abn_xhat(T y, T f, T r, T b, T a) { return (y / f - r - b) / a; }
template <typename T>
__device__ complex<double> abn_sums(T y, T g, T r, T b, T a, T slope) {
    T f = abn_factor(y, slope);
    T dz = f * g;
    return complex<double>(dz, (double)dz * (double)abn_xhat(y, f, r, b, a));
}
"""
)


def _abn_forward(x, s, inv_m, eps, w, aeps, b, r, slope, y):
    mean, invstd = _bn_stats(s, inv_m, eps, x.dtype)
    z = (x - mean) * (invstd * (np.abs(w) + aeps)) + b + r
    y[...] = np.where(z > 0, z, z * slope)


abn_forward = elementwise(
    "T x, complex128 s, float64 inv_m, float64 eps, T w, T aeps, T b, T r, T slope",
    "T y",
    "double mean, invstd; bn_stats(s, inv_m, eps, mean, invstd);"
    " T z = (x - (T)mean) * ((T)invstd * (abs(w) + aeps)) + b + r;"
    " y = z > (T)0 ? z : z * slope;",
    "fused_abn_forward",
    _abn_forward,
    preamble=_ABN_PREAMBLE,
)


def _abn_parts(y, g, r, b, w, aeps, slope):
    """NumPy's ``abn_factor``/``abn_xhat``: (dz, x_hat, a)."""
    f = np.where(y > 0, y.dtype.type(1), slope)
    a = np.abs(w) + aeps
    return f * g, (y / f - r - b) / a, a


def _abn_grad_sums(y, g, r, b, w, aeps, slope, axis):
    dz, xhat, _ = _abn_parts(y, g, r, b, w, aeps, slope)
    dzd = dz.astype(np.float64)
    return dzd.sum(axis) + 1j * (dzd * xhat.astype(np.float64)).sum(axis)


abn_grad_sums = reduction(
    "T y, T g, T r, T b, T w, T aeps, T slope",
    "C sums",
    "abn_sums(y, g, r, b, abs(w) + aeps, slope)",
    "a + b",
    "sums = C(a.real(), a.imag())",
    "0",
    "fused_abn_grad_sums",
    _abn_grad_sums,
    reduce_type="complex<double>",
    preamble=_ABN_PREAMBLE,
)


def _abn_backward_kernel(batch: bool, with_dz: bool, with_gw: bool):
    """x's gradient (and, ``with_dz``, the residual's: the pre-activation gradient dz).

    ``batch``: batch statistics, ``dx = a * invstd * (dz - mean(dz) - x_hat * mean(dz * x_hat))``
    with the means from ``sums``; else given statistics, ``dx = a * invstd * dz``.
    ``with_gw``: also weight's gradient ``sign(w) * sum(dz * x_hat)`` into the raw (C,)
    output ``gw``, written by the thread of each channel's first element (``i`` is the
    index in the loop's C order over (N, C, inner): channel ``i / inner`` when
    ``i < C * inner``, first when ``i % inner == 0``), so no launch is spent on C values.
    """
    params = "T y, T g, T r, T b, T w, T aeps, T slope, complex128 s, float64 inv_m, float64 eps"
    op = (
        "double mean, invstd; bn_stats(s, inv_m, eps, mean, invstd);"
        " T f = abn_factor(y, slope); T dzv = f * g; T a = abs(w) + aeps;"
    )
    if batch or with_gw:
        params += ", C sums"
    if batch:
        op += (
            " T xhat = abn_xhat(y, f, r, b, a);"
            " gx = ((T)invstd * a) * (dzv - (xhat * (T)(sums.imag() * inv_m) + (T)(sums.real() * inv_m)));"
        )
    else:
        op += " gx = dzv * ((T)invstd * a);"
    outs = "T gx"
    if with_dz:
        outs += ", T dz"
        op += " dz = dzv;"
    if with_gw:
        params += ", int64 channels, int64 inner"
        outs += ", raw T gw"
        op += (
            " if (i < channels * inner && i % inner == 0)"
            " gw[i / inner] = (T)sums.imag() * (w > (T)0 ? (T)1 : (w < (T)0 ? (T)-1 : (T)0));"
        )

    def reference(y, g, r, b, w, aeps, slope, s, inv_m, eps, *rest):
        rest = list(rest)
        sums = rest.pop(0) if batch or with_gw else None
        if with_gw:
            rest = rest[2:]  # channels, inner: the C order is NumPy's own
        _, invstd = _bn_stats(s, inv_m, eps, y.dtype)
        dz, xhat, a = _abn_parts(y, g, r, b, w, aeps, slope)
        if batch:
            mga = (sums.imag * inv_m).astype(y.dtype)
            mgb = (sums.real * inv_m).astype(y.dtype)
            gx = (invstd * a) * (dz - (xhat * mga + mgb))
        else:
            gx = dz * (invstd * a)
        if with_gw:
            first = (0, slice(None)) + (0,) * (y.ndim - 2)  # each channel's first element
            rest[-1][...] = sums[first].imag.astype(y.dtype) * np.sign(np.broadcast_to(w, y.shape)[first])
        if with_dz:
            rest[1][...] = dz
        rest[0][...] = gx

    name = f"fused_abn_backward_{'batch' if batch else 'given'}{'_dz' if with_dz else ''}{'_gw' if with_gw else ''}"
    return elementwise(params, outs, op, name, reference, preamble=_ABN_PREAMBLE)


abn_backward = {
    (batch, dz, gw): _abn_backward_kernel(batch, dz, gw)
    for batch in (True, False)
    for dz in (True, False)
    for gw in (True, False)
}
abn_dz = elementwise(
    "T y, T g, T slope",
    "T dz",
    "dz = (y > (T)0 ? (T)1 : slope) * g;",
    "fused_abn_dz",
    lambda y, g, slope, dz: _put(dz, np.where(y > 0, y.dtype.type(1), slope) * g),
)
abn_weight_grad = elementwise(
    "C sums, T w",
    "T gw",
    "gw = (T)sums.imag() * (w > (T)0 ? (T)1 : (w < (T)0 ? (T)-1 : (T)0));",
    "fused_abn_weight_grad",
    lambda sums, w, gw: _put(gw, sums.imag.astype(w.dtype) * np.sign(w)),
)


# --- cross entropy: one kernel each way (plus the batch mean), no host synchronization ----------

_CE_ROW = r"""
T m = x[i * c];
for (long long j = 1; j < c; ++j) m = max(m, x[i * c + j]);
T s = 0, sx = 0;
for (long long j = 0; j < c; ++j) { T v = x[i * c + j] - m; s += exp(v); sx += v; }
lse = m + log(s);
if (t < 0 || t >= c) {
    loss = (T)nan("");  // an out-of-range target: never read outside the row (check_targets reports it)
} else {
    T l = -(x[i * c + t] - m);
    if (eps != 0) { l *= (T)(1.0 - eps); l -= (T)eps * (sx / (T)c); }
    loss = l + log(s);
}
"""


def _ce_forward(x, t, c, eps, loss, lse):
    dt = x.dtype.type
    m = x.max(axis=1)
    shifted = x - m[:, None]
    e = np.exp(shifted)
    s = e.sum(axis=1)
    bad = (t < 0) | (t >= c)
    l_ = -shifted[np.arange(x.shape[0]), np.where(bad, 0, t)]
    if eps != 0:
        l_ = l_ * dt(1.0 - eps) - dt(eps) * (shifted.sum(axis=1) / dt(c))
    lse_ = m + np.log(s)
    loss[...] = np.where(bad, dt(np.nan), l_ + np.log(s))
    lse[...] = lse_


cross_entropy = elementwise(
    "raw T x, S t, int64 c, float64 eps",
    "T loss, T lse",
    _CE_ROW,
    "fused_cross_entropy",
    _ce_forward,
)


def _ce_backward(x, t, lse, g, inv_n, eps, c, gx):
    dt = x.dtype.type
    col = np.arange(x.shape[-1])
    p = np.exp(x - lse)
    hit = np.where(col == t, dt(1.0 - eps), dt(0))
    gx[...] = (p - hit - dt(eps / c)) * (g * inv_n).astype(x.dtype)


cross_entropy_backward = elementwise(
    "T x, S t, T lse, T g, float64 inv_n, float64 eps, int64 c",
    "T gx",
    "T p = exp(x - lse);"
    " gx = (p - ((long long)(i % c) == (long long)t ? (T)(1.0 - eps) : (T)0) - (T)(eps / c)) * (T)(g * inv_n);",
    "fused_cross_entropy_backward",
    _ce_backward,
)


def _first_bad(t, c, axis):
    bad = t[(t < 0) | (t >= c)]
    return np.int64(bad[0] if bad.size else 0)


bad_target = reduction(
    "T t, int64 c",
    "int64 bad",
    "(t < 0 || t >= c) ? (long long)t : 0LL",  # 0 is a valid class: it marks "no bad target"
    "a != 0 ? a : b",
    "bad = a",
    "0",
    "fused_bad_target",
    _first_bad,
)
