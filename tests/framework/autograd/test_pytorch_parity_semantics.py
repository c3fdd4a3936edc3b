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


# --- grad_fn._saved_<name> ----------------------------------------------------------------


def test_saved_self_and_other():
    # test_grad_fn_attr_bindings: out2.grad_fn._saved_self == a * 2
    a = fw.ones(1, requires_grad=True)
    b = fw.zeros(1, requires_grad=True)
    out2 = (a * 2) * b
    assert isinstance(out2.grad_fn._saved_self, fw.Tensor)
    assert out2.grad_fn._saved_self.tolist() == [2.0]
    assert out2.grad_fn._saved_other.tolist() == [0.0]
    out2.sum().backward()
    with pytest.raises(RuntimeError, match="after they have already been freed"):
        _ = out2.grad_fn._saved_self


def test_saved_result_and_names_per_op():
    x = fw.tensor([0.5, 2.0], requires_grad=True)
    y = x.exp()
    assert_close(y.grad_fn._saved_result, y)
    assert_close(x.log().grad_fn._saved_self, x)
    p = x ** fw.tensor([2.0, 3.0], requires_grad=True)  # PyTorch: PowBackward1
    assert p.grad_fn._saved_exponent.tolist() == [2.0, 3.0]
    assert_close(p.grad_fn._saved_result, p)
    assert (x**2.0).grad_fn._saved_exponent == 2.0  # a scalar exponent stays a number
    m = x.view(1, 2) @ x.view(2, 1)
    assert m.grad_fn._saved_mat2.shape == (2, 1)  # PyTorch: MmBackward0
    assert fw.where(x > 1, x, x).grad_fn._saved_condition.tolist() == [False, True]
    with pytest.raises(AttributeError):
        _ = y.grad_fn._saved_self  # exp saves its result only, as PyTorch's ExpBackward0


def test_saved_tensor_shares_storage_and_version():
    a = fw.ones(2, requires_grad=True)
    h = a * 1
    out = h * a
    saved = out.grad_fn._saved_self
    assert saved._version == h._version
    h.add_(1)  # the saved input changed: reading it raises as backward would
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _ = out.grad_fn._saved_self


def test_saved_not_needed_is_none():
    # mul saves each factor only for the other's gradient (PyTorch: undefined -> None)
    a = fw.ones(2, requires_grad=True)
    out = a * fw.ones(2)
    assert out.grad_fn._saved_self is None
    assert out.grad_fn._saved_other.tolist() == [1.0, 1.0]


def test_saved_names_match_torch(torch):
    cases = {
        "mul": lambda m, a, b: a * b,
        "div": lambda m, a, b: a / b,
        "pow": lambda m, a, b: a**b,
        "exp": lambda m, a, b: a.exp(),
        "log": lambda m, a, b: a.log(),
        "sqrt": lambda m, a, b: a.sqrt(),
        "tanh": lambda m, a, b: a.tanh(),
        "sin": lambda m, a, b: a.sin(),
        "relu": lambda m, a, b: a.relu(),
        "maximum": lambda m, a, b: m.maximum(a, b),
        "mm": lambda m, a, b: a.view(1, 2) @ b.view(2, 1),
    }
    for name, f in cases.items():
        ours = f(fw, fw.tensor([0.5, 2.0], requires_grad=True), fw.tensor([1.5, 3.0], requires_grad=True))
        theirs = f(torch, torch.tensor([0.5, 2.0], requires_grad=True), torch.tensor([1.5, 3.0], requires_grad=True))
        compared = 0
        for attr in dir(theirs.grad_fn):
            value = getattr(theirs.grad_fn, attr)
            # div saves its result where PyTorch saves self: what backward needs differs
            if attr.startswith("_saved_") and isinstance(value, torch.Tensor) and hasattr(ours.grad_fn, attr):
                np.testing.assert_allclose(getattr(ours.grad_fn, attr).numpy(), value.detach().numpy(), err_msg=name)
                compared += 1
        assert compared, name
