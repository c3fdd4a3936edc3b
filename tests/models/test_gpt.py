"""The GPT model: nanoGPT's structure, names and initialisation, weight tying, the policies
(bitwise the same losses and gradients), its memory knobs (the same function), generation,
and the trainer's AdamW parameter groups."""

from __future__ import annotations

import math

import numpy as np
import pytest

import framework as fw
from models import GPT, build_model
from trainers.config import config_from_dict
from trainers.trainer import build_optimizer, param_groups

SMALL = dict(vocab_size=23, block_size=12, n_layer=2, n_head=2, n_embd=16)


def _idx(b=3, t=12, vocab=23, seed=0):
    return fw.tensor(np.random.default_rng(seed).integers(0, vocab, (b, t)))


def _run(policy, seed=0, **kwargs):
    """Loss and gradients of one training step under ``policy`` (same init, same dropout draws)."""
    with fw.inplace.policy(policy):
        fw.manual_seed(seed)
        model = GPT(**{**SMALL, **kwargs})
        fw.manual_seed(seed + 1)
        _, loss = model(_idx(), _idx(seed=1))
        loss.backward()
        grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
    return loss.item(), grads


def test_parameter_and_buffer_names_are_nanogpt_s():
    model = GPT(**SMALL)
    names = [n for n, _ in model.named_parameters()]
    block = [
        "ln_1.weight",
        "ln_1.bias",
        "attn.c_attn.weight",
        "attn.c_attn.bias",
        "attn.c_proj.weight",
        "attn.c_proj.bias",
        "ln_2.weight",
        "ln_2.bias",
        "mlp.c_fc.weight",
        "mlp.c_fc.bias",
        "mlp.c_proj.weight",
        "mlp.c_proj.bias",
    ]
    want = ["transformer.wte.weight", "transformer.wpe.weight"]
    want += [f"transformer.h.{i}.{n}" for i in range(2) for n in block]
    want += ["transformer.ln_f.weight", "transformer.ln_f.bias"]
    assert names == want  # the tied head weight is the token embedding's: listed once
    assert model.lm_head.weight is model.transformer.wte.weight
    assert "lm_head.weight" in model.state_dict()
    assert [n for n, _ in model.named_buffers()] == ["pos"] + [f"transformer.h.{i}.attn.bias" for i in range(2)]
    assert [n for n, _ in GPT(**SMALL, attention="fused").named_buffers()] == ["pos"]  # no mask: is_causal
    assert "pos" not in model.state_dict()  # the positions are not state (non-persistent)
    assert "lm_head.weight" in dict(GPT(**SMALL, tie_weights=False).named_parameters())


def test_parameter_count_and_nanogpt_s_initialisation():
    fw.manual_seed(0)
    model = GPT(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384, bias=False)
    c = 384
    per_block = 12 * c * c + 2 * c  # 4 matrices of 3C^2 + C^2 + 4C^2 + 4C^2, two LayerNorm weights
    assert model.get_num_params() == 6 * per_block + 65 * c + c  # + tied embedding/head, final LN
    assert model.get_num_params(non_embedding=False) == model.get_num_params() + 256 * c
    stds = {n: float(p.detach().numpy().std()) for n, p in model.named_parameters() if p.ndim == 2}
    for name, std in stds.items():
        want = 0.02 / math.sqrt(2 * 6) if name.endswith("c_proj.weight") else 0.02
        assert abs(std - want) < 0.1 * want, name
    ln = model.transformer.h[0].ln_1
    assert np.all(ln.weight.detach().numpy() == 1) and ln.bias is None


@pytest.mark.parametrize("attention", ["math", "fused"])
@pytest.mark.parametrize("layer_norm", ["standard", "memory_efficient"])
def test_auto_and_on_give_off_s_loss_and_gradients_bit_for_bit(attention, layer_norm):
    """With dropout everywhere: every inplace site of the model (dropouts, residual adds,
    and under auto the ops it proves dead) changes no number."""
    kw = dict(attention=attention, layer_norm=layer_norm, dropout=0.2)
    prev = fw.inplace.set_auto_min_bytes(0)  # small tensors: let auto try every site
    try:
        off = _run("off", **kw)
        for policy in ("auto", "on"):
            got = _run(policy, **kw)
            assert got[0] == off[0], policy
            for name, g in off[1].items():
                np.testing.assert_array_equal(got[1][name], g, err_msg=f"{policy}: {name}")
    finally:
        fw.inplace.set_auto_min_bytes(prev)


def test_the_memory_knobs_compute_the_same_function():
    """Without dropout: fused attention equals the written-out one to rounding, the
    memory-efficient LayerNorm's forward is the standard one bit for bit (its backward
    rebuilds x_hat from the output: equal to rounding)."""
    base = _run("off")
    fused = _run("off", attention="fused")
    me = _run("off", layer_norm="memory_efficient")
    assert me[0] == base[0]
    assert fused[0] == pytest.approx(base[0], rel=1e-6)
    for name, g in base[1].items():
        np.testing.assert_allclose(fused[1][name], g, rtol=2e-4, atol=2e-6, err_msg=name)
        np.testing.assert_allclose(me[1][name], g, rtol=2e-4, atol=2e-6, err_msg=name)


def test_greedy_generation_takes_the_argmax_and_crops_the_context():
    fw.manual_seed(0)
    model = GPT(**SMALL).eval()
    prompt = _idx(b=2, t=10)
    out = model.generate(prompt, 6, top_k=1)
    assert out.shape == (2, 16)
    assert np.array_equal(out.numpy()[:, :10], prompt.numpy())
    idx = prompt
    for _ in range(6):  # by hand: the last 12 tokens' logits, the largest
        logits = model(idx if idx.shape[1] <= 12 else idx[:, -12:])[:, -1, :].detach().numpy()
        idx = fw.cat([idx, fw.tensor(logits.argmax(-1)[:, None])], dim=1)
    assert np.array_equal(out.numpy(), idx.numpy())


def test_sampling_is_seeded_and_top_k_restricts_the_choice():
    fw.manual_seed(0)
    model = GPT(**SMALL).eval()
    prompt = _idx(b=1, t=4)
    fw.manual_seed(5)
    a = model.generate(prompt, 20, temperature=2.0, top_k=3).numpy()
    fw.manual_seed(5)
    b = model.generate(prompt, 20, temperature=2.0, top_k=3).numpy()
    assert np.array_equal(a, b)
    logits = model(fw.tensor(a[:, :4]))[:, -1, :].detach().numpy()[0]
    assert a[0, 4] in np.argsort(logits)[-3:]


@pytest.mark.parametrize("attention", ["math", "fused"])
def test_the_key_value_cache_gives_the_logits_of_the_whole_context(attention):
    """Hugging Face's past_key_values: a prefix's cache, then the rest (one token, or several:
    the fused path's explicit causal mask over the cached keys) gives the whole sequence's
    logits; the cache holds (B, n_head, T, head_size) keys and values per block."""
    fw.manual_seed(0)
    model = GPT(**SMALL, attention=attention).eval()
    idx = _idx(b=2, t=12)
    with fw.no_grad():
        full = model(idx).numpy()
        logits, past = model(idx[:, :5], use_cache=True)
        assert len(past) == SMALL["n_layer"] and past[0][0].shape == (2, SMALL["n_head"], 5, 8)
        more, past = model(idx[:, 5:6], past_key_values=past, use_cache=True)
        rest, past = model(idx[:, 6:], past_key_values=past, use_cache=True)
    assert past[1][1].shape == (2, SMALL["n_head"], 12, 8)
    got = np.concatenate([logits.numpy(), more.numpy(), rest.numpy()], axis=1)
    np.testing.assert_allclose(got, full, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="block size is only 12"):
        model(idx[:, :1], past_key_values=past, use_cache=True)
    with pytest.raises(ValueError, match="no targets"):
        model(idx, idx, use_cache=True)


@pytest.mark.parametrize("attention", ["math", "fused"])
@pytest.mark.parametrize("top_k,temperature", [(1, 1.0), (None, 0.8), (5, 1.5)])
def test_generation_with_the_cache_writes_the_tokens_it_writes_without(attention, top_k, temperature):
    """Greedy and sampled (the same seed), past block_size (where the window slides and every
    token is a whole forward again), in a batch of two prompts."""
    fw.manual_seed(0)
    model = GPT(**SMALL, attention=attention, dropout=0.1).eval()
    prompt = _idx(b=2, t=3)
    out = {}
    for use_cache in (True, False):
        fw.manual_seed(7)
        out[use_cache] = model.generate(prompt, 14, temperature=temperature, top_k=top_k, use_cache=use_cache).numpy()
    assert out[True].shape == (2, 17)
    np.testing.assert_array_equal(out[True], out[False])


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="multiple of n_head"):
        GPT(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="attention must be one of"):
        GPT(attention="flash")
    with pytest.raises(ValueError, match="block size is only 12"):
        GPT(**SMALL)(_idx(t=13))
    with pytest.raises(ValueError, match="temperature"):
        GPT(**SMALL).generate(_idx(), 1, temperature=0)
    assert isinstance(build_model("gpt", **SMALL), GPT)


def test_adamw_groups_decay_matrices_only_as_nanogpt():
    model = GPT(**SMALL)
    params = list(model.parameters())
    cfg = config_from_dict({"optim": {"name": "adamw", "lr": 0.1, "weight_decay": 0.5, "decay": "matrices"}})
    groups = param_groups(cfg, params)
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0]
    assert all(p.ndim >= 2 for p in groups[0]["params"]) and all(p.ndim < 2 for p in groups[1]["params"])
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(params)
    opt = build_optimizer(cfg, params)
    before = {id(p): p.detach().numpy().copy() for p in params}
    for p in params:
        p.grad = fw.zeros_like(p)
    opt.step()  # zero gradients: only the decoupled decay moves a parameter
    for p in params:
        moved = not np.array_equal(p.detach().numpy(), before[id(p)])
        assert moved == (p.ndim >= 2 and np.any(before[id(p)] != 0))
    assert param_groups(config_from_dict({}), params) == params  # default: one group, as before
