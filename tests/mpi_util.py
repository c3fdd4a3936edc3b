"""Launching MPI jobs from tests: find mpiexec, run a script under it, never hang.

A job runs in its own process session; on timeout the whole group (mpiexec and every
rank it started) is killed and the test fails with what the job printed.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from framework.distributed.comm import find_mpiexec  # noqa: F401  (re-exported for the tests)

REPO = Path(__file__).resolve().parents[1]
HAVE_MPI4PY = importlib.util.find_spec("mpi4py") is not None


needs_mpiexec = pytest.mark.skipif(
    not HAVE_MPI4PY or find_mpiexec() is None,
    reason="multi-rank tests need mpi4py and an mpiexec (pip install -e '.[mpi]')",
)


def worker_env():
    """The environment of a job: one BLAS thread per rank, the repository importable."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def run_command(cmd, timeout: float, cwd=REPO, env=None):
    """Runs ``cmd``; returns ``(returncode, stdout, stderr, seconds)``."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [str(c) for c in cmd],
        cwd=cwd,
        env=worker_env() if env is None else env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # mpiexec and the ranks it started
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} did not finish in {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
    return proc.returncode, out, err, time.monotonic() - start


def run_script(script, args=(), nprocs=None, timeout: float = 30.0, cwd=REPO, env=None):
    """``python script args`` (under ``mpiexec -n nprocs`` when given)."""
    cmd = [sys.executable, str(script), *args]
    if nprocs is not None:
        cmd = [find_mpiexec(), "-n", str(nprocs), *cmd]
    return run_command(cmd, timeout, cwd, env)
