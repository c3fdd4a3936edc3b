"""benchmarks/bench_recompute.py, quick: a row per framework and recompute mode, and what
ours holds at the forward/backward boundary falls from none to selective to full (never
timings: the machine is shared)."""

from __future__ import annotations

from benchmarks import bench_recompute as B


def test_quick_rows_and_what_each_mode_holds(capsys):
    out = B.main(["--quick", "--only", "tiny", "resnet20", "--repeats", "1"])
    text = capsys.readouterr().out
    assert "| model | framework | recompute | samples/s | step time vs none |" in text
    for name in ("tiny", "resnet20"):
        r, _ = out["results"][name]
        held = {mode: r[("ours", mode)]["held_mb"] for mode in B.MODES}
        assert held["full"] < held["selective"] < held["none"], (name, held)
        assert all(r[(who, mode)]["median_s"] > 0 for who, mode in r)
