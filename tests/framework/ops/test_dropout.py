"""dropout: statistics, scaling, the mask reused by backward, the inplace form,
determinism under fw.manual_seed, and PyTorch's edge cases (p = 0, p = 1, eval)."""

import numpy as np
import pytest

import framework as fw
from framework import memory
from framework.ops.dropout import dropout
from framework.testing import assert_close, gradcheck, gradgradcheck


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_statistics_and_scaling(p, backend):
    fw.manual_seed(0)
    x = fw.ones(200, 500, device=backend)
    out = dropout(x, p)
    assert out.device == x.device  # the mask is drawn on the tensor's device
    y = out.numpy()
    n = y.size
    zero = y == 0
    # Fraction dropped within 5 standard deviations of p.
    assert abs(zero.mean() - p) < 5 * np.sqrt(p * (1 - p) / n)
    # Kept values are scaled by 1 / (1 - p), so the expectation is preserved.
    assert np.allclose(y[~zero], np.float32(1 / (1 - p)), rtol=1e-6)
    assert abs(y.mean() - 1) < 5 * np.sqrt(p / (1 - p) / n)
    assert y.dtype == np.float32


def test_output_is_input_times_scaled_mask():
    fw.manual_seed(1)
    x = fw.randn(30, 40, dtype=fw.float64)
    y = dropout(x, 0.25).numpy()
    kept = y != 0
    assert_close(y[kept], x.numpy()[kept] / 0.75, rtol=1e-15, atol=0)


def test_backward_reuses_the_forward_mask():
    fw.manual_seed(2)
    x = fw.randn(20, 30, requires_grad=True)
    y = dropout(x, 0.4)
    kept = y.detach().numpy() != 0
    g = np.random.default_rng(0).standard_normal(x.shape).astype(np.float32)
    fw.manual_seed(99)  # a different stream now: backward must not draw a new mask
    y.backward(fw.tensor(g))
    assert_close(x.grad, np.where(kept, g / np.float32(0.6), 0), rtol=1e-6, atol=0)


def test_gradcheck_with_fixed_seed():
    x = fw.randn(4, 5, dtype=fw.float64, requires_grad=True)

    def fn(x):
        fw.manual_seed(3)  # the same mask on every evaluation
        return dropout(x, 0.3)

    assert gradcheck(fn, [x])


def test_keeps_only_a_bool_mask():
    fw.manual_seed(4)
    x = fw.randn(64, 64, requires_grad=True)
    before = memory.saved_bytes()
    y = dropout(x, 0.5)
    assert memory.saved_bytes() - before == x.numel()  # 1 byte per value: the bool mask
    y.sum().backward()
    assert memory.saved_bytes() == before
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.grad_fn.backward(np.ones(y.shape, np.float32))


def test_inplace_shares_memory_and_saves_no_copy():
    fw.manual_seed(5)
    x = fw.randn(32, 32, requires_grad=True)
    memory.reset_stats()
    h = x * 1
    buf, v = h._data, h._version
    before = memory.saved_bytes()
    out = dropout(h, 0.5, inplace=True)
    assert out is h and out._data is buf and h._version == v + 1
    assert memory.saved_bytes() - before == h.numel()  # the mask, no copy of h
    assert memory.stats().get("inplace_copy_bytes", 0) == 0

    fw.manual_seed(5)
    fw.randn(32, 32)  # same stream position as above
    ref = dropout(x * 1, 0.5)
    assert_close(out, ref, rtol=0, atol=0)
    g = fw.randn(32, 32)
    out.backward(g)
    grad_inplace = x.grad.numpy().copy()
    x.grad = None
    ref.backward(g)
    assert_close(grad_inplace, x.grad, rtol=0, atol=0)


def test_inplace_on_leaf_requiring_grad_raises():
    x = fw.randn(4, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        dropout(x, 0.5, inplace=True)


def test_determinism_with_manual_seed():
    x = fw.randn(50, 50)
    fw.manual_seed(123)
    a = dropout(x, 0.5).numpy()
    b = dropout(x, 0.5).numpy()
    fw.manual_seed(123)
    c = dropout(x, 0.5).numpy()
    assert np.array_equal(a, c)
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("p,error", [(-0.1, ValueError), (1.5, ValueError), (float("nan"), RuntimeError)])
def test_p_out_of_range_raises(p, error):
    # PyTorch's: its Python test (p < 0 or p > 1) raises ValueError; NaN passes it and its
    # kernel raises RuntimeError
    with pytest.raises(error, match="between 0 and 1"):
        dropout(fw.randn(3), p)


@pytest.mark.parametrize("kwargs", [dict(p=0.0), dict(p=0.5, training=False), dict(p=0.0, inplace=True)])
def test_identity_cases_return_the_input_itself(kwargs):
    x = fw.randn(5, 5, requires_grad=True)
    v = x._version
    assert dropout(x, **kwargs) is x
    assert x._version == v


def test_p_one_gives_zeros_and_zero_gradient():
    x = fw.randn(6, 7, requires_grad=True)
    y = dropout(x, 1.0)
    assert np.array_equal(y.detach().numpy(), np.zeros((6, 7), np.float32))
    y.sum().backward()
    assert np.array_equal(x.grad.numpy(), np.zeros((6, 7), np.float32))


def test_second_derivatives_through_dropout_use_the_same_mask(backend):
    x = fw.tensor(np.random.default_rng(0).standard_normal((4, 6)), dtype=fw.float64, device=backend)
    x.requires_grad_()

    def fn(t):
        fw.manual_seed(3)  # the same mask at every evaluation (the differences re-run forward)
        return dropout(t * t, 0.5)

    gradgradcheck(fn, [x])
