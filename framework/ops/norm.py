"""Batch normalization and InPlace-ABN (BatchNorm + leaky ReLU fused, in place).

What each path keeps for backward (``memory.saved_bytes()`` sees all of it):

- ``batch_norm``, training: the input ``x`` (one activation), ``weight``, and the
  per-channel batch mean and inverse std (2 x C values). Its output is a new buffer; an
  activation after it (relu, leaky_relu) keeps that output too: BN + activation holds
  two activations whether or not the activation runs in place.
- ``batch_norm``, eval: ``x`` only if ``weight`` needs a gradient, ``weight`` only if
  ``x`` does, plus per-channel copies of the running statistics (later training steps
  update the running buffers in place; backward must not see those updates).
- ``inplace_abn`` (Rota Bulo et al., CVPR 2018): overwrites the input's buffer with
  ``y = leaky_relu(x_hat * (|weight| + eps) + bias)`` and keeps only ``y`` (the same
  buffer), ``weight``, ``bias`` and the per-channel inverse std: ONE activation. Backward
  inverts the leaky ReLU (``y / slope`` where ``y <= 0``) and the affine step
  (``x_hat = (z - bias) / (|weight| + eps)``; ``|weight| + eps > 0`` makes it invertible),
  then runs the usual BN backward in terms of ``x_hat``.
- ``inplace_abn(..., residual=r)``: ``y = leaky_relu(x_hat * (|weight| + eps) + bias + r)``
  over x's buffer, for a basic block's second unit (BN + residual add + activation
  fused). Keeps ``y`` and ``r`` BY REFERENCE (no copy; in a ResNet ``r`` is the block
  input, which the block's first conv keeps anyway, so it costs nothing more); backward
  subtracts ``r`` from the inverted activation before inverting the affine step, and
  ``r``'s gradient is the gradient w.r.t. the pre-activation sum. ``r`` is
  version-checked: modifying it in place before backward raises.

Running statistics follow PyTorch: in training they move toward the batch mean and the
UNBIASED batch variance with ``momentum``, in place under ``no_grad`` (one inplace op
per buffer and call, allocating nothing, so each buffer's version bumps by exactly 1, as
in PyTorch); the output is normalized with the BIASED variance.

Per-channel reductions use ``einsum`` over an (N, C, rest) view: no full-size temporary
(3x faster than ``(d * d).sum(axes)`` on NumPy, and as accurate as pairwise sums).
Full-size temporaries go through :mod:`framework.memory` (category ``workspace``).

On a GPU (:func:`.kernels.on_gpu`) each Function runs its fused kernels instead
(:mod:`.kernels`): in training one reduction for the per-channel sums (``(sum x,
sum x^2)`` in one pass, in double precision) and one elementwise kernel each way, the
statistics derived inside the kernels; in eval one tiny kernel makes a private copy of
the running statistics as ``(mean, invstd)``. What each Function saves and its inplace
rules do not change; the per-channel statistics it keeps are then that one complex
array (``stats``) instead of ``mean``/``invstd``. SyncBatchNorm (``comm``) keeps the
general path, which its host-side reduction needs anyway.
"""

from __future__ import annotations

from numbers import Real

import numpy as np

from .. import backend, memory
from ..autograd.function import Function
from ..autograd.grad_mode import no_grad
from ..autograd.grad_mode import state as grad_state
from ..backend import get_array_module
from ..tensor import Tensor
from . import kernels as K
from .broadcast import astype
from .elementwise import mask_grad
from .kernels import on_gpu
from .promotion import half_on_cpu, is_floating, narrow, widen

__all__ = ["batch_norm", "inplace_abn", "BatchNorm", "BatchNormEval", "InPlaceABN"]


# --- per-channel helpers ------------------------------------------------------------


def _cshape(shape) -> tuple:
    """Shape that broadcasts a (C,) array over an (N, C, ...) array."""
    return (1, shape[1]) + (1,) * (len(shape) - 2)


def _rows(a, xp):
    """``a`` as (N, C, rest): a view when the strides allow, else a counted copy."""
    r = a.reshape(a.shape[0], a.shape[1], -1)
    if not xp.may_share_memory(r, a):
        memory.track(r, "workspace")
    return r


def _csum(a, xp):
    """Per-channel sum of an (N, C, ...) array (or tensor, under create_graph)."""
    if a.__class__ is Tensor:
        return a.sum(_caxes(a.ndim))
    return xp.einsum("ncs->c", _rows(a, xp))


def _cdot(a, b, xp):
    """Per-channel sum of ``a * b`` without a full-size temporary."""
    if a.__class__ is Tensor or b.__class__ is Tensor:
        return xp.multiply(a, b).sum(_caxes(a.ndim))
    return xp.einsum("ncs,ncs->c", _rows(a, xp), _rows(b, xp))


def _count(shape) -> int:
    """Values per channel: N * H * W ..."""
    m = shape[0]
    for n in shape[2:]:
        m *= n
    return m


def _channel(a, dtype):
    return None if a is None else astype(a, dtype)


def _normalize_into(out, x, stats, xp):
    """Writes ``x - mean`` into ``out`` and returns per-channel (mean, biased var).

    ``stats`` holds the batch statistics afterwards, for the running-stat update.
    ``out`` may be ``x`` itself (InPlace-ABN): the mean is taken before anything is written.
    """
    m = _count(x.shape)
    mean = _csum(x, xp) / m
    xp.subtract(x, mean.reshape(_cshape(x.shape)), out=out)
    var = _cdot(out, out, xp) / m
    if stats is not None:
        stats["mean"], stats["var"], stats["count"] = mean, var, m
    return mean, var


def _global_moments(x, comm, stats, xp):
    """Per-channel (mean, biased var, count) over the inputs of every rank of ``comm``.

    ``[count, sum x, sum x^2]`` (float64) go into ONE buffer reduced in place, so ranks
    may hold different batch sizes (the count is reduced with the sums). Used by
    SyncBatchNorm (framework.distributed.sync_batchnorm); ``comm`` is any object with
    ``allreduce_(buf, op)``.

    The buffer is host memory (the communicators reduce NumPy arrays); on a GPU the sums
    are copied to it and the statistics back to the device, 2 x C values each way.
    """
    c = x.shape[1]
    r = _rows(x, xp)
    buf = np.empty(2 * c + 1, dtype=np.float64)
    buf[0] = _count(x.shape)
    buf[1 : c + 1] = backend.to_numpy(xp.einsum("ncs->c", r, dtype=np.float64))
    buf[c + 1 :] = backend.to_numpy(xp.einsum("ncs,ncs->c", r, r, dtype=np.float64))
    comm.allreduce_(buf, "sum")
    m = int(round(buf[0]))
    if m <= 1:
        raise ValueError(
            f"sync_batch_norm: expected more than 1 value per channel over all ranks when training, "
            f"got {m} (local input size {x.shape})"
        )
    mean = buf[1 : c + 1] / m
    var = np.maximum(buf[c + 1 :] / m - mean * mean, 0.0)
    mean, var = xp.asarray(mean), xp.asarray(var)  # back on x's device (NumPy: the same arrays)
    if stats is not None:
        stats["mean"], stats["var"], stats["count"] = mean, var, m
    return mean, var, m


def _global_sums(comm, *per_channel):
    """The per-channel arrays summed over every rank: one float64 buffer reduced in place.

    Tensors (a backward under create_graph) go through :class:`AllReduceSum` instead, in
    float64 as the buffer, so that the sums keep their history; the arrays' path is
    unchanged.
    """
    if per_channel[0].__class__ is Tensor:  # then all are: sums of the tensor gradient
        xp = get_array_module(per_channel[0])
        c = per_channel[0].shape[0]
        s = AllReduceSum.apply(xp.concatenate([xp.asarray(a, np.float64) for a in per_channel]), comm=comm)
        return [s[k * c : (k + 1) * c] for k in range(len(per_channel))]
    c = per_channel[0].shape[0]
    xp = get_array_module(per_channel[0])
    buf = np.empty(len(per_channel) * c, dtype=np.float64)  # host memory, as _global_moments
    for k, a in enumerate(per_channel):
        buf[k * c : (k + 1) * c] = backend.to_numpy(a)
    comm.allreduce_(buf, "sum")
    return [xp.asarray(buf[k * c : (k + 1) * c]) for k in range(len(per_channel))]


class AllReduceSum(Function):
    """A 1-D array summed over every rank of ``comm``: SyncBatchNorm's reduction as an op,
    for its statistics and backward sums under create_graph.

    Its backward is the same all-reduce of the incoming gradient: the adjoint when the
    loss is the sum of every rank's loss, which SyncBatchNorm's first-order backward
    assumes too (its input gradient takes the sums of every rank's ``g``). Going through
    :func:`_global_sums`, a backward under create_graph is this op again: any order.
    """

    def forward(ctx, a, comm=None):
        ctx.comm = comm
        return _global_sums(comm, a)[0].astype(a.dtype, copy=False)

    def backward(ctx, g):
        return astype(_global_sums(ctx.comm, g)[0], g.dtype)


def _caxes(ndim) -> tuple:
    """The axes a per-channel reduction sums over: all but axis 1."""
    return (0,) + tuple(range(2, ndim))


def _gpu_param(a, dtype, cs, default):
    """A (C,) parameter as the fused kernels take it: broadcast to ``cs``, or a scalar."""
    return default if a is None else _channel(a, dtype).reshape(cs)


def _gpu_abs_weight(weight, dtype, cs, eps):
    """``(w, aeps)`` with ``a = |w| + aeps`` as InPlace-ABN's kernels take it (a = 1 without a weight)."""
    t = np.dtype(dtype).type
    return (t(1), t(0)) if weight is None else (_channel(weight, dtype).reshape(cs), t(eps))


def _channel_sums(kernel, args, out, shape, xp):
    """``kernel(*args, out, axis=_caxes(...))``, a reduction of an (N, C, ...) map to C values.

    With spatial axes it runs as two launches: over them into (N, C) complex128 partial sums,
    then ``channel_sums`` over N into ``out``. CuPy's ReductionKernel gives each output to one
    thread block at most (several contiguous outputs to one block), so ONE reduction to C
    values kept all but a few of a GPU's multiprocessors idle: BatchNorm's gradient sums took
    4.2 ms of each 4.7 ms BatchNorm backward of ResNet-20 at batch 256 on an H200, 89% of the
    step's GPU time. The partial sums add in float64, as the one-launch reduction did.
    """
    if len(shape) <= 2:
        kernel(*args, out, axis=(0,))
        return out
    partial = memory.empty(shape[:2], np.complex128, xp, "workspace")
    kernel(*args, partial, axis=tuple(range(2, len(shape))))
    K.channel_sums(partial, out, axis=(0,))
    return out


def _gpu_moments(x, xp):
    """The batch's per-channel ``sum x + 1j * sum x^2`` (complex128, C values): two launches
    (:func:`_channel_sums`)."""
    s = memory.empty((x.shape[1],), np.complex128, xp)  # kept for backward: not a workspace
    return _channel_sums(K.bn_moments, (x,), s, x.shape, xp)


def _gpu_eval_stats(mean, var, eps, xp):
    """``mean + 1j * invstd`` of given statistics (a private copy: ONE launch over C values)."""
    s = memory.empty(mean.shape, np.complex128, xp)  # kept for backward: not a workspace
    K.bn_eval_stats(mean, var.astype(mean.dtype, copy=False), eps, s)
    return s


def _gpu_grad_sums(g, x, s, inv_m, eps, xp):
    """Per-channel ``sum g + 1j * sum g * x_hat`` in g's precision (:func:`_channel_sums`)."""
    r = memory.empty((g.shape[1],), np.result_type(g.dtype, np.complex64), xp)
    return _channel_sums(K.bn_grad_sums, (g, x, s.reshape(_cshape(g.shape)), inv_m, eps), r, g.shape, xp)


def _leaky_relu_inplace(z, slope, xp):
    """``z = leaky_relu(z)`` for ``slope > 0``: max(z, slope * z) (min when slope > 1).

    One temporary (``slope * z``); NumPy's masked ``multiply(..., where=z < 0)`` would
    need only a bool mask but runs ~15x slower.
    """
    tmp = memory.track(xp.multiply(z, z.dtype.type(slope)), "workspace")
    (xp.maximum if slope <= 1 else xp.minimum)(z, tmp, out=z)
    return z


# --- batch norm -----------------------------------------------------------------------


class BatchNorm(Function):
    """Training-mode BN with batch statistics. Backward is the fused BN formula.

    With ``comm`` (SyncBatchNorm) the statistics are those of every rank's batch, and
    the two per-channel sums the input's gradient needs are reduced over the ranks too;
    the weight and bias gradients stay local sums, as in PyTorch (DataParallel reduces
    them like any gradient). Saves ``x`` and ``weight``; keeps the per-channel mean and
    inverse std. Under create_graph the sums over ranks go through :class:`AllReduceSum`.
    """

    node_name = "NativeBatchNormBackward0"

    inplace_name = "batch_norm_"
    saves = ("x", "weight")
    saved_when = {"weight": (0,)}  # weight enters only the input's gradient
    saved_as = {"x": "input"}  # PyTorch's NativeBatchNormBackward0

    def forward(ctx, x, weight, bias, eps=1e-5, stats=None, comm=None):
        xp = get_array_module(x)
        cs = _cshape(x.shape)
        out = ctx.out if ctx.out is not None else memory.empty(x.shape, x.dtype, xp, "activations")
        ctx.m, ctx.comm, ctx.eps = _count(x.shape), comm, eps
        if comm is None and on_gpu(x):
            s = _gpu_moments(x, xp)
            t = x.dtype.type
            w, b = _gpu_param(weight, x.dtype, cs, t(1)), _gpu_param(bias, x.dtype, cs, t(0))
            K.bn_forward(x, s.reshape(cs), 1.0 / ctx.m, eps, w, b, out)
            if stats is not None:
                stats["moments"], stats["count"] = s, ctx.m
            ctx.keep(stats=s)
            return out
        half = half_on_cpu(x.dtype, xp)
        if half is not None:  # in float32, rounded once into the output (see half_on_cpu)
            given, ctx.out = ctx.out, None  # the float32 pass writes a buffer of its own
            out32 = BatchNorm.forward(ctx, widen(x), weight, bias, eps, stats, comm)
            ctx.out = given
            return narrow(out32, half, "activations", out)
        if comm is None:
            mean, var = _normalize_into(out, x, stats, xp)
            m = _count(x.shape)
        else:
            mean, var, m = _global_moments(x, comm, stats, xp)
            mean = mean.astype(x.dtype)
            xp.subtract(x, mean.reshape(cs), out=out)
        invstd = (1.0 / xp.sqrt(var + eps)).astype(x.dtype, copy=False)
        scale = invstd if weight is None else invstd * _channel(weight, x.dtype)
        out *= scale.reshape(cs)
        if bias is not None:
            out += _channel(bias, x.dtype).reshape(cs)
        ctx.m = m
        ctx.keep(mean=mean, invstd=invstd)
        return out

    def backward(ctx, g):
        need_x, need_w, need_b = ctx.needs_input_grad
        xp = get_array_module(g)
        x = ctx.x
        cs = _cshape(x.shape)
        if on_gpu(g) and ctx.comm is None:
            r = _gpu_grad_sums(g, x, ctx.stats, 1.0 / ctx.m, ctx.eps, xp)
            if not need_x:  # the weight's and bias's gradients are r's two sums
                return None, r.imag if need_w else None, r.real if need_b else None
            gx = memory.empty(x.shape, x.dtype, xp)
            w = _gpu_param(ctx.weight, x.dtype, cs, x.dtype.type(1))
            args = (g, x, ctx.stats.reshape(cs), 1.0 / ctx.m, ctx.eps, w, r.reshape(cs))
            if not (need_w or need_b):
                K.bn_backward(*args, gx)
                return gx, None, None
            # the same kernel writes r's sums as arrays of their own (no copy of a view later)
            c = x.shape[1]
            gw, gb = memory.empty((c,), x.dtype, xp), memory.empty((c,), x.dtype, xp)
            K.bn_backward_affine(*args, c, x.size // (x.shape[0] * c), gx, gw, gb)
            return gx, gw if need_w else None, gb if need_b else None
        half = half_on_cpu(g.dtype, xp)
        if half is not None:  # in float32, x's gradient rounded once (the weight's and bias's stay float32)
            x, g = widen(x), widen(g)
        # Written with out= and the results assigned: in place on arrays (xhat's buffer
        # becomes the input's gradient); new tensors under create_graph, where mean and
        # invstd are recomputed from x with history (kept_as_tensors)
        mean, invstd = ctx.mean, ctx.invstd
        xhat = memory.empty(x.shape, x.dtype, xp)  # becomes the input's gradient
        xhat = xp.subtract(x, mean.reshape(cs), out=xhat)
        xhat = xp.multiply(xhat, invstd.reshape(cs), out=xhat)
        gb = _csum(g, xp)
        gw = _cdot(g, xhat, xp)
        gx = None
        if need_x:
            w = ctx.weight
            scale = invstd if w is None else invstd * _channel(w, x.dtype)
            sum_g, sum_gx = (gb, gw) if ctx.comm is None else _global_sums(ctx.comm, gb, gw)
            # dx = w * invstd * (g - mean(g) - x_hat * mean(g * x_hat)), per channel, with the
            # means over every rank's values under SyncBatchNorm
            t = xp.multiply(xhat, astype(sum_gx / ctx.m, x.dtype).reshape(cs), out=xhat)
            t = xp.add(t, astype(sum_g / ctx.m, x.dtype).reshape(cs), out=t)
            t = xp.subtract(g, t, out=t)
            gx = xp.multiply(t, scale.reshape(cs), out=t)
            if half is not None:
                gx = narrow(gx, half)
        return gx, gw if need_w else None, gb if need_b else None

    def kept_as_tensors(ctx):
        """Under create_graph: the batch mean and inverse std as functions of x (with its
        history), so that their dependence on x is differentiated too (forward's formula:
        the mean and the biased variance per channel)."""
        kept = ctx.__dict__.get("_graph_kept")
        if kept is None and ctx.comm is not None:
            kept = ctx._graph_kept = _global_kept(ctx.x, ctx.comm, ctx.m, ctx.eps)
        if kept is None:
            x = ctx.x
            axes = _caxes(x.ndim)
            mean = x.mean(axes)
            d = x - mean.reshape(_cshape(x.shape))
            var = (d * d).mean(axes)
            kept = ctx._graph_kept = {"mean": mean, "invstd": 1.0 / (var + ctx.eps).sqrt()}
        return kept


def _global_kept(x, comm, m, eps):
    """SyncBatchNorm's mean and inverse std as tensors of x (with history): forward's
    arithmetic (_global_moments: float64 sums of x and x^2 over every rank, the count
    ``m`` of every rank's values), the sums through :class:`AllReduceSum`."""
    xp = get_array_module(x)
    axes = _caxes(x.ndim)
    x64 = astype(x, np.float64)
    s = _global_sums(comm, x64.sum(axes), (x64 * x64).sum(axes))
    mean = s[0] / m
    var = xp.maximum(s[1] / m - mean * mean, 0.0)
    return {"mean": astype(mean, x.dtype), "invstd": astype(1.0 / (var + eps).sqrt(), x.dtype)}


class BatchNormEval(Function):
    """Eval-mode BN with given (running) statistics: an affine map per channel."""

    node_name = "NativeBatchNormBackward0"

    saves = ("x", "weight")
    saved_when = {"x": (1,), "weight": (0,)}
    saved_as = {"x": "input"}  # PyTorch's NativeBatchNormBackward0

    def forward(ctx, x, weight, bias, mean=None, var=None, eps=1e-5):
        xp = get_array_module(x)
        cs = _cshape(x.shape)
        ctx.eps = eps
        if on_gpu(x):
            s = _gpu_eval_stats(mean, var, eps, xp)
            t = x.dtype.type
            w, b = _gpu_param(weight, x.dtype, cs, t(1)), _gpu_param(bias, x.dtype, cs, t(0))
            out = ctx.out if ctx.out is not None else memory.empty(x.shape, x.dtype, xp, "activations")
            K.bn_forward(x, s.reshape(cs), 0.0, eps, w, b, out)
            ctx.keep(stats=s)
            ctx.dtype = x.dtype
            return out
        half = half_on_cpu(x.dtype, xp)
        if half is not None:  # in float32, rounded once into the output (see half_on_cpu)
            given, ctx.out = ctx.out, None  # the float32 pass writes a buffer of its own
            out32 = BatchNormEval.forward(ctx, widen(x), weight, bias, mean, var, eps)
            ctx.out = given
            return narrow(out32, half, "activations", given)
        mean = mean.astype(x.dtype, copy=True)  # private: running buffers change in place later
        invstd = 1.0 / xp.sqrt(var.astype(x.dtype, copy=False) + eps)
        scale = invstd if weight is None else invstd * _channel(weight, x.dtype)
        shift = -mean * scale
        if bias is not None:
            shift += _channel(bias, x.dtype)
        out = ctx.out if ctx.out is not None else memory.empty(x.shape, x.dtype, xp, "activations")
        xp.multiply(x, scale.reshape(cs), out=out)
        out += shift.reshape(cs)
        ctx.keep(mean=mean, invstd=invstd)
        return out

    def backward(ctx, g):
        need_x, need_w, need_b = ctx.needs_input_grad
        xp = get_array_module(g)
        cs = _cshape(g.shape)
        if on_gpu(g):
            return ctx.gpu_backward(g, need_x, need_w, need_b, xp, cs)
        invstd = ctx.invstd
        gx = gw = gb = None
        half = half_on_cpu(g.dtype, xp)
        if half is not None:  # in float32, x's gradient rounded once
            g = widen(g)
        if need_w:
            x = ctx.x if half is None else widen(ctx.x)
            xhat = memory.empty(x.shape, x.dtype, xp, "workspace")
            xhat = xp.subtract(x, ctx.mean.reshape(cs), out=xhat)
            xhat = xp.multiply(xhat, invstd.reshape(cs), out=xhat)
            gw = _cdot(g, xhat, xp)
            del xhat
        if need_b:
            gb = _csum(g, xp)
        if need_x:
            w = ctx.weight
            scale = invstd if w is None else invstd * _channel(w, g.dtype)
            gx = memory.empty(g.shape, g.dtype, xp)
            gx = xp.multiply(g, scale.reshape(cs), out=gx)
            if half is not None:
                gx = narrow(gx, half)
        return gx, gw, gb

    def kept_as_tensors(ctx):
        """Under create_graph: the statistics as constants (they are the running ones),
        as the CPU formula reads them, also where the GPU kept them as one complex array."""
        saved = ctx.__dict__.get("_saved") or {}
        if "stats" not in saved:
            return {}
        s = saved["stats"].unpack(ctx)
        mean, invstd = s.real.astype(ctx.dtype), s.imag.astype(ctx.dtype)
        return {"mean": Tensor._from_array(mean), "invstd": Tensor._from_array(invstd)}

    def gpu_backward(ctx, g, need_x, need_w, need_b, xp, cs):
        s = ctx.stats
        gx = gw = gb = None
        if need_w:  # one reduction gives both sums (x is saved only when weight needs a gradient)
            r = _gpu_grad_sums(g, ctx.x, s, 0.0, ctx.eps, xp)
            gw, gb = r.imag, r.real if need_b else None
        elif need_b:
            gb = g.sum(axis=_caxes(g.ndim))
        if need_x:
            gx = memory.empty(g.shape, g.dtype, xp)
            K.bn_scale(g, s.reshape(cs), 0.0, ctx.eps, _gpu_param(ctx.weight, g.dtype, cs, g.dtype.type(1)), gx)
        return gx, gw, gb


# --- InPlace-ABN ----------------------------------------------------------------------


class InPlaceABN(Function):
    """BatchNorm + leaky ReLU (optionally + a residual) written over the input; backward
    reconstructs x_hat from y.

    ``y = leaky_relu(x_hat * a + bias [+ residual])`` with ``a = |weight| + eps``.
    Forward's ``mean``/``var`` given: eval mode (those statistics are constants);
    ``None``: batch statistics (training). Saves the result, ``weight``, ``bias`` and the
    ``residual`` (by reference, version-checked: it is the block input, which the block's
    first conv keeps anyway); keeps the per-channel inverse std (and nothing else: x_hat
    comes back from y).
    """

    inplace_name = "inplace_abn"
    saves = ("result", "weight", "bias", "residual")
    # The residual only enters the rebuilt x_hat, which only x's and weight's gradients read.
    saved_when = {"residual": (0, 1)}

    def forward(ctx, x, weight, bias, residual=None, mean=None, var=None, eps=1e-5, negative_slope=0.01, stats=None):
        xp = get_array_module(x)
        cs = _cshape(x.shape)
        out = ctx.out if ctx.out is not None else memory.empty(x.shape, x.dtype, xp, "activations")
        ctx.batch = mean is None
        ctx.eps, ctx.slope, ctx.m = eps, negative_slope, _count(x.shape)
        if on_gpu(x):
            if ctx.batch:
                s = _gpu_moments(x, xp)
                if stats is not None:
                    stats["moments"], stats["count"] = s, ctx.m
            else:
                s = _gpu_eval_stats(mean, var, eps, xp)
            t = x.dtype.type
            w, aeps = _gpu_abs_weight(weight, x.dtype, cs, eps)
            b = _gpu_param(bias, x.dtype, cs, t(0))
            r = t(0) if residual is None else residual
            K.abn_forward(x, s.reshape(cs), 1.0 / ctx.m if ctx.batch else 0.0, eps, w, aeps, b, r, negative_slope, out)
            ctx.keep(stats=s)
            ctx.dtype = x.dtype
            return out
        half = half_on_cpu(x.dtype, xp)
        if half is not None:  # in float32, rounded once into the output (x's buffer in place)
            given, ctx.out = ctx.out, None  # the float32 pass writes a buffer of its own
            out32 = InPlaceABN.forward(
                ctx, widen(x), weight, bias, widen(residual), mean, var, eps, negative_slope, stats
            )
            ctx.out = given
            return narrow(out32, half, "activations", out)
        if ctx.batch:
            _, var = _normalize_into(out, x, stats, xp)
        else:
            xp.subtract(x, mean.astype(x.dtype, copy=False).reshape(cs), out=out)
            var = var.astype(x.dtype, copy=False)
        invstd = 1.0 / xp.sqrt(var + eps)
        a = 1.0 if weight is None else xp.abs(_channel(weight, x.dtype)) + eps
        out *= (invstd * a).reshape(cs)
        if bias is not None:
            out += _channel(bias, x.dtype).reshape(cs)
        if residual is not None:
            out += residual
        _leaky_relu_inplace(out, negative_slope, xp)
        ctx.keep(invstd=invstd)
        return out

    def backward(ctx, g):
        need_x, need_w, need_b, need_r = ctx.needs_input_grad
        xp = get_array_module(g)
        y = ctx.result
        cs = _cshape(y.shape)
        if on_gpu(g):
            return ctx.gpu_backward(g, y, cs, xp)
        half = half_on_cpu(g.dtype, xp)
        if half is not None:  # in float32 from the rounded output; x's and the residual's gradients rounded once
            y, g = widen(y), widen(g)
        # Written with out= and the results assigned: in place on arrays; new tensors under
        # create_graph (where invstd, in training, carries its dependence on x: kept_as_tensors)
        invstd = ctx.invstd
        a = _abs_weight(ctx.weight, y.dtype, ctx.eps, xp)
        factor = _activation_slope(y, ctx.slope, xp)
        need_xhat = need_w or (need_x and ctx.batch)
        # version-checked: raises if the residual was modified in place
        xhat = _rebuild_xhat(ctx, y, factor, a, xp) if need_xhat else None
        dz = xp.multiply(factor, g, out=factor)  # d/dz (z: pre-activation); also the residual's gradient
        gb = _csum(dz, xp) if (need_b or (need_x and ctx.batch)) else None
        ga = _cdot(dz, xhat, xp) if need_xhat else None

        gx = None
        if need_x:
            scale = invstd if a is None else invstd * a
            if ctx.batch:
                # dx = a * invstd * (dz - mean(dz) - x_hat * mean(dz * x_hat)), per channel
                t = xp.multiply(xhat, (ga / ctx.m).reshape(cs), out=xhat)
                t = xp.add(t, (gb / ctx.m).reshape(cs), out=t)
                t = xp.subtract(dz, t, out=t)
                gx = xp.multiply(t, scale.reshape(cs), out=t)
            elif need_r:
                gx = memory.empty(y.shape, y.dtype, xp)  # dz is the residual's gradient
                gx = xp.multiply(dz, scale.reshape(cs), out=gx)
            else:
                gx = xp.multiply(dz, scale.reshape(cs), out=dz)
        gw = None
        if need_w:
            w = ctx.weight
            gw = mask_grad(ga, xp.sign(_channel(w, ga.dtype)), w)  # d|w|/dw = sign(w)
        if half is not None:
            gx = None if gx is None else narrow(gx, half)
            dz = narrow(dz, half) if need_r else dz
        return gx, gw, gb if need_b else None, dz if need_r else None

    def kept_as_tensors(ctx):
        """Under create_graph: the inverse std as the backward formula reads it. In eval
        mode a constant; in training a function of x, whose values are gone (y was
        written over them): a tensor whose node sends d(invstd)/dx = -invstd^2 x_hat / m
        (per channel) to x, with x_hat rebuilt from y as the backward does."""
        kept = ctx.__dict__.get("_graph_kept")
        if kept is not None:
            return kept
        saved = ctx.__dict__["_saved"]
        if "stats" in saved:  # the GPU's kernels kept (sum x) + 1j (sum x^2), or in eval mean + 1j invstd
            s = saved["stats"].unpack(ctx)
            if ctx.batch:
                mean = s.real / ctx.m
                s = 1.0 / get_array_module(s).sqrt(s.imag / ctx.m - mean * mean + ctx.eps)
            invstd = s.imag.astype(ctx.dtype) if not ctx.batch else s.astype(ctx.dtype)
        else:
            invstd = saved["invstd"].unpack(ctx)
        t = Tensor._from_array(invstd)
        edge = ctx.next[0]
        if ctx.batch and edge is not None:
            y = ctx.result
            xp = get_array_module(y)
            a = _abs_weight(ctx.weight, y.dtype, ctx.eps, xp)
            xhat = _rebuild_xhat(ctx, y, _activation_slope(y, ctx.slope, xp), a, xp)
            t._grad_fn = _InvStd(edge, t, xhat, ctx.m)
        kept = ctx._graph_kept = {"invstd": t}
        return kept

    def gpu_backward(ctx, g, y, cs, xp):
        """The fused path: one reduction (sum dz, sum dz * x_hat) and one elementwise kernel
        for the gradients of x, the residual (dz), weight and bias; without x's gradient, a
        tiny kernel over C values for weight's (and one for dz when the residual needs it)."""
        need_x, need_w, need_b, need_r = ctx.needs_input_grad
        t = y.dtype.type
        w, aeps = _gpu_abs_weight(ctx.weight, y.dtype, cs, ctx.eps)
        b = _gpu_param(ctx.bias, y.dtype, cs, t(0))
        need_xhat = need_w or (need_x and ctx.batch)
        r = ctx.residual if need_xhat else None  # version-checked, as on the CPU
        r = t(0) if r is None else r
        sums = None
        if need_b or need_xhat:
            sums = memory.empty((y.shape[1],), np.result_type(y.dtype, np.complex64), xp)
            _channel_sums(K.abn_grad_sums, (y, g, r, b, w, aeps, ctx.slope), sums, y.shape, xp)
        gx = dz = gw = None
        gb = sums.real if need_b else None  # a view, unless the kernel below writes its own
        if need_w:
            gw = memory.empty(sums.shape, y.dtype, xp)
        if need_x:  # x's gradient, and in the same kernel the residual's, weight's and bias's
            affine = need_w or need_b
            outs = [memory.empty(y.shape, y.dtype, xp)] + ([memory.empty(y.shape, y.dtype, xp)] if need_r else [])
            args = (sums.reshape(cs),) if ctx.batch or affine else ()
            if affine:
                gw = gw if gw is not None else memory.empty(sums.shape, y.dtype, xp)
                gb = memory.empty(sums.shape, y.dtype, xp)
                args += (y.shape[1], _count(y.shape) // y.shape[0], *outs, gw, gb)
            else:
                args += tuple(outs)
            inv_m = 1.0 / ctx.m if ctx.batch else 0.0
            s = ctx.stats.reshape(cs)
            K.abn_backward[ctx.batch, need_r, affine](y, g, r, b, w, aeps, ctx.slope, s, inv_m, ctx.eps, *args)
            gx, dz = outs[0], (outs[1] if need_r else None)
        else:
            if need_r:
                dz = K.abn_dz(y, g, ctx.slope, memory.empty(y.shape, y.dtype, xp))
            if need_w:
                K.abn_weight_grad(sums, _channel(ctx.weight, y.dtype), gw)
        return gx, gw if need_w else None, gb if need_b else None, dz


def _abs_weight(w, dtype, eps, xp):
    """InPlace-ABN's per-channel scale ``|weight| + eps`` (None without a weight)."""
    return None if w is None else xp.abs(_channel(w, dtype)) + eps


def _activation_slope(y, slope, xp):
    """``d y / d z`` of the leaky ReLU, from its output: 1 where y > 0, slope elsewhere."""
    factor = memory.empty(y.shape, y.dtype, xp)
    factor = xp.greater(y, 0, out=factor)
    factor = xp.multiply(factor, 1 - slope, out=factor)
    return xp.add(factor, slope, out=factor)


def _rebuild_xhat(ctx, y, factor, a, xp):
    """InPlace-ABN's x_hat from its output: invert the activation (z = y / factor), take
    the residual away, then invert the affine step: x_hat = (z - residual - bias) / a."""
    cs = _cshape(y.shape)
    xhat = memory.empty(y.shape, y.dtype, xp)
    xhat = xp.divide(y, factor, out=xhat)
    r, b = ctx.residual, ctx.bias
    if r is not None:
        xhat = xp.subtract(xhat, r, out=xhat)
    if b is not None:
        xhat = xp.subtract(xhat, _channel(b, y.dtype).reshape(cs), out=xhat)
    if a is not None:
        xhat = xp.divide(xhat, a.reshape(cs), out=xhat)
    return xhat


class _InvStd(Function):
    """The node of InPlace-ABN's batch inverse std under create_graph (see
    ``InPlaceABN.kept_as_tensors``): d(invstd_c)/dx = -invstd_c^2 x_hat / m."""

    def __init__(self, edge, invstd, xhat, m):
        self.next = (edge,)
        self.needs_input_grad = (True,)
        self.invstd, self.xhat, self.m = invstd, xhat, m

    def backward(ctx, gc):
        inv, xhat = (ctx.invstd, ctx.xhat) if gc.__class__ is Tensor else (ctx.invstd._data, ctx.xhat._data)
        cs = _cshape(xhat.shape)
        return (-(inv * inv * gc / ctx.m)).reshape(cs) * xhat


# --- public functions -----------------------------------------------------------------


def _check_args(name, input, tensors, momentum, eps):
    if not isinstance(input, Tensor):
        raise TypeError(f"{name} expects a Tensor input, got {type(input).__name__}")
    if input.ndim < 2:
        raise ValueError(f"{name} expects an input of shape (N, C) or (N, C, H, W), got shape {input.shape}")
    if not is_floating(input.dtype):
        raise TypeError(f"{name} expects a floating point input, got {input.dtype}")
    c = input.shape[1]
    for what, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: {what} must be a Tensor or None, got {type(t).__name__}")
        if t.shape != (c,):
            raise ValueError(
                f"{name}: {what} has shape {t.shape}, expected ({c},) for an input with {c} channels "
                f"(input shape {input.shape})"
            )
    if not isinstance(momentum, Real):
        raise TypeError(f"{name}: momentum must be a number, got {momentum!r}")
    if not (isinstance(eps, Real) and eps >= 0):
        raise ValueError(f"{name}: eps must be a number >= 0, got {eps!r}")


def _check_batch(name, input):
    if _count(input.shape) <= 1:
        raise ValueError(f"{name}: expected more than 1 value per channel when training, got input size {input.shape}")


class RunningStatUpdate(Function):
    """``r = (1 - momentum) * r + momentum * scale * batch``, written over ``r``'s buffer.

    Allocates nothing (three passes over the C values: scale, add, scale back; one kernel
    on a GPU, which derives the batch statistic from BatchNorm's sums itself when given
    ``moments``), so the update is inplace for the allocator as well as for the version
    counter. Not differentiable: running statistics are buffers, updated under ``no_grad``.
    """

    differentiable = False
    inplace_name = "running_stat_update_"

    def forward(ctx, r, batch, momentum=0.1, scale=1.0, moments=None):
        # moments: (inv_m, var) when batch is a GPU's complex per-channel sums, from which
        # the kernel derives the batch mean (var False) or biased variance (var True)
        xp = get_array_module(r)
        out = ctx.out if ctx.out is not None else memory.empty(r.shape, r.dtype, xp)
        w = momentum * scale
        if w == 0:
            xp.multiply(r, 1.0 - momentum, out=out)
            return out
        if moments is not None:  # one kernel, the statistic included
            K.running_stat_from_moments(r, batch, moments[0], int(moments[1]), 1.0 - momentum, w, out)
            return out
        if on_gpu(r):  # one kernel
            K.running_stat_update(r, batch, 1.0 - momentum, w, out)
            return out
        xp.multiply(r, (1.0 - momentum) / w, out=out)
        xp.add(out, batch, out=out, casting="same_kind")
        xp.multiply(out, w, out=out)
        return out


def _update_running(running_mean, running_var, stats, momentum):
    """Moves the running statistics toward the batch mean and UNBIASED variance, in place
    under no_grad: one inplace op per buffer, so its version bumps once per call (PyTorch).
    Not while a checkpoint recomputes the forward in backward: the forward updated them
    (PyTorch updates them again, moving them twice toward the same batch)."""
    m = stats["count"]
    if (running_mean is None and running_var is None) or grad_state.recomputing:
        return
    if "mean" in stats:
        mean, var, moments = stats["mean"], stats["var"], {}
    else:  # the GPU path keeps the sums: each update's kernel derives its statistic from them
        mean = var = stats["moments"]
        moments = {"mean": (1.0 / m, False), "var": (1.0 / m, True)}
    with no_grad():
        if running_mean is not None:
            RunningStatUpdate.apply_(running_mean, mean, momentum=momentum, moments=moments.get("mean"))
        if running_var is not None:
            RunningStatUpdate.apply_(running_var, var, momentum=momentum, scale=m / (m - 1), moments=moments.get("var"))


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    """Batch normalization over (N, C) or (N, C, H, W) inputs, as ``torch.nn.functional.batch_norm``.

    Args:
        input: (N, C, ...) floating point tensor.
        running_mean, running_var: (C,) tensors or None. In training they are updated in
            place (their versions bump) with ``momentum`` and the unbiased batch variance.
            If either is None, batch statistics are used in eval mode too.
        weight, bias: (C,) affine parameters or None.
        training: batch statistics (True) or the running ones (False).
        momentum: weight of the new batch in the running statistics.
        eps: added to the variance.

    Returns:
        A new tensor of the input's shape.
    """
    _check_args(
        "batch_norm",
        input,
        {"running_mean": running_mean, "running_var": running_var, "weight": weight, "bias": bias},
        momentum,
        eps,
    )
    use_batch = training or running_mean is None or running_var is None
    if not use_batch:
        return BatchNormEval.apply(input, weight, bias, mean=running_mean._data, var=running_var._data, eps=eps)
    _check_batch("batch_norm", input)
    stats = {}
    out = BatchNorm.apply(input, weight, bias, eps=eps, stats=stats)
    if training:
        _update_running(running_mean, running_var, stats, momentum)
    return out


def _check_residual(input, residual, inplace=True):
    if residual is None:
        return
    if not isinstance(residual, Tensor):
        raise TypeError(f"inplace_abn: residual must be a Tensor or None, got {type(residual).__name__}")
    if residual.shape != input.shape:
        raise ValueError(
            f"inplace_abn: residual has shape {tuple(residual.shape)}, expected the input's shape "
            f"{tuple(input.shape)} (it is added elementwise; no broadcasting)"
        )
    if residual.dtype != input.dtype:
        raise TypeError(f"inplace_abn: residual has dtype {residual.dtype}, expected the input's {input.dtype}")
    if residual.device != input.device:
        raise ValueError(f"inplace_abn: residual is on {residual.device}, the input on {input.device}")
    xp = get_array_module(input._data)
    if inplace and xp.may_share_memory(residual._data, input._data):
        raise ValueError(
            "inplace_abn: residual shares memory with input, which is overwritten (and backward needs "
            "the residual): pass residual.clone()"
        )


def inplace_abn(
    input,
    running_mean,
    running_var,
    weight,
    bias,
    training=False,
    momentum=0.1,
    eps=1e-5,
    negative_slope=0.01,
    residual=None,
    inplace=True,
):
    """BatchNorm + leaky ReLU (after an optional residual add) computed over the input's buffer.

    ``y = leaky_relu((x - mean) / sqrt(var + eps) * (|weight| + eps) + bias [+ residual],
    negative_slope)`` is written into ``input``, which is returned (its version bumps).
    With ``inplace=False`` the same function writes a new tensor instead: bitwise the same
    values and gradients (backward still rebuilds everything from ``y``), one more buffer
    while it runs. That is the out-of-place path of the policy site in ``models``.
    Backward keeps only ``y`` and rebuilds the normalized input from it, so the BN input
    is not kept alive. Statistics and running-stat updates are those of :func:`batch_norm`.

    With ``residual`` (a basic block's second unit, ``act(BN(conv2_out) + identity)``),
    backward inverts the activation, subtracts the residual, which it keeps BY REFERENCE
    (no copy: in a ResNet it is the block input, kept anyway by the block's first conv),
    then inverts the affine step. The residual is version-checked like every saved
    tensor: modifying it in place before backward makes backward raise. Its gradient is
    the gradient w.r.t. the pre-activation sum.

    Args:
        input: (N, C, ...) floating point tensor; not a leaf that requires grad (it is
            overwritten), so it is usually a conv or linear output.
        running_mean, running_var: (C,) tensors or None (then batch statistics always).
        weight, bias: (C,) tensors or None (weight None means scale 1, bias None means 0).
        negative_slope: leaky ReLU slope, > 0 (ReLU cannot be inverted).
        residual: None, or a tensor of exactly the input's shape, dtype and device (no
            broadcasting) that does not share memory with ``input``.
        inplace: write over ``input`` (True) or into a new tensor.

    Returns:
        ``input`` itself, now holding the activation (a new tensor when not ``inplace``).

    Raises:
        RuntimeError: ``input`` is a leaf that requires grad (or a view of one).
        ValueError: bad shapes (of the residual too), ``negative_slope <= 0``, one value
            per channel in training, a residual overlapping the input.
        TypeError: a residual that is not a tensor, or of another dtype.
    """
    _check_args(
        "inplace_abn",
        input,
        {"running_mean": running_mean, "running_var": running_var, "weight": weight, "bias": bias},
        momentum,
        eps,
    )
    if not eps > 0:
        raise ValueError(f"inplace_abn: eps must be > 0 (|weight| + eps must not vanish), got {eps!r}")
    if not (isinstance(negative_slope, Real) and negative_slope > 0):
        raise ValueError(
            f"inplace_abn: negative_slope must be > 0 so that backward can invert the activation, "
            f"got {negative_slope!r} (use batch_norm + relu for a plain ReLU)"
        )
    _check_residual(input, residual, inplace)
    apply = InPlaceABN.apply_ if inplace else InPlaceABN.apply
    use_batch = training or running_mean is None or running_var is None
    if not use_batch:
        return apply(
            input,
            weight,
            bias,
            residual,
            mean=running_mean._data,
            var=running_var._data,
            eps=eps,
            negative_slope=negative_slope,
        )
    _check_batch("inplace_abn", input)
    stats = {}
    out = apply(input, weight, bias, residual, eps=eps, negative_slope=negative_slope, stats=stats)
    if training:
        _update_running(running_mean, running_var, stats, momentum)
    return out
