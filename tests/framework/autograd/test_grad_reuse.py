"""Backward writes into a dead incoming gradient under policy 'on' (an inplace site)."""

import numpy as np
import pytest

import framework as fw
from framework import memory
from framework.testing import assert_close

N = 1 << 16  # 256 KiB of float32 per activation


def chain(x):
    # Every op here is elementwise: each backward could write over its incoming gradient.
    h = (x * 1.5).tanh()
    h = h.relu() * 2.0
    h = h.sigmoid().exp()
    return (h / 3.0).leaky_relu(0.1).sum()


def run(policy):
    fw.manual_seed(0)
    x = fw.randn(N, requires_grad=True)
    loss = chain(x)
    with fw.inplace.policy(policy):
        before = memory.stats().get("backward_grad_reuse", 0)
        with memory.record_timeline() as tl:
            loss.backward()
        reused = memory.stats().get("backward_grad_reuse", 0) - before
    allocated = sum(delta for _, _, delta, _, _ in tl.events if delta > 0)
    return x.grad.numpy().copy(), allocated, reused


def test_on_and_off_give_identical_gradients_and_on_allocates_less():
    g_on, alloc_on, reused_on = run("on")
    g_off, alloc_off, reused_off = run("off")
    np.testing.assert_array_equal(g_on, g_off)
    act = N * 4
    assert reused_off == 0
    # Sum hands a broadcast view (not reusable); every later elementwise node can write
    # over its dead incoming gradient: mul, tanh, relu, mul, sigmoid, exp, div, leaky_relu.
    assert reused_on >= 7, reused_on
    assert alloc_on <= alloc_off - 6 * act, (alloc_on, alloc_off)


def test_a_shared_gradient_is_never_overwritten():
    # Add passes one array to both inputs: neither branch may write into it.
    x = fw.randn(8, requires_grad=True, dtype=fw.float64)
    with fw.inplace.policy("on"):
        a = x * 1.0
        y = a.relu() + a.tanh()  # AddBackward0 hands the same gradient to relu and tanh
        y.sum().backward()
    xn = x.detach().numpy()
    expected = (xn > 0).astype(np.float64) + (1 - np.tanh(xn) ** 2)
    assert_close(x.grad, expected, rtol=1e-12, atol=1e-12)


def test_a_gradient_held_by_a_hook_is_never_overwritten():
    kept = []
    x = fw.randn(8, requires_grad=True, dtype=fw.float64)
    with fw.inplace.policy("on"):
        h = x * 2.0
        y = h.exp()
        y.register_hook(lambda g: kept.append(g) or None)
        (y * 3.0).sum().backward()
    assert_close(kept[0], np.full(8, 3.0))  # the hook's view of dL/dy is still 3
    assert_close(x.grad, 2.0 * 3.0 * np.exp(2.0 * x.detach().numpy()), rtol=1e-12)


@pytest.mark.parametrize("policy", ["on", "off"])
def test_retain_graph_second_backward_is_unchanged(policy):
    x = fw.randn(16, requires_grad=True, dtype=fw.float64)
    with fw.inplace.policy(policy):
        loss = chain(x)
        loss.backward(retain_graph=True)
        first = x.grad.numpy().copy()
        x.grad = None
        loss.backward()
    np.testing.assert_array_equal(x.grad.numpy(), first)
