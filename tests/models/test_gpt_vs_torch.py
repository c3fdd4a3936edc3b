"""The GPT beside PyTorch: the same model in torch (benchmarks/gpt_torch.py), the same
weights and batches, in float64: the same losses and gradients over a few AdamW steps
(nanoGPT's decay groups, a warm-up and cosine schedule), the same greedy text, and
PyTorch's own LayerNorm, GELU, embedding and attention functions against ours."""

from __future__ import annotations

import numpy as np
import pytest

import framework as fw
import framework.nn.functional as F
from models import GPT
from trainers.config import config_from_dict
from trainers.trainer import build_optimizer, learning_rate

SHAPE = dict(vocab_size=29, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0)
STEPS = 4


def _batches(n, b=3, t=16, vocab=29):
    rng = np.random.default_rng(7)
    return [(rng.integers(0, vocab, (b, t)), rng.integers(0, vocab, (b, t))) for _ in range(n)]


def _ours(**kwargs):
    fw.manual_seed(0)
    model = GPT(**{**SHAPE, **kwargs})
    for p in model.parameters():  # float64, as the comparison wants
        p.data = p.data.to(dtype=fw.float64)
    return model


CFG = config_from_dict(
    {
        "optim": {"name": "adamw", "lr": 3e-3, "betas": [0.9, 0.99], "weight_decay": 0.1, "decay": "matrices"},
        "schedule": {"name": "cosine", "warmup_steps": 2, "min_lr": 3e-4},
    }
)


def _twin(model):
    """The same model in torch (imported once the ``torch`` fixture has made sure of torch)."""
    from benchmarks import gpt_torch  # noqa: PLC0415

    return gpt_torch.from_ours(model)


def _torch_optimizer(torch, twin):
    params = [p for p in twin.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.99), eps=1e-8)


@pytest.mark.parametrize("attention", ["math", "fused"])
@pytest.mark.parametrize("layer_norm", ["standard", "memory_efficient"])
def test_the_same_losses_and_gradients_as_pytorch_over_adamw_steps(attention, layer_norm, torch):
    model = _ours(attention=attention, layer_norm=layer_norm)
    twin = _twin(model)
    opt = build_optimizer(CFG, list(model.parameters()))
    topt = _torch_optimizer(torch, twin)
    for step, (x, y) in enumerate(_batches(STEPS)):
        lr = learning_rate(CFG, step, STEPS)
        for group in opt.param_groups:
            group["lr"] = lr
        for group in topt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        _, loss = model(fw.tensor(x), fw.tensor(y))
        loss.backward()
        topt.zero_grad()
        _, tloss = twin(torch.from_numpy(x), torch.from_numpy(y))
        tloss.backward()
        assert loss.item() == pytest.approx(tloss.item(), rel=1e-12), step
        grads = dict(model.named_parameters())
        for name, p in twin.named_parameters():
            np.testing.assert_allclose(
                grads[name].grad.numpy(), p.grad.numpy(), rtol=1e-9, atol=1e-12, err_msg=f"step {step}: {name}"
            )
        opt.step()
        topt.step()
    for name, p in twin.named_parameters():
        np.testing.assert_allclose(
            dict(model.named_parameters())[name].detach().numpy(), p.detach().numpy(), rtol=1e-9, atol=1e-12
        )


def test_the_same_greedy_text_as_pytorch(torch):
    model = _ours(attention="fused")
    twin = _twin(model)
    model.eval()
    twin.eval()
    prompt = _batches(1, b=2, t=5)[0][0]
    ours = model.generate(fw.tensor(prompt), 20, top_k=1).numpy()
    theirs = twin.generate(torch.from_numpy(prompt), 20, top_k=1).numpy()
    np.testing.assert_array_equal(ours, theirs)
    assert ours.shape == (2, 25)  # the context was cropped to the block size on the way


def _t(torch, a, grad=True):
    return fw.tensor(a, requires_grad=grad), torch.tensor(a, requires_grad=grad)


def _check(torch, ours, theirs, inputs, rtol=1e-10):
    o, t = ours, theirs
    np.testing.assert_allclose(o.detach().numpy(), t.detach().numpy(), rtol=rtol, atol=1e-12)
    w = np.random.default_rng(3).standard_normal(tuple(o.shape))
    (o * fw.tensor(w)).sum().backward()
    (t * torch.from_numpy(w)).sum().backward()
    for a, b in inputs:
        np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=rtol, atol=1e-12)


@pytest.mark.parametrize("memory_efficient", [False, True])
def test_layer_norm_is_torch_s(memory_efficient, torch):
    rng = np.random.default_rng(0)
    (x, tx), (w, tw), (b, tb) = (
        _t(torch, a) for a in (rng.standard_normal((3, 4, 6)), rng.random(6) + 0.5, rng.random(6))
    )
    _check(
        torch,
        F.layer_norm(x, (6,), w, b, memory_efficient=memory_efficient),
        torch.nn.functional.layer_norm(tx, (6,), tw, tb),
        [(x, tx), (w, tw), (b, tb)],
    )


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_is_torch_s(approximate, torch):
    x, tx = _t(torch, np.random.default_rng(1).standard_normal((4, 5)) * 3)
    _check(torch, F.gelu(x, approximate=approximate), torch.nn.functional.gelu(tx, approximate=approximate), [(x, tx)])


def test_embedding_is_torch_s(torch):
    w, tw = _t(torch, np.random.default_rng(2).standard_normal((7, 3)))
    idx = np.array([[1, 6, 1], [0, 3, 3]])
    _check(
        torch,
        F.embedding(fw.tensor(idx), w, padding_idx=3),
        torch.nn.functional.embedding(torch.from_numpy(idx), tw, padding_idx=3),
        [(w, tw)],
    )


@pytest.mark.parametrize("kind", ["plain", "causal", "bool mask", "float mask", "scale"])
def test_scaled_dot_product_attention_is_torch_s(kind, torch):
    rng = np.random.default_rng(4)
    pairs = [_t(torch, rng.standard_normal(shape)) for shape in ((2, 3, 5, 4), (2, 3, 6, 4), (2, 3, 6, 2))]
    (q, tq), (k, tk), (v, tv) = pairs
    kwargs, tkwargs = {}, {}
    if kind == "causal":
        kwargs = tkwargs = {"is_causal": True}
    elif kind == "scale":
        kwargs = tkwargs = {"scale": 0.7}
    elif kind == "bool mask":
        m = rng.random((5, 6)) > 0.3
        m[:, 0] = True
        kwargs, tkwargs = {"attn_mask": fw.tensor(m)}, {"attn_mask": torch.from_numpy(m)}
    elif kind == "float mask":
        m, tm = _t(torch, rng.standard_normal((3, 5, 6)))
        kwargs, tkwargs = {"attn_mask": m}, {"attn_mask": tm}
        pairs = pairs + [(m, tm)]
    _check(
        torch,
        F.scaled_dot_product_attention(q, k, v, **kwargs),
        torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, **tkwargs),
        pairs,
    )
