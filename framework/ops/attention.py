"""``scaled_dot_product_attention``, as ``torch.nn.functional.scaled_dot_product_attention``:
one op that keeps no ``L x S`` matrix for backward (FlashAttention's memory).

``softmax(q @ k^T * scale + mask) @ v`` for ``q`` (..., L, E), ``k`` (..., S, E), ``v``
(..., S, Ev), with dropout on the probabilities. What backward keeps: ``q``, ``k``, ``v``,
the output, each row's log-sum-exp of the scores (L values per head), the mask when one
is given, and, with dropout, one random draw: the dropout mask is regenerated from it
(a counter-based hash of the element's index, :func:`.kernels_transformer.keep_mask`), as
FlashAttention and cuDNN regenerate theirs from a Philox seed. So none of attention's
``as^2b`` terms of Korthikanti et al. (scores, probabilities, their dropout mask and
output) outlives the op; the probabilities are computed again in backward from the
log-sum-exp. (The written-out attention of nanoGPT, ``softmax(q @ k^T ...)`` op by op,
keeps them: ``models/gpt.py``'s ``attention="math"``.)

The output of 4-D inputs ``(B, H, L, E)`` is laid out as ``(B, L, H, Ev)`` in memory (a
transposed view, as PyTorch's flash kernels return it), so the ``transpose(1, 2)
.contiguous()`` that merges the heads is free and the next linear layer keeps the same
buffer that this op keeps.

Devices: on a GPU with NVIDIA's cuDNN frontend, float16/bfloat16 inputs without dropout
and without an explicit mask run cuDNN's SDPA (forward and backward: one ``execute``
each, :mod:`.attention_cudnn`); cuDNN's SDPA takes no float32. Everything else on a GPU
runs as matrix products (the cuDNN frontend's matmul) and fused kernels
(:mod:`.kernels_transformer`): forward three launches (scores, a row kernel for softmax
and dropout, output), backward eight. On the CPU the same steps run in NumPy; the scores
are a transient workspace there, never kept.

Under ``create_graph`` the backward formula runs on tensors (the log-sum-exp recomputed
from ``q`` and ``k`` with history): derivatives of any order.
"""

from __future__ import annotations

import math

import numpy as np

from .. import memory
from .. import random as _random
from ..autograd.function import Function
from ..backend import get_array_module
from ..tensor import Tensor
from . import attention_cudnn as _cudnn
from . import kernels_transformer as KT
from .broadcast import astype, sum_to
from .kernels import on_gpu, opmath_dtype
from .matmul_gpu import matmul as _mm
from .promotion import cpp_name, is_floating


def _transpose(a, xp):
    return xp.swapaxes(a, -1, -2)


def output_like(q, v, xp):
    """A new output buffer ``q.shape[:-1] + (Ev,)``; for 4-D inputs laid out as (B, L, H, Ev)."""
    shape = q.shape[:-1] + v.shape[-1:]
    if q.ndim == 4:
        b, h, l_, e = shape
        return memory.empty((b, l_, h, e), q.dtype, xp, "activations").transpose(0, 2, 1, 3)
    return memory.empty(shape, q.dtype, xp, "activations")


def _no_seed(xp):
    """The draw argument of a kernel without dropout: never read (no launch to fill it)."""
    return xp.empty((1,), np.float64)


def _scores(q, k, mask, scale, causal, xp, row0=0):
    """``q @ k^T * scale + mask`` with the causal mask (``q``'s first row is row ``row0``):
    on arrays (a new buffer) or tensors."""
    s = xp.matmul(q, _transpose(k, xp)) * scale
    if mask is not None:
        if getattr(mask, "dtype", None) == np.bool_:
            s = xp.where(mask, s, -math.inf)
        else:
            s = s + mask
    if causal:
        s = xp.where(KT.causal_allowed(s.shape, get_array_module(getattr(q, "_data", q)), row0), s, -math.inf)
    return s


class ScaledDotProductAttention(Function):
    """The whole attention as one node: saves ``q``, ``k``, ``v``, the mask and the output;
    keeps each row's log-sum-exp (and the dropout's random draw)."""

    saves = ("q", "k", "v", "attn_mask", "result")
    saved_as = {"q": "query", "k": "key", "v": "value"}

    def forward(ctx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        xp = get_array_module(q)
        ctx.scale, ctx.causal, ctx.p = scale, is_causal, dropout_p
        ctx.mask_shape = None if attn_mask is None else attn_mask.shape
        out = output_like(q, v, xp)
        if dropout_p > 0:
            useed = memory.track(_random.generator(xp).random((1,), dtype=np.float64), "workspace")
            ctx.keep(useed=useed)
        else:
            useed = None
        if on_gpu(q) and attn_mask is None and dropout_p == 0:
            lse = _cudnn.forward(q, k, v, out, scale, is_causal)
            if lse is not None:
                ctx.keep(lse=lse)
                return out
        if on_gpu(q):
            lse = _gpu_forward(q, k, v, attn_mask, scale, is_causal, dropout_p, useed, out, xp)
        else:
            lse = _cpu_forward(q, k, v, attn_mask, scale, is_causal, dropout_p, useed, out, xp)
        ctx.keep(lse=lse)
        return out

    def backward(ctx, g):
        if on_gpu(g):
            return ctx.gpu_backward(g)
        if g.__class__ is Tensor or ctx.needs_input_grad[3]:
            return ctx.formula_backward(g)
        return ctx.cpu_backward(g)

    def formula_backward(ctx, g):
        """The backward formula in one piece, on tensors (create_graph, any device) or, for
        a float mask's gradient (a sum over every sample and head), on arrays."""
        need_q, need_k, need_v, need_m = ctx.needs_input_grad
        useed = ctx.useed if ctx.p > 0 else None
        gq, gk, gv, ds = _attention_grads(ctx, ctx.q, ctx.k, ctx.v, g, ctx.lse, ctx.attn_mask, useed)
        gm = sum_to(ds, ctx.mask_shape) if need_m else None
        return gq if need_q else None, gk if need_k else None, gv if need_v else None, gm

    def cpu_backward(ctx, g):
        """The formula chunk by chunk of samples (``_cpu_chunks``): the scores and
        probabilities of one chunk at a time, each counted as workspace."""
        need_q, need_k, need_v, _ = ctx.needs_input_grad
        q, k, v, lse, mask = ctx.q, ctx.k, ctx.v, ctx.lse, ctx.attn_mask
        useed = ctx.useed if ctx.p > 0 else None
        xp = get_array_module(g)
        # dK and dV sum over the rows: summed chunk by chunk (zeros first)
        gq = memory.empty(q.shape, g.dtype, xp) if need_q else None
        gk = memory.zeros(k.shape, g.dtype, xp) if need_k else None
        gv = memory.zeros(v.shape, g.dtype, xp) if need_v else None
        full = q.shape[:-1] + k.shape[-2:-1]
        for index, rows, ids in _cpu_chunks(full, xp):
            m = _mask_chunk(mask, full, index, rows, xp)
            dq, dk, dv, _ = _attention_grads(
                ctx,
                _rows_of(q, index, rows),
                k[index],
                v[index],
                _rows_of(g, index, rows),
                lse[index + (rows,)],
                m,
                useed,
                ids,
                rows.start or 0,
            )
            if need_q:
                _rows_of(gq, index, rows)[...] = dq
            if need_k:
                gk[index] += dk
            if need_v:
                gv[index] += dv
        return gq, gk, gv, None

    def gpu_backward(ctx, g):
        """cuDNN's SDPA backward where it runs (one execute), else eight launches: the scores,
        the probabilities again (one kernel), dV, dP, D = rowsum(dO * O) (one reduction), the
        scores' gradient (one kernel), dQ and dK."""
        need_q, need_k, need_v, need_m = ctx.needs_input_grad
        q, k, v, o = ctx.q, ctx.k, ctx.v, ctx.result
        mask = ctx.attn_mask
        if mask is None and ctx.p == 0:
            grads = _cudnn.backward(q, k, v, o, g, ctx.lse, ctx.scale, ctx.causal)
            if grads is not None:
                gq, gk, gv = grads
                return gq if need_q else None, gk if need_k else None, gv if need_v else None, None
        xp = get_array_module(g)
        s, kscale = _gpu_raw_scores(q, k, mask, ctx.scale, xp)
        rows = s.shape[:-1]
        n, lq = s.shape[-1], s.shape[-2]
        lse = ctx.lse.reshape(rows + (1,))
        useed = ctx.useed if ctx.p > 0 else _no_seed(xp)
        args = (n, lq, kscale, int(ctx.causal), float(ctx.p), useed)
        gq = gk = gv = gm = None
        if need_v:
            dropped = memory.empty(s.shape, s.dtype, xp, "workspace")
            KT.attn_probs(s, lse, *args, dropped)
            gv = _mm(_transpose(dropped, xp), g, xp)
            del dropped
        if need_q or need_k or need_m:
            dpd = _mm(g, _transpose(v, xp), xp)
            delta = memory.empty(rows + (1,), opmath_dtype(g.dtype), xp, "workspace")
            KT.attn_delta(g, o, delta.reshape(rows), axis=(g.ndim - 1,))
            post = 1.0 if need_m else ctx.scale  # the mask's gradient is taken before the scale
            KT.attn_scores_grad(s, lse, dpd, delta, n, lq, kscale, post, int(ctx.causal), float(ctx.p), useed, s)
            del dpd
            if need_m:
                gm = sum_to(s, ctx.mask_shape)
                if gm is s:
                    gm = s.copy()
                s *= s.dtype.type(ctx.scale)
            if need_q:
                gq = _mm(s, k, xp)
            if need_k:
                gk = _mm(_transpose(s, xp), q, xp)
        return gq, gk, gv, gm

    def kept_as_tensors(ctx):
        """Under create_graph: the log-sum-exp of the scores as a function of ``q`` and ``k``
        (and a float mask) with history."""
        kept = ctx.__dict__.get("_graph_kept")
        if kept is None:
            q = ctx.q
            xp = get_array_module(q)
            s = _scores(q, ctx.k, ctx.attn_mask, ctx.scale, ctx.causal, xp)
            m = s.detach().amax(-1, keepdim=True)  # any shift gives the same value and derivative
            # a fully masked row's log-sum-exp is +inf, as forward keeps it; its scores are
            # replaced by zeros first, so that no NaN reaches the derivative through them
            masked = (m == -math.inf)._data
            s = xp.where(masked, 0.0, s)
            m = xp.where(masked, 0.0, m)
            lse = xp.where(masked[..., 0], math.inf, (s - m).exp().sum(-1).log() + m.squeeze(-1))
            kept = ctx._graph_kept = {"lse": lse}
        return kept


# The scores of one chunk on the CPU: what attention holds while it runs is bounded by this,
# whatever the batch and the sequence (FlashAttention tiles for the same reason).
CHUNK_SCORES_BYTES = 2 << 20


def _cpu_chunks(scores_shape, xp):
    """The chunks of the scores ``(..., L, S)``: ``(index, rows, ids)`` with ``index`` the
    chunk's part of the leading dims and rows (samples along the first dim, all rows when a
    whole sample fits, else a block of one sample's rows), ``rows`` its row slice, ``ids``
    the C-order indices of its scores in the whole (the dropout mask's counter)."""
    lead, n_rows, n_cols = scores_shape[:-2], scores_shape[-2], scores_shape[-1]
    rest = math.prod(lead[1:])
    per_sample = rest * n_rows * n_cols * 4
    if not lead:
        yield (Ellipsis,), slice(None), None
        return
    samples = max(1, CHUNK_SCORES_BYTES // max(per_sample, 1))
    rows = (
        n_rows if samples > 1 or per_sample <= CHUNK_SCORES_BYTES else max(1, CHUNK_SCORES_BYTES // (rest * n_cols * 4))
    )
    cols = xp.arange(n_cols, dtype=xp.uint64)
    for b0 in range(0, lead[0], samples):
        b1 = min(b0 + samples, lead[0])
        heads = xp.arange(b0 * rest, b1 * rest, dtype=xp.uint64).reshape((b1 - b0,) + lead[1:] + (1, 1))
        for r0 in range(0, n_rows, rows):
            r1 = min(r0 + rows, n_rows)
            row_ids = xp.arange(r0, r1, dtype=xp.uint64).reshape(-1, 1)
            ids = (heads * xp.uint64(n_rows) + row_ids) * xp.uint64(n_cols) + cols
            yield (slice(b0, b1), Ellipsis), slice(r0, r1), ids


def _rows_of(a, index, rows):
    """The chunk of an operand with a row dim (q, the output, dO): its samples and rows."""
    return a[index + (rows, slice(None))]


def _mask_chunk(mask, scores_shape, index, rows, xp):
    return None if mask is None else xp.broadcast_to(mask, scores_shape)[index + (rows, slice(None))]


def _attention_grads(ctx, q, k, v, g, lse, mask, useed, ids=None, row0=0):
    """(dQ, dK, dV, dS) of one chunk (rows of ``q``, ``g`` and ``lse`` from ``row0``; the
    scores' indices ``ids`` in the whole) or of the whole op, dS before the scale (the float
    mask's gradient): on arrays or tensors alike."""
    need_q, need_k, need_v, need_m = ctx.needs_input_grad
    xp = get_array_module(g)
    s = _scores(q, k, mask, ctx.scale, ctx.causal, xp, row0)
    probs = xp.exp(s - xp.expand_dims(lse, -1))
    del s
    keep = None
    if ctx.p > 0:
        data = getattr(useed, "_data", useed)
        keep = KT.keep_mask(data, probs.shape, ctx.p, get_array_module(data), index=ids)
        ks = KT.dropout_scale(ctx.p)
    gq = gk = gv = ds = None
    if need_v:
        dropped = probs if keep is None else xp.where(keep, probs, 0) * ks
        gv = astype(xp.matmul(_transpose(dropped, xp), g), g.dtype)
        del dropped
    if need_q or need_k or need_m:
        dp = xp.matmul(g, _transpose(v, xp))
        if keep is not None:
            dp = xp.where(keep, dp, 0) * ks
        ds = probs * (dp - xp.sum(probs * dp, axis=-1, keepdims=True))
        if need_q:
            gq = astype(xp.matmul(ds, k) * ctx.scale, g.dtype)
        if need_k:
            gk = astype(xp.matmul(_transpose(ds, xp), q) * ctx.scale, g.dtype)
    return gq, gk, gv, ds


def _cpu_forward(q, k, v, mask, scale, causal, p, useed, out, xp):
    full = q.shape[:-1] + k.shape[-2:-1]
    lse = memory.empty(full[:-1], opmath_dtype(q.dtype), xp)  # kept for backward: not a workspace
    for index, rows, ids in _cpu_chunks(full, xp):
        m = _mask_chunk(mask, full, index, rows, xp)
        s = memory.track(
            _scores(_rows_of(q, index, rows), k[index], m, scale, causal, xp, rows.start or 0), "workspace"
        )
        probs, lse[index + (rows,)] = KT.attention_probs_reference(s, 1.0, False, p, useed, index=ids)
        del s
        probs = memory.track(probs.astype(q.dtype, copy=False), "workspace")
        xp.matmul(probs, v[index], out=_rows_of(out, index, rows))
    return lse


def _gpu_raw_scores(q, k, mask, scale, xp):
    """The scores before the row kernel: ``q @ k^T`` (one product), the mask applied (a
    float mask after the scale: then the kernel scales by 1). Returns (scores, kernel scale)."""
    s = memory.track(_mm(q, _transpose(k, xp), xp), "workspace")
    if mask is None:
        return s, scale
    if mask.dtype == np.bool_:
        xp.copyto(s, s.dtype.type(-math.inf), where=~mask)
        return s, scale
    s *= s.dtype.type(scale)
    s += mask.astype(s.dtype, copy=False)
    return s, 1.0


def _gpu_forward(q, k, v, mask, scale, causal, p, useed, out, xp):
    s, kscale = _gpu_raw_scores(q, k, mask, scale, xp)
    rows = s.shape[:-1]
    lse = memory.empty(rows, opmath_dtype(q.dtype), xp)  # kept for backward: not a workspace
    seed = useed if useed is not None else _no_seed(xp)
    # the probabilities over the scores' buffer: each thread reads its row before writing it
    flat = s.reshape(-1)  # raw arrays, flat (new buffers: views)
    KT.attn_softmax(
        flat, s.shape[-1], s.shape[-2], kscale, int(causal), float(p), seed, flat, lse.reshape(-1), size=math.prod(rows)
    )
    _mm(s, v, xp, out=out)
    return lse


def _check_mask(mask, query, key, value, dropout_p) -> None:
    """What PyTorch 2.13 refuses of ``attn_mask``: a dtype other than bool, float32 or the
    query's (an integer mask is not added to the scores); and a mask of fewer than 2 dims
    where it would take its flash path on the CPU (4-D query, key and value, no dropout, a
    mask that needs no gradient), whose check reads the mask's dim -2 (elsewhere its math
    path broadcasts such a mask, and so does this op)."""
    if not isinstance(mask, Tensor):
        raise TypeError("scaled_dot_product_attention: attn_mask must be a Tensor or None")
    if mask.dtype not in (np.bool_, np.float32, query.dtype):
        raise RuntimeError(
            "Expected attn_mask dtype to be bool or float or to match query dtype, but got attn_mask.dtype: "
            f"{cpp_name(mask.dtype)} and  query.dtype: {cpp_name(query.dtype)} instead."
        )
    flash = query.ndim == key.ndim == value.ndim == 4 and dropout_p <= 0 and not mask.requires_grad
    if flash and mask.ndim == 1:
        raise IndexError("Dimension out of range (expected to be in range of [-1, 0], but got -2)")
    if flash and mask.ndim == 0:
        raise IndexError("Dimension specified as -2 but tensor has no dimensions")


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """Attention ``softmax(query @ key^T * scale + attn_mask) @ value``, dropout on the
    probabilities, as PyTorch's.

    Args:
        query: (..., L, E); key: (..., S, E); value: (..., S, Ev); same leading dims.
        attn_mask: None, a bool tensor (True: take part) or a float tensor (float32 or the
            query's dtype) added to the scores, broadcast to (..., L, S). A query row that
            takes part nowhere (all False, or all -inf) gives zeros, and finite gradients,
            as PyTorch's.
        dropout_p: dropout probability on the attention weights (pass 0 in eval, as
            ``F.scaled_dot_product_attention`` users do); outside [0, 1] a RuntimeError.
        is_causal: a top-left causal mask (row i sees columns <= i); not with ``attn_mask``.
        scale: defaults to ``1 / sqrt(E)``.
        enable_gqa: grouped-query attention; only False is supported.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor) or not is_floating(t.dtype):
            raise RuntimeError(f"scaled_dot_product_attention: {name} must be a floating point tensor")
        if t.ndim < 2:
            raise RuntimeError(f"scaled_dot_product_attention: {name} must have at least 2 dims, got {t.ndim}")
    if enable_gqa:
        raise NotImplementedError("scaled_dot_product_attention: enable_gqa=True is not supported")
    if not (query.dtype == key.dtype == value.dtype):
        raise RuntimeError(
            f"Expected query, key, and value to have the same dtype, but got query.dtype: {query.dtype} key.dtype: "
            f"{key.dtype} and value.dtype: {value.dtype} instead."
        )
    if not (query.device == key.device == value.device):
        raise RuntimeError("scaled_dot_product_attention: query, key and value must be on one device")
    lead = query.shape[:-2]
    if key.shape[:-2] != lead or value.shape[:-2] != lead:
        raise RuntimeError(
            f"scaled_dot_product_attention: query {tuple(query.shape)}, key {tuple(key.shape)} and value "
            f"{tuple(value.shape)} must have the same leading (batch, head) dims"
        )
    if key.shape[-1] != query.shape[-1] or value.shape[-2] != key.shape[-2]:
        raise RuntimeError(
            f"scaled_dot_product_attention: key {tuple(key.shape)} must be (..., S, {query.shape[-1]}) and "
            f"value (..., S, Ev) with the same S, for query {tuple(query.shape)}"
        )
    if not 0.0 <= dropout_p <= 1.0:  # PyTorch's RuntimeError (its 4-D path refuses p < 0 too)
        raise RuntimeError(f"dropout probability has to be between 0 and 1, but got {dropout_p}")
    if is_causal and attn_mask is not None:
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")
    if attn_mask is not None:
        _check_mask(attn_mask, query, key, value, dropout_p)
        want = tuple(query.shape[:-1]) + (key.shape[-2],)
        try:
            ok = np.broadcast_shapes(attn_mask.shape, want) == want
        except ValueError:
            ok = False
        if not ok:
            raise RuntimeError(
                f"scaled_dot_product_attention: attn_mask of shape {tuple(attn_mask.shape)} does not "
                f"broadcast to the scores' shape {want}"
            )
        if attn_mask.dtype != np.bool_ and attn_mask.dtype != query.dtype:
            attn_mask = attn_mask.to(dtype=query.dtype)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    return ScaledDotProductAttention.apply(
        query,
        key,
        value,
        attn_mask,
        dropout_p=float(dropout_p),
        is_causal=bool(is_causal),
        scale=float(scale),
    )
