"""``cupy.cuda.memory`` of the stand-in: a memory pool with real pointers and memory hooks.

Device memory is host memory here: every allocation ("cudaMalloc") is a NumPy byte
buffer at a 512-byte aligned address, so ``ndarray.data.ptr`` is a real pointer that
NCCL calls, overlap checks and the pool's bookkeeping can use. The pool behaves as
CuPy's where this project depends on it:

- requests are rounded up to 512 bytes
  (:func:`_round_size`), and a freed block is kept for reuse, so ``used_bytes()`` and
  ``total_bytes()`` differ as they do on a GPU;
- every ``malloc`` calls each registered :class:`MemoryHook` of the calling thread
  (``malloc_preprocess(device_id, size, mem_size)``, then
  ``malloc_postprocess(device_id, size, mem_size, mem_ptr, pmem_id)``), a new device
  allocation also ``alloc_preprocess``/``alloc_postprocess``, and every free
  ``free_preprocess``/``free_postprocess(device_id, mem_size, mem_ptr, pmem_id)``:
  keyword arguments only, as ``cupy/cuda/memory.pyx`` calls them;
- a block goes back to the pool when the last array using it is garbage collected;
- while a stream captures a graph, an allocation by the thread whose current stream it
  is raises an error that names it (CUDA's relaxed mode would bake it into the graph),
  and a cudaMalloc the capture's mode forbids fails as CUDA fails it (see :mod:`.graph`);
- ``set_limit(size=None, fraction=None)`` caps what the pool holds (in use and cached,
  as ``total_bytes()``), as CuPy's: a new block that would pass the cap first frees the
  cached blocks, then raises :class:`OutOfMemoryError` with CuPy's message, so a step too
  large for its device fails here as it would on a GPU.

CuPy also splits a larger free block to serve a smaller request; the stand-in reuses
only blocks of the same rounded size. Pointers of live blocks can be looked up
(:func:`_block_at`), which is how the stand-in's NCCL finds the arrays it reduces.
"""

from __future__ import annotations

import threading
import weakref

import numpy

from . import graph, runtime
from .device import Device
from .memory_hook import _hooks

_allocation_unit_size = 512
_ALIGNMENT = 512  # cudaMalloc returns 256-byte aligned pointers; CuPy's blocks are 512-byte multiples


def _round_size(size: int) -> int:
    """Rounds a request up to the pool's unit, as ``cupy.cuda.memory._round_size``."""
    return (size + _allocation_unit_size - 1) // _allocation_unit_size * _allocation_unit_size


# --- memory and pointers ----------------------------------------------------------------------


class Memory:
    """One device allocation ("cudaMalloc"): ``size`` host bytes at a 512-byte aligned ``ptr``."""

    def __init__(self, size: int, device_id: int | None = None):
        self.size = int(size)
        self.device_id = runtime.getDevice() if device_id is None else int(device_id)
        if self.size:
            raw = numpy.empty(self.size + _ALIGNMENT, numpy.uint8)
            start = -raw.ctypes.data % _ALIGNMENT
            self._buf = raw[start : start + self.size]
            self.ptr = self._buf.ctypes.data
        else:  # CuPy's zero-size allocation: pointer 0, no memory
            self._buf = numpy.empty(0, numpy.uint8)
            self.ptr = 0

    @property
    def device(self) -> Device:
        return Device(self.device_id)


class PooledMemory:
    """A block the pool handed out; freed back to the pool (hooks called) when collected."""

    __slots__ = ("ptr", "size", "device_id", "_mem", "_pool", "__weakref__")

    def __init__(self, mem: Memory, pool: SingleDeviceMemoryPool):
        self._mem = mem
        self.ptr = mem.ptr
        self.size = mem.size
        self.device_id = mem.device_id
        self._pool = weakref.ref(pool)

    @property
    def _buf(self) -> numpy.ndarray:
        return self._mem._buf

    @property
    def device(self) -> Device:
        return Device(self.device_id)

    def free(self) -> None:
        """Returns the block to the pool (the arrays using it must be gone)."""
        ptr, self.ptr = self.ptr, 0
        pool = self._pool()
        if not ptr or pool is None:
            return
        hooks = _hooks()
        for hook in hooks:
            hook.free_preprocess(device_id=self.device_id, mem_size=self.size, mem_ptr=ptr, pmem_id=id(self))
        try:
            pool._free(ptr, self._mem)
        finally:
            for hook in hooks:
                hook.free_postprocess(device_id=self.device_id, mem_size=self.size, mem_ptr=ptr, pmem_id=id(self))

    def __del__(self):
        try:
            self.free()
        except Exception:  # noqa: BLE001 - at interpreter exit the modules may be gone
            pass


class UnownedMemory:
    """Device memory that CuPy does not own, as ``cupy.cuda.UnownedMemory(ptr, size, owner,
    device_id=-1)``: ``owner`` is held to keep the memory alive (CuPy holds nothing else).

    The stand-in reads it through the pool block (or the ``owner``'s memory) that holds
    ``[ptr, ptr + size)``; any other address is refused (there is no other memory here)."""

    __slots__ = ("ptr", "size", "device_id", "_owner", "_buf", "__weakref__")

    def __init__(self, ptr: int, size: int, owner, device_id: int = -1):
        ptr, size = int(ptr), int(size)
        if device_id < 0 and ptr == 0:
            raise RuntimeError("UnownedMemory requires explicit device ID for a null pointer.")
        found = _block_at(ptr, size) if ptr else None
        if found is not None:
            block, offset = found
        else:
            block = getattr(getattr(owner, "data", owner), "mem", owner)  # an array, a pointer, memory
            offset = ptr - getattr(block, "ptr", 0)
            if not ptr or getattr(block, "_buf", None) is None or not 0 <= offset <= block.size - size:
                raise ValueError(f"cupy stand-in: UnownedMemory at 0x{ptr:x} ({size} bytes) is no device memory here")
        self.ptr, self.size = ptr, size
        self.device_id = block.device_id if device_id < 0 else int(device_id)
        self._owner = owner
        self._buf = block._buf[offset : offset + size]

    @property
    def device(self) -> Device:
        return Device(self.device_id)


class MemoryPointer:
    """A pointer into device memory, as ``cupy.cuda.MemoryPointer``: ``mem`` and ``ptr``.

    As CuPy's: ``p + n`` (or ``n + p``, ``p - n``) is a new pointer that holds the same
    ``mem``. CuPy's ``p += n`` moves ``p`` itself, and so every array whose ``data`` it is;
    the stand-in's arrays cannot follow their pointer: it refuses, naming it."""

    __slots__ = ("mem", "ptr", "device_id")

    def __init__(self, mem, offset: int):
        self.mem = mem
        self.ptr = mem.ptr + offset
        self.device_id = mem.device_id

    @property
    def device(self) -> Device:
        return Device(self.device_id)

    def __int__(self) -> int:
        return self.ptr

    def __add__(self, offset: int) -> MemoryPointer:
        return MemoryPointer(self.mem, self.ptr - self.mem.ptr + int(offset))

    __radd__ = __add__

    def __sub__(self, offset: int) -> MemoryPointer:
        return self + -int(offset)

    def __iadd__(self, offset: int) -> MemoryPointer:
        raise NotImplementedError(
            "cupy stand-in: `p += n` moves the pointer itself in CuPy, and every array whose .data it is "
            "with it; the stand-in's arrays cannot follow: use `p = p + n` (a new pointer)"
        )

    __isub__ = __iadd__

    def __repr__(self) -> str:
        return f"<MemoryPointer 0x{self.ptr:x} on device {self.device_id}>"


def _host_buffer(memptr: MemoryPointer) -> tuple[numpy.ndarray, int]:
    """The host bytes behind a pointer and the pointer's offset in them."""
    return memptr.mem._buf, memptr.ptr - memptr.mem.ptr


# --- pools ----------------------------------------------------------------------------------------

_pools = runtime._pools  # every single-device pool: for pointer lookups, and runtime.memGetInfo


class OutOfMemoryError(MemoryError):
    """CuPy's out-of-memory error: ``size`` asked for, ``total`` allocated so far, the ``limit``."""

    def __init__(self, size, total, limit=0):
        self._size, self._total, self._limit = size, total, limit
        if limit == 0:
            msg = f"Out of memory allocating {size:,} bytes"
            if total != -1:
                msg += f" (allocated so far: {total:,} bytes)."
        else:
            msg = (
                f"Out of memory allocating {size:,} bytes "
                f"(allocated so far: {total:,} bytes, limit set to: {limit:,} bytes)."
            )
        super().__init__(msg)

    def __reduce__(self):
        return (type(self), (self._size, self._total, self._limit))


class SingleDeviceMemoryPool:
    """The pool of one device: rounds, reuses freed blocks of the same size, calls hooks."""

    def __init__(self, device_id: int):
        self._device_id = device_id
        self._lock = threading.RLock()  # a free may run inside a malloc (the GC runs there)
        self._free_blocks: dict[int, list[Memory]] = {}
        self._in_use = 0
        self._total = 0
        self._live: dict[int, weakref.ref] = {}  # ptr -> the PooledMemory handed out
        self._limit = 0  # bytes the pool may hold; 0: no limit
        _pools.add(self)

    def set_limit(self, size=None, fraction=None) -> None:
        """Caps the bytes the pool holds: ``size`` bytes, or ``fraction`` of the device's memory
        (neither: no limit), as CuPy's ``set_limit``."""
        if size is not None and fraction is not None:
            raise ValueError("size and fraction cannot be specified at one time")
        if fraction is not None:
            if not 0 <= fraction <= 1:
                raise ValueError(f"memory limit fraction out of range: {fraction}")
            size = int(fraction * runtime._mem_info(self._device_id)[1])
        if size is not None and size < 0:
            raise ValueError(f"memory limit size out of range: {size}")
        self._limit = int(size or 0)

    def get_limit(self) -> int:
        return self._limit

    def malloc(self, size: int) -> MemoryPointer:
        size = int(size)
        rounded = _round_size(size)
        if rounded and graph._captures:  # during stream capture: see graph.check_allocation
            with self._lock:
                cached = bool(self._free_blocks.get(rounded))
            graph.check_allocation(self._device_id, rounded, not cached, "CuPy's memory pool")
        hooks = _hooks()
        if not hooks:
            return self._malloc(rounded)
        for hook in hooks:
            hook.malloc_preprocess(device_id=self._device_id, size=size, mem_size=rounded)
        memptr = None
        try:
            memptr = self._malloc(rounded)
        finally:
            mem_ptr = memptr.ptr if memptr is not None else 0
            pmem_id = id(memptr.mem) if memptr is not None else 0
            for hook in hooks:
                hook.malloc_postprocess(
                    device_id=self._device_id, size=size, mem_size=rounded, mem_ptr=mem_ptr, pmem_id=pmem_id
                )
        return memptr

    def _malloc(self, rounded: int) -> MemoryPointer:
        if rounded == 0:
            return MemoryPointer(Memory(0, self._device_id), 0)
        with self._lock:
            cached = self._free_blocks.get(rounded)
            mem = cached.pop() if cached else None
        if mem is None:
            mem = self._alloc(rounded)
        pmem = PooledMemory(mem, self)
        with self._lock:
            self._in_use += rounded
            self._live[mem.ptr] = weakref.ref(pmem)
        return MemoryPointer(pmem, 0)

    def _alloc(self, rounded: int) -> Memory:
        if self._limit and self._total + rounded > self._limit:
            self.free_all_blocks()  # CuPy gives the cached blocks back before it gives up
            if self._total + rounded > self._limit:
                raise OutOfMemoryError(rounded, self._total, self._limit)
        hooks = _hooks()
        for hook in hooks:
            hook.alloc_preprocess(device_id=self._device_id, mem_size=rounded)
        mem = None
        try:
            mem = Memory(rounded, self._device_id)
        finally:
            for hook in hooks:
                hook.alloc_postprocess(
                    device_id=self._device_id, mem_size=rounded, mem_ptr=mem.ptr if mem is not None else 0
                )
        with self._lock:
            self._total += rounded
        return mem

    def _free(self, ptr: int, mem: Memory) -> None:
        with self._lock:
            self._live.pop(ptr, None)
            self._in_use -= mem.size
            self._free_blocks.setdefault(mem.size, []).append(mem)

    def used_bytes(self) -> int:
        return self._in_use

    def total_bytes(self) -> int:
        return self._total

    def free_bytes(self) -> int:
        return self._total - self._in_use

    def n_free_blocks(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._free_blocks.values())

    def free_all_blocks(self, stream=None) -> None:
        """Gives the cached (unused) blocks back to the "device"."""
        with self._lock:
            freed = sum(mem.size for mems in self._free_blocks.values() for mem in mems)
            self._free_blocks.clear()
            self._total -= freed


class MemoryPool:
    """Pools for all devices, as ``cupy.cuda.MemoryPool``; queries are for the current device."""

    def __init__(self, allocator=None):
        self._device_pools: dict[int, SingleDeviceMemoryPool] = {}
        self._lock = threading.Lock()

    def _device_pool(self) -> SingleDeviceMemoryPool:
        device_id = runtime.getDevice()
        pool = self._device_pools.get(device_id)
        if pool is None:
            with self._lock:
                pool = self._device_pools.setdefault(device_id, SingleDeviceMemoryPool(device_id))
        return pool

    def malloc(self, size: int) -> MemoryPointer:
        return self._device_pool().malloc(size)

    def used_bytes(self) -> int:
        return self._device_pool().used_bytes()

    def total_bytes(self) -> int:
        return self._device_pool().total_bytes()

    def free_bytes(self) -> int:
        return self._device_pool().free_bytes()

    def n_free_blocks(self) -> int:
        return self._device_pool().n_free_blocks()

    def free_all_blocks(self, stream=None) -> None:
        self._device_pool().free_all_blocks(stream)

    def set_limit(self, size=None, fraction=None) -> None:
        self._device_pool().set_limit(size, fraction)

    def get_limit(self) -> int:
        return self._device_pool().get_limit()


def _malloc(size: int) -> MemoryPointer:
    """The raw allocator (no pool, no hooks): what ``set_allocator(None)`` selects."""
    if size and graph._captures:  # cudaMalloc during stream capture: see graph.check_allocation
        graph.check_allocation(runtime.getDevice(), int(size), True, "a raw allocation (cudaMalloc)")
    return MemoryPointer(Memory(int(size)), 0)


_default_pool = MemoryPool()
_current_allocator = _default_pool.malloc
_thread_local = threading.local()  # .allocator: the calling thread's (cupy.cuda.using_allocator)


def _get_thread_local_allocator():
    return getattr(_thread_local, "allocator", None)


def _set_thread_local_allocator(allocator) -> None:
    _thread_local.allocator = allocator


def alloc(size: int) -> MemoryPointer:
    """Allocates ``size`` bytes on the current device with the current allocator."""
    return get_allocator()(size)


def get_allocator():
    """The calling thread's allocator (``using_allocator``), else the process-wide one."""
    allocator = getattr(_thread_local, "allocator", None)
    return _current_allocator if allocator is None else allocator


def set_allocator(allocator=None) -> None:
    """Sets the process-wide allocator (``None``: raw allocations, no pool, as in CuPy);
    refused inside a ``using_allocator`` block, with CuPy's ValueError."""
    global _current_allocator
    if allocator is None:
        allocator = _malloc
    if getattr(_thread_local, "allocator", None) is not None:
        raise ValueError("Can't change the global allocator inside `using_allocator` context manager")
    _current_allocator = allocator


def _block_at(ptr: int, nbytes: int):
    """The live pool block holding ``[ptr, ptr + nbytes)``: ``(PooledMemory, offset)``, or None."""
    for pool in list(_pools):
        with pool._lock:
            refs = list(pool._live.values())
        for ref in refs:
            pmem = ref()
            if pmem is not None and pmem.ptr and pmem.ptr <= ptr and ptr + nbytes <= pmem.ptr + pmem.size:
                return pmem, ptr - pmem.ptr
    return None
