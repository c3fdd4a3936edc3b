"""Reductions (sum, mean, var, amax, max) and softmax / log_softmax."""

from __future__ import annotations

import numpy as np
import pytest

import framework as fw
from framework.testing import assert_close, gradcheck

from . import harness
from .harness import UNARY, Budget, OpSpec

ND = [((5,),), ((2, 3),), ((2, 3, 4),)]  # at least one dim
ND2 = [((2, 3),), ((2, 3, 4),)]  # at least two dims
ND3 = [((2, 3, 4),)]


def _softmax(a, axis):
    e = np.exp(a - a.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


SPECS = [
    OpSpec("sum()", fw.sum, np.sum, UNARY),
    OpSpec("sum(0)", lambda x: x.sum(0), lambda a: a.sum(0), ND),
    OpSpec("sum(0) 0-d", lambda x: x.sum(0), lambda a: a, [((),)]),
    OpSpec("sum(-1,keepdim)", lambda x: x.sum(-1, keepdim=True), lambda a: a.sum(-1, keepdims=True), ND),
    OpSpec("sum((0,2))", lambda x: fw.sum(x, (0, 2)), lambda a: a.sum((0, 2)), ND3),
    OpSpec("mean()", fw.mean, np.mean, UNARY),
    OpSpec("mean(1)", lambda x: x.mean(1), lambda a: a.mean(1), ND2),
    OpSpec(
        "mean((0,-1),keepdim)", lambda x: x.mean((0, -1), keepdim=True), lambda a: a.mean((0, -1), keepdims=True), ND2
    ),
    OpSpec("var()", fw.var, lambda a: a.var(ddof=1), ND),
    OpSpec("var(1)", lambda x: x.var(1), lambda a: a.var(1, ddof=1), ND2),
    OpSpec("var(0,unbiased=False)", lambda x: x.var(0, unbiased=False), lambda a: a.var(0), ND),
    OpSpec(
        "var((0,2),keepdim)",
        lambda x: x.var((0, 2), keepdim=True),
        lambda a: a.var((0, 2), ddof=1, keepdims=True),
        ND3,
    ),
    OpSpec("var(correction=0)", lambda x: x.var(correction=0), lambda a: a.var(), ND),
    OpSpec("amax()", fw.amax, np.amax, UNARY),
    OpSpec("amax(1)", lambda x: x.amax(1), lambda a: a.max(1), ND2),
    OpSpec("amax(-1,keepdim)", lambda x: x.amax(-1, keepdim=True), lambda a: a.max(-1, keepdims=True), ND),
    OpSpec("amax((0,2))", lambda x: x.amax((0, 2)), lambda a: a.max((0, 2)), ND3),
    OpSpec("max()", fw.max, np.max, UNARY),
    OpSpec("max(1).values", lambda x: x.max(1).values, lambda a: a.max(1), ND2),
    OpSpec("max(0,keepdim).values", lambda x: x.max(0, keepdim=True)[0], lambda a: a.max(0, keepdims=True), ND),
    OpSpec("softmax(-1)", fw.softmax, lambda a: _softmax(a, -1), ND, budget=Budget(5, 8)),
    OpSpec("softmax(0)", lambda x: x.softmax(0), lambda a: _softmax(a, 0), ND2, budget=Budget(5, 8)),
    OpSpec("softmax 0-d", lambda x: x.softmax(-1), lambda a: np.ones_like(a), [((),)], budget=Budget(5, 6)),
    OpSpec("log_softmax(-1)", fw.log_softmax, lambda a: np.log(_softmax(a, -1)), ND, budget=Budget(6, 8)),
    OpSpec("log_softmax(1)", lambda x: x.log_softmax(1), lambda a: np.log(_softmax(a, 1)), ND2, budget=Budget(6, 8)),
    OpSpec("log_softmax 0-d", lambda x: x.log_softmax(0), lambda a: np.zeros_like(a), [((),)], budget=Budget(6, 6)),
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


# --- max(dim): values and indices ----------------------------------------------------------


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_max_dim_returns_values_and_indices(dim, keepdim):
    a = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    x = fw.tensor(a, requires_grad=True)
    values, indices = x.max(dim, keepdim=keepdim)
    result = x.max(dim, keepdim=keepdim)
    assert result.values is not None and result.indices is not None  # a named tuple
    assert_close(values, a.max(dim, keepdims=keepdim))
    assert indices.dtype == fw.int64 and not indices.requires_grad
    np.testing.assert_array_equal(indices.numpy(), np.expand_dims(a.argmax(dim), dim) if keepdim else a.argmax(dim))
    values.sum().backward()  # the gradient goes to the picked elements only
    picked = np.zeros_like(a)
    np.put_along_axis(picked, np.expand_dims(a.argmax(dim), dim), 1, axis=dim)
    assert_close(x.grad, picked)


def test_max_dim_without_grad_gives_the_same_indices():
    a = fw.tensor([[1.0, 5.0, 2.0], [7.0, 0.0, 1.0]])
    with fw.no_grad():
        assert a.max(1).indices.tolist() == [1, 0]
    assert a.max(1).indices.tolist() == [1, 0]
    assert a.max(0, keepdim=True).indices.tolist() == [[1, 0, 0]]
    assert fw.tensor([1.0, 3.0, 2.0]).max(0).indices.item() == 1


def test_ties_amax_splits_the_gradient_max_dim_picks_one():
    for reduce in (lambda x: x.amax(), lambda x: x.max(), lambda x: x.amax(0)):
        x = fw.tensor([3.0, 1.0, 3.0], requires_grad=True)
        reduce(x).backward()
        assert x.grad.tolist() == [0.5, 0.0, 0.5]
    x = fw.tensor([3.0, 1.0, 3.0], requires_grad=True)
    x.max(0).values.backward()
    assert sorted(x.grad.tolist()) == [0.0, 0.0, 1.0] and x.grad.tolist()[1] == 0.0


# --- dtypes and edge cases -------------------------------------------------------------------


def test_reduction_dtypes():
    assert fw.tensor([1, 2, 3]).sum().dtype == fw.int64
    assert fw.tensor([1.0, 2.0]).sum().dtype == fw.float32
    assert fw.tensor([1.0, 2.0]).var().dtype == fw.float32
    with pytest.raises(RuntimeError, match="floating point"):
        fw.tensor([1, 2]).mean()


def test_reductions_of_0d_are_0d_tensors():
    x = fw.tensor(2.0, requires_grad=True)
    for out in (x.sum(), x.mean(), x.amax(), x.max(), x.sum(0), x.sum(-1, keepdim=True)):
        assert out.shape == () and isinstance(out._data, np.ndarray) and out.item() == 2.0
    x.sum().backward()
    assert x.grad.shape == () and x.grad.item() == 1.0


def test_bad_dim_raises_index_error():
    with pytest.raises(IndexError, match="Dimension out of range"):
        fw.randn(2, 3).sum(2)


@pytest.mark.parametrize("fn", [fw.softmax, fw.log_softmax])
def test_softmax_is_stable_for_large_inputs(fn):
    x = fw.tensor([[1000.0, 1000.0, -1000.0], [0.0, 1.0, 2.0]], dtype=fw.float64, requires_grad=True)
    out = fn(x)
    assert np.isfinite(out.detach().numpy()).all()
    a = x.detach().numpy()
    shifted = a - a.max(-1, keepdims=True)
    log_expected = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    assert_close(out, np.exp(log_expected) if fn is fw.softmax else log_expected, rtol=1e-6)
    gradcheck(lambda a: fn(a) * fw.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=fw.float64), [x])


def test_softmax_rows_sum_to_one():
    x = fw.randn(4, 5)
    assert_close(x.softmax(-1).sum(-1), np.ones(4, dtype=np.float32), rtol=1e-6)
    assert_close(x.log_softmax(0).exp().sum(0), np.ones(5, dtype=np.float32), rtol=1e-6)
