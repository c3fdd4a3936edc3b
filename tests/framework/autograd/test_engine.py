"""The backward engine: order, accumulation, graph freeing, hooks, autograd.grad, anomaly mode,
.grad aliasing safety and the inplace policy's gradient-accumulation site.

Expected gradients are worked out by hand in the comments.
"""

import inspect
import weakref

import numpy as np
import pytest

import framework as fw
from framework import autograd, memory
from framework.testing import assert_close

TWICE_MSG = "backward through the graph a second time"


def next_line() -> int:
    return inspect.currentframe().f_back.f_lineno + 1


def record_order(log, **tensors):
    """Registers a prehook on each tensor's grad_fn that logs the tensor's label when it runs."""
    for label, t in tensors.items():
        t.grad_fn.register_prehook(lambda g, label=label: log.append(label))


# --- order and dependency counting ---------------------------------------------------------


def test_diamond_runs_each_node_once_after_all_its_consumers():
    a = fw.tensor([0.5, -1.0], requires_grad=True)
    b = a * 2.0
    c = b.sin()
    d = b * b
    e = c + d
    loss = e.sum()
    log, calls = [], []
    record_order(log, loss=loss, e=e, c=c, d=d, b=b)
    b.register_hook(lambda g: calls.append(g.numpy().copy()))
    loss.backward()
    assert log[:2] == ["loss", "e"]
    assert sorted(log[2:4]) == ["c", "d"]
    assert log[4:] == ["b"]  # b's node last, once
    # b's hook sees the SUM of both branches once: cos(b) + 2b
    b_np = 2.0 * np.array([0.5, -1.0])
    assert len(calls) == 1
    assert_close(calls[0], np.cos(b_np) + 2.0 * b_np, rtol=1e-5)
    # dL/da = 2 (cos(2a) + 4a)
    assert_close(a.grad, 2.0 * (np.cos(b_np) + 2.0 * b_np), rtol=1e-5)


def test_unbalanced_diamond_waits_for_the_long_branch():
    a_np = np.array([0.3, -0.7, 1.1])
    a = fw.tensor(a_np, dtype=fw.float64, requires_grad=True)
    b = a * 1.0
    long_branch = b.exp().sin().tanh()  # three nodes between b and the add
    calls = []
    b.register_hook(lambda g: calls.append(g.numpy().copy()))
    (long_branch + b).sum().backward()
    # d/db [tanh(sin(e^b)) + b] = (1 - tanh^2(sin(e^b))) cos(e^b) e^b + 1
    expected = (1 - np.tanh(np.sin(np.exp(a_np))) ** 2) * np.cos(np.exp(a_np)) * np.exp(a_np) + 1
    assert len(calls) == 1  # not once per branch
    assert_close(calls[0], expected, rtol=1e-12)
    assert_close(a.grad, expected, rtol=1e-12)


def test_leaf_used_three_times_gets_one_summed_gradient_and_hooks_run_once():
    # Like PyTorch's AccumulateGrad: the hooks of a leaf see the total, once per backward.
    x = fw.tensor([1.0, 2.0], dtype=fw.float64, requires_grad=True)
    seen, post = [], []
    x.register_hook(lambda g: seen.append(g.numpy().copy()))
    x.register_post_accumulate_grad_hook(lambda t: post.append(t.grad.numpy().copy()))
    (x * 2.0 + x.sin() + x * x).sum().backward()
    # d/dx [2x + sin x + x^2] = 2 + cos x + 2x
    expected = 2.0 + np.cos([1.0, 2.0]) + 2.0 * np.array([1.0, 2.0])
    assert len(seen) == 1 and len(post) == 1
    assert_close(seen[0], expected, rtol=1e-12)
    assert_close(post[0], expected, rtol=1e-12)


# --- accumulation and graph lifetime ----------------------------------------------------------


def test_gradients_accumulate_into_leaves_across_backward_calls():
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    (a * 3.0).sum().backward()
    assert_close(a.grad, [3.0, 3.0])
    (a * a).sum().backward()
    assert_close(a.grad, [3.0 + 2.0, 3.0 + 4.0])  # 3 + 2a


def test_default_backward_frees_the_graph_and_a_second_backward_raises():
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    b = fw.tensor([3.0, 4.0], requires_grad=True)
    loss = (a * b).sum()  # MulBackward0 saves a and b
    loss.backward()
    with pytest.raises(RuntimeError, match=TWICE_MSG) as err:
        loss.backward()
    assert "retain_graph=True" in str(err.value)
    assert_close(a.grad, [3.0, 4.0])  # the failed call accumulated nothing more


def test_retain_graph_allows_a_second_backward():
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    b = fw.tensor([3.0, 4.0], requires_grad=True)
    loss = (a * b).sum()
    loss.backward(retain_graph=True)
    loss.backward(retain_graph=True)
    assert_close(a.grad, [6.0, 8.0])  # 2b
    assert_close(b.grad, [2.0, 4.0])  # 2a
    loss.backward()  # the last one may free
    with pytest.raises(RuntimeError, match=TWICE_MSG):
        loss.backward()


def test_nodes_without_saved_tensors_can_run_again():
    # PyTorch: only nodes that saved tensors refuse a second backward.
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    b = fw.tensor([3.0, 4.0], requires_grad=True)
    loss = (a + b - a.neg()).sum()  # Add, Sub, Neg, Sum save nothing
    loss.backward()
    loss.backward()
    assert_close(a.grad, [4.0, 4.0])  # d/da (2a + b) = 2, twice
    assert_close(b.grad, [2.0, 2.0])


def test_nodes_that_keep_only_python_scalars_are_freed_as_in_pytorch():
    # PyTorch saves the 2.0 of a * 2.0 as a tensor (a wrapped number): after one backward
    # the node is freed like any other. Nodes that keep nothing (a + 1) can run again.
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    loss = (a * 2.0 + a / 4.0).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match=TWICE_MSG):
        loss.backward()
    shifted = (a + 1.0).sum()
    shifted.backward()
    shifted.backward()
    assert_close(a.grad, [4.25, 4.25])  # 2 + 1/4 once, then 1 twice
    squared = (a**2).sum()  # PowBackward0 saves the tensor a: freed after one backward
    squared.backward()
    with pytest.raises(RuntimeError, match=TWICE_MSG):
        squared.backward()


def test_nodes_that_keep_only_python_scalars_match_pytorch(torch):
    for lib in (fw, torch):
        a = lib.tensor([1.0, 2.0], requires_grad=True)
        loss = (a * 2.0).sum()
        loss.backward()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()
        view_add = a * 1
        view_add[1].add_(2.0)  # CopySlices drops the op it replays, even one that saved nothing
        view_add.sum().backward()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            view_add.sum().backward()


# --- hooks ---------------------------------------------------------------------------------------


def test_register_hook_on_leaf_replaces_the_gradient_and_can_be_removed():
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    handle = a.register_hook(lambda g: g * 10.0)
    (a * 2.0).sum().backward()
    assert_close(a.grad, [20.0, 20.0])
    handle.remove()
    a.grad = None
    (a * 2.0).sum().backward()
    assert_close(a.grad, [2.0, 2.0])


def test_register_hook_on_non_leaf_changes_what_flows_upstream():
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    y = a * 3.0
    seen = []
    y.register_hook(lambda g: seen.append(g.numpy().copy()))  # returns None: no change
    y.register_hook(lambda g: g + 1.0)  # replaces dL/dy = 1 with 2
    y.sum().backward()
    np.testing.assert_array_equal(seen[0], [1.0, 1.0])
    assert_close(a.grad, [6.0, 6.0])  # 3 * (1 + 1)


def test_register_hook_on_tensor_without_grad_raises():
    with pytest.raises(RuntimeError, match="doesn't require gradient"):
        fw.tensor([1.0]).register_hook(lambda g: g)


def test_retain_grad_keeps_non_leaf_gradient_and_accumulates():
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    y = a * 3.0
    assert y.grad is None and not y.retains_grad
    y.retain_grad()
    assert y.retains_grad
    loss = (y * y).sum()
    loss.backward(retain_graph=True)
    assert_close(y.grad, [6.0, 12.0])  # 2y = 2 * [3, 6]
    loss.backward()
    assert_close(y.grad, [12.0, 24.0])
    assert_close(a.grad, [36.0, 72.0])  # twice 2y * 3


def test_retain_grad_sees_the_effect_of_every_hook_whenever_registered():
    # PyTorch: the retain_grad hook always runs last (test_retains_grad_can_always_observe...).
    a = fw.tensor(1.0, requires_grad=True)
    b = a * 1.0
    b.register_hook(lambda g: g * 2.0)
    b.retain_grad()
    b.register_hook(lambda g: g * 2.0)  # registered after retain_grad
    (b * 1.0).backward()
    assert b.grad.item() == 4.0
    assert a.grad.item() == 4.0


def test_retain_grad_on_leaf_is_noop_and_on_no_grad_tensor_raises():
    a = fw.tensor([1.0], requires_grad=True)
    a.retain_grad()
    assert not a.retains_grad
    (a * 2.0).sum().backward()
    assert_close(a.grad, [2.0])
    with pytest.raises(RuntimeError, match="requires_grad=False"):
        fw.tensor([1.0]).retain_grad()


def test_post_accumulate_grad_hook_runs_after_grad_is_set():
    lr = 0.5
    v = fw.tensor([1.0, 2.0, 3.0], requires_grad=True)
    seen = []

    def step(p):  # an SGD step from inside backward, as in PyTorch's docs
        seen.append(p.grad.numpy().copy())
        with fw.no_grad():
            p.sub_(lr * p.grad)

    handle = v.register_post_accumulate_grad_hook(step)
    v.backward(fw.tensor([1.0, 2.0, 3.0]))
    np.testing.assert_array_equal(seen[0], [1.0, 2.0, 3.0])
    assert_close(v, [0.5, 1.0, 1.5])
    handle.remove()
    v.backward(fw.tensor([1.0, 1.0, 1.0]))
    assert len(seen) == 1
    with pytest.raises(RuntimeError, match="non-leaf"):
        (v * 2.0).register_post_accumulate_grad_hook(step)


# --- autograd.grad and backward(inputs=...) --------------------------------------------------


def test_autograd_grad_returns_gradients_without_touching_dot_grad():
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    b = fw.tensor([3.0, 4.0], requires_grad=True)
    b.grad = fw.tensor([100.0, 100.0])
    (ga, gb) = autograd.grad((a * b).sum(), [a, b])
    assert_close(ga, [3.0, 4.0])  # b
    assert_close(gb, [1.0, 2.0])  # a
    assert a.grad is None
    assert_close(b.grad, [100.0, 100.0])  # untouched


def test_autograd_grad_allow_unused():
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    unused = fw.tensor([1.0], requires_grad=True)
    with pytest.raises(RuntimeError, match="allow_unused=True"):
        autograd.grad((a * 2.0).sum(), [a, unused])
    ga, gu = autograd.grad((a * 2.0).sum(), [a, unused], allow_unused=True)
    assert_close(ga, [2.0, 2.0])
    assert gu is None


def test_autograd_grad_with_respect_to_a_non_leaf():
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    y = a * 2.0
    z = (y * y).sum()
    (gy,) = autograd.grad(z, y)
    assert_close(gy, [4.0, 8.0])  # 2y
    assert a.grad is None


def test_autograd_grad_with_grad_outputs_and_input_that_does_not_require_grad():
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    (ga,) = autograd.grad(a * 3.0, a, grad_outputs=fw.tensor([1.0, 10.0]))
    assert_close(ga, [3.0, 30.0])
    with pytest.raises(RuntimeError, match="does not require grad"):
        autograd.grad((a * 2.0).sum(), fw.tensor([1.0]))


def test_backward_inputs_accumulates_only_into_the_listed_leaves():
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    c = fw.tensor([5.0, 7.0], requires_grad=True)
    (a * c).sum().backward(inputs=[a])
    assert_close(a.grad, [5.0, 7.0])
    assert c.grad is None


def test_backward_with_explicit_gradient_and_its_shape_check():
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    y = a * 2.0
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"):
        y.backward()
    with pytest.raises(RuntimeError, match="shape"):
        y.backward(gradient=fw.ones(3))
    y.backward(gradient=fw.tensor([1.0, 10.0]))
    assert_close(a.grad, [2.0, 20.0])


def test_backward_on_tensor_without_history_raises():
    with pytest.raises(RuntimeError, match="does not require grad and does not have a grad_fn"):
        fw.tensor(1.0).backward()


# --- anomaly mode -------------------------------------------------------------------------------


def test_detect_anomaly_names_the_op_and_shows_the_forward_line():
    x = fw.tensor([0.0, 1.0], requires_grad=True)
    with fw.detect_anomaly():
        line = next_line()
        y = x.sqrt()  # d/dx sqrt at 0 is inf; times 0 below gives nan
        with pytest.raises(RuntimeError, match="SqrtBackward0") as err, np.errstate(all="ignore"):
            (y * 0.0).sum().backward()
    msg = str(err.value)
    assert "nan" in msg
    assert f'File "{__file__}", line {line}' in msg and "y = x.sqrt()" in msg
    assert not fw.autograd.grad_mode.state.anomaly  # restored on exit


def test_without_anomaly_mode_nan_passes_silently():
    x = fw.tensor([0.0, 1.0], requires_grad=True)
    with np.errstate(all="ignore"):
        (x.sqrt() * 0.0).sum().backward()
    assert np.isnan(x.grad.numpy()[0]) and x.grad.numpy()[1] == 0.0


# --- .grad aliasing and the inplace policy ------------------------------------------------------


@pytest.mark.parametrize("policy", ["on", "off"])
def test_grads_of_add_inputs_do_not_share_memory(policy):
    with fw.inplace.policy(policy):
        x = fw.tensor([1.0, 2.0], requires_grad=True)
        w = fw.tensor([3.0, 4.0], requires_grad=True)
        (x + w).sum().backward()  # AddBackward0 hands the SAME array to both inputs
        assert not np.shares_memory(x.grad._data, w.grad._data)
        (x * 3.0).sum().backward()  # accumulates into x.grad only
        assert_close(x.grad, [4.0, 4.0])
        assert_close(w.grad, [1.0, 1.0])
        with fw.no_grad():
            w.grad.mul_(5.0)
        assert_close(x.grad, [4.0, 4.0])


@pytest.mark.parametrize("policy", ["on", "off"])
def test_grad_does_not_alias_the_gradient_passed_to_backward(policy):
    with fw.inplace.policy(policy):
        g = fw.tensor([1.0, 1.0])
        x = fw.tensor([1.0, 2.0], requires_grad=True)
        x.backward(g)  # x is a leaf: the root gradient goes straight to x.grad
        y = fw.tensor([1.0, 2.0], requires_grad=True)
        (y * 1.0).backward(g)
        with fw.no_grad():
            g.mul_(7.0)
        assert_close(x.grad, [1.0, 1.0])
        assert_close(y.grad, [1.0, 1.0])


def test_accumulation_into_existing_grad_follows_the_policy():
    # "on": like PyTorch's AccumulateGrad, .grad is updated in place (same tensor);
    # "off": the sum is a new tensor and a held reference keeps the old values.
    x = fw.tensor([1.0, 2.0], requires_grad=True)
    with fw.inplace.policy("on"):
        (x * 2.0).sum().backward()
        held = x.grad
        (x * 2.0).sum().backward()
        assert x.grad is held
        assert_close(held, [4.0, 4.0])
    x.grad = None
    with fw.inplace.policy("off"):
        (x * 2.0).sum().backward()
        held = x.grad
        (x * 2.0).sum().backward()
        assert x.grad is not held
        assert_close(held, [2.0, 2.0])
        assert_close(x.grad, [4.0, 4.0])


def _fan_out_grads():
    x = fw.tensor([0.5, -1.0, 2.0], dtype=fw.float64, requires_grad=True)
    b = x * 2.0  # b feeds three consumers: its node sums three gradients
    loss = (b.sin() + b * b + b.exp()).sum()
    loss2 = (x.sin() + x * x + x.exp()).sum()  # x used three times directly
    loss.backward()
    loss2.backward()
    return x.grad.numpy().copy()


def test_inplace_policy_on_and_off_give_identical_gradients_on_fan_out():
    memory.reset_stats()
    with fw.inplace.policy("off"):
        off = _fan_out_grads()
    assert memory.stats().get("inplace_grad_accumulations", 0) == 0
    with fw.inplace.policy("on"):
        on = _fan_out_grads()
    # "on" really took the in-place path (within one backward, not only across calls).
    assert memory.stats().get("inplace_grad_accumulations", 0) >= 3
    np.testing.assert_array_equal(on, off)
    # Hand check: b = 2x; d/dx = 2 (cos b + 2b + e^b) + (cos x + 2x + e^x)
    x = np.array([0.5, -1.0, 2.0])
    b = 2 * x
    expected = 2 * (np.cos(b) + 2 * b + np.exp(b)) + (np.cos(x) + 2 * x + np.exp(x))
    assert_close(on, expected, rtol=1e-12)


@pytest.mark.parametrize("clone_first", [True, False])
def test_in_place_accumulation_never_writes_into_a_gradient_someone_holds(clone_first):
    # CloneBackward0 passes its incoming gradient on unchanged, and y's hook keeps that very
    # array; when it reaches b's node first, the engine must not add the other path's
    # gradient into it (the refcount proof fails), whichever path arrives first.
    x_np = np.array([0.3, 1.2])
    x = fw.tensor(x_np, dtype=fw.float64, requires_grad=True)
    b = x * 1.0
    y = b.clone()
    kept = []
    y.register_hook(lambda g: kept.append(g) or None)
    paths = [y.sin(), (b * 2.0).sin()]
    if not clone_first:
        paths.reverse()
    with fw.inplace.policy("on"):
        (paths[0] + paths[1]).sum().backward()
    assert_close(kept[0], np.cos(x_np), rtol=1e-12)  # dL/dy, untouched
    # d/dx [sin(x) + sin(2x)] = cos(x) + 2 cos(2x)
    assert_close(x.grad, np.cos(x_np) + 2 * np.cos(2 * x_np), rtol=1e-12)


def test_autograd_grad_runs_the_hooks_of_leaf_inputs():
    # PyTorch runs a leaf input's tensor hooks in autograd.grad too (not its post-accumulate hooks).
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    a.register_hook(lambda g: g * 10.0)
    post = []
    a.register_post_accumulate_grad_hook(post.append)
    (ga,) = autograd.grad((a * 2.0).sum(), a)
    assert_close(ga, [20.0, 20.0])
    assert a.grad is None and post == []


class _Fresh(fw.autograd.OpFunction):  # the base of built-in ops (arrays in, arrays out)
    """Identity whose backward returns a new array and remembers it (weakly)."""

    made = []

    def forward(ctx, x):
        return x.copy()

    def backward(ctx, g):
        out = g * 1.0
        _Fresh.made.append(weakref.ref(out))
        return out


def test_a_leafs_first_gradient_is_adopted_without_a_copy_when_nobody_else_holds_it():
    # The engine proves by refcount that the backward's fresh array is its own, and makes
    # it .grad instead of copying it (PyTorch's AccumulateGrad steals it the same way).
    _Fresh.made.clear()
    x = fw.tensor([1.0, 2.0], requires_grad=True)
    _Fresh.apply(x).backward(fw.tensor([1.0, 1.0]))
    assert x.grad._data is _Fresh.made[0]()
    assert_close(x.grad, [1.0, 1.0])


def test_a_gradient_returned_by_a_hook_is_not_adopted_as_grad():
    held = fw.tensor([5.0, 5.0])
    x = fw.tensor([1.0, 2.0], requires_grad=True)
    x.register_hook(lambda g: held)
    with fw.inplace.policy("on"):
        (x * 2.0).sum().backward()
        assert not np.shares_memory(x.grad._data, held._data)
        (x * 2.0).sum().backward()  # accumulates in place into x.grad
    assert_close(x.grad, [10.0, 10.0])
    assert_close(held, [5.0, 5.0])


@pytest.mark.parametrize("policy", ["on", "off"])
def test_zero_dim_gradients_stay_arrays_when_summed(policy):
    """0-d + 0-d is a NumPy scalar: the engine's sums (two paths into a node, into a leaf,
    and two roots) must still hand on arrays, so .grad.numpy() works."""
    with fw.inplace.policy(policy):
        b = fw.tensor(np.float32(0.3), requires_grad=True)
        h = b * 2.0
        loss = (h.abs() * 2.0).sum() + (h * 3.0).sum() + (b * 4.0).sum()
        loss.backward()
        assert isinstance(b.grad._data, np.ndarray) and b.grad.shape == ()
        np.testing.assert_allclose(b.grad.numpy(), 2.0 * 2.0 + 2.0 * 3.0 + 4.0)
        c = fw.tensor(np.float64(1.5), requires_grad=True)
        fw.autograd.backward([c * 2.0, c * 3.0], [fw.tensor(1.0, dtype=fw.float64)] * 2)
        assert isinstance(c.grad._data, np.ndarray)
        np.testing.assert_allclose(c.grad.numpy(), 5.0)
