"""The trainer on a GPU: device choice per rank, one-line errors, host checkpoints, GPU memory logs.

Everything that needs no GPU runs everywhere (device selection against a stand-in CuPy,
the CLI error, checkpoints as host arrays, sums that stay on the device until a log
point). Tests marked ``gpu`` train on CuPy and are skipped cleanly without a device.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import types

import numpy as np
import pytest

import framework as fw
from framework import backend, memory
from trainers import trainer as trainer_mod
from trainers.checkpoint import list_checkpoints, load_checkpoint
from trainers.config import ConfigError
from trainers.logging import read_scalars
from trainers.trainer import Trainer, clip_grad_norm_, gpu_index, host_state, select_device

from .test_logging import accumulator
from .test_trainer import TINY, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MB = 2**20


# --- which GPU a process uses ---------------------------------------------------------------


def test_cuda_gives_each_local_rank_its_gpu_round_robin():
    assert [gpu_index("cuda", r, 4) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    assert [gpu_index("cuda", r, 1) for r in range(3)] == [0, 0, 0]


def test_an_explicit_index_is_the_same_gpu_for_every_rank():
    assert [gpu_index("cuda:1", r, 4) for r in range(4)] == [1, 1, 1, 1]
    assert gpu_index(" cuda:0 ", 3, 1) == 0


@pytest.mark.parametrize(
    "spec, count, fragments",
    [
        ("cuda:2", 2, ["device: cuda:2", "2 GPUs (cuda:0 to cuda:1)", "device: cuda"]),
        ("cuda:1", 1, ["1 GPU (cuda:0 to cuda:0)"]),
        ("cuda", 0, ["CUDA reports none", "device: cpu"]),
        ("cpu", 1, ["not a GPU"]),
    ],
)
def test_impossible_gpu_choices_are_config_errors(spec, count, fragments):
    with pytest.raises(ConfigError) as info:
        gpu_index(spec, 0, count)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert "\n" not in str(info.value)


@pytest.fixture
def stand_in_cupy(monkeypatch):
    """A CuPy with 4 GPUs that records what the trainer asks of it (no device needed)."""
    calls = []

    class Device:
        def __init__(self, index):
            self.index = index

        def use(self):
            calls.append(("use", self.index))

        def synchronize(self):
            calls.append(("synchronize", self.index))

    cp = types.SimpleNamespace(
        cuda=types.SimpleNamespace(Device=Device, runtime=types.SimpleNamespace(getDeviceCount=lambda: 4))
    )
    monkeypatch.setattr(backend, "cupy_module", lambda: cp)
    monkeypatch.setattr(memory, "enable_gpu_hook", lambda: calls.append(("hook",)))
    return calls


def test_select_device_sets_the_current_gpu_before_counting_its_memory(stand_in_cupy):
    dev = select_device("cuda", local_rank=6)
    assert dev == fw.device("cuda:2")
    assert stand_in_cupy == [("use", 2), ("hook",)]  # the device first, then the pool hook
    trainer_mod.synchronize(dev)
    assert stand_in_cupy[-1] == ("synchronize", 2)
    assert select_device("cuda:3", local_rank=0) == fw.device("cuda:3")


def test_select_device_cpu_never_touches_cupy(monkeypatch):
    def boom():
        raise AssertionError("CuPy was looked up for device: cpu")

    monkeypatch.setattr(backend, "cupy_module", boom)
    assert select_device("cpu", local_rank=3) == fw.device("cpu")
    trainer_mod.synchronize(fw.device("cpu"))  # a no-op


@pytest.mark.parametrize(
    "installed, fragment",
    [
        (False, "CuPy is not installed: pip install -e '.[gpu]'"),
        (True, "CuPy sees no usable GPU"),
    ],
)
def test_cuda_without_a_usable_gpu_is_one_config_error(monkeypatch, installed, fragment):
    monkeypatch.setenv(backend.CUPY_ENV, "cupy")  # the real CuPy's messages, whatever the suite runs on
    monkeypatch.setattr(backend, "cupy_module", lambda: None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if installed else None)
    with pytest.raises(ConfigError) as info:
        select_device("cuda:0")
    msg = str(info.value)
    assert msg.startswith("device: cuda:0 needs CuPy and a CUDA GPU, but ") and fragment in msg
    assert msg.endswith("or set device: cpu") and "\n" not in msg


def test_trainer_picks_the_gpu_of_its_local_rank_before_building_anything(tmp_path, monkeypatch):
    seen = {}

    class Stop(Exception):
        pass

    def fake_select(spec, local_rank=0):
        seen["args"] = (spec, local_rank)
        raise Stop

    def no_data(cfg):
        raise AssertionError("data built before the device was chosen")

    monkeypatch.setattr(trainer_mod, "select_device", fake_select)
    monkeypatch.setattr(trainer_mod, "build_data", no_data)
    comm = types.SimpleNamespace(size=1, rank=0, local_rank=3, local_size=4, is_main=True)
    with pytest.raises(Stop):
        Trainer(tiny_config(tmp_path, "device=cuda"), comm=comm)
    assert seen["args"] == ("cuda", 3)


def test_cli_device_cuda_without_a_gpu_is_one_line_and_exit_code_2(tmp_path, without_cupy):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "train.py"),
            "--config",
            str(path),
            "--set",
            "device=cuda",
            "--set",
            f"logging.logdir={tmp_path / 'runs'}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 2, (r.returncode, r.stderr)  # as every other bad input (trainers/cli.py)
    assert r.stderr.splitlines() == [r.stderr.strip()], r.stderr  # one line, no traceback
    assert r.stderr.startswith("error: device: cuda needs CuPy and a CUDA GPU, but ")
    assert not (tmp_path / "runs").exists()  # nothing was started


# --- host checkpoints and device-side sums (CPU) ----------------------------------------------


def test_host_state_turns_tensors_into_numpy_arrays_everywhere():
    t = fw.randn(3)
    state = {"a": t, "nested": {"list": [t, 1], "tuple": (t, "x")}, "arr": np.zeros(2), "n": 5}
    out = host_state(state)
    assert isinstance(out["a"], np.ndarray) and np.array_equal(out["a"], np.asarray(t))
    assert isinstance(out["nested"]["list"][0], np.ndarray) and out["nested"]["list"][1] == 1
    assert isinstance(out["nested"]["tuple"], tuple) and out["nested"]["tuple"][1] == "x"
    assert out["arr"] is state["arr"] and out["n"] == 5


def test_checkpoints_hold_host_numpy_arrays_only(tmp_path):
    result = Trainer(tiny_config(tmp_path, "model.args.dropout=0.0")).fit()
    path = list_checkpoints(str(tmp_path / "ckpt" / "tiny" / "inplace-auto_np1"))[-1][1]
    state = load_checkpoint(path)

    def arrays(obj):
        if isinstance(obj, dict):
            for v in obj.values():
                yield from arrays(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from arrays(v)
        elif hasattr(obj, "shape"):
            yield obj

    found = list(arrays({"model": state["model"], "optimizer": state["optimizer"]}))
    assert found and all(type(a) is np.ndarray for a in found)  # no Tensor, no device array
    assert result.steps == 8


def test_accuracy_summed_on_the_device_matches_per_step_logging(tmp_path):
    """train/accuracy is read once per log point from a device-side sum: logging every 2
    steps must give the mean of logging every step, pairwise (same batches, same seen)."""
    every1 = Trainer(_config(tmp_path / "a", "train.log_every=1", "model.args.dropout=0.0")).fit()
    every2 = Trainer(_config(tmp_path / "b", "train.log_every=2", "model.args.dropout=0.0")).fit()
    acc1 = [v for _, v in read_scalars(every1.run_dir)["train/accuracy"]]
    acc2 = [v for _, v in read_scalars(every2.run_dir)["train/accuracy"]]
    assert len(acc1) == 8 and len(acc2) == 4
    np.testing.assert_allclose(acc2, [(acc1[i] + acc1[i + 1]) / 2 for i in range(0, 8, 2)], rtol=1e-6)
    assert all(0 <= a <= 1 for a in acc1) and every1.losses == every2.losses


def test_clip_grad_norm_reads_the_norm_once_and_matches_the_reference():
    fw.manual_seed(0)
    params = [fw.randn(5, 3, requires_grad=True), fw.randn(4, requires_grad=True), fw.randn(2, requires_grad=True)]
    for p in params[:2]:
        (p * 3.0).sum().backward()
    ref = math.sqrt(sum(float((np.asarray(p.grad, np.float64) ** 2).sum()) for p in params[:2]))
    before = [np.asarray(p.grad).copy() for p in params[:2]]
    total = clip_grad_norm_(params, max_norm=1.0)  # the third has no grad
    assert total == pytest.approx(ref, rel=1e-12)
    for b, p in zip(before, params[:2]):
        np.testing.assert_allclose(np.asarray(p.grad), b / (ref + 1e-6), rtol=1e-6)
    assert clip_grad_norm_([fw.randn(2, requires_grad=True)], 1.0) == 0.0


def test_cpu_breakdown_sums_to_the_counter_and_holds_the_step_state(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "model.args.dropout=0.0", "train.log_every=4"))
    result = trainer.fit()
    _check_memory_logs(result, param_bytes=sum(p.nbytes for p in trainer.params), exact_sum=True)


def _config(directory, *overrides):
    directory.mkdir(parents=True, exist_ok=True)
    return tiny_config(directory, *overrides)


def _check_memory_logs(result, param_bytes: int, exact_sum: bool) -> None:
    """What the category breakdown at every log point must satisfy (CPU and GPU alike).

    At a log point, after a step: every parameter's gradient and its momentum buffer are
    alive (SGD, momentum 0.9), and the parameters themselves. Other tests in the process
    may keep tensors alive, so those are lower bounds. On the CPU the categories ARE the
    counter, so they sum to allocated_mb; on a GPU they are tracked arrays at nbytes and
    sum to at most the pool's allocated_mb.
    """
    s = read_scalars(result.run_dir)
    cats = [f"memory/{c}_mb" for c in memory.CATEGORIES]
    for i, (step, allocated) in enumerate(s["memory/allocated_mb"]):
        values = {c: s[c][i][1] for c in cats}
        assert all(s[c][i][0] == step for c in cats)
        total = sum(values.values())
        if exact_sum:
            assert total == pytest.approx(allocated, rel=1e-5)
        else:
            assert total <= allocated * (1 + 1e-5)
        assert values["memory/parameters_mb"] * MB >= param_bytes * (1 - 1e-6)
        assert values["memory/gradients_mb"] * MB >= param_bytes * (1 - 1e-6)
        assert values["memory/optimizer_state_mb"] * MB >= param_bytes * (1 - 1e-6)
        assert s["memory/peak_mb"][i][1] >= s["memory/floor_mb"][i][1] * 0.5 > 0


# --- on a GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_run_logs_the_pool_hook_peak_and_a_sensible_breakdown(tmp_path, gpu_run, cupy):
    cfg = tiny_config(
        tmp_path,
        "device=cuda",
        "model.args.dropout=0.0",
        "train.log_every=2",
        "train.eval_every=100",
        "checkpoint.every=4",
    )
    trainer = Trainer(cfg)
    assert trainer.device.type == "cuda" and memory.gpu_hook_enabled()
    assert all(p.device == trainer.device for p in trainer.model.parameters())
    assert cupy.cuda.Device().id == trainer.device.index  # made current before allocating
    counter = memory.gpu_counter()
    step_peaks = []
    original = trainer._train_step

    def recording_step(*args):
        out = original(*args)
        step_peaks.append(counter.peak)  # the hook's peak of this step (reset before it)
        return out

    trainer._train_step = recording_step
    result = trainer.fit()
    logged = read_scalars(result.run_dir)["memory/peak_mb"]
    assert [s for s, _ in logged] == [2, 4, 6, 8]
    expected = [max(step_peaks[i : i + 2]) / MB for i in range(0, 8, 2)]
    np.testing.assert_allclose([v for _, v in logged], expected, rtol=1e-6)  # float32 in the event file
    assert result.peak_mb == pytest.approx(max(step_peaks) / MB)
    # The hook's total is the pool's in-use bytes (one thread, one device).
    assert memory.allocated_bytes("cuda") == cupy.get_default_memory_pool().used_bytes()
    _check_memory_logs(result, param_bytes=sum(p.nbytes for p in trainer.params), exact_sum=False)
    # The memory timeline of one step is the pool's: every malloc and free, in the step's phases.
    tl = result.timeline
    assert tl.device == "cuda" and {"forward", "backward", "optimizer"} <= {e[4] for e in tl.events}
    assert all(e[2] % 512 == 0 for e in tl.events)  # pool blocks, never NumPy buffer sizes
    assert accumulator(result.run_dir).Tags()["images"] == ["memory/timeline"]


@pytest.mark.gpu
def test_gpu_checkpoint_is_host_numpy_and_resume_loads_onto_the_device(tmp_path, gpu_run):
    cfg = ("device=cuda", "model.args.dropout=0.0")  # dropout masks come from CuPy's stream: not in checkpoints
    full = Trainer(tiny_config(tmp_path, *cfg)).fit()
    first = list_checkpoints(str(tmp_path / "ckpt" / "tiny" / "inplace-auto_np1"))[0][1]
    state = load_checkpoint(first)
    assert all(type(v) is np.ndarray for v in state["model"].values())
    resumed = Trainer(tiny_config(tmp_path, *cfg), resume=first)
    assert resumed.step == 4
    for name, p in resumed.model.state_dict().items():
        assert p.device == resumed.device
        np.testing.assert_array_equal(backend.to_numpy(p._data), state["model"][name])
    np.testing.assert_allclose(resumed.fit().losses, full.losses[4:], rtol=1e-5)


@pytest.mark.gpu
def test_gpu_and_cpu_runs_agree(tmp_path, gpu_run):
    cpu = Trainer(_config(tmp_path / "cpu", "model.args.dropout=0.0")).fit()
    gpu = Trainer(_config(tmp_path / "gpu", "device=cuda", "model.args.dropout=0.0")).fit()
    np.testing.assert_allclose(gpu.losses, cpu.losses, rtol=1e-3)  # cuBLAS vs BLAS summation order
    assert gpu.eval_metric == pytest.approx(cpu.eval_metric, abs=0.02)


@pytest.mark.gpu
def test_gpu_steps_read_nothing_back_and_the_losses_are_read_at_log_points(tmp_path, gpu_run):
    if backend.cupy_choice() != "standin":
        pytest.skip("host synchronizations are counted on the CuPy stand-in only")
    from framework.testing.cupy_standin import counting

    cfg = ("model.args.dropout=0.0", "train.log_every=4", "checkpoint.every=0")
    trainer = Trainer(_config(tmp_path / "gpu", "device=cuda", *cfg))
    step_syncs, reads = [], []
    original_step, original_read = trainer._train_step, trainer._read_losses

    def counted_step(*args):
        with counting.count() as c:
            out = original_step(*args)
        step_syncs.append(c.host_syncs)
        return out

    def counted_read(pending):
        with counting.count() as c:
            values = original_read(pending)
        reads.append((trainer.step, len(values), c.host_syncs))
        return values

    trainer._train_step, trainer._read_losses = counted_step, counted_read
    gpu = trainer.fit()
    assert step_syncs == [0] * 8
    assert [(step, n) for step, n, _ in reads if n] == [(4, 4), (8, 4)]  # each window's losses at its log point
    assert all(syncs == 1 for _, n, syncs in reads if n)  # in one transfer
    cpu = Trainer(_config(tmp_path / "cpu", *cfg)).fit()
    assert len(gpu.losses) == 8
    np.testing.assert_allclose(gpu.losses, cpu.losses, rtol=1e-3)
    logged = [v for _, v in read_scalars(gpu.run_dir)["train/loss"]]
    np.testing.assert_allclose(logged, [np.mean(gpu.losses[:4]), np.mean(gpu.losses[4:])], rtol=1e-6)
    assert gpu.final_loss == pytest.approx(logged[-1], rel=1e-6)  # train/loss at the last log point


@pytest.mark.gpu
def test_a_non_finite_loss_on_the_gpu_is_reported_at_the_log_point_with_its_step(tmp_path, gpu_run):
    cfg = _config(
        tmp_path,
        "device=cuda",
        "optim.lr=1e6",
        "schedule.name=none",
        "model.args.dropout=0.0",
        "train.max_steps=50",
        "train.log_every=4",
    )
    trainer = Trainer(cfg)
    with pytest.raises(trainer_mod.TrainingError) as info, np.errstate(over="ignore", invalid="ignore"):
        trainer.fit()
    msg = str(info.value)
    assert "on a GPU the loss is read at log points" in msg and "Lower optim.lr" in msg
    bad = int(msg.split(" at step ")[1].split(" ")[0])
    assert bad < trainer.step and trainer.step % cfg.train.log_every == 0  # found at the log point after it
    assert f"steps up to {trainer.step - 1} have applied their updates" in msg
