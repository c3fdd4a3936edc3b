"""The NCCL communicator: GPU (CuPy) arrays reduced by NCCL, bootstrapped over MPI.

Ranks, host arrays and Python objects still go through MPI (:class:`.mpi.Communicator`);
CuPy arrays are reduced by NCCL on the GPU through CuPy's ``cuda.nccl`` with pointer-based
calls. Blocking collectives run on the current CUDA stream, non-blocking ones on a side
stream so they overlap the computation. The streams and events come from
:mod:`framework.backend`, the one place that calls CuPy's device API.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import backend as _backend
from .collective import (
    Handle,
    check_buffer,
    check_copy_pair,
    check_op,
    check_parts,
    check_reduce_dtype,
    check_scatter,
    is_host,
)
from .mpi import Communicator


def import_nccl():
    """CuPy's NCCL module; RuntimeError saying what is missing when it cannot be used."""
    if not _backend.is_cuda_available():
        raise RuntimeError(
            "the NCCL backend needs CuPy and a CUDA device (pip install -e '.[gpu]' on a "
            "machine with a GPU); use distributed.backend 'mpi' or device 'cpu'"
        )
    nccl = _backend.nccl_module()
    if nccl is None:
        raise RuntimeError(nccl_missing_message(_backend.cuda_major()))
    return nccl


def nccl_missing_message(major: int) -> str:
    """What to install when CuPy cannot load NCCL: the wheel built for the CUDA major
    version CuPy runs on (the project's ``gpu-cuda12``/``gpu-cuda13`` extras carry it)."""
    extra = f" or pip install -e '.[gpu-cuda{major}]'" if major in (12, 13) else ""
    return (
        f"CuPy (CUDA {major}) cannot load the NCCL library (libnccl.so.2): install it (pip install "
        f"nvidia-nccl-cu{major}{extra}), or set distributed.backend 'mpi' to stage GPU buffers through host memory"
    )


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

    __slots__ = ("_event",)

    def __init__(self, event: Any) -> None:
        self._event = event

    def Wait(self) -> None:  # noqa: N802 - the mpi4py request protocol Handle uses
        _backend.wait_event(self._event)

    def Test(self) -> bool:  # noqa: N802
        return _backend.event_done(self._event)


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
        nccl = import_nccl()
        super().__init__(comm)
        self.device = self.local_rank % _backend.device_count() if device is None else int(device)
        self._nccl_ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}
        # Reductions are limited to REDUCE_DTYPES (checked first); broadcasts take these all.
        self._nccl_dtypes = {
            np.dtype(np.float32): nccl.NCCL_FLOAT32,
            np.dtype(np.float64): nccl.NCCL_FLOAT64,
            np.dtype(np.int32): nccl.NCCL_INT32,
            np.dtype(np.int64): nccl.NCCL_INT64,
            np.dtype(np.float16): nccl.NCCL_FLOAT16,
            np.dtype(np.int8): nccl.NCCL_INT8,
            np.dtype(np.uint8): nccl.NCCL_UINT8,
            np.dtype(np.bool_): nccl.NCCL_UINT8,
        }
        with _backend.device_context(_backend.Device("cuda", self.device)):
            self._nccl = nccl_bootstrap(self, nccl)
            self._side = _backend.new_stream()

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", device=cuda:{self.device})"

    def _gpu_args(self, buf: Any) -> tuple:
        on = _backend.device_of(buf)
        if on.index != self.device:
            raise ValueError(f"buffer is on {on}, this rank's NCCL device is cuda:{self.device}")
        dtype = self._nccl_dtypes.get(np.dtype(buf.dtype))
        if dtype is None:
            raise TypeError(
                f"NCCL cannot carry dtype {buf.dtype}; supported: " + ", ".join(str(d) for d in self._nccl_dtypes)
            )
        return buf.size, dtype

    def _side_stream_after_current(self) -> Any:
        _backend.wait_event(_backend.record_event(), self._side)
        return self._side

    def _side_handle(self, buf: Any, keep: Any = None) -> Handle:
        return Handle(_StreamEvent(_backend.record_event(self._side)), buf, keep=keep)

    def _all_reduce(self, send: Any, recv: Any, op: str, stream: Any) -> Any:
        """NCCL allreduce of GPU arrays on ``stream``; in place when ``send is recv``."""
        if send is recv:
            check_buffer(recv)
            check_reduce_dtype(recv)
        else:
            check_copy_pair(send, recv)
        count, dtype = self._gpu_args(recv)
        self._nccl.allReduce(send.data.ptr, recv.data.ptr, count, dtype, self._nccl_ops[check_op(op)], stream.ptr)
        return recv

    def allreduce_(self, buf: Any, op: str = "sum") -> Any:
        if is_host(buf):
            return super().allreduce_(buf, op)
        return self._all_reduce(buf, buf, op, _backend.current_stream())

    def iallreduce_(self, buf: Any, op: str = "sum") -> Handle:
        if is_host(buf):
            return super().iallreduce_(buf, op)
        self._all_reduce(buf, buf, op, self._side_stream_after_current())
        return self._side_handle(buf)

    def allreduce_copy(self, sendbuf: Any, recvbuf: Any, op: str = "sum") -> Any:
        if is_host(sendbuf) and is_host(recvbuf):
            return super().allreduce_copy(sendbuf, recvbuf, op)
        return self._all_reduce(sendbuf, recvbuf, op, _backend.current_stream())

    def iallreduce_copy(self, sendbuf: Any, recvbuf: Any, op: str = "sum") -> Handle:
        if is_host(sendbuf) and is_host(recvbuf):
            return super().iallreduce_copy(sendbuf, recvbuf, op)
        self._all_reduce(sendbuf, recvbuf, op, self._side_stream_after_current())
        return self._side_handle(recvbuf, keep=sendbuf)

    def broadcast_(self, buf: Any, root: int = 0) -> Any:
        if is_host(buf):
            return super().broadcast_(buf, root)
        check_buffer(buf)
        self._check_root(root)
        count, dtype = self._gpu_args(buf)
        self._nccl.bcast(buf.data.ptr, count, dtype, root, _backend.current_stream().ptr)
        return buf

    def ireduce_scatter(self, sendbuf: Any, recvbuf: Any, counts, op: str = "sum") -> Handle:
        """:meth:`.mpi.Communicator.ireduce_scatter` of GPU arrays, on the side stream.

        Equal counts are one ``ncclReduceScatter``; NCCL has no reduce-scatter of unequal
        blocks, so those run as one ``ncclReduce`` to each rank whose block is not empty
        (the same bytes on the wire: each element still travels to its one owner).
        """
        if is_host(sendbuf) and is_host(recvbuf):
            return super().ireduce_scatter(sendbuf, recvbuf, counts, op)
        counts = check_scatter(sendbuf, recvbuf, counts, self.rank, self.size)
        _, dtype = self._gpu_args(sendbuf)
        nccl_op = self._nccl_ops[check_op(op)]
        stream = self._side_stream_after_current()
        if len(set(counts)) == 1:
            self._nccl.reduceScatter(sendbuf.data.ptr, recvbuf.data.ptr, counts[0], dtype, nccl_op, stream.ptr)
        else:
            start = 0
            for owner, count in enumerate(counts):
                if count:
                    block = sendbuf[start : start + count]
                    into = recvbuf if owner == self.rank else block  # NCCL reads recvbuff on the root only
                    self._nccl.reduce(block.data.ptr, into.data.ptr, count, dtype, nccl_op, owner, stream.ptr)
                start += count
        return self._side_handle(recvbuf, keep=sendbuf)

    def allgather_(self, buf: Any) -> Any:
        if is_host(buf):
            return super().allgather_(buf)
        check_buffer(buf)
        part = check_parts(buf, self.size)
        _, dtype = self._gpu_args(buf)
        # in place as NCCL defines it: this rank's part is the send buffer
        mine = buf[self.rank * part : (self.rank + 1) * part]
        self._nccl.allGather(mine.data.ptr, buf.data.ptr, part, dtype, _backend.current_stream().ptr)
        return buf

    def allgather_copy(self, sendbuf: Any, recvbuf: Any) -> Any:
        if is_host(sendbuf) and is_host(recvbuf):
            return super().allgather_copy(sendbuf, recvbuf)
        check_buffer(sendbuf, "sendbuf", writable=False)
        check_buffer(recvbuf, "recvbuf")
        if check_parts(recvbuf, self.size, "recvbuf") != sendbuf.size or sendbuf.dtype != recvbuf.dtype:
            raise ValueError(f"recvbuf must hold {self.size} times sendbuf ({sendbuf.size} of {sendbuf.dtype})")
        count, dtype = self._gpu_args(sendbuf)
        self._nccl.allGather(sendbuf.data.ptr, recvbuf.data.ptr, count, dtype, _backend.current_stream().ptr)
        return recvbuf
