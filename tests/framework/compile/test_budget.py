"""``fw.compile(step, memory_budget=b)``: backward recomputes forward values instead of
keeping them, bitwise eager ``off`` at every budget and under every policy, with a floor
that falls as the budget falls (framework/compile/recompute.py, docs/COMPILE.md "A memory
budget")."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

import framework as fw
import framework.nn.functional as F
from framework.compile import plan as P
from framework.compile import recompute as R
from framework.ops import dropout as D
from framework.ops import elementwise as E
from models import GPT
from tests.conftest import requires_gpu

from .helpers import bitwise_equal, make_model, run, snapshot
from .test_passes import Builder

BUDGETS = (1.0, 0.75, 0.5, 0.25, 0.0)
STEPS = 3  # captured twice (the first step makes the optimizer state), then replayed
GPT_SHAPE = dict(vocab_size=17, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.1)


def _gpt_run(policy, compiled, steps, device="cpu", **compile_kw):
    """One GPT block (with its embeddings and head), dropout 0.1, AdamW."""
    fw.inplace.set_policy(policy)
    fw.manual_seed(0)
    model = GPT(**GPT_SHAPE).to(device)
    opt = fw.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def step(x, y):
        opt.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
        loss.backward()
        opt.step()
        return loss

    f = fw.compile(step, **compile_kw) if compiled else step
    rng = np.random.default_rng(1)
    fw.manual_seed(5)  # the dropout masks: the same draws in every run
    losses, states = [], []
    for _ in range(steps):
        x, y = (fw.tensor(rng.integers(0, 17, (2, 8)), device=device) for _ in range(2))
        losses.append(f(x, y).detach().cpu().numpy().copy())
        states.append(snapshot(model, opt))
    return losses, states, f


MODELS = {
    "mlp": lambda policy, compiled, **kw: run("mlp", policy, compiled, STEPS, **kw),  # dropout 0.1
    "resnet": lambda policy, compiled, **kw: run("resnet", policy, compiled, STEPS, "bn", **kw),
    "gpt": lambda policy, compiled, **kw: _gpt_run(policy, compiled, STEPS, **kw),
}
_EAGER = {}


def _eager_off(model):
    if model not in _EAGER:
        _EAGER[model] = MODELS[model]("off", False)[:2]
    return _EAGER[model]


def _assert_bitwise(eager, compiled):
    for k, (a, b) in enumerate(zip(eager[0], compiled[0])):
        assert a.tobytes() == b.tobytes(), f"loss differs at step {k}"
    for k, (a, b) in enumerate(zip(eager[1], compiled[1])):
        assert bitwise_equal(a, b), f"parameters, gradients or optimizer state differ after step {k}"


@pytest.mark.parametrize("policy", ["off", "auto", "on"])
@pytest.mark.parametrize("model", ["mlp", "resnet", "gpt"])
def test_every_budget_replays_bitwise_eager_off_and_the_floor_falls_with_it(model, policy):
    eager = _eager_off(model)
    floors, saved = [], []
    for budget in BUDGETS:
        losses, states, f = MODELS[model](policy, True, memory_budget=budget)
        _assert_bitwise(eager, (losses, states))
        r = f.report()
        assert r["replays"] >= 1 and r["memory_budget"] == budget
        if budget == 1.0:  # the program as captured
            assert r["recomputed"] == [] and r["saved_bytes_least"] is None
        else:  # what the pass chose is what the plan counts, and it fits the budget
            least, most = r["saved_bytes_least"], r["saved_bytes_eager"]
            assert r["saved_bytes"] == f._current().recompute.kept_bytes <= least + budget * (most - least)
            assert r["recomputed"] and most == saved[0]
        if model == "resnet" and budget == 0.0:  # the shortcut's zero padding is made again too
            assert "zeros" in {row["op"] for row in r["recomputed"]}
        floors.append(r["floor_bytes"])
        saved.append(r["saved_bytes"])
    assert floors == sorted(floors, reverse=True), f"the floor does not fall with the budget: {floors}"
    assert saved[-1] < saved[0] and floors[-1] < floors[0]


def test_dropout_is_kept_and_what_follows_it_is_recomputed_from_the_same_mask():
    # the MLP's dropout (p=0.1) feeds the next Linear: at budget 0 that Linear runs again on
    # the dropout's kept output, bitwise eager (above); the dropout itself never runs again
    losses, states, f = MODELS["mlp"]("off", True, memory_budget=0.0)
    program = f.program
    recomputed = [n for n in program.nodes if "recomputes" in n.info]
    assert recomputed and not any(n.op is D.Dropout for n in recomputed)
    dropped = {n.outputs[0] for n in program.nodes if n.kind == "call" and n.op is D.Dropout}
    assert any(t.id in dropped for n in recomputed for t in n.inputs if hasattr(t, "id"))
    assert f._current().recompute.banned == {"draws random numbers": 2}
    # the GPT's attention dropout sits inside the recomputed attention: still bitwise
    _assert_bitwise(_eager_off("gpt"), MODELS["gpt"]("off", True, memory_budget=0.0)[:2])


def test_an_inplace_chain_is_recomputed_out_of_place_from_what_is_still_there():
    # under policy on, ResNet's relu_ and residual add_ write over BatchNorm's output: what
    # backward reads is the last version; recomputing it runs BatchNorm, add and ReLU again
    # out of place (the first versions are gone), and the verifier checks no read is stale
    losses, states, f = run("resnet", "on", True, STEPS, "bn", memory_budget=0.5)
    _assert_bitwise(_eager_off("resnet"), (losses, states))
    program = f.program
    originals = {n.info["recomputes"] for n in program.nodes if "recomputes" in n.info}
    captured_inplace = [r["op"] for r in f.report()["recomputed"] if r["op"] in ("Relu", "Add")]
    assert originals and captured_inplace
    assert all(not n.inplace or n.reinplaced for n in program.nodes if "recomputes" in n.info)


def test_fused_attention_and_memory_efficient_layer_norm_recompute_bitwise():
    def gpt(policy, compiled, **kw):
        fw.inplace.set_policy(policy)
        fw.manual_seed(0)
        model = GPT(**GPT_SHAPE, attention="fused", layer_norm="memory_efficient")
        opt = fw.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def step(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x).view(-1, 17), y.view(-1))
            loss.backward()
            opt.step()
            return loss

        f = fw.compile(step, **kw) if compiled else step
        rng = np.random.default_rng(1)
        fw.manual_seed(5)
        out = []
        for _ in range(STEPS):
            x, y = (fw.tensor(rng.integers(0, 17, (2, 8))) for _ in range(2))
            out.append(f(x, y).detach().numpy().copy())
        return out, [snapshot(model, opt)], f

    eager = gpt("off", False)
    compiled = gpt("auto", True, memory_budget=0.0)
    _assert_bitwise(eager[:2], compiled[:2])
    # fused attention with dropout draws random numbers: kept, not run again
    assert compiled[2]._current().recompute.banned["draws random numbers"] >= 1


# --- the pass on small programs --------------------------------------------------------------


def _backward_region(b, *pairs):
    """A backward node for each (forward value, its saved values) after a root gradient."""
    g = b.input("g")
    for value in pairs:
        b.backward(value, g)


def test_a_value_written_over_in_place_is_recomputed_from_its_first_version_not_read_stale():
    # y = neg(w); relu_(y) writes over y; relu's backward reads its result. At budget 0 the
    # result is made again as relu(neg(w)), out of place: y's first version is gone.
    b = Builder()
    x = b.input("w", kind="param", obj=object())  # a parameter: kept anyway, it costs nothing
    y = b.op(E.Neg, x)
    y2 = b.op(E.Relu, y, inplace=True)
    b.p.nodes[-1].info["saved"] = {"result": y2}
    _backward_region(b, y2)
    R.rematerialize(b.p, 0.0)
    names = [(n.name, n.inplace, "recomputes" in n.info) for n in b.p.nodes]
    assert names[:2] == [("Neg", False, False), ("relu_", True, False)]
    assert names[2:4] == [("Neg", False, True), ("Relu", False, True)]  # out of place, before backward
    bw = b.p.nodes[-1]
    relu_copy = b.p.nodes[3]
    assert bw.info["fwd"] == relu_copy.index and bw.info["saved_values"] == [relu_copy.outputs[0]]
    P.verify(b.p, P.plan_memory(b.p))  # no read after a later write


def test_a_random_op_is_kept_and_only_what_follows_it_runs_again():
    # d = dropout(w) (one value), e = d + v (four), f = exp(e), g = exp(f), each exp saving its
    # result: at budget 0 backward keeps d and runs the add and both exps again from it;
    # the dropout never runs twice
    b = Builder()
    w = b.input("w", shape=(1,), kind="param", obj=object())
    v = b.input("v", kind="param", obj=object())
    d = b.op(D.Dropout, w, p=0.5, shape=(1,))
    e = b.op(E.Add, d, v, alpha=1)
    f = b.op(E.Exp, e)
    b.p.nodes[-1].info["saved"] = {"result": f}
    g = b.op(E.Exp, f)
    b.p.nodes[-1].info["saved"] = {"result": g}
    _backward_region(b, g, f)
    rc = R.rematerialize(b.p, 0.0)
    copies = [n for n in b.p.nodes if "recomputes" in n.info]
    assert [n.op for n in copies] == [E.Add, E.Exp, E.Exp] and copies[0].inputs[0].id == d
    assert (rc.eager_bytes, rc.kept_bytes) == (32, 4)  # f and g kept eagerly; d instead
    assert rc.banned == {}  # backward reads nothing random itself


def test_budget_one_and_a_step_without_backward_change_nothing():
    b = Builder()
    x = b.input("x")
    e = b.op(E.Exp, x)
    b.p.nodes[-1].info["saved"] = {"result": e}
    _backward_region(b, e)
    before = [n.name for n in b.p.nodes]
    assert R.rematerialize(b.p, 1.0).nodes == 0 and [n.name for n in b.p.nodes] == before
    b2 = Builder()
    b2.op(E.Exp, b2.input("x"))
    assert R.rematerialize(b2.p, 0.0).why == "the step has no backward"


def test_the_cost_model_counts_products_and_passes():
    b = Builder()
    x = b.input("x", shape=(8, 32))
    w = b.input("w", shape=(16, 32), kind="param", obj=object())
    from framework.ops import linalg as L

    y = b.op(L.Linear, x, w, shape=(8, 16))
    r = b.op(E.Relu, y, shape=(8, 16))
    assert R.op_cost(b.p.nodes[0], b.p) == (2 * 8 * 16 * 32, 4 * (8 * 32 + 16 * 32 + 8 * 16))
    assert R.op_cost(b.p.nodes[1], b.p) == (8 * 16, 4 * 2 * 8 * 16)
    assert r is not None


# --- the guards and the errors ---------------------------------------------------------------


@pytest.mark.parametrize("bad", [1.5, -0.1, math.nan, math.inf, "0.5", True, None, [0.5]])
def test_a_bad_budget_raises_one_clear_error(bad):
    step = lambda x: x  # noqa: E731
    with pytest.raises(ValueError, match=r"memory_budget=.*: the memory budget is a number in \[0, 1\]"):
        fw.compile(step, memory_budget=bad)
    with pytest.raises(ValueError, match=r"the memory budget is a number in \[0, 1\]"):
        fw.compile(memory_budget=bad)  # as a decorator too
    compiled = fw.compile(step)
    with pytest.raises(ValueError, match=r"the memory budget is a number in \[0, 1\]"):
        compiled.memory_budget = bad
    assert compiled.memory_budget == 1.0


def test_the_budget_is_part_of_a_programs_identity():
    fw.inplace.set_policy("off")
    model = make_model("mlp")
    opt = fw.optim.SGD(model.parameters(), lr=0.1)

    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    f = fw.compile(step, memory_budget=0.0)
    x, y = fw.randn(8, 64), fw.tensor(np.arange(8) % 10)
    for _ in range(3):
        f(x, y)
    captures = f.captures
    assert f.report()["recomputed"] and f.report()["replays"] >= 1
    f.memory_budget = 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f(x, y)
    assert f.captures == captures + 1 and f.report()["recomputed"] == [] and f.report()["memory_budget"] == 1.0
    assert any("changed: memory budget" in str(w.message) for w in caught)
    f.memory_budget = 0.0
    f(x, y)
    assert f.captures == captures + 1 and f.report()["recomputed"]  # the program planned at 0 is cached


def test_report_and_explain_show_what_was_recomputed_and_its_cost(capsys):
    _, _, f = run("resnet", "off", True, STEPS, "bn", memory_budget=0.5)
    r = f.report()
    rows = r["recomputed"]
    assert rows and all(row["site"] for row in rows)
    assert all(row["flops"] > 0 and row["bytes"] > 0 for row in rows if row["op"] != "View")  # a view is free
    assert r["recompute_flops"] == sum(row["flops"] for row in rows)
    assert {row["op"] for row in rows} <= {"BatchNorm", "Relu", "Add", "Conv2d", "AvgPool2d", "View", "Linear", "Cat"}
    text = f.explain()
    assert "memory budget 0.5: saved for backward" in text
    assert f"recomputed in backward: {len(rows)} ops, {r['recompute_flops']} FLOPs" in text
    assert "recomputes %" in str(f.program)


# --- on a GPU: the recomputed step is still one CUDA graph -------------------------------------


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("kind,norm,budget", [("mlp", None, 0.5), ("resnet", "bn", 0.0)])
def test_a_recomputing_step_replays_as_one_cuda_graph_bitwise_eager_off(kind, norm, budget):
    # at budget 0 ResNet-20 also makes its shortcut's zeros again (a creation recipe)
    steps = 6
    eager = run(kind, "off", False, steps, norm, device="cuda")
    compiled = run(kind, "off", True, steps, norm, device="cuda", memory_budget=budget)
    _assert_bitwise(eager[:2], compiled[:2])
    f = compiled[2]
    report = f.report()
    assert report["recomputed"] and report["replay_mode"] == "cuda graph"
    assert (kind == "resnet") == ("zeros" in {row["op"] for row in report["recomputed"]})
    graph = f._current().executor.cuda_graph
    assert graph.captures == 1 and graph.launches == steps - 3 and graph.uncaptured == 0


@pytest.mark.gpu
@requires_gpu
def test_the_gpt_step_recomputing_everything_it_can_is_one_cuda_graph_bitwise_eager_off():
    steps = 5
    eager = _gpt_run("off", False, steps, device="cuda")
    compiled = _gpt_run("off", True, steps, device="cuda", memory_budget=0.0)
    _assert_bitwise(eager[:2], compiled[:2])
    assert compiled[2].report()["recomputed"] and compiled[2].report()["replay_mode"] == "cuda graph"
