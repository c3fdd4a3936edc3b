"""What every communicator shares: the argument checks of a collective and the
:class:`Handle` of a non-blocking one.

Array collectives work on contiguous NumPy or CuPy arrays of the dtypes in
:data:`REDUCE_DTYPES`; the checks say what is wrong with a buffer before any rank starts
a collective it could not finish.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import backend as _backend

REDUCE_OPS = ("sum", "max", "min")
SCALAR_OPS = ("sum", "max", "min", "mean")
# Dtypes the reductions are tested with (MPI_FLOAT, MPI_DOUBLE, MPI_INT32_T/MPI_LONG).
REDUCE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int64))


def is_host(buf: Any) -> bool:
    """Whether ``buf`` is a host (NumPy) array: MPI takes it as it is."""
    return isinstance(buf, np.ndarray)


def check_buffer(buf: Any, name: str = "buf", *, writable: bool = True) -> Any:
    if not is_host(buf) and _backend.device_of(buf).type != "cuda":
        raise TypeError(f"{name} must be a NumPy or CuPy array, got {type(buf).__name__}")
    if not buf.flags.c_contiguous:
        raise ValueError(
            f"{name} must be C-contiguous for a collective (shape {buf.shape}, strides "
            f"{buf.strides}); reduce a contiguous flat buffer, or pass "
            "xp.ascontiguousarray(x) and copy back"
        )
    if writable and is_host(buf) and not buf.flags.writeable:
        raise ValueError(f"{name} is read-only; the collective writes the result into it")
    return buf


def check_reduce_dtype(buf: Any, name: str = "buf") -> None:
    if buf.dtype not in REDUCE_DTYPES:
        allowed = ", ".join(str(d) for d in REDUCE_DTYPES)
        raise TypeError(f"cannot reduce {name} of dtype {buf.dtype}; supported: {allowed}")


def check_op(op: str, allowed: tuple[str, ...] = REDUCE_OPS) -> str:
    if op not in allowed:
        raise ValueError(f"unknown reduction op {op!r}; expected one of {', '.join(allowed)}")
    return op


def check_copy_pair(sendbuf: Any, recvbuf: Any) -> None:
    check_buffer(sendbuf, "sendbuf", writable=False)
    check_buffer(recvbuf, "recvbuf")
    check_reduce_dtype(sendbuf, "sendbuf")
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


def check_parts(buf: Any, size: int, name: str = "buf") -> int:
    """The length of each of ``size`` equal parts of ``buf`` (an all-gather's buffer)."""
    if buf.ndim != 1 or buf.size % size:
        raise ValueError(
            f"{name} must be 1-D with a multiple of {size} elements (one equal part per rank), got shape {buf.shape}"
        )
    return buf.size // size


def check_scatter(sendbuf: Any, recvbuf: Any, counts, rank: int, size: int) -> list[int]:
    """Checks a reduce-scatter's arguments: ``counts`` (one per rank, >= 0) sum to the 1-D
    ``sendbuf``'s length and ``recvbuf`` holds this rank's count, same dtype and device."""
    check_buffer(sendbuf, "sendbuf", writable=False)
    check_buffer(recvbuf, "recvbuf")
    check_reduce_dtype(sendbuf, "sendbuf")
    counts = [int(c) for c in counts]
    if len(counts) != size or sendbuf.ndim != 1 or any(c < 0 for c in counts) or sum(counts) != sendbuf.size:
        raise ValueError(
            f"counts {counts} must be {size} counts >= 0 that sum to the 1-D sendbuf's {sendbuf.size} "
            f"elements (shape {sendbuf.shape})"
        )
    if recvbuf.shape != (counts[rank],) or recvbuf.dtype != sendbuf.dtype:
        raise ValueError(
            f"recvbuf must hold this rank's {counts[rank]} elements of {sendbuf.dtype}, got shape "
            f"{recvbuf.shape} of {recvbuf.dtype}"
        )
    if _backend.device_of(sendbuf) != _backend.device_of(recvbuf):
        raise ValueError("sendbuf and recvbuf must be on the same device")
    return counts


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
