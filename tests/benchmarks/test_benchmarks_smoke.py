"""Smoke runs of the benchmarks: ``main(["--quick"])`` in-process prints the expected tables.

Only the shape of the output and the byte counts are checked, never timings (the
machine is shared and noisy; the numbers belong in docs/BENCHMARKS.md).
"""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_blas, bench_elementwise, bench_op_overhead, bench_winograd_stages, common


def _table_rows(text: str) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def _legend(text: str) -> dict[str, str]:
    """The legend lines every printed table ends with (``common.legend``): columns -> meaning."""
    lines = [line.removeprefix("legend: ") for line in text.splitlines() if line.startswith("legend: ")]
    return dict(line.split(": ", 1) for line in lines)


def test_op_overhead_quick(capsys, tmp_path):
    path = tmp_path / "overhead.json"
    payload = bench_op_overhead.main(["--quick", "--json", str(path)])
    out = capsys.readouterr().out
    first_cells = [r[0] for r in _table_rows(out)]
    for mode in (
        "forward + backward",
        "forward (grad on)",
        "forward (no_grad)",
        "NumPy forward kernels",
        "NumPy forward + backward kernels",
    ):
        assert mode in first_cells
    for kind in bench_op_overhead.MIX:
        assert kind in first_cells
    assert "Target: forward + backward <= 10 µs/op:" in out
    legend = _legend(out)
    assert "min minus the NumPy kernels" in legend["framework µs/op (share)"]
    assert "NumPy fwd, NumPy fwd+bwd" in legend
    assert "Machine: " in out
    saved = json.loads(path.read_text())
    assert saved["params"]["quick"] is True and saved["params"]["ops"] == 20
    assert set(saved["results"]) == set(payload["results"])
    for r in saved["results"].values():
        assert 0 < r["min_us_per_op"] <= r["median_us_per_op"]
    assert set(saved["machine"]) >= {"cpu", "cores", "python", "numpy", "date"}


def test_op_overhead_profile_option(capsys):
    bench_op_overhead.main(["--quick", "--ops", "10", "--repeats", "1", "--profile", "5"])
    out = capsys.readouterr().out
    assert "cProfile of forward + backward" in out and "tottime" in out


def test_elementwise_quick(capsys, tmp_path):
    path = tmp_path / "elementwise.json"
    payload = bench_elementwise.main(["--quick", "--json", str(path)])
    out = capsys.readouterr().out
    rows = _table_rows(out)
    pairs = {(r[0], r[1]) for r in rows if len(r) > 2}
    for op in ("add", "relu", "exp", "mul"):
        for variant in bench_elementwise.VARIANTS:
            assert (op, variant) in pairs
    assert ("add", "np inplace (control)") in pairs
    assert "Noise floor:" in out
    for name in ("x.add_(y)", "x.relu_()", "x.exp_()", "x.mul_(y)"):
        assert name in [r[0] for r in rows]
    assert "Target: x.add_(y) <= 1.15x raw NumPy:" in out
    assert {"vs np inplace", "ratio", "alloc/call"} <= set(_legend(out))
    saved = json.loads(path.read_text())
    size = saved["params"]["size"]
    assert size == 1 << 16
    for variants in saved["results"].values():
        # Bytes are exact, not timings: inplace allocates nothing, out of place one tensor.
        assert variants["fw inplace"]["allocated_bytes_counter"] == 0
        assert variants["fw out"]["allocated_bytes_counter"] == 4 * size
        assert variants["fw inplace"]["allocated_bytes_tracemalloc"] == 0
        assert variants["np inplace"]["allocated_bytes_tracemalloc"] == 0
        assert variants["np out"]["allocated_bytes_tracemalloc"] == 4 * size
        assert variants["np out"]["allocated_bytes_counter"] is None
    assert set(payload["inplace_over_raw"]) == {"add", "relu", "exp", "mul"}


def test_common_helpers():
    s = common.summarize([3.0, 1.0, 2.0])
    assert s == {"min": 1.0, "median": 2.0, "repeats": 3}
    calls = []
    times = common.interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=0)
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
    assert calls == ["a", "b", "b", "a", "a", "b"]  # the order rotates every round
    assert len(common.time_repeats(lambda: None, 4)) == 4
    table = common.markdown_table(["x", "y"], [[1, "2"]])
    assert table.splitlines() == ["| x | y |", "|---|---|", "| 1 | 2 |"]
    table = common.markdown_table(["x", "y"], [[1, "2"]], [("y", "what y is")])
    # a blank line ends the Markdown table before the legend
    assert table.splitlines()[3:] == ["", "legend: y: what y is"]
    assert common.legend([]) == ""
    info = common.machine_info()
    assert info["cores"] >= 1 and info["cpu"]
    assert info["blas"] != "unknown" and f"NumPy {info['numpy']} ({info['blas']})" in common.machine_line(info)


def test_repeats_must_be_positive():
    with pytest.raises(SystemExit):
        bench_elementwise.main(["--quick", "--repeats", "0"])


def test_logging_quick(capsys, tmp_path):
    from benchmarks import bench_logging

    path = tmp_path / "logging.json"
    assert bench_logging.main(["--quick", "--repeats", "1", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert {r[0] for r in _table_rows(out)} >= {"logging on", "logging off"}
    assert "Overhead of logging every 10 steps + progress bar:" in out
    assert {"wall s (min)", "time / no logging (median)", "min-max"} <= set(_legend(out))
    assert {"RunLogger (RecordWriter)", "FileWriter.add_summary", "SummaryWriter.add_scalar x 14"} <= {
        r[0] for r in _table_rows(out)
    }
    saved = json.loads(path.read_text())
    assert saved["steps"] == 60 and saved["calls"]["scalars_us"] > 0 and saved["calls"]["flush_ms"] > 0
    assert set(saved["writers"]["variants"]) == {
        "no logging",
        "RunLogger (RecordWriter)",
        "FileWriter.add_summary",
        "SummaryWriter.add_scalar x 14",
    }


def test_bench_auto_rewrites_temporaries_and_rebound_names_not_kept_ones(tmp_path, capsys):
    from benchmarks import bench_auto

    payload = bench_auto.main(["--quick", "--repeats", "1", "--json", str(tmp_path / "auto.json")])
    n = bench_auto.N
    assert payload["rewritten"] == {
        "temporary_chain/on": 0,
        "temporary_chain/auto": n,
        "rebound_chain/on": 0,
        "rebound_chain/auto": n,
        "named_chain/on": 0,
        "named_chain/auto": 0,
    }
    assert (tmp_path / "auto.json").exists()
    assert {"auto - on", "ops rewritten", "auto / on"} <= set(_legend(capsys.readouterr().out))


def test_consumed_check_quick(capsys, tmp_path):
    from benchmarks import bench_consumed_check

    path = tmp_path / "consumed.json"
    bench_consumed_check.main(["--quick", "--repeats", "2", "--json", str(path)])
    out = capsys.readouterr().out
    assert [r[0] for r in _table_rows(out)][1:] == ["forward", "fwd+bwd"]
    assert "budget 0.3 us per op" in out
    assert "check (min), check (median)" in _legend(out)
    saved = json.loads(path.read_text())
    for what in ("forward", "fwd+bwd"):
        assert {"checked_us_per_op", "unchecked_us_per_op", "check_us_per_op_median"} <= set(saved[what])
    from framework.autograd import function

    assert function._read_inputs is bench_consumed_check._checked  # the real one is back


def test_vs_pytorch_quick(capsys, tmp_path, torch):
    from benchmarks import bench_vs_pytorch

    path = tmp_path / "vs.json"
    bench_vs_pytorch.main(["--quick", "--repeats", "1", "--json", str(path)])
    out = capsys.readouterr().out
    assert [r[0] for r in _table_rows(out)][1:] == ["mlp", "resnet20", "resnet20_eval", "tiny"]
    saved = json.loads(path.read_text())
    assert set(saved["workloads"]) == {"mlp", "resnet20", "resnet20_eval", "tiny"} and saved["policy"] == "auto"
    assert saved["conv"] == "auto" and "conv2d auto" in out
    assert "PyTorch's" in _legend(out)["speed ratio"] and "spread" in _legend(out)
    bench_vs_pytorch.main(["--quick", "--repeats", "1", "--only", "resnet20", "--conv", "fast"])
    assert "conv2d fast" in capsys.readouterr().out


def test_resnet_breakdown_times_every_layer_and_restores_the_functions():
    """Runs without PyTorch: our side of the breakdown, on a small batch."""
    import collections

    from benchmarks import bench_resnet_breakdown as B
    from framework.ops import norm
    from framework.ops.conv_algorithms import ALGORITHMS

    before = {name: dict(vars(a)) for name, a in ALGORITHMS.items()}
    bn = (norm.BatchNorm.forward, norm.BatchNorm.backward)
    step = B.ours("resnet20", 4)
    acc = collections.defaultdict(float)
    with B.timed_ours(acc):
        step()
    layers = {"3->16 32x32", "16->16 32x32", "16->32 32x32 s2", "32->32 16x16", "32->64 16x16 s2", "64->64 8x8"}
    assert {k[0] for k in acc} == layers | {"batch norm"}
    for layer in layers:
        passes = {p for (name, p) in acc if name == layer}
        # the stem's input (the batch) needs no gradient
        assert passes == ({"forward", "grad_weight"} if layer.startswith("3->") else set(B.PASSES))
    assert all(t > 0 for t in acc.values())
    assert {name: dict(vars(a)) for name, a in ALGORITHMS.items()} == before
    assert (norm.BatchNorm.forward, norm.BatchNorm.backward) == bn


def test_resnet_breakdown_quick(capsys, torch):
    from benchmarks import bench_resnet_breakdown

    bench_resnet_breakdown.main(["--quick"])
    out = capsys.readouterr().out
    rows = _table_rows(out)
    assert "ours / PyTorch" in _legend(out)
    names = [r[0] for r in rows][1:]
    assert names[0] == "3->16 32x32" and names[-2:] == ["whole step, split as above", "**whole step as it runs**"]
    assert {"**all convolutions**", "batch norm (19 layers)", "everything else"} <= set(names)


def test_blas_quick(capsys, tmp_path):
    path = tmp_path / "blas.json"
    bench_blas.main(["--quick", "--json", str(path)])
    out = capsys.readouterr().out
    rows = _table_rows(out)
    assert rows[0] == ["product", "shape", "ms per call (min)", "GFLOP/s"]
    assert [r[0] for r in rows[1:]] == [what for what, *_ in bench_blas.QUICK_SHAPES]
    assert common.blas_kernels() in out  # the kernels that ran are on the record
    assert set(_legend(out)) == {"ms per call (min)", "GFLOP/s"}
    saved = json.loads(path.read_text())
    assert saved["repeats"] == 3 and all(r["gflops"] > 0 for r in saved["results"])


def test_winograd_stages_quick(capsys, tmp_path):
    path = tmp_path / "stages.json"
    bench_winograd_stages.main(["--quick", "--json", str(path)])  # raises if its steps are not conv2d's forward
    out = capsys.readouterr().out
    rows = _table_rows(out)
    assert rows[0][:2] == ["layer", "algorithm"] and rows[0][-3:] == ["total ms", "products GFLOP/s", "PyTorch ms"]
    assert [r[1] for r in rows[1:]] == ["winograd2", "winograd4"] * len(bench_winograd_stages.QUICK_LAYERS)
    assert "PyTorch ms" in _legend(out)
    assert common.blas_kernels() in out
    saved = json.loads(path.read_text())
    for r in saved["results"]:
        assert set(r["ms"]) == set(bench_winograd_stages.STEPS)
        assert r["total_ms"] == pytest.approx(sum(r["ms"].values()))
        assert r["chunks"] >= 1


def test_mlp_breakdown_quick(capsys, tmp_path, torch):
    from benchmarks import bench_mlp_breakdown as B

    path = tmp_path / "mlp.json"
    assert B.main(["--quick", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    parts = [line.split("|")[1].strip() for line in out.splitlines()[2:]]
    assert parts == ["step", "forward", "backward", "optimizer", "gemm", "rest"]
    saved = json.loads(path.read_text())
    for side in ("ours", "pytorch"):
        assert all(saved[side][p] > 0 for p in B.PARTS)
        assert saved[side]["rest"] == saved[side]["step"] - saved[side]["gemm"]
    # the products of a 3-layer MLP: 3 forward, 3 weight gradients, 2 input gradients
    assert [w for w, *_ in B._gemm_shapes(64, B.SIZES)].count("input grad") == 2
    assert len(B._gemm_shapes(64, B.SIZES)) == 8


@pytest.mark.mpi
def test_stop_signal_quick(tmp_path):
    """Under mpiexec -n 2 (the benchmark launches itself): the table and the JSON of its three variants."""
    import subprocess
    import sys

    from tests.mpi_util import REPO, find_mpiexec, worker_env

    if find_mpiexec() is None:
        pytest.skip("needs mpiexec")
    path = tmp_path / "stop.json"
    script = REPO / "benchmarks" / "bench_stop_signal.py"
    r = subprocess.run(
        [sys.executable, str(script), "--quick", "--json", str(path)],
        capture_output=True,
        text=True,
        env=worker_env(),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    cells = [row[0] for row in _table_rows(r.stdout)]
    assert cells == [
        "what",
        "agreement alone, µs per call",
        "step, without, ms",
        "step, blocking, ms",
        "step, nonblocking, ms",
    ]
    assert "StopAgreement" in _legend(r.stdout)["step"]
    saved = json.loads(path.read_text())
    assert set(saved["results"]["extra_us_per_step"]) == {"blocking", "nonblocking"}
    assert saved["params"]["ranks"] == 2


def test_add_scaled_quick(capsys, tmp_path):
    from benchmarks import bench_add_scaled

    path = tmp_path / "add_scaled.json"
    bench_add_scaled.main(["--quick", "--json", str(path)])
    rows = _table_rows(capsys.readouterr().out)
    assert rows[0][:3] == ["parameters", "elements", "axpy ms (min)"]
    saved = json.loads(path.read_text())
    (r,) = saved["results"]
    assert r["elements"] == bench_add_scaled.QUICK_SIZES[0][1] and r["axpy_s"] > 0 and r["add_scaled_s"] > 0
    assert r["add_scaled_bits_moved"] == 0  # two roundings: an element's bits do not depend on its place
