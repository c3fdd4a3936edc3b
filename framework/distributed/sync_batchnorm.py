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
Under ``create_graph`` the same backward runs on tensors, its sums (and the statistics,
recomputed from ``x``) through a differentiable all-reduce
(:class:`framework.ops.norm.AllReduceSum`): higher-order gradients across the ranks.

The arithmetic is :class:`framework.ops.norm.BatchNorm`'s, called with ``comm``: only
where the sums come from differs. Eval mode uses the running statistics and
communicates nothing. One process (or a
:class:`~framework.distributed.comm.SingleProcessCommunicator`) gives plain BatchNorm.
Every rank must call forward (and backward) the same number of times, in the same order:
the reductions are blocking collectives.
"""

from __future__ import annotations

from ..nn.layers import BatchNorm1d, BatchNorm2d, _BatchNorm
from ..ops.norm import BatchNorm, _check_args, _update_running
from .comm import get_world

__all__ = ["SyncBatchNorm", "sync_batch_norm"]


def sync_batch_norm(input, running_mean, running_var, weight=None, bias=None, momentum=0.1, eps=1e-5, comm=None):
    """Training-mode batch norm with statistics over all ranks of ``comm`` (default: the world).

    Updates ``running_mean``/``running_var`` (if given) in place with ``momentum`` and the
    unbiased global variance. Returns a new tensor of the input's shape.
    """
    _check_args(
        "sync_batch_norm",
        input,
        {"running_mean": running_mean, "running_var": running_var, "weight": weight, "bias": bias},
        momentum,
        eps,
    )
    comm = get_world() if comm is None else comm
    stats = {}
    out = BatchNorm.apply(input, weight, bias, eps=eps, stats=stats, comm=comm)
    _update_running(running_mean, running_var, stats, momentum)
    return out


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over ``(N, C, ...)`` inputs whose training statistics span every rank.

    Same parameters, buffers and ``state_dict`` keys as :class:`~framework.nn.BatchNorm2d`.
    ``comm``: the communicator to reduce over (default: :func:`get_world` at the first
    training forward). Eval mode (and ``track_running_stats=False`` in eval) is plain,
    local BatchNorm.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        comm=None,
        device=None,
        dtype=None,
    ):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.comm = comm

    def _check_input_dim(self, input) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _batch_norm(self, input, running_mean, running_var, training, momentum):
        if not self.training:
            # eval: running (or this batch's) statistics, no communication
            return super()._batch_norm(input, running_mean, running_var, training, momentum)
        if self.comm is None:
            self.comm = get_world()
        return sync_batch_norm(
            input, running_mean, running_var, self.weight, self.bias, momentum=momentum, eps=self.eps, comm=self.comm
        )

    @classmethod
    def convert_sync_batchnorm(cls, module, comm=None):
        """Returns ``module`` with every BatchNorm1d/2d replaced by a SyncBatchNorm.

        The new layers share the old ones' parameters and buffers (same tensors, as in
        PyTorch), so optimizers and state dicts stay valid. A BatchNorm given as ``module``
        itself is returned converted.
        """
        out = module
        if isinstance(module, (BatchNorm1d, BatchNorm2d)):
            out = cls(
                module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats, comm=comm
            )
            if module.affine:
                out.weight = module.weight
                out.bias = module.bias
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                setattr(out, name, getattr(module, name))
            out.train(module.training)
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, comm))
        return out
