"""GELU's CPU kernels in float32 (and half types, computed in float32): NumPy ufuncs only.

``gelu(x) = x Phi(x)``, ``gelu'(x) = Phi(x) + x phi(x)``, with ``Phi`` the standard normal
CDF and ``phi`` its density. SciPy's ``erf`` is a scalar loop (about 11 ns an element
here, 40x NumPy's SIMD ``exp``), so ``Phi`` is written with ufuncs that NumPy vectorizes:

    Phi(-a) = exp(-a^2 / 2) S(a),  a = |x|,  S(a) = sum_k c_k t^k,  t = 4 / (4 + a),

and ``Phi(x) = 1 - Phi(-x)`` for ``x > 0``. ``S(a) = Phi(-a) exp(a^2 / 2)`` (the Mills
ratio over ``sqrt(2 pi)``) is smooth from 0.5 at 0 to ``1 / (a sqrt(2 pi))``: a polynomial
of degree 9 in ``t`` holds it to 2.4e-8 relative on ``[0, 14.5]`` (beyond, ``exp``
underflows). The coefficients are a minimax fit (Lawson's iteratively reweighted least
squares in float64 on 44,000 points), rounded to float32 one at a time from the highest,
the rest fitted again after each; in float32 arithmetic their sum, ``S(0)``, is 0.5
exactly (so are ``Phi(0)`` and ``gelu'(0)``). ``tests/framework/ops/test_gelu_cpu.py``
checks the fit. Writing ``Phi(-a)`` as a product, not as ``1 + erf``, keeps its relative accuracy
in the lower tail, where ``0.5 (1 + erf(x / sqrt 2))`` cancels to 0 (PyTorch's GELU is
0 there below x = -5.6; this one follows the true value down to float32's smallest).
Backward reuses ``exp(-x^2 / 2)`` for ``phi``.

Accuracy against float64 (measured, and held by the tests): ``Phi``, GELU and its
derivative within ``(12 + 1.5 x^2)`` units of 2^-24, relative: about 5 units in the last
place for ``|x| <= 1`` (the polynomial and float32 Horner arithmetic), growing with ``x^2``
beyond (the rounding of ``x^2`` inside ``exp``). PyTorch's own CPU GELU is within about 6
units of 2^-24 for ``x >= 0`` and accurate only absolutely below 0.

The arrays are walked in cache-sized blocks through per-thread scratch buffers
(:func:`framework.backend.scratch`), so a call allocates nothing but its result. The GPU
keeps its fused kernels (:mod:`.kernels_transformer`); float64 keeps SciPy's ``erf``
(their NumPy reference), whose accuracy float64 needs.
"""

from __future__ import annotations

import numpy as np

from ..backend import ADD_SCALED_BLOCK, scratch
from ..memory import is_dense

BLOCK = ADD_SCALED_BLOCK
_F32 = np.dtype(np.float32)
# S(a) = sum_k C[k] t^k, t = 4 / (4 + a) (float32 values; S(0) is 0.5 exactly in float32 Horner arithmetic)
_C = tuple(
    np.float32(c)
    for c in (
        -1.9856164726661518e-05,
        0.10019536316394806,
        0.0950988233089447,
        0.12026692926883698,
        -0.016605040058493614,
        0.29739922285079956,
        -0.3248741924762726,
        0.3884926438331604,
        -0.19337975978851318,
        0.03342586010694504,
    )
)
_INV_SQRT_2PI = np.float32(0.3989422804014327)
_FOUR, _ONE, _MINUS_HALF, _MINUS_TWO = np.float32(4), np.float32(1), np.float32(-0.5), np.float32(-2)


def _cdf(x, phi, e, h, s):
    """``Phi(x)`` into ``phi`` and ``exp(-x^2 / 2)`` into ``e`` (float32 blocks of one size;
    ``h`` and ``s`` are scratch)."""
    np.abs(x, out=e)
    e += _FOUR
    np.divide(_FOUR, e, out=e)  # t
    np.multiply(e, _C[-1], out=phi)
    for c in _C[-2:0:-1]:
        phi += c
        phi *= e
    phi += _C[0]  # S(|x|)
    with np.errstate(over="ignore"):  # |x| > 1.8e19: x^2 is inf, exp(-inf) = 0, the right limit
        np.multiply(x, x, out=e)
    e *= _MINUS_HALF
    np.exp(e, out=e)
    phi *= e  # Phi(-|x|)
    # Phi(x) = h + (1 - 2h) Phi(-|x|), h = [x > 0]: 1 - Phi(-x) above 0 (one rounding), exact
    # below; arithmetic, as a masked ufunc (where=) or np.where on a sign pattern runs 10x slower
    np.greater(x, 0, out=h, casting="unsafe")
    np.multiply(h, _MINUS_TWO, out=s)
    s += _ONE
    phi *= s
    phi += h


def _blend_scratch(n):
    return scratch(_F32, n, "gelu_h"), scratch(_F32, n, "gelu_s")


def _dense_like(a, like):
    out = np.empty_like(like, dtype=a.dtype)
    np.copyto(out, a)
    return out


def _walk(out, *inputs):
    """Blocks ``(out_block, *input_blocks, n)`` of dense ``out`` and the inputs in its order."""
    flats = [np.ravel(out, order="K")]
    for a in inputs:
        if a.strides != out.strides or a.itemsize != out.itemsize:
            a = _dense_like(a, out)
        flats.append(np.ravel(a, order="K"))
    n = out.size
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        yield (*(f[start:stop] for f in flats), stop - start)


def _as_float32(block, n, slot):
    """A float32 block: ``block`` itself, or converted into a scratch buffer (half types)."""
    if block.dtype == _F32:
        return block
    buf = scratch(_F32, n, slot)
    np.copyto(buf, block, casting="unsafe")
    return buf


def _result(out, like, dtype):
    """``out`` where it can take the blocks (laid out as ``like``), else a new array so laid out."""
    if out is not None and out.dtype == dtype and out.shape == like.shape and out.strides == like.strides:
        if is_dense(out):
            return out
    return np.empty_like(like, dtype=dtype)


def gelu(x, out=None):
    """``x Phi(x)`` of a float32 or half-type array, into ``out`` (when laid out as ``x``) or
    a new array of ``x``'s dtype and layout; returns it (copy it into ``out`` if it is not)."""
    y = _result(out, x, x.dtype)
    for yb, xb, n in _walk(y, x):
        v = _as_float32(xb, n, "gelu_x")
        phi, e = scratch(_F32, n, "gelu_phi"), scratch(_F32, n, "gelu_e")
        _cdf(v, phi, e, *_blend_scratch(n))
        if yb.dtype == _F32:
            np.multiply(v, phi, out=yb)
        else:
            np.copyto(yb, np.multiply(v, phi, out=phi), casting="unsafe")
    return y


def gelu_backward(g, x, out=None):
    """``g gelu'(x)``, into ``out`` (when laid out as ``x``; ``g`` itself may be it) or a new
    array of ``g``'s dtype laid out as ``x``; returns it."""
    gx = _result(out, x, g.dtype)
    for gxb, xb, gb, n in _walk(gx, x, g):
        v = _as_float32(xb, n, "gelu_x")
        phi, e = scratch(_F32, n, "gelu_phi"), scratch(_F32, n, "gelu_e")
        _cdf(v, phi, e, *_blend_scratch(n))
        e *= v
        e *= _INV_SQRT_2PI  # x phi(x)
        phi += e
        phi *= _as_float32(gb, n, "gelu_g")
        np.copyto(gxb, phi, casting="unsafe")
    return gx


def normal_cdf(x):
    """``Phi(x)`` of a float32 array (what GELU computes with): a new float32 array."""
    x = np.asarray(x, dtype=_F32)
    out = np.empty_like(x)
    for pb, xb, n in _walk(out, x):
        _cdf(xb, pb, scratch(_F32, n, "gelu_e"), *_blend_scratch(n))
    return out
