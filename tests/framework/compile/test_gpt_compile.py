"""The GPT's training step compiled (fw.compile): bitwise equal to eager ``off`` on the
CPU and on a GPU, where it replays as one CUDA graph (on the CuPy stand-in, which refuses
what a capture may not do), with dropout, AdamW's parameter groups and a learning rate
that changes every step."""

from __future__ import annotations

import numpy as np
import pytest

import framework as fw
import framework.nn.functional as F
from models import GPT
from tests.conftest import requires_gpu
from trainers.config import config_from_dict
from trainers.trainer import build_optimizer

from .helpers import bitwise_equal, snapshot

SHAPE = dict(vocab_size=17, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.1)
OPTIM = config_from_dict({"optim": {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1, "decay": "matrices"}})
KNOBS = [dict(attention="math"), dict(attention="fused", layer_norm="memory_efficient")]


def _run(device, compiled, steps, policy="off", **knobs):
    fw.inplace.set_policy(policy)
    fw.manual_seed(0)
    model = GPT(**SHAPE, **knobs).to(device)
    opt = build_optimizer(OPTIM, list(model.parameters()))

    def step(x, y, lr):
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
        loss.backward()
        opt.step()
        return loss

    f = fw.compile(step) if compiled else step
    rng = np.random.default_rng(1)
    fw.manual_seed(5)  # the dropout masks: the same draws in both runs
    losses, states = [], []
    for k in range(steps):
        x, y = (fw.tensor(rng.integers(0, 17, (3, 8)), device=device) for _ in range(2))
        losses.append(f(x, y, 1e-2 / (1 + k)).detach().cpu().numpy().copy())
        states.append(snapshot(model, opt))
    return losses, states, f


def _assert_bitwise(eager, compiled):
    for k, (a, b) in enumerate(zip(eager[0], compiled[0])):
        assert a.tobytes() == b.tobytes(), f"loss differs at step {k}"
    for k, (a, b) in enumerate(zip(eager[1], compiled[1])):
        assert bitwise_equal(a, b), f"state differs at step {k}"


@pytest.mark.parametrize("knobs", KNOBS, ids=["math", "fused+meln"])
@pytest.mark.parametrize("policy", ["off", "auto"])
def test_compiled_gpt_step_matches_eager_off_bitwise(knobs, policy):
    _assert_bitwise(_run("cpu", False, 6, **knobs), _run("cpu", True, 6, policy, **knobs))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("knobs", KNOBS, ids=["math", "fused+meln"])
def test_compiled_gpt_step_on_the_gpu_is_one_cuda_graph_bitwise_equal_to_eager_off(knobs):
    steps = 6
    eager = _run("cuda", False, steps, **knobs)
    compiled = _run("cuda", True, steps, **knobs)
    _assert_bitwise(eager, compiled)
    f = compiled[2]
    assert f.report()["replay_mode"] == "cuda graph"
    graph = f._current().executor.cuda_graph
    assert graph.captures == 1 and graph.uncaptured == 0 and graph.launches >= 1
