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

    def forward(self, x, past=None, use_cache=False):
        """The attention of ``x`` (B, T, C). With ``past`` (the keys and values of the
        positions before ``x``'s, each (B, nh, T_past, hs)) ``x``'s positions attend to those
        too; with ``use_cache`` the result is ``(y, (keys, values))`` of every position so far."""
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        t0 = 0
        if past is not None:
            t0 = past[0].shape[2]
            k, v = fw.cat([past[0], k], dim=2), fw.cat([past[1], v], dim=2)
        if self.recompute_core and t0 == 0:
            y = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            y = self.core(q, k, v, t0)
        y = y.transpose(1, 2).contiguous().view(b, t, c)  # the heads side by side
        y = self.resid_dropout(self.c_proj(y))
        return (y, (k, v)) if use_cache else y

    def core(self, q, k, v, t0=0):
        """Attention proper, ``(B, nh, T, hs)`` each: softmax(q k^T / sqrt(hs), causal) v;
        ``q``'s positions start at ``t0`` (the keys and values before them cached)."""
        t = q.shape[-2]
        if self.fused:
            p = self.dropout if self.training else 0.0
            mask = None if t0 == 0 or t == 1 else _causal_rows(t0, t, q.device)  # a new token sees every key
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=t0 == 0)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
        att = att.masked_fill(self.bias[:, :, t0 : t0 + t, : t0 + t] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        return att @ v  # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)


def _causal_rows(t0, t, device):
    """The causal mask of positions ``t0 .. t0 + t - 1`` over keys ``0 .. t0 + t - 1`` (True: attends)."""
    return fw.tensor(np.tril(np.ones((t, t0 + t), dtype=bool), k=t0), device=device)


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

    def forward(self, x, past=None, use_cache=False):
        if past is not None or use_cache:  # inference with a key/value cache: nothing to recompute
            return self.cached(x, past, use_cache)
        if self.recompute == "full":
            return checkpoint(self.block, x, use_reentrant=False)
        return self.block(x)

    def block(self, x):
        x = F.residual_add(self.attn(self.ln_1(x)), x)
        x = F.residual_add(self.mlp(self.ln_2(x)), x)
        return x

    def cached(self, x, past, use_cache):
        """The block with the attention's cache (``past``); with ``use_cache``, ``(x, (keys, values))``."""
        a, present = self.attn(self.ln_1(x), past=past, use_cache=True)
        x = F.residual_add(a, x)
        x = F.residual_add(self.mlp(self.ln_2(x)), x)
        return (x, present) if use_cache else x


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

    def forward(self, idx, targets=None, past_key_values=None, use_cache=False):
        """Logits ``(B, T, vocab_size)`` of the token indices ``idx`` ``(B, T)``; with
        ``targets`` ``(B, T)`` also their mean cross entropy, as ``(logits, loss)``.

        A key/value cache, as Hugging Face's ``past_key_values``: ``past_key_values`` holds,
        per block, the keys and values ``(B, n_head, T_past, head_size)`` of the positions
        before ``idx``'s (which then sit at positions ``T_past ..``); with ``use_cache`` the
        logits come with the cache of every position so far, ``(logits, past_key_values)``
        (without ``targets``)."""
        if idx.ndim != 2:
            raise ValueError(f"GPT expects token indices of shape (batch, time), got shape {tuple(idx.shape)}")
        if use_cache and targets is not None:
            raise ValueError("GPT: use_cache is for inference; it takes no targets")
        b, t = idx.shape
        t0 = 0 if past_key_values is None else past_key_values[0][0].shape[2]
        if t0 + t > self.config.block_size:
            raise ValueError(f"Cannot forward sequence of length {t0 + t}, block size is only {self.config.block_size}")
        pos = self.pos[t0 : t0 + t]
        tok_emb = self.transformer.wte(idx)  # (B, T, n_embd)
        pos_emb = self.transformer.wpe(pos)  # (T, n_embd)
        x = self.transformer.drop(tok_emb + pos_emb)
        presents = []
        for i, block in enumerate(self.transformer.h):
            if past_key_values is None and not use_cache:
                x = block(x)
            else:
                x = block(x, past=None if past_key_values is None else past_key_values[i], use_cache=use_cache)
                if use_cache:
                    x, present = x
                    presents.append(present)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        if use_cache:
            return logits, tuple(presents)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
        return logits, loss

    @fw.no_grad()
    def generate(
        self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None, use_cache: bool = True
    ):
        """``idx`` ``(B, T)`` followed by ``max_new_tokens`` sampled tokens, each from the
        softmax of the last position's logits / ``temperature``, restricted to the ``top_k``
        most likely (``top_k=1``: greedy). Draws come from the framework's seeded generator
        (``fw.manual_seed``). Put the model in eval mode first (dropout), as with nanoGPT.

        With ``use_cache`` (Hugging Face's ``past_key_values``) each new token runs through
        the model alone, attending to the kept keys and values of the tokens before it,
        instead of the whole context again: the same tokens as without the cache, at a
        fraction of the work. Once the sequence is longer than ``block_size`` the context
        is cropped to its last ``block_size`` tokens (as nanoGPT does); each token then
        moves every position of the window, whose keys and values are no longer the ones
        kept, so from there on every token is a forward over the whole window either way.
        """
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        block_size, past = self.config.block_size, None
        for _ in range(max_new_tokens):
            if use_cache and idx.shape[1] <= block_size:
                cond = idx if past is None else idx[:, -1:]
                logits, past = self(cond, past_key_values=past, use_cache=True)
            else:
                cond = idx if idx.shape[1] <= block_size else idx[:, -block_size:]
                logits = self(cond)
            logits = logits[:, -1, :] / temperature
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
