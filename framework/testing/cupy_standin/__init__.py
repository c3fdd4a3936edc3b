"""A strict CuPy stand-in: CuPy's API and behaviour on the CPU, for testing GPU code paths.

``framework.backend`` loads this module in place of ``cupy`` when the environment says
``INPLACE_LAB_CUPY=standin`` (the test suite does so by itself on a machine where CuPy
sees no GPU). Code written for CuPy then runs unchanged on two
simulated GPUs, and fails where it would fail on a GPU:

- arrays are their own type (:class:`ndarray`, not a NumPy subclass) with ``.get()``,
  ``.device``, ``.data.ptr``; NumPy cannot see into them: ``numpy.asarray(a)`` and host
  arrays mixed into device routines raise TypeError, so every hidden host transfer is
  caught; ``asnumpy``/``.get()`` and ``asarray``/``array`` are the explicit transfers;
- the namespace holds only names real CuPy has, with CuPy's signatures where they differ
  from NumPy's (``argmax(a, axis, dtype, out, keepdims)``, reductions without ``where=``,
  ``ufunc.reduce`` only for add and multiply, ...), and results are device arrays,
  0-d ones where NumPy would give a scalar;
- memory comes from a pool that rounds to 512 bytes and calls ``cuda.MemoryHook`` s on
  every malloc and free, with real pointers (:mod:`.cuda.memory`);
- integer index arrays wrap around instead of raising (CuPy does not check bounds), and
  kernels refuse arrays of a device other than the current one;
- ``cuda.Device``, streams and events have CuPy's API; they order nothing, since every
  call has finished when it returns; stream capture records kernels into a
  ``cuda.Graph`` and refuses what CUDA and CuPy refuse during capture (:mod:`.cuda.graph`);
  ``cuda.nccl`` carries NCCL's pointer-based collectives over MPI (:mod:`.cuda.nccl`).

- CuPy's odd answers are kept: ``shares_memory`` compares element addresses as CuPy's
  kernel reports them (a 0-d element's is a kernel local's: two distinct 0-d arrays
  "share", a 0-d view does not), reductions refuse axis 0/-1 on 0-d arrays, NCCL
  failures are ``NcclError(status)`` with NCCL's own message;
- what costs time on a GPU is counted (:mod:`.counting`): one launch per kernel real
  CuPy would run, one host synchronization per call that waits for the device, by kind
  and call site.

What it cannot show: CuPy's kernels and their numerics (the values are NumPy's), GPU
timings and asynchrony, NCCL itself, and the device's memory size (a pool limit set
with ``set_limit`` is enforced, as CuPy enforces it).
"""

from __future__ import annotations

from numpy import (  # noqa: F401  (CuPy re-exports NumPy's scalar types and constants)
    bool_,
    can_cast,
    complex64,
    complex128,
    dtype,
    e,
    finfo,
    float16,
    float32,
    float64,
    iinfo,
    inf,
    int8,
    int16,
    int32,
    int64,
    intp,
    isscalar,
    nan,
    newaxis,
    pi,
    promote_types,
    uint8,
    uint16,
    uint32,
    uint64,
)

from . import cuda, lib, random  # noqa: F401
from ._core import ndarray, ufunc  # noqa: F401
from ._kernels import ElementwiseKernel, ReductionKernel  # noqa: F401
from ._routines import *  # noqa: F401,F403
from ._ufuncs import UFUNCS as _UFUNCS

__version__ = "14.0.0+standin"


def get_default_memory_pool():
    """The memory pool of every device (``cupy.get_default_memory_pool``)."""
    return cuda.memory._default_pool


globals().update(_UFUNCS)
