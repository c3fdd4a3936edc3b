"""Shared test fixtures: the GPU leg (``requires_gpu``, ``backend``) and a clean global state.

Tests marked ``@pytest.mark.gpu`` (or decorated with :data:`requires_gpu`) run only when
CuPy sees a CUDA device and are skipped with a reason otherwise, so the suite passes on
a CPU-only machine and checks the GPU path where one exists.
"""

from __future__ import annotations

import pytest

from framework import backend as fw_backend
from framework import inplace
from framework.autograd.grad_mode import state as _grad_state

CUDA_AVAILABLE = fw_backend.is_cuda_available()
NO_GPU_REASON = "needs CuPy and a CUDA device (framework.backend.is_cuda_available() is False)"

#: Skip marker for tests that need a GPU; use together with ``@pytest.mark.gpu``.
requires_gpu = pytest.mark.skipif(not CUDA_AVAILABLE, reason=NO_GPU_REASON)


def pytest_collection_modifyitems(config, items):
    # Every test marked gpu is skipped cleanly without a device, even without @requires_gpu.
    if CUDA_AVAILABLE:
        return
    skip = pytest.mark.skip(reason=NO_GPU_REASON)
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not item.keywords: it holds param ids too
            item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_gpu])])
def backend(request):
    """The device a test runs on: ``"cpu"``, and ``"cuda"`` where a GPU is available.

    The same test body then checks NumPy and CuPy; compare values with
    ``framework.testing.to_numpy`` (it copies from the GPU).
    """
    return request.param


@pytest.fixture(autouse=True)
def _restore_global_state():
    """Grad mode, anomaly mode and the inplace policy are process-global: restore them."""
    enabled, anomaly, policy = _grad_state.enabled, _grad_state.anomaly, inplace.get_policy()
    yield
    _grad_state.enabled, _grad_state.anomaly = enabled, anomaly
    inplace.set_policy(policy)
