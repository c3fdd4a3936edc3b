"""The trainer end to end on tiny configs: logs, checkpoints, resume, failure paths."""

import math
import os

import numpy as np
import pytest

import framework as fw
from trainers.checkpoint import CheckpointError, list_checkpoints, load_checkpoint, save_checkpoint
from trainers.config import ConfigError, load_config
from trainers.logging import read_scalars
from trainers.trainer import Trainer, TrainingError, learning_rate

TINY = """\
experiment: tiny
seed: 3
threads: 1
data:
  name: digits
  batch_size: 32
model:
  name: mlp
  args:
    hidden: [16]
    dropout: 0.2
optim:
  name: sgd
  lr: 0.1
  momentum: 0.9
schedule:
  name: cosine
  warmup_steps: 2
train:
  epochs: 1
  max_steps: 8
  eval_every: 4
  log_every: 2
logging:
  progress: false
checkpoint:
  every: 4
  keep: 5
"""


def tiny_config(tmp_path, *overrides):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    base = [f"logging.logdir={tmp_path / 'runs'}", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    return load_config(path, base + list(overrides))


def test_run_writes_the_documented_tensorboard_layout(tmp_path):
    result = Trainer(tiny_config(tmp_path)).fit()
    assert result.run_dir == str(tmp_path / "runs" / "tiny" / "inplace-auto_np1")
    scalars = read_scalars(result.run_dir)
    for tag in (
        "train/loss",
        "train/accuracy",
        "perf/samples_per_sec",
        "perf/step_ms",
        "memory/peak_mb",
        "memory/allocated_mb",
        "memory/floor_mb",
        "memory/parameters_mb",
        "memory/gradients_mb",
        "memory/optimizer_state_mb",
        "memory/activations_mb",
    ):
        assert [s for s, _ in scalars[tag]] == [2, 4, 6, 8], tag
    assert [s for s, _ in scalars["eval/accuracy"]] == [4, 8]
    # train/loss is the mean of the losses of the steps since the previous log point
    logged = [v for _, v in scalars["train/loss"]]
    means = [np.mean(result.losses[i : i + 2]) for i in range(0, 8, 2)]
    np.testing.assert_allclose(logged, means, rtol=1e-6)
    assert scalars["eval/accuracy"][-1][1] == pytest.approx(result.eval_metric, rel=1e-6)
    for (_, peak), (_, floor) in zip(scalars["memory/peak_mb"], scalars["memory/floor_mb"]):
        assert 0 < floor <= peak * 1.5  # the floor is a lower bound of what a step needs
    assert all(v > 0 for _, v in scalars["perf/samples_per_sec"])
    files = os.listdir(result.run_dir)
    assert "config.yaml" in files and "timeline.png" in files
    assert sorted(os.listdir(tmp_path / "runs" / "tiny")) == ["inplace-auto_np1"]  # hparams made no extra run
    assert result.peak_mb > 0 and result.floor_mb > 0 and result.samples_per_sec > 0


def test_policies_log_the_same_losses_into_separate_runs(tmp_path):
    on = Trainer(tiny_config(tmp_path, "inplace=on")).fit()
    off = Trainer(tiny_config(tmp_path, "inplace=off")).fit()
    assert os.path.basename(off.run_dir) == "inplace-off_np1"
    np.testing.assert_allclose(on.losses, off.losses, rtol=1e-6)


def test_resume_continues_exactly(tmp_path):
    full = Trainer(tiny_config(tmp_path)).fit()
    ckpts = list_checkpoints(str(tmp_path / "ckpt" / "tiny" / "inplace-auto_np1"))
    assert [s for s, _ in ckpts] == [4, 8]
    state = load_checkpoint(ckpts[0][1])
    assert state["step"] == 4 and state["loader"] == {"epoch": 0, "batch": 4}
    assert state["config"]["model"]["args"]["hidden"] == [16]
    # Resume from step 4 (model, momentum, dropout RNG, data position, schedule position).
    resumed = Trainer(tiny_config(tmp_path), resume=ckpts[0][1])
    assert resumed.step == 4
    second = resumed.fit()
    assert second.losses == full.losses[4:]  # bit for bit, dropout included


def test_a_run_that_reached_max_steps_trains_on_from_the_next_batch_when_max_steps_is_raised(tmp_path):
    """The run's end saved the loader one batch ahead (the loop took the next batch before
    seeing it was done), so training longer skipped a batch."""
    full = Trainer(tiny_config(tmp_path, "train.max_steps=6", "logging.run_name=full")).fit()
    short = Trainer(tiny_config(tmp_path, "train.max_steps=3", "logging.run_name=short"))
    short.fit()
    assert short.loader.state_dict() == {"epoch": 0, "batch": 3}
    longer = Trainer(tiny_config(tmp_path, "train.max_steps=6", "logging.run_name=short"), resume="auto")
    assert longer.step == 3
    assert longer.fit().losses == full.losses[3:]


def test_resume_auto_picks_the_latest_and_starts_fresh_without_one(tmp_path):
    fresh = Trainer(tiny_config(tmp_path, "checkpoint.resume=auto"))
    assert fresh.step == 0
    fresh.fit()
    again = Trainer(tiny_config(tmp_path, "checkpoint.resume=auto", "train.max_steps=10"))
    assert again.step == 8


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path):
    Trainer(tiny_config(tmp_path)).fit()
    path = list_checkpoints(str(tmp_path / "ckpt" / "tiny" / "inplace-auto_np1"))[-1][1]
    # One line naming both runs and what tells them apart.
    both = (
        r"is run inplace-auto_np1 \(id \w{12}\), not this config's run \(id \w{12}\): "
        r"model.args.hidden \[16\] there, \[8\] here"
    )
    with pytest.raises(CheckpointError, match=both):
        Trainer(tiny_config(tmp_path, "model.args.hidden=[8]"), resume=path)


def test_non_finite_loss_stops_before_the_update_and_keeps_the_last_good_checkpoint(tmp_path):
    cfg = tiny_config(
        tmp_path,
        "optim.lr=1e6",
        "schedule.name=none",
        "checkpoint.every=1",
        "train.max_steps=50",
        "model.args.dropout=0.0",
    )
    trainer = Trainer(cfg)
    with pytest.raises(TrainingError) as info, np.errstate(over="ignore", invalid="ignore"):
        trainer.fit()  # the overflow on the way is expected: the trainer reports it once
    msg = str(info.value)
    bad_step = trainer.step
    assert f"at step {bad_step} " in msg and "Lower optim.lr" in msg
    ckpts = list_checkpoints(str(tmp_path / "ckpt" / "tiny" / "inplace-auto_np1"))
    assert ckpts and ckpts[-1][0] == bad_step  # nothing was saved after the bad step
    assert f"the last good checkpoint is {ckpts[-1][1]}" in msg
    params = load_checkpoint(ckpts[-1][1])["model"]
    assert all(np.isfinite(np.asarray(v)).all() for v in params.values())


def test_unknown_model_argument_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="hiden"):
        Trainer(tiny_config(tmp_path, "model.args.hiden=[4]"))


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    d = str(tmp_path / "c")
    save_checkpoint({"step": 1, "x": 1}, d, 1)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", boom)
    with pytest.raises(OSError):
        save_checkpoint({"step": 2}, d, 2)
    assert os.listdir(d) == ["step_00000001.npz"]  # no partial file, the old one intact
    assert load_checkpoint(os.path.join(d, "step_00000001.npz"))["x"] == 1


def test_learning_rate_schedules(tmp_path):
    cfg = tiny_config(
        tmp_path, "schedule.name=step", "schedule.step_size=3", "schedule.gamma=0.5", "schedule.warmup_steps=2"
    )
    lrs = [learning_rate(cfg, s, 10) for s in range(8)]
    assert lrs == pytest.approx([0.05, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05])
    cfg = tiny_config(tmp_path, "schedule.name=cosine", "schedule.warmup_steps=0", "schedule.min_lr=0.01")
    assert learning_rate(cfg, 0, 10) == pytest.approx(0.1)
    assert learning_rate(cfg, 5, 10) == pytest.approx(0.01 + 0.09 * 0.5)
    assert learning_rate(cfg, 10, 10) == pytest.approx(0.01)
    assert math.isclose(
        learning_rate(tiny_config(tmp_path, "schedule.name=none", "schedule.warmup_steps=0"), 7, 10), 0.1
    )


def test_multistep_divides_the_learning_rate_at_each_milestone_as_pytorch_does(tmp_path, torch):
    milestones = ("schedule.name=multistep", "schedule.milestones=[3, 5]", "schedule.gamma=0.1")
    cfg = tiny_config(tmp_path, *milestones, "schedule.warmup_steps=0")
    ours = [learning_rate(cfg, s, 8) for s in range(8)]
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3, 5], gamma=0.1)
    theirs = []
    for _ in range(8):  # the lr of each step, then one scheduler step per training step
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert ours == pytest.approx(theirs, rel=1e-12)
    assert ours == pytest.approx([0.1, 0.1, 0.1, 0.01, 0.01, 0.001, 0.001, 0.001])


def test_a_checkpoint_of_the_previous_format_still_resumes(tmp_path):
    from trainers.checkpoint import write_checkpoint

    full = Trainer(tiny_config(tmp_path, "checkpoint.every=4")).fit()
    first = list_checkpoints(str(tmp_path / "ckpt" / "tiny" / "inplace-auto_np1"))[0][1]
    state = load_checkpoint(first)
    old = {k: v for k, v in state.items() if k not in ("ranks", "run")}  # what the previous version wrote
    write_checkpoint(old, str(tmp_path / "old.npz"))
    resumed = Trainer(tiny_config(tmp_path, "checkpoint.every=4"), resume=str(tmp_path / "old.npz"))
    assert resumed.step == 4 and resumed.fit().losses == full.losses[4:]
    # Finished, it resumes to nothing; its totals (for compare_inplace.py --resume) are not there.
    last = load_checkpoint(list_checkpoints(str(tmp_path / "ckpt" / "tiny" / "inplace-auto_np1"))[-1][1])
    write_checkpoint({k: v for k, v in last.items() if k not in ("ranks", "run")}, str(tmp_path / "old_end.npz"))
    done = Trainer(tiny_config(tmp_path, "checkpoint.every=4"), resume=str(tmp_path / "old_end.npz"))
    assert done.finished
    with pytest.raises(CheckpointError, match="written by an earlier version, without the run's peak"):
        done.result()


def test_logged_peak_is_the_training_steps_not_the_evaluation(tmp_path, monkeypatch):
    # An evaluation that allocates a lot between steps must not show up in memory/peak_mb.
    trainer = Trainer(tiny_config(tmp_path, "train.eval_every=2"))
    original = trainer.evaluate

    def hungry_evaluate():
        import framework as fw

        big = fw.zeros(64, 1024, 1024)  # 256 MiB
        del big
        return original()

    monkeypatch.setattr(trainer, "evaluate", hungry_evaluate)
    result = trainer.fit()
    assert result.peak_mb < 64
    assert max(v for _, v in read_scalars(result.run_dir)["memory/peak_mb"]) < 64


def test_auto_policy_logs_what_it_ran_in_place(tmp_path):
    """Under auto the MLP's ReLU (fed its Linear's output as a temporary through
    Sequential) runs in place every step, and the trainer logs it per step."""
    prev = fw.inplace.set_auto_min_bytes(0)  # the tiny model's activations are 2 KiB
    try:
        _auto_policy_logs(tmp_path)
    finally:
        fw.inplace.set_auto_min_bytes(prev)


def _auto_policy_logs(tmp_path):
    result = Trainer(tiny_config(tmp_path, "inplace=auto", "model.args.dropout=0.0")).fit()
    assert result.run_dir.endswith("inplace-auto_np1")
    scalars = read_scalars(result.run_dir)
    assert [v for _, v in scalars["inplace/auto_ops_per_step/ReLU"]] == [1.0] * 4
    # The total adds auto's writes over the framework's own buffers (count_owned's sites).
    sites = [t for t in scalars if t.startswith("inplace/auto_ops_per_step/")]
    assert {t.rsplit("/", 1)[1] for t in sites} >= {"ReLU", "optimizer", "linear_bias"}
    total = [sum(scalars[t][i][1] for t in sites) for i in range(4)]
    assert [v for _, v in scalars["inplace/auto_ops_per_step"]] == pytest.approx(total)
    relu_mb = 32 * 16 * 4 / 2**20  # batch 32 x 16 hidden units, float32
    assert scalars["inplace/auto_saved_mb_per_step"][-1][1] > relu_mb
    assert result.auto_ops_per_step == pytest.approx(sum(total) / 4)  # four windows of two steps
    with_on = Trainer(tiny_config(tmp_path, "inplace=on", "model.args.dropout=0.0")).fit()
    assert read_scalars(with_on.run_dir)["inplace/auto_ops_per_step"][-1][1] == 0.0
    assert with_on.losses == result.losses  # same arithmetic, only buffers differ


# --------------------------------------------------------------------- resume and TensorBoard


def accumulator(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(path, size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def comparable(scalars):
    """Scalars a rerun reproduces bit for bit: not timings, and not live memory, which
    depends on when Python's garbage collector frees cyclic graphs."""
    return {
        tag: points
        for tag, points in scalars.items()
        if tag.startswith(("train/", "eval/", "inplace/", "summary/final", "summary/eval"))
    }


@pytest.mark.parametrize("every", [4, 3])  # a checkpoint on a log point, and between them
def test_a_resumed_run_shows_every_point_once_with_the_values_of_an_unbroken_run(tmp_path, every):
    common = (
        "inplace=on",
        f"checkpoint.every={every}",
        "checkpoint.keep=10",
        "train.max_steps=10",
        "train.log_every=2",
        "train.eval_every=5",
    )
    full = Trainer(tiny_config(tmp_path, *common, "logging.run_name=full")).fit()
    Trainer(tiny_config(tmp_path, *common, "logging.run_name=broken")).fit()
    ckpts = list_checkpoints(str(tmp_path / "ckpt" / "tiny" / "broken"))
    # As if that attempt had stopped right after its last step: resumed from its first
    # checkpoint, its points after the checkpoint's step (on disk) give way to new ones.
    resumed = Trainer(tiny_config(tmp_path, *common, "logging.run_name=broken"), resume=ckpts[0][1])
    assert resumed.step == every
    second = resumed.fit()
    assert second.losses == full.losses[every:]
    got, want = read_scalars(second.run_dir), read_scalars(full.run_dir)
    assert comparable(got) == comparable(want)
    for tag in got:
        steps = [s for s, _ in got[tag]]
        assert steps == [s for s, _ in want[tag]] and len(steps) == len(set(steps)), tag
    # The checkpoint's step is a log point, so the windows of the resumed run are the same.
    assert every in [s for s, _ in got["train/loss"]]
    # One memory timeline (step 2, before the checkpoint), and the config text once.
    acc = accumulator(second.run_dir)
    assert [e.step for e in acc.Images("memory/timeline")] == [2]
    assert len(acc.Tensors("config/text_summary")) == 1


def test_resuming_a_finished_run_trains_logs_and_saves_nothing(tmp_path):
    Trainer(tiny_config(tmp_path, "inplace=on")).fit()
    run = tmp_path / "runs" / "tiny" / "inplace-on_np1"
    ckpt_dir = tmp_path / "ckpt" / "tiny" / "inplace-on_np1"
    before = {p: p.read_bytes() for p in list(run.iterdir()) + list(ckpt_dir.iterdir())}
    again = Trainer(tiny_config(tmp_path, "inplace=on"), resume=True)
    assert again.finished and again.step == 8
    assert again.fit() is None
    assert {p: p.read_bytes() for p in list(run.iterdir()) + list(ckpt_dir.iterdir())} == before
    longer = Trainer(tiny_config(tmp_path, "inplace=on", "train.max_steps=10"), resume=True)
    assert not longer.finished and longer.fit().steps == 10
    # Its config differs (max_steps), so it is logged again, at the first step it trained.
    assert [e.step for e in accumulator(str(run)).Tensors("config/text_summary")] == [0, 9]


# --------------------------------------------------------------------- HPARAMS


def session_hparams(run_dir):
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = accumulator(run_dir).PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    return {k: getattr(v, v.WhichOneof("kind")) for k, v in start.session_start_info.hparams.items()}


def test_hparams_tell_policies_and_inplace_abn_apart(tmp_path):
    base = ("model.args.dropout=0.0", "model.args.activation=leaky_relu", "train.max_steps=4")
    on = Trainer(tiny_config(tmp_path, "inplace=on", *base)).fit()
    abn = Trainer(tiny_config(tmp_path, "inplace=on", "model.args.norm=inplace_abn", *base)).fit()
    off = Trainer(tiny_config(tmp_path, "inplace=off", "model.args.norm=inplace_abn", *base)).fit()
    names = [os.path.basename(r.run_dir) for r in (on, abn, off)]
    assert names == ["inplace-on_np1", "inplace-on_np1_inplace_abn", "inplace-off_np1_inplace_abn"]
    hps = [session_hparams(r.run_dir) for r in (on, abn, off)]
    for name, hp in zip(names, hps):
        assert hp["run"] == name  # the whole name, as a column of its own
        assert set(hp) == {
            "run",
            "inplace",
            "inplace_abn",
            "compiled",
            "recompute",
            "conv2d",
            "conv_math",
            "precision",
            "zero",
            "accumulate",
            "processes",
            "model",
            "batch_size",
            "optimizer",
            "lr",
        }
        assert hp["compiled"] is False and hp["conv2d"] == "auto" and hp["conv_math"] == "fp32"
        assert hp["recompute"] == "none"
        assert hp["precision"] == "fp32"
        assert hp["processes"] == 1 and hp["model"] == "mlp" and hp["batch_size"] == 32
        assert hp["zero"] == 0 and hp["accumulate"] == 1
    # inplace, the column TensorBoard shows by default, names InPlace-ABN too.
    assert [(hp["inplace"], hp["inplace_abn"]) for hp in hps] == [("on", False), ("on+abn", True), ("off+abn", True)]
    assert [r.policy for r in (on, abn, off)] == ["on", "on+abn", "off+abn"]


def test_a_compile_switch_in_the_config_shows_in_hparams_and_the_run_name(tmp_path):
    from trainers.config import Config
    from trainers.trainer import compiled

    cfg = tiny_config(tmp_path, "inplace=on", "train.max_steps=2")
    assert compiled(cfg) is False  # the schema's default
    with_key = Config({**cfg.to_dict(), "compile": True})
    assert compiled(with_key) is True
    trainer = Trainer(with_key)
    assert trainer.run_name == "inplace-on_np1_compiled"
    assert trainer.hparams()["compiled"] is True
    assert Trainer(cfg).hparams()["compiled"] is False
    no_key = {k: v for k, v in cfg.to_dict().items() if k != "compile"}  # a config from before the key
    assert compiled(Config(no_key)) is None


def test_the_conv2d_setting_chooses_the_algorithms_and_names_the_run(tmp_path):
    from framework.ops import conv as conv_ops
    from trainers.config import Config
    from trainers.trainer import conv2d_mode

    cfg = tiny_config(tmp_path, "inplace=on", "train.max_steps=2")
    assert conv2d_mode(cfg) == "auto"  # the schema's default
    fast = tiny_config(tmp_path, "inplace=on", "train.max_steps=2", "conv2d=fast")
    trainer = Trainer(fast)
    assert conv_ops.get_contraction() == "fast"
    assert trainer.run_name == "inplace-on_np1_conv-fast" and trainer.hparams()["conv2d"] == "fast"
    plain = Trainer(cfg)
    assert conv_ops.get_contraction() == "auto" and plain.run_name == "inplace-on_np1"
    trainer.time_steps(1)  # trainers taking turns in one process each run under their own setting
    assert conv_ops.get_contraction() == "fast"
    no_key = {k: v for k, v in cfg.to_dict().items() if k != "conv2d"}  # a config from before the key
    assert conv2d_mode(Config(no_key)) == "auto"


def test_the_conv_math_setting_chooses_tf32_only_when_asked_and_names_the_run(tmp_path):
    from framework.ops import conv as conv_ops
    from trainers.config import Config
    from trainers.trainer import conv_math

    cfg = tiny_config(tmp_path, "inplace=on", "train.max_steps=2")
    assert conv_math(cfg) == "fp32"  # the schema's default
    tf32 = tiny_config(tmp_path, "inplace=on", "train.max_steps=2", "conv_math=tf32")
    trainer = Trainer(tf32)
    assert conv_ops.get_math_mode() == "tf32"
    assert trainer.run_name == "inplace-on_np1_conv-tf32" and trainer.hparams()["conv_math"] == "tf32"
    plain = Trainer(cfg)
    assert conv_ops.get_math_mode() == "fp32" and plain.run_name == "inplace-on_np1"
    assert plain.hparams()["conv_math"] == "fp32"
    trainer.time_steps(1)  # trainers taking turns in one process each run under their own setting
    assert conv_ops.get_math_mode() == "tf32"
    no_key = {k: v for k, v in cfg.to_dict().items() if k != "conv_math"}  # a config from before the key
    assert conv_math(Config(no_key)) == "fp32"


def test_checking_the_model_against_the_data_leaves_nothing_allocated(tmp_path):
    # One training sample goes through the model before training: it must be a copy, as
    # a tensor of a view of the data set would keep the whole data set counted as live
    # memory (it once added the 24 MiB of ResNet-20's training images to every peak).
    import gc

    from framework import memory

    gc.collect()
    before = memory.allocated_bytes()
    trainer = Trainer(tiny_config(tmp_path, "model.args.dropout=0.0"))
    gc.collect()
    assert memory.allocated_bytes() - before == sum(p.nbytes for p in trainer.params)


def test_final_loss_is_the_last_logged_loss_and_the_dashboard_opens_on_memory(tmp_path):
    result = Trainer(tiny_config(tmp_path, "train.log_every=3")).fit()  # 8 steps: windows of 3, 3, 2
    scalars = read_scalars(result.run_dir)
    assert scalars["train/loss"][-1][0] == 8
    assert result.final_loss == pytest.approx(scalars["train/loss"][-1][1])
    assert result.final_loss == pytest.approx(sum(result.losses[-2:]) / 2)
    assert scalars["summary/final_loss"][-1][1] == pytest.approx(result.final_loss)
    from tensorboard.plugins.custom_scalar import layout_pb2

    (event,) = accumulator(result.run_dir).Tensors("custom_scalars__config__")
    first = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0]).category[0]
    assert [list(c.multiline.tag) for c in first.chart][:3] == [
        [r"^memory/peak_mb$"],
        [r"^memory/floor_mb$"],
        [r"^perf/samples_per_sec$"],
    ]
