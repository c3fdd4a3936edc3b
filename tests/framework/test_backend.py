"""The backend: device parsing, the array module per device, transfers; a GPU leg where one exists."""

import numpy as np
import pytest

import framework as fw
from framework import backend
from framework.backend import Device
from tests.conftest import requires_gpu


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


def test_asking_for_cuda_without_a_gpu_says_what_to_do():
    if backend.is_cuda_available():
        pytest.skip("a GPU is available here")
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
