"""train.accumulate (gradient accumulation) on one process, and the settings a run refuses."""

import os
import signal

import numpy as np
import pytest

from trainers.cli import run_cli
from trainers.config import ConfigError, load_config
from trainers.trainer import Interrupted, Trainer, check_zero

CONFIG = """\
experiment: acc
threads: 1
seed: 3
data: {name: digits, batch_size: 64, drop_last: false, test_fraction: 0.8}
model: {name: mlp, args: {hidden: [16], dropout: 0.0}}
optim: {name: sgd, lr: 0.1, momentum: 0.9}
train: {epochs: 1, eval_every: 100, log_every: 5}
logging: {progress: false, timeline: false}
"""


def config(tmp_path, *overrides):
    path = tmp_path / "acc.yaml"
    path.write_text(CONFIG)
    base = [f"logging.logdir={tmp_path / 'runs'}", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    return load_config(path, base + list(overrides))


def test_four_micro_batches_are_one_step_on_the_four_times_larger_batch(tmp_path):
    """359 training samples: 6 steps of 64 (the last of 39) against 23 batches of 16 (the
    last of 7) taken 4 at a time, the last step 3 of them: the same samples each step, each
    loss weighted by its share, so the same steps up to the order of the sums."""
    big = Trainer(config(tmp_path))
    big_result = big.fit()
    acc = Trainer(config(tmp_path, "data.batch_size=16", "train.accumulate=4"))
    assert len(big.train_set) == 359 and len(acc.loader) == 23
    assert acc.total_steps == big.total_steps == 6
    result = acc.fit()
    assert result.run_dir.endswith("inplace-auto_np1_acc4") and result.steps == 6
    np.testing.assert_allclose(result.losses, big_result.losses, rtol=1e-5)
    for a, b in zip(acc.model.parameters(), big.model.parameters()):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-4, atol=1e-6)
    # samples/s counts every micro-batch's samples: the same samples as the large batch's steps
    assert acc.totals["timed"]["samples"] == big.totals["timed"]["samples"] == 359 - 64
    # dropping the last incomplete batch drops the last incomplete group: 22 // 4 steps, as 359 // 64
    dropped = Trainer(config(tmp_path, "data.batch_size=16", "train.accumulate=4", "data.drop_last=true"))
    assert dropped.total_steps == 5 == 359 // 64


def test_settings_a_run_refuses(tmp_path):
    with pytest.raises(ConfigError, match=r"train.accumulate must be >= 1, got 0"):
        config(tmp_path, "train.accumulate=0")
    with pytest.raises(ConfigError, match="distributed.zero must be one of 0, 1, 2"):
        config(tmp_path, "distributed.zero=3")
    with pytest.raises(ConfigError, match=r"but this run has one; run it under mpiexec -n N"):
        check_zero(config(tmp_path, "distributed.zero=2"), 1)
    with pytest.raises(ConfigError, match="sgd without momentum keeps none"):
        check_zero(config(tmp_path, "distributed.zero=1", "optim.momentum=0"), 2)
    check_zero(config(tmp_path, "distributed.zero=2", "optim.momentum=0"), 2)  # gradients to shard
    with pytest.raises(ConfigError, match="set compile: false or distributed.zero: 0"):
        check_zero(config(tmp_path, "distributed.zero=1", "compile=true"), 2)
    with pytest.raises(ConfigError, match="set train.accumulate: 1 or compile: false"):
        Trainer(config(tmp_path, "train.accumulate=2", "compile=true"))


def test_zero_on_one_process_exits_2_with_one_line(tmp_path, capsys):
    assert run_cli(lambda: Trainer(config(tmp_path, "distributed.zero=1"))) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(err) == 1 and "distributed.zero: 1" in err[0] and "mpiexec -n N" in err[0], err


def test_a_signal_between_micro_batches_stops_after_the_step_and_the_resume_goes_on_from_there(tmp_path):
    """SIGINT during step 2's second micro-batch: the step's other micro-batches and its
    update run, the checkpoint is at step 2 and the resumed run is the one never stopped."""
    settings = ("data.batch_size=16", "train.accumulate=3", "train.max_steps=4", "checkpoint.every=0")
    full = Trainer(config(tmp_path, *settings, "logging.run_name=full"))
    full_result = full.fit()
    cut = Trainer(config(tmp_path, *settings, "logging.run_name=cut"))
    forward, calls = cut.net.forward, []

    def forward_then_signal(*args):
        calls.append(1)
        if len(calls) == 5:  # step 2 (micro-batches 4 to 6), its second
            os.kill(os.getpid(), signal.SIGINT)
        return forward(*args)

    cut.net.forward = forward_then_signal
    with pytest.raises(Interrupted) as info:
        cut.fit()
    assert info.value.step == 2 and len(calls) == 6 and cut.loader.state_dict() == {"epoch": 0, "batch": 6}
    resumed = Trainer(config(tmp_path, *settings, "logging.run_name=cut"), resume="auto")
    assert resumed.step == 2
    assert resumed.fit().losses == full_result.losses[2:]
    for a, b in zip(resumed.model.parameters(), full.model.parameters()):
        assert a.detach().numpy().tobytes() == b.detach().numpy().tobytes()
