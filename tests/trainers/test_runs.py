"""What makes two configs the same run (trainers/runs.py); the folders and the CLI: tests/scripts/test_runs.py."""

from __future__ import annotations

from tests.trainers.test_trainer import tiny_config
from trainers import runs
from trainers.config import resumable_keys


def test_the_keys_a_resume_may_change_are_where_how_long_what_is_shown_and_how_fast():
    assert resumable_keys() == [
        "experiment",
        "device",
        "threads",
        "data.eval_batch_size",
        "sample.tokens",
        "sample.prompt",
        "sample.temperature",
        "sample.top_k",
        "train.epochs",
        "train.max_steps",
        "train.eval_every",
        "train.log_every",
        "logging.logdir",
        "logging.run_name",
        "logging.progress",
        "logging.timeline",
        "checkpoint.dir",
        "checkpoint.every",
        "checkpoint.keep",
        "checkpoint.resume",
        "distributed.bucket_mb",
        "distributed.backend",
    ]


def test_the_same_run_is_the_config_less_those_keys(tmp_path):
    cfg = tiny_config(tmp_path).to_dict()
    longer = tiny_config(tmp_path, "train.max_steps=20", "logging.run_name=x", "checkpoint.every=1").to_dict()
    assert runs.same_run(cfg, longer) and runs.run_id(cfg) == runs.run_id(longer)
    other = tiny_config(tmp_path, "optim.lr=0.05").to_dict()
    assert not runs.same_run(cfg, other) and runs.run_id(cfg) != runs.run_id(other)
    assert runs.differences(cfg, other) == "optim.lr 0.1 there, 0.05 here"
    # A checkpoint written before a key existed is the run of a config that leaves it at its default.
    older = tiny_config(tmp_path).to_dict()
    del older["conv_math"], older["optim"]["decay"]
    assert runs.same_run(older, cfg)
    # A config this version cannot read is another run, said so.
    assert not runs.same_run({**cfg, "future_key": 1}, cfg)
    assert runs.differences({**cfg, "future_key": 1}, cfg).startswith("a config this version cannot read")
