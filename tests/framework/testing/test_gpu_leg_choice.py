"""Which CuPy the gpu leg runs on, where CuPy is installed but cannot run (tests/conftest.py).

A session is started in a subprocess with a "cupy" whose import fails as a CuPy built for
another CUDA does: unset, the leg runs on the stand-in and says why in one line; with
``INPLACE_LAB_CUPY=cupy`` nothing falls back: the gpu tests are skipped with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from framework import backend

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BROKEN = "libcudart.so.13: cannot open shared object file: No such file or directory"
GPU_TEST = "tests/framework/test_backend.py::test_tensor_from_a_cupy_array_and_back"


# What real CuPy 14 raises at its first CUDA call on a machine with no NVIDIA driver at all.
NO_DRIVER = """\
class CUDARuntimeError(RuntimeError):
    pass


class runtime:
    @staticmethod
    def getDeviceCount():
        raise CUDARuntimeError(
            "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version"
        )


class cuda:
    runtime = runtime
"""


def _session(tmp_path, choice, cupy=f"raise ImportError({BROKEN!r})\n"):
    fake = tmp_path / "cupy"
    fake.mkdir(exist_ok=True)
    (fake / "__init__.py").write_text(cupy)
    env = {k: v for k, v in os.environ.items() if k != "INPLACE_LAB_CUPY"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), ROOT])
    if choice is not None:
        env["INPLACE_LAB_CUPY"] = choice
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "-p", "no:xdist", GPU_TEST]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_an_unusable_cupy_is_never_replaced_in_silence(tmp_path):
    r = _session(tmp_path, None)
    assert r.returncode == 0, r.stdout + r.stderr
    line = f"gpu leg on the CuPy stand-in, not CuPy: CuPy is installed but cannot be used (ImportError: {BROKEN})"
    said = [x for x in r.stderr.splitlines() if x.startswith("gpu leg on")]
    assert len(said) == 1 and said[0].startswith(line), r.stderr
    assert "1 passed" in r.stdout


def test_asking_for_cupy_never_falls_back(tmp_path):
    r = _session(tmp_path, "cupy")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "gpu leg on the CuPy stand-in" not in r.stderr
    assert "1 skipped" in r.stdout and f"ImportError: {BROKEN}" in r.stdout


def test_a_cupy_on_a_machine_without_a_driver_is_no_news(tmp_path):
    """Issue 41: the nvrtc extra installs CuPy, so a test run on a machine without a GPU
    printed "CuPy is installed but cannot be used (cudaErrorInsufficientDriver ...)". No
    driver is no GPU: the stand-in runs the leg without a word (the header says which)."""
    if backend._driver_loads():
        pytest.skip("NVIDIA's driver loads here: an insufficient driver would be real news")
    r = _session(tmp_path, None, cupy=NO_DRIVER)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "cannot be used" not in r.stderr + r.stdout and "gpu leg on" not in r.stderr
    assert "1 passed" in r.stdout
