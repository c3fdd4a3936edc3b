"""The derivative of a mask under ``create_graph``: where PyTorch's double backward
records an edge to the mask's source that carries zeros (``threshold_backward`` of
relu, ``leaky_relu_backward``, abs's ``sgn``, max_pool2d's ``zeros_like(self)``), a
leaf reached only through the mask gets a zero ``.grad`` (not None), and
``autograd.grad(..., allow_unused=False)`` returns zeros; where PyTorch records none
(clamp, maximum, amax, max, where), the leaf gets None and ``allow_unused=False``
raises. The table is checked on both devices, and against PyTorch where it is installed."""

from __future__ import annotations

import numpy as np
import pytest

import framework as fw
from framework.autograd import grad

F = fw.nn.functional
SHAPE = (2, 3, 4, 4)

# name -> (the op on this framework's tensor, on a torch tensor, PyTorch records the zero edge)
CASES = {
    "relu": (lambda x: x.relu(), lambda x: x.relu(), True),
    "relu_": (lambda x: x.clone().relu_(), lambda x: x.clone().relu_(), True),
    "leaky_relu": (lambda x: F.leaky_relu(x, 0.2), lambda x: _tf().leaky_relu(x, 0.2), True),
    "leaky_relu_": (lambda x: x.clone().leaky_relu_(0.2), lambda x: _tf().leaky_relu_(x.clone(), 0.2), True),
    "abs": (lambda x: x.abs(), lambda x: x.abs(), True),
    "abs_": (lambda x: x.clone().abs_(), lambda x: x.clone().abs_(), True),
    "max_pool2d": (lambda x: F.max_pool2d(x, 2), lambda x: _tf().max_pool2d(x, 2), True),
    "clamp(min)": (lambda x: x.clamp(min=0.1), lambda x: x.clamp(min=0.1), False),
    "clamp(max)": (lambda x: x.clamp(max=0.1), lambda x: x.clamp(max=0.1), False),
    "clamp(min, max)": (lambda x: x.clamp(-0.5, 0.5), lambda x: x.clamp(-0.5, 0.5), False),
    "clamp_": (lambda x: x.clone().clamp_(-0.5, 0.5), lambda x: x.clone().clamp_(-0.5, 0.5), False),
    "maximum": (lambda x: x.maximum(x.detach() * 0.5), lambda x: x.maximum(x.detach() * 0.5), False),
    "amax(dim)": (lambda x: x.amax(1, keepdim=True), lambda x: x.amax(1, keepdim=True), False),
    "amax": (lambda x: x.amax(), lambda x: x.amax(), False),
    "max": (lambda x: x.max(), lambda x: x.max(), False),
    "max(dim)": (lambda x: x.max(1, keepdim=True)[0], lambda x: x.max(1, keepdim=True)[0], False),
    "where": (lambda x: fw.where(x > 0, x, 0.0), lambda x: _torch().where(x > 0, x, 0.0), False),
}


def _torch():
    import torch

    return torch


def _tf():
    return _torch().nn.functional


def _program(lib, op, a, b):
    """The second derivative of ``sum(op(a * 1) * b)`` into the leaf ``a``: ``a`` reaches
    ``g`` only through ``op``'s mask (``b`` keeps ``g`` a function of a leaf for the ops
    without an edge)."""
    x = a * 1.0
    (g,) = lib.autograd.grad((op(x) * b).sum(), [x], create_graph=True)
    return g


def _leaves(lib, device="cpu"):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(SHAPE), np.asarray(1.5)  # b: a 0-d factor, any op's shape
    if lib is fw:
        return (fw.tensor(v, device=device, requires_grad=True) for v in (a, b))
    return (lib.tensor(v, requires_grad=True) for v in (a, b))


def _run(lib, op, device="cpu"):
    """(the leaf's .grad after g.sum().backward(), autograd.grad's answer with
    allow_unused=False: the gradient or the RuntimeError's text)."""
    a, b = _leaves(lib, device)
    g = _program(lib, op, a, b)
    try:
        (strict,) = lib.autograd.grad(g.sum(), [a], retain_graph=True)
    except RuntimeError as e:
        strict = str(e)
    g.sum().backward()
    return a.grad, strict


@pytest.mark.parametrize("name", list(CASES))
def test_a_leaf_reached_only_through_a_mask(name, backend):
    op, _, edge = CASES[name]
    leaf_grad, strict = _run(fw, op, backend)
    if edge:
        assert leaf_grad is not None, "the mask's zero derivative reaches the leaf"
        assert leaf_grad.shape == SHAPE and leaf_grad.dtype == np.float64 and leaf_grad.device.type == backend
        assert not fw.testing.to_numpy(leaf_grad).any()
        assert not isinstance(strict, str) and not fw.testing.to_numpy(strict).any()
    else:
        assert leaf_grad is None
        assert isinstance(strict, str) and "appears to not have been used in the graph" in strict


@pytest.mark.parametrize("name", list(CASES))
def test_the_table_is_pytorchs(name, torch):
    op, top, edge = CASES[name]
    got, got_strict = _run(fw, op)
    want, want_strict = _run(torch, top)
    assert (want is not None) == edge and isinstance(want_strict, str) != edge
    if edge:
        for mine, theirs in ((got, want), (got_strict, want_strict)):
            # force: PyTorch's abs gives a ZeroTensor (sgn's efficient zero), still a tensor
            theirs = theirs.detach().numpy(force=True)
            assert mine.shape == theirs.shape and mine.dtype == theirs.dtype
            np.testing.assert_array_equal(mine.detach().numpy(), theirs)


def test_allow_unused_returns_zeros_not_none():
    a, b = _leaves(fw)
    g = _program(fw, lambda x: x.relu(), a, b)
    (ga,) = grad(g.sum(), [a], allow_unused=True)
    assert ga is not None and not ga.numpy().any()


@pytest.mark.parametrize("name", ["relu", "leaky_relu", "abs"])
def test_the_edge_is_recorded_again_at_third_order(name):
    """threshold_backward's derivative in its gradient is threshold_backward again: the
    edge to the mask's source is in the third-order graph too (as in PyTorch)."""
    op = CASES[name][0]
    a, b = _leaves(fw)
    g = _program(fw, op, a, b)
    (gb,) = grad(g.sum(), [b], create_graph=True)  # the mask itself, with the edge to a
    assert gb.requires_grad
    gb.sum().backward()
    assert a.grad is not None and not a.grad.numpy().any()


def test_the_numbers_are_unchanged():
    """The second derivative through relu (zero) and its first derivative: the same
    numbers as the first-order backward."""
    a, b = _leaves(fw)
    x = a * 1.0
    (g,) = grad((x.relu() * b).sum(), [x], create_graph=True)
    (g1,) = grad((x.relu() * b).sum(), [x])
    np.testing.assert_array_equal(g.detach().numpy(), g1.numpy())
