"""Runs that never mix (trainers/runs.py), as a user meets them in scripts/train.py and
scripts/compare_inplace.py: a new run beside another one writes the next version of its
name, ``--resume`` takes only its own run's checkpoints (or names both runs and stops),
and a run's end (its summary, its sample) is finished or given again by ``--resume``.

The scripts run in this process (``main(argv)``), in a temporary working directory.
"""

from __future__ import annotations

import os
import signal

import pytest

from models.gpt import GPT
from scripts import compare_inplace, train
from trainers.checkpoint import list_checkpoints
from trainers.logging import read_scalars

TINY = """\
experiment: tiny
seed: 3
threads: 1
data: {name: digits, batch_size: 32}
model: {name: mlp, args: {hidden: [8]}}
optim: {name: sgd, lr: 0.1}
train: {max_steps: 6, eval_every: 3, log_every: 2}
logging: {progress: false, timeline: false}
"""


@pytest.fixture
def run(tmp_path, monkeypatch, capsys):
    """``run(main, *argv)`` -> (exit status, stdout, stderr) of a script's main in ``tmp_path``."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(TINY)

    def call(main, *argv):
        code = main(["--config", "c.yaml", *argv])
        out, err = capsys.readouterr()
        return code, out, err

    return call


def files(folder) -> dict:
    """Every file under ``folder`` with its bytes."""
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                found[os.path.join(root, name)] = f.read()
    return found


def steps(run_dir, tag="train/loss"):
    return [s for s, _ in read_scalars(run_dir)[tag]]


def test_a_resume_takes_only_its_own_runs_checkpoints(run, tmp_path):
    """Issue 41's repro: a run with another learning rate under the same name, then resumed.
    It used to write into the first run's folders and resume from the first run's checkpoint."""
    first, second = ("--set", "checkpoint.every=2"), ("--set", "checkpoint.every=2", "--set", "optim.lr=0.05")
    assert run(train.main, *first)[0] == 0
    code, out, _ = run(train.main, *second, "--set", "train.max_steps=5")
    assert code == 0
    assert "runs/tiny/inplace-auto_np1 already holds a run: this run writes runs/tiny/inplace-auto_np1_v2" in out
    code, out, err = run(train.main, *second, "--set", "train.max_steps=8", "--resume")
    assert code == 0, err
    assert "resumed from step 5 (checkpoints/tiny/inplace-auto_np1_v2/step_00000005.npz)" in out
    # Each run's points and checkpoints in its own folders, each point once.
    assert steps("runs/tiny/inplace-auto_np1") == [2, 4, 6]
    assert steps("runs/tiny/inplace-auto_np1_v2") == [2, 4, 5, 6, 8]
    assert [s for s, _ in list_checkpoints("checkpoints/tiny/inplace-auto_np1")] == [4, 6]
    assert [s for s, _ in list_checkpoints("checkpoints/tiny/inplace-auto_np1_v2")] == [6, 8]

    # A config whose run has no checkpoint: one line naming both runs, nothing written.
    before = files(tmp_path)
    code, _, err = run(train.main, "--set", "optim.lr=0.07", "--resume")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: --resume: no checkpoint of this config's run in checkpoints/tiny: ")
    assert "is run inplace-auto_np1_v2 (id " in err and "not this config's run (id " in err
    assert "optim.lr 0.05 there, 0.07 here" in err
    assert files(tmp_path) == before


def test_a_new_run_never_writes_into_another_runs_folders(run, tmp_path):
    """Other settings under the same name, or the same config started again: a new version
    each time (Lightning's version_N), the earlier runs' files untouched."""
    assert run(train.main)[0] == 0
    before = files(tmp_path)
    code, out, _ = run(train.main, "--set", "seed=4")
    assert code == 0 and "this run writes runs/tiny/inplace-auto_np1_v2" in out
    code, out, _ = run(train.main)
    assert code == 0 and "this run writes runs/tiny/inplace-auto_np1_v3" in out
    after = files(tmp_path)
    assert {p: after[p] for p in before} == before
    for version in ("inplace-auto_np1", "inplace-auto_np1_v2", "inplace-auto_np1_v3"):
        assert steps(f"runs/tiny/{version}") == [2, 4, 6], version
        assert [s for s, _ in list_checkpoints(f"checkpoints/tiny/{version}")] == [6], version
    # The one that resumes is the newest run of the config.
    code, out, _ = run(train.main, "--set", "train.max_steps=8", "--resume")
    assert code == 0 and "resumed from step 6 (checkpoints/tiny/inplace-auto_np1_v3/step_00000006.npz)" in out


def test_a_comparison_takes_an_experiment_folder_of_its_own(run, tmp_path):
    """compare_inplace.py runs its policies into one experiment on purpose: run again, it
    writes the next version of the experiment, with its own figure; --resume finds it."""
    args = ("--policies", "off,on", "--rounds", "1", "--round-steps", "1", "--set", "train.max_steps=4")
    code, out, err = run(compare_inplace.main, *args)
    assert code == 0, err
    before = files(tmp_path)
    code, out, err = run(compare_inplace.main, *args)
    assert code == 0, err
    assert "runs/tiny already holds runs: this comparison writes runs/tiny_v2" in out
    after = files(tmp_path)
    assert {p: after[p] for p in before} == before
    assert sorted(os.listdir("runs/tiny_v2")) == ["compare.png", "inplace-off_np1", "inplace-on_np1"]
    code, out, err = run(compare_inplace.main, *args, "--resume")
    assert code == 0, err
    assert "resuming the comparison in runs/tiny_v2" in out
    assert "off: finished at step 4 (checkpoints/tiny_v2/inplace-off_np1/step_00000004.npz); kept as it is" in out


LM = """\
experiment: lm
threads: 1
seed: 2
data: {{name: text, path: {path}, block_size: 16, batch_size: 4, eval_batch_size: 8}}
model: {{name: gpt, args: {{n_layer: 1, n_head: 2, n_embd: 16}}}}
optim: {{name: adamw, lr: 0.003}}
train: {{max_steps: 4, eval_every: 2, log_every: 2}}
sample: {{tokens: 12, top_k: 5}}
logging: {{progress: false, timeline: false}}
"""


def test_ctrl_c_during_the_sample_and_resume_writes_it(run, tmp_path, monkeypatch):
    """Issue 41: a Ctrl-C while the finished run writes its sample lost the sample, and
    --resume of the finished run printed neither it nor the summary."""
    (tmp_path / "t.txt").write_text("abcdefgh éè\n" * 300, encoding="utf-8")
    (tmp_path / "c.yaml").write_text(LM.format(path=tmp_path / "t.txt"))
    generate = GPT.generate
    pressed = []

    def ctrl_c_once(self, *args, **kwargs):
        if not pressed:
            pressed.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # the run's handlers are gone: Python's own raises
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(GPT, "generate", ctrl_c_once)
    code, out, err = run(train.main)
    assert code == 130 and pressed, err
    assert "sample:" not in out
    assert "SIGINT: run inplace-auto_np1 stopped after step 4 of 4 (the run is complete)" in err
    assert "resume with: " in err and err.rstrip().endswith("--config c.yaml --resume")
    summary = out[out.index("run ") :]  # the summary table, printed before the sample

    code, again, err = run(train.main, "--resume")
    assert code == 0, err
    assert "has already finished" in again and summary in again  # the same table, from the checkpoint
    assert "validation loss " in again and "\nsample:\n" in again
