"""A run killed (SIGKILL) after a checkpoint and resumed shows, in TensorBoard, every logged
point exactly once, with the values of a run that was never stopped."""

import os
import signal
import subprocess
import sys
import time

import pytest

from trainers.logging import read_scalars

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 1000

CONFIG = f"""\
experiment: resume
seed: 5
inplace: on
threads: 1
data: {{name: digits, batch_size: 32}}
model: {{name: mlp, args: {{hidden: [64], dropout: 0.1}}}}
optim: {{name: sgd, lr: 0.05, momentum: 0.9}}
schedule: {{name: cosine, warmup_steps: 20}}
train: {{epochs: 100, max_steps: {STEPS}, log_every: 10, eval_every: 50}}
logging: {{progress: false}}
checkpoint: {{every: 50, keep: 100}}
"""


def command(config, *args):
    return [sys.executable, os.path.join(ROOT, "scripts", "train.py"), "--config", str(config), *args]


def train(tmp_path, config, *args):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(command(config, *args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r


def comparable(scalars):
    """What a rerun reproduces bit for bit: not timings, not live memory (garbage collection)."""
    return {
        tag: points
        for tag, points in scalars.items()
        if tag.startswith(("train/", "eval/", "inplace/", "summary/final", "summary/eval"))
    }


def assert_same_points(got, want):
    assert sorted(got) == sorted(want)
    for tag in want:
        steps = [s for s, _ in got[tag]]
        assert steps == [s for s, _ in want[tag]], tag  # every point, each once
    assert comparable(got) == comparable(want)


def timeline_steps(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"images": 0})
    acc.Reload()
    return [e.step for e in acc.Images("memory/timeline")]


def test_sigkill_after_a_checkpoint_then_resume_logs_every_point_once(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG)
    train(tmp_path, config, "--set", "logging.run_name=full")
    want = read_scalars(tmp_path / "runs" / "resume" / "full")
    assert [s for s, _ in want["train/loss"]] == list(range(10, STEPS + 1, 10))

    # Kill the run as soon as its second checkpoint exists (far from the end): the points
    # up to it were flushed before it was written; later ones may be lost or half written.
    ckpts = tmp_path / "checkpoints" / "resume" / "cut"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        command(config, "--set", "logging.run_name=cut"),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    while not (ckpts / "step_00000100.npz").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run ended or stalled before its checkpoint at step 100: {proc.stderr.read()}")
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    saved = sorted(os.listdir(ckpts))
    assert f"step_{STEPS:08d}.npz" not in saved, "the run finished before it was killed"

    # --resume: from the latest checkpoint, to the end.
    r = train(tmp_path, config, "--set", "logging.run_name=cut", "--resume")
    assert "TensorBoard logs: runs/resume/cut" in r.stdout
    cut = tmp_path / "runs" / "resume" / "cut"
    assert_same_points(read_scalars(cut), want)
    assert timeline_steps(str(cut)) == timeline_steps(str(tmp_path / "runs" / "resume" / "full")) == [2]

    # Resumed again from the first checkpoint: everything after step 50 is on disk now
    # and must be hidden (purged) and logged again; up to step 50 it must stay.
    train(tmp_path, config, "--set", "logging.run_name=cut", "--resume", str(ckpts / "step_00000050.npz"))
    assert_same_points(read_scalars(cut), want)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    raw = EventAccumulator(str(cut), size_guidance={"scalars": 0}, purge_orphaned_data=False)
    raw.Reload()
    raw_steps = [e.step for e in raw.Scalars("train/loss")]
    assert raw_steps.count(100) >= 2 and raw_steps.count(50) == 1  # the purge did work

    # And a finished run resumed once more: nothing changes.
    before = sorted(os.listdir(cut))
    r = train(tmp_path, config, "--set", "logging.run_name=cut", "--resume")
    assert "already finished" in r.stdout and sorted(os.listdir(cut)) == before
    assert_same_points(read_scalars(cut), want)
