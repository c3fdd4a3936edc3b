"""Trainer.fit on a signal, in this process: stop after the step in flight, checkpoint, resume exactly.

The process signals itself from inside a step (a real signal, a real handler), so the
test knows which step the run must stop after. The CLI and mpiexec: tests/scripts/test_interrupt.py.
"""

import gc
import os
import signal
import threading

import numpy as np
import pytest

from tests.trainers.test_trainer import accumulator, comparable, tiny_config
from trainers.checkpoint import list_checkpoints, load_checkpoint
from trainers.interrupt import StopSignals
from trainers.logging import read_scalars
from trainers.trainer import Interrupted, Trainer

COMMON = ("checkpoint.every=0", "train.max_steps=10", "train.log_every=3", "train.eval_every=4")


@pytest.fixture
def signal_at(monkeypatch):
    """``signal_at(signum, step, times=1)``: during ``step`` (1-based) the process sends itself ``signum``."""

    def arm(signum, step, times=1):
        original = Trainer._train_step

        def step_then_signal(self, x, y, lr):
            out = original(self, x, y, lr)
            if self.step + 1 == step:
                for _ in range(times):
                    os.kill(os.getpid(), signum)
            return out

        monkeypatch.setattr(Trainer, "_train_step", step_then_signal)

    return arm


def params(trainer):
    return [p.detach().numpy().copy() for p in trainer.model.parameters()]


@pytest.mark.parametrize(
    "name, at",
    [
        ("SIGINT", 5),
        ("SIGTERM", 7),
        pytest.param("SIGUSR1", 2, marks=pytest.mark.skipif(os.name != "posix", reason="")),
    ],
)
def test_a_signal_stops_after_the_step_and_a_resume_is_the_run_never_stopped(tmp_path, signal_at, name, at):
    full_trainer = Trainer(tiny_config(tmp_path, *COMMON, "logging.run_name=full"))
    full = full_trainer.fit()
    full_params = params(full_trainer)
    del full_trainer  # memory/* counts every live array: one trainer at a time
    gc.collect()  # ... and one held by a reference cycle until the collector runs
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    signal_at(getattr(signal, name), at)
    cut = Trainer(tiny_config(tmp_path, *COMMON, "logging.run_name=cut"))
    with pytest.raises(Interrupted) as info:
        cut.fit()
    stop = info.value
    assert (stop.signum, stop.step, stop.total_steps) == (getattr(signal, name), at, 10)
    assert stop.exit_code == 128 + stop.signum
    assert stop.checkpoint.endswith(f"step_{at:08d}.npz") and os.path.isfile(stop.checkpoint)
    assert f"{name}: run cut stopped after step {at} of 10" in str(stop)
    assert {s: signal.getsignal(s) for s in before} == before  # the handlers live only while fit() runs
    assert [s for s, _ in list_checkpoints(str(tmp_path / "ckpt" / "tiny" / "cut"))] == [at]
    assert "summary/final_loss" not in read_scalars(cut.run_dir)  # the summary waits for the end

    del cut, info, stop
    gc.collect()
    resumed = Trainer(tiny_config(tmp_path, *COMMON, "logging.run_name=cut"), resume="auto")
    assert resumed.step == at
    second = resumed.fit()
    assert second.losses == full.losses[at:]  # dropout included: the random state is restored
    assert all(a.tobytes() == b.tobytes() for a, b in zip(params(resumed), full_params))
    got, want = read_scalars(second.run_dir), read_scalars(full.run_dir)
    assert comparable(got) == comparable(want)  # the open log window was in the checkpoint
    for tag in want:
        assert [s for s, _ in got[tag]] == [s for s, _ in want[tag]], tag
    # The summary of the whole run, not of its second part.
    for key in ("final_loss", "eval_metric", "peak_mb", "floor_mb", "auto_ops_per_step"):
        assert getattr(second, key) == getattr(full, key), key
    assert second.timeline is not None
    assert [e.step for e in accumulator(second.run_dir).Images("memory/timeline")] == [2]


def test_the_result_of_a_finished_run_comes_back_from_its_checkpoint(tmp_path):
    full = Trainer(tiny_config(tmp_path, *COMMON)).fit()
    again = Trainer(tiny_config(tmp_path, *COMMON), resume="auto")
    assert again.finished
    kept = again.result()
    for key in ("steps", "final_loss", "eval_metric", "peak_mb", "floor_mb", "samples_per_sec", "policy"):
        assert getattr(kept, key) == getattr(full, key), key
    assert kept.auto_ops_per_step == full.auto_ops_per_step and kept.timeline_floor_mb == full.timeline_floor_mb
    assert [e[:2] for e in kept.timeline["events"]] == [e[:2] for e in full.timeline.events]


def test_a_second_ctrl_c_stops_at_once_without_a_checkpoint(tmp_path, signal_at):
    signal_at(signal.SIGINT, 4, times=2)
    trainer = Trainer(tiny_config(tmp_path, *COMMON))
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    assert list_checkpoints(str(tmp_path / "ckpt" / "tiny" / "inplace-auto_np1")) == []


def test_a_signal_in_the_last_step_completes_the_run_then_stops(tmp_path, signal_at):
    signal_at(signal.SIGTERM, 10)
    trainer = Trainer(tiny_config(tmp_path, *COMMON))
    with pytest.raises(Interrupted, match=r"after step 10 of 10 \(the run is complete\)"):
        trainer.fit()
    assert "summary/final_loss" in read_scalars(trainer.run_dir)
    assert Trainer(tiny_config(tmp_path, *COMMON), resume="auto").finished


def test_a_signal_during_the_final_evaluation_finishes_it_then_stops_the_complete_run(tmp_path, monkeypatch, capfd):
    """Issue 41: a Ctrl-C during the final evaluation was taken for the next step's, which
    never came; the run went on to its end (and to the sample) as if nothing was pressed."""
    full = Trainer(tiny_config(tmp_path, *COMMON, "logging.run_name=full")).fit()
    evaluate = Trainer.evaluate

    def ctrl_c_in_the_final_evaluation(self):
        if self.step == self.total_steps:
            os.kill(os.getpid(), signal.SIGINT)
        return evaluate(self)

    monkeypatch.setattr(Trainer, "evaluate", ctrl_c_in_the_final_evaluation)
    cut = Trainer(tiny_config(tmp_path, *COMMON, "logging.run_name=cut"))
    with pytest.raises(Interrupted, match=r"after step 10 of 10 \(the run is complete\)") as info:
        cut.fit()
    assert (
        "SIGINT: finishing the run's final evaluation and summary, then writing a checkpoint" in capfd.readouterr().err
    )
    assert info.value.checkpoint.endswith("step_00000010.npz")
    # The final evaluation and the summary are logged, as in the run never stopped.
    assert comparable(read_scalars(cut.run_dir)) == comparable(read_scalars(full.run_dir))
    done = Trainer(tiny_config(tmp_path, *COMMON, "logging.run_name=cut"), resume="auto")
    assert done.finished and done.result().eval_metric == full.eval_metric


def test_a_checkpoint_of_another_number_of_processes_is_refused(tmp_path):
    from trainers.checkpoint import CheckpointError, write_checkpoint

    Trainer(tiny_config(tmp_path, *COMMON)).fit()
    path = list_checkpoints(str(tmp_path / "ckpt" / "tiny" / "inplace-auto_np1"))[-1][1]
    state = load_checkpoint(path)
    state["ranks"] = state["ranks"] * 2
    write_checkpoint(state, str(tmp_path / "two.npz"))
    with pytest.raises(CheckpointError, match="written by 2 processes, this run has 1; resume it with mpiexec -n 2"):
        Trainer(tiny_config(tmp_path, *COMMON), resume=str(tmp_path / "two.npz"))


def test_stop_signals_outside_the_main_thread_install_nothing():
    seen = []

    def run():
        with StopSignals(announce=False) as signals:
            seen.append(signals._previous == {})

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [True]


@pytest.mark.gpu
def test_on_a_gpu_the_losses_of_the_steps_since_the_last_log_point_are_read_before_the_checkpoint(
    tmp_path, signal_at, gpu_run
):
    common = (*COMMON, "device=cuda", "model.args.dropout=0.0")  # CuPy's dropout stream is not checkpointed
    full = Trainer(tiny_config(tmp_path, *common, "logging.run_name=full")).fit()
    signal_at(signal.SIGTERM, 5)  # between the log points 3 and 6: two losses still on the device
    with pytest.raises(Interrupted):
        Trainer(tiny_config(tmp_path, *common, "logging.run_name=cut")).fit()
    state = load_checkpoint(list_checkpoints(str(tmp_path / "ckpt" / "tiny" / "cut"))[-1][1])
    window = state["ranks"][0]["window"]
    assert window["steps"] == 2 and np.isfinite(window["loss"]) and window["loss"] > 0
    second = Trainer(tiny_config(tmp_path, *common, "logging.run_name=cut"), resume="auto").fit()
    np.testing.assert_allclose(second.losses, full.losses[5:], rtol=1e-6)
    got, want = read_scalars(second.run_dir), read_scalars(full.run_dir)
    assert [s for s, _ in got["train/loss"]] == [s for s, _ in want["train/loss"]]
    np.testing.assert_allclose([v for _, v in got["train/loss"]], [v for _, v in want["train/loss"]], rtol=1e-6)
