"""matmul / ``@`` with NumPy's rules: 1-D operands, 2-D, batched with broadcasting."""

from __future__ import annotations

import operator

import numpy as np
import pytest

import framework as fw
from framework.nn import functional as F
from framework.testing import assert_close

from . import harness
from .harness import Budget, OpSpec

MATMUL_SHAPES = [
    ((3,), (3,)),  # dot: a 0-d result
    ((2, 3), (3,)),  # matrix @ vector
    ((3,), (3, 2)),  # vector @ matrix
    ((2, 3), (3, 4)),
    ((2, 2, 3), (3,)),  # batch @ vector
    ((3,), (2, 3, 2)),  # vector @ batch
    ((2, 2, 3), (3, 2)),  # batch @ matrix: the matrix broadcasts over the batch
    ((2, 1, 2, 3), (3, 3, 2)),  # both batch dims broadcast
]


def _linear_ref(x, w, b):
    return np.matmul(x, w.T) + b


LINEAR_SHAPES = [((4,), (3, 4), (3,)), ((2, 4), (3, 4), (3,)), ((2, 5, 4), (3, 4), (3,))]

SPECS = [
    # Launches on a GPU: strided layouts cost cuBLAS a copy of the operand first, as in CuPy.
    OpSpec("F.linear", F.linear, _linear_ref, LINEAR_SHAPES, budget=Budget(4, 13)),
    OpSpec(
        "F.linear without bias",
        lambda x, w: F.linear(x, w),
        lambda x, w: np.matmul(x, w.T),
        [(s[0], s[1]) for s in LINEAR_SHAPES],
        budget=Budget(3, 10),
    ),
    OpSpec("matmul", fw.matmul, np.matmul, MATMUL_SHAPES, budget=Budget(6, 18)),
    OpSpec("@", operator.matmul, np.matmul, MATMUL_SHAPES, budget=Budget(6, 18)),
    OpSpec("x.matmul", lambda x, y: x.matmul(y), np.matmul, [((2, 3), (3, 2))], budget=Budget(3, 10)),
]


@pytest.mark.parametrize("case", harness.cases(SPECS))
def test_forward(case, backend):
    harness.check_forward(case, backend)


@pytest.mark.parametrize("case", harness.cases(SPECS, need="grad"))
def test_backward(case, backend):
    harness.check_backward(case, backend)


@pytest.mark.parametrize("case", harness.cases(SPECS, need="grad"))
def test_double_backward(case, backend):
    harness.check_double_backward(case, backend)


def test_matmul_gradient_by_hand():
    x = fw.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    y = fw.tensor([5.0, 6.0], requires_grad=True)
    (x @ y).sum().backward()
    assert x.grad.tolist() == [[5.0, 6.0], [5.0, 6.0]]  # d/dx_ij = y_j
    assert y.grad.tolist() == [4.0, 6.0]  # column sums of x


def test_only_the_needed_gradient_is_computed():
    x = fw.randn(2, 3, requires_grad=True)
    w = fw.randn(3, 4)  # a constant: its gradient is never computed nor its input saved
    out = x @ w
    assert out.grad_fn.needs_input_grad == (True, False)
    out.sum().backward()
    assert_close(x.grad, np.tile(w.numpy().sum(1), (2, 1)))


def test_matmul_dtypes():
    assert (fw.randn(2, 3) @ fw.randn(3)).dtype == fw.float32
    assert (fw.randn(2, 3, dtype=fw.float64) @ fw.randn(3, dtype=fw.float64)).dtype == fw.float64


def test_matmul_errors():
    with pytest.raises(RuntimeError, match="at least 1D"):
        fw.tensor(2.0) @ fw.randn(2)
    with pytest.raises((ValueError, RuntimeError), match="size 2 is different from 3"):
        fw.randn(2, 3) @ fw.randn(2, 3)


def test_linear_weight_gradient_is_adopted_in_its_own_layout():
    """grad_weight = grad.T @ x comes out C-contiguous: the engine adopts it as .grad."""
    lin = fw.nn.Linear(64, 32)
    x = fw.randn(16, 64)
    lin(x).sum().backward()
    g = lin.weight.grad._data
    assert g.flags.c_contiguous and g.base is None
    assert_close(lin.weight.grad, np.ones((16, 32), np.float32).T @ x.numpy(), rtol=1e-5)
