"""``cupy.cuda`` of the stand-in: simulated devices, streams, events and the memory pool.

``cupy.cuda.nccl`` is a submodule to import (``from ... cuda import nccl``), as in CuPy.
"""

from __future__ import annotations

import contextlib

from . import compiler, device, graph, memory, memory_hook, runtime, stream  # noqa: F401
from .device import Device, get_device_id  # noqa: F401
from .graph import Graph  # noqa: F401
from .memory import (  # noqa: F401
    Memory,
    MemoryPointer,
    MemoryPool,
    UnownedMemory,
    alloc,
    get_allocator,
    set_allocator,
)
from .memory_hook import MemoryHook  # noqa: F401
from .stream import Event, Stream, get_current_stream  # noqa: F401


@contextlib.contextmanager
def using_allocator(allocator=None):
    """Sets the calling thread's allocator inside the block (``None``: raw allocations), as
    ``cupy.cuda.using_allocator``: other threads keep theirs."""
    if allocator is None:
        allocator = memory._malloc
    previous = memory._get_thread_local_allocator()
    memory._set_thread_local_allocator(allocator)
    try:
        yield
    finally:
        memory._set_thread_local_allocator(previous)


def is_available() -> bool:
    """True: the stand-in always has its simulated GPUs."""
    return runtime.getDeviceCount() > 0
