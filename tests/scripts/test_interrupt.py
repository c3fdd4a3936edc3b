"""Interruptions lose nothing: SIGINT, SIGTERM and SIGUSR1 at random steps, alone and under mpiexec.

Each signal is sent at a step drawn from a seeded generator, by the process to itself
(``tests/stop_driver.py``), to one rank only under ``mpiexec -n 2``. The run must stop
after that step with a checkpoint of it, exit with 128 + the signal, and print the
command that resumes it; that command, run as printed, must finish the run so that
TensorBoard shows every point once with the values of a run never stopped, and the
final parameters are the same bit for bit.
"""

from __future__ import annotations

import os
import random
import re
import shlex
import signal
import sys
import time

import numpy as np
import pytest

from tests.mpi_util import REPO, find_mpiexec, needs_mpiexec, run_command, worker_env
from trainers.checkpoint import list_checkpoints, load_checkpoint
from trainers.logging import read_scalars

STEPS = 24
SIGNALS = ["SIGINT", "SIGTERM", "SIGUSR1"]
DRIVER = REPO / "tests" / "stop_driver.py"
TRAIN = REPO / "scripts" / "train.py"

# Dropout draws from each rank's random stream, so a resume must restore every rank's.
CONFIG = f"""\
experiment: stop
seed: 11
threads: 1
data: {{name: digits, batch_size: 16}}
model: {{name: mlp, args: {{hidden: [16], dropout: 0.1}}}}
optim: {{name: sgd, lr: 0.05, momentum: 0.9}}
schedule: {{name: cosine, warmup_steps: 3}}
train: {{epochs: 10, max_steps: {STEPS}, log_every: 4, eval_every: 10}}
logging: {{progress: false}}
"""


def stop_step(name: str, salt: int) -> int:
    """A step to send the signal in, drawn from a seeded generator (two before the last at most)."""
    return random.Random(f"{name}-{salt}").randrange(2, STEPS - 1)


def train(tmp_path, args, nprocs=1, env=None, timeout=240):
    cmd = [sys.executable, *map(str, args)]
    if nprocs > 1:
        cmd = [find_mpiexec(), "-n", str(nprocs), *cmd]
    return run_command(cmd, timeout, cwd=tmp_path, env=env)


def config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG)
    return path


def comparable(scalars):
    """What a rerun reproduces bit for bit: not timings, not live memory (garbage collection)."""
    return {
        tag: points
        for tag, points in scalars.items()
        if tag.startswith(("train/", "eval/", "inplace/", "summary/final", "summary/eval"))
    }


def assert_same_run(tmp_path, got: str, want: str):
    """Every point of run ``got`` once, at the steps and with the values of ``want``; the
    same final parameters and optimizer state, bit for bit."""
    a, b = read_scalars(tmp_path / "runs" / "stop" / got), read_scalars(tmp_path / "runs" / "stop" / want)
    assert sorted(a) == sorted(b)
    for tag in b:
        assert [s for s, _ in a[tag]] == [s for s, _ in b[tag]], tag  # every point, each once
    assert comparable(a) == comparable(b)
    last = f"step_{STEPS:08d}.npz"
    x = load_checkpoint(str(tmp_path / "checkpoints" / "stop" / got / last))
    y = load_checkpoint(str(tmp_path / "checkpoints" / "stop" / want / last))
    for part in ("model", "optimizer"):
        assert_equal_bits(x[part], y[part])


def assert_equal_bits(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_equal_bits(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            assert_equal_bits(u, v)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    else:
        assert a == b


def resume_command(err: str) -> list[str]:
    """The command the stopped run printed, as argv (``python`` is this interpreter)."""
    line = next(line for line in err.splitlines() if line.startswith("resume with: "))
    argv = shlex.split(line.removeprefix("resume with: "))
    if argv[0] == "mpiexec":
        argv[0] = find_mpiexec()
    return [sys.executable if a == "python" else a for a in argv]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted runs: ``full`` in one process, ``full2`` in two (trained once, when first needed)."""
    tmp = tmp_path_factory.mktemp("reference")
    path = config(tmp)
    done = set()

    def run(name: str, nprocs: int):
        if name not in done:
            code, _, err, _ = train(tmp, [TRAIN, "--config", path, "--set", f"logging.run_name={name}"], nprocs)
            assert code == 0, err
            done.add(name)
        return tmp

    return run


def copy_reference(reference, tmp_path, run="full", nprocs=1):
    import shutil

    source = reference(run, nprocs)
    for root in ("runs", "checkpoints"):
        shutil.copytree(source / root / "stop" / run, tmp_path / root / "stop" / run)


@pytest.mark.parametrize("name", SIGNALS)
def test_a_signal_stops_after_the_step_in_flight_and_the_printed_command_resumes_it(tmp_path, reference, name):
    at = stop_step(name, 1)
    copy_reference(reference, tmp_path)
    path = config(tmp_path)
    env = {**worker_env(), "STOP_SIGNAL": name, "STOP_AT": str(at)}
    code, out, err, _ = train(tmp_path, [DRIVER, TRAIN, "--config", path, "--set", "logging.run_name=cut"], env=env)
    signum = getattr(signal, name)
    assert code == 128 + signum, (code, err)
    assert "Traceback" not in err
    ckpts = tmp_path / "checkpoints" / "stop" / "cut"
    assert [s for s, _ in list_checkpoints(str(ckpts))] == [at]  # checkpoint.every is 0: this one is the stop's
    assert f"{name}: run cut stopped after step {at} of {STEPS}; checkpoint: " in err
    assert str(ckpts.relative_to(tmp_path) / f"step_{at:08d}.npz") in err

    argv = resume_command(err)
    assert argv[1:] == [str(TRAIN), "--config", str(path), "--set", "logging.run_name=cut", "--resume"]
    code, out, err, _ = train(tmp_path, argv[1:])
    assert code == 0, err
    assert f"resumed from step {at} (checkpoints/stop/cut/step_{at:08d}.npz)" in out
    assert_same_run(tmp_path, "cut", "full")


@needs_mpiexec
@pytest.mark.mpi
@pytest.mark.parametrize("name", SIGNALS)
def test_one_rank_signalled_stops_both_after_the_same_step(tmp_path, reference, name):
    at, rank = stop_step(name, 2), random.Random(name).randrange(2)
    stop = at + 1  # the ranks' agreement, started after step `at`, is read after the next one
    copy_reference(reference, tmp_path, "full2", nprocs=2)
    path = config(tmp_path)
    env = {**worker_env(), "STOP_SIGNAL": name, "STOP_AT": str(at), "STOP_RANK": str(rank)}
    args = [DRIVER, TRAIN, "--config", path, "--set", "logging.run_name=cut"]
    code, out, err, _ = train(tmp_path, args, nprocs=2, env=env)
    assert code == 128 + getattr(signal, name), (code, err)
    assert "Traceback" not in err
    assert err.count("resume with: ") == 1  # rank 0 says it, once
    assert f"run cut stopped after step {stop} of {STEPS}" in err
    ckpts = tmp_path / "checkpoints" / "stop" / "cut"
    assert [s for s, _ in list_checkpoints(str(ckpts))] == [stop]
    state = load_checkpoint(str(ckpts / f"step_{stop:08d}.npz"))
    assert len(state["ranks"]) == 2  # each rank's random state and open log window

    argv = resume_command(err)
    assert argv[:3] == [find_mpiexec(), "-n", "2"]
    code, out, err, _ = run_command(argv, 240, cwd=tmp_path)
    assert code == 0, err
    assert out.count(f"resumed from step {stop} ") == 1
    assert_same_run(tmp_path, "cut", "full2")


@needs_mpiexec
@pytest.mark.mpi
def test_sigterm_to_mpiexec_reaches_every_rank_and_loses_nothing(tmp_path, reference):
    """What Slurm or a user does: signal the launcher; MPICH's forwards SIGINT, SIGTERM and SIGUSR1."""
    import subprocess

    copy_reference(reference, tmp_path, "full2", nprocs=2)
    path = config(tmp_path)
    ready = tmp_path / "ready"
    env = {**worker_env(), "STOP_READY": str(ready), "STOP_AT": "3", "STOP_RANK": "0"}
    cmd = [find_mpiexec(), "-n", "2", sys.executable, DRIVER, TRAIN, "--config", path, "--set", "logging.run_name=cut"]
    proc = subprocess.Popen(
        list(map(str, cmd)), cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    stopped = int(re.search(r"stopped after step (\d+) of", err).group(1))
    assert 3 <= stopped <= STEPS
    code, out, err, _ = run_command(resume_command(err), 240, cwd=tmp_path)
    assert code == 0, err
    assert_same_run(tmp_path, "cut", "full2")


COMPARE = REPO / "scripts" / "compare_inplace.py"


def table_rows(out: str) -> dict[str, dict[str, str]]:
    """compare_inplace.py's table: policy -> column -> cell."""
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("policy"))
    columns = re.split(r"\s{2,}", lines[header].strip())
    rows = {}
    for line in lines[header + 2 :]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != len(columns):
            break
        rows[cells[0]] = dict(zip(columns, cells))
    return rows


def image_steps(run_dir) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"images": 0})
    acc.Reload()
    return [e.step for e in acc.Images("memory/timeline")]


def test_compare_resume_keeps_finished_runs_resumes_the_stopped_one_and_trains_the_rest(tmp_path):
    path = config(tmp_path)
    common = ["--config", path, "--policies", "off,on,auto", "--rounds", "1", "--round-steps", "1"]
    code, want, err, _ = train(tmp_path, [COMPARE, *common, "--set", "experiment=whole"])
    assert code == 0, err

    at = stop_step("compare", 3)
    env = {**worker_env(), "STOP_SIGNAL": "SIGTERM", "STOP_AT": str(at), "STOP_RUN": "inplace-on_np1"}
    code, out, err, _ = train(tmp_path, [DRIVER, COMPARE, *common], env=env)
    assert code == 128 + signal.SIGTERM, err
    assert f"run inplace-on_np1 stopped after step {at} of {STEPS}" in err
    runs = tmp_path / "runs" / "stop"
    assert sorted(os.listdir(runs)) == ["inplace-off_np1", "inplace-on_np1"]  # auto never started

    argv = resume_command(err)
    assert argv[1:] == [str(COMPARE), *map(str, common), "--resume"]
    code, got, err, _ = run_command(argv, 240, cwd=tmp_path)
    assert code == 0, err
    ckpts = "checkpoints/stop"
    assert f"off: finished at step {STEPS} ({ckpts}/inplace-off_np1/step_{STEPS:08d}.npz); kept as it is" in got
    assert f"on: resumed from step {at} ({ckpts}/inplace-on_np1/step_{at:08d}.npz)" in got
    assert f"auto: no checkpoint in {ckpts}/inplace-auto_np1 yet; training from step 0" in got

    for run in ("inplace-off_np1", "inplace-on_np1", "inplace-auto_np1"):
        a, b = read_scalars(runs / run), read_scalars(tmp_path / "runs" / "whole" / run)
        for tag in b:
            assert [s for s, _ in a[tag]] == [s for s, _ in b[tag]], (run, tag)
        assert comparable(a) == comparable(b), run
        assert image_steps(runs / run) == [2], run  # each run's timeline image once, on one scale
    # The table of the resumed comparison is the uninterrupted one's, except the timings.
    got_rows, want_rows = table_rows(got), table_rows(want)
    assert sorted(got_rows) == ["auto", "off", "on"]
    for policy, row in want_rows.items():
        for column in ("peak MB", "floor MB", "auto ops/step", "auto MB/step", "final loss", "eval accuracy"):
            assert got_rows[policy][column] == row[column], (policy, column)
