"""The CuPy stand-in itself: that it behaves like CuPy where this project depends on CuPy.

These tests use the stand-in directly (they run on every machine, whatever CuPy the gpu
leg runs on). Each checks a behaviour of real CuPy (cited from its source or reference)
that lets the gpu leg catch a mistake a NumPy-only run would not.
"""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import pickle
import re
import threading

import ml_dtypes
import numpy as np
import pytest

import framework as fw
import framework.testing.cupy_standin as cp
from framework import backend, memory
from framework.testing import cupyx_standin as cupyx
from framework.testing.cupy_standin.cuda import memory as cmem
from framework.testing.cupy_standin.cuda import memory_hook, nccl

# --- host transfers are explicit ---------------------------------------------------------------


def test_a_numpy_call_on_a_device_array_fails_as_on_cupy():
    """The hidden host transfer: NumPy cannot read device memory, so CuPy refuses it."""
    a = cp.arange(6, dtype=cp.float32).reshape(2, 3)
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(a)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.ascontiguousarray(a)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.array([a, a])
    with pytest.raises(TypeError, match="Unsupported type <class 'numpy.ndarray'>"):
        np.concatenate([a, np.ones((1, 3), np.float32)])  # dispatched to the device, host array refused
    with pytest.raises(TypeError, match="Unsupported type"):
        a + np.ones(3, np.float32)
    with pytest.raises(TypeError, match="Unsupported type"):
        np.ones(3, np.float32) * a
    with pytest.raises(TypeError):
        np.linalg.norm(a)  # a routine the stand-in lacks: never silently run on the host
    with pytest.raises(TypeError):
        float(a)  # more than one element
    # What CuPy itself runs on the device: NumPy's ufuncs and functions dispatch to it.
    out = np.exp(a)
    assert isinstance(out, cp.ndarray) and out.device.id == 0
    assert isinstance(np.sum(a), cp.ndarray) and float(np.sum(a)) == 15.0
    assert float(a[1, 2]) == 5.0 and int(a.sum()) == 15  # one element: copied, as CuPy does
    np.testing.assert_array_equal(a.get(), cp.asnumpy(a))  # the explicit transfers


def test_a_framework_op_hiding_a_host_transfer_fails_on_the_stand_in(monkeypatch):
    """A kernel that calls NumPy on its input passes on the CPU and fails on the stand-in."""
    from framework.ops import elementwise

    def exp_through_numpy(ctx, x):
        return np.exp(np.asarray(x), out=ctx.out)  # the bug: np.asarray of a device array

    monkeypatch.setattr(elementwise.Exp, "forward", exp_through_numpy)
    np.testing.assert_allclose(fw.exp(fw.zeros(3)).numpy(), np.ones(3))  # NumPy: fine
    x = fw.zeros(3, device=_device())
    with pytest.raises(TypeError, match="Implicit conversion"):
        fw.exp(x)


def _device():
    """A device for tensors: the gpu leg's CuPy when it is the stand-in, else skip."""
    if backend.cupy_choice() != "standin" or not backend.is_cuda_available():
        pytest.skip("the backend does not load the stand-in in this run")
    return "cuda"


# --- the array type -------------------------------------------------------------------------------


def test_arrays_are_their_own_type_with_cupys_attributes():
    a = cp.zeros((2, 3), cp.float64)
    assert not isinstance(a, np.ndarray) and type(a).__name__ == "ndarray"
    assert a.shape == (2, 3) and a.dtype == np.float64 and a.nbytes == 48 and a.size == 6
    assert a.device == cp.cuda.Device(0) and a.data.device_id == 0
    assert a.flags.c_contiguous and a.flags.owndata and a.base is None
    iface = a.__cuda_array_interface__
    assert iface["data"] == (a.data.ptr, False) and iface["shape"] == (2, 3)
    with pytest.raises(TypeError):
        hash(a)
    assert repr(a).startswith("array(") and pickle.loads(pickle.dumps(a)).get().tolist() == a.get().tolist()


def test_results_are_device_arrays_never_numpy_scalars():
    a = cp.arange(4.0)
    for value in (a.sum(), a.max(), a[1], a.mean(), cp.argmax(a), a[0] + 1):
        assert isinstance(value, cp.ndarray) and value.shape == ()
    assert a[1].base is a  # an integer index is a 0-d view, as in CuPy
    assert isinstance(a[1].item(), float) and a.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_views_share_memory_and_name_the_owning_array_as_base():
    a = cp.arange(12.0).reshape(3, 4)
    root = a.base
    assert root is not None and root.base is None  # reshape of arange: a view of it
    for v in (a.T, a[1:], a[:, ::2], a.reshape(12), a.swapaxes(0, 1), cp.expand_dims(a, 0), a.view()):
        assert v.base is root and cp.shares_memory(v, a)
    t = a.T.copy()
    assert t.base is None and not cp.shares_memory(t, a)
    a[0, 0] = 100.0
    assert float(root[0]) == 100.0


def test_the_shape_setter_reshapes_in_place_or_raises_as_cupy():
    a = cp.arange(6.0)
    v = a.view()
    v.shape = (2, 3)
    assert v.shape == (2, 3) and cp.shares_memory(v, a)
    t = v.T
    with pytest.raises(AttributeError):
        t.shape = (6,)  # would need a copy


def test_bfloat16_matmul_is_bfloat16_in_2d_and_refused_above_as_cupy_14_2():
    """CuPy 14.2 multiplies 2-d bfloat16 matrices with cuBLAS (float32 compute, a bfloat16
    result; NumPy returns float32) and sends batched ones to its integer GEMM kernel, which
    has no bfloat16 instance (``cupy/_core/_routines_linalg.pyx``: ``matmul``)."""
    bf16 = np.dtype(ml_dtypes.bfloat16)
    a = np.random.default_rng(0).standard_normal((3, 40)).astype(bf16)
    got = cp.matmul(cp.asarray(a), cp.asarray(a.T))
    assert got.dtype == bf16
    np.testing.assert_array_equal(cp.asnumpy(got), (a.astype(np.float32) @ a.T.astype(np.float32)).astype(bf16))
    assert (cp.asarray(a) @ cp.asarray(a.T)).dtype == bf16
    with pytest.raises(TypeError, match="no batched bfloat16 matmul"):
        cp.matmul(cp.asarray(a[None]), cp.asarray(a.T[None]))


def test_integer_index_arrays_wrap_around_instead_of_raising():
    """CuPy does not check index bounds: ``a[[1, 3]]`` of 3 elements is ``a[[1, 0]]``."""
    a = cp.arange(3.0) * 10
    assert a[[1, 3]].get().tolist() == [10.0, 0.0]
    assert a[cp.array([-1, 4])].get().tolist() == [20.0, 10.0]
    b = cp.zeros((2, 3))
    b[:, [3, -1]] = 5.0
    assert b.get().tolist() == [[5.0, 0.0, 5.0]] * 2
    assert a.take(cp.array([5])).get().tolist() == [20.0]
    with pytest.raises(IndexError):
        a[3]  # a plain integer is still checked


def test_host_values_cannot_be_assigned_but_scalars_can():
    a = cp.zeros(3)
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray cannot be used for fill"):
        a[...] = np.ones(3)
    with pytest.raises(ValueError, match="non-scalar"):
        a[:] = [1.0, 2.0, 3.0]
    a[1] = np.float32(2.5)
    a[2] = np.array(4.0)  # a 0-d host array is a number
    a.set(np.array([7.0, 8.0, 9.0]))
    assert a.get().tolist() == [7.0, 8.0, 9.0]
    with pytest.raises(TypeError, match="cannot be set"):
        a.set(np.ones(3, np.float32))


def test_only_cupys_signatures_and_names():
    a = cp.arange(6.0).reshape(2, 3)
    with pytest.raises(TypeError):
        a.sum(where=a > 1)  # NumPy has where=, CuPy does not
    with pytest.raises(TypeError):
        a.max(initial=0.0)
    with pytest.raises(TypeError, match="Wrong arguments"):
        cp.add(a, a, where=a > 1)
    with pytest.raises(TypeError, match="Did not understand"):
        cp.einsum("ij->i", a, out=cp.zeros(2))
    with pytest.raises(NotImplementedError, match="cupy_maximum.reduce"):
        cp.maximum.reduce(a)
    assert cp.add.reduce(a, axis=0).get().tolist() == [3.0, 5.0, 7.0]
    assert a.argmax(axis=1, dtype=np.int32).dtype == np.int32  # CuPy's argmax has a dtype
    for name in ("normal", "choice", "permutation", "shuffle"):
        assert not hasattr(cp.random.default_rng(0), name)
    with pytest.raises(ValueError, match="Unsupported dtype"):
        cp.array(["a", "b"])
    assert not hasattr(cp, "float128") and not hasattr(cp, "nditer")


@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="compares with an installed CuPy")
def test_every_public_name_exists_in_real_cupy():
    import cupy as real  # noqa: PLC0415

    # counting is the stand-in's own module (what a GPU would launch and wait for)
    names = [n for n in dir(cp) if not n.startswith("_") and n not in ("annotations", "counting")]
    missing = [n for n in names if not hasattr(real, n)]
    assert missing == []
    # the generator's methods, by class: making a real Generator needs a GPU, CI has none
    ours, theirs = type(cp.random.default_rng(0)), real.random.Generator
    assert [m for m in dir(ours) if not m.startswith("_") and not hasattr(theirs, m)] == []


def test_as_strided_is_a_base_less_view_that_must_fit_its_block():
    a = cp.arange(16, dtype=cp.float32)
    w = cp.lib.stride_tricks.as_strided(a, shape=(3, 4), strides=(16, 4))
    assert w.base is None and w.data.mem is a.data.mem and cp.shares_memory(w, a)
    assert w[2].get().tolist() == [8.0, 9.0, 10.0, 11.0]
    with pytest.raises(ValueError, match="outside the array's memory block"):
        cp.lib.stride_tricks.as_strided(a, shape=(1000,), strides=(4,))


def test_pointer_arithmetic_and_unowned_memory_hold_memory_as_cupys():
    a = cp.arange(16, dtype=cp.float32)
    p = a.data + 8
    assert p.mem is a.data.mem and p.ptr == a.data.ptr + 8 and (8 + a.data).ptr == p.ptr and (p - 8).ptr == a.data.ptr
    assert cp.ndarray((2,), cp.float32, memptr=p).get().tolist() == [2.0, 3.0]
    q = a.data
    with pytest.raises(NotImplementedError, match=r"`p \+= n` moves the pointer itself"):
        q += 4  # CuPy moves a's own pointer (and a with it): the stand-in's arrays cannot follow
    assert a.data.ptr == q.ptr and a[0].get() == 0.0
    u = cp.cuda.UnownedMemory(a.data.ptr + 4, 8, a, 0)
    assert u._owner is a and u.size == 8 and u.device_id == 0
    b = cp.ndarray((2,), cp.float32, memptr=cp.cuda.MemoryPointer(u, 0))
    b[...] = 7
    assert a[1:3].get().tolist() == [7.0, 7.0]
    with pytest.raises(RuntimeError, match="explicit device ID for a null pointer"):
        cp.cuda.UnownedMemory(0, 0, None)


# --- the memory pool --------------------------------------------------------------------------------


class RecordingHook(cp.cuda.MemoryHook):
    name = "test_recording"

    def __init__(self):
        self.calls = []

    def __getattribute__(self, attr):
        if attr.endswith("process"):
            calls = object.__getattribute__(self, "calls")
            return lambda **kwargs: calls.append((attr, kwargs))
        return object.__getattribute__(self, attr)


def test_the_pool_rounds_to_512_bytes_and_calls_hooks_with_cupys_arguments():
    gc.collect()  # device arrays of earlier tests, freed later by a collection, would move used_bytes
    pool = cp.get_default_memory_pool()
    used = pool.used_bytes()
    with RecordingHook() as hook:
        a = cp.empty(100, cp.float32)  # 400 bytes -> one 512-byte block
        assert pool.used_bytes() == used + 512
        ptr = a.data.ptr
        del a
        gc.collect()
    assert pool.used_bytes() == used
    names = [c[0] for c in hook.calls]
    assert names[0] == "malloc_preprocess" and names[-2:] == ["free_preprocess", "free_postprocess"]
    malloc = dict(hook.calls)["malloc_postprocess"]
    assert set(malloc) == {"device_id", "size", "mem_size", "mem_ptr", "pmem_id"}
    assert (malloc["size"], malloc["mem_size"], malloc["mem_ptr"]) == (400, 512, ptr)
    free = dict(hook.calls)["free_postprocess"]
    assert set(free) == {"device_id", "mem_size", "mem_ptr", "pmem_id"} and free["mem_ptr"] == ptr
    assert cmem._round_size(1) == 512 and cmem._round_size(512) == 512 and cmem._round_size(513) == 1024


def test_blocks_have_real_aligned_pointers_and_are_reused():
    a = cp.zeros(4, cp.float64)
    assert a.data.ptr % 512 == 0
    ctypes.c_double.from_address(a.data.ptr + 8).value = 42.0  # the pointer IS the memory
    assert a.get().tolist() == [0.0, 42.0, 0.0, 0.0]
    b = a[1:]
    assert b.data.ptr == a.data.ptr + 8 and b.data.mem is a.data.mem
    ptr = a.data.ptr
    del a, b
    gc.collect()
    pool = cp.get_default_memory_pool()
    assert pool.total_bytes() > pool.used_bytes()  # the freed block stays in the pool
    assert cp.zeros(4, cp.float64).data.ptr == ptr  # and serves the next request of its size
    pool.free_all_blocks()
    assert pool.n_free_blocks() == 0


def test_hooks_are_per_thread_and_unique_by_name():
    seen = []

    def other():
        seen.append(len(memory_hook.get_memory_hooks()))
        cp.zeros(10)

    with RecordingHook() as hook:
        with pytest.raises(KeyError, match="already exists"), RecordingHook():
            pass
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen == [0] and hook.calls == []  # the other thread's malloc was not seen here


def test_the_framework_pool_counter_equals_the_pool_end_to_end():
    pool = cp.get_default_memory_pool()
    counter = memory.PoolCounter(baseline=pool.used_bytes())
    hook = memory.pool_hook_class(cp.cuda.MemoryHook)(counter)
    with hook:
        x = cp.ones((100, 7), cp.float32)
        y = (x * 2).sum(axis=0)
        assert counter.allocated == pool.used_bytes()
        del x
        gc.collect()
        assert counter.allocated == pool.used_bytes()
    assert counter.peak >= counter.allocated + 2800 and y.shape == (7,)


# --- devices, streams, events -------------------------------------------------------------------------


def test_arrays_live_on_the_current_device_and_kernels_refuse_others():
    assert cp.cuda.runtime.getDeviceCount() == 2
    with cp.cuda.Device(1):
        b = cp.ones(3)
        assert cp.cuda.Device().id == 1
    a = cp.ones(3)
    assert (a.device.id, b.device.id) == (0, 1)
    with pytest.raises(ValueError, match=r"resides \(1\) is different from the current device \(0\)"):
        a + b
    with pytest.raises(ValueError, match="Peer access"):
        b.sum()
    moved = b.copy()  # copy() goes to the current device, as CuPy's
    assert moved.device.id == 0 and (a + moved).get().tolist() == [2.0] * 3
    assert b.get().tolist() == [1.0] * 3  # reading back works from any device
    assert b.T.device.id == 1  # views need no kernel
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match="invalid device ordinal"):
        cp.cuda.Device(2).use()


def test_streams_and_events_have_cupys_api_and_order_nothing():
    s = cp.cuda.Stream(non_blocking=True)
    assert s.ptr != 0 and s.device_id == 0 and cp.cuda.get_current_stream() == cp.cuda.Stream.null
    with s:
        assert cp.cuda.get_current_stream() is s
    e = s.record()
    assert isinstance(e, cp.cuda.Event) and e.done and s.done
    cp.cuda.get_current_stream().wait_event(e)
    with pytest.raises(TypeError):
        s.wait_event(s)
    with cp.cuda.Device(1), pytest.raises(RuntimeError, match="does not match with the current device"):
        s.use()


def test_random_generators_keep_their_state_on_their_device():
    pool = cp.get_default_memory_pool()
    before = pool.used_bytes()
    g = cp.random.default_rng(5)
    assert pool.used_bytes() > before  # cuRAND state on the device, as CuPy's XORWOW
    x = g.standard_normal((2, 3), dtype=cp.float32)
    assert x.dtype == np.float32 and isinstance(g.random(), cp.ndarray)
    assert cp.random.default_rng(5).standard_normal((2, 3), dtype=cp.float32).get().tolist() == x.get().tolist()
    with cp.cuda.Device(1), pytest.raises(ValueError, match="state resides on device 0"):
        g.random(3)
    with pytest.raises(TypeError, match="Unsupported dtype"):
        g.standard_normal(3, dtype=np.int32)


def test_scatter_add_accumulates_repeated_indices():
    a = cp.zeros(4)
    cupyx.scatter_add(a, cp.array([0, 0, 5]), cp.array([1.0, 2.0, 4.0]))  # 5 wraps to 1
    assert a.get().tolist() == [3.0, 4.0, 0.0, 0.0]
    cp.add.at(a, [3], 1.0)
    assert a.get().tolist() == [3.0, 4.0, 0.0, 1.0]


# --- NCCL (one rank here; two under mpiexec in tests/framework/distributed) ------------------------------


# NCCL's messages (ncclGetErrorString) under CuPy's names, by status.
_NCCL_MESSAGES = {
    1: "NCCL_ERROR_UNHANDLED_CUDA_ERROR: unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
    4: "NCCL_ERROR_INVALID_ARGUMENT: invalid argument (run with NCCL_DEBUG=WARN for details)",
}


@pytest.mark.skipif(not nccl.available, reason="the stand-in's NCCL runs over mpi4py")
def test_nccl_calls_take_device_pointers_of_the_communicators_device(monkeypatch, capfd):
    """Refused calls raise NcclError(status) with NCCL's own message; the reason is a
    ``NCCL WARN`` line on stderr under NCCL_DEBUG=WARN, as NCCL prints it."""
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    assert (comm.size(), comm.rank_id(), comm.device_id()) == (1, 0, 0)
    x = cp.arange(4, dtype=cp.float32)
    y = cp.zeros(4, cp.float32)
    stream = cp.cuda.Stream()
    comm.allReduce(x.data.ptr, y.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
    assert y.get().tolist() == [0.0, 1.0, 2.0, 3.0]
    comm.allReduce(x.data.ptr + 8, x.data.ptr + 8, 2, nccl.NCCL_FLOAT32, nccl.NCCL_AVG, 0)  # in place, a slice
    comm.bcast(y.data.ptr, 4, nccl.NCCL_FLOAT32, 0, 0)
    with pytest.raises(nccl.NcclError, match=re.escape(_NCCL_MESSAGES[4])) as err:
        comm.allReduce(x.data.ptr, y.data.ptr, 200, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, 0)  # past the block
    assert (
        err.value.status == 4
        and "NCCL WARN" in (warn := capfd.readouterr().err)
        and "not 800 bytes of live device memory" in warn
    )
    with cp.cuda.Device(1):
        other = cp.zeros(4, cp.float32)
        side = cp.cuda.Stream()
    with pytest.raises(nccl.NcclError, match=re.escape(_NCCL_MESSAGES[4])) as err:
        comm.allReduce(other.data.ptr, other.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, 0)
    assert err.value.status == 4 and "NCCL WARN" in (warn := capfd.readouterr().err) and "memory of device 1" in warn
    with pytest.raises(nccl.NcclError, match=re.escape(_NCCL_MESSAGES[1])) as err:
        comm.allReduce(x.data.ptr, x.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, side.ptr)
    assert err.value.status == 1 and "NCCL WARN" in (warn := capfd.readouterr().err) and "stream of device 1" in warn
    freed = cp.zeros(4, cp.float32)
    ptr = freed.data.ptr
    del freed
    gc.collect()
    with pytest.raises(nccl.NcclError, match=re.escape(_NCCL_MESSAGES[4])) as err:
        comm.allReduce(ptr, ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, 0)  # use after free
    assert err.value.status == 4 and "NCCL WARN" in (warn := capfd.readouterr().err) and "live device memory" in warn
    with pytest.raises(ValueError, match="commId length"):
        nccl.NcclCommunicator(1, b"short", 0)
    comm.destroy()


def test_the_pool_limit_frees_cached_blocks_then_raises_cupys_out_of_memory_error():
    from framework.testing import cupy_standin as cp

    pool = cp.cuda.MemoryPool()
    with cp.cuda.Device(0):
        pool.set_limit(size=4096)
        assert pool.get_limit() == 4096
        a = pool.malloc(2048)
        b = pool.malloc(2048)
        del b  # back to the pool, cached
        assert pool.total_bytes() == 4096
        c = pool.malloc(1024)  # a new block: the cached one is given back first
        assert pool.total_bytes() == 3072 and pool.n_free_blocks() == 0
        with pytest.raises(cp.cuda.memory.OutOfMemoryError) as info:
            pool.malloc(2048)
        assert str(info.value) == (
            "Out of memory allocating 2,048 bytes (allocated so far: 3,072 bytes, limit set to: 4,096 bytes)."
        )
        assert isinstance(info.value, MemoryError)
        pool.set_limit(fraction=0.5)
        assert pool.get_limit() == cp.cuda.runtime.getDeviceProperties(0)["totalGlobalMem"] // 2
        with pytest.raises(ValueError, match="at one time"):
            pool.set_limit(size=1, fraction=0.5)
        pool.set_limit()  # no limit
        assert pool.get_limit() == 0 and pool.malloc(8192).mem.size == 8192
        del a, c
