"""Half types on the CPU: the ops with long sums (conv2d, avg_pool2d, batch_norm, InPlace-ABN)
compute float16 and bfloat16 in float32 and round once (``promotion.half_on_cpu``), as
PyTorch's CPU kernels accumulate them; max_pool2d pads a bfloat16 input with -inf. Each
against the same op run in float32 on the same (rounded) values, the result rounded."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import framework as fw
import framework.nn.functional as F

HALF = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}


def _pair(run, arrays, dtype):
    """``run`` on half-type tensors and on float32 ones holding the same values: outputs and
    gradients (a fixed weighting's), the float32 ones rounded to the half type."""
    outs = []
    for dt in (HALF[dtype], np.dtype(np.float32)):
        ts = [fw.tensor(a.astype(HALF[dtype]).astype(dt), requires_grad=True) for a in arrays]
        out = run(*ts)
        w = np.random.default_rng(5).standard_normal(out.shape).astype(HALF[dtype]).astype(dt)
        (out * fw.tensor(w)).sum().backward()
        outs.append([out.detach().numpy()] + [t.grad.numpy() for t in ts])
    half, full = outs
    return half, [a.astype(HALF[dtype]) for a in full]


@pytest.mark.parametrize("dtype", sorted(HALF))
@pytest.mark.parametrize(
    "name",
    ["conv2d", "conv2d strided", "avg_pool2d", "batch_norm", "batch_norm eval", "inplace_abn", "max_pool2d padded"],
)
def test_half_types_compute_in_float32_and_round_once(name, dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    ops = {
        "conv2d": (lambda x_, w_: F.conv2d(x_, w_, padding=1), [x, rng.standard_normal((3, 4, 3, 3))]),
        "conv2d strided": (lambda x_, w_: F.conv2d(x_, w_, stride=2), [x, rng.standard_normal((3, 4, 3, 3))]),
        "avg_pool2d": (lambda x_: F.avg_pool2d(x_, 2), [x]),
        "batch_norm": (lambda x_, g_: F.batch_norm(x_, None, None, g_, None, training=True), [x, rng.random(4) + 0.5]),
        "batch_norm eval": (
            lambda x_: F.batch_norm(x_, fw.tensor(np.full(4, 0.1)), fw.tensor(np.full(4, 2.0)), training=False),
            [x],
        ),
        "inplace_abn": (
            lambda x_: F.inplace_abn(x_ * 1.0, None, None, None, None, training=True, inplace=True),
            [x],
        ),
        "max_pool2d padded": (lambda x_: F.max_pool2d(-(x_.abs()), 3, 2, padding=1), [x]),
    }
    run, arrays = ops[name]
    half, want = _pair(run, [np.asarray(a, np.float32) for a in arrays], dtype)
    for got, exp in zip(half, want):
        assert got.dtype == HALF[dtype]
        g, e = got.astype(np.float32), exp.astype(np.float32)
        # one rounding apart at most (the float32 run's sums in another order)
        ulp = 2.0**-7 if dtype == "bfloat16" else 2.0**-10
        np.testing.assert_allclose(g, e, rtol=2 * ulp, atol=2 * ulp * np.abs(e).max())
