"""A GPT language model with nanoGPT's structure (Karpathy's ``model.py``), parameter names
and initialisation, whose inplace sites follow the policy.

Token and learned position embeddings, ``n_layer`` pre-LN blocks (causal self-attention
and a GELU MLP, each added to the residual stream), a final LayerNorm and a linear head
whose weight is the token embedding's (weight tying). The knobs are nanoGPT's
(``n_layer``, ``n_head``, ``n_embd``, ``block_size``, ``vocab_size``, ``dropout``, ``bias``)
plus three for the memory story (docs/TRANSFORMERS.md):

- ``attention``: ``"math"`` writes attention out op by op, as nanoGPT does without flash
  attention (scores, causal ``masked_fill``, softmax, dropout, ``@ v``): backward keeps
  the ``L x L`` probabilities, their dropout mask and the dropped probabilities,
  Korthikanti et al.'s ``as^2b`` terms. ``"fused"`` is one
  ``F.scaled_dot_product_attention`` (nanoGPT's flash path), which keeps none of them.
- ``layer_norm``: ``"standard"``, or ``"memory_efficient"`` (Apex's mode: each LayerNorm
  keeps its output, which the next linear layer keeps anyway, instead of its input).
- ``tie_weights``: share the head's weight with the token embedding (nanoGPT does).

``set_recompute(mode)`` (the config's ``recompute``) checkpoints each block
(``"full"``: a block keeps its input only and runs again in backward) or each block's
attention core, from q, k, v to the output of ``@ v`` (``"selective"``: Korthikanti et
al.'s selective recomputation, which drops the ``as^2b`` terms and keeps the rest).

The inplace sites of a block are the policy's, as everywhere: the dropouts
(``nn.Dropout(inplace=None)``), the two residual adds (``F.residual_add``, which writes the
sum over the branch's output), and under ``auto`` the ordinary ops whose input is dead
(the scaled scores, the masked scores, softmax's input). GELU has no free inplace form.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

import framework as fw
import framework.nn.functional as F
from framework import nn
from framework.utils.checkpoint import checkpoint

from .layers import RECOMPUTE, check_choice, positive_int
from .registry import register_model

ATTENTIONS = ("math", "fused")
LAYER_NORMS = ("standard", "memory_efficient")


class _Modules(nn.Module):
    """Named submodules (nanoGPT's ``nn.ModuleDict``), so that parameter names are nanoGPT's."""

    def __init__(self, **modules):
        super().__init__()
        for name, module in modules.items():
            setattr(self, name, module)


def _layer_norm(cfg):
    return nn.LayerNorm(cfg.n_embd, bias=cfg.bias, memory_efficient=cfg.layer_norm == "memory_efficient")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one projection for q, k, v of every head, one out.

    ``recompute_core``: the core (scores, mask, softmax, dropout, ``@ v``) is checkpointed:
    backward keeps q, k and v and runs it again (Korthikanti et al.'s selective recompute).
    """

    recompute_core = False

    def __init__(self, cfg):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head, self.n_embd, self.dropout = cfg.n_head, cfg.n_embd, cfg.dropout
        self.fused = cfg.attention == "fused"
        if not self.fused:  # the causal mask of the written-out attention, as nanoGPT's buffer
            mask = fw.tril(fw.ones(cfg.block_size, cfg.block_size)).view(1, 1, cfg.block_size, cfg.block_size)
            self.register_buffer("bias", mask)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        if self.recompute_core:
            y = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            y = self.core(q, k, v)
        y = y.transpose(1, 2).contiguous().view(b, t, c)  # the heads side by side
        return self.resid_dropout(self.c_proj(y))

    def core(self, q, k, v):
        """Attention proper, ``(B, nh, T, hs)`` each: softmax(q k^T / sqrt(hs), causal) v."""
        if self.fused:
            p = self.dropout if self.training else 0.0
            return F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=p, is_causal=True)
        t = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        return att @ v  # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = self.c_fc(x)
        x = self.gelu(x)
        x = self.c_proj(x)
        x = self.dropout(x)
        return x


class Block(nn.Module):
    """A pre-LN Transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``.

    nanoGPT writes ``x = x + self.attn(self.ln_1(x))``; here the add is the policy's
    residual-add site, written over the branch's output (the same sum bit for bit).
    ``recompute = "full"``: the block is checkpointed (it keeps its input only).
    """

    recompute = "none"

    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = _layer_norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = _layer_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x):
        if self.recompute == "full":
            return checkpoint(self.block, x, use_reentrant=False)
        return self.block(x)

    def block(self, x):
        x = F.residual_add(self.attn(self.ln_1(x)), x)
        x = F.residual_add(self.mlp(self.ln_2(x)), x)
        return x


@dataclasses.dataclass
class GPTConfig:
    """nanoGPT's ``GPTConfig`` (its defaults are GPT-2's) and the memory knobs; what the
    blocks are built from (``GPT`` checks the values)."""

    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    attention: str = "math"
    layer_norm: str = "standard"


@register_model("gpt")
class GPT(nn.Module):
    """A GPT language model (nanoGPT's ``GPT``).

    Args:
        vocab_size: tokens in the vocabulary (a text data set fills it in).
        block_size: the longest sequence (context) the model takes (filled in likewise).
        n_layer, n_head, n_embd: blocks, heads per attention, width (``n_embd`` a multiple
            of ``n_head``).
        dropout: dropout probability of the embeddings, attention weights and residual
            branches.
        bias: biases in the linear layers and LayerNorms (GPT-2 has them).
        attention: ``"math"`` (written out op by op) or ``"fused"`` (one
            ``scaled_dot_product_attention``): the same function, other memory.
        layer_norm: ``"standard"`` or ``"memory_efficient"`` (keeps the output, not the input).
        tie_weights: the head's weight is the token embedding's.
    """

    def __init__(
        self,
        vocab_size=65,
        block_size=64,
        n_layer=2,
        n_head=4,
        n_embd=64,
        dropout=0.0,
        bias=True,
        attention="math",
        layer_norm="standard",
        tie_weights=True,
    ):
        super().__init__()
        for what, value in (("vocab_size", vocab_size), ("block_size", block_size), ("n_layer", n_layer)):
            positive_int(what, value)
        positive_int("n_head", n_head)
        positive_int("n_embd", n_embd)
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
        check_choice("attention", attention, ATTENTIONS)
        check_choice("layer_norm", layer_norm, LAYER_NORMS)
        cfg = self.config = GPTConfig(
            vocab_size=vocab_size,
            block_size=block_size,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            dropout=float(dropout),
            bias=bool(bias),
            attention=attention,
            layer_norm=layer_norm,
        )
        self.transformer = _Modules(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg) for _ in range(n_layer)]),
            ln_f=_layer_norm(cfg),
        )
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        # the positions 0 .. block_size - 1, made once (nanoGPT makes them every forward): a
        # compiled step reads them as the model's state instead of creating them
        self.register_buffer("pos", fw.arange(0, block_size, dtype=fw.int64), persistent=False)
        if tie_weights:
            self.transformer.wte.weight = self.lm_head.weight
        for module in self.modules():
            _init_weights(module)
        # GPT-2's scaled initialisation of the projections into the residual stream
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def set_recompute(self, mode: str) -> None:
        """``"none"``, ``"full"`` (each block checkpointed) or ``"selective"`` (each block's
        attention core checkpointed: Korthikanti et al.'s selective recompute)."""
        check_choice("recompute", mode, RECOMPUTE)
        for block in self.transformer.h:
            block.recompute = "full" if mode == "full" else "none"
            block.attn.recompute_core = mode == "selective"

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Parameters of the model (without the position embeddings: ``non_embedding``)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def forward(self, idx, targets=None):
        """Logits ``(B, T, vocab_size)`` of the token indices ``idx`` ``(B, T)``; with
        ``targets`` ``(B, T)`` also their mean cross entropy, as ``(logits, loss)``."""
        if idx.ndim != 2:
            raise ValueError(f"GPT expects token indices of shape (batch, time), got shape {tuple(idx.shape)}")
        b, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(f"Cannot forward sequence of length {t}, block size is only {self.config.block_size}")
        pos = self.pos[:t]
        tok_emb = self.transformer.wte(idx)  # (B, T, n_embd)
        pos_emb = self.transformer.wpe(pos)  # (T, n_embd)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
        return logits, loss

    @fw.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None):
        """``idx`` ``(B, T)`` followed by ``max_new_tokens`` sampled tokens, each from the
        softmax of the last position's logits / ``temperature``, restricted to the ``top_k``
        most likely (``top_k=1``: greedy). The context is cropped to ``block_size``; draws
        come from the framework's seeded generator (``fw.manual_seed``). Put the model in
        eval mode first (dropout), as with nanoGPT."""
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        for _ in range(max_new_tokens):
            cond = idx if idx.shape[1] <= self.config.block_size else idx[:, -self.config.block_size :]
            logits = self(cond)[:, -1, :] / temperature
            if top_k is not None:
                k = min(top_k, logits.shape[-1])
                kth = np.sort(logits.numpy(), axis=-1)[:, -k]  # the k-th largest of each row
                limit = fw.tensor(kth[:, None], dtype=logits.dtype, device=logits.device)
                logits = logits.masked_fill(logits < limit, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            idx = fw.cat([idx, fw.multinomial(probs, num_samples=1)], dim=1)
        return idx


def _init_weights(module):
    """nanoGPT's initialisation: N(0, 0.02) for linear and embedding weights, zero biases."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
