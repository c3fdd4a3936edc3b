"""Smoke run of benchmarks/bench_memory_budget.py (``--quick``, our side): the table, and
the kept bytes falling with the budget, bitwise eager ``off`` at each. Timings are never
checked here; PyTorch's side runs in the benchmark itself (docs/BENCHMARKS.md)."""

from __future__ import annotations

import json

from benchmarks import bench_memory_budget


def test_bench_memory_budget_quick(capsys, tmp_path):
    path = tmp_path / "budget.json"
    bench_memory_budget.main(
        [
            "--quick",
            "--no-torch",
            "--repeats",
            "1",
            "--only",
            "gpt-block",
            "--json",
            str(path),
            "--figure",
            str(tmp_path / "f.png"),
        ]
    )
    out = capsys.readouterr().out
    assert "| gpt-block | 0.5 |" in out and "\nlegend: kept MB: " in out
    rows = json.loads(path.read_text())["results"]["gpt-block"]
    kept = [rows[str(b)]["ours"]["kept"] for b in bench_memory_budget.BUDGETS]
    assert kept == sorted(kept, reverse=True) and kept[-1] < kept[0]
    assert all(rows[str(b)]["ours"]["bitwise"] for b in bench_memory_budget.BUDGETS)
    assert (tmp_path / "f.png").stat().st_size > 0
