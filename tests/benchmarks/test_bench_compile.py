"""Smoke run of benchmarks/bench_compile.py (``--quick``): the tables and the byte counts.

Timings are never checked here; they belong in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import json

from benchmarks import bench_compile


def test_bench_compile_quick(capsys, tmp_path):
    path = tmp_path / "compile.json"
    payload = bench_compile.main(["--quick", "--steps", "3", "--json", str(path)])
    out = capsys.readouterr().out
    for heading in ("### Bitwise", "### Memory of one step", "### Speed", "### Capture cost", "### Targets"):
        assert heading in out
    for column in ("planned/floor", "lower bound", "speedup", "plan"):  # the tables' legends
        assert f"\nlegend: {column}: " in out
    saved = json.loads(path.read_text())
    assert saved["params"] == {"steps": 3, "repeats": 3, "quick": True}
    # the compiled steps replay eager's numbers bit for bit
    assert all(v is None for v in saved["bitwise_first_difference"].values())
    for row in payload["memory"]:
        for policy in ("off", "auto"):
            c = row[policy]
            assert c["lower_bound"] <= c["planned_peak"]
            assert c["unbound"] == 0
        # compiled under off needs no more than eager off; under auto, no more than eager auto
        assert row["off"]["planned_peak"] <= row["eager_off_peak"]
        assert row["auto"]["planned_peak"] <= row["eager_auto_peak"]
    assert saved["tiny_op_us"]["compiled"] > 0
