"""The backend: device parsing, the array module per device, transfers; a GPU leg where one exists."""

import re

import numpy as np
import pytest

import framework as fw
from framework import backend
from framework.backend import Device
from framework.testing import to_numpy
from tests.conftest import requires_gpu
from tests.framework.ops.harness import memory_overlaps


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("cpu", Device("cpu")),
        ("cpu:0", Device("cpu")),
        (" cpu ", Device("cpu")),
        (None, Device("cpu")),
        ("cuda", Device("cuda", 0)),  # resolved to the first GPU (PyTorch keeps index None)
        ("cuda:0", Device("cuda", 0)),
        ("cuda:1", Device("cuda", 1)),
        (Device("cuda", 3), Device("cuda", 3)),
    ],
)
def test_device_parsing(spec, expected):
    assert backend.device(spec) == expected
    assert fw.device(spec) == expected  # re-exported as fw.device


@pytest.mark.parametrize("bad", ["gpu", "CUDA", "cuda:", "cuda:x", "cuda:-1", "cpu:1", "", "tpu:0", "cuda0"])
def test_bad_device_strings_raise_a_clear_error(bad):
    with pytest.raises(ValueError, match="unknown device") as err:
        backend.device(bad)
    assert repr(bad) in str(err.value)
    assert "'cpu', 'cuda' or 'cuda:N'" in str(err.value) or "one cpu device" in str(err.value)


def test_device_str_repr_and_hash():
    assert str(Device("cpu")) == "cpu" and str(Device("cuda", 1)) == "cuda:1"
    assert repr(Device("cpu")) == "device(type='cpu')"
    assert repr(Device("cuda", 1)) == "device(type='cuda', index=1)"
    assert len({backend.device("cuda"), backend.device("cuda:0")}) == 1


def test_cpu_array_module_and_helpers():
    assert backend.xp_for(backend.device("cpu")) is np
    a = np.arange(3.0)
    assert backend.get_array_module(a) is np
    assert backend.device_of(a) == Device("cpu")
    assert backend.to_device(a, Device("cpu")) is a  # already there: no copy
    assert backend.to_numpy(a) is a


def test_is_cuda_available_is_a_bool():
    assert isinstance(backend.is_cuda_available(), bool)
    assert fw.is_cuda_available() == backend.is_cuda_available()


def test_asking_for_cuda_without_a_gpu_says_what_to_do(without_cupy):
    with pytest.raises(RuntimeError, match=r"CuPy is not installed or sees no GPU.*pip install"):
        backend.xp_for(backend.device("cuda"))


def test_array_module_of_tensors_on_backend(backend):
    t = fw.ones(3, device=backend)
    xp = backend_module_for(backend)
    assert t.xp is xp
    assert fw.backend.get_array_module(t._data) is xp
    assert fw.backend.device_of(t._data) == fw.device(backend)
    host = fw.backend.to_numpy(t._data)
    assert isinstance(host, np.ndarray)
    np.testing.assert_array_equal(host, [1.0, 1.0, 1.0])


def backend_module_for(name):
    return fw.backend.xp_for(fw.device(name))


@pytest.mark.gpu
@requires_gpu
def test_gpu_transfers_round_trip():
    cp = backend.cupy_module()
    assert backend.xp_for(Device("cuda", 0)) is cp
    a = np.arange(4.0)
    g = backend.to_device(a, Device("cuda", 0))
    assert isinstance(g, cp.ndarray) and backend.device_of(g) == Device("cuda", 0)
    assert backend.get_array_module(g) is cp
    back = backend.to_device(g, Device("cpu"))
    assert isinstance(back, np.ndarray)
    np.testing.assert_array_equal(back, a)
    assert backend.to_device(g, Device("cuda", 0)) is g


# --- the calls that differ between NumPy and CuPy (backend.py decides) ---------------------------


def test_reshape_view_is_a_view_or_none(backend):
    a = fw.arange(24, device=backend)._data.reshape(2, 3, 4)
    v = fw.backend.reshape_view(a, (6, 4))
    assert v is not None and v.shape == (6, 4) and memory_overlaps(v, a)
    t = a.transpose(2, 0, 1)  # (4, 2, 3), not contiguous
    assert fw.backend.reshape_view(t, (4, 6)) is not None  # merging the last two dims keeps strides
    assert fw.backend.reshape_view(t, (24,)) is None  # would need a copy
    assert fw.backend.reshape_view(a, (5, 5)) is None  # wrong size


@pytest.mark.parametrize(
    "shape,size,expected",
    [
        ((-1,), 24, (24,)),
        ((2, -1, 3), 24, (2, 4, 3)),
        ((6, 4), 24, (6, 4)),
        ((), 1, ()),
        ((0, 3), 0, (0, 3)),
        ((5, -1), 24, None),
        ((-1, -1), 24, None),
        ((5, 5), 24, None),
        ((0, -1), 0, None),
    ],
)
def test_known_shape_resolves_minus_one_as_numpy_does(shape, size, expected):
    # What reshape_view's CuPy branch hands to the shape setter (that branch needs a GPU).
    assert backend._known_shape(shape, size) == expected
    if expected is not None:
        assert np.empty(size).reshape(shape).shape == expected


def test_scatter_add_accumulates_repeated_indices(backend):
    xp = backend_module_for(backend)
    a = xp.zeros((4, 2))
    index = fw.backend.index_like(np.array([0, 2, 0, 0]), a)
    fw.backend.scatter_add(a, index, xp.ones((4, 2)))
    np.testing.assert_array_equal(fw.backend.to_numpy(a), [[3, 3], [0, 0], [1, 1], [0, 0]])
    mask = fw.backend.index_like(np.array([True, False, True, False]), a)
    fw.backend.scatter_add(a, (mask, 1), xp.asarray([10.0, 20.0]))
    np.testing.assert_array_equal(fw.backend.to_numpy(a)[:, 1], [13, 0, 21, 0])


def test_index_like_puts_index_arrays_on_the_arrays_device(backend):
    a = fw.zeros(3, device=backend)._data
    for item in ([2, 0], np.array([2, 0]), fw.tensor([2, 0], device=backend)._data):
        moved = fw.backend.index_like(item, a)
        if backend == "cpu":
            assert moved is item  # NumPy takes lists and arrays as they are
        else:
            assert fw.backend.device_of(moved) == fw.backend.device_of(a)
        np.testing.assert_array_equal(to_numpy(moved), [2, 0])


def test_is_array_and_bounds_checking_per_module(backend):
    a = fw.zeros(2, device=backend)._data
    assert fw.backend.is_array(a)
    assert not any(fw.backend.is_array(v) for v in (1.0, [1.0], fw.zeros(2), np.float32(1)))
    assert fw.backend.index_bounds_checked(a) == (backend == "cpu")


def test_device_context_and_rng_key(backend):
    dev = fw.device(backend)
    with fw.backend.device_context(dev):
        t = fw.zeros(2, device=backend)
    assert t.device == dev
    xp = backend_module_for(backend)
    key = fw.backend.rng_key(xp)
    assert (key == "numpy") if backend == "cpu" else key.startswith("cupy:")


def test_get_array_module_finds_cupy_arrays_before_anything_asked_for_cuda():
    # A CuPy array made by the user directly: get_array_module must not say NumPy.
    assert backend.get_array_module(1.0) is np and backend.get_array_module([1.0]) is np
    assert not backend.is_array(np.float64(1.0))


@pytest.mark.gpu
@requires_gpu
def test_tensor_from_a_cupy_array_and_back():
    cp = backend.cupy_module()
    g = cp.arange(6, dtype=cp.float32).reshape(2, 3)
    t = fw.tensor(g, device="cuda")
    assert t.dtype == np.float32 and t.device == Device("cuda", 0)
    assert not memory_overlaps(t._data, g)  # a copy, as fw.tensor always makes
    c = fw.tensor(g)  # to the CPU
    assert isinstance(c._data, np.ndarray)
    np.testing.assert_array_equal(c.numpy(), g.get())
    with pytest.raises(TypeError, match="not NumPy arrays"):
        fw.ones(3, device="cuda") + g


@pytest.mark.gpu
@requires_gpu
def test_to_device_between_two_gpus():
    cp = backend.cupy_module()
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    a = backend.to_device(np.arange(3.0), Device("cuda", 0))
    b = backend.to_device(a, Device("cuda", 1))
    assert backend.device_of(b) == Device("cuda", 1) and b is not a
    np.testing.assert_array_equal(b.get(), [0.0, 1.0, 2.0])
    t = fw.zeros(2, device="cuda:1")
    assert t.device == Device("cuda", 1)


# --- the one device parser and the choice of CuPy -------------------------------------------------


def test_parse_device_keeps_a_bare_cuda_unresolved():
    assert backend.parse_device("cuda") == Device("cuda", None) and str(Device("cuda")) == "cuda"
    assert backend.parse_device(" cuda:1 ") == Device("cuda", 1)
    assert backend.device("cuda") == Device("cuda", 0)  # device() resolves it to the first GPU
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        backend.parse_device("gpu")


def test_memory_and_the_config_check_use_the_backend_parser():
    from trainers.config import SCHEMA

    for bad in ("gpu", "cuda:x", "cpu:1"):
        with pytest.raises(ValueError) as by_backend:
            backend.parse_device(bad)
        with pytest.raises(ValueError) as by_memory:
            fw.memory.allocated_bytes(bad)
        assert str(by_memory.value) == str(by_backend.value)
        with pytest.raises(ValueError):
            SCHEMA["device"].parse(bad)
    assert SCHEMA["device"].parse("cuda:3") == Device("cuda", 3)


@pytest.mark.parametrize("value, choice", [("", "cupy"), ("cupy", "cupy"), ("standin", "standin"), (" none ", "none")])
def test_cupy_choice_comes_from_the_environment(monkeypatch, value, choice):
    monkeypatch.setenv(backend.CUPY_ENV, value)
    assert backend.cupy_choice() == choice


def test_a_bad_cupy_choice_says_what_is_allowed(monkeypatch):
    monkeypatch.setenv(backend.CUPY_ENV, "gpu")
    with pytest.raises(ValueError, match="INPLACE_LAB_CUPY='gpu': use one of cupy, standin, none"):
        backend.cupy_choice()


def test_without_cupy_the_device_functions_say_why(without_cupy):
    assert backend.device_count() == 0 and backend.nccl_module() is None
    assert backend.cuda_unavailable_reason() == "CuPy is switched off (INPLACE_LAB_CUPY=none)"
    with pytest.raises(RuntimeError, match="a GPU was asked for, but CuPy is switched off"):
        backend.use_device(Device("cuda", 0))
    backend.synchronize(Device("cpu"))  # nothing to wait for on the CPU


@pytest.fixture
def fresh_backend(monkeypatch):
    """The backend's CuPy loaded anew in the test, and put back as it was afterwards."""
    for name in ("_cupy", "_cupyx", "_cupy_error"):
        monkeypatch.setattr(backend, name, None)


@pytest.mark.parametrize(
    "count, why",
    [
        (None, "CUDARuntimeError: cudaErrorNoDevice: no CUDA-capable device is detected"),
        (0, "RuntimeError: CUDA reports no device"),
    ],
)
def test_a_cupy_that_cannot_be_used_says_why(fresh_backend, monkeypatch, count, why):
    """A CuPy that imports but fails (no driver, no device) is not CuPy "not installed": the
    reason it failed is kept and given, and nothing falls back to another module."""
    import framework.testing.cupy_standin as standin  # noqa: PLC0415 - the module under test here

    def device_count():
        if count is None:
            raise standin.cuda.runtime.CUDARuntimeError(100, "cudaErrorNoDevice: no CUDA-capable device is detected")
        return count

    monkeypatch.setenv(backend.CUPY_ENV, "standin")
    monkeypatch.setattr(standin.cuda.runtime, "getDeviceCount", device_count)
    assert backend.cupy_module() is None and not backend.is_cuda_available()
    reason = backend.cuda_unavailable_reason()
    assert reason.startswith(f"CuPy is installed but cannot be used ({why})"), reason
    with pytest.raises(RuntimeError, match=re.escape(why)):
        backend.use_device(Device("cuda", 0))


@pytest.mark.parametrize(
    "error, driver, broken",
    [
        ("cudaErrorInsufficientDriver: CUDA driver version is insufficient", False, False),  # no driver: no GPU
        ("cudaErrorInsufficientDriver: CUDA driver version is insufficient", True, True),  # a driver too old
        ("cudaErrorNoDevice: no CUDA-capable device is detected", False, False),
        ("cudaErrorNoDevice: no CUDA-capable device is detected", True, True),  # hidden, or lost: say so
    ],
)
def test_a_cupy_without_a_gpu_here_is_not_broken(fresh_backend, monkeypatch, error, driver, broken):
    import framework.testing.cupy_standin as standin  # noqa: PLC0415 - the module under test here

    def device_count():
        raise standin.cuda.runtime.CUDARuntimeError(35, error)

    monkeypatch.setenv(backend.CUPY_ENV, "standin")
    monkeypatch.setattr(standin.cuda.runtime, "getDeviceCount", device_count)
    monkeypatch.setattr(backend, "_driver_loads", lambda: driver)
    assert backend.cupy_broken() is broken
    assert error in backend.cuda_unavailable_reason()  # whoever asks for a GPU hears why


def test_a_cupy_that_does_not_import_is_broken_with_or_without_a_driver(fresh_backend, monkeypatch):
    monkeypatch.setenv(backend.CUPY_ENV, "standin")
    monkeypatch.setitem(backend._CUPY_MODULES, "standin", ("framework.testing.no_such_module", "x"))
    monkeypatch.setattr(backend, "_driver_loads", lambda: False)
    assert backend.cupy_broken()


@pytest.mark.gpu
@requires_gpu
def test_device_functions_on_the_gpu_legs_cupy(cupy):
    assert backend.device_count() == cupy.cuda.runtime.getDeviceCount() >= 1
    last = Device("cuda", backend.device_count() - 1)
    before = backend.current_device()
    try:
        backend.use_device(last)
        assert backend.current_device() == last and fw.zeros(1, device="cuda:0").device == Device("cuda", 0)
        backend.synchronize(last)
    finally:
        backend.use_device(before)
    side = backend.new_stream()
    event = backend.record_event()  # on the current stream
    backend.wait_event(event, side)  # the side stream waits for it
    after = backend.record_event(side)
    backend.wait_event(after)  # and the current stream for the side stream
    cupy.cuda.get_current_stream().synchronize()
    assert backend.event_done(after) and backend.current_stream() == cupy.cuda.get_current_stream()
    props = backend.device_properties(last)
    assert props["name"] and props["total_memory"] > 0 and props["cupy"] == cupy.__version__
    assert backend.nccl_module() is None or hasattr(backend.nccl_module(), "NcclCommunicator")
