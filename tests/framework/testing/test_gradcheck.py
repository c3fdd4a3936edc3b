"""framework.testing.gradcheck catches wrong gradients, element by element and in fast mode."""

from __future__ import annotations

import numpy as np
import pytest

import framework as fw
from framework.testing import gradcheck


class _WrongScale(fw.autograd.Function):
    """y = 2x whose backward says 2.001: wrong by 0.05%, above the default rtol of 1e-4."""

    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        return g * 2.001


class _OneWrongElement(fw.autograd.Function):
    """y = x * w whose backward is wrong in one weight element only."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gw = g * x
        gw = gw + fw.tensor(np.eye(1, gw.numel(), 37).reshape(gw.shape))  # element 37 off by 1
        return g * w, gw


def _inputs(shape):
    rng = np.random.default_rng(0)
    return [fw.tensor(rng.standard_normal(shape), requires_grad=True) for _ in range(2)]


@pytest.mark.parametrize("fast_mode", [False, True])
def test_right_gradients_pass(fast_mode):
    x, w = _inputs((6, 7))
    assert gradcheck(lambda x, w: (x * w).tanh() + x.exp() * 0.1, [x, w], fast_mode=fast_mode)


@pytest.mark.parametrize("fast_mode", [False, True])
def test_a_wrong_gradient_fails(fast_mode):
    x, _ = _inputs((6, 7))
    with pytest.raises(AssertionError, match="differs from finite differences"):
        gradcheck(_WrongScale.apply, [x], fast_mode=fast_mode)


@pytest.mark.parametrize("fast_mode", [False, True])
def test_one_wrong_element_among_many_fails(fast_mode):
    x, w = _inputs((6, 7))
    with pytest.raises(AssertionError, match="input 1"):
        gradcheck(_OneWrongElement.apply, [x, w], fast_mode=fast_mode)
