"""Which CuPy the gpu leg runs on, where CuPy is installed but cannot run (tests/conftest.py).

A session is started in a subprocess with a "cupy" whose import fails as a CuPy built for
another CUDA does: unset, the leg runs on the stand-in and says why in one line; with
``INPLACE_LAB_CUPY=cupy`` nothing falls back: the gpu tests are skipped with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BROKEN = "libcudart.so.13: cannot open shared object file: No such file or directory"
GPU_TEST = "tests/framework/test_backend.py::test_tensor_from_a_cupy_array_and_back"


def _session(tmp_path, choice):
    fake = tmp_path / "cupy"
    fake.mkdir(exist_ok=True)
    (fake / "__init__.py").write_text(f"raise ImportError({BROKEN!r})\n")
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
