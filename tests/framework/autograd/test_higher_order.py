"""Higher-order gradients: ``backward(create_graph=True)`` and ``autograd.grad(...,
create_graph=True)`` with PyTorch's signature and semantics (retain_graph defaulting to
create_graph, allow_unused, grad_outputs with history), the inplace rules in the graph a
first backward records (version errors naming the op and line, leaf checks, views),
custom Functions, hooks, and the compiled step's refusal. Where PyTorch is installed,
the same programs run on it and the numbers agree."""

from __future__ import annotations

import inspect
import os

import numpy as np
import pytest

import framework as fw
from framework.autograd import grad

HERE = os.path.abspath(__file__)


def _x(values=(0.5, 1.5, -2.0), requires_grad=True):
    return fw.tensor(np.asarray(values, dtype=np.float64), requires_grad=requires_grad)


def _np(t):
    return t.detach().numpy()


def _line(fn, text):
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


# --- the API ----------------------------------------------------------------------------


def test_grad_with_create_graph_returns_a_differentiable_gradient():
    x = _x()
    (g,) = grad((x**3).sum(), x, create_graph=True)
    assert g.requires_grad and g.grad_fn is not None
    np.testing.assert_allclose(_np(g), 3 * _np(x) ** 2)
    (h,) = grad(g.sum(), x, create_graph=True)
    np.testing.assert_allclose(_np(h), 6 * _np(x))
    (t,) = grad(h.sum(), x)  # third order
    np.testing.assert_allclose(_np(t), np.full(3, 6.0))


def test_without_create_graph_the_gradient_has_no_history():
    x = _x()
    (g,) = grad((x**3).sum(), x)
    assert not g.requires_grad and g.grad_fn is None


def test_retain_graph_defaults_to_create_graph():
    x = _x()
    y = (x.exp() * x).sum()
    grad(y, x, create_graph=True)
    grad(y, x)  # the graph was kept by the first call: a second backward works
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        grad(y, x)  # ... and freed by the second (retain_graph=False by default)
    z = (x.exp() * x).sum()
    grad(z, x, create_graph=True, retain_graph=False)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        grad(z, x)


def test_allow_unused_and_an_input_the_gradient_does_not_depend_on():
    x, y = _x(), _x((1.0, 2.0, 3.0))
    (gx,) = grad((x * 2).sum(), x, create_graph=True)
    assert not gx.requires_grad  # a constant gradient: nothing to differentiate
    with pytest.raises(RuntimeError, match="allow_unused=True"):
        grad((x * x).sum(), [x, y], create_graph=True)
    gx, gy = grad((x * x).sum(), [x, y], create_graph=True, allow_unused=True)
    assert gy is None and gx.requires_grad


def test_grad_outputs_with_history_are_part_of_the_new_graph():
    x, v = _x(), _x((0.3, -1.0, 2.0))
    (g,) = grad(x.sin(), x, grad_outputs=v, create_graph=True)
    np.testing.assert_allclose(_np(g), np.cos(_np(x)) * _np(v))
    gx, gv = grad(g.sum(), [x, v])
    np.testing.assert_allclose(_np(gx), -np.sin(_np(x)) * _np(v))
    np.testing.assert_allclose(_np(gv), np.cos(_np(x)))
    with pytest.raises(RuntimeError, match="one grad_output per output"):
        grad([x.sin(), x.cos()], x, grad_outputs=[v])


def test_backward_create_graph_leaves_grads_with_history_and_accumulates():
    x = _x()
    (x**3).sum().backward(create_graph=True)
    g = x.grad
    assert g.grad_fn is not None
    np.testing.assert_allclose(_np(g), 3 * _np(x) ** 2)
    x.grad = None
    g.sum().backward()
    np.testing.assert_allclose(_np(x.grad), 6 * _np(x))
    # accumulation into an existing .grad is out of place, with history (PyTorch)
    x.grad = None
    (x**2).sum().backward(create_graph=True)
    first = x.grad
    (x**2).sum().backward(create_graph=True)
    assert x.grad is not first and x.grad.grad_fn is not None
    np.testing.assert_allclose(_np(x.grad), 4 * _np(x))


def test_hooks_see_tensors_with_history():
    x = _x()
    seen = []
    y = x * x
    y.register_hook(lambda g: seen.append(g.requires_grad) or g * 2)
    x.register_hook(lambda g: seen.append(g.requires_grad))
    (g,) = grad(y.sum(), x, create_graph=True)
    assert seen == [False, True]  # the root's ones have no history; x's gradient does
    np.testing.assert_allclose(_np(g), 4 * _np(x))
    (h,) = grad(g.sum(), x)
    np.testing.assert_allclose(_np(h), np.full(3, 4.0))


def test_retain_grad_under_create_graph():
    x = _x()
    y = x.exp()
    y.retain_grad()
    (y * y).sum().backward(create_graph=True)
    assert y.grad.grad_fn is not None
    np.testing.assert_allclose(_np(y.grad), 2 * np.exp(_np(x)))


# --- inplace rules in the recorded graph ---------------------------------------------------


def _modify_after_first_backward():
    x = _x()
    h = x.exp()  # exp's backward reads its result: the gradient's graph saves h
    y = (h * h).sum()
    (g,) = grad(y, x, create_graph=True)
    h.mul_(2)  # the line the error must name
    return g, x


def test_modifying_a_tensor_the_second_backward_needs_raises_naming_the_op_and_line():
    g, x = _modify_after_first_backward()
    line = _line(_modify_after_first_backward, "h.mul_(2)")
    with pytest.raises(RuntimeError) as err:
        grad(g.sum(), x)
    msg = str(err.value)
    assert "modified by an inplace operation" in msg and "is at version 1; expected version 0" in msg
    assert f"mul_ at {HERE}:{line}" in msg


def test_modifying_a_first_order_gradient_that_is_saved_raises_too():
    x = _x()
    (g,) = grad((x**3).sum(), x, create_graph=True)
    z = (g * g).sum()  # Mul saves g
    g.add_(1.0)
    with pytest.raises(RuntimeError, match="add_ at"):
        grad(z, x)


def test_an_inplace_op_on_a_gradient_is_recorded_and_differentiated():
    x = _x()
    (g,) = grad((x**3).sum(), x, create_graph=True)
    g.mul_(x)  # g = 3 x^2 * x, in place on a non-leaf: recorded
    (h,) = grad(g.sum(), x)
    np.testing.assert_allclose(_np(h), 9 * _np(x) ** 2)


def test_inplace_on_a_view_of_a_gradient():
    x = _x()
    (g,) = grad((x**3).sum(), x, create_graph=True)
    g[1:].mul_(x[1:])  # CopySlices on the gradient
    (h,) = grad(g.sum(), x)
    xv = _np(x)
    np.testing.assert_allclose(_np(h), [6 * xv[0], 9 * xv[1] ** 2, 9 * xv[2] ** 2])


def test_inplace_on_a_view_in_the_first_graph_has_a_differentiable_copy_slices():
    x = _x()
    y = x * 1
    y[:2].mul_(x[:2])  # y = [x0^2, x1^2, x2]
    (g,) = grad((y * y).sum(), x, create_graph=True)
    xv = _np(x)
    np.testing.assert_allclose(_np(g), [4 * xv[0] ** 3, 4 * xv[1] ** 3, 2 * xv[2]])
    (h,) = grad(g.sum(), x)
    np.testing.assert_allclose(_np(h), [12 * xv[0] ** 2, 12 * xv[1] ** 2, 2.0])


def test_a_leaf_gradient_with_history_is_not_a_leaf():
    x = _x()
    (x**2).sum().backward(create_graph=True)
    with pytest.raises(RuntimeError, match="leaf"):
        x.mul_(2)  # x itself is still a leaf that requires grad
    x.grad.mul_(2)  # its .grad is a non-leaf: allowed, and recorded
    assert x.grad.grad_fn is not None


# --- custom Functions and compiled steps ---------------------------------------------------


class _Cube(fw.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x * x * x
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return g * 3 * y / x  # uses the saved output: it must keep its history


def test_custom_function_backward_is_differentiated():
    x = _x()
    (g,) = grad(_Cube.apply(x).sum(), x, create_graph=True)
    np.testing.assert_allclose(_np(g), 3 * _np(x) ** 2)
    (h,) = grad(g.sum(), x)
    np.testing.assert_allclose(_np(h), 6 * _np(x))


def test_compiled_step_refuses_create_graph_with_one_line():
    model = fw.nn.Linear(3, 1)
    x = fw.randn(4, 3)

    @fw.compile
    def step():
        (g,) = grad(model(x).sum(), model.weight, create_graph=True)
        return (g * g).sum()

    with pytest.raises(RuntimeError) as err:
        step()
    assert "create_graph=True is not supported inside a compiled step" in str(err.value)
    assert "\n" not in str(err.value)


# --- against PyTorch -------------------------------------------------------------------------


def test_a_program_matches_pytorch_to_third_order(torch):
    rng = np.random.default_rng(0)
    xv, wv = rng.standard_normal((4, 3)), rng.standard_normal((3, 2))
    t = np.array([0, 1, 1, 0])

    def program(lib, x, w, target):
        h = (x @ w).tanh()
        h = lib.nn.functional.log_softmax(h * h.sigmoid(), 1) if lib is torch else (h * h.sigmoid()).log_softmax(1)
        loss = -(h[np.arange(4), target]).mean() + (w.abs() ** 1.5).sum() + x.max(1)[0].sum()
        (gw,) = lib.autograd.grad(loss, w, create_graph=True)
        (gx,) = lib.autograd.grad((gw * gw).sum(), x, create_graph=True)
        return gw, gx, lib.autograd.grad((gx.sin()).sum(), w)[0]

    got = program(fw, fw.tensor(xv, requires_grad=True), fw.tensor(wv, requires_grad=True), t)
    want = program(torch, torch.tensor(xv, requires_grad=True), torch.tensor(wv, requires_grad=True), torch.tensor(t))
    for a, b in zip(got, want):
        np.testing.assert_allclose(_np(a), b.detach().numpy(), rtol=1e-10, atol=1e-12)


def test_casts_and_device_moves_are_differentiated_twice(backend):
    x = fw.tensor(np.array([0.5, 1.5, -2.0]), dtype=fw.float64, requires_grad=True)
    y = (x.to(device=backend).float() ** 3).double().to(device="cpu").sum()
    (g,) = grad(y, x, create_graph=True)
    assert g.dtype == np.float64 and g.device == x.device and g.requires_grad
    (h,) = grad(g.sum(), x)
    np.testing.assert_allclose(_np(h), 6 * _np(x), rtol=1e-6)


class _Frozen(fw.autograd.OpFunction):
    """An op whose backward is not differentiable: create_graph must refuse it."""

    differentiable_backward = False

    def forward(ctx, x):
        return x * 2

    def backward(ctx, g):
        return g * 2


def test_a_node_without_a_differentiable_backward_refuses_create_graph():
    x = _x()
    y = _Frozen.apply(x).sum()
    with pytest.raises(RuntimeError, match="_FrozenBackward0 has no differentiable backward"):
        grad(y, x, create_graph=True)
    (g,) = grad(_Frozen.apply(x).sum(), x)
    np.testing.assert_allclose(_np(g), np.full(3, 2.0))


def test_pytorch_raises_and_allows_where_this_framework_does(torch):
    """The inplace scenarios above, on PyTorch: the same raise/allow decisions."""

    def scenario(lib, which):
        x = lib.tensor([0.5, 1.5, -2.0], dtype=lib.float64, requires_grad=True)
        if which == "saved activation":
            h = x.exp()
            (g,) = lib.autograd.grad((h * h).sum(), x, create_graph=True)
            h.mul_(2)
            lib.autograd.grad(g.sum(), x)
        elif which == "saved gradient":
            (g,) = lib.autograd.grad((x**3).sum(), x, create_graph=True)
            z = (g * g).sum()
            g.add_(1.0)
            lib.autograd.grad(z, x)
        elif which == "inplace on gradient":
            (g,) = lib.autograd.grad((x**3).sum(), x, create_graph=True)
            g.mul_(x)
            return lib.autograd.grad(g.sum(), x)[0].detach().numpy()
        elif which == "leaf":
            (x**2).sum().backward(create_graph=True)
            x.mul_(2)

    for which in ("saved activation", "saved gradient", "leaf"):
        for lib in (fw, torch):
            with pytest.raises(RuntimeError):
                scenario(lib, which)
    np.testing.assert_allclose(scenario(fw, "inplace on gradient"), scenario(torch, "inplace on gradient"))
