"""Every inplace rule of the autograd contract, each error case and each safe case.

The expected gradients are worked out by hand in the comments; the behaviour follows
PyTorch (docs/INPLACE.md), except that the
version error also names the op that modified the tensor and where it was called.
"""

import inspect

import numpy as np
import pytest

import framework as fw
from framework import memory
from framework.testing import assert_close

LEAF_MSG = "a leaf Variable that requires grad is being used in an in-place operation"
VIEW_OF_LEAF_MSG = "a view of a leaf Variable that requires grad is being used in an in-place operation"
VERSION_MSG = "one of the variables needed for gradient computation has been modified by an inplace operation"
OVERLAP_MSG = "more than one element of the written-to tensor refers to a single memory location"
NO_GRAD_VIEW_MSG = (
    "view was created in no_grad mode and is being modified inplace with grad mode enabled"  # PyTorch's wording
)


def next_line() -> int:
    """The number of the line after the caller's: where the op under test is called."""
    return inspect.currentframe().f_back.f_lineno + 1


def copy_bytes() -> int:
    return memory.stats().get("inplace_copy_bytes", 0)


def values(t) -> np.ndarray:
    return np.array(t._data, copy=True)


# --- leaf protection: checked BEFORE the kernel, so nothing changes ---------------------

INPLACE_OPS = {
    "add_": lambda t: t.add_(1.0),
    "sub_": lambda t: t.sub_(1.0),
    "mul_": lambda t: t.mul_(2.0),
    "div_": lambda t: t.div_(2.0),
    "exp_": lambda t: t.exp_(),
    "sin_": lambda t: t.sin_(),
    "relu_": lambda t: t.relu_(),
    "zero_": lambda t: t.zero_(),
    "fill_": lambda t: t.fill_(7.0),
    "copy_": lambda t: t.copy_(fw.ones(t.shape)),
    "normal_": lambda t: t.normal_(),
}


def _iadd(t):
    t += 1.0


@pytest.mark.parametrize("op", sorted(INPLACE_OPS) + ["+="])
def test_inplace_on_leaf_requiring_grad_raises_before_value_changes(op):
    w = fw.tensor([1.0, -2.0, 3.0], requires_grad=True)
    before = values(w)
    with pytest.raises(RuntimeError, match=LEAF_MSG) as err:
        (_iadd if op == "+=" else INPLACE_OPS[op])(w)
    if op != "+=":
        assert op in str(err.value)  # the message names the inplace op
    np.testing.assert_array_equal(values(w), before)  # unlike Paddle, nothing was written
    assert w._version == 0
    assert w.is_leaf and w.grad_fn is None and w.requires_grad


@pytest.mark.parametrize(
    "write",
    [
        lambda w: w[1:].mul_(2.0),
        lambda w: w.view(3).add_(1.0),
        lambda w: w[0].zero_(),
        lambda w: w.__setitem__(0, 5.0),  # w[0] = 5.0 writes through a view of w
        lambda w: w.__setitem__(slice(0, 2), fw.ones(2)),
    ],
    ids=["slice.mul_", "view.add_", "index.zero_", "setitem-scalar", "setitem-tensor"],
)
def test_inplace_on_view_of_leaf_raises_before_value_changes(write):
    w = fw.tensor([1.0, -2.0, 3.0], requires_grad=True)
    before = values(w)
    with pytest.raises(RuntimeError, match=VIEW_OF_LEAF_MSG):
        write(w)
    np.testing.assert_array_equal(values(w), before)
    assert w._version == 0
    assert w.is_leaf


def test_inplace_on_leaf_and_its_view_allowed_under_no_grad_and_bumps_version():
    w = fw.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with fw.no_grad():
        w.add_(1.0)  # [2, 3, 4]
        w[0:2].mul_(2.0)  # [4, 6, 4]
        w[2] = 10.0  # [4, 6, 10]
    np.testing.assert_array_equal(values(w), [4.0, 6.0, 10.0])
    assert w._version == 3  # every inplace op bumps, grad mode or not
    assert w.is_leaf and w.requires_grad and w.grad_fn is None
    # The leaf is still usable: d/dw sum(w*w) = 2w with the NEW values.
    (w * w).sum().backward()
    assert_close(w.grad, [8.0, 12.0, 20.0])


def test_inplace_on_leaf_not_requiring_grad_is_allowed():
    x = fw.tensor([1.0, 2.0])
    x.add_(1.0)
    np.testing.assert_array_equal(values(x), [2.0, 3.0])
    assert x._version == 1 and x.is_leaf and not x.requires_grad


# --- detach() shares the version counter, .data does not ---------------------------------


def test_detach_shares_version_counter_so_autograd_sees_the_change():
    a = fw.tensor([0.0, 1.0], requires_grad=True)
    y = a.sin()  # SinBackward0 saves a
    d = a.detach()
    assert not d.requires_grad and d._version == a._version == 0
    line = next_line()
    d.add_(1.0)
    assert a._version == 1  # same counter
    np.testing.assert_array_equal(values(a), [1.0, 2.0])  # same memory
    with pytest.raises(RuntimeError, match=VERSION_MSG) as err:
        y.sum().backward()
    msg = str(err.value)
    assert "SinBackward0" in msg and "add_" in msg and f"{__file__}:{line}" in msg


def test_data_is_the_escape_hatch_no_error_and_silently_different_gradient():
    a = fw.tensor([0.0, 1.0], requires_grad=True)
    y = a.sin()  # saves a (by memory, not by value)
    a.data.add_(1.0)  # new version counter: autograd does not see this write
    assert a._version == 0
    y.sum().backward()  # no error, as in PyTorch
    # The gradient is cos(a_new) = cos([1, 2]), not the true cos(a_old) = cos([0, 1]).
    assert_close(a.grad, np.cos([1.0, 2.0]).astype(np.float32))
    assert not np.allclose(a.grad.numpy(), np.cos([0.0, 1.0]))


def test_data_setter_replaces_values_without_history():
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    a.data = fw.tensor([5.0, 6.0])
    np.testing.assert_array_equal(values(a), [5.0, 6.0])
    assert a.is_leaf and a.requires_grad


# --- the version error: shape, dtype, the op that saved, versions, the op that wrote ------


def test_saved_input_modified_error_names_tensor_op_versions_and_call_site():
    x = fw.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], requires_grad=True)
    b = x * 1.0
    c = b.sin()  # SinBackward0 saves its input b
    line = next_line()
    b.add_(1.0)
    with pytest.raises(RuntimeError) as err:
        c.sum().backward()
    msg = str(err.value)
    assert VERSION_MSG in msg
    assert "(2, 3)" in msg and "float32" in msg  # the tensor: shape and dtype
    assert "SinBackward0" in msg  # the op whose backward needed it
    assert "is at version 1; expected version 0" in msg
    assert "add_" in msg and f"{__file__}:{line}" in msg  # the op that changed it, and where


def test_two_modifications_are_both_named_in_order():
    x = fw.tensor([1.0, 2.0], requires_grad=True)
    b = x * 1.0
    c = b.sin()
    line_add = next_line()
    b.add_(1.0)
    line_mul = next_line()
    b.mul_(3.0)
    with pytest.raises(RuntimeError, match=VERSION_MSG) as err:
        c.sum().backward()
    msg = str(err.value)
    assert "is at version 2; expected version 0" in msg
    first, second = f"add_ at {__file__}:{line_add}", f"mul_ at {__file__}:{line_mul}"
    assert first in msg and second in msg
    assert msg.index(first) < msg.index(second)


def test_saved_result_modified_names_the_output():
    a = fw.tensor([0.5, 1.0], requires_grad=True)
    e = a.exp()  # ExpBackward0 saves its result e
    line = next_line()
    e.mul_(2.0)
    with pytest.raises(RuntimeError, match=VERSION_MSG) as err:
        e.sum().backward()
    msg = str(err.value)
    assert "the output of ExpBackward0" in msg and f"mul_ at {__file__}:{line}" in msg


def test_inplace_through_a_view_bumps_the_shared_counter_and_invalidates_saved_base():
    a = fw.tensor([1.0, 2.0, 3.0], requires_grad=True)
    b = a * 1.0
    c = b.sin()  # saves b
    v = b[0:1]
    line = next_line()
    v.mul_(2.0)
    assert v._version == b._version == 1
    with pytest.raises(RuntimeError, match=VERSION_MSG) as err:
        c.sum().backward()
    assert f"mul_ at {__file__}:{line}" in str(err.value)


# --- safe inplace: no error, PyTorch's gradients, nothing copied --------------------------


def test_exp_inplace_after_use_only_by_ops_that_save_their_result():
    memory.reset_stats()
    a = fw.tensor([0.0, 0.5], requires_grad=True)
    b = a * 2.0  # MulBackward0 by a constant saves nothing of b
    c = b.exp()  # ExpBackward0 saves c, not b
    b.exp_()  # so overwriting b is safe
    (c + 3.0 * b).sum().backward()
    # c = e^{2a}, b_new = e^{2a}: dL/da = 2e^{2a} + 3 * 2e^{2a} = 8e^{2a} = [8, 8e]
    assert_close(a.grad, [8.0, 8.0 * np.e])
    assert copy_bytes() == 0  # exp_ saves its result: free in place


def test_relu_inplace_on_an_intermediate():
    memory.reset_stats()
    a = fw.tensor([-1.0, 2.0], requires_grad=True)
    w = fw.tensor([3.0, 4.0], requires_grad=True)
    h = a * w  # [-3, 8]; MulBackward0 saves a and w, not h
    h.relu_()  # [0, 8]; ReluBackward0 saves its result
    h.sum().backward()
    # mask = [0, 1]: dL/da = w * mask = [0, 4], dL/dw = a * mask = [0, 2]
    assert_close(a.grad, [0.0, 4.0])
    assert_close(w.grad, [0.0, 2.0])
    assert copy_bytes() == 0
    np.testing.assert_array_equal(values(h), [0.0, 8.0])


def test_residual_add_inplace_out_plus_identity():
    a = fw.tensor([1.0, -2.0], requires_grad=True)
    w = fw.tensor([3.0, 0.5], requires_grad=True)
    identity = a * 1.0
    out = identity * w  # [3, -1]; saves identity and w, not out
    out += identity  # [4, -3]: the residual add, in place
    out = out.relu()  # [4, 0]
    out.sum().backward()
    # mask = [1, 0]: dL/da = (w + 1) * mask = [4, 0]; dL/dw = a * mask = [1, 0]
    assert_close(a.grad, [4.0, 0.0])
    assert_close(w.grad, [1.0, 0.0])


def test_mul_inplace_by_a_constant():
    memory.reset_stats()
    a = fw.tensor([0.0, 1.0], requires_grad=True)
    b = a.sin()  # SinBackward0 saves a, not b
    b.mul_(3.0)
    b.sum().backward()
    # d/da 3 sin(a) = 3 cos(a) = [3, 3cos(1)]
    assert_close(a.grad, [3.0, 3.0 * np.cos(1.0)])
    assert copy_bytes() == 0


def test_div_inplace_by_a_tensor_with_a_gradient_keeps_the_overwritten_input():
    # PyTorch's div_ saves self (a clone) for the divisor's gradient, never its result:
    # the result may change again afterwards (b.add_(1)) and backward is still right
    memory.reset_stats()
    a = fw.tensor([2.0, 6.0], requires_grad=True)
    y = fw.tensor([4.0, 3.0], requires_grad=True)
    b = a * 1.0
    b.div_(y)  # [0.5, 2]
    b.add_(1)
    b.sum().backward()
    # dL/da = 1/y = [0.25, 1/3]; dL/dy = -a/y^2 = [-2/16, -6/9]
    assert_close(a.grad, [0.25, 1.0 / 3.0])
    assert_close(y.grad, [-0.125, -6.0 / 9.0])
    assert copy_bytes() == b.nbytes  # the old b, kept for y's gradient


def test_div_inplace_by_a_constant_is_free():
    memory.reset_stats()
    a = fw.tensor([2.0, 6.0], requires_grad=True)
    b = a * 1.0
    b.div_(fw.tensor([4.0, 3.0]))
    b.add_(1)
    b.sum().backward()
    assert_close(a.grad, [0.25, 1.0 / 3.0])
    assert copy_bytes() == 0  # only the divisor is read


@pytest.mark.parametrize(
    "op, expected",
    [
        # d/da sin(a) = cos(a)
        ("sin_", lambda a: np.cos(a)),
        # d/da log(a) = 1/a = [1, 0.5, 0.25]
        ("log_", lambda a: 1.0 / a),
    ],
)
def test_ops_that_need_the_overwritten_input_keep_a_counted_copy(op, expected):
    memory.reset_stats()
    a_np = np.array([1.0, 2.0, 4.0], dtype=np.float32)
    a = fw.tensor(a_np, requires_grad=True)
    b = a * 1.0
    getattr(b, op)()
    assert copy_bytes() == b.nbytes  # the memory this inplace op did NOT save
    b.sum().backward()
    assert_close(a.grad, expected(a_np))


def test_mul_inplace_by_a_tensor_that_requires_grad_keeps_a_copy():
    memory.reset_stats()
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    w = fw.tensor([3.0, 5.0], requires_grad=True)
    b = a * 1.0
    b.mul_(w)  # w's gradient needs the old b
    assert copy_bytes() == b.nbytes
    b.sum().backward()
    # dL/da = w = [3, 5]; dL/dw = a (old b) = [1, 2]
    assert_close(a.grad, [3.0, 5.0])
    assert_close(w.grad, [1.0, 2.0])


def test_mul_inplace_by_itself_is_refused_in_backward_as_in_pytorch():
    # PyTorch keeps a copy of the overwritten self only; the other factor is saved as
    # itself, and this very op changes it: backward raises (pytorch 2.13 does too)
    a = fw.tensor([1.0, 2.0, 3.0], requires_grad=True)
    b = a * 1.0
    b.mul_(b)
    assert b.tolist() == [1.0, 4.0, 9.0]
    with pytest.raises(RuntimeError, match=r"input 'y' of MulBackward0, is at version 1; expected version 0"):
        b.sum().backward()
    b = a * 1.0
    b.mul_(b.clone())  # the way that works: b^2
    b.sum().backward()
    assert_close(a.grad, [2.0, 4.0, 6.0])  # d/da a^2 = 2a


# --- inplace on a view of a non-leaf: CopySlices rewrites the base's history ---------------


def test_inplace_on_view_of_non_leaf_gives_correct_gradient_and_regenerates_other_views():
    a = fw.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    b = a * 2.0
    v_other = b[2:4]  # created BEFORE the write, overlaps it at index 2
    stale = v_other.grad_fn
    b[1:3].mul_(3.0)
    assert b.grad_fn.name() == "CopySlices" and b.grad_fn.fn.name() == "MulBackward0"  # PyTorch's names
    assert not b.is_leaf
    # The old view sees the new history: its grad_fn was regenerated on the new base.
    assert v_other.grad_fn is not stale
    assert v_other.grad_fn.next[0] is b.grad_fn
    np.testing.assert_array_equal(values(v_other), [18.0, 8.0])
    (b * fw.tensor([1.0, 10.0, 100.0, 1000.0])).sum().backward(retain_graph=True)
    # b = [2a0, 6a1, 6a2, 2a3]: dL/da = [2*1, 6*10, 6*100, 2*1000]
    assert_close(a.grad, [2.0, 60.0, 600.0, 2000.0])
    a.grad = None
    v_other.sum().backward()
    # v_other = [6a2, 2a3]: [0, 0, 6, 2] (a stale graph would give [0, 0, 2, 2])
    assert_close(a.grad, [0.0, 0.0, 6.0, 2.0])


def test_inplace_through_a_chain_of_views():
    a = fw.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], requires_grad=True)
    b = a * 1.0
    b.view(2, 3)[1][0:2].mul_(10.0)  # elements 3 and 4 of b
    (b * fw.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])).sum().backward()
    # dL/da = k, times 10 where the view was scaled
    assert_close(a.grad, [1.0, 2.0, 3.0, 40.0, 50.0, 6.0])


def test_two_writes_through_overlapping_views():
    a = fw.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    b = a * 1.0
    b[0:2].mul_(2.0)  # [2a0, 2a1, a2, a3]
    b[1:3].mul_(3.0)  # [2a0, 6a1, 3a2, a3]
    np.testing.assert_array_equal(values(b), [2.0, 12.0, 9.0, 4.0])
    (b * fw.tensor([1.0, 10.0, 100.0, 1000.0])).sum().backward()
    assert_close(a.grad, [2.0, 60.0, 300.0, 1000.0])


def test_write_into_base_then_use_an_old_view():
    a = fw.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    b = a * 2.0
    v = b[0:2]
    stale = v.grad_fn
    b.mul_(3.0)  # b itself (not a view) gets a new grad_fn
    assert v.grad_fn is not stale and v.grad_fn.next[0] is b.grad_fn
    np.testing.assert_array_equal(values(v), [6.0, 12.0])
    v.sum().backward()
    # v = 6 a[0:2]: [6, 6, 0, 0]
    assert_close(a.grad, [6.0, 6.0, 0.0, 0.0])


def test_setitem_with_a_value_that_requires_grad_makes_the_target_a_non_leaf():
    w = fw.tensor([5.0, 6.0], requires_grad=True)
    x = fw.zeros(3)
    assert x.is_leaf and not x.requires_grad
    x[0:2] = w
    assert not x.is_leaf and x.requires_grad and x.grad_fn is not None
    np.testing.assert_array_equal(values(x), [5.0, 6.0, 0.0])
    (x * fw.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert_close(w.grad, [1.0, 2.0])  # x[0:2] = w: dL/dw = k[0:2]


def test_setitem_overwritten_elements_get_no_gradient():
    a = fw.tensor([1.0, 2.0, 3.0], requires_grad=True)
    b = a * 1.0
    b[0] = 0.0
    b.sum().backward()
    assert_close(a.grad, [0.0, 1.0, 1.0])  # b[0] no longer depends on a[0]


# --- error cases that change nothing ---------------------------------------------------------


@pytest.mark.parametrize("requires_grad", [False, True])
def test_write_through_expanded_view_raises_and_changes_nothing(requires_grad):
    src = fw.tensor([1.0, 2.0], requires_grad=requires_grad)
    base = src * 1.0 if requires_grad else src
    e = base.view(2, 1).expand(2, 3)  # each element of base seen 3 times
    before, version = values(base), base._version
    with pytest.raises(RuntimeError, match=OVERLAP_MSG):
        e.add_(1.0)
    with pytest.raises(RuntimeError, match=OVERLAP_MSG):
        e[:, 0:2] = 5.0  # still overlapping
    np.testing.assert_array_equal(values(base), before)
    assert base._version == version


def test_view_made_under_no_grad_then_modified_with_grad_on_raises():
    a = fw.tensor([1.0, 2.0, 3.0], requires_grad=True)
    b = a * 1.0
    with fw.no_grad():
        v = b[0:2]
    with pytest.raises(RuntimeError, match=NO_GRAD_VIEW_MSG):
        v.mul_(2.0)
    np.testing.assert_array_equal(values(b), [1.0, 2.0, 3.0])
    assert b._version == 0
    with fw.no_grad():
        v.mul_(2.0)  # allowed where no history is recorded
    assert b._version == 1


def test_no_grad_view_of_a_plain_tensor_written_with_a_value_that_requires_grad_raises():
    # The base does not require grad, but the written value does: its history cannot be
    # attached through a view whose chain was not recorded (PyTorch raises here too).
    w = fw.tensor([5.0, 6.0], requires_grad=True)
    x = fw.zeros(4)
    with fw.no_grad():
        v = x[0:2]
    with pytest.raises(RuntimeError, match=NO_GRAD_VIEW_MSG):
        v.copy_(w)
    np.testing.assert_array_equal(values(x), np.zeros(4))
    assert x._version == 0 and x.is_leaf
    v.copy_(fw.tensor([1.0, 1.0]))  # nothing requires grad: a plain write is fine
    np.testing.assert_array_equal(values(x), [1.0, 1.0, 0.0, 0.0])


def test_optimizer_style_update_bumps_version_so_stale_graph_raises():
    p = fw.tensor([1.0, 2.0], requires_grad=True)
    loss = (p * p).sum()  # MulBackward0 saves p
    loss.backward(retain_graph=True)
    assert_close(p.grad, [2.0, 4.0])
    lr = 0.1
    with fw.no_grad():
        line = next_line()
        p -= lr * p.grad
    assert p._version == 1 and p.is_leaf
    assert_close(p, [0.8, 1.6])
    with pytest.raises(RuntimeError, match=VERSION_MSG) as err:
        loss.backward()  # would use the NEW p with a graph recorded on the old one
    msg = str(err.value)
    assert "MulBackward0" in msg and f"sub_ at {__file__}:{line}" in msg
