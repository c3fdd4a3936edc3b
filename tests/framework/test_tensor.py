"""Tensor attributes and methods (PyTorch names and behaviour), on the CPU and, where one
exists, on a GPU (tests taking the ``backend`` fixture run on both)."""

import inspect

import numpy as np
import pytest

import framework as fw
from framework.testing import assert_close, to_numpy
from tests.conftest import requires_gpu

NON_LEAF_MSG = "you can only change requires_grad flags of leaf variables"


@pytest.fixture
def t():
    return fw.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])


# --- metadata ---------------------------------------------------------------------------


def test_metadata(t):
    assert t.shape == (2, 3) and t.ndim == 2 and t.dim() == 2
    assert t.dtype == fw.float32
    assert t.device == fw.device("cpu") and str(t.device) == "cpu"
    assert t.numel() == 6 and len(t) == 2
    assert t.size() == (2, 3) and t.size(1) == 3 and t.size(-1) == 3
    assert t.stride() == (3, 1) and t.T.stride() == (1, 3)
    assert t.element_size() == 4 and t.nbytes == 24


def test_zero_dim_tensor():
    s = fw.tensor(2.5)
    assert s.shape == () and s.ndim == 0 and s.numel() == 1
    assert s.item() == 2.5 and s.tolist() == 2.5
    with pytest.raises(TypeError):
        len(s)


# --- conversion --------------------------------------------------------------------------


def test_numpy_shares_memory_on_cpu(t):
    n = t.numpy()
    assert isinstance(n, np.ndarray)
    n[0, 0] = 100.0
    assert t[0, 0].item() == 100.0


def test_numpy_on_tensor_requiring_grad_raises():
    a = fw.tensor([1.0], requires_grad=True)
    with pytest.raises(RuntimeError, match=r"detach\(\).numpy\(\)"):
        a.numpy()
    np.testing.assert_array_equal(a.detach().numpy(), [1.0])


def test_item_and_tolist(t):
    assert fw.tensor([3.0]).item() == 3.0
    assert isinstance(fw.tensor(3).item(), int)
    with pytest.raises(RuntimeError, match="6 elements"):
        t.item()
    assert t.tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    assert fw.tensor([1, 2]).tolist() == [1, 2]


def test_to_cpu_and_dtype():
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    assert a.to("cpu") is a and a.cpu() is a  # nothing to change: the same tensor
    d = a.to(fw.float64)
    assert d.dtype == fw.float64 and d.grad_fn is not None  # the copy is recorded
    d.sum().backward()
    assert a.grad.dtype == fw.float32  # the gradient is cast back
    assert_close(a.grad, [1.0, 1.0])
    assert a.to("cpu", fw.float64).dtype == fw.float64
    with pytest.raises(ValueError, match="unknown device"):
        a.to("tpu")


def test_to_cuda_without_gpu_raises_a_clear_error(without_cupy):
    with pytest.raises(RuntimeError, match="CuPy is not installed or sees no GPU"):
        fw.tensor([1.0]).to("cuda")


# --- copies and layout -------------------------------------------------------------------


def test_clone_copies_memory_and_records_history():
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    c = a.clone()
    assert not np.shares_memory(c._data, a._data)
    assert not c.is_leaf and c.grad_fn.name() == "CloneBackward0"
    (c * fw.tensor([3.0, 4.0])).sum().backward()
    assert_close(a.grad, [3.0, 4.0])
    with fw.no_grad():
        c.add_(10.0)
    np.testing.assert_array_equal(a.detach().numpy(), [1.0, 2.0])


def test_contiguous_and_is_contiguous(t):
    assert t.is_contiguous() and t.contiguous() is t
    tt = t.T
    assert not tt.is_contiguous() and tt._base is t
    c = tt.contiguous()
    assert c.is_contiguous() and c is not tt
    np.testing.assert_array_equal(c.numpy(), t.numpy().T)
    assert not np.shares_memory(c._data, t._data)


# --- detach, detach_, data ----------------------------------------------------------------


def test_detach_shares_memory_and_version_but_has_no_history():
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    d = a.detach()
    assert d.is_leaf and not d.requires_grad and d.grad_fn is None
    assert np.shares_memory(d._data, a._data)
    d.mul_(2.0)
    assert a._version == 1  # one counter for the storage
    np.testing.assert_array_equal(a.detach().numpy(), [2.0, 4.0])


def test_detach_in_place():
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    b = a * 2.0
    assert b.detach_() is b
    assert b.is_leaf and not b.requires_grad and b.grad_fn is None
    with pytest.raises(RuntimeError, match="Can't detach views in-place"):
        (a * 2.0)[0:1].detach_()


def test_data_has_its_own_version_counter():
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    d = a.data
    assert not d.requires_grad and np.shares_memory(d._data, a._data)
    d.add_(1.0)
    assert a._version == 0 and d._version == 1
    a.data = fw.tensor([7.0, 8.0])
    np.testing.assert_array_equal(a.detach().numpy(), [7.0, 8.0])
    assert a.requires_grad and a.is_leaf
    with pytest.raises(TypeError):
        a.data = np.zeros(2)


# --- requires_grad, grad, grad_fn, is_leaf, _version, _base --------------------------------


def test_requires_grad_settable_on_leaves():
    a = fw.tensor([1.0, 2.0])
    assert not a.requires_grad and a.is_leaf
    a.requires_grad = True
    assert a.requires_grad and a.is_leaf and a.grad_fn is None
    assert a.requires_grad_(False) is a and not a.requires_grad
    assert a.requires_grad_() is a and a.requires_grad


def test_requires_grad_on_non_leaf():
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    b = a * 2.0
    for value in (False, True):  # the setter refuses both, as in PyTorch
        with pytest.raises(RuntimeError, match=NON_LEAF_MSG):
            b.requires_grad = value
    with pytest.raises(RuntimeError, match=NON_LEAF_MSG):
        b.requires_grad_(False)
    assert b.requires_grad_() is b  # requires_grad_(True) on a non-leaf is a no-op in PyTorch
    assert b.requires_grad and not b.is_leaf


@pytest.mark.parametrize("make", [lambda: fw.tensor([1, 2]), lambda: fw.arange(3), lambda: fw.tensor([True])])
def test_non_float_dtypes_cannot_require_grad(make):
    x = make()
    with pytest.raises(RuntimeError, match="only Tensors of floating point dtype can require gradients"):
        x.requires_grad_()
    with pytest.raises(RuntimeError, match="floating point"):
        x.requires_grad = True
    assert not x.requires_grad


def test_int_tensor_with_requires_grad_at_creation_raises():
    with pytest.raises(RuntimeError, match="floating point"):
        fw.tensor([1, 2], requires_grad=True)
    with pytest.raises(RuntimeError, match="floating point"):
        fw.zeros(2, dtype=fw.int64, requires_grad=True)


def test_grad_fn_is_leaf_and_grad():
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    b = a * 3.0
    assert a.grad_fn is None and a.is_leaf and a.grad is None
    assert b.grad_fn.name() == "MulBackward0" and not b.is_leaf
    assert fw.tensor([1.0]).is_leaf  # no grad required: a leaf too
    b.sum().backward()
    assert_close(a.grad, [3.0, 3.0])
    assert b.grad is None  # non-leaves keep no .grad unless retain_grad()


def test_grad_setter_checks():
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    a.grad = fw.tensor([5.0, 6.0])
    assert_close(a.grad, [5.0, 6.0])
    a.grad = None
    assert a.grad is None
    with pytest.raises(RuntimeError, match="shape"):
        a.grad = fw.zeros(3)
    with pytest.raises(RuntimeError, match="dtype"):
        a.grad = fw.zeros(2, dtype=fw.float64)
    with pytest.raises(TypeError):
        a.grad = np.zeros(2)


def test_version_counts_inplace_ops_and_views_share_it():
    x = fw.zeros(4)
    assert x._version == 0
    x.add_(1.0)
    assert x._version == 1
    v = x[1:3]
    v.mul_(2.0)
    assert x._version == v._version == 2
    x[0] = 5.0
    assert v._version == 3
    y = x + 1.0  # out of place: a new storage
    assert y._version == 0 and x._version == 3


def test_base_of_views_is_the_root():
    t = fw.zeros(2, 3)
    assert t._base is None
    row = t[1]
    assert row._base is t and row[0:2]._base is t  # a view of a view points at the root
    assert t.view(3, 2)._base is t and t.T._base is t
    assert t.clone()._base is None and (t + 1)._base is None


# --- repr -----------------------------------------------------------------------------------------


def test_repr_is_readable():
    assert repr(fw.tensor([1.0, 2.0])) == "tensor([1., 2.])"
    assert repr(fw.tensor([1, 2])) == "tensor([1, 2])"
    assert repr(fw.tensor(2.5)) == "tensor(2.5)"
    assert repr(fw.tensor([1.0], dtype=fw.float64)) == "tensor([1.], dtype=float64)"
    assert repr(fw.tensor([1.0, 2.0], requires_grad=True)) == "tensor([1., 2.], requires_grad=True)"
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    assert repr(a * 2.0) == "tensor([2., 4.], grad_fn=<MulBackward0>)"
    assert repr(fw.tensor([[1.0, 2.0], [3.0, 4.0]])) == "tensor([[1., 2.],\n        [3., 4.]])"


# --- the same behaviour on every backend -------------------------------------------------------


def test_tensor_on_backend(backend):
    x = fw.tensor([[1.0, -2.0], [3.0, 4.0]], device=backend)
    assert x.device == fw.device(backend)
    assert x.device.type == backend
    assert x.tolist() == [[1.0, -2.0], [3.0, 4.0]]
    assert x[1, 1].item() == 4.0
    assert isinstance(x.detach().numpy(), np.ndarray)
    back = x.to("cpu")
    assert back.device == fw.device("cpu")
    np.testing.assert_array_equal(back.numpy(), [[1.0, -2.0], [3.0, 4.0]])
    assert x.to(backend) is x
    if backend != "cpu":
        assert "device='cuda:0'" in repr(x)


def test_backward_on_backend_matches_hand_gradient(backend):
    a = fw.tensor([0.5, -1.0, 2.0], device=backend, requires_grad=True)
    b = a * 2.0
    b.relu_()  # [1, 0, 4]
    (b * b).sum().backward()
    # d/da (relu(2a))^2 = 2 relu(2a) * 2 * [a > 0] = [4, 0, 16]
    assert a.grad.device == a.device
    assert_close(to_numpy(a.grad), [4.0, 0.0, 16.0])


def test_inplace_rules_on_backend(backend):
    w = fw.tensor([1.0, 2.0], device=backend, requires_grad=True)
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        w.add_(1.0)
    assert to_numpy(w.detach()).tolist() == [1.0, 2.0]
    b = w * 1.0
    c = b.sin()
    line = inspect.currentframe().f_lineno + 1
    b.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as err:
        c.sum().backward()
    assert f"mul_ at {__file__}:{line}" in str(err.value)


def test_to_and_from_gpu_records_history_on_backend(backend):
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    moved = a.to(backend)
    assert moved.device == fw.device(backend)
    (moved * fw.tensor([3.0, 4.0], device=backend)).sum().backward()
    assert a.grad.device == fw.device("cpu")  # the gradient came back to the CPU leaf
    assert_close(a.grad, [3.0, 4.0])


@pytest.mark.gpu
@requires_gpu
def test_cuda_tensor_numpy_is_a_host_copy():
    x = fw.tensor([1.0, 2.0], device="cuda")
    n = x.numpy()
    n[0] = 50.0
    assert x[0].item() == 1.0  # GPU memory cannot be shared with a NumPy array
    assert fw.tensor([1.0], device="cuda:0").device == fw.device("cuda")


# --- NumPy 2's __array__(dtype, copy) protocol ------------------------------------------------


def test_np_array_is_a_snapshot_that_later_updates_do_not_change():
    p = fw.tensor([1.0, 2.0], requires_grad=True)
    snap = np.array(p)  # copy=True
    assert not np.shares_memory(snap, p._data)
    with fw.no_grad():
        p.mul_(10.0)  # an optimizer-style update
    np.testing.assert_array_equal(snap, [1.0, 2.0])
    snap[0] = -1.0  # writing into the snapshot does not reach p
    assert p.tolist() == [10.0, 20.0] and p._version == 1


def test_np_asarray_shares_memory_like_numpy_and_read_only_where_grad_is_required():
    t = fw.tensor([1.0, 2.0])
    a = np.asarray(t)  # copy=None: shares when it can, as t.numpy() does
    assert np.shares_memory(a, t._data)
    a[0] = 9.0
    assert t.tolist() == [9.0, 2.0]
    p = fw.tensor([1.0, 2.0], requires_grad=True)
    b = np.asarray(p)
    assert np.shares_memory(b, p._data) and not b.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        b[0] = 5.0  # a silent write into a leaf that requires grad, with no version bump
    assert p.tolist() == [1.0, 2.0] and p._version == 0


def test_np_array_copy_false_and_dtype():
    t = fw.tensor([1.0, 2.0])
    assert np.shares_memory(np.array(t, copy=False), t._data)
    with pytest.raises(ValueError, match="Unable to avoid a copy"):
        np.array(t, dtype=np.float64, copy=False)
    d = np.asarray(t, dtype=np.float64)
    assert d.dtype == np.float64 and not np.shares_memory(d, t._data)
    np.testing.assert_array_equal(d, [1.0, 2.0])
    assert np.array(t, dtype=np.int64).tolist() == [1, 2]
