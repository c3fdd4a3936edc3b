"""The fused GPU kernels of the Transformer ops: GELU, LayerNorm and attention.

Built with :func:`framework.ops.kernels.elementwise` / :func:`~framework.ops.kernels.reduction`
like every fused kernel of the framework: each is its CUDA source (which real CuPy
compiles) and a NumPy reference (which the CuPy stand-in runs instead, and which follows
the source operation by operation), with what its call sites pass it (``Takes``). The
source compiles for float16 and bfloat16 too: arithmetic runs in the opmath type
``opmath<T>::type`` (float for half types and float32, double for float64; the
references in :func:`~framework.ops.kernels.opmath_dtype`), every conversion is an
explicit cast, and both arms of a ternary have one type.

- GELU (exact and tanh): one kernel each way.
- LayerNorm over the trailing dims: forward one reduction for each row's ``(sum x,
  sum x^2)`` (complex128, summed in double precision) and one elementwise kernel; backward
  one reduction per row (``sum w g``, ``sum w g x_hat``), one per feature (``sum g``,
  ``sum g x_hat``) and one elementwise kernel that also writes the weight's and bias's
  gradients (by the threads of the first row). In the memory-efficient mode
  (Apex's ``FusedLayerNorm(memory_efficient=True)``) the kernels rebuild ``x_hat`` from
  the output: ``(y - bias) / weight``.
- Attention (:mod:`framework.ops.attention`, the fallback where cuDNN's SDPA does not
  run): one row kernel turns raw scores into probabilities (scale, causal mask, softmax
  from ``max`` and ``log(sum exp)``, dropout) and keeps each row's log-sum-exp; backward
  recomputes the probabilities from it (one kernel), takes ``D = rowsum(dO * O)`` (one
  reduction) and the scores' gradient (one kernel). The dropout mask is never stored:
  ``keep(seed, index)`` is a counter-based hash (SplitMix64's finalizer), as
  FlashAttention and cuDNN regenerate theirs from a Philox seed and offset.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .kernels import (
    _OPMATH,
    CUB_UNREAD_J,
    FLOATS,
    INTEGERS,
    LAYOUTS,
    Takes,
    dtype_of,
    each,
    elementwise,
    moments,
    opmath_dtype,
    pair,
    reduction,
)

__all__ = ["keep_mask"]

# What the call sites pass (each kernel's ``Takes``, see framework/ops/kernels.py). The ops
# take every floating dtype (``is_floating``: bfloat16 too); ``F`` is the type a kernel
# keeps a per-row value in (attention's log-sum-exp, its D = rowsum(dO * O)): the opmath
# type, float32 for half types.
_ANY_FLOAT = each(T=FLOATS)
_WITH_OPMATH = tuple({"T": t, "F": opmath_dtype(dtype_of(t)).name} for t in FLOATS)
# A tensor's values as they come: contiguous, a strided view; 0-d where the op takes it.
_NOT_0D = ("contiguous", "strided")


def _put(out, value):
    out[...] = value


# --- GELU ---------------------------------------------------------------------------------------

_SQRT1_2 = 0.7071067811865476  # 1 / sqrt(2)
_INV_SQRT_2PI = 0.3989422804014327  # 1 / sqrt(2 pi)
_SQRT_2_PI = 0.7978845608028654  # sqrt(2 / pi)
_KAPPA = 0.044715


def _erf_(v):
    """``erf`` in place on a float32/float64 array (the accumulation types)."""
    from scipy.special import erf  # noqa: PLC0415  (SciPy's import is slow: loaded when GELU first runs)

    return erf(v, out=v)


def _tanh_inner(v, out):
    """``tanh(sqrt(2/pi) (v + 0.044715 v^3))`` into ``out``, as the kernel orders it."""
    np.multiply(v, _KAPPA, out=out)
    out *= v
    out *= v
    out += v
    out *= _SQRT_2_PI
    return np.tanh(out, out=out)


def gelu_reference(x, approximate: str):
    """GELU of ``x`` in its accumulation type (what the kernels compute, before the cast):
    one new array, written in place (a GELU input is 4 times a block's width: temporaries
    count). ``0.5 v (1 + f)`` is taken as ``v (1 + f) 0.5``: scaling by 0.5 is exact."""
    v = x.astype(opmath_dtype(x.dtype), copy=False)
    out = np.empty_like(v)
    if approximate == "tanh":
        _tanh_inner(v, out)
    else:
        np.multiply(v, _SQRT1_2, out=out)
        _erf_(out)
    out += 1
    out *= v
    out *= 0.5
    return out


def gelu_derivative_reference(x, approximate: str, g=None):
    """d GELU / dx in the accumulation type (times ``g`` when given), in two new arrays
    (three for tanh), written in place."""
    v = x.astype(opmath_dtype(x.dtype), copy=False)
    d, t = np.empty_like(v), np.empty_like(v)
    if approximate == "tanh":
        _tanh_inner(v, d)  # t = tanh(u)
        np.multiply(v, 3 * _KAPPA, out=t)  # du = sqrt(2/pi) (1 + 3 k v^2)
        t *= v
        t += 1
        t *= _SQRT_2_PI
        sq = np.multiply(d, d, out=np.empty_like(d))  # out=: an array also for 0-d
        np.subtract(1, sq, out=sq)
        t *= sq  # (1 - t^2) du
        del sq
        t *= v
        t *= 0.5
        d += 1
        d *= 0.5  # 0.5 (1 + t)
        d += t
    else:
        np.multiply(v, _SQRT1_2, out=d)
        _erf_(d)
        d += 1
        d *= 0.5  # cdf
        np.multiply(v, -0.5, out=t)
        t *= v
        np.exp(t, out=t)
        t *= _INV_SQRT_2PI  # pdf
        t *= v
        d += t
    if g is not None:
        d *= g.astype(d.dtype, copy=False)
    return d


_GELU_SOURCE = {
    "none": f"typedef opmath<T>::type A; A v = (A)x; y = (T)((A)0.5 * v * ((A)1 + erf(v * (A){_SQRT1_2!r})));",
    "tanh": "typedef opmath<T>::type A; A v = (A)x;"
    f" A inner = (A){_SQRT_2_PI!r} * (v + (A){_KAPPA!r} * v * v * v);"
    " y = (T)((A)0.5 * v * ((A)1 + tanh(inner)));",
}
_GELU_BACKWARD_SOURCE = {
    "none": "typedef opmath<T>::type A; A v = (A)x;"
    f" A cdf = (A)0.5 * ((A)1 + erf(v * (A){_SQRT1_2!r}));"
    f" A pdf = exp((A)-0.5 * v * v) * (A){_INV_SQRT_2PI!r};"
    " gx = (T)((A)g * (cdf + v * pdf));",
    "tanh": "typedef opmath<T>::type A; A v = (A)x;"
    f" A t = tanh((A){_SQRT_2_PI!r} * (v + (A){_KAPPA!r} * v * v * v));"
    f" A du = (A){_SQRT_2_PI!r} * ((A)1 + (A){3 * _KAPPA!r} * v * v);"
    " A d = (A)0.5 * ((A)1 + t) + (A)0.5 * v * (((A)1 - t * t) * du);"
    " gx = (T)((A)g * d);",
}

gelu = {
    a: elementwise(
        "T x",
        "T y",
        _GELU_SOURCE[a],
        f"fused_gelu_{a}",
        lambda x, y, a=a: _put(y, gelu_reference(x, a)),
        Takes(_ANY_FLOAT, layouts=LAYOUTS),
        preamble=_OPMATH,
    )
    for a in ("none", "tanh")
}
gelu_backward = {
    a: elementwise(
        "T g, T x",
        "T gx",
        _GELU_BACKWARD_SOURCE[a],
        f"fused_gelu_{a}_backward",
        lambda g, x, gx, a=a: _put(gx, gelu_derivative_reference(x, a, g)),
        Takes(_ANY_FLOAT, layouts=LAYOUTS),
        preamble=_OPMATH,
    )
    for a in ("none", "tanh")
}


# --- LayerNorm ----------------------------------------------------------------------------------

#: The memory-efficient LayerNorm rebuilds ``x_hat_j = (y - bias_j) / weight_j`` only where
#: ``|weight_j|`` is a normal number of the dtype and ``|bias_j| <= REBUILD_BIAS_RATIO
#: |weight_j|``: the output's rounding then moves it by at most ``u (|x_hat| + ratio)``
#: (framework/ops/layer_norm.py says what happens elsewhere).
REBUILD_BIAS_RATIO = 16.0


def rebuild_trusted(w, b, dtype):
    """Where (per feature) the memory-efficient mode may rebuild x_hat from the output: the
    test of :data:`REBUILD_BIAS_RATIO` on the weight and bias values ``w`` and ``b``."""
    aw, ab = np.abs(np.asarray(w, np.float64)), np.abs(np.asarray(b, np.float64))
    return (aw >= float(ml_dtypes.finfo(dtype).smallest_normal)) & (ab <= REBUILD_BIAS_RATIO * aw)


_LN_PREAMBLE = (
    _OPMATH
    + r"""
__device__ inline void ln_stats(const complex<double>& st, double inv_n, double eps, double& mean, double& rstd) {
    mean = st.real() * inv_n;
    rstd = rsqrt(max(st.imag() * inv_n - mean * mean, 0.0) + eps);
}
template <typename T> __device__ inline double smallest_normal();
template <> __device__ inline double smallest_normal<float16>() { return 6.103515625e-05; }
template <> __device__ inline double smallest_normal<bfloat16>() { return 1.1754943508222875e-38; }
template <> __device__ inline double smallest_normal<float>() { return 1.1754943508222875e-38; }
template <> __device__ inline double smallest_normal<double>() { return 2.2250738585072014e-308; }
// The memory-efficient mode's x_hat, rebuilt from the output where the weight and bias allow
// it (rebuild_trusted), else NaN: the kernels refuse such a feature (no host read to do more).
template <typename T> __device__ inline typename opmath<T>::type ln_rebuilt(T y, T b, T w) {
    typedef typename opmath<T>::type A;
    double aw = fabs((double)(A)w), ab = fabs((double)(A)b);
    bool trusted = aw >= smallest_normal<T>() && ab <= """
    + repr(REBUILD_BIAS_RATIO)
    + r""" * aw;
    return trusted ? (A)(((A)y - (A)b) / (A)w) : (A)__longlong_as_double(0x7ff8000000000000LL);
}
"""
)


def ln_stats(st, inv_n, eps):
    """NumPy's ``ln_stats``: each row's (mean, 1 / sqrt(var + eps)) in float64 from its sums."""
    mean = st.real * inv_n
    return mean, 1.0 / np.sqrt(np.maximum(st.imag * inv_n - mean * mean, 0.0) + eps)


# ``xin``: a name no other identifier of the expression contains (CuPy's CUB path renames a
# reduction's first input by text replacement).
ln_moments = reduction(
    "T xin",
    "complex128 st",
    "complex<double>((double)(opmath<T>::type)xin, (double)(opmath<T>::type)xin * (double)(opmath<T>::type)xin)",
    "a + b",
    "st = a",
    "0",
    "fused_ln_moments",
    moments,
    Takes(_ANY_FLOAT, warnings=CUB_UNREAD_J),
    reduce_type="complex<double>",
    preamble=_OPMATH,
)


def _ln_forward(x, st, inv_n, eps, w, b, y):
    a = opmath_dtype(x.dtype)
    mean, rstd = ln_stats(st, inv_n, eps)
    y[...] = (x.astype(a) - mean.astype(a)) * rstd.astype(a) * np.asarray(w).astype(a) + np.asarray(b).astype(a)


ln_forward = elementwise(
    "T xin, complex128 st, float64 inv_n, float64 eps, T win, T bin",
    "T y",
    "double mean, rstd; ln_stats(st, inv_n, eps, mean, rstd); typedef opmath<T>::type A;"
    " y = (T)(((A)xin - (A)mean) * (A)rstd * (A)win + (A)bin);",
    "fused_ln_forward",
    _ln_forward,
    # x in any layout, the row sums broadcast over it (contiguous all: one normalized
    # value per row); no weight or bias: 1 and 0 as scalars
    Takes(_ANY_FLOAT, layouts=_NOT_0D, scalars=("inv_n", "eps"), either=("win", "bin")),
    preamble=_LN_PREAMBLE,
)

# How the backward kernels get x_hat: from the input and the row statistics, or (the
# memory-efficient mode) from the output: (y - bias) / weight.
_XHAT = {
    False: ("T xin, complex128 st, float64 inv_n, float64 eps", "((A)xin - (A)mean) * (A)rstd"),
    True: ("T yin, T bin, complex128 st, float64 inv_n, float64 eps", "ln_rebuilt<T>(yin, bin, win)"),
}


def _xhat(me, a, src, st, inv_n, eps, w, b):
    """NumPy's x_hat in the accumulation type ``a`` (``src`` is x, or y when ``me``)."""
    if me:
        with np.errstate(divide="ignore", invalid="ignore"):
            xh = (src.astype(a) - np.asarray(b).astype(a)) / np.asarray(w).astype(a)
        return np.where(rebuild_trusted(w, b, src.dtype), xh, a.type(np.nan))
    mean, rstd = ln_stats(st, inv_n, eps)
    return (src.astype(a) - mean.astype(a)) * rstd.astype(a)


def _ln_sums_takes(me: bool) -> Takes:
    """The backward reductions' call sites: no weight (or, memory-efficient, no bias) is
    passed as a scalar (1, 0)."""
    return Takes(_ANY_FLOAT, scalars=("inv_n", "eps"), either=("win", "bin") if me else ("win",))


def _ln_sums_kernel(me: bool, per_row: bool):
    """The backward's sums of ``(q, q x_hat)``: per row with ``q = w g`` (``per_row``, for
    x's gradient), per feature with ``q = g`` (the weight's and bias's gradients)."""
    params, _ = _XHAT[me]

    def reference(g, w, src, *rest, axis):
        b, (st, inv_n, eps) = (rest[0], rest[1:]) if me else (None, rest)
        a = opmath_dtype(g.dtype)
        q = g.astype(a) * np.asarray(w).astype(a) if per_row else g.astype(a)
        xh = _xhat(me, a, src, st, inv_n, eps, w, b)
        qd = q.astype(np.float64)
        return pair(qd.sum(axis), (qd * xh.astype(np.float64)).sum(axis))

    what = "row" if per_row else "feature"
    return reduction(
        "T gin, T win, " + params,
        "complex128 r",
        f"ln_sum_terms<T>(gin, win, {'yin, bin' if me else 'xin, xin'}, st, inv_n, eps, {int(me)}, {int(per_row)})",
        "a + b",
        "r = a",
        "0",
        f"fused_ln_{what}_sums{'_me' if me else ''}",
        reference,
        _ln_sums_takes(me),
        reduce_type="complex<double>",
        preamble=_LN_PREAMBLE + _LN_TERMS,
    )


# (q, q x_hat) of one element, in double precision, for the sums: q = w g (by_w) or g.
_LN_TERMS = r"""
template <typename T>
__device__ inline complex<double> ln_sum_terms(T g, T w, T src, T bsrc, const complex<double>& st, double inv_n,
                                               double eps, int me, int by_w) {
    typedef typename opmath<T>::type A;
    double mean, rstd; ln_stats(st, inv_n, eps, mean, rstd);
    A xhat = me ? ln_rebuilt<T>(src, bsrc, w) : (A)(((A)src - (A)mean) * (A)rstd);
    A q = by_w ? (A)((A)g * (A)w) : (A)g;
    return complex<double>((double)q, (double)q * (double)xhat);
}
"""


ln_row_sums = {me: _ln_sums_kernel(me, per_row=True) for me in (False, True)}
ln_feature_sums = {me: _ln_sums_kernel(me, per_row=False) for me in (False, True)}


def _ln_backward_kernel(me: bool, affine: bool):
    """x's gradient ``rstd * (w g - mean(w g) - x_hat * mean(w g x_hat))``; with ``affine``
    also the weight's (``sum g x_hat``) and bias's (``sum g``) gradients, from the feature
    sums ``f``, written by the threads of the first row (``i < nf``: the loop runs in C
    order over x's shape, whose trailing dims are the normalized ones)."""
    params, xhat = _XHAT[me]
    params = "T gin, T win, " + params + ", complex128 r"
    outs = "T gx"
    op = (
        "double mean, rstd; ln_stats(st, inv_n, eps, mean, rstd); typedef opmath<T>::type A;"
        f" A xhat = (A)({xhat}); A wg = (A)gin * (A)win;"
        " gx = (T)((A)rstd * (wg - (A)(r.real() * inv_n) - xhat * (A)(r.imag() * inv_n)));"
    )
    if affine:
        params += ", raw complex128 f, int64 nf"
        outs += ", raw T gw, raw T gb"
        op += " if (i < nf) { gw[i] = (T)f[i].imag(); gb[i] = (T)f[i].real(); }"

    def reference(g, w, src, *rest):
        rest = list(rest)
        b = rest.pop(0) if me else None
        st, inv_n, eps, r = rest[:4]
        a = opmath_dtype(g.dtype)
        mean, rstd = ln_stats(st, inv_n, eps)
        xh = _xhat(me, a, src, st, inv_n, eps, w, b)
        wg = g.astype(a) * np.asarray(w).astype(a)
        gx = rstd.astype(a) * (wg - (r.real * inv_n).astype(a) - xh * (r.imag * inv_n).astype(a))
        if affine:
            f, _, gx_out, gw, gb = rest[4:]
            gw[...] = f.imag.reshape(gw.shape).astype(gw.dtype)
            gb[...] = f.real.reshape(gb.shape).astype(gb.dtype)
        else:
            (gx_out,) = rest[4:]
        gx_out[...] = gx

    name = f"fused_ln_backward{'_me' if me else ''}{'_affine' if affine else ''}"
    takes = Takes(
        _ANY_FLOAT,
        layouts=_NOT_0D,
        scalars=("inv_n", "eps") + (("nf",) if affine else ()),
        either=("win", "bin") if me else ("win",),
        raw={"f": 1, "gw": 1, "gb": 1} if affine else {},  # the normalized shape's values, flat
    )
    return elementwise(params, outs, op, name, reference, takes, preamble=_LN_PREAMBLE)


ln_backward = {(me, affine): _ln_backward_kernel(me, affine) for me in (False, True) for affine in (False, True)}

ln_affine_grads = elementwise(
    "complex128 f",
    "T gw, T gb",
    "gw = (T)f.imag(); gb = (T)f.real();",
    "fused_ln_affine_grads",
    lambda f, gw, gb: (_put(gw, f.imag), _put(gb, f.real)),
    Takes(_ANY_FLOAT, layouts=("contiguous",)),  # three new arrays of the normalized shape
)


# --- attention ----------------------------------------------------------------------------------

_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_U53 = float(2**53)

_ATTN_PREAMBLE = (
    _OPMATH
    + rf"""
__device__ inline unsigned long long attn_seed(double u) {{ return (unsigned long long)(u * {_U53!r}); }}
// SplitMix64's finalizer of (seed + index * golden): uniform bits per element, the same on
// every launch, so backward regenerates forward's dropout mask instead of reading it.
__device__ inline bool attn_keep(unsigned long long seed, unsigned long long idx, double p) {{
    unsigned long long z = seed + idx * {_GOLDEN}ULL;
    z = (z ^ (z >> 30)) * {_MIX1}ULL;
    z = (z ^ (z >> 27)) * {_MIX2}ULL;
    z = z ^ (z >> 31);
    return (float)(z >> 40) * (1.0f / 16777216.0f) >= (float)p;
}}
"""
)


def keep_mask(useed, shape, p: float, xp=np, index=None):
    """Which elements a dropout of probability ``p`` keeps (a bool array of ``shape``):
    ``attn_keep`` of the kernels for each element's C-order index in the whole scores
    (``index``: those indices, for a chunk of them; default ``0 .. size - 1``), with the
    seed ``attn_seed`` makes of the draw ``useed`` (a float64 array of one uniform in
    [0, 1), on ``xp``'s device: nothing is read back to the host). Two uint64 buffers,
    written in place."""
    seed = (useed.reshape(()) * _U53).astype(xp.uint64)
    if index is None:
        z = xp.arange(int(np.prod(shape)), dtype=xp.uint64)
    else:
        z = xp.array(xp.broadcast_to(index, shape), dtype=xp.uint64).reshape(-1)
    t = xp.empty_like(z)
    with np.errstate(over="ignore"):
        z *= xp.uint64(_GOLDEN)
        z += seed
        for shift, mix in ((30, _MIX1), (27, _MIX2), (31, None)):
            xp.right_shift(z, xp.uint64(shift), out=t)
            xp.bitwise_xor(z, t, out=z)
            if mix is not None:
                z *= xp.uint64(mix)
        xp.right_shift(z, xp.uint64(40), out=t)
    del z
    u = t.astype(xp.float32)
    del t
    u *= xp.float32(1.0 / 16777216.0)
    return (u >= xp.float32(p)).reshape(shape)


def dropout_scale(p: float) -> float:
    """What a kept value is multiplied by: ``1 / (1 - p)`` (0 when everything is dropped)."""
    return 1.0 / (1.0 - p) if p < 1 else 0.0


def causal_allowed(shape, xp=np, row0=0):
    """Where a top-left causal mask lets scores of ``shape`` (..., L, S) through: column <= row
    (the first row being row ``row0``: a chunk's)."""
    rows, cols = shape[-2], shape[-1]
    return xp.arange(cols)[None, :] <= xp.arange(row0, row0 + rows)[:, None]


def attention_probs_reference(sc, scale, causal, p, useed, index=None):
    """Probabilities (after dropout) and each row's log-sum-exp of raw scores ``sc``
    (..., L, S), in the accumulation type: what ``attn_softmax`` computes (``index``: the
    scores' indices in the whole, for a chunk's dropout mask: :func:`keep_mask`).

    A fully masked row (every score -inf) keeps +inf as its log-sum-exp, so that every
    ``exp(score - lse)`` of it, here and in backward, is 0: its output is zeros and its
    gradients are finite, as PyTorch's (softmax of -inf everywhere would be NaN)."""
    a = opmath_dtype(sc.dtype)
    s = sc.astype(a) * a.type(scale)
    if causal:
        s = np.where(causal_allowed(s.shape), s, a.type(-np.inf))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        m = s.max(axis=-1, keepdims=True)
        total = np.exp(s - m).sum(axis=-1, keepdims=True)
        lse = np.where(m == -np.inf, a.type(np.inf), m + np.log(total))
        probs = np.exp(s - lse)
    if p > 0:
        keep = keep_mask(np.asarray(useed), s.shape, p, index=index)
        probs = np.where(keep, probs, a.type(0)) * a.type(dropout_scale(p))
    return probs, lse[..., 0]


def _attn_softmax(sc, n, lq, scale, causal, p, useed, pr, lse):
    probs, l_ = attention_probs_reference(sc.reshape(-1, lq, n), scale, bool(causal), float(p), useed)
    pr.reshape(-1, lq, n)[...] = probs
    lse.reshape(-1, lq)[...] = l_


# One thread per row of scores (``size=`` rows): its max, its sum of exponentials, then the
# probabilities written from the log-sum-exp, dropout applied. A fully masked row (its max
# -inf) keeps +inf as its log-sum-exp: its probabilities, here and in backward, are 0.
attn_softmax = elementwise(
    "raw T sc, int64 n, int64 lq, float64 scale, int32 causal, float64 p, raw float64 useed",
    "raw T pr, raw F lse",
    "typedef opmath<T>::type A;"
    " long long row = i; long long lim = causal ? min((long long)(row % lq) + 1, n) : n;"
    " A m = (A)sc[row * n] * (A)scale;"
    " for (long long j = 1; j < lim; ++j) m = max(m, (A)((A)sc[row * n + j] * (A)scale));"
    " A s = (A)0;"
    " for (long long j = 0; j < lim; ++j) s += exp((A)sc[row * n + j] * (A)scale - m);"
    " A l = isinf(m) && m < (A)0 ? -m : m + log(s); lse[row] = (F)l;"
    " unsigned long long seed = p > 0.0 ? attn_seed(useed[0]) : 0ULL;"
    " A ks = p < 1.0 ? (A)(1.0 / (1.0 - p)) : (A)0;"
    " for (long long j = 0; j < n; ++j) {"
    "   A v = j < lim ? (A)exp((A)sc[row * n + j] * (A)scale - l) : (A)0;"
    "   if (p > 0.0) v = attn_keep(seed, (unsigned long long)(row * n + j), p) ? (A)(v * ks) : (A)0;"
    "   pr[row * n + j] = (T)v; }",
    "fused_attn_softmax",
    _attn_softmax,
    # every array raw and flat (a loop of ``size=`` rows)
    Takes(
        _WITH_OPMATH,
        scalars=("n", "lq", "scale", "causal", "p"),
        raw={"sc": 1, "useed": 1, "pr": 1, "lse": 1},
    ),
    preamble=_ATTN_PREAMBLE,
)


def _masked_probs(sc, lse, n, lq, scale, causal, p, useed):
    """Backward's probabilities from the log-sum-exp, before dropout (and the keep mask)."""
    a = opmath_dtype(sc.dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        probs = np.exp(sc.astype(a) * a.type(scale) - lse.astype(a))
    if causal:
        probs = np.where(causal_allowed(sc.shape), probs, a.type(0))
    keep = keep_mask(np.asarray(useed), sc.shape, p) if p > 0 else None
    return probs, keep


def _attn_probs(sc, lse, n, lq, scale, causal, p, useed, pd):
    probs, keep = _masked_probs(sc, lse, n, lq, scale, bool(causal), float(p), useed)
    if keep is not None:
        probs = np.where(keep, probs, probs.dtype.type(0)) * probs.dtype.type(dropout_scale(p))
    pd[...] = probs


_ATTN_ELEMENT = (
    "typedef opmath<T>::type A; long long j = i % n; long long q = (i / n) % lq;"
    " A prob = (causal && j > q) ? (A)0 : (A)exp((A)sc * (A)scale - (A)lse);"
    " unsigned long long seed = p > 0.0 ? attn_seed(useed[0]) : 0ULL;"
    " A ks = p < 1.0 ? (A)(1.0 / (1.0 - p)) : (A)0;"
    " bool kept = p > 0.0 ? attn_keep(seed, (unsigned long long)i, p) : true;"
)

# The probabilities again, dropout applied, from the scores and the log-sum-exp (``sc``
# (..., L, S) in C order, so ``i`` is the element's index as forward's row kernel counted it).
attn_probs = elementwise(
    "T sc, F lse, int64 n, int64 lq, float64 scale, int32 causal, float64 p, raw float64 useed",
    "T pd",
    _ATTN_ELEMENT + " pd = (T)(kept ? (A)(prob * (p > 0.0 ? ks : (A)1)) : (A)0);",
    "fused_attn_probs",
    _attn_probs,
    # the log-sum-exp broadcast over the scores' rows (contiguous all: one key)
    Takes(_WITH_OPMATH, layouts=_NOT_0D, scalars=("n", "lq", "scale", "causal", "p"), raw={"useed": 1}),
    preamble=_ATTN_PREAMBLE,
)


def _attn_scores_grad(sc, lse, dpd, dlt, n, lq, scale, post, causal, p, useed, ds):
    probs, keep = _masked_probs(sc, lse, n, lq, scale, bool(causal), float(p), useed)
    a = probs.dtype.type
    dp = dpd.astype(probs.dtype)
    if keep is not None:
        dp = np.where(keep, dp * a(dropout_scale(p)), a(0))
    ds[...] = probs * (dp - dlt.astype(probs.dtype)) * a(post)


# The scores' gradient P * (dP - D) * post, with dP the probabilities' gradient through the
# dropout and D = rowsum(dO * O) = rowsum(P * dP) (FlashAttention's identity).
attn_scores_grad = elementwise(
    "T sc, F lse, T dpd, F dlt, int64 n, int64 lq, float64 scale, float64 post, int32 causal, float64 p,"
    " raw float64 useed",
    "T ds",
    _ATTN_ELEMENT + " A dp = kept ? (A)((A)dpd * (p > 0.0 ? ks : (A)1)) : (A)0;"
    " ds = (T)(prob * (dp - (A)dlt) * (A)post);",
    "fused_attn_scores_grad",
    _attn_scores_grad,
    Takes(_WITH_OPMATH, layouts=_NOT_0D, scalars=("n", "lq", "scale", "post", "causal", "p"), raw={"useed": 1}),
    preamble=_ATTN_PREAMBLE,
)


def _attn_delta(do, o, axis):
    a = opmath_dtype(do.dtype)
    return (do.astype(a).astype(np.float64) * o.astype(a).astype(np.float64)).sum(axis)


attn_delta = reduction(
    "T dout, T oin",
    "F dlt",
    "(double)(opmath<T>::type)dout * (double)(opmath<T>::type)oin",
    "a + b",
    "dlt = (F)a",
    "0",
    "fused_attn_delta",
    _attn_delta,
    Takes(_WITH_OPMATH),
    reduce_type="double",
    preamble=_OPMATH,
)


# --- causal masks: tril / triu ---------------------------------------------------------------------


# tril and triu take a tensor of any dtype (a causal mask is often bool or float); at least 2-d.
_EVERY_DTYPE = FLOATS + INTEGERS + ("bool", "complex64", "complex128")


def _tri(upper: bool):
    def reference(x, m, n, k, y):
        rows = np.arange(int(m))[:, None]
        cols = np.arange(int(n))[None, :]
        keep = (cols - rows >= k) if upper else (cols - rows <= k)
        y[...] = np.where(keep, x, x.dtype.type(0))

    cond = "c - r >= k" if upper else "c - r <= k"
    return elementwise(
        "T x, int64 m, int64 n, int64 k",
        "T y",
        f"long long c = i % n; long long r = (i / n) % m; y = ({cond}) ? (T)x : (T)0;",
        f"fused_{'triu' if upper else 'tril'}",
        reference,
        Takes(each(T=_EVERY_DTYPE), layouts=_NOT_0D, scalars=("m", "n", "k")),
    )


tril = _tri(False)
triu = _tri(True)


# --- embedding's backward: a deterministic gather --------------------------------------------
#
# Each weight-gradient element sums, in index order, the output gradients of the positions that
# picked its row (padding_idx's row: none). A scatter-add (``cupyx.scatter_add``) adds repeated
# indices with atomics, in an order that changes from call to call: two runs of a GPT step
# differed in the last bit on an H200, so a compiled step was not bitwise eager's. Each thread
# scans every index, so the kernel is for the vocabularies and batches it pays for (the op
# decides: framework/ops/embedding.py).


def _embedding_backward(g, idx, n, d, pad, gw):
    acc = np.zeros(gw.shape, opmath_dtype(gw.dtype))
    rows = idx.reshape(-1)[: int(n)]
    keep = (rows != pad) & (rows >= 0) & (rows < gw.shape[0])  # an index out of range picks no row
    np.add.at(acc, rows[keep], g.reshape(int(n), int(d))[keep].astype(acc.dtype))  # in index order
    gw[...] = acc


embedding_backward = elementwise(
    "raw T g, raw I idx, int64 n, int64 d, int64 pad",
    "T gw",
    "typedef typename opmath<T>::type A;"
    " const long long v = i / d, c = i % d;"
    " A acc = (A)0;"
    " if (v != pad) {"
    "   for (long long k = 0; k < n; ++k) {"
    "     if ((long long)idx[k] == v) acc += (A)g[k * d + c];"
    "   }"
    " }"
    " gw = (T)acc;",
    "fused_embedding_backward",
    _embedding_backward,
    Takes(
        each(T=FLOATS, I=("int32", "int64")), layouts=("contiguous",), scalars=("n", "d", "pad"), raw={"g": 2, "idx": 1}
    ),
    preamble=_OPMATH,
)
