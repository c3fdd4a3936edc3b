"""Host staging: how MPI, which is not CUDA-aware here, reduces GPU arrays.

The MPI wheels are not CUDA-aware, so a CuPy array is copied to host memory, the
collective runs there and the result is copied back: two copies of the buffer per
collective (the fallback, not the fast path). Host arrays pass through untouched.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .collective import Handle, is_host


def staged(buf: Any) -> Any:
    """The host array MPI works on: ``buf`` itself, or a host copy of a GPU array."""
    return buf if is_host(buf) else buf.get()


def receiving(buf: Any) -> np.ndarray:
    """The host array MPI writes a result into: ``buf``, or host memory for a GPU array."""
    return buf if is_host(buf) else np.empty(buf.shape, buf.dtype)


def unstage(buf: Any, host: np.ndarray) -> None:
    """Copies a staged result back into the GPU array it came from."""
    if host is not buf:
        buf.set(host)


def staged_handle(request: Any, buf: Any, host: np.ndarray, keep: Any = None) -> Handle:
    """A handle on ``buf`` whose MPI request works on ``host`` (``buf`` or its staging copy)."""
    if host is buf:
        return Handle(request, buf, keep=keep)
    return Handle(request, buf, keep=(keep, host), on_complete=lambda: buf.set(host))
