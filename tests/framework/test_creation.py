"""Creation functions: PyTorch names, argument order, dtype inference, seeding, devices."""

import numpy as np
import pytest

import framework as fw
from framework import random as fw_random
from framework.testing import to_numpy

# --- tensor(): copies, dtype inference ----------------------------------------------------


@pytest.mark.parametrize(
    "data, dtype",
    [
        (1.5, fw.float32),  # Python float -> float32 (PyTorch's default dtype)
        ([1.0, 2.0], fw.float32),
        ([1, 2.5], fw.float32),  # mixed: float wins
        (3, fw.int64),  # Python int -> int64
        ([[1, 2], [3, 4]], fw.int64),
        ([True, False], fw.bool),
        (np.array([1.0, 2.0]), fw.float64),  # NumPy arrays keep their dtype
        (np.array([1, 2], dtype=np.int32), fw.int32),
        (np.float64(2.0), fw.float64),  # and so do NumPy scalars
        (np.int32(2), fw.int32),
    ],
)
def test_tensor_dtype_inference(data, dtype):
    assert fw.tensor(data).dtype == dtype


def test_tensor_copies_its_data():
    src = np.array([1.0, 2.0])
    t = fw.tensor(src)
    src[0] = 99.0
    assert t.tolist() == [1.0, 2.0]
    u = fw.tensor(t)  # from a tensor: a copy too
    u.add_(1.0)
    assert t.tolist() == [1.0, 2.0]


def test_tensor_dtype_and_requires_grad_arguments():
    t = fw.tensor([1, 2], dtype=fw.float64, requires_grad=True)
    assert t.dtype == fw.float64 and t.requires_grad and t.is_leaf
    assert fw.tensor([[1.0, 2.0]]).shape == (1, 2)


def test_from_numpy_allocates_nothing_and_counts_nothing():
    big = np.zeros((500, 1000), np.float32)
    base = fw.memory.allocated_bytes()
    t = fw.from_numpy(big[:10])  # a view of the caller's 2 MB array
    assert fw.memory.allocated_bytes() == base
    y = t + 1.0  # what the framework allocates is counted
    assert fw.memory.allocated_bytes() == base + y.nbytes


def test_from_numpy_shares_memory_both_ways():
    a = np.array([1.0, 2.0, 3.0])
    t = fw.from_numpy(a)
    assert t.dtype == fw.float64 and not t.requires_grad
    a[0] = 10.0
    assert t[0].item() == 10.0
    t[1] = 20.0
    assert a[1] == 20.0
    assert np.shares_memory(t.numpy(), a)
    with pytest.raises(TypeError, match="np.ndarray"):
        fw.from_numpy([1.0, 2.0])


# --- filled tensors -------------------------------------------------------------------------


@pytest.mark.parametrize("fn, value", [(fw.zeros, 0.0), (fw.ones, 1.0)])
def test_zeros_ones(fn, value):
    for t in (fn(2, 3), fn((2, 3)), fn([2, 3])):  # varargs or one sequence, as in PyTorch
        assert t.shape == (2, 3) and t.dtype == fw.float32
        assert (t.numpy() == value).all()
    assert fn(3, dtype=fw.int64).dtype == fw.int64
    assert fn(2, requires_grad=True).requires_grad
    assert fn(()).shape == ()


def test_empty():
    t = fw.empty(4, 2)
    assert t.shape == (4, 2) and t.dtype == fw.float32
    assert fw.empty(3, dtype=fw.float64).dtype == fw.float64


def test_full_infers_dtype_from_the_fill_value():
    t = fw.full((2, 2), 1.5)
    assert t.dtype == fw.float32 and (t.numpy() == 1.5).all()
    assert fw.full((2,), 7).dtype == fw.int64
    assert fw.full((2,), True).dtype == fw.bool
    assert fw.full((2,), 7, dtype=fw.float64).dtype == fw.float64


def test_arange():
    a = fw.arange(5)
    assert a.dtype == fw.int64 and a.tolist() == [0, 1, 2, 3, 4]
    assert fw.arange(2, 5).tolist() == [2, 3, 4]
    b = fw.arange(1, 2, 0.25)
    assert b.dtype == fw.float32 and b.tolist() == [1.0, 1.25, 1.5, 1.75]
    assert fw.arange(3, dtype=fw.float64).dtype == fw.float64


def test_eye():
    np.testing.assert_array_equal(fw.eye(3).numpy(), np.eye(3))
    e = fw.eye(2, 3)
    assert e.shape == (2, 3) and e.dtype == fw.float32
    np.testing.assert_array_equal(e.numpy(), np.eye(2, 3))


def test_like_functions_follow_the_source():
    src = fw.tensor([[1, 2, 3]], dtype=fw.float64)
    z, o = fw.zeros_like(src), fw.ones_like(src)
    assert z.shape == o.shape == (1, 3) and z.dtype == o.dtype == fw.float64
    assert (z.numpy() == 0).all() and (o.numpy() == 1).all()
    assert fw.zeros_like(src, dtype=fw.float32).dtype == fw.float32
    assert fw.ones_like(src, requires_grad=True).requires_grad
    assert fw.empty_like(src).shape == (1, 3)
    assert fw.randn_like(src).dtype == fw.float64


# --- random ---------------------------------------------------------------------------------------


def test_randn_and_rand_shapes_dtypes_and_ranges():
    fw.manual_seed(0)
    r = fw.randn(1000)
    assert r.dtype == fw.float32 and r.shape == (1000,)
    assert abs(float(r.numpy().mean())) < 0.2 and 0.8 < float(r.numpy().std()) < 1.2
    u = fw.rand(2, 500)
    assert u.shape == (2, 500) and u.dtype == fw.float32
    assert (u.numpy() >= 0).all() and (u.numpy() < 1).all()
    assert fw.randn(2, 3, dtype=fw.float64).dtype == fw.float64
    assert fw.randn((2, 3)).shape == (2, 3)
    assert fw.randn(2, requires_grad=True).requires_grad


def test_manual_seed_reproduces_sequences():
    fw.manual_seed(1234)
    first = [fw.randn(4).numpy().copy(), fw.rand(3).numpy().copy()]
    fw.manual_seed(1234)
    again = [fw.randn(4).numpy().copy(), fw.rand(3).numpy().copy()]
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first[0][:3], first[1])  # successive draws differ
    fw.manual_seed(4321)
    assert not np.array_equal(fw.randn(4).numpy(), first[0])


def test_random_state_round_trips():
    fw.manual_seed(7)
    fw.randn(5)
    state = fw_random.get_state()
    expected = fw.randn(5).numpy().copy()
    fw.manual_seed(99)
    fw_random.set_state(state)
    np.testing.assert_array_equal(fw.randn(5).numpy(), expected)


# --- devices -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda d: fw.tensor([1.0], device=d),
        lambda d: fw.zeros(2, device=d),
        lambda d: fw.arange(3, device=d),
        lambda d: fw.eye(2, device=d),
    ],
)
def test_bad_device_string_is_a_clear_error(make):
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        make("gpu0")


def test_cuda_without_gpu_is_a_clear_error(without_cupy):
    with pytest.raises(RuntimeError, match="CuPy is not installed or sees no GPU"):
        fw.zeros(2, device="cuda")


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda d: fw.tensor([1.0, 2.0], device=d), [1.0, 2.0]),
        (lambda d: fw.zeros(2, device=d), [0.0, 0.0]),
        (lambda d: fw.ones(2, device=d), [1.0, 1.0]),
        (lambda d: fw.full((2,), 3.0, device=d), [3.0, 3.0]),
        (lambda d: fw.arange(2, device=d), [0, 1]),
        (lambda d: fw.eye(2, device=d)[0], [1.0, 0.0]),
        (lambda d: fw.zeros_like(fw.ones(2, device=d)), [0.0, 0.0]),
    ],
)
def test_creation_on_backend(backend, make, expected):
    t = make(backend)
    assert t.device == fw.device(backend)
    np.testing.assert_array_equal(to_numpy(t), expected)


def test_seeded_random_on_backend(backend):
    fw.manual_seed(3)
    a = fw.randn(4, device=backend)
    b = fw.rand(4, device=backend)
    fw.manual_seed(3)
    assert a.device == fw.device(backend) and b.dtype == fw.float32
    np.testing.assert_array_equal(to_numpy(fw.randn(4, device=backend)), to_numpy(a))
    np.testing.assert_array_equal(to_numpy(fw.rand(4, device=backend)), to_numpy(b))
