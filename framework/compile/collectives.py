"""Collectives as ops, so that a compiled step records and replays them.

``DataParallel`` averages gradients from backward hooks (Python run on each gradient),
which a captured step refuses. A compiled data-parallel step instead averages them with
:func:`allreduce_mean_` between its backward and its optimizer step: one inplace op per
gradient, recorded like any other (the re-inplace pass and the plan see it write the
gradient's buffer) and replayed as the same MPI call. With two processes the sum is
bitwise the one ``DataParallel`` computes (a sum of two numbers does not depend on the
order); with more, the order of the reduction may differ from a bucketed allreduce.
"""

from __future__ import annotations

from ..autograd.function import Function
from ..autograd.grad_mode import no_grad
from ..backend import get_array_module


class AllReduceMean(Function):
    """``g = (sum of g over the ranks of comm) / comm.size``, written over ``g``."""

    differentiable = False
    inplace_name = "allreduce_mean_"

    def forward(ctx, g, comm=None):
        out = ctx.out if ctx.out is not None else g.copy()
        comm.allreduce_(out, "sum")
        get_array_module(out).divide(out, comm.size, out=out)
        return out


def allreduce_mean_(tensors, comm) -> None:
    """Averages each tensor (e.g. every ``p.grad``) over the ranks of ``comm``, in place.

    Args:
        tensors: C-contiguous tensors (gradients), the same shapes on every rank, in the
            same order.
        comm: a communicator (``framework.distributed.comm``) with ``allreduce_`` and ``size``.
    """
    with no_grad():
        for t in tensors:
            AllReduceMean.apply_(t, comm=comm)
