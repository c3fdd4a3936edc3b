"""``framework.utils.checkpoint``: PyTorch's non-reentrant checkpoint and selective
checkpointing, on the CPU and the gpu leg.

- The promise: with and without a checkpoint, under ``off``, ``auto`` and ``on``, the
  losses, the gradients, BatchNorm's running statistics and the random stream after the
  step are the same bit for bit, dropout included (its masks replayed from the
  generator's state, also on the CuPy stand-in's device generator).
- PyTorch's semantics: ``autograd.grad``, inputs without grad, keyword arguments,
  outputs that are not tensors, nested checkpoints, ``checkpoint_sequential``,
  ``create_graph=True``, a backward inside the checkpointed function, reading a saved
  tensor outside backward, early stop.
- The failure modes, one clear error each: an input modified in place after forward
  (naming the op and its line), a closure's tensor modified likewise, a recomputation
  that would write twice, a nondeterministic function (shapes, number of tensors, with
  ``debug=True`` the ops of both runs), unsupported arguments, a selective cache that was
  mutated or used twice.
- Memory: what the graph keeps is the inputs; the recomputed values are freed when the
  backward ends.
"""

from __future__ import annotations

import functools
import inspect

import numpy as np
import pytest

import framework as fw
from framework import memory, nn
from framework.nn import functional as F
from framework.ops.linalg import Linear, Matmul
from framework.testing import to_numpy
from framework.utils.checkpoint import (
    CheckpointError,
    CheckpointPolicy,
    checkpoint,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
    save_matmuls_policy,
    set_checkpoint_debug_enabled,
    set_checkpoint_early_stop,
)

POLICIES = ("off", "auto", "on")


class Block(nn.Module):
    """A residual block with every kind of site: LayerNorm, a linear layer, GELU, dropout,
    BatchNorm in training mode, a ReLU site, a residual add."""

    def __init__(self, width=8):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 2 * width)
        self.gelu = nn.GELU()
        self.drop = nn.Dropout(0.3)
        self.bn = nn.BatchNorm1d(2 * width)
        self.relu = nn.ReLU()
        self.out = nn.Linear(2 * width, width)

    def forward(self, x):
        return F.residual_add(self.out(self.relu(self.bn(self.drop(self.gelu(self.fc(self.ln(x))))))), x)


def _model(device):
    fw.manual_seed(0)
    return nn.Sequential(Block(), Block(), Block()).to(device)


def _step(model, device, mode, context_fn=None):
    """One forward and backward from the same state; what the user can observe."""
    fw.manual_seed(1)
    x = fw.randn(16, 8, device=device, requires_grad=True)
    h = x * 1.0
    for block in model:
        if mode == "none":
            h = block(h)
        else:
            kwargs = {} if context_fn is None else {"context_fn": context_fn}
            h = checkpoint(block, h, use_reentrant=False, **kwargs)
    loss = (h * h).mean()
    forward = memory.stats()
    loss.backward()
    backward = memory.stats()
    _step.inplace = {  # inplace writes of the policy's sites and auto's proof, in forward and in backward
        k: (forward.get(k, 0), backward.get(k, 0) - forward.get(k, 0)) for k in ("auto_inplace_ops", "inplace_ops")
    }
    return {
        "loss": to_numpy(loss).copy(),
        "grads": [to_numpy(x.grad).copy()] + [to_numpy(p.grad).copy() for p in model.parameters()],
        "buffers": [to_numpy(b).copy() for b in model.buffers()],
        "next draw": to_numpy(fw.rand(4, device=device)).copy(),
    }


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(
        all(np.array_equal(p, q) for p, q in zip(a[k], b[k], strict=True))
        if isinstance(a[k], list)
        else np.array_equal(a[k], b[k])
        for k in a
    )


@pytest.fixture
def prove_every_tensor():
    """Policy auto tries even these small tensors (its threshold is 64 KiB)."""
    prev = fw.inplace.set_auto_min_bytes(0)
    yield
    fw.inplace.set_auto_min_bytes(prev)


@pytest.mark.parametrize("policy", POLICIES)
def test_gradients_are_bit_for_bit_those_without_checkpoint(backend, policy, prove_every_tensor):
    with fw.inplace.policy("off"):
        ref = _step(_model(backend), backend, "none")
    with fw.inplace.policy(policy):
        memory.reset_stats()
        got = _step(_model(backend), backend, "full")
        stats, inplace = memory.stats(), _step.inplace
        sac = functools.partial(create_selective_checkpoint_contexts, save_matmuls_policy)
        selective = _step(_model(backend), backend, "full", context_fn=sac)
    assert stats["recompute_runs"] == 3  # each block once, in the backward
    assert _same(got, ref)  # dropout masks replayed, running statistics updated once
    assert _same(selective, ref)
    # not vacuous: the policy wrote in place in the forward and again in the recomputation
    key = {"auto": "auto_inplace_ops", "on": "inplace_ops"}.get(policy)
    if key is not None:
        assert inplace[key][0] > 0 and inplace[key][1] > 0, inplace


@pytest.mark.parametrize("policy", POLICIES)
def test_the_recomputation_runs_under_the_forwards_autocast(policy, prove_every_tensor):
    """Forward in a bfloat16 autocast region, backward outside it (as a training step does):
    the recomputation is autocast as the forward was (torch.utils.checkpoint records the
    state too), so the gradients are those without checkpoint bit for bit; recomputed in
    float32 the determinism check would stop it (other dtypes than forward saved)."""

    def run(mode):
        with fw.inplace.policy("off" if mode == "none" else policy):
            model = _model("cpu")
            fw.manual_seed(1)
            x = fw.randn(16, 8, requires_grad=True)
            with fw.autocast("cpu", dtype=fw.bfloat16):
                h = x * 1.0
                for block in model:
                    h = block(h) if mode == "none" else checkpoint(block, h, use_reentrant=False)
                loss = (h.float() * h.float()).mean()
            loss.backward()  # outside the region
            return [to_numpy(loss)] + [to_numpy(t.grad) for t in (x, *model.parameters())]

    ref, got = run("none"), run("full")
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(ref, got, strict=True))
    assert not fw.is_autocast_enabled("cpu")  # the recomputation's region closed again


def test_dropout_masks_are_replayed_not_redrawn(backend):
    """Not vacuous: without the generator's state the recomputation draws other masks
    (and the gradient changes); with it, the stream after the step is untouched."""
    fw.manual_seed(0)
    x = fw.randn(64, device=backend, requires_grad=True)

    def grad(**kwargs):
        x.grad = None
        fw.manual_seed(3)
        checkpoint(lambda t: F.dropout(t * 1.0, 0.5).sin(), x, use_reentrant=False, **kwargs).sum().backward()
        return to_numpy(x.grad).copy(), to_numpy(fw.rand(3, device=backend))

    fw.manual_seed(3)
    x.grad = None
    F.dropout(x * 1.0, 0.5).sin().sum().backward()
    ref = to_numpy(x.grad).copy(), to_numpy(fw.rand(3, device=backend))
    replayed, redrawn = grad(), grad(preserve_rng_state=False)
    assert all(map(np.array_equal, replayed, ref))
    assert not np.array_equal(redrawn[0], ref[0])


def test_autograd_grad_inputs_without_grad_kwargs_and_outputs_that_are_not_tensors():
    fw.manual_seed(0)
    x = fw.randn(4, 3, requires_grad=True)
    c = fw.randn(3, 3)  # no grad
    w = fw.randn(3, 3, requires_grad=True)

    def fn(x, c, n, *, scale, bias=None):
        h = (x @ c * scale).tanh() @ w
        return {"out": h.sin(), "n": n, "parts": (h.exp(), None, "text")}

    out = checkpoint(fn, x, c, 7, use_reentrant=False, scale=0.5, bias=None)
    assert out["n"] == 7 and out["parts"][1:] == (None, "text")
    got = fw.autograd.grad((out["out"] + out["parts"][0]).sum(), [x, w])
    ref_out = fn(x, c, 7, scale=0.5)
    ref = fw.autograd.grad((ref_out["out"] + ref_out["parts"][0]).sum(), [x, w])
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(got, ref))
    # a function of inputs that do not require grad: nothing is saved, nothing recomputed
    y = checkpoint(lambda c: c.exp(), c, use_reentrant=False)
    assert not y.requires_grad


def test_nested_checkpoints_and_checkpoint_sequential():
    fw.manual_seed(0)
    w = fw.randn(5, 5, requires_grad=True)
    x = fw.randn(4, 5, requires_grad=True)

    def inner(h):
        return (h @ w).sigmoid()

    def outer(x):
        return checkpoint(inner, (x @ w).tanh(), use_reentrant=False).sin()

    checkpoint(outer, x, use_reentrant=False).sum().backward()
    got = x.grad.numpy().copy(), w.grad.numpy().copy()
    x.grad = w.grad = None
    outer(x).sum().backward()
    assert np.array_equal(got[0], x.grad.numpy()) and np.array_equal(got[1], w.grad.numpy())

    model = nn.Sequential(*[nn.Sequential(nn.Linear(5, 5), nn.Tanh()) for _ in range(4)])
    x.grad = None
    checkpoint_sequential(model, 2, x, use_reentrant=False).sum().backward()
    got = [x.grad.numpy().copy()] + [p.grad.numpy().copy() for p in model.parameters()]
    x.grad = None
    model.zero_grad()
    model(x).sum().backward()
    assert all(np.array_equal(a, b.numpy()) for a, b in zip(got, [x.grad, *[p.grad for p in model.parameters()]]))


def test_create_graph_double_backward(backend):
    fw.manual_seed(0)
    x = fw.randn(4, 3, device=backend, requires_grad=True)
    w = fw.randn(3, 3, device=backend, requires_grad=True)

    def fn(x):
        return F.dropout((x @ w).tanh(), 0.25).sin() * x

    def second_order(checkpointed):
        x.grad = w.grad = None
        fw.manual_seed(2)
        y = checkpoint(fn, x, use_reentrant=False) if checkpointed else fn(x)
        (g,) = fw.autograd.grad(y.sum(), x, create_graph=True)
        (g * g).sum().backward()
        return to_numpy(g).copy(), to_numpy(x.grad).copy(), to_numpy(w.grad).copy()

    assert all(map(np.array_equal, second_order(True), second_order(False)))


def test_a_backward_inside_the_checkpointed_function():
    fw.manual_seed(0)
    x = fw.randn(3, requires_grad=True)

    def fn(x):
        y = x.sin()
        (gx,) = fw.autograd.grad(y.cos().sum(), x, create_graph=True)
        return x.cos() * gx

    checkpoint(fn, x, use_reentrant=False).sum().backward()
    got = x.grad.numpy().copy()
    x.grad = None
    fn(x).sum().backward()
    assert np.allclose(got, x.grad.numpy(), rtol=0, atol=1e-6)


def test_a_saved_tensor_read_outside_backward_is_recomputed_for_that_read():
    x = fw.tensor([0.5, 1.0, 2.0], requires_grad=True)
    y = checkpoint(lambda x: (x * 2.0).exp(), x, use_reentrant=False)
    assert np.array_equal(y.grad_fn._saved_result.numpy(), y.detach().numpy())


def test_under_no_grad_it_only_runs_the_function():
    x = fw.randn(3, requires_grad=True)
    with fw.no_grad():
        y = checkpoint(lambda x: x.exp(), x, use_reentrant=False)
    assert y.grad_fn is None and memory.saved_bytes() >= 0


def test_early_stop_recomputes_only_what_backward_needs():
    x = fw.randn(4, requires_grad=True)

    def fn(x):
        h = x.exp()  # saves its result: the last tensor the graph keeps
        return h + 1.0, h * 2.0  # add and multiply by a number save nothing

    def recomputed_ops():
        memory.reset_stats()
        outs = checkpoint(fn, x, use_reentrant=False)
        (outs[0] + outs[1]).sum().backward()
        return memory.stats()["recomputed_ops"]

    assert recomputed_ops() == 1
    with set_checkpoint_early_stop(False):
        assert recomputed_ops() == 3


# --- what it keeps --------------------------------------------------------------------


def test_the_graph_keeps_the_inputs_and_the_recomputed_values_go_with_the_backward():
    fw.manual_seed(0)
    block = Block(32)
    x = fw.randn(64, 32, requires_grad=True)
    h = x * 1.0  # an activation, not a parameter
    before = memory.saved_bytes(parameters=False)
    plain = block(h)
    kept_without = memory.saved_bytes(parameters=False) - before  # the block's activations, h among them
    del plain
    y = checkpoint(block, h, use_reentrant=False)
    listing = fw.autograd.saved_tensors(y)
    assert [(e.node, e.name) for e in listing] == [("checkpoint(Block)", "args[0]")]
    assert memory.saved_bytes(parameters=False) - before == h.nbytes
    del h
    memory.reset_stats()
    y.sum().backward()
    # during the backward: the block's activations again, all but the input held already
    assert memory.stats()["recomputed_bytes"] == kept_without - x.nbytes
    assert memory.saved_bytes(parameters=False) == before  # all gone with the backward


def test_retain_graph_recomputes_again_for_a_second_backward():
    x = fw.randn(4, requires_grad=True)
    y = checkpoint(lambda x: x.exp().sin(), x, use_reentrant=False)
    memory.reset_stats()
    y.sum().backward(retain_graph=True)
    first = x.grad.numpy().copy()
    y.sum().backward()
    assert memory.stats()["recompute_runs"] == 2
    assert np.array_equal(x.grad.numpy(), 2 * first)


def test_saved_tensors_hooks_pack_and_unpack():
    packed = []

    def pack(t):
        packed.append(t.numpy().copy())
        return len(packed) - 1

    def unpack(i):
        return fw.tensor(packed[i])

    x = fw.tensor([0.5, 1.0], requires_grad=True)
    with fw.autograd.graph.saved_tensors_hooks(pack, unpack):
        y = x.sin().exp()
    assert len(packed) == 2  # sin's input, exp's result
    y.sum().backward()
    assert np.allclose(x.grad.numpy(), np.exp(np.sin([0.5, 1.0])) * np.cos([0.5, 1.0]))


# --- the failure modes -----------------------------------------------------------------


def _line_of(fn, text):
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_an_input_modified_in_place_after_forward_raises_naming_the_op_and_line(backend):
    w = fw.randn(3, 3, device=backend, requires_grad=True)
    h = fw.randn(2, 3, device=backend, requires_grad=True) * 1.0
    y = checkpoint(lambda h: (h + 1.0).exp() @ w, h, use_reentrant=False)  # exp does not save h
    h.add_(1.0)
    line = _line_of(test_an_input_modified_in_place_after_forward_raises_naming_the_op_and_line, "h.add_(1.0)")
    with pytest.raises(RuntimeError, match=rf"input 'args\[0\]' of checkpoint\(<lambda>\).*add_ at .*:{line}"):
        y.sum().backward()


def test_a_closure_tensor_modified_after_the_function_read_it_raises():
    """PyTorch recomputes with the new values and returns a wrong gradient here."""
    c = fw.tensor([1.0, 2.0])
    x = fw.tensor([0.5, 1.5], requires_grad=True)
    y = checkpoint(lambda x: (x + c).exp(), x, use_reentrant=False)  # add saves nothing: exp's result depends on c
    c.mul_(3.0)
    with pytest.raises(RuntimeError, match=r"read in its forward \(an input of Add.*mul_ at"):
        y.sum().backward()

    def writes_after_reading(x):
        y = (x + c).exp()
        c.add_(1.0)  # the recomputation would read the new c
        return y

    y = checkpoint(writes_after_reading, x, use_reentrant=False)
    with pytest.raises(RuntimeError, match=r"read in its forward \(an input of Add.*add_ at"):
        y.sum().backward()


def test_a_recomputation_that_would_write_twice_raises():
    c = fw.tensor([1.0, 2.0])
    x = fw.tensor([0.5, 1.5], requires_grad=True)

    def fn(x):
        c.add_(1.0)  # writes a tensor fn did not make: a recomputation would do it again
        return (x + c).exp()

    y = checkpoint(fn, x, use_reentrant=False)
    with pytest.raises(CheckpointError, match="would write in place .add_. into .*a second time"):
        y.sum().backward()
    assert c.numpy().tolist() == [2.0, 3.0]  # written once

    def makes_its_own(x):  # a tensor fn makes is its own: written again in each run, rightly
        buf = fw.zeros(2)
        buf.add_(x.detach())
        return (x * buf).exp()

    y = checkpoint(makes_its_own, x, use_reentrant=False)
    y.sum().backward()
    got = x.grad.numpy().copy()
    x.grad = None
    makes_its_own(x).sum().backward()
    assert np.array_equal(got, x.grad.numpy())


def test_nondeterministic_functions_raise_checkpoint_errors():
    x = fw.randn(4, 8, requires_grad=True)
    widths = iter([8, 4])
    y = checkpoint(lambda x: (x[:, : next(widths)] * 2.0).tanh(), x, use_reentrant=False)
    with pytest.raises(CheckpointError, match=r"different metadata.*\n.*\nsaved metadata: shape: \(4, 8\)"):
        y.sum().backward()
    counts = iter([1, 2])

    def more_saves(x):
        for _ in range(next(counts)):
            x = x.tanh()
        return x

    with set_checkpoint_early_stop(False):
        y = checkpoint(more_saves, x, use_reentrant=False)
    with pytest.raises(CheckpointError, match="trying to save more tensors during recomputation"):
        y.sum().backward()
    counts = iter([2, 1])
    y = checkpoint(more_saves, x, use_reentrant=False)
    with pytest.raises(
        CheckpointError, match="(?s)A different number of tensors was saved.*forward: 2\n.*recomputation: 1"
    ):
        y.sum().backward()
    # determinism_check="none": shapes are not compared (the count still is)
    widths = iter([8, 8])
    y = checkpoint(lambda x: (x[:, : next(widths)] * 2.0).tanh(), x, use_reentrant=False, determinism_check="none")
    y.sum().backward()


def test_debug_lists_the_ops_of_both_runs_with_their_lines():
    x = fw.randn(4, 8, requires_grad=True)
    widths = iter([8, 4])

    def fn(x):
        return (x[:, : next(widths)] * 2.0).tanh()

    line = _line_of(fn, "tanh()")
    with set_checkpoint_debug_enabled(True):
        y = checkpoint(fn, x, use_reentrant=False)
    with pytest.raises(CheckpointError) as e:
        y.sum().backward()
    assert f"Tanh at {__file__}:{line}" in str(e.value)
    assert "Operations executed during recomputation:" in str(e.value)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x: checkpoint(fw.exp, x, use_reentrant=True), "use_reentrant=True. is not supported"),
        (lambda x: checkpoint(fw.exp, x, use_reentrant=False, determinism_check="shape"), "determinism_check"),
        (
            lambda x: checkpoint(fw.exp, x, use_reentrant=False, debug=True, context_fn=lambda: (None, None)),
            "debug=True is incompatible with non-default context_fn",
        ),
        (lambda x: checkpoint_sequential([fw.exp], 1, x, use_reentrant=False, foo=1), "Unexpected keyword arguments"),
        (lambda x: create_selective_checkpoint_contexts(["mm"]), "Expected op in `op_list` to be an op class"),
    ],
)
def test_unsupported_arguments_raise_one_clear_error(call, match):
    with pytest.raises(ValueError, match=match) as e:
        call(fw.randn(3, requires_grad=True))
    assert "\n" not in str(e.value)


# --- selective checkpoint ----------------------------------------------------------------


def test_selective_checkpoint_does_not_run_the_saved_ops_again():
    fw.manual_seed(0)
    w = fw.randn(4, 4, requires_grad=True)
    x = fw.randn(3, 4, requires_grad=True)
    calls = []

    def policy(ctx, op, *args, **kwargs):
        calls.append((op, ctx.is_recompute, ctx.op_output.shape))
        return CheckpointPolicy.MUST_SAVE if op is Matmul else CheckpointPolicy.PREFER_RECOMPUTE

    def fn(x):
        return ((x @ w).tanh() @ w).sin()

    memory.reset_stats()
    y = checkpoint(fn, x, use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts(policy))
    assert [c[0].__name__ for c in calls] == ["Matmul", "Tanh", "Matmul", "Sin"] and not any(c[1] for c in calls)
    listing = [(e.node, e.name) for e in fw.autograd.saved_tensors(y)]
    assert ("checkpoint(fn) selective", "Matmul[0] output") in listing, listing
    y.sum().backward()
    assert memory.stats()["recomputed_ops"] == 4  # run: Tanh, Sin; taken from the cache: both Matmuls
    got = x.grad.numpy().copy(), w.grad.numpy().copy()
    x.grad = w.grad = None
    fn(x).sum().backward()
    assert np.array_equal(got[0], x.grad.numpy()) and np.array_equal(got[1], w.grad.numpy())
    assert len(calls) == 4  # the policy is called in the forward only


def test_selective_checkpoint_errors():
    w = fw.randn(4, 4, requires_grad=True)
    x = fw.randn(3, 4, requires_grad=True)
    ops = functools.partial(create_selective_checkpoint_contexts, [Matmul, Linear])
    y = checkpoint(lambda x: (x @ w).tanh(), x, use_reentrant=False, context_fn=ops)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="Trying to backward an extra time"):
        y.sum().backward()

    def mutates(x):
        h = x @ w
        out = h.tanh()
        h.mul_(2.0)  # the cached output of the matmul changes after it was cached
        return out

    y = checkpoint(mutates, x, use_reentrant=False, context_fn=ops)
    with pytest.raises(RuntimeError, match="Tensor cached during selective activation checkpoint has been mutated"):
        y.sum().backward()
    y = checkpoint(
        mutates,
        x,
        use_reentrant=False,
        context_fn=lambda: create_selective_checkpoint_contexts([Matmul], allow_cache_entry_mutation=True),
    )
    y.sum().backward()
    with pytest.raises(TypeError, match="must return a CheckpointPolicy"):
        checkpoint(
            fw.exp, x, use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts(lambda *a: 1)
        )
    forward, _ = create_selective_checkpoint_contexts([Matmul])
    with pytest.raises(RuntimeError, match="works only as checkpoint's context_fn"):
        with forward:
            pass


def test_a_compiled_step_refuses_a_checkpoint():
    lin = nn.Linear(3, 3)
    opt = fw.optim.SGD(lin.parameters(), lr=0.1)

    def step(x):
        opt.zero_grad()
        loss = checkpoint(lin, x, use_reentrant=False).sum()
        loss.backward()
        opt.step()
        return loss

    with pytest.raises(RuntimeError, match=r"checkpoint is not supported inside a compiled step .*memory_budget"):
        fw.compile(step)(fw.randn(2, 3))
