"""The programs of the autograd review (issue: PyTorch's programs run here), each run on
PyTorch 2.13 (the oracle) and on this framework under every inplace policy, in float64:
the same values, and an error exactly where PyTorch raises one (the messages differ).

A program is ``program(m, t)``: ``m`` is the library (``fw`` or ``torch``), ``t`` makes a
float64 leaf that requires grad from a list. It returns the values to compare (tensors,
tuples of ints, None), or raises.
"""

from __future__ import annotations

import numpy as np
import pytest

import framework as fw


def _f(m):
    return m.nn.functional


def saliency_then_train(m, t):
    """grad w.r.t. a non-leaf captures the gradient flowing into it; its node stays."""
    x = t([0.5, -1.0, 2.0])
    h = x.exp()
    (gh,) = m.autograd.grad((h * 2).sum(), h)
    (h * 3).sum().backward()
    return gh, x.grad


def grad_of_non_leaf_and_leaf_behind_it(m, t):
    x = t([0.5, -1.0, 2.0])
    h = x.exp()
    gh, gx = m.autograd.grad((h * h).sum(), [h, x])
    (h * 3).sum().backward()  # h's node ran for x's gradient, without retain_graph: freed
    return gh, gx


def second_order_after_inplace_on_a_view(op):
    def program(m, t):
        x = t(np.linspace(-1.0, 1.0, 12).reshape(3, 4).tolist())
        y = x.clone()
        getattr(y[0], op)()
        (g,) = m.autograd.grad((y**2).sum(), x, create_graph=True)
        (gg,) = m.autograd.grad(g.sum(), x)
        return g, gg

    return program


def normalize_then_scale_in_place(m, t):
    x = t([[1.0, 2.0], [3.0, -4.0]])
    v = x / x.pow(2).sum().sqrt()
    v.mul_(2)
    v.sum().backward()
    return v, x.grad


def leaky_relu_then_add_in_place(m, t):
    x = t([[1.0, -2.0], [3.0, -4.0]])
    y = _f(m).leaky_relu(x).add_(1)
    y.sum().backward()
    return y, x.grad


def div_in_place_then_add_in_place(m, t):
    x, d = t([1.0, -2.0, 3.0]), t([0.5, 4.0, -2.0])
    y = x * 1
    y.div_(d)
    y.add_(1)
    (y * y).sum().backward()
    return y, x.grad, d.grad


def div_saves_the_dividend_for_the_divisors_gradient(m, t):
    """Rejected by PyTorch: the dividend changed after div saved it."""
    x, d = t([1.0, -2.0, 3.0]), t([0.5, 4.0, -2.0])
    a = x * 1
    b = a / d
    a.add_(1)
    b.sum().backward()
    return x.grad, d.grad


def div_by_a_constant_saves_no_dividend(m, t):
    x = t([1.0, -2.0, 3.0])
    a = x * 1
    b = a / m.tensor([0.5, 4.0, -2.0], dtype=m.float64)
    a.add_(1)
    b.sum().backward()
    return x.grad


def leaky_relu_inplace_saves_its_result(m, t):
    """Rejected by PyTorch: leaky_relu_ saves its result, which add_ then changes."""
    x = t([[1.0, -2.0], [3.0, -4.0]])
    y = _f(m).leaky_relu(x * 1, inplace=True)
    y.add_(1)
    y.sum().backward()
    return x.grad


def exp_then_add_in_place(m, t):
    """Rejected by PyTorch: exp saves its result."""
    x = t([0.5, -1.0])
    y = x.exp()
    y.add_(1)
    y.sum().backward()
    return x.grad


def grad_of_the_same_input_twice(m, t):
    x = t([1.0, 2.0, 3.0])
    h = x * 2
    return m.autograd.grad((h * h).sum(), [x, h, x, h])


def leaf_grad_layout_under_create_graph(m, t):
    leaf = t(np.arange(12.0).reshape(4, 3).tolist()).detach().t().requires_grad_()
    (leaf * leaf).sum().backward(create_graph=True)
    first = (leaf.grad.stride(), leaf.grad.clone())
    (leaf * leaf).sum().backward(create_graph=True)
    return first, leaf.grad.stride(), leaf.grad


def pow_tensor_exponent_at_zero(m, t):
    a, y = t([2.0, 0.0, 3.0]), t([0.0, 0.0, 1.0])
    (g,) = m.autograd.grad((a**y).sum(), a, create_graph=True)
    return g, m.autograd.grad(g.sum(), [a, y], allow_unused=True)


def pow_zero_then_a_further_grad(m, t):
    """Rejected by PyTorch: x ** 0's gradient is a constant."""
    a = t([2.0, 0.0, 3.0])
    (g,) = m.autograd.grad((a**0).sum(), a, create_graph=True)
    return m.autograd.grad(g.sum(), a)


def pow_one_then_a_further_grad(m, t):
    a = t([2.0, 0.0, 3.0])
    (g,) = m.autograd.grad((a**1).sum(), a, create_graph=True)
    return g, m.autograd.grad(g.sum(), a)


def materialize_grads(m, t):
    a, unused = t([1.0, 2.0]), t([3.0])
    plain = m.autograd.grad((a * 2).sum(), [a, unused], materialize_grads=True)
    graph = m.autograd.grad((a * a).sum(), [a, unused], materialize_grads=True, create_graph=True)
    return plain, graph[1].requires_grad, graph[1].grad_fn is None


def materialize_grads_without_allow_unused(m, t):
    a, unused = t([1.0, 2.0]), t([3.0])
    return m.autograd.grad((a * 2).sum(), [a, unused], materialize_grads=True, allow_unused=False)


def backward_into_a_non_leaf(m, t):
    x = t([0.5, -1.0, 2.0])
    h = x.exp()
    (h * h).sum().backward(inputs=[h], retain_graph=True)
    first = (h.grad.clone(), h.retains_grad, x.grad)
    (h * h).sum().backward()
    return first, h.grad, x.grad


def backward_into_a_non_leaf_frees_its_node(m, t):
    """Rejected by PyTorch: backward(inputs=[h]) ran and freed h's node."""
    x = t([0.5, -1.0, 2.0])
    h = x.exp()
    (h * h).sum().backward(inputs=[h])
    (h * 3).sum().backward()
    return x.grad


def backward_into_a_non_leaf_with_create_graph(m, t):
    x = t([0.5, -1.0, 2.0])
    h = x.exp()
    (h * h).sum().backward(inputs=[h], create_graph=True)
    (gg,) = m.autograd.grad(h.grad.sum(), x)
    return h.grad, gg


PROGRAMS = {
    "saliency then train (grad w.r.t. a non-leaf)": saliency_then_train,
    "grad w.r.t. a non-leaf and a leaf behind it": grad_of_non_leaf_and_leaf_behind_it,
    **{
        f"second order after y[0].{op}()": second_order_after_inplace_on_a_view(op)
        for op in ("exp_", "tanh_", "sigmoid_", "relu_")
    },
    "v = x / norm; v.mul_(2)": normalize_then_scale_in_place,
    "leaky_relu(x).add_(1)": leaky_relu_then_add_in_place,
    "y.div_(d); y.add_(1)": div_in_place_then_add_in_place,
    "b = a / d; a.add_(1) (refused)": div_saves_the_dividend_for_the_divisors_gradient,
    "b = a / constant; a.add_(1)": div_by_a_constant_saves_no_dividend,
    "leaky_relu_(x).add_(1) (refused)": leaky_relu_inplace_saves_its_result,
    "exp(x).add_(1) (refused)": exp_then_add_in_place,
    "grad(y, [x, h, x, h])": grad_of_the_same_input_twice,
    "a transposed leaf's .grad under create_graph": leaf_grad_layout_under_create_graph,
    "pow with a tensor exponent at 0": pow_tensor_exponent_at_zero,
    "x ** 0, then a further grad (refused)": pow_zero_then_a_further_grad,
    "x ** 1, then a further grad": pow_one_then_a_further_grad,
    "grad(materialize_grads=True)": materialize_grads,
    "materialize_grads with allow_unused=False (refused)": materialize_grads_without_allow_unused,
    "backward(inputs=[non_leaf])": backward_into_a_non_leaf,
    "backward(inputs=[non_leaf]) frees its node (refused)": backward_into_a_non_leaf_frees_its_node,
    "backward(inputs=[non_leaf], create_graph=True)": backward_into_a_non_leaf_with_create_graph,
}


def outcome(program, m):
    """The program's values as NumPy (nested like the program's result), or the error's
    type name."""

    def t(values):
        return m.tensor(values, dtype=m.float64, requires_grad=True)

    try:
        return _plain(program(m, t))
    except (RuntimeError, ValueError) as e:
        return type(e).__name__


def _plain(value):
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "detach"):
        return value.detach().numpy().copy()
    return value


def assert_same(ours, theirs, where=""):
    if isinstance(theirs, str) or isinstance(ours, str):
        assert ours == theirs, f"{where}: this framework gave {ours!r}, PyTorch {theirs!r}"
    elif isinstance(theirs, tuple):
        assert isinstance(ours, tuple) and len(ours) == len(theirs), f"{where}: {ours!r} != {theirs!r}"
        for k, (a, b) in enumerate(zip(ours, theirs)):
            assert_same(a, b, f"{where}[{k}]")
    elif isinstance(theirs, np.ndarray):
        assert isinstance(ours, np.ndarray) and ours.shape == theirs.shape, f"{where}: {ours!r} != {theirs!r}"
        np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-12, err_msg=where)
    else:
        assert ours == theirs, f"{where}: {ours!r} != {theirs!r}"


@pytest.mark.parametrize("policy", ["off", "auto", "on"])
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_the_program_runs_as_on_pytorch(name, policy, torch):
    theirs = outcome(PROGRAMS[name], torch)
    fw.inplace.set_policy(policy)
    with np.errstate(divide="ignore", invalid="ignore"):
        ours = outcome(PROGRAMS[name], fw)
    assert_same(ours, theirs, name)
    if name.endswith("(refused)"):
        assert isinstance(theirs, str), "the program's name says PyTorch refuses it"
