"""Layer normalization over the trailing dims, as ``torch.nn.functional.layer_norm``,
with Apex's memory-efficient mode.

``y = (x - mean) / sqrt(var + eps) * weight + bias``, the statistics of each row (the
biased variance) over ``normalized_shape``, the last dims of ``x``. What backward keeps:

- standard: the input ``x`` (one activation), ``weight``, and each row's statistics (two
  values per row on the CPU, mean and 1/std; one complex ``(sum x, sum x^2)`` on a GPU);
- ``memory_efficient=True`` (Apex's ``FusedLayerNorm(memory_efficient=True)``): the
  OUTPUT instead of the input, ``weight``, ``bias`` and 1/std per row; backward rebuilds
  ``x_hat = (y - bias) / weight``. In a Transformer the output is what the next linear
  layer keeps anyway, so the input's buffer (the residual stream) is no longer held for
  backward: one activation less per LayerNorm. The rebuild is trusted for feature ``j``
  where ``|weight_j|`` is a normal number and ``|bias_j| <= 16 |weight_j|``
  (``kernels_transformer.REBUILD_BIAS_RATIO``): the output's rounding ``u |y|`` then
  moves ``x_hat`` by at most ``u (|x_hat| + 16)`` (``u``: the dtype's unit roundoff). Elsewhere (a weight of 0,
  1e-30, or 1e-6 beside a bias of 0.1: ``(y - bias) / weight`` is 0 / 0, or cancels) the
  CPU keeps that feature's input column (and each row's mean) and computes ``x_hat``
  there as the standard mode does, bit for bit: the mode never refuses and is never
  wrong there, at the cost of an input column per such feature. A GPU cannot know those
  features without reading the weight back (a synchronization, which a CUDA graph cannot
  hold): its kernels refuse such a feature by making its ``x_hat`` NaN, so its weight's
  gradient and x's gradient of every row (the trainer stops at the next non-finite loss).

There is no inplace form: in a pre-LN Transformer block every LayerNorm input is read
again by the residual add, so writing the output over it (InPlace-ABN's trick) would
save nothing there; docs/TRANSFORMERS.md says more.

On a GPU forward is two fused kernels (each row's sums, then the normalization) and
backward three (per-row sums, per-feature sums, then x's gradient, whose kernel also
writes the weight's and bias's gradients): :mod:`.kernels_transformer`. Under
``create_graph`` the CPU formula runs on tensors, with the statistics recomputed from
``x`` with history (standard) or, in the memory-efficient mode, 1/std as a tensor whose
node sends ``d(1/std)/dx = -(1/std)^2 x_hat / n`` to ``x`` (``x`` itself was not kept).
"""

from __future__ import annotations

import math

import numpy as np

from .. import memory
from ..autograd.function import ABSENT, Function
from ..backend import get_array_module
from ..tensor import Tensor, _wrap
from . import kernels_transformer as KT
from .broadcast import astype, sum_axes
from .kernels import on_gpu, opmath_dtype
from .promotion import is_floating


def _axes(x, k):
    """The normalized axes: the last ``k`` of ``x``."""
    return tuple(range(x.ndim - k, x.ndim))


def _row_shape(x, k):
    """What broadcasts a per-row value over ``x``: the leading dims, then ones."""
    return x.shape[: x.ndim - k] + (1,) * k


def _sum_rows(a, lead):
    """``a`` summed over the leading (row) axes; itself when there are none (a tensor's
    ``sum(())`` would sum everything)."""
    return sum_axes(a, lead) if lead else a


def _row_dot(a, w, n, xp):
    """Each row's (the normalized dims') sum of ``a``, weighted by ``w`` (flat) when given."""
    rows = a.reshape(-1, n)
    if w is None:
        return sum_axes(rows, (1,))
    return xp.matmul(rows, w.reshape(n))


def _gpu_param(a, dtype, default):
    return dtype.type(default) if a is None else a.astype(dtype, copy=False)


def _same(v):
    return v


def untrusted_features(weight, bias, dtype):
    """The features (flat indices over the normalized shape) whose ``x_hat`` the
    memory-efficient mode cannot rebuild from the output within its bound
    (:func:`.kernels_transformer.rebuild_trusted`: ``|weight_j|`` below the smallest normal
    number of ``dtype``, 0 included, or ``|bias_j| > 16 |weight_j|``), or None. Host arrays
    (or None: 1 and 0)."""
    w = np.ones(1) if weight is None else weight.reshape(-1)
    b = np.zeros(1) if bias is None else bias.reshape(-1)
    bad = np.flatnonzero(~KT.rebuild_trusted(w, b, dtype))
    return bad if bad.size else None


def _row_stat(i: int):
    """PyTorch's ``_saved_result1`` (i = 0: each row's mean) or ``_saved_result2`` (i = 1:
    its 1/std), shaped ``(..., 1, ...)`` as the rows; ABSENT in the memory-efficient mode."""

    def get(ctx):
        if type(ctx).memory_efficient:
            return ABSENT
        saved = ctx.__dict__.get("_saved")
        if isinstance(saved, dict) and "stats" in saved:  # a GPU's: the moments of each row
            st = ctx.stats
            stats = KT.ln_stats(st, 1.0 / ctx.n, ctx.eps)[i].astype(ctx.dtype)
            return _wrap(stats.reshape(st.shape + (1,) * ctx.k))
        return _wrap(ctx.mean if i == 0 else ctx.rstd)

    return get


class LayerNorm(Function):
    """Layer norm over the last ``k`` dims; saves ``x``, ``weight`` and ``bias`` (as
    PyTorch's node), keeps each row's statistics."""

    node_name = "NativeLayerNormBackward0"
    # the bias as PyTorch's node saves it (no gradient reads it: a parameter's reference,
    # with its version checked as every saved tensor's)
    saves = ("x", "weight", "bias")
    saved_when = {"x": (0, 1), "weight": (0,)}  # x_hat (from x) for x's and weight's gradients
    saved_as = {"x": "input"}
    saved_attrs = {  # PyTorch's NativeLayerNormBackward0
        "normalized_shape": lambda c: c.normalized_shape,
        "result1": _row_stat(0),
        "result2": _row_stat(1),
    }
    memory_efficient = False

    def forward(ctx, x, weight, bias, k=1, eps=1e-5):
        xp = get_array_module(x)
        ctx.k, ctx.eps, ctx.dtype = k, eps, x.dtype
        ctx.n = math.prod(x.shape[x.ndim - k :])
        ctx.normalized_shape = tuple(x.shape[x.ndim - k :])
        ctx.affine = (weight is not None, bias is not None)
        axes = _axes(x, k)
        if on_gpu(x):
            st = memory.empty(x.shape[: x.ndim - k], np.complex128, xp)  # kept for backward: not a workspace
            KT.ln_moments(x, st, axis=axes)
            out = memory.empty(x.shape, x.dtype, xp, "activations")
            w, b = _gpu_param(weight, x.dtype, 1), _gpu_param(bias, x.dtype, 0)
            KT.ln_forward(x, st.reshape(_row_shape(x, k)), 1.0 / ctx.n, eps, w, b, out)
            ctx.keep(stats=st)
            return out
        a = opmath_dtype(x.dtype)
        xa = x.astype(a, copy=False)
        mean = sum_axes(xa, axes, keepdims=True) / a.type(ctx.n)
        y = memory.track(xp.subtract(xa, mean), "activations")
        rows = y.reshape(-1, ctx.n)
        var = xp.einsum("ij,ij->i", rows, rows).reshape(mean.shape) / a.type(ctx.n)
        rstd = a.type(1) / xp.sqrt(var + a.type(eps))
        y = xp.multiply(y, rstd, out=y)
        if weight is not None:
            y = xp.multiply(y, weight, out=y)
        if bias is not None:
            y = xp.add(y, bias, out=y)
        if y.dtype != x.dtype:
            y = memory.track(y.astype(x.dtype), "activations")
        if type(ctx).memory_efficient:
            ctx.keep(rstd=rstd.astype(x.dtype, copy=False))
            ctx.fallback = untrusted_features(weight, bias, x.dtype)
            if ctx.fallback is not None:  # those features' input columns, and each row's mean
                ctx.keep(x_columns=x.reshape(-1, ctx.n)[:, ctx.fallback], mean=mean.astype(x.dtype, copy=False))
        else:
            ctx.keep(mean=mean.astype(x.dtype, copy=False), rstd=rstd.astype(x.dtype, copy=False))
        return y

    def xhat(ctx, up=None):
        """The normalized input, from the input and the row statistics (each converted by
        ``up`` first: half types are computed in float32): a new array (or tensor)."""
        up = up or _same
        xp = get_array_module(ctx.x)
        xhat = xp.subtract(up(ctx.x), up(ctx.mean))
        return xp.multiply(xhat, up(ctx.rstd), out=xhat)

    def backward(ctx, g):
        need_x, need_w, need_b = ctx.needs_input_grad
        _ = ctx.bias  # unpacked, as PyTorch's node unpacks it: a bias changed in place since raises
        if on_gpu(g):
            return ctx.gpu_backward(g, need_x, need_w, need_b)
        xp = get_array_module(g)
        lead = tuple(range(g.ndim - ctx.k))
        dtype = g.dtype
        # Half types: every sum and product in float32, rounded once at the end (a bfloat16
        # sum over the rows loses a digit); under create_graph too, with differentiable
        # conversions, so that both give the same first-order gradients. Written through
        # out= and the values returned: in place on arrays, new tensors under create_graph.
        a = opmath_dtype(dtype)
        up = _same if a == dtype else (lambda v: astype(v, a))
        g = up(g)
        gx = gw = gb = None
        if need_b:
            gb = astype(_sum_rows(g, lead), dtype)
        if need_x or need_w:
            xhat = ctx.xhat(up)
            gxhat = g * xhat
            if need_w:
                gw = astype(_sum_rows(gxhat, lead), dtype)
            if need_x:
                # x's gradient: rstd (w g - mean(w g) - x_hat mean(w g x_hat)), the two row
                # means as products with w (a BLAS matrix-vector product on arrays)
                w = up(ctx.weight) if ctx.affine[0] else None
                n, rows = ctx.n, _row_shape(g, ctx.k)
                c1 = _row_dot(g, w, n, xp).reshape(rows) / n
                c2 = _row_dot(gxhat, w, n, xp).reshape(rows) / n
                gx = g * w if w is not None else xp.subtract(g, c1)
                if w is not None:
                    gx = xp.subtract(gx, c1, out=gx)
                gxhat = xp.multiply(xhat, c2, out=gxhat)
                gx = xp.subtract(gx, gxhat, out=gx)
                gx = astype(xp.multiply(gx, up(ctx.rstd), out=gx), dtype)
        return gx, gw, gb

    def gpu_sources(ctx, w, dtype):
        """What the backward kernels rebuild x_hat from (after ``g, w``): x."""
        return (ctx.x,)

    def gpu_backward(ctx, g, need_x, need_w, need_b):
        """Fused kernels: the per-feature sums (when the weight or bias needs a gradient),
        the per-row sums and x's gradient (whose kernel writes the weight's and bias's too)."""
        xp = get_array_module(g)
        k, dtype = ctx.k, g.dtype
        axes, lead = _axes(g, k), tuple(range(g.ndim - k))
        if not (need_x or need_w):  # the bias alone: a plain sum
            return None, None, g.sum(lead).astype(dtype, copy=False)
        me = type(ctx).memory_efficient
        # the weight enters x's gradient (and, in the memory-efficient mode, x_hat)
        w = _gpu_param(ctx.weight if ctx.affine[0] and (need_x or me) else None, dtype, 1)
        st = ctx.stats.reshape(_row_shape(g, k))
        tail = (*ctx.gpu_sources(w, dtype), st, 1.0 / ctx.n, ctx.eps)
        affine = need_w or need_b
        f = gw = gb = None
        if affine:
            f = memory.empty(g.shape[g.ndim - k :], np.complex128, xp, "workspace")
            KT.ln_feature_sums[me](g, w, *tail, f, axis=lead)
            gw, gb = memory.empty(f.shape, dtype, xp), memory.empty(f.shape, dtype, xp)
        gx = None
        if need_x:
            r = memory.empty(g.shape[: g.ndim - k], np.complex128, xp, "workspace")
            KT.ln_row_sums[me](g, w, *tail, r, axis=axes)
            gx = memory.empty(g.shape, dtype, xp)
            # the normalized shape's values as flat raw arrays (new buffers: views)
            extra = (f.reshape(-1), f.size, gx, gw.reshape(-1), gb.reshape(-1)) if affine else (gx,)
            KT.ln_backward[me, affine](g, w, *tail, r.reshape(_row_shape(g, k)), *extra)
        elif affine:
            KT.ln_affine_grads(f, gw, gb)
        return gx, gw if need_w else None, gb if need_b else None

    def kept_as_tensors(ctx):
        """Under create_graph: the row statistics as functions of ``x`` with history."""
        kept = ctx.__dict__.get("_graph_kept")
        if kept is None:
            x = ctx.x
            axes = _axes(x, ctx.k)
            a = opmath_dtype(x.dtype)  # computed as forward computed them, rounded alike
            xa = astype(x, a)
            mean = xa.mean(axes, keepdim=True)
            d = xa - mean
            var = (d * d).mean(axes, keepdim=True)
            rstd = 1.0 / (var + ctx.eps).sqrt()
            kept = ctx._graph_kept = {"mean": astype(mean, x.dtype), "rstd": astype(rstd, x.dtype)}
        return kept


class LayerNormMemoryEfficient(LayerNorm):
    """Apex's memory-efficient LayerNorm: saves the OUTPUT, ``weight`` and ``bias`` (not
    ``x``) and keeps 1/std per row; backward rebuilds ``x_hat = (y - bias) / weight``."""

    node_name = "LayerNormMemoryEfficientBackward0"  # no PyTorch node keeps what this one does
    saves = ("result", "weight", "bias")
    saved_when = {"result": (0, 1), "weight": (0, 1), "bias": (0, 1)}  # x_hat, for x's and weight's
    saved_as = {}
    saved_attrs = {}
    memory_efficient = True

    def forward(ctx, x, weight, bias, k=1, eps=1e-5):
        return LayerNorm.forward(ctx, x, weight, bias, k=k, eps=eps)

    def xhat(ctx, up=None):
        """The normalized input, rebuilt from the output (converted by ``up`` first); the
        untrusted features' (``ctx.fallback``) from their kept input columns, as the
        standard mode computes it."""
        up = up or _same
        fallback = ctx.__dict__.get("fallback")
        xhat = up(ctx.result)
        if fallback is not None and xhat.__class__ is Tensor:
            raise NotImplementedError(
                "layer_norm(memory_efficient=True): a second derivative where the weight has an element "
                f"of 0 or near it beside the bias (features {fallback.tolist()[:8]}) is not supported; "
                "use memory_efficient=False"
            )
        with np.errstate(divide="ignore", invalid="ignore"):  # the untrusted features: replaced below
            if ctx.affine[1]:
                xhat = xhat - up(ctx.bias)
            if ctx.affine[0]:
                xhat = xhat / up(ctx.weight)
        if fallback is not None:
            rows = xhat.reshape(-1, ctx.n)  # a new C-ordered array: a view
            rows[:, fallback] = (up(ctx.x_columns) - up(ctx.mean).reshape(-1, 1)) * up(ctx.rstd).reshape(-1, 1)
        return xhat

    def gpu_sources(ctx, w, dtype):
        """What the backward kernels rebuild x_hat from (after ``g, w``): y and the bias."""
        return (ctx.result, _gpu_param(ctx.bias if ctx.affine[1] else None, dtype, 0))

    def kept_as_tensors(ctx):
        """Under create_graph: 1/std per row, a function of ``x``, whose values are gone: a
        tensor whose node sends ``d(1/std)/dx = -(1/std)^2 x_hat / n`` to ``x``, with x_hat
        rebuilt from the output as backward does."""
        kept = ctx.__dict__.get("_graph_kept")
        if kept is not None:
            return kept
        saved = ctx.__dict__["_saved"]
        if "stats" in saved:  # the GPU kept each row's sums
            y = saved["result"].unpack(ctx)
            _, rstd = KT.ln_stats(saved["stats"].unpack(ctx), 1.0 / ctx.n, ctx.eps)
            rstd = rstd.astype(y.dtype).reshape(_row_shape(y, ctx.k))
        else:
            rstd = saved["rstd"].unpack(ctx)
        t = Tensor._from_array(rstd)
        edge = ctx.next[0]
        if edge is not None:
            t._grad_fn = _Rstd(edge, t, ctx.xhat(), ctx.k, ctx.n)
        kept = ctx._graph_kept = {"rstd": t}
        return kept


class _Rstd(Function):
    """The node of the memory-efficient LayerNorm's 1/std under create_graph (see
    ``LayerNormMemoryEfficient.kept_as_tensors``): ``d(rstd_r)/dx_rj = -rstd_r^2 x_hat_rj / n``."""

    def __init__(self, edge, rstd, xhat, k, n):
        self.next = (edge,)
        self.needs_input_grad = (True,)
        self.rstd, self.xhat, self.k, self.n = rstd, xhat, k, n

    def backward(ctx, g):
        rstd, xhat = (ctx.rstd, ctx.xhat) if g.__class__ is Tensor else (ctx.rstd._data, ctx.xhat._data)
        return (-(rstd * rstd * g / ctx.n)) * xhat


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, memory_efficient=False):
    """Layer normalization over the last ``len(normalized_shape)`` dims.

    Args:
        input: floating point tensor ``(*, *normalized_shape)``.
        normalized_shape: int or tuple: the trailing dims to normalize over.
        weight, bias: tensors of ``normalized_shape`` or None.
        eps: added to the variance.
        memory_efficient: keep the output instead of the input for backward (Apex's mode;
            where a weight is 0, or small beside its bias, see the module docstring).
    """
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    normalized_shape = tuple(int(n) for n in normalized_shape)
    k = len(normalized_shape)
    if not isinstance(input, Tensor) or not is_floating(input.dtype):
        raise RuntimeError("layer_norm: expected a floating point input tensor")
    if k == 0 or tuple(input.shape[input.ndim - k :]) != normalized_shape or input.ndim < k:
        raise RuntimeError(
            f"Given normalized_shape={list(normalized_shape)}, expected input with shape "
            f"[*, {', '.join(map(str, normalized_shape))}], but got input of size{list(input.shape)}"
        )
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and tuple(p.shape) != normalized_shape:
            raise RuntimeError(f"layer_norm: {name} of shape {tuple(p.shape)}, expected {normalized_shape}")
    op = LayerNormMemoryEfficient if memory_efficient else LayerNorm
    return op.apply(input, weight, bias, k=k, eps=eps)
