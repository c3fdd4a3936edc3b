"""The models' recompute modes (the config's ``recompute``): a ResNet per basic block
(``full``; ``selective``: its convolutions' outputs kept), a GPT per Transformer block
(``full``; ``selective``: the attention core, Korthikanti et al.'s). Under every inplace
policy the losses, gradients and BatchNorm's running statistics are bit for bit those
without recomputation (dropout on); each mode keeps less for backward; the trainer takes
the key, names the run after it, and refuses it where it cannot apply."""

from __future__ import annotations

import numpy as np
import pytest

import framework as fw
from framework import memory
from framework.autograd.saved import held_bytes, saved_tensors
from models import GPT, MLP, ResNet
from models.layers import set_recompute
from scripts import compare_inplace
from tests.trainers.test_trainer import tiny_config
from trainers.config import ConfigError
from trainers.trainer import Trainer

GPT_SMALL = dict(vocab_size=23, block_size=12, n_layer=2, n_head=2, n_embd=16, dropout=0.2)


def _gpt_step(policy, mode, **kwargs):
    with fw.inplace.policy(policy):
        fw.manual_seed(0)
        model = GPT(**{**GPT_SMALL, **kwargs})
        set_recompute(model, mode)
        rng = np.random.default_rng(0)
        idx, targets = (fw.tensor(rng.integers(0, 23, (3, 12))) for _ in range(2))
        fw.manual_seed(1)
        _, loss = model(idx, targets)
        held = held_bytes(saved_tensors(loss))
        loss.backward()
    return loss.item(), [p.grad.numpy().copy() for p in model.parameters()], held


def _resnet_step(policy, mode, norm="bn"):
    with fw.inplace.policy(policy):
        fw.manual_seed(0)
        model = ResNet(depth=8, width=4, num_classes=3, norm=norm)
        set_recompute(model, mode)
        fw.manual_seed(1)
        x = fw.randn(4, 3, 8, 8)
        loss = fw.nn.functional.cross_entropy(model(x), fw.tensor([0, 1, 2, 1]))
        held = held_bytes(saved_tensors(loss))
        loss.backward()
    grads = [p.grad.numpy().copy() for p in model.parameters()]
    return loss.item(), grads + [b.numpy().copy() for b in model.buffers()], held


@pytest.fixture
def prove_every_tensor():
    prev = fw.inplace.set_auto_min_bytes(0)
    yield
    fw.inplace.set_auto_min_bytes(prev)


def _assert_same(got, ref, what):
    assert got[0] == ref[0], what
    for a, b in zip(got[1], ref[1], strict=True):
        np.testing.assert_array_equal(a, b, err_msg=what)


@pytest.mark.parametrize("attention", ["math", "fused"])
def test_gpt_recompute_changes_no_number_and_keeps_less(attention, prove_every_tensor):
    ref = _gpt_step("off", "none", attention=attention)
    held = {}
    for mode in ("full", "selective"):
        for policy in ("off", "auto", "on"):
            got = _gpt_step(policy, mode, attention=attention)
            _assert_same(got, ref, f"{mode} {policy}")
            held[mode] = got[2]
    assert held["full"] < held["selective"] < ref[2]


@pytest.mark.parametrize("norm", ["bn", "inplace_abn"])
def test_resnet_recompute_changes_no_number_and_keeps_less(norm, prove_every_tensor):
    ref = _resnet_step("off", "none", norm)
    for policy in ("off", "auto", "on"):
        none = _resnet_step(policy, "none", norm)
        held = {}
        for mode in ("full", "selective"):
            got = _resnet_step(policy, mode, norm)
            if norm == "bn":
                _assert_same(got, ref, f"{mode} {policy}")
            else:  # InPlace-ABN in place (on, auto) rebuilds x_hat from its output: equal to rounding
                assert got[0] == pytest.approx(ref[0], rel=1e-6)
                _assert_same(got, none, f"{mode} {policy}")
            held[mode] = got[2]
        assert held["full"] < none[2], policy
        if norm == "bn":
            assert held["full"] < held["selective"] < none[2], policy
        # With InPlace-ABN, selective keeps the convolutions' outputs that the ABN sites would
        # write over (they then write out of place): docs/RECOMPUTE.md


def test_a_model_without_blocks_refuses_recompute():
    with pytest.raises(ValueError, match="recompute: full needs a model made of blocks"):
        set_recompute(MLP(in_features=4, num_classes=2), "full")
    set_recompute(MLP(in_features=4, num_classes=2), "none")
    with pytest.raises(ValueError, match="recompute must be one of"):
        set_recompute(GPT(**GPT_SMALL), "partial")


def test_the_trainer_takes_the_key(tmp_path):
    cfg = tiny_config(tmp_path, "recompute=full", "model.name=resnet8", "model.args={width: 4}", "train.max_steps=2")
    trainer = Trainer(cfg)
    assert trainer.run_name.endswith("_recompute-full")
    assert trainer.hparams()["recompute"] == "full"
    assert all(block.recompute == "full" for block in trainer.model.layers)
    memory.reset_stats()
    trainer.time_steps(1)
    assert memory.stats()["recompute_runs"] == len(trainer.model.layers)
    with pytest.raises(ConfigError, match="recompute: selective needs a model made of blocks"):
        Trainer(tiny_config(tmp_path, "recompute=selective"))
    with pytest.raises(ConfigError, match="compile: true cannot run a checkpointed model"):
        Trainer(tiny_config(tmp_path, "recompute=full", "compile=true", "model.name=resnet8"))


def test_compare_inplace_takes_the_recompute_variants():
    assert compare_inplace.variant("auto+full") == ("auto", ["recompute=full"])
    assert compare_inplace.variant("on+fused+selective") == (
        "on",
        ["model.args.attention=fused", "recompute=selective"],
    )
    assert compare_inplace.variant("auto+full+selective") is None
