"""``precision: fp32 | bf16 | fp16`` in the trainer: autocast around forward and loss, the
GradScaler with fp16 (its state in checkpoints), the run name, the logs, and the settings
that stop a run with one line."""

from __future__ import annotations

import numpy as np
import pytest

import framework as fw
from framework import backend
from tests.trainers.test_trainer import tiny_config
from trainers.checkpoint import list_checkpoints, load_checkpoint
from trainers.config import ConfigError
from trainers.logging import read_scalars
from trainers.trainer import Trainer

BN_MLP = ("model.args.norm=bn",)  # the MLP with BatchNorm: half-type activations through every kind of op


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_mixed_precision_run_logs_as_any_run_and_names_its_precision(tmp_path, precision):
    trainer = Trainer(tiny_config(tmp_path, f"precision={precision}", *BN_MLP))
    result = trainer.fit()
    assert result.run_dir.endswith(f"inplace-auto_np1_{precision}")
    assert trainer.hparams()["precision"] == precision
    assert all(np.isfinite(result.losses))
    assert {p.dtype for p in trainer.model.parameters()} == {np.dtype(np.float32)}  # parameters stay float32
    scalars = read_scalars(result.run_dir)
    for tag in ("train/loss", "memory/peak_mb", "memory/floor_mb", "perf/samples_per_sec", "eval/accuracy"):
        assert scalars[tag], tag
    assert ("train/loss_scale" in scalars) == (precision == "fp16")


def test_fp16_saves_the_scaler_and_resumes_exactly(tmp_path):
    cfg = tiny_config(tmp_path, "precision=fp16", *BN_MLP)
    full = Trainer(cfg).fit()
    ckpts = list_checkpoints(str(tmp_path / "ckpt" / "tiny" / "inplace-auto_np1_fp16"))
    state = load_checkpoint(ckpts[0][1])
    saved = state["scaler"]
    assert set(saved) == {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
    resumed = Trainer(tiny_config(tmp_path, "precision=fp16", *BN_MLP), resume=ckpts[0][1])
    assert resumed.scaler.state_dict() == saved
    assert resumed.fit().losses == full.losses[4:]  # bit for bit


def test_fp16_skips_a_step_with_inf_gradients_and_backs_off(tmp_path):
    """A scale that overflows float16's gradients: the step is skipped (the parameters
    stay), the scale halves, the run goes on."""
    trainer = Trainer(tiny_config(tmp_path, "precision=fp16", "train.max_steps=1", *BN_MLP))
    trainer.scaler = fw.amp.GradScaler("cpu", init_scale=2.0**100)  # float16's backward overflows
    before = [p.detach().numpy().copy() for p in trainer.model.parameters()]
    trainer.fit()
    assert trainer.scaler.get_scale() == 2.0**99
    for p, b in zip(trainer.model.parameters(), before):
        np.testing.assert_array_equal(p.detach().numpy(), b)


def test_every_policy_gives_the_same_numbers_in_bf16(tmp_path):
    runs = {}
    for policy in ("off", "auto", "on"):
        (tmp_path / policy).mkdir()
        runs[policy] = Trainer(tiny_config(tmp_path / policy, "precision=bf16", f"inplace={policy}", *BN_MLP)).fit()
    assert runs["auto"].losses == runs["off"].losses == runs["on"].losses


def test_precision_cannot_run_compiled(tmp_path):
    with pytest.raises(ConfigError, match="precision: bf16 cannot run compiled"):
        Trainer(tiny_config(tmp_path, "precision=bf16", "compile=true"))


def test_fp16_with_zero_is_a_config_error(tmp_path):
    from trainers.trainer import _check_precision  # noqa: PLC0415  (the check alone: ZeRO needs ranks)

    cfg = tiny_config(tmp_path, "precision=fp16", "distributed.zero=2")
    with pytest.raises(ConfigError, match="precision: fp16 does not run with distributed.zero: 2"):
        _check_precision("fp16", cfg, backend.device("cpu"))
    _check_precision("bf16", cfg, backend.device("cpu"))  # bf16 has no scaler


def test_fp16_scales_every_micro_batch_and_steps_once(tmp_path):
    """train.accumulate: each micro-batch's backward is scaled, the sum unscaled once at the
    step (PyTorch's recipe); the run name shows both."""
    trainer = Trainer(tiny_config(tmp_path, "precision=fp16", "train.accumulate=2", "train.max_steps=3", *BN_MLP))
    result = trainer.fit()
    assert result.run_dir.endswith("_acc2_fp16") and all(np.isfinite(result.losses))
    assert trainer.scaler.get_scale() == 2.0**16


@pytest.mark.gpu
def test_bf16_on_a_gpu_before_ampere_is_a_config_error(tmp_path, monkeypatch, gpu_run):
    real = backend.device_properties

    def turing(dev):
        return {**real(dev), "compute_capability": (7, 5)}

    monkeypatch.setattr(backend, "device_properties", turing)
    with pytest.raises(ConfigError, match="bf16 needs a GPU of compute capability 8.0 or later.*is 7.5"):
        Trainer(tiny_config(tmp_path, "precision=bf16", "device=cuda", *BN_MLP))
    Trainer(tiny_config(tmp_path, "precision=fp16", "device=cuda", *BN_MLP))  # fp16 runs there


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_the_gpu_leg(tmp_path, precision, gpu_run):
    trainer = Trainer(tiny_config(tmp_path, f"precision={precision}", "device=cuda", *BN_MLP))
    result = trainer.fit()
    assert all(np.isfinite(result.losses))
    assert {p.dtype for p in trainer.model.parameters()} == {np.dtype(np.float32)}
