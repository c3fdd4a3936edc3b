"""GELU's CPU kernels (framework/ops/gelu_cpu.py): accuracy over the whole float32 range
against float64 (SciPy) and against PyTorch's GELU, special values, half types, layouts
and blocks."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from scipy.special import log_ndtr, ndtr

import framework as fw
import framework.nn.functional as F
from framework.ops import gelu_cpu
from framework.ops import kernels_transformer as KT

EPS = 2.0**-24  # float32's unit roundoff
TINY = float(np.finfo(np.float32).tiny)


def _points():
    """Float32 points over the whole range: dense in [-20, 20] (past both tails), both signs
    of every power of two from the smallest subnormal to the largest finite, the largest
    finite values, zeros."""
    dense = np.linspace(-20, 20, 400_001)
    powers = 2.0 ** np.arange(-149, 128)
    mantissas = np.outer(powers, [1.0, 1.3, 1.7]).ravel()
    big = np.array([np.finfo(np.float32).max, 1e30, 2e19, 1.8e19])
    x = np.concatenate([dense, mantissas, -mantissas, big, -big, [0.0, -0.0]])
    return x.astype(np.float32)


X = _points()


def _exact(x):
    """Phi, GELU and GELU' of float32 ``x`` in float64, and the scale of each derivative's
    two terms (the derivative crosses 0 at x = -0.75: its error is relative to the terms)."""
    x = x.astype(np.float64)
    phi = ndtr(x)
    with np.errstate(over="ignore", invalid="ignore"):
        pdf_x = np.where(np.abs(x) > 40, 0.0, x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi))
    return phi, x * phi, phi + pdf_x, np.abs(phi) + np.abs(pdf_x)


def _bound(x):
    """The measured accuracy, as the tests hold it: relative error at most (12 + 1.5 x^2)
    units of 2^-24 (the polynomial and float32 Horner arithmetic: about 5 units in the last
    place for |x| <= 1; the rounding of x^2 inside exp grows with x^2), plus subnormals'
    spacing."""
    x = x.astype(np.float64)
    return (12 + 1.5 * np.minimum(x * x, 1e4)) * EPS


def _check(name, got, want, scale, x):
    err = np.abs(got.astype(np.float64) - want)
    allowed = _bound(x) * scale + 2.0**-139  # below float32's normal range: the subnormal spacing
    bad = ~(err <= allowed)
    assert not bad.any(), f"{name}: {bad.sum()} points off, first x={x[bad][:5]}, error {err[bad][:5]}"


def test_the_polynomial_fits_the_scaled_tail_in_float64():
    """S(a) = Phi(-a) exp(a^2 / 2) to 3e-8 relative on [0, 14.5] in exact arithmetic, and
    S(0) = 0.5 exactly in float32 Horner arithmetic (so Phi(0) = 0.5, gelu'(0) = 0.5)."""
    a = np.linspace(0, 14.5, 100_001)
    t = 4 / (4 + a)
    s = np.polynomial.polynomial.polyval(t, np.array(gelu_cpu._C, dtype=np.float64))
    want = np.exp(log_ndtr(-a) + a * a / 2)
    assert np.max(np.abs(s / want - 1)) < 3e-8
    s0 = np.float32(gelu_cpu._C[-1])
    for c in gelu_cpu._C[-2::-1]:
        s0 = s0 * np.float32(1) + c
    assert s0 == np.float32(0.5)


def test_normal_cdf_gelu_and_its_derivative_against_float64_over_the_float32_range():
    phi, y, d, d_scale = _exact(X)
    with np.errstate(over="ignore", invalid="ignore"):
        _check("Phi", gelu_cpu.normal_cdf(X), phi, phi, X)
        _check("gelu", gelu_cpu.gelu(X), y, np.abs(y), X)
        _check("gelu'", gelu_cpu.gelu_backward(np.ones_like(X), X), d, d_scale, X)


def test_the_lower_tail_keeps_its_relative_accuracy():
    """Where 0.5 (1 + erf(x / sqrt 2)) cancels to 0 (x < -5.6 in float32), x Phi(x) follows
    the true value down to float32's normal range (1e-30 at x = -11.3)."""
    x = np.float32([-6.0, -8.0, -11.3])
    _, want, _, _ = _exact(x)
    got = gelu_cpu.gelu(x).astype(np.float64)
    assert (got < 0).all() and np.all(np.abs(got / want - 1) < 4e-6)


def test_agrees_with_torch_gelu_forward_and_backward(torch):
    """Within the two errors: ours (above) and PyTorch's, which is absolute, ``|x| eps``,
    where its ``1 + erf`` cancels (x < 0)."""
    x = X[np.isfinite(X) & (np.abs(X) < 1e4)]
    tx = torch.from_numpy(x.copy()).requires_grad_()
    ty = torch.nn.functional.gelu(tx)
    ty.backward(torch.ones_like(ty))
    _, y, d, d_scale = _exact(x)
    ours_y = gelu_cpu.gelu(x).astype(np.float64)
    ours_d = gelu_cpu.gelu_backward(np.ones_like(x), x).astype(np.float64)
    theirs_y, theirs_d = ty.detach().numpy().astype(np.float64), tx.grad.numpy().astype(np.float64)
    torch_abs = 8 * EPS * np.abs(x.astype(np.float64)) + TINY
    assert np.all(np.abs(ours_y - theirs_y) <= _bound(x) * np.abs(y) + torch_abs)
    assert np.all(np.abs(ours_d - theirs_d) <= _bound(x) * d_scale + torch_abs)
    # where PyTorch is accurate (x >= 0), closer than 1e-6 relative
    pos = x >= 0
    assert np.all(np.abs(ours_y - theirs_y)[pos] <= 1e-6 * np.abs(y[pos]) + TINY)


def test_special_values_as_torch(torch):
    """NaN stays NaN, -0.0 keeps its sign, 0 has derivative 0.5, a huge negative input gives
    -0.0 (as PyTorch); -inf gives NaN both ways (inf * 0, as PyTorch); +inf gives +inf (PyTorch's
    vectorized kernel gives NaN there: its erf's formula meets inf * 0) and NaN backward, as
    PyTorch."""
    x = np.float32([np.nan, -0.0, 0.0, -1e30, 1e30, -np.inf, np.inf])
    tx = torch.from_numpy(x.copy()).requires_grad_()
    ty = torch.nn.functional.gelu(tx)
    ty.backward(torch.ones_like(ty))
    with np.errstate(invalid="ignore"):
        y = gelu_cpu.gelu(x)
        d = gelu_cpu.gelu_backward(np.ones_like(x), x)
    theirs_y, theirs_d = ty.detach().numpy(), tx.grad.numpy()
    finite = slice(0, 5)
    np.testing.assert_array_equal(y[finite], theirs_y[finite])
    assert list(np.signbit(y[finite])) == list(np.signbit(theirs_y[finite]))
    np.testing.assert_array_equal(d[:6], theirs_d[:6])
    assert np.isnan(y[5]) and np.isnan(theirs_y[5])
    assert y[6] == np.inf and np.isnan(theirs_y[6]) and np.isnan(d[6]) and np.isnan(theirs_d[6])


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_half_types_compute_in_float32_and_round_once(dtype):
    x = (np.random.default_rng(0).standard_normal(3000) * 3).astype(dtype)
    g = np.random.default_rng(1).standard_normal(3000).astype(dtype)
    wide = x.astype(np.float32)
    y = gelu_cpu.gelu(x)
    assert y.dtype == dtype
    np.testing.assert_array_equal(y, gelu_cpu.gelu(wide).astype(dtype))
    gx = gelu_cpu.gelu_backward(g, x)
    assert gx.dtype == dtype
    np.testing.assert_array_equal(gx, gelu_cpu.gelu_backward(g.astype(np.float32), wide).astype(dtype))


def test_layouts_blocks_and_out_give_the_same_values():
    """Transposed (kept as PyTorch's preserve_format keeps it), strided, 0-d, more elements
    than a block (the walk's blocks and their tail), and written into ``out``: the values of
    the contiguous call, bit for bit."""
    rng = np.random.default_rng(2)
    n = gelu_cpu.BLOCK + 37
    base = (rng.standard_normal((3, n)) * 4).astype(np.float32)
    want = gelu_cpu.gelu(np.ascontiguousarray(base))
    g = rng.standard_normal((3, n)).astype(np.float32)
    want_d = gelu_cpu.gelu_backward(g, np.ascontiguousarray(base))
    t = np.ascontiguousarray(base.T).T  # transposed storage, same values
    y = gelu_cpu.gelu(t)
    assert y.strides == t.strides
    np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(gelu_cpu.gelu_backward(g, t), want_d)
    np.testing.assert_array_equal(gelu_cpu.gelu(base[:, ::2]), want[:, ::2])
    np.testing.assert_array_equal(gelu_cpu.gelu_backward(g[:, ::3], base[:, ::3]), want_d[:, ::3])
    assert gelu_cpu.gelu(np.array(base[1, 5])) == want[1, 5]
    # one element alone is what it is inside the blocks
    np.testing.assert_array_equal(gelu_cpu.gelu(base[:, -5:].copy()), want[:, -5:])
    out = base.copy()
    assert gelu_cpu.gelu(out, out=out) is out
    np.testing.assert_array_equal(out, want)
    g_out = g.copy()
    assert gelu_cpu.gelu_backward(g_out, base, out=g_out) is g_out
    np.testing.assert_array_equal(g_out, want_d)


def test_the_op_runs_the_cpu_kernel_below_float64_and_scipy_in_float64():
    x = np.linspace(-3, 3, 11)
    for dtype in (fw.float32, fw.float16):
        t = fw.tensor(x, dtype=dtype, requires_grad=True)
        y = F.gelu(t)
        y.sum().backward()
        xs = x.astype(t.detach().numpy().dtype)
        np.testing.assert_array_equal(y.detach().numpy(), gelu_cpu.gelu(xs))
        np.testing.assert_array_equal(t.grad.detach().numpy(), gelu_cpu.gelu_backward(np.ones_like(xs), xs))
    t64 = fw.tensor(x, dtype=fw.float64)
    np.testing.assert_array_equal(F.gelu(t64).numpy(), KT.gelu_reference(x, "none"))
