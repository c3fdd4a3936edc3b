"""benchmarks/bench_gpu.py: one clear line without a GPU, its report logic, its measurement path.

The measurement path is the one bench_models.py uses (``Runner``), so it runs here on the
CPU with tiny settings; the real run needs a GPU and is marked ``gpu``. No timing is
checked, only the shape of the results.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from benchmarks import bench_gpu, bench_models
from framework import backend, memory
from tests.conftest import requires_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINE = "error: bench_gpu.py needs CuPy and a CUDA GPU, and "


def test_without_a_gpu_the_script_fails_with_one_clear_line(without_cupy):
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.splitlines() == [r.stderr.strip()] and r.stderr.startswith(LINE), r.stderr
    assert "nothing was measured" in r.stderr


def test_main_reports_a_missing_gpu_before_measuring_anything(monkeypatch, capsys):
    monkeypatch.setattr(backend, "is_cuda_available", lambda: False)

    def boom(*args, **kwargs):
        raise AssertionError("measured without a GPU")

    monkeypatch.setattr(bench_gpu, "measure_ours", boom)
    assert bench_gpu.main(["--quick", "--no-torch"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(LINE) and err.count("\n") == 1


def test_bad_options_exit_with_a_message():
    with pytest.raises(SystemExit, match="MODEL=N"):
        bench_gpu.main(["--batch", "resnet20=0"])
    with pytest.raises(SystemExit, match="--rounds must be at least 1"):
        bench_gpu.main(["--rounds", "0"])
    with pytest.raises(SystemExit, match="cuda or cuda:N"):
        bench_gpu.main(["--device", "cpu"])
    assert bench_gpu.parse_batches(["mlp=64"]) == {"mlp": 64, "convnet": 256, "resnet20": 256}


def test_variants_and_models_come_from_bench_models():
    assert [v[0] for v in bench_gpu.variants()] == ["off", "on", "auto", "on+InPlaceABN", "compiled"]
    assert all(v in bench_models.VARIANTS for v in bench_gpu.variants()[:-1])
    assert bench_gpu.variants()[-1] == bench_gpu.COMPILED == ("compiled", "off", False)
    assert set(bench_gpu.GPU_MODELS) <= set(bench_models.MODELS)
    assert bench_gpu.BATCH["resnet20"] == 256


def test_measurement_path_runs_on_the_cpu():
    """measure_ours is bench_models' Runner plus synchronized rounds: run it tiny on the CPU."""
    p = {"warmup": 1, "mem_steps": 1, "rounds": 2, "steps": 1}
    syncs = []
    row = bench_gpu.measure_ours("mlp", bench_gpu.variants()[3], "cpu", 16, p, lambda: syncs.append(1))
    assert row["model"] == "mlp" and row["variant"] == "on+InPlaceABN" and row["batch"] == 16
    assert row["peak_mb"] > 0 and row["floor_mb"] > 0 and row["samples_per_s"] > 0
    assert len(row["round_seconds"]) == 2 and len(syncs) == 4  # before and after each round
    assert row["step_ms"] == pytest.approx(1e3 * statistics.median(row["round_seconds"]) / p["steps"])


def _rows(torch_peak=100.0, torch_speed=1000.0, batch=256):
    rows = []
    for variant, peak, speed in (("off", 150.0, 600.0), ("on", 140.0, 620.0), ("on+InPlaceABN", 90.0, 480.0)):
        rows.append(
            {
                "model": "resnet20",
                "batch": batch,
                "variant": variant,
                "framework": "ours",
                "peak_mb": peak,
                "samples_per_s": speed,
                "step_ms": 1e3 * batch / speed,
                "floor_mb": 50.0,
                "activation_mb": 80.0,
            }
        )
    if torch_peak is not None:
        rows.append(
            {
                "model": "resnet20",
                "batch": batch,
                "variant": "PyTorch",
                "framework": "torch",
                "peak_mb": torch_peak,
                "samples_per_s": torch_speed,
                "step_ms": 1e3 * batch / torch_speed,
            }
        )
    return rows


def test_targets_compare_resnet20_with_pytorch():
    t = bench_gpu.targets(_rows())
    assert [x["target"] for x in t] == [
        "ResNet-20 batch 256: peak GPU MB, on+InPlaceABN / PyTorch <= 1",
        "ResNet-20 batch 256: samples/s, on / PyTorch >= 0.5",
        "ResNet-20 batch 256: samples/s, on+InPlaceABN / PyTorch >= 0.5",
    ]
    assert [x["value"] for x in t] == pytest.approx([0.9, 0.62, 0.48])
    assert [x["met"] for x in t] == [True, True, False]
    t = bench_gpu.targets(_rows(torch_peak=80.0))
    assert t[0]["met"] is False


def test_targets_without_pytorch_are_not_checked_and_say_so():
    results = {"rows": _rows(torch_peak=None)}
    results["targets"] = bench_gpu.targets(results["rows"])
    assert all(x["met"] is None and x["value"] is None for x in results["targets"])
    text = bench_gpu.markdown(results)
    assert "| - | not checked |" in text
    assert bench_gpu.targets([]) == []
    assert "(the target is set at 256)" in bench_gpu.targets(_rows(batch=128))[0]["target"]


def test_markdown_table_has_a_row_per_variant_and_the_pytorch_ratios():
    results = {"rows": _rows()}
    results["targets"] = bench_gpu.targets(results["rows"])
    lines = bench_gpu.markdown(results).splitlines()
    rows = [line for line in lines if line.startswith("| resnet20 |")]
    assert len(rows) == 4
    abn = [c.strip() for c in rows[2].strip("|").split("|")]
    assert abn[:7] == ["resnet20", "256", "on+InPlaceABN", "90.0", "0.90", "480", "0.48"]
    torch_row = [c.strip() for c in rows[3].strip("|").split("|")]
    assert torch_row[3:5] == ["100.0", "-"]
    assert "| ResNet-20 batch 256: samples/s, on+InPlaceABN / PyTorch >= 0.5 | 0.4800 | NO |" in lines


@pytest.mark.parametrize("model", ["mlp", "convnet", "resnet20"])
def test_pytorch_twins_have_the_same_parameters(model, torch):
    from models import build_model

    reg, kw, _, _, _ = bench_models.MODELS[model]
    ours = sum(p.numel() for p in build_model(reg, **kw).parameters())
    theirs = sum(p.numel() for p in bench_models.torch_model(model).parameters())
    assert ours == theirs


# The --quick path with small batches: the code path is the same at any batch, and the
# CuPy stand-in computes with NumPy on the CPU, where batch 256 would take minutes.
SMALL_BATCHES = ["--batch", "mlp=16", "--batch", "convnet=16", "--batch", "resnet20=8"]


@pytest.mark.gpu
@pytest.mark.slow
def test_quick_run_on_a_gpu(tmp_path, capsys):
    from framework import memory

    path = tmp_path / "gpu.json"
    assert bench_gpu.main(["--quick", *SMALL_BATCHES, "--json", str(path)]) == 0
    assert memory.gpu_counter() is None  # the hook is gone: later tests read host memory
    out = capsys.readouterr().out
    saved = json.loads(path.read_text())
    ours = [r for r in saved["rows"] if r["framework"] == "ours"]
    assert {(r["model"], r["variant"]) for r in ours} == {
        (m, v[0]) for m in bench_gpu.GPU_MODELS for v in bench_gpu.variants()
    }
    (comp,) = [r for r in ours if r["model"] == "resnet20" and r["variant"] == "compiled"]
    # the batch is uploaded into the graph's input slots (CompiledStep.upload): no copy-in,
    # the scalars' one host-to-device copy, the graph, the loss copied out
    assert comp["replay_mode"] == "cuda graph" and comp["replay_launches"] == 3
    # nothing is allocated while the graph replays: the pool's peak is the plan's, but for
    # the few blocks the pool rounds (and the copied-out loss)
    assert comp["peak_mb"] == pytest.approx(comp["planned_peak_mb"], rel=0.01)
    assert all(r["peak_mb"] > 0 and r["samples_per_s"] > 0 for r in ours)
    assert saved["targets"] and "| target | value | met |" in out
    if saved["env"]["cupy_choice"] == "standin":  # counted; real CuPy without --count says it did not count
        assert all(r["launches_per_step"] > 0 and r["host_syncs_per_step"] >= 0 for r in ours)
    else:
        assert saved["counts"] == bench_gpu.NOT_COUNTED and all(r["launches_per_step"] is None for r in ours)
    if saved["torch_missing"] is None:
        assert {r["model"] for r in saved["rows"] if r["framework"] == "torch"} == set(bench_gpu.GPU_MODELS)


def test_the_default_run_is_small():
    """A real GPU did not finish the old default (7 rounds of 20 steps per variant) in 150 s."""
    steps = lambda p: p["warmup"] + p["mem_steps"] + p["rounds"] * p["steps"]  # noqa: E731
    assert steps(bench_gpu.DEFAULT) <= 20 and steps(bench_gpu.QUICK) < steps(bench_gpu.DEFAULT)
    assert steps(bench_gpu.FULL) > steps(bench_gpu.DEFAULT)
    with pytest.raises(SystemExit):
        bench_gpu.main(["--quick", "--full"])


def test_counting_needs_the_standin(monkeypatch):
    monkeypatch.setattr(bench_gpu, "counts_here", lambda: False)
    with pytest.raises(RuntimeError, match="counting needs the CuPy stand-in"):
        bench_gpu.count_training_step("mlp")
    with pytest.raises(SystemExit, match="quickstart is for --count-only"):
        bench_gpu.main(["--models", "quickstart"])


@pytest.mark.gpu
@requires_gpu
def test_a_step_is_counted_on_the_standin(tmp_path):
    """Each row carries launches and host syncs per step (and by kind), counted on the stand-in."""
    if not bench_gpu.counts_here():
        pytest.skip("counted on the CuPy stand-in only")
    p = {"warmup": 1, "mem_steps": 1, "rounds": 1, "steps": 1}
    with memory.gpu_hook():
        row = bench_gpu.measure_ours("mlp", bench_gpu.variants()[1], "cuda", 16, p, lambda: None)
    c = bench_gpu.count_training_step("mlp", "on", 16)
    assert row["launches_per_step"] == c.launches > 0 and row["host_syncs_per_step"] == c.host_syncs
    assert row["launches_by_kind"] == c.by_kind() and sum(c.by_kind().values()) == c.launches
    assert row["host_syncs_by_kind"] == c.by_kind(syncs=True)
    # three linear layers, forward and backward: through the cuDNN frontend's matmul where it
    # is installed (its stand-in here), else CuPy's cuBLAS
    from framework import backend

    assert c.by_kind()["cudnn" if backend.cudnn_module() is not None else "matmul"] >= 6
    out = tmp_path / "counts.json"
    assert bench_gpu.main(["--count-only", "--models", "quickstart", "--json", str(out)]) == 0
    (q,) = json.loads(out.read_text())["rows"]
    assert q["model"] == "quickstart" and q["batch"] == 32 and q["launches_per_step"] > 0
    assert sum(q["launches_by_kind"].values()) == q["launches_per_step"]
    assert sum(q["host_syncs_by_kind"].values()) == q["host_syncs_per_step"]


def test_counts_for_a_real_gpu_run_come_from_the_standin_in_a_subprocess():
    counts = bench_gpu.counts_on_standin(["mlp"], {"mlp": 8})
    assert set(counts) == {("mlp", v[0]) for v in bench_gpu.variants()}
    for fields in counts.values():
        assert fields["launches_per_step"] == sum(fields["launches_by_kind"].values()) > 0


def test_without_counts_the_report_says_so():
    rows = _rows()
    rows[0].update(launches_per_step=120, host_syncs_per_step=0)
    table = bench_gpu.markdown({"rows": rows, "targets": []})
    assert "| launches/step | host syncs/step |" in table
    assert table.splitlines()[2].endswith("| 120 | 0 |") and table.splitlines()[3].endswith("| - | - |")


def _compiled_row(batch, speed, peak, mode="cuda graph"):
    return {
        "model": "resnet20",
        "batch": batch,
        "variant": "compiled",
        "framework": "ours",
        "peak_mb": peak,
        "samples_per_s": speed,
        "step_ms": 1e3 * batch / speed,
        "replay_mode": mode,
        "replay_launches": 5 if mode == "cuda graph" else None,
    }


def test_compiled_targets_by_batch_against_pytorch_eager_and_eager_auto():
    rows = [r for r in _rows(batch=64) if r["variant"] != "on"] + [_compiled_row(64, 1600.0, 90.0)]
    rows.append({**rows[0], "variant": "auto", "peak_mb": 100.0})
    t = bench_gpu.compiled_targets(rows)
    assert [x["target"] for x in t] == [
        "ResNet-20 batch 64: samples/s, compiled / PyTorch eager >= 1.5 (goal 2.5)",
        "ResNet-20 batch 64: peak GPU MB, compiled / eager auto <= 1.0",
        "ResNet-20 batch 64: a replayed step is one graph launch + copies (cuda graph)",
    ]
    assert [x["value"] for x in t] == pytest.approx([1.6, 0.9, 5])
    assert [x["met"] for x in t] == [True, True, True]
    rows[-2] = _compiled_row(256, 900.0, 110.0, mode="uncaptured: node 3 could not be captured")
    rows = [{**r, "batch": 256} for r in rows]
    t = bench_gpu.compiled_targets(rows)
    assert t[0]["target"].endswith(">= 1.0 (goal 1.3)") and [x["met"] for x in t] == [False, False, False]
    assert bench_gpu.compiled_targets(_rows()) == []  # no compiled row


@pytest.mark.gpu
@requires_gpu
def test_the_compiled_step_is_counted_after_its_graph_is_captured():
    if not bench_gpu.counts_here():
        pytest.skip("counted on the CuPy stand-in only")
    c = bench_gpu.count_training_step("mlp", "compiled", 16)
    # the batch is in the graph's input slots (uploaded there before): the scalars, the
    # graph, the loss out
    assert c.by_kind() == {"copy": 1, "h2d": 1, "graph": 1} and c.host_syncs == 0
