"""``framework.utils.checkpoint`` against PyTorch 2.13's ``torch.utils.checkpoint`` on the
same small block with the same float64 weights: the gradients agree to 1e-12 (plain,
selective, and to second order), and where PyTorch raises this framework raises the
same error (type and PyTorch's sentence). Where PyTorch returns a wrong gradient in
silence (a closure's tensor modified after the forward), this raises."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import framework as fw
from framework import nn
from framework.ops.linalg import Linear, Matmul
from framework.utils import checkpoint as ck

TOL = dict(rtol=1e-12, atol=1e-12)


def _blocks(torch):
    """The same block in both frameworks: linear, LayerNorm, GELU, linear, residual."""
    rng = np.random.default_rng(0)
    arrays = {
        "fc.weight": rng.standard_normal((16, 8)),
        "fc.bias": rng.standard_normal(16),
        "ln.weight": 1 + 0.1 * rng.standard_normal(16),
        "ln.bias": 0.1 * rng.standard_normal(16),
        "out.weight": rng.standard_normal((8, 16)) / 4,
        "out.bias": rng.standard_normal(8),
    }

    class FwBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.ln, self.out = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8)
            self.gelu = nn.GELU()

        def forward(self, x):
            return self.out(self.gelu(self.ln(self.fc(x)))) + x

    class TorchBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.ln, self.out = torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 8)
            self.gelu = torch.nn.GELU()

        def forward(self, x):
            return self.out(self.gelu(self.ln(self.fc(x)))) + x

    ours, theirs = FwBlock().to(dtype=fw.float64), TorchBlock().double()
    for name, p in ours.named_parameters():
        p.data = fw.tensor(arrays[name])
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.copy_(torch.from_numpy(arrays[name]))
    x = rng.standard_normal((5, 8))
    return ours, theirs, x


def _fw_grads(block, x, **kwargs):
    x = fw.tensor(x, requires_grad=True)
    y = ck.checkpoint(block, x * 1.0, use_reentrant=False, **kwargs)
    (y * y).sum().backward()
    return [x.grad.numpy()] + [p.grad.numpy() for p in block.parameters()]


def _torch_grads(torch, block, x, **kwargs):
    x = torch.tensor(x, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(block, x * 1.0, use_reentrant=False, **kwargs)
    (y * y).sum().backward()
    return [x.grad.numpy()] + [p.grad.numpy() for p in block.parameters()]


def test_gradients_equal_pytorch_s_checkpoint(torch):
    ours, theirs, x = _blocks(torch)
    for a, b in zip(_fw_grads(ours, x), _torch_grads(torch, theirs, x), strict=True):
        np.testing.assert_allclose(a, b, **TOL)


def test_selective_checkpoint_gradients_equal_pytorch_s(torch):
    ours, theirs, x = _blocks(torch)
    fw_ctx = functools.partial(ck.create_selective_checkpoint_contexts, [Linear, Matmul])
    aten = torch.ops.aten
    torch_ctx = functools.partial(
        torch.utils.checkpoint.create_selective_checkpoint_contexts, [aten.addmm.default, aten.mm.default]
    )
    got = _fw_grads(ours, x, context_fn=fw_ctx)
    for a, b in zip(got, _torch_grads(torch, theirs, x, context_fn=torch_ctx), strict=True):
        np.testing.assert_allclose(a, b, **TOL)


def test_second_order_gradients_equal_pytorch_s(torch):
    ours, theirs, x0 = _blocks(torch)

    def fw_run():
        x = fw.tensor(x0, requires_grad=True)
        y = ck.checkpoint(ours, x * 1.0, use_reentrant=False)
        (g,) = fw.autograd.grad((y * y).sum(), x, create_graph=True)
        (g * g).sum().backward()
        return [g.detach().numpy(), x.grad.numpy()] + [p.grad.numpy() for p in ours.parameters()]

    def torch_run():
        x = torch.tensor(x0, requires_grad=True)
        y = torch.utils.checkpoint.checkpoint(theirs, x * 1.0, use_reentrant=False)
        (g,) = torch.autograd.grad((y * y).sum(), x, create_graph=True)
        (g * g).sum().backward()
        return [g.detach().numpy(), x.grad.numpy()] + [p.grad.numpy() for p in theirs.parameters()]

    for a, b in zip(fw_run(), torch_run(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-11)


def _nondeterministic_widths(lib, checkpoint):
    x = lib.ones(4, 8, requires_grad=True)
    widths = iter([8, 4])
    return checkpoint(lambda x: (x[:, : next(widths)] * 2.0).tanh(), x, use_reentrant=False).sum()


def _fewer_saves(lib, checkpoint):
    x = lib.ones(4, 8, requires_grad=True)
    counts = iter([2, 1])

    def fn(x):
        for _ in range(next(counts)):
            x = x.tanh()
        return x

    return checkpoint(fn, x, use_reentrant=False).sum()


def _more_saves(lib, checkpoint, early_stop):
    x = lib.ones(4, 8, requires_grad=True)
    counts = iter([1, 2])

    def fn(x):
        for _ in range(next(counts)):
            x = x.tanh()
        return x

    with early_stop(False):
        return checkpoint(fn, x, use_reentrant=False).sum()


def _input_modified(lib, checkpoint):
    x = lib.ones(4, 8, requires_grad=True)
    h = x * 1.0
    y = checkpoint(lambda h: (h + 1.0).exp(), h, use_reentrant=False).sum()
    h.add_(1.0)
    return y


def _selective(lib, checkpoint, contexts, mm, mutate):
    x = lib.ones(3, 4, requires_grad=True)
    w = lib.ones(4, 4, requires_grad=True)

    def fn(x):
        h = x @ w
        out = h.tanh()
        if mutate:
            h.mul_(2.0)
        return out

    y = checkpoint(fn, x, use_reentrant=False, context_fn=functools.partial(contexts, [mm])).sum()
    if not mutate:
        y.backward(retain_graph=True)  # the second backward raises
    return y


@pytest.mark.parametrize(
    "program, error, sentence",
    [
        (_nondeterministic_widths, "CheckpointError", "Recomputed values for the following tensors have different"),
        (_fewer_saves, "CheckpointError", "A different number of tensors was saved during the original forward"),
        (_more_saves, "CheckpointError", "trying to save more tensors during recomputation than during the original"),
        (_input_modified, "RuntimeError", "one of the variables needed for gradient computation has been modified"),
        ("selective twice", "RuntimeError", "Trying to backward an extra time. You are only allowed to backward once"),
        ("selective mutated", "RuntimeError", "Tensor cached during selective activation checkpoint has been mutated"),
    ],
)
def test_the_same_errors_where_pytorch_raises(torch, program, error, sentence):
    def run(lib, module):
        if program == "selective twice" or program == "selective mutated":
            mm = Matmul if lib is fw else torch.ops.aten.mm.default
            y = _selective(
                lib, module.checkpoint, module.create_selective_checkpoint_contexts, mm, "mutated" in program
            )
        elif program is _more_saves:
            y = program(lib, module.checkpoint, module.set_checkpoint_early_stop)
        else:
            y = program(lib, module.checkpoint)
        with pytest.raises(Exception) as e:
            y.backward()
        return e.value

    ours, theirs = run(fw, ck), run(torch, torch.utils.checkpoint)
    for e in (ours, theirs):
        assert sentence in str(e), str(e)
        assert isinstance(e, RuntimeError)
    assert type(ours).__name__ == type(theirs).__name__ == error


@pytest.mark.parametrize(
    "kwargs, sentence",
    [
        (dict(determinism_check="shape"), "determinism_check should be one of ['default', 'none'], but got shape"),
        (dict(debug=True, context_fn=lambda: (None, None)), "debug=True is incompatible with non-default context_fn"),
    ],
)
def test_the_same_argument_errors(torch, kwargs, sentence):
    for lib, checkpoint in ((fw, ck.checkpoint), (torch, torch.utils.checkpoint.checkpoint)):
        with pytest.raises(ValueError) as e:
            checkpoint(lib.exp, lib.ones(2, requires_grad=True), use_reentrant=False, **kwargs)
        assert sentence in str(e.value)
    for lib, seq in ((fw, ck.checkpoint_sequential), (torch, torch.utils.checkpoint.checkpoint_sequential)):
        with pytest.raises(ValueError, match="Unexpected keyword arguments: foo"):
            seq([lib.exp], 1, lib.ones(2, requires_grad=True), use_reentrant=False, foo=1)
    for contexts in (
        ck.create_selective_checkpoint_contexts,
        torch.utils.checkpoint.create_selective_checkpoint_contexts,
    ):
        with pytest.raises(ValueError, match="Expected op in `op_list` to be an"):
            contexts(["mm"])


def test_a_closure_modified_after_forward_pytorch_silently_wrong_here_an_error(torch):
    def run(lib, checkpoint):
        c = lib.tensor([1.0, 2.0], dtype=lib.float64)
        x = lib.tensor([0.5, 1.5], dtype=lib.float64, requires_grad=True)
        y = checkpoint(lambda x: (x + c).exp(), x, use_reentrant=False)
        c.mul_(3.0)
        y.sum().backward()
        return x.grad.numpy()

    right = np.exp(np.array([0.5, 1.5]) + np.array([1.0, 2.0]))  # d/dx exp(x + c) at the c the forward read
    assert not np.allclose(run(torch, torch.utils.checkpoint.checkpoint), right)  # PyTorch: the new c
    with pytest.raises(RuntimeError, match="read in its forward"):
        run(fw, ck.checkpoint)
