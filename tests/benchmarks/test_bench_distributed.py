"""Smoke run of ``benchmarks/bench_distributed.py --quick`` (it launches itself on 2 MPI ranks).

Checks that the tables and their rows are printed and the JSON is written; never timings.
Skipped when mpi4py or mpiexec is missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_distributed.py")
_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


def _mpiexec() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpiexec")


pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None or _mpiexec() is None,
    reason="needs mpi4py and mpiexec",
)


def _table_rows(text: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("|") and not line.startswith("|---")
    ]


def test_bench_distributed_quick(tmp_path):
    path = tmp_path / "distributed.json"
    env = {k: v for k, v in os.environ.items() if k not in _MPI_ENV}  # let the script launch mpiexec
    env["OMP_NUM_THREADS"] = "1"
    try:
        proc = subprocess.run(
            [sys.executable, SCRIPT, "--quick", "--repeats", "2", "--json", str(path)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("bench_distributed --quick did not finish in 300 s")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = proc.stdout
    first = [r[0] for r in _table_rows(out)]
    for row in (
        "raw MPI Allreduce(IN_PLACE), 1 flat buffer",
        "iallreduce_ + wait on bucket buffers (25 MiB)",
        "DataParallel.finish(), on, 25 MiB buckets",
        "DataParallel.finish(), on, 1 MiB buckets",
        "allreduce_ per parameter",
        "off (packed copies)",
        "on (bucket views)",
        "1",
        "2",
        "efficiency",
    ):
        assert row in first, row
    assert out.count("Target:") >= 3
    assert "Load average" in out and "Machine: " in out
    saved = json.loads(path.read_text())
    assert saved["params"]["quick"] is True and saved["params"]["ranks"] == 2
    assert saved["allreduce"]["num_params"] > 0
    assert set(saved) >= {"allreduce", "grad_memory", "weak_scaling", "machine"}
