"""Smoke run of benchmarks/bench_conv.py: the tables it prints and the JSON it writes.

Only shapes, names and byte counts are checked, never timings.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_conv


def _rows(text):
    return [
        [c.strip() for c in line.strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("|") and not line.startswith("|---")
    ]


def _tables(text):
    """The markdown tables of the output, in order, as lists of rows (header first)."""
    return [_rows(block) for block in text.split("\n\n") if block.startswith("|")]


def test_bench_conv_quick(capsys, tmp_path):
    path = tmp_path / "conv.json"
    bench_conv.main(
        ["--quick", "--repeats", "1", "--variants", "gemm,grid,winograd2,winograd4", "--model", "--json", str(path)]
    )
    out = capsys.readouterr().out
    for column in ("time ours / torch", "ms (time vs torch)", "samples/s ours / torch"):  # the tables' legends
        assert f"\nlegend: {column}: " in out
    per_layer, chosen, totals, model = _tables(out)
    per_pass = {(r[0], r[1], r[2]): r for r in per_layer[1:]}
    # every layer and pass has gemm and grid; stride-1 layers also Winograd, strided ones not
    for name, _c, _co, _hw, stride, _count, _ in bench_conv.LAYERS:
        for pass_ in ("forward", "grad weight", "grad input"):
            assert (name, pass_, "gemm") in per_pass and (name, pass_, "grid") in per_pass
            assert ((name, pass_, "winograd4") in per_pass) == (stride == 1)
    # the choosing modes' picks are marked, exactly one row per mode and pass
    for mode in ("auto", "fast"):
        marked = [k for k, r in per_pass.items() if mode in r[3].split(", ")]
        assert len(marked) == 3 * len(bench_conv.LAYERS)
    assert per_pass[("64->64 8x8", "forward", "winograd2")][3] == "auto"
    assert per_pass[("64->64 8x8", "forward", "winograd4")][3] == "fast"
    assert per_pass[("16->32 32x32 s2", "forward", "grid")][3] == "auto, fast"
    assert per_pass[("16->32 32x32 s2", "grad input", "gemm")][3] == "auto, fast"
    # the summary of the picks: one row per layer and pass, naming the same algorithms
    assert len(chosen) == 1 + 3 * len(bench_conv.LAYERS)
    picks = {(r[0], r[1]): (r[4], r[6]) for r in chosen[1:]}
    assert picks[("64->64 8x8", "grad input")] == ("winograd2", "winograd4")
    assert picks[("16->16 32x32", "forward")] == ("grid", "grid")
    assert [r[0] for r in totals[1:]][:2] == ["auto", "fast"]
    assert {r[0] for r in model[1:]} >= {"auto", "fast", "gemm"}
    assert "ResNet-20 training step, batch 4" in out
    saved = json.loads(path.read_text())
    assert saved["batch"] == 4 and saved["repeats"] == 1
    for r in saved["results"]:
        if r["variant"] != "torch":
            assert r["workspace_peak_bytes"] > 0  # every algorithm's workspace is counted
    assert set(saved["model"]) >= {"auto", "fast", "gemm"}
    assert set(saved["network_totals_s"]) >= {"auto", "fast"}


def test_bench_conv_limits_and_bad_arguments(capsys):
    bench_conv.main(["--quick", "--repeats", "1", "--layers", "5", "--variants", "grid", "--limits", "0,none"])
    out = capsys.readouterr().out
    variants = {r[2] for r in _tables(out)[0][1:]}
    assert {"grid ws<=0", "grid ws<=none"} <= variants
    for bad, msg in (
        (["--variants", "fft"], "unknown variant 'fft'"),
        (["--layers", "9"], "--layers: comma"),
        (["--limits", "4Q"], "bad workspace limit '4Q'"),
    ):
        with pytest.raises(SystemExit) as e:
            bench_conv.main(["--quick", *bad])
        assert e.value.code == 2 and msg in capsys.readouterr().err
