"""Smoke run of ``benchmarks/bench_zero.py --quick --ranks 2`` (it launches itself under mpiexec).

Checks the table and the JSON rows: every stage's bytes per rank within 2% of the formula.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.mpi_util import needs_mpiexec, worker_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.mpi
@needs_mpiexec
def test_bench_zero_prints_measured_against_the_formula(tmp_path):
    path = tmp_path / "zero.json"
    script = os.path.join(ROOT, "benchmarks", "bench_zero.py")
    r = subprocess.run(
        [sys.executable, script, "--quick", "--ranks", "2", "--json", str(path)],
        capture_output=True,
        text=True,
        env=worker_env(),
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "| ranks | optimizer | stage | bytes/Ψ |" in r.stdout and "mixed precision" in r.stdout
    rows = json.loads(path.read_text())["rows"]
    assert [(row["optimizer"], row["stage"]) for row in rows] == [
        (o, s) for o in ("adam", "sgd momentum") for s in (0, 1, 2)
    ]
    for row in rows:
        assert abs(row["held_max"] / row["formula"] - 1) <= 0.02, row
    adam = [row["held_max"] / row["params"] for row in rows if row["optimizer"] == "adam"]
    assert adam == pytest.approx([16, 12, 10], rel=1e-3)  # the paper's 16, 8 + 8/2, 4 + 12/2 bytes per parameter
