"""PyTorch's own autograd tests about inplace ops, views, versions and leaves, ported.

Each test names the test of ``test/test_autograd.py`` (class ``TestAutograd`` unless
said otherwise) it comes from; the assertions are PyTorch's, written against this
framework's API (``fw.tensor`` for ``torch.tensor``, ``x.tolist()``/``assert_close`` for
``assertEqual``, float64 where PyTorch's autograd tests set it as the default dtype).
The rest of the port is in ``test_pytorch_parity_function.py`` (custom Functions),
``test_pytorch_parity_modes.py`` (inference mode, allow_mutation_on_saved_tensors) and
``test_pytorch_parity_views.py`` (``test/test_view_ops.py``).

Left out, with the reason (outside this framework's scope or API):

- create_graph / double backward (gradgradcheck, ``grad(..., create_graph=True)``):
  test_accumulate_grad, test_hessian_vector, test_grad, test_grad_nonleaf,
  test_custom_autograd_repeated_grad_grad, the gradgradcheck halves of the ported
  tests, test_inplace_on_view_backward, TestAllowMutationOnSaved.test_double_backward.
- complex dtypes and math views (conj/neg bits, view_as_real/complex, real/imag):
  test_first_grad_fn_access_in_no_grad_mode, test_autograd_inplace_views_cross_dtype,
  test_named_tensor_for_complex_views, TestAllowMutationOnSaved.test_with_math_views,
  the cdouble half of test_autograd_simple_views_python.
- sparse tensors, CUDA/multi-device, streams, threads, TorchScript/dynamo, functorch,
  forward-mode AD, profiler, checkpointing, nested tensors: every test of those
  families (test_set_data_tensorimpl_type is sparse-only).
- saved-tensor hooks and raw SavedVariable accessors (``_raw_saved_*``,
  ``saved_tensors_hooks``): nodes here hold raw arrays, not SavedVariable objects:
  test_saved_variable_version_counter, test_saved_variable_packing_unpacking_*,
  test_no_unnecessary_unwrapping. (``grad_fn._saved_self`` and the other
  ``_saved_<name>`` readers, test_grad_fn_attr_bindings's first half, are in
  ``test_pytorch_parity_semantics.py``.)
- inplace *view* ops that change a tensor's geometry in place (``t_``, ``transpose_``,
  ``squeeze_``, ``unsqueeze_``, ``swapdims_``, ``as_strided_``, ``set_``, ``resize_``)
  do not exist here: test_autograd_inplace_views_creation_meta, test_resize_version_bump.
- ``unsafe_split``/``unsafe_chunk`` do not exist: test_inplace_on_view_multi_output_unsafe.
- Node internals (``next_functions``, ``register_hook`` post-hooks on nodes,
  ``GradientEdge``, ``_will_engine_execute_node``, ``output_nr``, ``DelayedError``):
  test_next_functions, test_grad_to_node_*, test_copy_slices_graph_task_updates,
  test_save_output_nr, test_tensor_grad_warnings.
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import numpy as np
import pytest

import framework as fw
from framework.testing import assert_close, gradcheck

VERSION_MSG = "modified by an inplace operation"
LEAF_MSG = "a leaf Variable that requires grad is being used in an in-place operation"
VIEW_OF_LEAF_MSG = "a view of a leaf Variable that requires grad is being used in an in-place operation"
NO_GRAD_VIEW_MSG = "A view was created in no_grad mode and is being modified inplace"
MULTI_VIEW_MSG = "This view is the output of a function that returns multiple views."
RETAIN_GRAPH_MSG = "Specify retain_graph=True"


def f64(*shape, requires_grad=False):
    return fw.tensor(
        np.random.default_rng(sum(shape) + 7).standard_normal(shape), dtype=fw.float64, requires_grad=requires_grad
    )


# --- retain_grad and tensor hooks across inplace ops ------------------------------------------


def test_retain_grad():  # test_retain_grad
    inp = fw.rand(1, 3, requires_grad=True)
    h1 = inp * 3
    out = (h1 * h1).sum()
    h1.retain_grad()
    h1.retain_grad()  # can be called several times
    out.backward(retain_graph=True)
    assert_close(h1.grad, (h1 * 2).detach())
    out.backward(retain_graph=True)
    assert_close(h1.grad, (h1 * 4).detach())  # accumulated
    with fw.no_grad():
        inp.grad.zero_()
    inp.retain_grad()  # a no-op on leaves
    inp.retain_grad()
    out.backward()
    assert_close(inp.grad, (inp * 18).detach())


def test_retain_grad_inplace():  # test_retain_grad_inplace
    a = fw.tensor([1.0], requires_grad=True).clone()
    a.retain_grad()
    a.mul_(2)
    a.sum().backward()
    assert a.grad.tolist() == [1.0]  # the gradient of the latest a, not of the clone

    a = fw.tensor([1.0], requires_grad=True).clone()
    a.retain_grad()
    a.mul_(2)
    a.mul_(2)  # several inplace ops
    a.sum().backward()
    assert a.grad.tolist() == [1.0]

    # An inplace op through a view moves the base's hook to CopySlices; then one on the base.
    x = fw.tensor([1.0], requires_grad=True).clone()
    x.retain_grad()
    x_view = x[:]
    x_view *= 2
    x *= 2
    x.sum().backward()
    assert x.grad.tolist() == [1.0]  # 1, not 4: the gradient of the latest x

    # A base that did not require grad has no hook to move.
    x = fw.zeros(4)
    y = x.view(2, 2)
    y.add_(fw.randn(2, 2, requires_grad=True))
    assert x.requires_grad and not x.is_leaf


def test_retain_grad_inplace_over_view():  # test_retain_grad_inplace_over_view
    base = fw.tensor([1.0], requires_grad=True).clone()
    view = base[:]
    view2 = base[:]
    view.retain_grad()
    view2.retain_grad()
    view.mul_(2)
    (view + view2).sum().backward()
    # Without moving the hooks to the views' new grad_fns, the grads would be None.
    assert view.grad is not None and view2.grad is not None
    assert view.grad.tolist() == view2.grad.tolist() == [1.0]


def test_retain_grad_cycle():  # test_retain_grad_cycle
    x = fw.ones(5, 5, requires_grad=True)

    def run_test():
        y = x * 2
        y.retain_grad()
        return y / 2, weakref.ref(y)

    z, ref = run_test()
    assert ref() is None  # retain_grad does not keep y alive
    z.sum().backward()


def test_tensor_hooks_inplace():  # test_tensor_hooks_inplace
    count1, count2 = [0], [0]

    def fn1(grad):
        count1[0] += 1
        assert grad.tolist() == [4.0]  # x2 from mul_, x2 from fn2
        return grad * 2

    def fn2(grad):
        count2[0] += 1
        assert grad.tolist() == [1.0]
        return grad * 2

    a = fw.tensor([1.0], requires_grad=True)
    b = a.clone()
    b.register_hook(fn1)  # stays on the old value's node
    b.mul_(2)
    b.register_hook(fn2)  # goes to the new value's node
    b.sum().backward()
    assert count1 == [1] and count2 == [1]
    assert a.grad.tolist() == [8.0]

    count3 = [0]

    def fn3(grad):
        count3[0] += 1
        assert grad.tolist() == [4.0]
        return grad * 2

    a = fw.tensor([1.0], requires_grad=True)
    b = a.clone()
    b.register_hook(fn3)
    b.mul_(2)
    b.mul_(2)
    b.sum().backward()
    assert count3 == [1]
    assert a.grad.tolist() == [8.0]


def test_tensor_hooks_inplace_over_view():  # test_tensor_hooks_inplace_over_view
    count = [0]

    def fail(grad):
        raise AssertionError("a hook of the old view value ran")

    def fn2(grad):
        count[0] += 1
        assert grad.tolist() == [1.0]

    base = fw.tensor([1.0], requires_grad=True).clone()
    view = base[:]
    view2 = base[:]
    view.register_hook(fail)
    view2.register_hook(fail)
    view.mul_(2)
    view2.grad_fn  # explicitly trigger the update of view2's grad_fn  # noqa: B018
    view2.register_hook(fn2)
    (view + view2).sum().backward()
    assert count == [1]


# --- grad mode ------------------------------------------------------------------------------


def test_no_grad():  # test_no_grad
    x = fw.ones(5, 5, requires_grad=True)
    y = fw.ones(5, 5) * 4
    with fw.no_grad():
        w = x + y

    def adder(x, y):
        return x + y

    for add in (fw.no_grad()(adder), fw.no_grad(adder)):
        z = add(x, y)
        assert not w.requires_grad and w.grad_fn is None
        with pytest.raises(RuntimeError):
            w.backward(fw.ones(5, 5))
        assert not z.requires_grad and z.grad_fn is None
        with pytest.raises(RuntimeError):
            z.backward(fw.ones(5, 5))
    with fw.no_grad():
        assert not fw.is_grad_enabled()
        adder(x, y)
        assert not fw.is_grad_enabled()


def test_index_backward_does_not_save_tensor():  # test_index_backward_does_not_save_tensor
    a = fw.tensor([1.0, 0.0, 0.0])
    b = fw.zeros(3, requires_grad=True)
    tensor = b + 0
    tensor[a != 0] = tensor[a != 0]  # indexing saves the index, not the indexed tensor
    tensor.backward(fw.zeros_like(tensor))


# --- requires_grad --------------------------------------------------------------------------


def test_requires_grad_():  # test_requires_grad_
    x = fw.randn(5, 5)
    y = fw.randn(5, 5, requires_grad=True)
    assert x.requires_grad_() is x and x.requires_grad
    assert y.requires_grad_() is y and y.requires_grad
    assert x.requires_grad_(True) is x and x.requires_grad
    assert y.requires_grad_(True) is y and y.requires_grad
    z = x * y
    with pytest.raises(RuntimeError):
        z.requires_grad_(False)
    assert z.requires_grad_() is z and z.requires_grad
    assert z.requires_grad_(True) is z and z.requires_grad
    assert x.requires_grad_(False) is x and not x.requires_grad
    assert y.requires_grad_(False) is y and not y.requires_grad


def test_requires_grad_inplace():  # test_requires_grad_inplace
    a = fw.randn(5, 5)
    b = fw.randn(5, 5, requires_grad=True)
    a += b
    assert a.requires_grad
    a = fw.randn(5, 5) + 0  # non-leaf
    b = fw.randn(5, 5, requires_grad=True)
    a += b
    assert a.requires_grad


def test_no_requires_grad_inplace():  # test_no_requires_grad_inplace
    a = fw.randn(2, 3)
    a.add_(5)
    a.requires_grad = True
    a.sum().backward()
    assert a.grad.tolist() == np.ones((2, 3)).tolist()

    a = fw.randn(2, 3)  # same with a view
    b = a[:]
    b.add_(5)
    a.requires_grad = True
    a.sum().backward()
    assert a.grad.tolist() == np.ones((2, 3)).tolist()

    a = fw.randn(2, 3)  # fails once a requires grad
    b = a[:]
    a.requires_grad = True
    with pytest.raises(RuntimeError, match=LEAF_MSG):
        a.add_(5)
    with pytest.raises(RuntimeError, match=VIEW_OF_LEAF_MSG):
        b.add_(5)


def test_set_requires_grad_only_for_floats():  # TestAutogradDeviceType.test_set_requires_grad_only_for_floats
    for dtype in (fw.float32, fw.float64, fw.int32, fw.int64):
        a = fw.ones(1, dtype=dtype)
        a.requires_grad = False  # always works
        a.requires_grad_(False)
        makers = (
            lambda dtype=dtype: fw.ones(1, dtype=dtype).requires_grad_(),
            lambda dtype=dtype: setattr(fw.ones(1, dtype=dtype), "requires_grad", True),
            lambda dtype=dtype: fw.ones(1, dtype=dtype, requires_grad=True),
        )
        for make in makers:
            if np.dtype(dtype).kind == "f":
                make()
            else:
                with pytest.raises(RuntimeError, match="floating point"):
                    make()


def test_view_made_a_leaf_refuses_inplace():
    # A view whose base does not require grad can be made a leaf that requires grad
    # (PyTorch allows it); then, as in PyTorch (check_inplace: the view requires grad and
    # its base is a leaf), an inplace op on it raises instead of silently making it a
    # non-leaf that loses its gradient.
    t = fw.zeros(4)
    v = t[:2]
    v.requires_grad = True
    assert v.is_leaf and v.requires_grad
    with pytest.raises(RuntimeError, match=VIEW_OF_LEAF_MSG):
        v.add_(1)
    assert t.tolist() == [0.0] * 4 and v.is_leaf
    (v * 2).sum().backward()
    assert v.grad.tolist() == [2.0, 2.0]


# --- backward twice -------------------------------------------------------------------------


def test_backward_twice_with_saved_values():  # test_backward_twice_with_saved_values
    b = f64(3, requires_grad=True)
    c = fw.zeros(3, dtype=fw.float64)
    c[[1, 2]] = b[[1, 1]]
    c.backward(fw.tensor([1.0, 1.0, 1.0], dtype=fw.float64))
    with pytest.raises(RuntimeError, match=RETAIN_GRAPH_MSG):
        c.backward(fw.tensor([1.0, 1.0, 1.0], dtype=fw.float64))


def test_backward_twice_retained_graph_with_saved_values():  # test_backward_twice_retained_graph_with_saved_values
    b = f64(3, requires_grad=True)
    c = fw.zeros(3, dtype=fw.float64)
    c[[1, 2]] = b[[1, 1]]
    c.backward(fw.tensor([1.0, 1.0, 1.0], dtype=fw.float64), retain_graph=True)
    c.backward(fw.tensor([1.0, 1.0, 1.0], dtype=fw.float64))
    assert b.grad.tolist() == [0.0, 4.0, 0.0]  # b[1] reaches c twice, twice


def test_backward_twice_without_saved_values():  # test_backward_twice_without_saved_values
    b = f64(3, requires_grad=True)
    c = b + 1
    c.backward(fw.tensor([1.0, 1.0, 1.0], dtype=fw.float64))
    c.backward(fw.tensor([1.0, 1.0, 1.0], dtype=fw.float64))
    assert b.grad.tolist() == [2.0, 2.0, 2.0]


# PyTorch: test_backward_twice_retained_graph_without_saved_values
def test_backward_twice_retained_graph_without_saved_values():
    b = f64(3, requires_grad=True)
    c = fw.zeros(3, dtype=fw.float64)
    c[[1, 2]] = b[[1, 1]]
    c.backward(fw.tensor([1.0, 1.0, 1.0], dtype=fw.float64), retain_graph=True)
    c.backward(fw.tensor([1.0, 1.0, 1.0], dtype=fw.float64))


# --- inplace ops and the versions of saved tensors -------------------------------------------


def test_inplace():  # test_inplace
    x = fw.ones(5, 5, requires_grad=True)
    y = (fw.ones(5, 5) * 4).requires_grad_()
    z = x * y
    q = z + y
    w = z * y
    z.add_(2)
    q.backward(fw.ones(5, 5), retain_graph=True)  # add does not need its inputs
    with pytest.raises(RuntimeError, match=VERSION_MSG):
        w.backward(fw.ones(5, 5))  # mul saved z

    z = x * y
    q = z * y
    r = z + y
    w = z.add_(y)
    w.backward(fw.ones(5, 5), retain_graph=True)  # w is the latest z
    r.backward(fw.ones(5, 5), retain_graph=True)  # r does not use the modified value
    with pytest.raises(RuntimeError, match=VERSION_MSG):
        q.backward(fw.ones(5, 5))  # q uses the dirty z

    with fw.no_grad():
        x.grad.zero_()
    m = x / 2
    z = m + y / 8
    q = z * y
    r = z + y
    prev_version = z._version
    w = z.exp_()
    assert z._version != prev_version
    r.backward(fw.ones(5, 5), retain_graph=True)
    assert_close(x.grad, np.ones((5, 5)) / 2)
    w.backward(fw.ones(5, 5), retain_graph=True)
    assert_close(x.grad, np.full((5, 5), (1 + np.e) / 2))
    with pytest.raises(RuntimeError, match=VERSION_MSG):
        q.backward(fw.ones(5, 5))

    leaf = fw.ones(5, 5, requires_grad=True)
    x = leaf.clone()
    x.add_(10)
    assert x.tolist() == (np.ones((5, 5)) * 11).tolist()
    y = x + 2  # x is still usable
    y.backward(fw.ones(5, 5))
    assert leaf.grad.tolist() == np.ones((5, 5)).tolist()
    z = x * y
    x.add_(2)
    with pytest.raises(RuntimeError, match=VERSION_MSG):
        z.backward(fw.ones(5, 5))


def _test_setitem(size, index):  # TestAutograd._test_setitem
    x = fw.ones(*size, dtype=fw.float64, requires_grad=True)
    y = x + 2
    y_version = y._version
    y[index] = 2
    assert y._version != y_version
    y.backward(fw.ones(*size, dtype=fw.float64))
    expected = np.ones(size)
    expected[index if not isinstance(index, fw.Tensor) else index.numpy()] = 0
    assert_close(x.grad, expected)


def _test_setitem_tensor(size, index):  # TestAutograd._test_setitem_tensor
    x = fw.ones(*size, dtype=fw.float64, requires_grad=True)
    y = x + 2
    y_version = y._version
    value = fw.full(x[index].shape, 7.0, dtype=fw.float64).requires_grad_()
    y[index] = value
    assert y._version != y_version
    y.backward(fw.ones(*size, dtype=fw.float64))
    expected = np.ones(size)
    expected[index if not isinstance(index, fw.Tensor) else index.numpy()] = 0
    assert_close(x.grad, expected)
    assert_close(value.grad, np.ones(value.shape))
    # x broadcasts as y[1]
    x = fw.randn(4, requires_grad=True)
    y = fw.zeros(2, 3, 4)
    y[1] = x
    y.backward(fw.randn(2, 3, 4))
    assert x.grad.shape == x.shape


@pytest.mark.parametrize(
    "size, index",
    [
        ((5, 5), 1),
        ((5,), 1),
        ((1,), 0),
        ((10,), [0, 4, 2]),
        ((5, 5), ([0, 4], [2, 2])),
        ((5, 5, 5), (slice(None), slice(None), [1, 3])),
        ((5, 5, 5), (slice(None), [1, 3], slice(None))),
        ((5, 5, 5), ([1, 3], slice(None), slice(None))),
        ((5, 5, 5), (slice(None), [2, 4], [1, 3])),
        ((5, 5, 5), ([1, 3], [2, 4], slice(None))),
    ],
)
def test_setitem(size, index):  # test_setitem
    _test_setitem(size, index)


@pytest.mark.parametrize(
    "size, index",
    [
        ((5, 5), 3),
        ((5, 5), ([0, 1], [1, 0])),
        ((5,), 3),
        ((5,), [[0, 1, 2, 3]]),
        ((5, 5, 5), (slice(None), slice(None), [1, 3])),
        ((5, 5, 5), (slice(None), [1, 3], slice(None))),
        ((5, 5, 5), ([1, 3], slice(None), slice(None))),
        ((5, 5, 5), (slice(None), [2, 4], [1, 3])),
        ((5, 5, 5), ([1, 3], [2, 4], slice(None))),
    ],
)
def test_setitem_tensor(size, index):  # test_setitem (the _test_setitem_tensor half)
    _test_setitem_tensor(size, index)


def test_setitem_mask():  # test_setitem_mask
    mask = fw.tensor(np.random.default_rng(0).random((5, 5)) > 0.5)
    _test_setitem((5, 5), mask)
    _test_setitem((5,), mask[0])
    _test_setitem((1,), mask[0, 0:1])
    _test_setitem_tensor((5, 5), mask)
    _test_setitem_tensor((5,), mask[0])


def test_select_sum():  # test_select_sum
    x = f64(10, requires_grad=True)
    gradcheck(lambda x: x.select(0, 1).sum(), [x])


def test_unused_output():  # test_unused_output
    x = fw.randn(10, 10, requires_grad=True)
    outputs = x.chunk(5)
    o = outputs[2] * 4 + 2
    o.sum().backward()
    expected = np.zeros((10, 10))
    expected[4:6] = 4
    assert_close(x.grad, expected)
    with fw.no_grad():
        x.grad.zero_()
    grad_output = fw.randn(2, 10)
    outputs = x.chunk(5)
    outputs[0].backward(grad_output)
    expected = np.zeros((10, 10))
    expected[:2] = grad_output.numpy()
    assert_close(x.grad, expected)


def test_grad_nonleaf_many_outputs():  # test_grad_nonleaf_many_outputs (without create_graph)
    x = fw.randn(4, 2, requires_grad=True)
    a, b = x.chunk(2)
    hook_called = [False]
    x.register_hook(lambda g: hook_called.__setitem__(0, True))
    go = fw.randn(2, 2)
    grad_a, grad_b = fw.autograd.grad(a + 2 * b, [a, b], grad_outputs=go)
    assert_close(grad_a, go)
    assert_close(grad_b, (go * 2).numpy())
    assert not hook_called[0] and x.grad is None


def test_grad_nonleaf_register_hook():  # test_grad_nonleaf_register_hook
    x = fw.randn(5, requires_grad=True)
    x_list = x.unbind()
    hook_results = [None]

    def hook(grad):
        hook_results[0] = grad

    x_list[0].register_hook(hook)
    x_list[0].backward()
    assert hook_results[0].tolist() == 1.0
    expected = [1.0, 0.0, 0.0, 0.0, 0.0]
    assert x.grad.tolist() == expected
    assert x_list[0].grad is None
    for i in range(1, 5):
        hook_results[0] = None
        x_list[i].backward()
        assert hook_results[0] is None
        expected[i] = 1.0
        assert x.grad.tolist() == expected
        assert x_list[i].grad is None


# --- detach, detach_, .data and set_data -----------------------------------------------------


def test_detach():  # test_detach
    x = fw.randn(10, 10, requires_grad=True)
    y = (x + 2).detach()
    z = y * 4 + 2
    assert not y.requires_grad and not z.requires_grad

    x = fw.randn(10, 10, requires_grad=True)
    y = (x * 2).detach()
    assert not y.requires_grad and y.grad_fn is None
    z = x + y
    z.sum().backward()
    assert x.grad.tolist() == np.ones((10, 10)).tolist()  # not the true gradient: what detach asks for

    x = fw.randn(10, 10, requires_grad=True)  # in-place detach
    y = fw.randn(10, 10, requires_grad=True)
    a = x * 2
    (y + a).sum().backward(retain_graph=True)
    a.detach_()
    assert not a.requires_grad
    (y + a).sum().backward()  # does not reach x
    assert_close(x.grad, np.full((10, 10), 2.0))
    assert_close(y.grad, np.full((10, 10), 2.0))

    view = x.narrow(0, 1, 4)  # in-place detach of a view raises
    with pytest.raises(RuntimeError, match="view"):
        view.detach_()


def test_detach_base():  # test_detach_base: detaching the base does not detach the view
    x = fw.randn(10, 10, requires_grad=True)
    view = x.narrow(0, 1, 4)
    x.detach_()
    assert not x.requires_grad
    assert view.requires_grad and view.grad_fn is not None
    assert view._base is x


def test_detach_then_inplace_raises_in_autograd():  # test_detach_then_inplace_raises_in_autograd
    x = fw.randn((), requires_grad=True)
    y = x**2  # saves x
    z = x.detach()
    z.zero_()
    with pytest.raises(RuntimeError, match="has been modified by an inplace"):
        y.backward()


def test_no_unnecessary_save():  # test_no_unnecessary_save
    # x * ft does not keep x for backward (only ft is needed for x's gradient... and x
    # needs none), so modifying x after each use does not break backward.
    mu = fw.ones(1, requires_grad=True)
    x = fw.empty(1)
    loss = 0
    for i in range(3):
        x.detach_()
        x.copy_(mu + i)
        ft = fw.tensor([float(i)])
        multiplied = x * ft
        loss = loss + multiplied.sum()
    loss.backward()
    assert mu.grad.tolist() == [3.0]  # 0 + 1 + 2


def test_saved_variable_saved_original_inplace_detach():  # test_saved_variable_saved_original_inplace_detach
    a = fw.tensor(1.0, requires_grad=True).clone()
    b = a.sin()
    a.detach_()  # a was saved as an input: backward can no longer use it
    with pytest.raises(RuntimeError, match="Trying to use a saved tensor that has been detached"):
        b.backward()

    a = fw.tensor(1.0, requires_grad=True).clone()
    b = a.exp()  # saves its output, not a
    a.detach_()
    b.backward()


def test_version_counter():  # test_version_counter
    x = fw.randn(1, 2)
    saved = x._version
    x.add_(1).add_(1)
    assert x._version > saved
    xz = x[:]  # a view shares the counter
    assert x._version == xz._version
    xz.add_(1)
    assert x._version == xz._version
    saved = x._version
    x.data = fw.randn(2, 3)  # .data = keeps the counter
    assert x._version == saved
    x.add_(1)
    assert x._version > saved
    assert x._version == xz._version  # still shared with the view
    xz.add_(1)
    assert x._version == xz._version


def test_set_data_preserve_pyobj():  # test_set_data_preserve_pyobj
    a = fw.randn(1, 2)
    b = fw.randn(1, 2)
    b_id = id(b)
    b.data = a
    assert id(b) == b_id


def test_set_data_self_requires_grad():  # test_set_data_self_requires_grad
    a = fw.tensor(1.0, requires_grad=True)
    b = fw.tensor(2.0)
    c = fw.tensor(3, dtype=fw.int64)
    a.data = b
    with pytest.raises(RuntimeError, match="must be floating point or complex dtype"):
        a.data = c
    assert a.dtype == fw.float32 and a.tolist() == 2.0


def test_numpy_requires_grad():  # test_numpy_requires_grad
    x = fw.randn(2, 2, requires_grad=True)
    with pytest.raises(
        RuntimeError,
        match=r"Can't call numpy\(\) on Tensor that requires grad. Use tensor.detach\(\).numpy\(\) instead.",
    ):
        x.numpy()
    with fw.no_grad():
        x.numpy()
    x = fw.randn(2, 2)
    x.numpy()
    with fw.no_grad():
        x.numpy()


def test_attribute_deletion():  # test_attribute_deletion (the .data = None part)
    x = fw.randn(5, 5, requires_grad=True)
    with pytest.raises(TypeError):
        x.data = None


# --- leaves and assignments ------------------------------------------------------------------


def test_leaf_assignment():  # test_leaf_assignment
    x = fw.randn(5, 5)
    y = fw.randn(5, requires_grad=True)
    z = fw.randn(5, requires_grad=True)
    x[0] = y
    x[1] = 2 * z
    assert x.requires_grad and x.grad_fn is not None
    x.sum().backward()
    assert y.grad.tolist() == [1.0] * 5
    assert z.grad.tolist() == [2.0] * 5


def test_no_grad_assignment():  # test_no_grad_assignment
    x = fw.randn(5, 5, requires_grad=True)
    y = fw.randn(5)
    with fw.no_grad():
        x[0] = y
    assert x.requires_grad and x.grad_fn is None


def test_no_grad_modifies_version():  # test_no_grad_modifies_version
    x = fw.randn(5, requires_grad=True)
    y = fw.randn(5, requires_grad=True)
    z = (x * y).sum()
    with fw.no_grad():
        x *= 2
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()


def test_increment_version():  # test_increment_version
    a = fw.rand(5, requires_grad=True)
    v = a._version
    fw.autograd.graph.increment_version(a)
    assert a._version == v + 1
    a = fw.zeros(5, dtype=fw.int32)
    v = a._version
    fw.autograd.graph.increment_version(a)
    assert a._version == v + 1
    with fw.inference_mode():
        a = fw.rand(5, requires_grad=True)
        fw.autograd.graph.increment_version(a)  # does not error
    fw.autograd.graph.increment_version(a)  # does not error


# --- inplace on views -------------------------------------------------------------------------


def test_inplace_on_view_saved_output():  # test_inplace_on_view_saved_output
    # An inplace op on a view, whose op saves its output, must not create a reference
    # cycle: the graph is freed by reference counting alone.
    def make():
        root = fw.randn(3, 3, requires_grad=True)
        copy = root.clone()
        ref = weakref.ref(copy.grad_fn)
        view = copy.view(9)
        view.relu_()
        return ref

    gc.disable()
    try:
        ref = make()
        assert ref() is None
    finally:
        gc.enable()


def test_inplace_on_view_leaf_errors():  # test_inplace_on_view_leaf_errors
    x = fw.zeros(1, requires_grad=True)
    y = x.view_as(x)
    with pytest.raises(RuntimeError, match=VIEW_OF_LEAF_MSG):
        y.add_(1)


def test_inplace_on_view_weak_grad_fn():  # test_inplace_on_view_weak_grad_fn
    a = fw.arange(10.0).requires_grad_()
    b = a.narrow(0, 0, 2).clone().view(-1)
    b.relu_()
    c = b.clone()
    del b
    gc.collect()
    s = c.sum()
    s.backward()
    assert s.tolist() == 1.0
    a = fw.rand(10, requires_grad=True).narrow(0, 0, 10)
    with pytest.raises(RuntimeError):
        a.relu_()


def test_autograd_views_codegen():  # test_autograd_views_codegen
    def run_test(grad_mode, requires_grad, should_raise):
        def check(fn, expected):
            if expected is None:
                fn()
            else:
                with pytest.raises(RuntimeError, match=expected):
                    fn()

        inp = fw.rand(2, requires_grad=requires_grad).clone()
        with fw.set_grad_enabled(grad_mode):
            out = inp.view_as(inp)
        assert out._base is inp
        check(lambda: out.add_(1), should_raise[0])

        inp = fw.rand(2, requires_grad=requires_grad).clone()
        with fw.set_grad_enabled(grad_mode):
            out = inp.unbind()
        assert out[0]._base is inp and out[1]._base is inp
        check(lambda: out[0].add_(1), should_raise[1])
        check(lambda: out[1].add_(1), should_raise[2])

    run_test(grad_mode=True, requires_grad=False, should_raise=(None, None, None))
    err = "Output {} of UnbindBackward0 is a view and is being modified inplace."
    run_test(grad_mode=True, requires_grad=True, should_raise=(None, err.format(0), err.format(1)))
    run_test(grad_mode=False, requires_grad=True, should_raise=(NO_GRAD_VIEW_MSG,) * 3)
    run_test(grad_mode=False, requires_grad=False, should_raise=(None, None, None))


def test_autograd_inplace_view_of_view():  # test_autograd_inplace_view_of_view (the no_grad half)
    for mode, block in ((fw.no_grad, "no_grad"), (fw.inference_mode, "inference_mode")):
        x = fw.zeros(2)
        with mode():
            y = x.view(2)
        y.requires_grad_(True)
        z = y.view(2)
        with pytest.raises(RuntimeError, match=f"a view of a view .* is being .* inside the {block} block"):
            z /= 2
        assert x.tolist() == [0.0, 0.0]


def test_autograd_print_tensor():  # test_autograd_print_tensor
    a = fw.ones(1, requires_grad=True)
    assert repr(a) == "tensor([1.], requires_grad=True)"
    assert repr(a.clone()) == "tensor([1.], grad_fn=<CloneBackward0>)"
    with fw.no_grad():
        b = a[:]
        b *= 2
    # a view made under no_grad and written since: its history is ambiguous
    assert repr(b) == "tensor([2.], grad_fn=<Invalid>)"


# PyTorch's version check on views made under no_grad (VariableHooks::grad_fn, then
# handle_view_on_rebase): once the view, its base or another view of it has been
# written, reading the view's grad_fn raises while the base requires grad, so no op can
# record history through it. Each case below was run on PyTorch 2.13 first.
@pytest.mark.parametrize("write_under_no_grad", [True, False], ids=["written_under_no_grad", "written_with_grad"])
@pytest.mark.parametrize("written", ["base", "view", "other_view"])
def test_no_grad_view_after_write_refuses_history(written, write_under_no_grad):
    a = fw.randn(3, requires_grad=True).clone()
    with fw.no_grad():
        v = a[:2]
    other = a[1:]  # a view with history
    targets = {"base": a, "view": v, "other_view": other}
    if written == "view" and not write_under_no_grad:
        with pytest.raises(RuntimeError, match="A view was created in no_grad mode and is being modified"):
            v.mul_(2)
        return
    with fw.no_grad() if write_under_no_grad else contextlib.nullcontext():
        targets[written].mul_(2)
    indirect = "A view was created in no_grad mode and its base or another view of its base has been modified"
    with pytest.raises(RuntimeError, match=indirect):
        v.grad_fn  # noqa: B018
    with pytest.raises(RuntimeError, match=indirect):
        v * 3  # records history: reads v's grad_fn
    with pytest.raises(RuntimeError, match=indirect):
        v.is_leaf  # noqa: B018
    assert v.requires_grad  # as in PyTorch: reading requires_grad does not check
    with fw.no_grad():
        assert (v + 1).grad_fn is None  # nothing recorded, nothing checked
    assert v.detach().tolist() == a.detach()[:2].tolist()


def test_no_grad_view_unwritten_or_without_grad_is_fine():
    a = fw.randn(3, requires_grad=True)
    with fw.no_grad():
        v = a[:2]
    assert v.grad_fn is None  # unwritten: no history, and nothing ambiguous
    (v * 3).sum().backward()
    assert a.grad is None  # as in PyTorch: a view made under no_grad carries no gradient
    b = fw.randn(3)  # a base that does not require grad
    with fw.no_grad():
        w = b[:2]
    b.mul_(2)
    assert w.grad_fn is None
    c = fw.ones(3, requires_grad=True).clone()
    with fw.no_grad():
        u = c.view(-1)
    t = u[:2]  # a view of it made with grad on: untracked too, as of now
    assert t.grad_fn is not None
    c.mul_(2)
    with pytest.raises(
        RuntimeError, match="Output 0 of SliceBackward0 is a view of a view which was created in no_grad"
    ):
        t.grad_fn  # noqa: B018


def test_inplace_on_view_backprop_base():  # TestAutogradDeviceType.test_inplace_on_view_backprop_base
    root = fw.randn(2, 2, requires_grad=True)
    x = root.clone()
    v1 = x.narrow(0, 0, 1)
    v1.mul_(2)
    x.sum().backward()
    assert root.grad.tolist() == [[2, 2], [1, 1]]


def test_inplace_on_view_backprop_view_of_view():  # TestAutogradDeviceType.test_inplace_on_view_backprop_view_of_view
    root = fw.randn(2, 2, requires_grad=True)
    x = root.clone()
    v1 = x.narrow(0, 0, 1)
    v2 = x.narrow(0, 0, 1)
    v1.mul_(2)
    v2.sum().backward()
    assert root.grad.tolist() == [[2, 2], [0, 0]]


def test_inplace_on_view_of_view():  # TestAutogradDeviceType.test_inplace_on_view_of_view
    root = fw.randn(2, 2, requires_grad=True)
    x = root.clone()
    v1 = x.narrow(0, 0, 1)
    v2 = v1.narrow(1, 1, 1)
    v2.mul_(2)
    x.sum().backward()
    assert root.grad.tolist() == [[1, 2], [1, 1]]


def test_inplace_on_view_then_no_grad():  # TestAutogradDeviceType.test_inplace_on_view_then_no_grad
    a = fw.ones(3, 1, dtype=fw.float64, requires_grad=True)
    b = a * 2
    c = b.view_as(b)
    c[0][0] = 3
    with fw.no_grad():
        c.grad_fn  # a graph update with grad disabled  # noqa: B018
    c.sum().backward()
    assert a.grad.tolist() == [[0.0], [2.0], [2.0]]


def test_inplace_on_view_gradcheck():  # TestAutogradDeviceType.test_inplace_on_view_gradcheck
    a = f64(4, 4, requires_grad=True)
    b = f64(2, 2, requires_grad=True)

    def func(root, b):
        x = root.clone()
        x.narrow(1, 2, 2).narrow(0, 1, 2).mul_(b)
        x.narrow(1, 0, 2).narrow(0, 1, 2).mul_(b)
        return x

    gradcheck(func, [a, b])


def test_inplace_on_view_multiple_outputs():  # TestAutogradDeviceType.test_inplace_on_view_multiple_outputs
    root = fw.arange(9.0, dtype=fw.float64).reshape(3, 3).requires_grad_()
    x = root.clone()
    v1 = x.unbind()
    with pytest.raises(RuntimeError, match=MULTI_VIEW_MSG):
        v1[0].mul_(2)


# PyTorch: TestAutogradDeviceType.test_inplace_on_view_of_multiple_output_view
def test_inplace_on_view_of_multiple_output_view():
    a = fw.rand(10, dtype=fw.float64, requires_grad=True).clone()
    b = a.unbind(0)
    c = b[0].view_as(b[0])
    with pytest.raises(RuntimeError, match=MULTI_VIEW_MSG):
        c.mul_(2)


def test_inplace_multiple_output_view_of_view():  # TestAutogradDeviceType.test_inplace_multiple_output_view_of_view
    a = fw.rand(10, dtype=fw.float64, requires_grad=True).clone()
    b = a.view_as(a)
    c = b.unbind(0)
    with pytest.raises(RuntimeError, match=MULTI_VIEW_MSG):
        c[0].mul_(2)


# PyTorch: TestAutogradDeviceType.test_inplace_on_view_makes_base_require_grad
def test_inplace_on_view_makes_base_require_grad():
    a = f64(4, 4)
    b = f64(4, 2, requires_grad=True)

    def func(root, b, check=False):
        x = root.clone()
        assert not check or not x.requires_grad
        x.narrow(1, 2, 2).mul_(b)
        assert not check or x.requires_grad
        return x

    func(a, b, check=True)  # (framework.testing.gradcheck differentiates under no_grad)
    gradcheck(func, [a, b])


def test_inplace_on_view_backprop_view():  # TestAutogradDeviceType.test_inplace_on_view_backprop_view
    a = fw.tensor([2.0, 5.0])
    b = fw.tensor([3.0], requires_grad=True)
    res = a.narrow(0, 1, 1).mul_(b)
    res.sum().backward()
    assert b.grad.tolist() == [5]
    assert a.grad is None


def test_inplace_on_view_modify_base():  # TestAutogradDeviceType.test_inplace_on_view_modify_base
    # An inplace op on a base that made it require grad also makes its earlier views
    # require grad, and backprop correctly.
    r = fw.ones(1, dtype=fw.float64, requires_grad=True)

    def fn(r, check=False):
        x = fw.ones(5, dtype=fw.float64)
        v = x.select(0, 1)
        assert not check or (not v.requires_grad and v.grad_fn is None)
        x.add_(r)  # v now depends on r
        assert not check or v.requires_grad
        return v

    fn(r, check=True)
    gradcheck(fn, [r])


def test_inplace_on_view_non_contig():  # TestAutogradDeviceType.test_inplace_on_view_non_contig
    root = fw.ones(2, 3, 2).select(2, 1).t().requires_grad_(True)
    x = root.clone()
    v1 = x.narrow(0, 0, 1)
    v2 = v1.narrow(1, 1, 1)
    v2.mul_(2)
    x.sum().backward()
    assert root.grad.tolist() == [[1, 2], [1, 1], [1, 1]]


@pytest.mark.parametrize(
    "split",
    [lambda t: t.split(1), lambda t: t.split_with_sizes((1, 1, 1)), lambda t: t.chunk(3)],
    ids=["split", "split_with_sizes", "chunk"],
)
def test_inplace_on_view_multi_output_safe(split):  # TestAutogradDeviceType.test_inplace_on_view_multi_output_safe
    a = fw.randn(3, 3, requires_grad=True)
    b = a + a
    s1, s2, s3 = split(b)
    with pytest.raises(RuntimeError, match=MULTI_VIEW_MSG):
        s1.mul_(s2)


def test_expand_view_written_through():
    # TestViewOps.test_expand_view on a tensor with history: the single element written
    # through the expanded view gets no gradient from its old value.
    leaf = fw.ones(5, 1, requires_grad=True)
    t = leaf.clone()
    v = t.expand(5, 5)
    v[2, 2] = 0
    assert t[2, 0].tolist() == v[2, 2].tolist() == 0.0
    t.sum().backward()
    assert leaf.grad.tolist() == [[1.0], [1.0], [0.0], [1.0], [1.0]]
