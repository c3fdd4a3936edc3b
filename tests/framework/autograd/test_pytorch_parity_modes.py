"""PyTorch's tests of inference mode and allow_mutation_on_saved_tensors, ported.

From ``test/test_autograd.py``: ``TestAutogradInferenceMode`` and
``TestAllowMutationOnSaved``. Left out: see ``test_pytorch_parity.py`` (double
backward, complex math views, out= variants, foreach ops, inplace view ops such as
``transpose_``, which is why the ``transpose_`` halves of the view-on-rebase tests are
not here).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import framework as fw
from framework.autograd.graph import allow_mutation_on_saved_tensors

VERSION_MSG = "one of the variables needed for gradient computation has been modified by an inplace operation"
DIRECT_MSG = "A view was created in inference mode and is being modified inplace"
INDIRECT_MSG = "A view was created in inference mode and its base or another view "


# --- TestAutogradInferenceMode -----------------------------------------------------------------


def test_inference_mode_context_manager():  # test_inference_mode_context_manager
    assert not fw.is_inference_mode_enabled()
    with fw.inference_mode():
        assert fw.is_inference_mode_enabled() and not fw.is_grad_enabled()
        with fw.inference_mode(False):
            assert not fw.is_inference_mode_enabled() and fw.is_grad_enabled()
        assert fw.is_inference_mode_enabled()
    assert not fw.is_inference_mode_enabled() and fw.is_grad_enabled()


def test_inference_mode_decorator():  # test_inference_mode_decorator
    for mode, use_kwarg in itertools.product((True, False, None), (True, False)):

        def func(x):  # called in the iteration that sets `expected`
            assert fw.is_inference_mode_enabled() == expected  # noqa: B023
            return x * x

        if mode is None:
            decorated = fw.inference_mode(mode=func) if use_kwarg else fw.inference_mode(func)
            expected = True
        else:
            decorated = fw.inference_mode(mode=mode)(func) if use_kwarg else fw.inference_mode(mode)(func)
            expected = mode
        for requires_grad in (True, False):
            c = fw.ones(1, 2, 3, requires_grad=requires_grad)
            d = decorated(c)
            assert not expected or fw.is_inference(d)
            assert d.requires_grad == (requires_grad and not expected)


def test_inference_mode_tensor_creation():  # test_inference_mode_tensor_creation
    with fw.inference_mode():
        c = fw.ones(1, 2, 3)  # constructors make inference tensors
        assert not c.requires_grad and fw.is_inference(c)
        tmp = fw.ones(1, 2, 3, requires_grad=True)
        assert tmp.requires_grad and fw.is_inference(tmp)
        tmp = fw.ones(1, 2, 3).requires_grad_(False)
        assert not tmp.requires_grad and fw.is_inference(tmp)


def test_inference_mode_existing_autograd_session():  # test_inference_mode_existing_autograd_session
    s = fw.ones(1, 2, 3, requires_grad=True)
    a = s.clone()
    out = a * a  # a is saved outside inference mode
    with fw.inference_mode():
        a.add_(2)
    assert not fw.is_inference(a)  # made before: still a normal tensor, its version counts
    with pytest.raises(RuntimeError, match=VERSION_MSG):
        out.backward(fw.ones_like(out))


# PyTorch: test_inference_mode_inf_tensor_in_inf_mode_functional_op
def test_inference_mode_inf_tensor_in_inf_mode_functional_op():
    with fw.inference_mode():
        for requires_grad in (True, False):
            c = fw.ones(1, 2, 3, requires_grad=requires_grad)
            out = c * c
            assert fw.is_inference(out) and not out.requires_grad


# PyTorch: test_inference_mode_inf_tensor_in_inf_mode_inplace_op (add_, copy_)
def test_inference_mode_inf_tensor_in_inf_mode_inplace_op():
    @fw.inference_mode()
    def run_test(fn):
        for requires_grad in (True, False):
            c = fw.ones(1, 2, 3, requires_grad=requires_grad)
            fn(c)  # still an inference tensor afterwards
            assert fw.is_inference(c)
            assert c.requires_grad == requires_grad

    run_test(lambda x: x.add_(2))
    run_test(lambda x: x.copy_(fw.ones(1, 2, 3)))


def test_inference_mode_inf_tensor_in_inf_mode_view_op():  # test_inference_mode_inf_tensor_in_inf_mode_view_op
    with fw.inference_mode():
        for requires_grad in (True, False):
            c = fw.ones(1, 2, 3, requires_grad=requires_grad)
            view_out = c.view(-1)
            assert fw.is_inference(view_out) and not view_out.requires_grad


def test_inference_mode_inf_tensor_in_normal_mode_view_op():  # test_inference_mode_inf_tensor_in_normal_mode_view_op
    for requires_grad in (True, False):
        with fw.inference_mode():
            c = fw.ones(1, 2, 3, requires_grad=requires_grad)
        out = c.view(-1)
        assert fw.is_inference(out) and not out.requires_grad
        assert out._base is None and out.is_leaf  # not a view for autograd (PyTorch: not _is_view())
        assert out.grad_fn is None
        for other in (c[0], c.transpose(0, 2), c.unsqueeze(0)):  # any view op, the same
            assert fw.is_inference(other) and not other.requires_grad and other._base is None


# PyTorch: test_inference_mode_inf_tensor_in_normal_mode_functional_op
def test_inference_mode_inf_tensor_in_normal_mode_functional_op():
    for requires_grad in (True, False):
        with fw.inference_mode():
            c = fw.ones(1, 2, 3, requires_grad=requires_grad)
    func_out = c * c
    assert not fw.is_inference(func_out)
    assert not func_out.requires_grad and func_out.is_leaf


# PyTorch: test_inference_mode_inf_tensor_in_normal_mode_inplace_op (add_)
def test_inference_mode_inf_tensor_in_normal_mode_inplace_op():
    with fw.inference_mode():
        c = fw.ones(1, 2, 3)
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        c.add_(2)
    assert c.tolist() == np.ones((1, 2, 3)).tolist()  # refused before writing


def test_normal_tensor_inplace_output_in_inference_mode():  # test_normal_tensor_inplace_output_in_inference_mode (add_)
    for requires_grad in (True, False):
        s = fw.ones(1, 2, 3, requires_grad=requires_grad)
        a = s.clone()
        with fw.inference_mode():
            a.add_(2)
            assert not fw.is_inference(a) and a.requires_grad == requires_grad
            a.add_(2)  # inplace -> inplace
            assert not fw.is_inference(a) and a.requires_grad == requires_grad
            view_out = a.view(-1)  # inplace -> inplace -> view
            assert not fw.is_inference(view_out) and view_out.requires_grad == requires_grad


def test_normal_tensor_view_output_in_inference_mode():  # test_normal_tensor_view_output_in_inference_mode
    for requires_grad in (True, False):
        s = fw.ones(1, 2, 3, requires_grad=requires_grad)
        a = s.clone()
        with fw.inference_mode():
            out = a.view(-1)
            assert not fw.is_inference(out) and out.requires_grad == requires_grad
            assert out._base is a
            tmp = out.view(-1)  # view -> view
            assert not fw.is_inference(tmp) and tmp.requires_grad == requires_grad
            assert tmp._base is a and tmp.is_leaf
            tmp.add_(2)  # view -> view -> inplace
            assert not fw.is_inference(tmp) and tmp.requires_grad == requires_grad
            assert a._version == tmp._version
            # PyTorch's comment: "Accessing is_leaf in python tries to update grad_fn and raises"
            if requires_grad:
                with pytest.raises(RuntimeError, match=INDIRECT_MSG):
                    tmp.is_leaf  # noqa: B018
            else:
                assert tmp.is_leaf


def test_normal_tensor_view_output_in_normal_mode():  # test_normal_tensor_view_output_in_normal_mode
    for requires_grad in (True, False):
        s = fw.ones(1, 2, 3, requires_grad=requires_grad)
        a = s.clone()
        with fw.inference_mode():
            out = a.view(-1)
            assert not fw.is_inference(out) and out.requires_grad == requires_grad
            assert out._base is a and out.is_leaf
        tmp = out * out
        assert not fw.is_inference(tmp) and tmp.requires_grad == requires_grad
        if requires_grad:
            with pytest.raises(RuntimeError, match=DIRECT_MSG):
                out.add_(2)
        else:
            out.add_(2)
        tmp = out.view(2, 3)
        assert not fw.is_inference(tmp) and tmp.requires_grad == requires_grad


def test_inference_mode_handle_direct_view_on_rebase():  # test_inference_mode_handle_direct_view_on_rebase (add_)
    for requires_grad in (True, False):
        s = fw.ones(1, 2, 3, requires_grad=requires_grad)
        a = s.clone()
        with fw.inference_mode():
            view_out = a.view_as(a)
        if requires_grad:
            with pytest.raises(RuntimeError, match=DIRECT_MSG):
                view_out.add_(2)
            assert a.tolist() == s.tolist()  # refused before anything was written
        else:
            view_out.add_(2)


def test_inference_mode_handle_indirect_view_on_rebase():  # test_inference_mode_handle_indirect_view_on_rebase (add_)
    for requires_grad in (True, False):
        s = fw.ones(1, 2, 3, requires_grad=requires_grad)
        a = s.clone()
        with fw.inference_mode():
            view_out = a.view(-1)
        a.add_(2)
        if requires_grad:
            with pytest.raises(RuntimeError, match=INDIRECT_MSG):
                view_out.grad_fn  # noqa: B018
        else:
            assert view_out.grad_fn is None


def test_mix_inference_and_normal_tensor_functional_op():  # test_mix_inference_and_normal_tensor_functional_op
    for requires_grad in (True, False):
        s = fw.ones(1, 2, 3, requires_grad=requires_grad)
        with fw.inference_mode():
            c = fw.ones(1, 2, 3, requires_grad=requires_grad)
        out = c.add(s)  # add saves nothing
        assert not fw.is_inference(out) and out.requires_grad == requires_grad
        if requires_grad:
            out.backward(fw.ones_like(out))  # an inference leaf that requires grad gets a gradient
            assert c.grad.tolist() == np.ones((1, 2, 3)).tolist()
            with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
                c * s


def test_mix_inference_and_normal_tensor_inplace_op():  # test_mix_inference_and_normal_tensor_inplace_op (mul_)
    for requires_grad in (True, False):
        s = fw.ones(1, 2, 3, requires_grad=requires_grad)
        a = s.clone()
        with fw.inference_mode():
            c = fw.ones(1, 2, 3)
        assert fw.is_inference(c)
        if requires_grad:
            with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
                a.mul_(c)
        else:
            a.mul_(c)


def test_mix_inference_and_normal_tensor_view_op():  # test_mix_inference_and_normal_tensor_view_op
    for requires_grad in (True, False):
        s = fw.ones(1, 2, 3, requires_grad=requires_grad)
        with fw.inference_mode():
            c = fw.ones(1, 2, 3)
        tmp1 = c.view_as(s)  # a view of an inference tensor is one
        assert fw.is_inference(tmp1) and not tmp1.requires_grad
        tmp2 = s.view_as(c)  # s.view(c.shape): a normal view
        assert not fw.is_inference(tmp2) and tmp2.requires_grad == requires_grad


def test_inference_tensor_has_no_version():  # TestAutogradInferenceMode._is_inference_tensor
    with fw.inference_mode():
        t = fw.ones(2)
    with pytest.raises(RuntimeError, match="Inference tensors do not track version counter"):
        t._version  # noqa: B018
    assert fw.ones(2)._version == 0


# --- TestAllowMutationOnSaved ---------------------------------------------------------------------


def _fn(a, view):
    b = a.clone()
    c = b.view_as(b) if view else b
    out = (b**2).sum()
    c.sin_()
    out.sum().backward()
    return a.grad


@pytest.mark.parametrize("view", [False, True], ids=["test_basic", "test_views"])
def test_basic_and_views(view):  # test_basic, test_views
    a = fw.rand(2, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="variables needed for gradient computation has been modified by an inplace"):
        _fn(a, view)
    a.grad = None
    with allow_mutation_on_saved_tensors() as ctx:
        da = _fn(a, view)
    assert fw.allclose(a * 2, da)
    assert len(ctx.cloned) == 0


def test_save_base_and_modify_view():  # test_save_base_and_modify_view
    with allow_mutation_on_saved_tensors() as ctx:
        a = fw.rand(2, 3, requires_grad=True)
        b = a.clone()
        c = b[:1]
        out = b**2
        c *= 10  # modify the view
        assert len(ctx.cloned) == 1
        out.sum().backward()
        assert len(ctx.cloned) == 0
    assert fw.allclose(a * 2, a.grad)


def test_save_view_modify_base():  # test_save_view_modify_base
    with allow_mutation_on_saved_tensors():
        a = fw.rand(2, 3, requires_grad=True)
        b = a.clone()
        c = b[:]
        out = (c**2).sum()
        b *= 2
        out.backward()
        assert fw.allclose(a * 2, a.grad)


def test_saved_but_not_anymore():  # test_saved_but_not_anymore
    with allow_mutation_on_saved_tensors() as ctx:
        a = fw.randn(2, 3, requires_grad=True).clone()
        out = (a**2).sum()
        assert len(ctx.cloned) == 0
        out.backward()
        a.sin_()  # saved once, but backward freed it: nothing to copy
        assert len(ctx.cloned) == 0
        out = (a**2).sum()
        a.sin_()
        assert len(ctx.cloned) == 1
        del out
        assert len(ctx.cloned) == 0


def test_saved_same_tensor_many_times():  # test_saved_same_tensor_many_times
    with allow_mutation_on_saved_tensors() as ctx:
        a = fw.randn(2, 3, requires_grad=True).clone()
        b = a**2
        c = a**2
        a.sin_()
        assert len(ctx.cloned) == 1  # copied once
        del b, c
        assert len(ctx.cloned) == 0


def test_saved_same_tensor_different_versions():  # test_saved_same_tensor_different_versions
    with allow_mutation_on_saved_tensors() as ctx:
        a = fw.randn(2, 3, requires_grad=True).clone()
        b = a**2
        a.sin_()
        c = a**2
        a.sin_()
        assert len(ctx.cloned) == 2
        del b
        assert len(ctx.cloned) == 1
        del c
        assert len(ctx.cloned) == 0


def test_backward_out_of_context():  # test_backward_out_of_context
    msg = "Trying to backward outside of the 'allow_mutation_on_saved_tensors' context"
    with allow_mutation_on_saved_tensors():
        a = fw.rand(2, 3, requires_grad=True)
        out = (a**2).sum()
    with pytest.raises(AssertionError, match=msg):
        out.backward()
    with allow_mutation_on_saved_tensors():  # a different context
        a = fw.rand(2, 3, requires_grad=True)
        out = (a**2).sum()
    with allow_mutation_on_saved_tensors():
        with pytest.raises(AssertionError, match=msg):
            out.backward()


def test_disallow_nesting():  # test_disallow_nesting
    with allow_mutation_on_saved_tensors():
        with pytest.raises(RuntimeError, match="allow_mutation_on_saved_tensors contexts cannot be nested"):
            with allow_mutation_on_saved_tensors():
                pass


def test_mutation_copy_is_counted_as_memory_inplace_did_not_save():
    from framework import memory

    with allow_mutation_on_saved_tensors():
        a = fw.randn(1000, requires_grad=True).clone()
        out = (a**2).sum()
        before = memory.breakdown().get("inplace_copies", 0)
        a.mul_(2.0)
        assert memory.breakdown().get("inplace_copies", 0) - before == a.nbytes
        out.backward()
