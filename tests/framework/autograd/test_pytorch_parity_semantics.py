"""PyTorch 2.13's answers where a review found this framework's different, checked here.

Each test asserts PyTorch's value literally (so it runs without PyTorch); where PyTorch is
installed, the ``torch`` fixture tests compute the same program with it and compare.
"""

from __future__ import annotations

import numpy as np
import pytest

import framework as fw
from framework.testing import assert_close


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


# --- pow's gradient at exponent 0 and base 0 ---------------------------------------------


def test_pow_zero_exponent_has_zero_gradient_at_zero():
    x = fw.tensor([0.0, 0.0, 2.0], requires_grad=True)
    (x**0).sum().backward()
    assert x.grad.tolist() == [0.0, 0.0, 0.0]  # PyTorch: 0, not nan (0 * 0**-1)


def test_pow_tensor_exponent_masks_zero_exponents():
    x = fw.tensor([0.0, 0.0, 2.0], requires_grad=True)
    (x ** fw.tensor([0.0, 1.0, 0.0])).sum().backward()
    assert x.grad.tolist() == [0.0, 1.0, 0.0]


@pytest.mark.parametrize("e", [2.0, 0.0, -1.0, -0.5, 0.5])
def test_pow_exponent_gradient_at_zero_base(e):
    # PyTorch's pow_backward_exponent: 0 where base == 0 and exponent >= 0, else result * log(base)
    base = fw.tensor([0.0, 2.0])
    y = fw.tensor([e, e], requires_grad=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        (base**y).sum().backward()
    expected = [0.0 if e >= 0 else -np.inf, 2.0**e * np.log(2.0)]
    assert_close(y.grad, fw.tensor(expected))


def test_pow_scalar_base_gradient():
    y = fw.tensor([0.0, -1.0, 2.0], requires_grad=True)
    (2**y).sum().backward()
    assert_close(y.grad, fw.tensor([np.log(2.0), 0.5 * np.log(2.0), 4 * np.log(2.0)]))
    y = fw.tensor([0.0, -1.0, 2.0], requires_grad=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        (0**y).sum().backward()
    assert y.grad.tolist() == [0.0, -np.inf, 0.0]  # PyTorch's values


def test_pow_gradients_match_torch(torch):
    bases = [0.0, 0.0, 0.0, 2.0, 3.0, 0.5]
    exps = [0.0, 1.0, -1.0, 0.0, 2.5, -0.5]
    ours_x = fw.tensor(bases, dtype=fw.float64, requires_grad=True)
    ours_y = fw.tensor(exps, dtype=fw.float64, requires_grad=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        (ours_x**ours_y).sum().backward()
    tx = torch.tensor(bases, dtype=torch.float64, requires_grad=True)
    ty = torch.tensor(exps, dtype=torch.float64, requires_grad=True)
    (tx**ty).sum().backward()
    np.testing.assert_array_equal(ours_x.grad.numpy(), tx.grad.numpy())
    np.testing.assert_array_equal(ours_y.grad.numpy(), ty.grad.numpy())


# --- reductions over dim=() ------------------------------------------------------------------


@pytest.mark.parametrize("dim", [(), []])
def test_empty_dim_reduces_every_dim(dim):
    x = fw.arange(6.0).reshape(2, 3)
    assert x.sum(dim=dim).item() == 15.0  # PyTorch 2.13: all dims, not none
    assert x.mean(dim=dim).item() == 2.5
    assert fw.amax(x, dim=dim).item() == 5.0
    assert x.var(dim=dim).item() == 3.5
    assert x.sum(dim=dim, keepdim=True).shape == (1, 1)


def test_empty_dim_gradient():
    x = fw.arange(6.0).reshape(2, 3).requires_grad_()
    x.sum(dim=()).backward()
    assert x.grad.tolist() == [[1.0] * 3] * 2


def test_empty_dim_reductions_match_torch(torch):
    a = np.arange(6.0).reshape(2, 3)
    x, t = fw.tensor(a), torch.tensor(a)
    for name in ("sum", "mean", "amax", "var"):
        for keepdim in (False, True):
            ours = getattr(x, name)(dim=(), keepdim=keepdim)
            theirs = getattr(t, name)(dim=(), keepdim=keepdim)
            assert ours.shape == tuple(theirs.shape)
            np.testing.assert_allclose(ours.numpy(), theirs.numpy())
