"""Process-group communication for data-parallel training: MPI (mpi4py), NCCL on GPUs.

Array collectives work on contiguous arrays, in place where the name ends in ``_``
(``MPI.IN_PLACE``; NCCL with the same send and receive pointer), so a flat gradient
buffer whose views are the parameters' ``.grad`` is reduced without a copy. The buffer is
returned for chaining.

mpi4py is imported lazily: importing this module never fails, and :func:`get_world`
returns a :class:`SingleProcessCommunicator` (identities and no-ops) when mpi4py is not
installed, so the trainer runs unchanged on one process without MPI. With mpi4py, a
plain ``python train.py`` runs as an MPI singleton (size 1); ``mpiexec -n N`` (or
``srun``) gives N ranks.

Backends: every communicator has a ``backend`` attribute and the same methods.

- ``"mpi"`` (:class:`Communicator`): host NumPy arrays go straight to MPI. The MPI wheels
  are not CUDA-aware, so a CuPy array is STAGED: copied to host memory, reduced there
  and copied back (two copies of the buffer per collective: the fallback, not the fast
  path).
- ``"nccl"`` (:class:`NcclCommunicator`): CuPy arrays are reduced by NCCL on the GPU
  (``cupy.cuda.nccl``), bootstrapped by broadcasting rank 0's unique id over MPI;
  blocking collectives run on the current CUDA stream, non-blocking ones on a side
  stream so they overlap the computation. Host arrays and Python objects still use MPI.
- ``"none"`` (:class:`SingleProcessCommunicator`): one process without MPI; identities.

:func:`for_device` picks the communicator a training run on a device should use.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import traceback
from typing import Any

import numpy as np

from .. import backend as _backend

__all__ = [
    "Communicator",
    "NcclCommunicator",
    "SingleProcessCommunicator",
    "Handle",
    "BACKENDS",
    "for_device",
    "get_world",
    "install_abort_on_exception",
]

#: Values of ``distributed.backend`` (see :func:`for_device`).
BACKENDS = ("auto", "nccl", "mpi")

_REDUCE_OPS = ("sum", "max", "min")
_SCALAR_OPS = ("sum", "max", "min", "mean")
# Dtypes the reductions are tested with (MPI_FLOAT, MPI_DOUBLE, MPI_INT32_T/MPI_LONG).
_REDUCE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int64))


def _import_mpi():
    """Return the ``mpi4py.MPI`` module; raises ImportError when mpi4py is missing."""
    from mpi4py import MPI  # noqa: PLC0415  (lazy on purpose: MPI_Init happens here)

    return MPI


def _is_host(buf: Any) -> bool:
    return isinstance(buf, np.ndarray)


def _check_buffer(buf: Any, name: str = "buf", *, writable: bool = True) -> Any:
    if not _is_host(buf) and _backend.device_of(buf).type != "cuda":
        raise TypeError(f"{name} must be a NumPy or CuPy array, got {type(buf).__name__}")
    if not buf.flags.c_contiguous:
        raise ValueError(
            f"{name} must be C-contiguous for a collective (shape {buf.shape}, strides "
            f"{buf.strides}); reduce a contiguous flat buffer, or pass "
            "xp.ascontiguousarray(x) and copy back"
        )
    if writable and _is_host(buf) and not buf.flags.writeable:
        raise ValueError(f"{name} is read-only; the collective writes the result into it")
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
    if _backend.device_of(sendbuf) != _backend.device_of(recvbuf):
        raise ValueError(
            f"sendbuf is on {_backend.device_of(sendbuf)} and recvbuf on "
            f"{_backend.device_of(recvbuf)}; both must be on the same device"
        )
    xp = _backend.get_array_module(sendbuf)
    if sendbuf.size and xp.may_share_memory(sendbuf, recvbuf):
        raise ValueError("sendbuf and recvbuf overlap; use allreduce_(buf) for in-place reduction")


def _staged(buf: Any) -> Any:
    """The host array MPI works on: ``buf`` itself, or a host copy of a GPU array."""
    return buf if _is_host(buf) else buf.get()


def _receiving(buf: Any) -> np.ndarray:
    """The host array MPI writes a result into: ``buf``, or host memory for a GPU array."""
    return buf if _is_host(buf) else np.empty(buf.shape, buf.dtype)


def _unstage(buf: Any, host: np.ndarray) -> None:
    """Copies a staged result back into the GPU array it came from."""
    if host is not buf:
        buf.set(host)


class Handle:
    """A pending non-blocking collective; :meth:`wait` returns the result buffer.

    The handle keeps the buffers alive until the operation completes. Waiting twice is
    harmless (the second wait returns at once).
    """

    __slots__ = ("_request", "_buf", "_keep", "_on_complete")

    def __init__(self, request: Any, buf: Any, keep: Any = None, on_complete=None) -> None:
        self._request = request  # None means already complete; else has Wait() and Test()
        self._buf = buf
        self._keep = keep  # e.g. the send buffer of an out-of-place reduction
        self._on_complete = on_complete  # e.g. copy a host-staged result back to the GPU

    def wait(self) -> Any:
        """Block until the collective is complete and return its result buffer.

        For a NCCL collective "complete" means ordered: the current CUDA stream waits for
        it on the GPU, and the host does not block.
        """
        if self._request is not None:
            self._request.Wait()
            self._complete()
        return self._buf

    def test(self) -> bool:
        """Return True when the collective is complete (and progress it if not)."""
        if self._request is None:
            return True
        if self._request.Test():
            self._complete()
            return True
        return False

    def _complete(self) -> None:
        self._request = None
        if self._on_complete is not None:
            self._on_complete()
            self._on_complete = None
        self._keep = None


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

    def allreduce_(self, buf: Any, op: str = "sum") -> Any:
        """Reduce ``buf`` across ranks in place (``MPI.IN_PLACE``) and return it.

        A GPU array is staged through a host copy (the MPI wheels are not CUDA-aware).
        """
        _check_buffer(buf)
        _check_reduce_dtype(buf)
        host = _staged(buf)
        self._comm.Allreduce(self._MPI.IN_PLACE, host, op=self._ops[_check_op(op)])
        _unstage(buf, host)
        return buf

    def iallreduce_(self, buf: Any, op: str = "sum") -> Handle:
        """Start an in-place reduction of ``buf``; ``handle.wait()`` returns ``buf``.

        Do not read or write ``buf`` until the handle is waited on. Several handles may be
        outstanding, but every rank must start them in the same order.
        """
        _check_buffer(buf)
        _check_reduce_dtype(buf)
        host = _staged(buf)
        req = self._comm.Iallreduce(self._MPI.IN_PLACE, host, op=self._ops[_check_op(op)])
        return self._handle(req, buf, host)

    def allreduce_copy(self, sendbuf: Any, recvbuf: Any, op: str = "sum") -> Any:
        """Reduce ``sendbuf`` across ranks into a separate ``recvbuf``; return ``recvbuf``."""
        _check_copy_pair(sendbuf, recvbuf)
        recv = _receiving(recvbuf)
        self._comm.Allreduce(_staged(sendbuf), recv, op=self._ops[_check_op(op)])
        _unstage(recvbuf, recv)
        return recvbuf

    def iallreduce_copy(self, sendbuf: Any, recvbuf: Any, op: str = "sum") -> Handle:
        """Non-blocking :meth:`allreduce_copy`; ``handle.wait()`` returns ``recvbuf``."""
        _check_copy_pair(sendbuf, recvbuf)
        send, recv = _staged(sendbuf), _receiving(recvbuf)
        req = self._comm.Iallreduce(send, recv, op=self._ops[_check_op(op)])
        return self._handle(req, recvbuf, recv, keep=send)

    def broadcast_(self, buf: Any, root: int = 0) -> Any:
        """Overwrite ``buf`` on every rank with ``root``'s ``buf``; return it."""
        _check_buffer(buf)
        self._check_root(root)
        host = _staged(buf)
        self._comm.Bcast(host, root=root)
        _unstage(buf, host)
        return buf

    @staticmethod
    def _handle(req: Any, buf: Any, host: np.ndarray, keep: Any = None) -> Handle:
        """A handle on ``buf`` whose MPI request works on ``host`` (``buf`` or its staging copy)."""
        if host is buf:
            return Handle(req, buf, keep=keep)
        return Handle(req, buf, keep=(keep, host), on_complete=lambda: buf.set(host))

    # -- Python-object collectives (small, for metrics and config) -------------------------

    def allgather_object(self, obj: Any) -> list:
        """Return the list of every rank's (picklable) ``obj``, indexed by rank."""
        return self._comm.allgather(obj)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Return ``root``'s (picklable) ``obj`` on every rank."""
        self._check_root(root)
        return self._comm.bcast(obj, root=root)

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
        _backend.get_array_module(recvbuf).copyto(recvbuf, sendbuf)
        return recvbuf

    def iallreduce_copy(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str = "sum") -> Handle:
        return Handle(None, self.allreduce_copy(sendbuf, recvbuf, op))

    def broadcast_(self, buf: np.ndarray, root: int = 0) -> np.ndarray:
        _check_buffer(buf)
        self._check_root(root)
        return buf

    def allgather_object(self, obj: Any) -> list:
        return [obj]

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        self._check_root(root)
        return obj

    def allreduce_scalar(self, value: float, op: str = "sum") -> float:
        _check_op(op, _SCALAR_OPS)
        return float(value)

    def barrier(self) -> None:
        pass

    def abort(self, code: int = 1) -> None:
        _flush_std_streams()
        os._exit(code)


# -- NCCL ------------------------------------------------------------------------------------


def _import_nccl():
    """CuPy's NCCL module; RuntimeError saying what is missing when it cannot be used."""
    cp = _backend.cupy_module()
    if cp is None:
        raise RuntimeError(
            "the NCCL backend needs CuPy and a CUDA device (pip install -e '.[gpu]' on a "
            "machine with a GPU); use distributed.backend 'mpi' or device 'cpu'"
        )
    from cupy.cuda import nccl  # noqa: PLC0415  (optional, GPU only)

    if not getattr(nccl, "available", False):
        raise RuntimeError(
            "CuPy cannot load the NCCL library (libnccl.so.2): install it "
            "(pip install 'nvidia-nccl-cu12>=2.18,<3'), or set distributed.backend 'mpi' "
            "to stage GPU buffers through host memory"
        )
    return nccl


def nccl_bootstrap(mpi: Communicator, nccl: Any) -> Any:
    """Creates this rank's NCCL communicator: rank 0 makes the unique id, MPI broadcasts it.

    Every rank must call it (``ncclCommInitRank`` is collective), with its CUDA device
    already current.
    """
    uid = nccl.get_unique_id() if mpi.rank == 0 else None
    uid = mpi.broadcast_object(uid, root=0)
    return nccl.NcclCommunicator(mpi.size, uid, mpi.rank)


class _StreamEvent:
    """The request of a NCCL collective started on a side stream (see :class:`Handle`).

    ``Wait`` makes the stream current at that moment wait on the GPU (no host block);
    ``Test`` asks whether the GPU has finished it.
    """

    __slots__ = ("_event", "_cupy")

    def __init__(self, event: Any, cupy: Any) -> None:
        self._event = event
        self._cupy = cupy

    def Wait(self) -> None:  # noqa: N802 - the mpi4py request protocol Handle uses
        self._cupy.cuda.get_current_stream().wait_event(self._event)

    def Test(self) -> bool:  # noqa: N802
        return bool(self._event.done)


class NcclCommunicator(Communicator):
    """MPI for ranks, host arrays and Python objects; NCCL for GPU (CuPy) arrays.

    Blocking collectives of GPU arrays are enqueued on the current CUDA stream, so work
    enqueued after them sees their result without the host waiting. Non-blocking ones run
    on this communicator's side stream, after everything the current stream had enqueued
    (an event orders them), so the allreduce of a bucket overlaps the rest of backward;
    ``handle.wait()`` makes the current stream wait for it.

    Args:
        comm: an mpi4py communicator; defaults to ``MPI.COMM_WORLD``.
        device: the CUDA device of this rank; defaults to ``local_rank % device count``.
    """

    backend = "nccl"

    def __init__(self, comm: Any = None, device: int | None = None) -> None:
        nccl = _import_nccl()
        super().__init__(comm)
        cp = _backend.cupy_module()
        self._cupy = cp
        self.device = self.local_rank % cp.cuda.runtime.getDeviceCount() if device is None else int(device)
        self._nccl_ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}
        # Reductions are limited to _REDUCE_DTYPES (checked first); broadcasts take these all.
        self._nccl_dtypes = {
            np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float64): nccl.NCCL_FLOAT64,
            np.dtype(np.int32): nccl.NCCL_INT32, np.dtype(np.int64): nccl.NCCL_INT64,
            np.dtype(np.float16): nccl.NCCL_FLOAT16, np.dtype(np.int8): nccl.NCCL_INT8,
            np.dtype(np.uint8): nccl.NCCL_UINT8, np.dtype(np.bool_): nccl.NCCL_UINT8,
        }
        with cp.cuda.Device(self.device):
            self._nccl = nccl_bootstrap(self, nccl)
            self._side = cp.cuda.Stream(non_blocking=True)

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", device=cuda:{self.device})"

    def _gpu_args(self, buf: Any) -> tuple:
        if buf.device.id != self.device:
            raise ValueError(f"buffer is on cuda:{buf.device.id}, this rank's NCCL device is cuda:{self.device}")
        dtype = self._nccl_dtypes.get(np.dtype(buf.dtype))
        if dtype is None:
            raise TypeError(f"NCCL cannot carry dtype {buf.dtype}; supported: "
                            + ", ".join(str(d) for d in self._nccl_dtypes))
        return buf.size, dtype

    def _side_stream_after_current(self) -> Any:
        self._side.wait_event(self._cupy.cuda.get_current_stream().record())
        return self._side

    def _side_handle(self, buf: Any, keep: Any = None) -> Handle:
        return Handle(_StreamEvent(self._side.record(), self._cupy), buf, keep=keep)

    def _all_reduce(self, send: Any, recv: Any, op: str, stream: Any) -> Any:
        """NCCL allreduce of GPU arrays on ``stream``; in place when ``send is recv``."""
        if send is recv:
            _check_buffer(recv)
            _check_reduce_dtype(recv)
        else:
            _check_copy_pair(send, recv)
        count, dtype = self._gpu_args(recv)
        self._nccl.allReduce(send.data.ptr, recv.data.ptr, count, dtype, self._nccl_ops[_check_op(op)], stream.ptr)
        return recv

    def allreduce_(self, buf: Any, op: str = "sum") -> Any:
        if _is_host(buf):
            return super().allreduce_(buf, op)
        return self._all_reduce(buf, buf, op, self._cupy.cuda.get_current_stream())

    def iallreduce_(self, buf: Any, op: str = "sum") -> Handle:
        if _is_host(buf):
            return super().iallreduce_(buf, op)
        self._all_reduce(buf, buf, op, self._side_stream_after_current())
        return self._side_handle(buf)

    def allreduce_copy(self, sendbuf: Any, recvbuf: Any, op: str = "sum") -> Any:
        if _is_host(sendbuf) and _is_host(recvbuf):
            return super().allreduce_copy(sendbuf, recvbuf, op)
        return self._all_reduce(sendbuf, recvbuf, op, self._cupy.cuda.get_current_stream())

    def iallreduce_copy(self, sendbuf: Any, recvbuf: Any, op: str = "sum") -> Handle:
        if _is_host(sendbuf) and _is_host(recvbuf):
            return super().iallreduce_copy(sendbuf, recvbuf, op)
        self._all_reduce(sendbuf, recvbuf, op, self._side_stream_after_current())
        return self._side_handle(recvbuf, keep=sendbuf)

    def broadcast_(self, buf: Any, root: int = 0) -> Any:
        if _is_host(buf):
            return super().broadcast_(buf, root)
        _check_buffer(buf)
        self._check_root(root)
        count, dtype = self._gpu_args(buf)
        stream = self._cupy.cuda.get_current_stream()
        self._nccl.bcast(buf.data.ptr, count, dtype, root, stream.ptr)
        return buf


def for_device(world: Communicator, device: Any, backend: str = "auto") -> Communicator:
    """The communicator a run on ``device`` uses for its gradients.

    ``backend`` is ``"auto"`` (NCCL for a multi-rank GPU run when CuPy can load NCCL, else
    MPI with host staging, said once in a warning), ``"nccl"`` (NCCL or a clear error) or
    ``"mpi"`` (always MPI; GPU buffers staged through host memory). On the CPU, and with
    one process, the answer is ``world`` itself.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown distributed backend {backend!r}; use one of: {', '.join(BACKENDS)}")
    dev = _backend.device(device)
    if dev.type == "cpu":
        if backend == "nccl":
            raise ValueError("distributed backend 'nccl' needs device 'cuda'; on the CPU use 'mpi' or 'auto'")
        return world
    if world.size == 1 or backend == "mpi" or isinstance(world, NcclCommunicator):
        return world
    if backend == "auto":
        try:
            _import_nccl()
        except RuntimeError as e:
            import warnings  # noqa: PLC0415

            warnings.warn(f"{e}; falling back to MPI with host staging", RuntimeWarning, stacklevel=2)
            return world
    return NcclCommunicator(world.mpi_comm, device=dev.index)


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
