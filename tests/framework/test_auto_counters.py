"""Policy auto's counters count every write it runs in place: not only the ops it proves
dead, but also the writes over the framework's own buffers (gradient accumulation,
backward writing over its incoming gradient, optimizer updates, linear's bias), so that
``inplace/auto_saved_mb_per_step`` covers the memory auto saves against off."""

import os

import pytest

import framework as fw
from framework import memory
from trainers.config import load_config
from trainers.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def counted(fn, policy):
    with fw.inplace.policy(policy):
        memory.reset_stats()
        fn()
        return {k: v for k, v in memory.stats().items() if k.startswith(("auto_inplace", "auto_owned"))}


def test_gradient_accumulation_is_counted_under_auto_only():
    x = fw.randn(64, 64, requires_grad=True)

    def two_backwards():
        x.grad = None
        (x * 2).sum().backward()
        (x * 3).sum().backward()  # summed into x.grad's buffer in place under auto and on

    assert counted(two_backwards, "auto") == {"auto_owned_ops.grad_accumulation": 1, "auto_owned_bytes": x.nbytes}
    assert counted(two_backwards, "on") == {}
    assert counted(two_backwards, "off") == {}


def test_optimizer_updates_are_counted_with_the_bytes_they_wrote_over():
    w = fw.randn(32, 16, requires_grad=True)
    opt = fw.optim.SGD([w], lr=0.1, momentum=0.9)

    def step():
        opt.zero_grad()
        (w * w).sum().backward()
        opt.step()

    counted(step, "auto")  # the first step creates the momentum buffer
    stats = counted(step, "auto")
    # Momentum buffer: scaled, then added to; the parameter: added to. Three buffers of w's size.
    assert stats["auto_owned_ops.optimizer"] == 3
    assert stats["auto_owned_bytes"] >= 3 * w.nbytes
    assert counted(step, "off") == {}


@pytest.mark.slow
def test_auto_counter_covers_the_peak_auto_saves_on_the_digits_mlp(tmp_path):
    """On the quickstart MLP every tensor is below auto's proof threshold, yet auto's peak
    is lower than off's: the saving comes from the owned-buffer sites, and the counter
    must account for at least that much per step."""
    results = {}
    for policy in ("off", "auto"):
        cfg = load_config(
            os.path.join(ROOT, "configs", "quickstart.yaml"),
            [
                f"inplace={policy}",
                "train.max_steps=12",
                "train.log_every=4",
                "logging.progress=false",
                "logging.timeline=false",
                f"logging.logdir={tmp_path / 'runs'}",
                f"checkpoint.dir={tmp_path / 'ckpt'}",
            ],
        )
        results[policy] = Trainer(cfg).fit()
    off, auto = results["off"], results["auto"]
    assert off.auto_saved_mb_per_step == 0
    assert auto.peak_mb < off.peak_mb
    assert auto.auto_saved_mb_per_step >= off.peak_mb - auto.peak_mb
