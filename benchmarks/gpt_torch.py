"""The GPT of ``models/gpt.py`` written in PyTorch, for the comparisons beside PyTorch
(``tests/models/test_gpt_vs_torch.py``, ``benchmarks/bench_gpt_vs_pytorch.py``).

The same structure, parameter names and knobs (``attention``: written out or PyTorch's
``F.scaled_dot_product_attention``; ``layer_norm``: PyTorch has no memory-efficient mode,
so both settings run ``F.layer_norm``; ``set_recompute``: ``torch.utils.checkpoint`` around
each block or each attention core, as ``models/gpt.py`` does with the framework's);
:func:`from_ours` copies a framework model's weights into a twin, by parameter name.
Needs ``pip install torch==2.13.0``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class CausalSelfAttention(nn.Module):
    recompute_core = False

    def __init__(self, cfg):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head, self.n_embd, self.dropout = cfg.n_head, cfg.n_embd, cfg.dropout
        self.fused = cfg.attention == "fused"
        if not self.fused:
            mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size)).view(1, 1, cfg.block_size, cfg.block_size)
            self.register_buffer("bias", mask)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = checkpoint(self.core, q, k, v, use_reentrant=False) if self.recompute_core else self.core(q, k, v)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))

    def core(self, q, k, v):
        if self.fused:
            p = self.dropout if self.training else 0.0
            return F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=p, is_causal=True)
        t = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        return att @ v


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    recompute = "none"

    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False) if self.recompute == "full" else self.block(x)

    def block(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TorchGPT(nn.Module):
    """``models.gpt.GPT`` in PyTorch (``cfg``: its ``GPTConfig``)."""

    def __init__(self, cfg, tie_weights: bool = True):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if tie_weights:
            self.transformer.wte.weight = self.lm_head.weight

    def set_recompute(self, mode: str) -> None:
        """As ``models.gpt.GPT.set_recompute``: ``"none"``, ``"full"`` or ``"selective"``."""
        for block in self.transformer.h:
            block.recompute = "full" if mode == "full" else "none"
            block.attn.recompute_core = mode == "selective"

    def forward(self, idx, targets=None):
        b, t = idx.shape
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size :]
            logits = self(cond)[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            idx = torch.cat((idx, torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)), dim=1)
        return idx


def from_ours(model, dtype=torch.float64) -> TorchGPT:
    """A :class:`TorchGPT` with the weights of the framework's ``model`` (a ``models.gpt.GPT``)."""
    tied = model.lm_head.weight is model.transformer.wte.weight
    twin = TorchGPT(model.config, tie_weights=tied).to(dtype)
    ours = {name: p.detach().numpy() for name, p in model.named_parameters()}
    with torch.no_grad():
        for name, p in twin.named_parameters():
            p.copy_(torch.from_numpy(np.asarray(ours[name], dtype=np.float64)).to(dtype))
    return twin
