"""Process-group communication for data-parallel training, over MPI (mpi4py).

All collectives work on contiguous host NumPy arrays, in place where the name ends in
``_`` (``MPI.IN_PLACE``), so a flat gradient buffer whose views are the parameters'
``.grad`` is reduced without a copy. The buffer is returned for chaining.

mpi4py is imported lazily: importing this module never fails, and :func:`get_world`
returns a :class:`SingleProcessCommunicator` (identities and no-ops) when mpi4py is not
installed, so the trainer runs unchanged on one process without MPI. With mpi4py, a
plain ``python train.py`` runs as an MPI singleton (size 1); ``mpiexec -n N`` (or
``srun``) gives N ranks.

Backends: every communicator has a ``backend`` attribute, ``"mpi"`` here (``"none"``
for the single-process fallback). The MPI wheels are not CUDA-aware, so GPU buffers must
be staged through host memory. A NCCL backend (CuPy's ``cupy.cuda.nccl``, its unique id
broadcast over this MPI communicator) is planned as a separate class with the same method
names and ``backend = "nccl"``; callers should dispatch on ``backend``, not on the class.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import traceback
from typing import Any

import numpy as np

__all__ = [
    "Communicator",
    "SingleProcessCommunicator",
    "Handle",
    "get_world",
    "install_abort_on_exception",
]

_REDUCE_OPS = ("sum", "max", "min")
_SCALAR_OPS = ("sum", "max", "min", "mean")
# Dtypes the reductions are tested with (MPI_FLOAT, MPI_DOUBLE, MPI_INT32_T/MPI_LONG).
_REDUCE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int64))


def _import_mpi():
    """Return the ``mpi4py.MPI`` module; raises ImportError when mpi4py is missing."""
    from mpi4py import MPI  # noqa: PLC0415  (lazy on purpose: MPI_Init happens here)

    return MPI


def _check_buffer(buf: Any, name: str = "buf", *, writable: bool = True) -> np.ndarray:
    if not isinstance(buf, np.ndarray):
        raise TypeError(
            f"{name} must be a NumPy array, got {type(buf).__name__}; "
            "GPU (CuPy) buffers must be copied to host memory first (the MPI wheels are "
            "not CUDA-aware)"
        )
    if not buf.flags.c_contiguous:
        raise ValueError(
            f"{name} must be C-contiguous for MPI (shape {buf.shape}, strides {buf.strides}); "
            "reduce a contiguous flat buffer, or pass np.ascontiguousarray(x) and copy back"
        )
    if writable and not buf.flags.writeable:
        raise ValueError(f"{name} is read-only; MPI writes the result into it")
    return buf


def _check_reduce_dtype(buf: np.ndarray, name: str = "buf") -> None:
    if buf.dtype not in _REDUCE_DTYPES:
        allowed = ", ".join(str(d) for d in _REDUCE_DTYPES)
        raise TypeError(f"cannot reduce {name} of dtype {buf.dtype}; supported: {allowed}")


def _check_op(op: str, allowed: tuple[str, ...] = _REDUCE_OPS) -> str:
    if op not in allowed:
        raise ValueError(f"unknown reduction op {op!r}; expected one of {', '.join(allowed)}")
    return op


def _check_copy_pair(sendbuf: Any, recvbuf: Any) -> None:
    _check_buffer(sendbuf, "sendbuf", writable=False)
    _check_buffer(recvbuf, "recvbuf")
    _check_reduce_dtype(sendbuf, "sendbuf")
    if sendbuf.shape != recvbuf.shape or sendbuf.dtype != recvbuf.dtype:
        raise ValueError(
            f"sendbuf {sendbuf.shape} {sendbuf.dtype} and recvbuf {recvbuf.shape} "
            f"{recvbuf.dtype} must have the same shape and dtype"
        )
    if sendbuf.size and np.may_share_memory(sendbuf, recvbuf):
        raise ValueError("sendbuf and recvbuf overlap; use allreduce_(buf) for in-place reduction")


class Handle:
    """A pending non-blocking collective; :meth:`wait` returns the result buffer.

    The handle keeps the buffers alive until the operation completes. Waiting twice is
    harmless (the second wait returns at once).
    """

    __slots__ = ("_request", "_buf", "_keep")

    def __init__(self, request: Any, buf: np.ndarray, keep: Any = None) -> None:
        self._request = request  # None means already complete
        self._buf = buf
        self._keep = keep  # e.g. the send buffer of an out-of-place reduction

    def wait(self) -> np.ndarray:
        """Block until the collective is complete and return its result buffer."""
        if self._request is not None:
            self._request.Wait()
            self._request = None
            self._keep = None
        return self._buf

    def test(self) -> bool:
        """Return True when the collective is complete (and progress it if not)."""
        if self._request is None:
            return True
        if self._request.Test():
            self._request = None
            self._keep = None
            return True
        return False


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
        MPI = _import_mpi()
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

    def allreduce_(self, buf: np.ndarray, op: str = "sum") -> np.ndarray:
        """Reduce ``buf`` across ranks in place (``MPI.IN_PLACE``) and return it."""
        _check_buffer(buf)
        _check_reduce_dtype(buf)
        self._comm.Allreduce(self._MPI.IN_PLACE, buf, op=self._ops[_check_op(op)])
        return buf

    def iallreduce_(self, buf: np.ndarray, op: str = "sum") -> Handle:
        """Start an in-place reduction of ``buf``; ``handle.wait()`` returns ``buf``.

        Do not read or write ``buf`` until the handle is waited on. Several handles may be
        outstanding, but every rank must start them in the same order.
        """
        _check_buffer(buf)
        _check_reduce_dtype(buf)
        req = self._comm.Iallreduce(self._MPI.IN_PLACE, buf, op=self._ops[_check_op(op)])
        return Handle(req, buf)

    def allreduce_copy(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str = "sum") -> np.ndarray:
        """Reduce ``sendbuf`` across ranks into a separate ``recvbuf``; return ``recvbuf``."""
        _check_copy_pair(sendbuf, recvbuf)
        self._comm.Allreduce(sendbuf, recvbuf, op=self._ops[_check_op(op)])
        return recvbuf

    def iallreduce_copy(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str = "sum") -> Handle:
        """Non-blocking :meth:`allreduce_copy`; ``handle.wait()`` returns ``recvbuf``."""
        _check_copy_pair(sendbuf, recvbuf)
        req = self._comm.Iallreduce(sendbuf, recvbuf, op=self._ops[_check_op(op)])
        return Handle(req, recvbuf, keep=sendbuf)

    def broadcast_(self, buf: np.ndarray, root: int = 0) -> np.ndarray:
        """Overwrite ``buf`` on every rank with ``root``'s ``buf``; return it."""
        _check_buffer(buf)
        self._check_root(root)
        self._comm.Bcast(buf, root=root)
        return buf

    # -- Python-object collectives (small, for metrics and config) -------------------------

    def allgather_object(self, obj: Any) -> list:
        """Return the list of every rank's (picklable) ``obj``, indexed by rank."""
        return self._comm.allgather(obj)

    def allreduce_scalar(self, value: float, op: str = "sum") -> float:
        """Reduce a number across ranks (``sum``, ``max``, ``min`` or ``mean``) in float64."""
        _check_op(op, _SCALAR_OPS)
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
        _flush_std_streams()
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
        _check_buffer(buf)
        _check_reduce_dtype(buf)
        _check_op(op)
        return buf

    def iallreduce_(self, buf: np.ndarray, op: str = "sum") -> Handle:
        return Handle(None, self.allreduce_(buf, op))

    def allreduce_copy(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str = "sum") -> np.ndarray:
        _check_copy_pair(sendbuf, recvbuf)
        _check_op(op)
        np.copyto(recvbuf, sendbuf)
        return recvbuf

    def iallreduce_copy(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str = "sum") -> Handle:
        return Handle(None, self.allreduce_copy(sendbuf, recvbuf, op))

    def broadcast_(self, buf: np.ndarray, root: int = 0) -> np.ndarray:
        _check_buffer(buf)
        self._check_root(root)
        return buf

    def allgather_object(self, obj: Any) -> list:
        return [obj]

    def allreduce_scalar(self, value: float, op: str = "sum") -> float:
        _check_op(op, _SCALAR_OPS)
        return float(value)

    def barrier(self) -> None:
        pass

    def abort(self, code: int = 1) -> None:
        _flush_std_streams()
        os._exit(code)


@functools.lru_cache(maxsize=None)
def get_world() -> Communicator:
    """The communicator of all ranks (cached; ``get_world.cache_clear()`` resets it).

    Returns a :class:`SingleProcessCommunicator` when mpi4py is not installed.
    """
    try:
        _import_mpi()
    except ImportError:
        return SingleProcessCommunicator()
    return Communicator()


# -- abort on an uncaught exception ----------------------------------------------------------


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not stop the abort
            pass


def _report(rank: int, exc_type, exc_value, exc_tb, thread_name: str | None = None) -> None:
    text = "".join(traceback.format_exception(exc_type, exc_value, exc_tb))
    where = f" in thread {thread_name!r}" if thread_name else ""
    lines = [f"[rank {rank}] uncaught exception{where}, aborting the job"]
    lines += [f"[rank {rank}] {line}" for line in text.rstrip("\n").splitlines()]
    try:
        sys.stderr.write("\n".join(lines) + "\n")
    except Exception:  # noqa: BLE001
        pass
    _flush_std_streams()


def install_abort_on_exception(comm: Communicator | None = None) -> None:
    """Make an uncaught exception on any rank end the whole job instead of hanging it.

    With more than one rank, installs ``sys.excepthook`` and ``threading.excepthook``
    handlers that print the traceback, each line prefixed ``[rank R]``, to stderr, flush,
    and call ``MPI.COMM_WORLD.Abort(1)``; otherwise the other ranks would wait forever in
    their next collective. With one rank nothing is installed: the default behaviour
    (print the traceback, exit non-zero) is already right. Calling it again is a no-op.

    Args:
        comm: the communicator to report the rank of; defaults to :func:`get_world`.
    """
    comm = get_world() if comm is None else comm
    if comm.size <= 1:
        return

    if not getattr(sys.excepthook, "_inplace_lab_abort", False):
        def excepthook(exc_type, exc_value, exc_tb):
            _report(comm.rank, exc_type, exc_value, exc_tb)
            comm.abort(1)

        excepthook._inplace_lab_abort = True  # type: ignore[attr-defined]
        sys.excepthook = excepthook

    if not getattr(threading.excepthook, "_inplace_lab_abort", False):
        def thread_excepthook(args):
            if args.exc_type is SystemExit:  # like the default hook: a thread may exit
                return
            name = args.thread.name if args.thread is not None else None
            _report(comm.rank, args.exc_type, args.exc_value, args.exc_traceback, name)
            comm.abort(1)

        thread_excepthook._inplace_lab_abort = True  # type: ignore[attr-defined]
        threading.excepthook = thread_excepthook


def find_mpiexec() -> str | None:
    """The mpiexec to launch jobs with: the one beside this interpreter (where the mpich
    wheel installs it), else the first on PATH; None when there is none."""
    import shutil  # noqa: PLC0415

    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpiexec")
