"""Shared test fixtures: the GPU leg (on CuPy or its stand-in) and a clean global state.

Which CuPy the ``gpu`` leg runs on is decided once, here, before any test module is
imported, from the environment variable ``INPLACE_LAB_CUPY`` (``framework.backend.CUPY_ENV``):

- unset: real CuPy where it sees a GPU; elsewhere the CuPy stand-in
  (:mod:`framework.testing.cupy_standin`: CuPy's API and behaviour on the CPU, with two
  simulated GPUs), so every ``gpu`` test runs on every machine;
- ``cupy``: real CuPy only (without a GPU the ``gpu`` tests are skipped, with the reason);
- ``standin``: the stand-in even where a GPU exists;
- ``none``: as if CuPy were not installed (the ``gpu`` tests are skipped).

The choice is written back to the environment, so the jobs the tests launch (``mpiexec``
workers, scripts) load the same module. Tests marked ``@pytest.mark.gpu`` (or decorated
with :data:`requires_gpu`) run when the chosen CuPy sees a device and are skipped with a
reason otherwise.
"""

from __future__ import annotations

import os
import sys

import pytest

from framework import backend as fw_backend
from framework import inplace, memory
from framework.autograd.grad_mode import state as _grad_state
from framework.ops import autocast as autocast_ops
from framework.ops import conv as conv_ops

#: Why the gpu leg runs on the stand-in although CuPy is installed (None otherwise).
FALLBACK_REASON = None


def _choose_cupy() -> str:
    global FALLBACK_REASON
    if os.environ.get(fw_backend.CUPY_ENV, "").strip():
        return fw_backend.cupy_choice()  # chosen by the user: never replaced (cupy without a GPU skips)
    choice = "cupy" if fw_backend.is_cuda_available() else "standin"
    # A CuPy that cannot see a GPU because there is none (the nvrtc extra installs CuPy on
    # machines without a driver) is no news; a broken one is.
    if choice == "standin" and fw_backend.cupy_broken():
        FALLBACK_REASON = fw_backend.cuda_unavailable_reason()
    os.environ[fw_backend.CUPY_ENV] = choice  # inherited by the jobs the tests launch
    fw_backend.forget_cupy()
    return choice


CUPY_CHOICE = _choose_cupy()
CUDA_AVAILABLE = fw_backend.is_cuda_available()
NO_GPU_REASON = (
    f"needs CuPy and a CUDA device ({fw_backend.CUPY_ENV}={CUPY_CHOICE}: {fw_backend.cuda_unavailable_reason()})"
)

#: Skip marker for tests that need a GPU; use together with ``@pytest.mark.gpu``.
requires_gpu = pytest.mark.skipif(not CUDA_AVAILABLE, reason=NO_GPU_REASON)


def pytest_configure(config):
    # Never in silence: a machine with CuPy whose gpu leg runs on the stand-in says why, once
    # (not in xdist workers), also under -q where the report header is not shown.
    if FALLBACK_REASON and not hasattr(config, "workerinput"):
        sys.stderr.write(f"gpu leg on the CuPy stand-in, not CuPy: {FALLBACK_REASON}\n")


def pytest_report_header(config):
    if not CUDA_AVAILABLE:
        return f"gpu leg: skipped ({NO_GPU_REASON})"
    cp = fw_backend.cupy_module()
    what = (
        "the CuPy stand-in (framework.testing.cupy_standin, NumPy on the CPU)"
        if CUPY_CHOICE == "standin"
        else f"CuPy {cp.__version__}"
    )
    if FALLBACK_REASON:
        what += f"; CuPy is installed but not used: {FALLBACK_REASON}"
    return f"gpu leg: {what}, {fw_backend.device_count()} GPU(s)"


def pytest_collection_modifyitems(config, items):
    # Every test that uses the oracle (the ``torch`` fixture) is marked torch_oracle, so that
    # `-m torch_oracle` counts them and `-m "not torch_oracle"` deselects them where torch
    # cannot be installed (.ci/run's other interpreters).
    for item in items:
        if "torch" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.torch_oracle)
    # Every test marked gpu is skipped cleanly without a device, even without @requires_gpu.
    if CUDA_AVAILABLE:
        return
    skip = pytest.mark.skip(reason=NO_GPU_REASON)
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not item.keywords: it holds param ids too
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    # How many random programs were compared with PyTorch (the differential test records
    # it per test; the reports carry it back from xdist's workers).
    ran = sum(
        value
        for report in terminalreporter.stats.get("passed", [])
        for key, value in getattr(report, "user_properties", ())
        if key == "oracle_programs"
    )
    if ran:
        terminalreporter.write_line(f"oracle: {ran} random programs compared with PyTorch under off, auto and on")


#: The PyTorch the oracle tests compare with (the ``oracle`` extra pins it).
TORCH_ORACLE_VERSION = "2.13.0"


def in_ci() -> bool:
    """True under CI (``CI=true``, as .ci/run is run): nothing that CI must check may skip."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require_torch():
    """PyTorch, the oracle: the one place that decides whether a comparison with it runs.

    Without torch (or with another version than the one the tests were written against)
    the test is skipped with the reason, on a developer's machine; under ``CI=true`` it
    FAILS instead: the comparisons with PyTorch must run in CI (``pip install -e
    ".[test,mpi,oracle]"``, as .ci/run does).
    """
    try:
        import torch  # noqa: PLC0415
    except ImportError as e:
        why = f"PyTorch is not installed ({e}); pip install -e '.[oracle]' runs the comparisons with it"
    else:
        if torch.__version__.split("+")[0] == TORCH_ORACLE_VERSION:
            return torch
        why = f"PyTorch {torch.__version__} is installed; the comparisons are written against {TORCH_ORACLE_VERSION}"
    if in_ci():
        pytest.fail(f"CI=true and the PyTorch oracle cannot run: {why}", pytrace=False)
    pytest.skip(why)


@pytest.fixture
def torch():
    """The ``torch`` module for a test that compares with PyTorch (see :func:`require_torch`);
    a test that uses it is marked ``torch_oracle``."""
    return require_torch()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_gpu])])
def backend(request):
    """The device a test runs on: ``"cpu"``, and ``"cuda"`` where a GPU (or the stand-in) is available.

    The same test body then checks NumPy and CuPy; compare values with
    ``framework.testing.to_numpy`` (it copies from the GPU).
    """
    return request.param


@pytest.fixture
def cupy():
    """The CuPy module the gpu leg runs on (real CuPy or the stand-in): ``cupy.arange(...)``."""
    cp = fw_backend.cupy_module()
    if cp is None:
        pytest.skip(NO_GPU_REASON)
    return cp


@pytest.fixture
def gpu_run():
    """For a test that runs a Trainer on a GPU: the trainer turns CuPy's pool hook on for
    the process; leave none behind, so later tests read host memory again."""
    yield
    memory.disable_gpu_hook()
    assert memory.gpu_counter() is None


@pytest.fixture
def without_cupy(monkeypatch):
    """The backend as on a machine without CuPy (what a CPU-only user sees), on any machine.

    Jobs launched from the test get ``INPLACE_LAB_CUPY=none`` too.
    """
    monkeypatch.setenv(fw_backend.CUPY_ENV, "none")
    monkeypatch.setattr(fw_backend, "_cupy", False)


@pytest.fixture(autouse=True)
def _restore_global_state():
    """Grad mode, anomaly mode, the inplace policy, conv2d's algorithm and math settings
    and autocast's regions are process-global (a Trainer sets the policy and conv2d's
    settings): restore them."""
    enabled, anomaly, policy = _grad_state.enabled, _grad_state.anomaly, inplace.get_policy()
    conv_mode, conv_math = conv_ops.get_contraction(), conv_ops.get_math_mode()
    regions = {name: (d.enabled, d.dtype) for name, d in autocast_ops.state.devices.items()}
    yield
    _grad_state.enabled, _grad_state.anomaly = enabled, anomaly
    inplace.set_policy(policy)
    conv_ops.set_contraction(conv_mode)
    conv_ops.set_math_mode(conv_math)
    if autocast_ops.state.nesting or regions != {
        n: (d.enabled, d.dtype) for n, d in autocast_ops.state.devices.items()
    }:
        for name, (on, dtype) in regions.items():  # a test that failed inside an autocast region
            autocast_ops.state.devices[name].enabled, autocast_ops.state.devices[name].dtype = on, dtype
        autocast_ops.state.nesting = 0
        autocast_ops.clear_autocast_cache()
        autocast_ops._sync_hook()
