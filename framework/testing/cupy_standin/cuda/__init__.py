"""``cupy.cuda`` of the stand-in: simulated devices, streams, events and the memory pool.

``cupy.cuda.nccl`` is a submodule to import (``from ... cuda import nccl``), as in CuPy.
"""

from __future__ import annotations

from . import compiler, device, graph, memory, memory_hook, runtime, stream  # noqa: F401
from .device import Device, get_device_id  # noqa: F401
from .graph import Graph  # noqa: F401
from .memory import (  # noqa: F401
    Memory,
    MemoryPointer,
    MemoryPool,
    alloc,
    get_allocator,
    set_allocator,
)
from .memory_hook import MemoryHook  # noqa: F401
from .stream import Event, Stream, get_current_stream  # noqa: F401


def is_available() -> bool:
    """True: the stand-in always has its simulated GPUs."""
    return runtime.getDeviceCount() > 0
