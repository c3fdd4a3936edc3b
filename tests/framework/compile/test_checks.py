"""A loss's target check (and an embedding's index check) runs at every call of a
compiled step, as in eager.

``cross_entropy`` checks that class indices lie in ``[0, C)`` before its op runs: Python
that a replay does not run, so the capture records it (a ``check`` node). On the CPU it
raises in the call, as eager does. On a GPU eager defers it (a device flag, read at
``check_targets()``, the trainer's log points: nothing is read back inside a step), and
so does a replay, its CUDA graph included: the graph keeps the first bad target it meets
in a flag of its own. ``embedding`` checks its row indices with the same check (its
``"Index"`` message); CuPy wraps an out-of-range index around, so on a GPU the loss stays
finite and only the deferred check tells.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import framework as fw
import framework.nn.functional as F
from framework.ops.loss import check_targets
from tests.conftest import CUPY_CHOICE, requires_gpu

from .helpers import batches, make_model, train_step

BAD_STEP, BAD_TARGET = 6, 12  # after two captures, the recorded replay and two graph launches


def _batches(bad_step=BAD_STEP):
    out = batches("mlp", 10)
    if bad_step is not None:
        y = out[bad_step][1].numpy().copy()
        y[3] = BAD_TARGET
        out[bad_step] = (out[bad_step][0], fw.from_numpy(y))
    return out


def _model_step(device, compiled):
    fw.inplace.set_policy("off")
    model = make_model("mlp").to(device)
    opt = fw.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = train_step(model, opt)
    return fw.compile(step) if compiled else step


MESSAGE = re.escape(f"cross_entropy: Target {BAD_TARGET} is out of bounds: class indices must be in [0, 9]")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_out_of_range_target_raises_in_the_call_on_the_cpu(compiled):
    f = _model_step("cpu", compiled)
    data = _batches()
    for x, y in data[:BAD_STEP]:
        f(x, y)
    with pytest.raises(IndexError, match=MESSAGE):
        f(*data[BAD_STEP])
    if compiled:
        assert f.report()["replays"] == BAD_STEP - 2  # the bad step was a replay
        assert any(n.name == "target_check" for n in f.program.nodes)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_out_of_range_target_on_a_gpu_is_raised_by_check_targets(compiled):
    check_targets()  # nothing pending from earlier tests
    f = _model_step("cuda", compiled)
    data = _batches()
    losses = [f(x.to("cuda"), y.to("cuda")).detach().cpu().numpy() for x, y in data[:BAD_STEP]]
    check_targets()  # good targets: nothing raised
    bad_loss = f(*(t.to("cuda") for t in data[BAD_STEP])).detach().cpu().numpy()
    assert np.isnan(bad_loss) and all(np.isfinite(v) for v in losses)  # the NaN at once, as eager
    with pytest.raises(IndexError, match=MESSAGE):
        check_targets()
    for x, y in data[BAD_STEP + 1 :]:
        f(x.to("cuda"), y.to("cuda"))
    check_targets()  # read and cleared: later good steps raise nothing
    if compiled:
        graph = f._current().executor.cuda_graph
        assert f.report()["replay_mode"] == "cuda graph" and graph.launches == len(data) - 3


@pytest.mark.gpu
@requires_gpu
@pytest.mark.skipif(CUPY_CHOICE != "standin", reason="counts host synchronizations with the CuPy stand-in")
def test_the_graphs_target_check_reads_nothing_back_inside_the_step():
    from framework.testing.cupy_standin import counting

    check_targets()
    f = _model_step("cuda", True)
    data = _batches(bad_step=None)
    for x, y in data[:5]:
        f(x.to("cuda"), y.to("cuda"))
    x, y = (t.to("cuda") for t in data[5])
    with counting.count() as c:
        f(x, y)
    assert c.host_syncs == 0 and c.by_kind() == {"copy": 3, "h2d": 1, "graph": 1}
    with counting.count() as c:
        check_targets()
    assert c.host_syncs == 1  # one transfer for every pending check


# --- embedding's row indices --------------------------------------------------------------------

VOCAB, BAD_INDEX = 10, 13
INDEX_MESSAGE = re.escape(f"embedding: index {BAD_INDEX} out of range in self: indices must be in [0, {VOCAB - 1}]")


def _token_batches(bad_step=BAD_STEP):
    rng = np.random.default_rng(2)
    out = []
    for i in range(10):
        idx, y = rng.integers(0, VOCAB, (4, 5)), rng.integers(0, VOCAB, (4, 5))
        if i == bad_step:
            idx[2, 3] = BAD_INDEX
        out.append((fw.from_numpy(idx), fw.from_numpy(y)))
    return out


def _embedding_step(device, compiled):
    """A token model's step: embedding, a linear head, cross entropy (two checks: the indices
    and the targets), SGD."""
    fw.inplace.set_policy("off")
    fw.manual_seed(0)
    emb, head = fw.nn.Embedding(VOCAB, 8).to(device), fw.nn.Linear(8, VOCAB).to(device)
    opt = fw.optim.SGD(list(emb.parameters()) + list(head.parameters()), lr=0.05, momentum=0.9)

    def step(idx, y):
        opt.zero_grad()
        loss = F.cross_entropy(head(emb(idx)).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        return loss

    return fw.compile(step) if compiled else step


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_out_of_range_embedding_index_raises_in_the_call_on_the_cpu(compiled):
    f = _embedding_step("cpu", compiled)
    data = _token_batches()
    for idx, y in data[:BAD_STEP]:
        f(idx, y)
    with pytest.raises(IndexError, match=INDEX_MESSAGE):
        f(*data[BAD_STEP])
    if compiled:
        assert f.report()["replays"] == BAD_STEP - 2  # the bad step was a replay
        assert sum(n.name == "target_check" for n in f.program.nodes) == 2  # the indices' and the targets'


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_out_of_range_embedding_index_on_a_gpu_is_raised_by_check_targets(compiled):
    check_targets()  # nothing pending from earlier tests
    f = _embedding_step("cuda", compiled)
    data = _token_batches()
    losses = [f(idx.to("cuda"), y.to("cuda")).detach().cpu().numpy() for idx, y in data[: BAD_STEP + 1]]
    assert all(np.isfinite(v) for v in losses)  # CuPy wraps the index around: nothing shows but the check
    with pytest.raises(IndexError, match=INDEX_MESSAGE):
        check_targets()
    for idx, y in data[BAD_STEP + 1 :]:
        f(idx.to("cuda"), y.to("cuda"))
    check_targets()  # read and cleared: later good steps raise nothing
    if compiled:
        graph = f._current().executor.cuda_graph
        assert f.report()["replay_mode"] == "cuda graph" and graph.launches == len(data) - 3
