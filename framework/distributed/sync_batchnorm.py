"""Synchronized batch normalization across data-parallel ranks (PyTorch's ``nn.SyncBatchNorm``).

Training forward: every rank computes, per channel, ``sum x`` and ``sum x^2`` (float64)
plus its value count ``m`` (N * H * W ...) into ONE contiguous float64 buffer
``[m, sum x (C), sum x^2 (C)]``, which is reduced in place (``comm.allreduce_``). The
global mean and (biased) variance follow from the global sums, so ranks may hold
DIFFERENT batch sizes: the count is reduced with the sums (as Horovod allgathers counts).
Running statistics move toward the global mean and the UNBIASED global variance, in
place under ``no_grad`` (one ``copy_`` per buffer, as :func:`framework.ops.norm.batch_norm`).

Backward: the two per-channel reductions BN's backward needs, ``sum g`` and
``sum g * x_hat``, go into one float64 buffer reduced in place; the input's gradient is
the fused BN formula with the GLOBAL count. Weight and bias get the LOCAL reductions
(as in PyTorch): their sum over ranks is the gradient of the global batch, and
:class:`~framework.distributed.data_parallel.DataParallel` reduces them as any gradient.
Saved for backward: ``x``, ``weight`` and the per-channel mean and inverse std.

Eval mode uses the running statistics and communicates nothing. One process (or a
:class:`~framework.distributed.comm.SingleProcessCommunicator`) gives plain BatchNorm.
Every rank must call forward (and backward) the same number of times, in the same order:
the reductions are blocking collectives.
"""

from __future__ import annotations

import numpy as np

from .. import memory
from ..autograd.function import Function
from ..autograd.grad_mode import no_grad
from ..backend import get_array_module
from ..nn.layers import BatchNorm1d, BatchNorm2d, _BatchNorm
from ..ops.norm import _channel, _check_args, _count, _cshape, _rows, _update_running
from .comm import get_world

__all__ = ["SyncBatchNorm", "SyncBatchNormFunction", "sync_batch_norm"]


class SyncBatchNormFunction(Function):
    """Training-mode BN with statistics over all ranks of ``comm``. Backward reduces too."""

    inplace_name = "sync_batch_norm_"
    saves = ("x", "weight")
    saved_when = {"weight": (0,)}  # weight enters only the input's gradient

    def forward(ctx, x, weight, bias, eps=1e-5, comm=None, stats=None):
        xp = get_array_module(x)
        c = x.shape[1]
        r = _rows(x, xp)
        buf = np.empty(2 * c + 1, dtype=np.float64)  # [count, sum x, sum x^2]: ONE reduction
        buf[0] = _count(x.shape)
        buf[1:c + 1] = xp.einsum("ncs->c", r, dtype=np.float64)
        buf[c + 1:] = xp.einsum("ncs,ncs->c", r, r, dtype=np.float64)
        comm.allreduce_(buf, "sum")
        m = int(round(buf[0]))
        if m <= 1:
            raise ValueError(
                f"sync_batch_norm: expected more than 1 value per channel over all ranks when training, "
                f"got {m} (local input size {x.shape})"
            )
        mean = buf[1:c + 1] / m
        var = np.maximum(buf[c + 1:] / m - mean * mean, 0.0)  # biased, global
        if stats is not None:
            stats["mean"], stats["var"], stats["count"] = mean, var, m
        mean_x = mean.astype(x.dtype)
        invstd = (1.0 / np.sqrt(var + eps)).astype(x.dtype)
        cs = _cshape(x.shape)
        out = ctx.out if ctx.out is not None else memory.empty(x.shape, x.dtype, xp, "activations")
        xp.subtract(x, mean_x.reshape(cs), out=out)
        scale = invstd if weight is None else invstd * _channel(weight, x.dtype)
        out *= scale.reshape(cs)
        if bias is not None:
            out += _channel(bias, x.dtype).reshape(cs)
        ctx.m, ctx.comm = m, comm
        ctx.keep(mean=mean_x, invstd=invstd)
        return out

    def backward(ctx, g):
        need_x, need_w, need_b = ctx.needs_input_grad
        xp = get_array_module(g)
        x = ctx.x
        cs = _cshape(x.shape)
        c = x.shape[1]
        mean, invstd = ctx.mean, ctx.invstd
        xhat = memory.empty(x.shape, x.dtype, xp)  # becomes the input's gradient
        xp.subtract(x, mean.reshape(cs), out=xhat)
        xhat *= invstd.reshape(cs)
        gb = xp.einsum("ncs->c", _rows(g, xp))  # local reductions: weight/bias gradients
        gw = xp.einsum("ncs,ncs->c", _rows(g, xp), _rows(xhat, xp))
        gx = None
        if need_x:
            buf = np.empty(2 * c, dtype=np.float64)
            buf[:c] = gb
            buf[c:] = gw
            ctx.comm.allreduce_(buf, "sum")
            m = ctx.m
            w = ctx.weight
            scale = invstd if w is None else invstd * _channel(w, x.dtype)
            # dx = w * invstd * (g - sum(g)/M - x_hat * sum(g * x_hat)/M), global sums and M
            xhat *= (buf[c:] / m).astype(x.dtype).reshape(cs)
            xhat += (buf[:c] / m).astype(x.dtype).reshape(cs)
            xp.subtract(g, xhat, out=xhat)
            xhat *= scale.reshape(cs)
            gx = xhat
        return gx, gw if need_w else None, gb if need_b else None


def sync_batch_norm(input, running_mean, running_var, weight=None, bias=None, momentum=0.1, eps=1e-5, comm=None):
    """Training-mode batch norm with statistics over all ranks of ``comm`` (default: the world).

    Updates ``running_mean``/``running_var`` (if given) in place with ``momentum`` and the
    unbiased global variance. Returns a new tensor of the input's shape.
    """
    _check_args("sync_batch_norm", input, {"running_mean": running_mean, "running_var": running_var,
                                           "weight": weight, "bias": bias}, momentum, eps)
    comm = get_world() if comm is None else comm
    stats = {}
    out = SyncBatchNormFunction.apply(input, weight, bias, eps=eps, comm=comm, stats=stats)
    _update_running(running_mean, running_var, stats, momentum)
    return out


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over ``(N, C, ...)`` inputs whose training statistics span every rank.

    Same parameters, buffers and ``state_dict`` keys as :class:`~framework.nn.BatchNorm2d`.
    ``comm``: the communicator to reduce over (default: :func:`get_world` at the first
    training forward). Eval mode (and ``track_running_stats=False`` in eval) is plain,
    local BatchNorm.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, comm=None, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.comm = comm

    def _check_input_dim(self, input) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"{type(self).__name__}({self.num_features}) got an input with {input.shape[1]} channels "
                f"(shape {tuple(input.shape)})"
            )
        if not self.training:
            return super().forward(input)  # running (or local batch) statistics: no communication
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            with no_grad():
                self.num_batches_tracked.add_(1)
            factor = 1.0 / int(self.num_batches_tracked.item()) if self.momentum is None else self.momentum
        if self.comm is None:
            self.comm = get_world()
        keep = self.track_running_stats
        return sync_batch_norm(input, self.running_mean if keep else None, self.running_var if keep else None,
                               self.weight, self.bias, momentum=factor, eps=self.eps, comm=self.comm)

    @classmethod
    def convert_sync_batchnorm(cls, module, comm=None):
        """Returns ``module`` with every BatchNorm1d/2d replaced by a SyncBatchNorm.

        The new layers share the old ones' parameters and buffers (same tensors, as in
        PyTorch), so optimizers and state dicts stay valid. A BatchNorm given as ``module``
        itself is returned converted.
        """
        out = module
        if isinstance(module, (BatchNorm1d, BatchNorm2d)):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, comm=comm)
            if module.affine:
                out.weight = module.weight
                out.bias = module.bias
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                setattr(out, name, getattr(module, name))
            out.train(module.training)
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, comm))
        return out
