"""The MPI communicator (mpi4py), and the one of a lone process without MPI.

Array collectives work on contiguous arrays, in place where the name ends in ``_``
(``MPI.IN_PLACE``), so a flat gradient buffer whose views are the parameters' ``.grad``
is reduced without a copy; the buffer is returned for chaining. GPU (CuPy) arrays are
staged through host memory (:mod:`.staging`).

mpi4py is imported lazily: importing this module never fails, and :func:`get_world`
returns a :class:`SingleProcessCommunicator` (identities and no-ops) when mpi4py is not
installed, so the trainer runs unchanged on one process without MPI. With mpi4py, a
plain ``python train.py`` runs as an MPI singleton (size 1); ``mpiexec -n N`` (or
``srun``) gives N ranks.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

from .. import backend as _backend
from .abort import flush_std_streams
from .collective import (
    SCALAR_OPS,
    Handle,
    check_buffer,
    check_copy_pair,
    check_op,
    check_parts,
    check_reduce_dtype,
    check_scatter,
)
from .staging import receiving, staged, staged_handle, unstage


def import_mpi():
    """Return the ``mpi4py.MPI`` module; raises ImportError when mpi4py is missing."""
    from mpi4py import MPI  # noqa: PLC0415  (lazy on purpose: MPI_Init happens here)

    return MPI


class Communicator:
    """A group of processes (MPI ranks) and the collectives the trainer needs.

    Args:
        comm: an mpi4py communicator; defaults to ``MPI.COMM_WORLD``.

    Attributes:
        rank, size: this process's rank and the number of ranks.
        local_rank, local_size: the same within this node (shared-memory split), e.g. to
            pick a GPU.
        is_main: True on rank 0, the rank that logs and checkpoints.
        backend: ``"mpi"``.
    """

    backend = "mpi"

    def __init__(self, comm: Any = None) -> None:
        MPI = import_mpi()
        self._MPI = MPI
        self._comm = MPI.COMM_WORLD if comm is None else comm
        self.rank: int = self._comm.Get_rank()
        self.size: int = self._comm.Get_size()
        local = self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        try:
            self.local_rank: int = local.Get_rank()
            self.local_size: int = local.Get_size()
        finally:
            local.Free()
        self._ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def mpi_comm(self) -> Any:
        """The wrapped mpi4py communicator (e.g. to bootstrap NCCL)."""
        return self._comm

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(backend={self.backend!r}, rank={self.rank}, "
            f"size={self.size}, local_rank={self.local_rank}, local_size={self.local_size})"
        )

    # -- array collectives ---------------------------------------------------------------

    def allreduce_(self, buf: Any, op: str = "sum") -> Any:
        """Reduce ``buf`` across ranks in place (``MPI.IN_PLACE``) and return it.

        A GPU array is staged through a host copy (the MPI wheels are not CUDA-aware).
        """
        check_buffer(buf)
        check_reduce_dtype(buf)
        host = staged(buf)
        self._comm.Allreduce(self._MPI.IN_PLACE, host, op=self._ops[check_op(op)])
        unstage(buf, host)
        return buf

    def iallreduce_(self, buf: Any, op: str = "sum") -> Handle:
        """Start an in-place reduction of ``buf``; ``handle.wait()`` returns ``buf``.

        Do not read or write ``buf`` until the handle is waited on. Several handles may be
        outstanding, but every rank must start them in the same order.
        """
        check_buffer(buf)
        check_reduce_dtype(buf)
        host = staged(buf)
        req = self._comm.Iallreduce(self._MPI.IN_PLACE, host, op=self._ops[check_op(op)])
        return staged_handle(req, buf, host)

    def allreduce_copy(self, sendbuf: Any, recvbuf: Any, op: str = "sum") -> Any:
        """Reduce ``sendbuf`` across ranks into a separate ``recvbuf``; return ``recvbuf``."""
        check_copy_pair(sendbuf, recvbuf)
        recv = receiving(recvbuf)
        self._comm.Allreduce(staged(sendbuf), recv, op=self._ops[check_op(op)])
        unstage(recvbuf, recv)
        return recvbuf

    def iallreduce_copy(self, sendbuf: Any, recvbuf: Any, op: str = "sum") -> Handle:
        """Non-blocking :meth:`allreduce_copy`; ``handle.wait()`` returns ``recvbuf``."""
        check_copy_pair(sendbuf, recvbuf)
        send, recv = staged(sendbuf), receiving(recvbuf)
        req = self._comm.Iallreduce(send, recv, op=self._ops[check_op(op)])
        return staged_handle(req, recvbuf, recv, keep=send)

    def broadcast_(self, buf: Any, root: int = 0) -> Any:
        """Overwrite ``buf`` on every rank with ``root``'s ``buf``; return it."""
        check_buffer(buf)
        self._check_root(root)
        host = staged(buf)
        self._comm.Bcast(host, root=root)
        unstage(buf, host)
        return buf

    def ireduce_scatter(self, sendbuf: Any, recvbuf: Any, counts, op: str = "sum") -> Handle:
        """Start reducing ``sendbuf`` across ranks, rank r receiving block r of the result.

        The blocks are consecutive: rank r's is the ``counts[r]`` elements after the
        first ``sum(counts[:r])``, and ``recvbuf`` holds this rank's count (it may be 0).
        Equal counts run ``MPI_Ireduce_scatter_block``, others ``MPI_Ireduce_scatter``.
        Out of place on purpose: with ``MPI.IN_PLACE`` MPI leaves a rank's block at the
        START of the buffer, so a block wanted elsewhere would cost a copy; here it is
        written where the caller wants it. ``handle.wait()`` returns ``recvbuf``; the
        handle holds ``sendbuf`` until the reduction is complete, then lets it go.
        """
        counts = check_scatter(sendbuf, recvbuf, counts, self.rank, self.size)
        send, recv = staged(sendbuf), receiving(recvbuf)
        mpi_op = self._ops[check_op(op)]
        if len(set(counts)) == 1:
            req = self._comm.Ireduce_scatter_block(send, recv, op=mpi_op)
        else:
            req = self._comm.Ireduce_scatter(send, recv, recvcounts=counts, op=mpi_op)
        return staged_handle(req, recvbuf, recv, keep=send)

    def allgather_(self, buf: Any) -> Any:
        """Every rank's part of ``buf`` to every rank, in place (``MPI.IN_PLACE``); return it.

        ``buf`` is 1-D and holds ``size`` equal parts: rank r's values in part r are sent,
        the other parts are overwritten with the other ranks' ones.
        """
        check_buffer(buf)
        check_parts(buf, self.size)
        host = staged(buf)
        self._comm.Allgather(self._MPI.IN_PLACE, host)
        unstage(buf, host)
        return buf

    def allgather_copy(self, sendbuf: Any, recvbuf: Any) -> Any:
        """Every rank's ``sendbuf``, in rank order, into ``recvbuf`` (``size`` times as long)."""
        check_buffer(sendbuf, "sendbuf", writable=False)
        check_buffer(recvbuf, "recvbuf")
        if check_parts(recvbuf, self.size, "recvbuf") != sendbuf.size or sendbuf.dtype != recvbuf.dtype:
            raise ValueError(
                f"recvbuf ({recvbuf.size} of {recvbuf.dtype}) must hold {self.size} times sendbuf "
                f"({sendbuf.size} of {sendbuf.dtype})"
            )
        recv = receiving(recvbuf)
        self._comm.Allgather(staged(sendbuf), recv)
        unstage(recvbuf, recv)
        return recvbuf

    # -- Python-object collectives (small, for metrics and config) -------------------------

    def allgather_object(self, obj: Any) -> list:
        """Return the list of every rank's (picklable) ``obj``, indexed by rank."""
        return self._comm.allgather(obj)

    def gather_object(self, obj: Any, root: int = 0) -> list | None:
        """Every rank's (picklable) ``obj``, indexed by rank, on ``root``; None elsewhere."""
        self._check_root(root)
        return self._comm.gather(obj, root=root)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Return ``root``'s (picklable) ``obj`` on every rank."""
        self._check_root(root)
        return self._comm.bcast(obj, root=root)

    def allreduce_scalar(self, value: float, op: str = "sum") -> float:
        """Reduce a number across ranks (``sum``, ``max``, ``min`` or ``mean``) in float64."""
        check_op(op, SCALAR_OPS)
        buf = np.array([float(value)], dtype=np.float64)
        mpi_op = self._ops["sum" if op == "mean" else op]
        self._comm.Allreduce(self._MPI.IN_PLACE, buf, op=mpi_op)
        result = float(buf[0])
        return result / self.size if op == "mean" else result

    # -- control ---------------------------------------------------------------------------

    def barrier(self) -> None:
        """Block until every rank has reached this call."""
        self._comm.Barrier()

    def abort(self, code: int = 1) -> None:
        """End every rank of the job now (``MPI.COMM_WORLD.Abort``); does not return."""
        flush_std_streams()
        self._MPI.COMM_WORLD.Abort(code)

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self.size:
            raise ValueError(f"root {root} out of range for a communicator of size {self.size}")


class SingleProcessCommunicator(Communicator):
    """The communicator of a lone process without MPI: collectives are identities."""

    backend = "none"

    def __init__(self) -> None:  # noqa: D107 - no MPI on purpose
        self._MPI = None
        self._comm = None
        self.rank = 0
        self.size = 1
        self.local_rank = 0
        self.local_size = 1

    def allreduce_(self, buf: np.ndarray, op: str = "sum") -> np.ndarray:
        check_buffer(buf)
        check_reduce_dtype(buf)
        check_op(op)
        return buf

    def iallreduce_(self, buf: np.ndarray, op: str = "sum") -> Handle:
        return Handle(None, self.allreduce_(buf, op))

    def allreduce_copy(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str = "sum") -> np.ndarray:
        check_copy_pair(sendbuf, recvbuf)
        check_op(op)
        _backend.get_array_module(recvbuf).copyto(recvbuf, sendbuf)
        return recvbuf

    def iallreduce_copy(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str = "sum") -> Handle:
        return Handle(None, self.allreduce_copy(sendbuf, recvbuf, op))

    def broadcast_(self, buf: np.ndarray, root: int = 0) -> np.ndarray:
        check_buffer(buf)
        self._check_root(root)
        return buf

    def ireduce_scatter(self, sendbuf: np.ndarray, recvbuf: np.ndarray, counts, op: str = "sum") -> Handle:
        check_scatter(sendbuf, recvbuf, counts, 0, 1)
        check_op(op)
        _backend.get_array_module(recvbuf).copyto(recvbuf, sendbuf)
        return Handle(None, recvbuf)

    def allgather_(self, buf: np.ndarray) -> np.ndarray:
        check_buffer(buf)
        check_parts(buf, 1)
        return buf

    def allgather_copy(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> np.ndarray:
        check_buffer(sendbuf, "sendbuf", writable=False)
        check_buffer(recvbuf, "recvbuf")
        _backend.get_array_module(recvbuf).copyto(recvbuf, sendbuf)
        return recvbuf

    def allgather_object(self, obj: Any) -> list:
        return [obj]

    def gather_object(self, obj: Any, root: int = 0) -> list:
        self._check_root(root)
        return [obj]

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        self._check_root(root)
        return obj

    def allreduce_scalar(self, value: float, op: str = "sum") -> float:
        check_op(op, SCALAR_OPS)
        return float(value)

    def barrier(self) -> None:
        pass

    def abort(self, code: int = 1) -> None:
        flush_std_streams()
        os._exit(code)


@functools.cache
def get_world() -> Communicator:
    """The communicator of all ranks (cached; ``get_world.cache_clear()`` resets it).

    Returns a :class:`SingleProcessCommunicator` when mpi4py is not installed.
    """
    try:
        import_mpi()
    except ImportError:
        return SingleProcessCommunicator()
    return Communicator()
