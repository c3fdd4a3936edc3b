"""``cupy.cuda.nccl`` of the stand-in: NCCL's pointer-based collectives, carried by MPI.

The calls have NCCL's (and CuPy's) signatures: buffers are device pointers
(``array.data.ptr``), counts are elements, ``datatype`` and ``op`` are the ``NCCL_*``
constants and the last argument is a stream handle. Each pointer is looked up among the
live blocks of the stand-in's memory pool and must hold ``count`` elements on the
communicator's device; the values then travel with mpi4py, so the code that drives NCCL
runs under ``mpiexec`` without a GPU. What is checked is what NCCL refuses: a pointer
that is not device memory of the communicator's GPU (``NCCL_ERROR_INVALID_ARGUMENT``),
two ranks on one GPU (``NCCL_ERROR_INVALID_USAGE``), a stream of another device.

Differences from NCCL: every collective has finished when the call returns (the stream
orders nothing), and ``NcclCommunicator(ndev, id, rank)`` must be called by every rank
of ``MPI.COMM_WORLD`` (its ranks are found by splitting COMM_WORLD by the id), whereas
NCCL needs only the ``ndev`` ranks that share the id. This is not NCCL: its algorithms,
its speed and its own failures are not exercised.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import socket
import sys

import numpy

from .. import counting
from . import graph, memory, runtime, stream

available = importlib.util.find_spec("mpi4py") is not None

NCCL_UNIQUE_ID_BYTES = 128

NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
NCCL_BFLOAT16 = 9

_DTYPES = {
    NCCL_INT8: numpy.int8,
    NCCL_UINT8: numpy.uint8,
    NCCL_INT32: numpy.int32,
    NCCL_UINT32: numpy.uint32,
    NCCL_INT64: numpy.int64,
    NCCL_UINT64: numpy.uint64,
    NCCL_FLOAT16: numpy.float16,
    NCCL_FLOAT32: numpy.float32,
    NCCL_FLOAT64: numpy.float64,
}

# status -> (CuPy's name for it, NCCL's ncclGetErrorString): the stand-in's failures.
_ERRORS = {
    1: ("NCCL_ERROR_UNHANDLED_CUDA_ERROR", "unhandled cuda error (run with NCCL_DEBUG=INFO for details)"),
    4: ("NCCL_ERROR_INVALID_ARGUMENT", "invalid argument (run with NCCL_DEBUG=WARN for details)"),
    5: ("NCCL_ERROR_INVALID_USAGE", "invalid usage (run with NCCL_DEBUG=WARN for details)"),
}


class NcclError(RuntimeError):
    """A failed NCCL call, as CuPy raises it: ``NcclError(status)``, ``status`` NCCL's result
    code, the message CuPy's name for it and NCCL's error string (never the details)."""

    def __init__(self, status: int):
        self.status = status
        name, text = _ERRORS[status]
        super().__init__(f"{name}: {text}")

    def __reduce__(self):
        return type(self), (self.status,)


def _fail(status: int, detail: str) -> NcclError:
    """The error of a refused call. Like NCCL, the reason goes to stderr as a ``NCCL WARN``
    line only when ``NCCL_DEBUG`` asks for warnings; the exception carries the status."""
    if os.environ.get("NCCL_DEBUG", "").upper() in ("WARN", "INFO", "TRACE"):
        print(f"{socket.gethostname()}:{os.getpid()} NCCL WARN {detail}", file=sys.stderr, flush=True)
    return NcclError(status)


def get_version() -> int:
    return 22809  # reported as NCCL 2.28.9, the version measured on a GPU


def get_build_version() -> int:
    return 22809


def get_unique_id() -> bytes:
    """A new communicator id (128 bytes), made on one rank and sent to the others."""
    return os.urandom(NCCL_UNIQUE_ID_BYTES)


class NcclCommunicator:
    """One rank of an NCCL communicator of ``ndev`` ranks, on the current device.

    Args:
        ndev: the number of ranks.
        commId: the id from :func:`get_unique_id` (the same bytes on every rank).
        rank: this process's rank in the communicator (0 .. ndev - 1).
    """

    def __init__(self, ndev: int, commId: bytes, rank: int, config=None):  # noqa: N803 - CuPy's names
        if not isinstance(commId, bytes):
            raise TypeError(f"commId must be bytes (from get_unique_id()), got {type(commId).__name__}")
        if len(commId) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"commId length {len(commId)} != {NCCL_UNIQUE_ID_BYTES}.")
        if not available:
            raise _fail(1, "the stand-in's NCCL runs over MPI: install mpi4py")
        from mpi4py import MPI  # noqa: PLC0415  (only where a communicator is made)

        self._MPI = MPI
        self._device = runtime.getDevice()
        color = int.from_bytes(hashlib.sha256(commId).digest()[:4], "little") & 0x7FFFFFFF
        self._comm = MPI.COMM_WORLD.Split(color, key=int(rank))
        ranks = self._comm.allgather(int(rank))
        if ranks != list(range(ndev)):
            self._comm.Free()
            raise _fail(4, f"ranks {sorted(ranks)} joined a communicator of {ndev} ranks")
        placed = self._comm.allgather((socket.gethostname(), self._device))
        for other, where in enumerate(placed):
            if other != rank and where == placed[rank]:
                self._comm.Free()
                raise _fail(
                    5, f"Duplicate GPU detected : rank {rank} and rank {other} both on CUDA device {self._device}"
                )
        self._rank, self._size = int(rank), int(ndev)
        self._ops = {NCCL_SUM: MPI.SUM, NCCL_PROD: MPI.PROD, NCCL_MAX: MPI.MAX, NCCL_MIN: MPI.MIN}

    # -- queries -----------------------------------------------------------------------------------
    def device_id(self) -> int:
        return self._device

    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def destroy(self) -> None:
        if self._comm is not None:
            self._comm.Free()
            self._comm = None

    def abort(self) -> None:
        self.destroy()

    def check_async_error(self) -> None:
        """Nothing runs asynchronously on the stand-in: there is never an async error."""

    # -- collectives -----------------------------------------------------------------------------
    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int) -> None:  # noqa: N802
        self._check_stream(stream)
        recv = self._buffer(recvbuf, count, datatype)
        send = recv if sendbuf == recvbuf else self._buffer(sendbuf, count, datatype)
        # NCCL supports stream capture: in a graph, every replay reduces again (all ranks
        # must replay theirs, as on a GPU)
        graph.launch_on(stream, "nccl", lambda: self._reduce_into(send, recv, op, root=None))

    def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, root: int, stream: int) -> None:
        self._check_stream(stream)
        counting.launch("nccl")
        self._check_root(root)
        recv = self._buffer(recvbuf, count, datatype) if self._rank == root else None
        send = recv if recv is not None and sendbuf == recvbuf else self._buffer(sendbuf, count, datatype)
        self._reduce_into(send, recv, op, root=root)

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None:
        self._check_stream(stream)
        counting.launch("nccl")
        self._check_root(root)
        self._comm.Bcast(self._buffer(buff, count, datatype).view(numpy.uint8), root=root)

    def broadcast(self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int, stream: int) -> None:
        self._check_stream(stream)
        counting.launch("nccl")
        self._check_root(root)
        recv = self._buffer(recvbuff, count, datatype)
        if self._rank == root and sendbuff != recvbuff:
            recv[...] = self._buffer(sendbuff, count, datatype)
        self._comm.Bcast(recv.view(numpy.uint8), root=root)

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:  # noqa: N802
        self._check_stream(stream)
        counting.launch("nccl")
        recv = self._buffer(recvbuf, count * self._size, datatype)
        send = self._buffer(sendbuf, count, datatype).copy()  # may be recv's own slot (in place)
        self._comm.Allgather(send.view(numpy.uint8), recv.view(numpy.uint8))

    def reduceScatter(
        self,
        sendbuf: int,
        recvbuf: int,
        recvcount: int,
        datatype: int,
        op: int,  # noqa: N802
        stream: int,
    ) -> None:
        self._check_stream(stream)
        counting.launch("nccl")
        send = self._buffer(sendbuf, recvcount * self._size, datatype)
        total = numpy.empty_like(send)
        self._reduce_into(send.copy(), total, op, root=None)
        self._buffer(recvbuf, recvcount, datatype)[...] = total[self._rank * recvcount : (self._rank + 1) * recvcount]

    # -- helpers ------------------------------------------------------------------------------------
    def _buffer(self, ptr: int, count: int, datatype: int) -> numpy.ndarray:
        """The ``count`` elements at device pointer ``ptr`` (host memory of a pool block)."""
        if self._comm is None:
            raise _fail(5, "the communicator was destroyed")
        dtype = _DTYPES.get(datatype)
        if dtype is None:
            raise _fail(4, f"datatype {datatype} is not supported by the stand-in")
        nbytes = int(count) * numpy.dtype(dtype).itemsize
        found = memory._block_at(int(ptr), nbytes)
        if found is None:
            raise _fail(4, f"pointer 0x{int(ptr):x} is not {nbytes} bytes of live device memory")
        block, offset = found
        if block.device_id != self._device:
            raise _fail(
                4,
                f"pointer 0x{int(ptr):x} is memory of device {block.device_id}, "
                f"this communicator's device is {self._device}",
            )
        return numpy.ndarray((int(count),), dtype, buffer=block._buf, offset=offset)

    def _reduce_into(self, send: numpy.ndarray, recv, op: int, root) -> None:
        """MPI reduction of ``send`` into ``recv`` (in place when they are one array; ``recv``
        is None on the ranks of ``reduce`` that are not its root)."""
        MPI = self._MPI
        if op == NCCL_AVG:
            mpi_op = MPI.SUM
        elif op in self._ops:
            mpi_op = self._ops[op]
        else:
            raise _fail(4, f"unknown reduction op {op}")
        if send.dtype == numpy.float16:  # MPI has no float16 reduction: reduce in float32, round once
            src = send.astype(numpy.float32)
            dst = None if recv is None else numpy.empty(src.shape, numpy.float32)
        else:
            src, dst = send, recv
        if src is dst:
            src = MPI.IN_PLACE
        if root is None:
            self._comm.Allreduce(src, dst, op=mpi_op)
        else:
            self._comm.Reduce(src, dst, op=mpi_op, root=root)
        if recv is None:
            return
        if op == NCCL_AVG:
            if dst.dtype.kind == "f":
                dst /= self._size
            else:
                dst //= self._size
        if dst is not recv:
            recv[...] = dst

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self._size:
            raise _fail(4, f"root {root} out of range for {self._size} ranks")

    def _check_stream(self, handle: int) -> None:
        device = stream._stream_device(int(handle))
        if device is None:
            raise _fail(1, f"stream handle {handle} is not a live stream (cudaErrorInvalidResourceHandle)")
        if device not in (-1, self._device):
            raise _fail(1, f"stream of device {device} used with a communicator on device {self._device}")
