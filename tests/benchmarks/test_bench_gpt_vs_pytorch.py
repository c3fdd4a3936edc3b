"""Smoke run of benchmarks/bench_gpt_vs_pytorch.py: the table's shape, never its timings."""

from __future__ import annotations


def test_quick_run_prints_both_frameworks_speed_and_peak(capsys, torch):
    from benchmarks import bench_gpt_vs_pytorch

    out = bench_gpt_vs_pytorch.main(["--quick", "--only", "tiny", "--repeats", "1"])
    text = capsys.readouterr().out
    assert "| tiny (batch 2) |" in text and "legend: peak RSS growth MB" in text
    r = out["tiny"]
    assert r["speed"]["ours_samples_per_s"] > 0 and r["speed"]["pytorch_samples_per_s"] > 0
    assert r["peak"]["median_mb"]["ours"] > 0 and r["peak"]["median_mb"]["pytorch"] > 0
    assert r["peak"]["counter_mb"] > 0
