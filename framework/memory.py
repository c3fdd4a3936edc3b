"""Honest allocation accounting: live bytes, peak, a timeline, and a breakdown by category.

On the CPU the counter follows array *buffers*, not tensors: every array that backs a
tensor, a gradient, a saved-for-backward value or an op workspace is registered here by
its root buffer (the array that owns the memory). A weak reference with a callback
uncounts the buffer at the moment NumPy frees it, so views, ``detach()`` and ``.data``
never count memory twice, and memory kept alive by any holder stays counted. A test
holds this counter against ``tracemalloc``'s NumPy domain.

On a GPU, two instruments work side by side (see :func:`enable_gpu_hook`):

- the TOTAL and its PEAK come from a hook on CuPy's memory pool, which sees every
  ``malloc`` and ``free`` of the pool, tracked or not (temporaries inside a CuPy
  expression included). It counts the pool's sizes, which CuPy rounds up to multiples
  of 512 bytes, so it equals ``MemoryPool.used_bytes()``;
- the BREAKDOWN by category counts tracked CuPy arrays exactly as NumPy ones: by root
  buffer, at ``nbytes`` (the array's own size, not rounded up). The categories therefore
  sum to a little less than the hook's total: the rounding, plus pool allocations the
  framework never registers (temporaries inside a CuPy expression or routine, such
  as a contiguous copy made for a matmul).

Host (NumPy) and GPU (CuPy) buffers are counted apart: ``breakdown("cpu")`` and
``breakdown("cuda")``; queries without a device report the GPU while the hook is on.

Categories describe why a buffer exists: ``parameters``, ``gradients``,
``optimizer_state``, ``activations`` (op outputs in the forward pass), ``workspace``
(op temporaries such as im2col buffers), ``inplace_copies`` (inputs an inplace op had
to copy because its backward needs them: memory inplace did NOT save), ``other``.
Separately, :func:`saved_bytes` counts the distinct buffers that autograd nodes hold
for backward, which is the activation part of a training step's memory floor.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import warnings
import weakref
from collections import Counter

import numpy as np

from . import backend

CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer_state",
    "activations",
    "workspace",
    "inplace_copies",
    "other",
)

_allocated = 0
_peak = 0
# Plain dicts with every category present: the hot path is a dict lookup, and a name
# outside CATEGORIES is caught instead of silently starting a category breakdown() omits.
_by_category: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
_peak_by_category: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
# The same per category for CuPy arrays (nbytes; the pool hook has the rounded total).
_gpu_by_category: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
_gpu_peak_by_category: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
_live: dict[int, _BufferRef] = {}  # id(root buffer) -> its weak reference (host and GPU)
_saved_refcount: dict[int, int] = {}  # id(root buffer) -> saved tensors holding it
_saved_size: dict[int, int] = {}  # id(root buffer) -> its bytes, while saved
_saved_bytes = 0
_default_category: list = [None]
_timelines: list[Timeline] = []
_stats: Counter = Counter()
# Counters a hot path adds to directly (framework.inplace.count_owned, once per backward
# op under policy auto): a plain dict updates about twice as fast as the Counter.
# stats() adds them in; reset_stats() clears both.
_plain_stats: dict[str, int] = {}
_gpu_counter: PoolCounter | None = None  # set while a GPU pool hook is registered
_hook_local = threading.local()  # .hook: the hook this thread registered with CuPy
_hook_threads = 0  # threads with a registered hook


class _BufferRef(weakref.ref):
    """Weak reference to a root buffer that remembers what it counted."""

    __slots__ = ("key", "nbytes", "category", "gpu")


def _on_free(ref: _BufferRef) -> None:
    global _allocated
    if _live.pop(ref.key, None) is None:
        return
    nbytes = ref.nbytes
    if ref.gpu:  # the pool hook records the free itself (total, peak, timeline)
        _gpu_by_category[ref.category] -= nbytes
        return
    _allocated -= nbytes
    _by_category[ref.category] -= nbytes
    if _timelines:
        _record_event("cpu", _allocated, -nbytes, ref.category)


def _bad_category(name) -> ValueError:
    return ValueError(f"unknown memory category {name!r}; use one of {', '.join(CATEGORIES)}")


def root_buffer(array):
    """The array that owns ``array``'s memory (``array`` itself when it owns it).

    Follows ``.base`` through NumPy and CuPy views, and through the ``DummyArray``
    wrappers that ``as_strided`` / ``sliding_window_view`` put between a window view
    and its array (otherwise an im2col view would count at its logical size).
    """
    root, base = array, array.base
    while base is not None:
        if hasattr(base, "shape"):
            root = base
        base = getattr(base, "base", None)
    return root


def track(array, category: str | None = None, fallback: str = "other"):
    """Counts ``array``'s buffer as allocated until NumPy frees it; returns ``array``.

    The category is ``category``, else the one set by :func:`category` around the call,
    else ``fallback``. Idempotent: a buffer is counted once however many arrays view it.
    CuPy arrays are counted the same way in the GPU breakdown (``breakdown("cuda")``);
    the GPU total and peak come from the pool hook (:func:`enable_gpu_hook`).

    Raises:
        ValueError: the category is not one of :data:`CATEGORIES`.
    """
    global _allocated, _peak
    if category is not None and category not in _by_category:
        raise _bad_category(category)
    if not isinstance(array, np.ndarray):
        return _track_gpu(array, category, fallback)
    # This runs for every op output and every gradient: keep the common case short.
    root = array if array.base is None else root_buffer(array)
    key = id(root)
    if key in _live:
        return array
    nbytes = root.nbytes
    if not nbytes:
        return array
    cat = _register(root, key, nbytes, category or _default_category[-1] or fallback, False)
    total = _allocated + nbytes
    _allocated = total
    if total > _peak:
        _peak = total
    if _timelines:
        _record_event("cpu", total, nbytes, cat)
    return array


def _gpu_array_type():
    """``cupy.ndarray`` once the backend has imported CuPy, else None (no import here)."""
    cp = backend._cupy
    return cp.ndarray if cp else None


def _track_gpu(array, category, fallback):
    """:func:`track` for a CuPy array: counted in the GPU breakdown, by root buffer."""
    gpu_type = _gpu_array_type()
    if gpu_type is None or not isinstance(array, gpu_type):
        return array  # a Python scalar or another array type: nothing to count
    root = root_buffer(array)
    key = id(root)
    if key in _live:
        return array
    nbytes = root.nbytes
    # CuPy's as_strided gives a view without .base (e.g. conv windows): never count such a
    # view beyond the allocation it lives in.
    mem = getattr(getattr(root, "data", None), "mem", None)
    size = getattr(mem, "size", None)
    if size is not None and 0 < size < nbytes:
        nbytes = size
    if not nbytes:
        return array
    _register(root, key, nbytes, category or _default_category[-1] or fallback, True)
    return array


def _register(root, key: int, nbytes: int, cat: str, gpu: bool) -> str:
    """Starts counting buffer ``root`` in category ``cat`` (host or GPU breakdown); returns ``cat``."""
    counts, peaks = (_gpu_by_category, _gpu_peak_by_category) if gpu else (_by_category, _peak_by_category)
    if cat not in counts:
        raise _bad_category(cat)  # a bad fallback (the block's name was checked on entry)
    # Creating the weakref may run the cyclic GC, which may free other buffers and run
    # _on_free: read the counters only after it, so no decrement is overwritten.
    ref = _BufferRef(root, _on_free)
    ref.key = key
    ref.nbytes = nbytes
    ref.category = cat
    ref.gpu = gpu
    _live[key] = ref
    in_cat = counts[cat] + nbytes
    counts[cat] = in_cat
    if in_cat > peaks[cat]:
        peaks[cat] = in_cat
    return cat


def retag(array, category: str) -> None:
    """Moves ``array``'s buffer to another category (e.g. a tensor becoming a Parameter)."""
    if category not in _by_category:
        raise _bad_category(category)
    if not hasattr(array, "shape"):
        return
    track(array, category)
    ref = _live.get(id(root_buffer(array)))
    if ref is None or ref.category == category:
        return
    counts, peaks = (_gpu_by_category, _gpu_peak_by_category) if ref.gpu else (_by_category, _peak_by_category)
    counts[ref.category] -= ref.nbytes
    ref.category = category
    counts[category] += ref.nbytes
    if counts[category] > peaks[category]:
        peaks[category] = counts[category]


def is_tracked(array) -> bool:
    """Whether ``array``'s buffer is counted (NumPy or CuPy)."""
    return hasattr(array, "shape") and id(root_buffer(array)) in _live


def category_of(array) -> str | None:
    """The category ``array``'s buffer is counted in, or None for a buffer not counted."""
    ref = _live.get(id(root_buffer(array))) if hasattr(array, "shape") else None
    return None if ref is None else ref.category


# --- allocation helpers: ops allocate through these so workspaces are counted -------


def empty(shape, dtype, xp=np, category: str | None = None):
    """``xp.empty`` whose buffer is counted (category defaults to the current one)."""
    return track(xp.empty(shape, dtype=dtype), category)


def zeros(shape, dtype, xp=np, category: str | None = None):
    return track(xp.zeros(shape, dtype=dtype), category)


def empty_like(array, category: str | None = None):
    xp = np if isinstance(array, np.ndarray) else _xp_of(array)
    return track(xp.empty(array.shape, dtype=array.dtype), category)


def zeros_like(array, category: str | None = None):
    xp = np if isinstance(array, np.ndarray) else _xp_of(array)
    return track(xp.zeros(array.shape, dtype=array.dtype), category)


def _xp_of(array):
    return backend.get_array_module(array)


# --- layouts (PyTorch's preserve_format and gradient layout contract) -----------------


def is_dense(array) -> bool:
    """Whether ``array``'s elements fill one block of memory without gaps or overlaps in
    some order of its dims (PyTorch's ``is_non_overlapping_and_dense``); dims of size 1
    do not count, and an empty array is dense. A transposed or permuted array is dense; a
    strided slice is not."""
    if array.size == 0:
        return True
    dims = sorted((d for d in range(array.ndim) if array.shape[d] != 1), key=lambda d: -array.strides[d])
    expected = array.itemsize
    for d in reversed(dims):
        if array.strides[d] != expected:
            return False
        expected *= array.shape[d]
    return True


def layout_order(array) -> str:
    """The ``order`` (of ``copy``, ``empty_like``) that lays a new array out as PyTorch's
    ``preserve_format`` does: ``"K"`` (``array``'s own strides) for a dense array, else
    ``"C"`` (contiguous)."""
    if array.flags.c_contiguous:
        return "C"
    return "K" if is_dense(array) else "C"


def dense_order(array) -> tuple | None:
    """The dims of ``array`` from the largest stride to the smallest (the order its elements
    lie in memory) when it is dense but not C-contiguous, else None (C order does). What
    lays out a new array as ``array``: :func:`empty_in_order`."""
    if array.flags.c_contiguous or not is_dense(array):
        return None
    return tuple(sorted(range(array.ndim), key=lambda d: -array.strides[d]))


def inverse_order(order: tuple) -> tuple:
    """The permutation that undoes ``order`` (``a.transpose(order).transpose(inverse)`` is ``a``)."""
    inverse = [0] * len(order)
    for i, d in enumerate(order):
        inverse[d] = i
    return tuple(inverse)


def empty_in_order(shape, dtype, xp=np, order: tuple | None = None, category: str | None = None):
    """A counted, uninitialized array of ``shape`` whose elements lie in memory in ``order``
    (:func:`dense_order`; None: C order)."""
    if order is None:
        return empty(shape, dtype, xp, category)
    inner = empty(tuple(shape[d] for d in order), dtype, xp, category)
    return inner.transpose(inverse_order(order))


def obeys_layout(grad, variable) -> bool:
    """PyTorch's gradient layout contract (``obeys_layout_contract``): ``grad`` has
    ``variable``'s strides (dims of size 1 aside) where ``variable`` is dense, else it is
    contiguous."""
    if grad.flags.c_contiguous and variable.flags.c_contiguous:
        return True
    if not is_dense(variable):
        return bool(grad.flags.c_contiguous)
    for n, gs, vs in zip(grad.shape, grad.strides, variable.strides):
        if (gs != vs) if n != 1 else (gs == 0):
            return False
    return True


def empty_layout(variable, dtype=None, category: str | None = None):
    """A counted, uninitialized array of ``variable``'s shape laid out as PyTorch lays out a
    gradient for it: ``variable``'s strides where it is dense, else contiguous."""
    xp = np if isinstance(variable, np.ndarray) else _xp_of(variable)
    return track(xp.empty_like(variable, dtype=dtype, order=layout_order(variable)), category)


def copy_to_layout(grad, variable, category: str | None = None):
    """A counted copy of ``grad`` laid out as ``variable`` (``clone_obey_contract``)."""
    out = empty_layout(variable, grad.dtype, category)
    (np if isinstance(grad, np.ndarray) else _xp_of(grad)).copyto(out, grad)
    return out


@contextlib.contextmanager
def category(name: str):
    """Buffers allocated inside the block default to category ``name``."""
    if name not in _by_category:
        raise _bad_category(name)
    _default_category.append(name)
    try:
        yield
    finally:
        _default_category.pop()


# --- saved-for-backward accounting ----------------------------------------------------


def _root_or_none(array):
    """The buffer that owns ``array``'s memory, or None for a Python scalar."""
    if array.__class__ is np.ndarray and array.base is None:
        return array  # the common case, first
    return root_buffer(array) if hasattr(array, "shape") else None


def note_saved(array) -> None:
    """An autograd node now holds ``array`` for backward (any device)."""
    global _saved_bytes
    root = _root_or_none(array)
    if root is None:
        return  # a Python scalar operand
    key = id(root)
    if key not in _live:
        track(root, "activations")
    n = _saved_refcount.get(key)
    if n is None:
        _saved_size[key] = root.nbytes
        _saved_bytes += root.nbytes
        _saved_refcount[key] = 1
    else:
        _saved_refcount[key] = n + 1


def note_released(array) -> None:
    """An autograd node no longer holds ``array`` (backward ran, or the graph died)."""
    global _saved_bytes
    root = _root_or_none(array)
    if root is None:
        return
    key = id(root)
    n = _saved_refcount.get(key, 0) - 1
    if n <= 0:
        _saved_refcount.pop(key, None)
        _saved_bytes -= _saved_size.pop(key, 0)
    else:
        _saved_refcount[key] = n


def saved_refcount(array) -> int:
    """How many saved-for-backward references point at ``array``'s buffer."""
    return _saved_refcount.get(id(root_buffer(array)), 0) if hasattr(array, "shape") else 0


def saved_bytes(parameters: bool = True) -> int:
    """Bytes of the distinct buffers that autograd currently holds for backward.

    With ``parameters=False``, buffers of category ``parameters`` (the weights that
    linear, conv and BN nodes hold) are left out: that is the activation part of a
    step's floor, whose parameters are counted once, as parameters.
    """
    if parameters:
        return max(_saved_bytes, 0)
    total = 0
    for key, nbytes in _saved_size.items():
        ref = _live.get(key)
        if ref is None or ref.category != "parameters":
            total += nbytes
    return total


# --- queries ------------------------------------------------------------------------


def _kind(device) -> str:
    """``"cpu"`` or ``"cuda"`` for a device (``Device``, ``"cuda:1"``, ...); None: the GPU
    while a pool hook is registered, else the host."""
    if device is None:
        return "cuda" if _gpu_counter is not None else "cpu"
    return backend.parse_device(device).type


def _counter_for(device) -> PoolCounter | None:
    """The GPU pool counter when ``device`` means the GPU (error if no hook counts it)."""
    if _kind(device) == "cpu":
        return None
    if _gpu_counter is None:
        raise RuntimeError(
            "GPU memory is counted by a CuPy pool hook: call framework.memory.enable_gpu_hook() "
            "before allocating on the GPU (the trainer does this for device: cuda)"
        )
    return _gpu_counter


def allocated_bytes(device=None) -> int:
    """Bytes of live buffers: NumPy buffers on ``"cpu"``, CuPy pool bytes on ``"cuda"``.

    Without ``device``: the GPU while the pool hook is on (:func:`enable_gpu_hook`), else
    the host.
    """
    counter = _counter_for(device)
    return _allocated if counter is None else counter.allocated


def max_allocated_bytes(device=None) -> int:
    """High-water mark of :func:`allocated_bytes` since the last :func:`reset_peak`."""
    counter = _counter_for(device)
    return _peak if counter is None else counter.peak


def reset_peak() -> None:
    """Starts a new peak measurement from the current allocation (host and GPU)."""
    global _peak
    _peak = _allocated
    _peak_by_category.update(_by_category)
    _gpu_peak_by_category.update(_gpu_by_category)
    if _gpu_counter is not None:
        _gpu_counter.reset_peak()


def breakdown(device=None) -> dict[str, int]:
    """Live bytes per category (every category present, zeros included).

    ``"cpu"``: NumPy buffers; ``"cuda"``: CuPy buffers at their ``nbytes`` (the pool
    hook's total is rounded up and also holds untracked temporaries, so it is a little
    larger than the sum). Without ``device``: the GPU while the pool hook is on.
    """
    return dict(_gpu_by_category if _kind(device) == "cuda" else _by_category)


def peak_breakdown(device=None) -> dict[str, int]:
    """Per-category high-water marks since the last :func:`reset_peak`."""
    return dict(_gpu_peak_by_category if _kind(device) == "cuda" else _peak_by_category)


def stats() -> dict[str, int]:
    """Event counters: inplace ops run, bytes copied for inplace backward, ...

    ``auto_inplace_ops`` is the total of the ``auto_inplace_ops.<op or site>`` counters.
    """
    out = dict(_stats)
    for key, value in _plain_stats.items():
        out[key] = out.get(key, 0) + value
    total = sum(v for k, v in out.items() if k.startswith("auto_inplace_ops."))
    if total:
        out["auto_inplace_ops"] = total
    return out


def count(event: str, n: int = 1) -> None:
    """Adds ``n`` to the event counter ``event`` (see :func:`stats`)."""
    _stats[event] += n


def reset_stats() -> None:
    _stats.clear()
    _plain_stats.clear()


# --- timeline -----------------------------------------------------------------------


class Timeline:
    """Allocation events recorded inside :func:`record_timeline`.

    ``events`` is a list of ``(seconds since start, allocated bytes after the event,
    delta bytes, category, phase)``; ``phase`` is whatever :func:`mark` last set
    (``forward``, ``backward``, ``optimizer``, ...). ``device`` is ``"cpu"`` (NumPy
    buffers, as tracked) or ``"cuda"`` (every ``malloc``/``free`` of CuPy's pool, as the
    pool hook sees them; the category is the :func:`category` block around it, else
    ``other``).
    """

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.start = time.perf_counter()
        self.events: list[tuple[float, int, int, str, str]] = []
        self.phase = ""
        self.marks: list[tuple[float, str]] = []

    @property
    def peak(self) -> int:
        if self.events:
            return max(e[1] for e in self.events)
        return _gpu_counter.allocated if self.device == "cuda" and _gpu_counter is not None else _allocated


def _record_event(device: str, allocated: int, delta: int, cat: str) -> None:
    now = time.perf_counter()
    for tl in _timelines:
        if tl.device == device:
            tl.events.append((now - tl.start, allocated, delta, cat, tl.phase))


def mark(phase: str) -> None:
    """Names the phase that the following timeline events belong to."""
    now = time.perf_counter()
    for tl in _timelines:
        tl.phase = phase
        tl.marks.append((now - tl.start, phase))


@contextlib.contextmanager
def record_timeline(device=None):
    """Records every allocation and free inside the block: ``with record_timeline() as tl``.

    ``device`` as in :func:`allocated_bytes`: the host's tracked buffers, or the GPU
    pool (needs the pool hook); without it, the GPU while the pool hook is on.
    """
    kind = _kind(device)
    tl = Timeline(kind)
    tl.events.append((0.0, allocated_bytes(kind), 0, "other", ""))
    _timelines.append(tl)
    try:
        yield tl
    finally:
        _timelines.remove(tl)


# --- GPU ------------------------------------------------------------------------------


class PoolCounter:
    """Exact bytes in use in a GPU memory pool, fed by the pool's ``malloc``/``free`` callbacks.

    Plain bookkeeping (no CuPy here, so it is tested without a GPU): :func:`enable_gpu_hook`
    registers a CuPy ``MemoryHook`` whose ``malloc_postprocess``/``free_postprocess`` call
    :meth:`malloc` and :meth:`free` with CuPy's ``mem_size`` (the request rounded up to
    512 bytes, the size the pool hands out) and ``mem_ptr``.

    Sizes are remembered per pointer, so a free is subtracted with the size that was
    added, whatever thread frees it. A free of a pointer the counter never saw (memory
    allocated before the hook, which ``baseline`` holds) comes out of the baseline. A
    failed ``malloc`` (``mem_ptr`` 0) counts nothing. Callbacks may come from several
    threads (a lock guards the state) and may nest (a malloc whose Python allocation runs
    the garbage collector, which frees CuPy arrays): the lock is re-entrant.

    Attributes:
        allocated: bytes in use now (``MemoryPool.used_bytes()`` of a single-device,
            single-threaded run).
        peak: high-water mark of ``allocated`` since the last :meth:`reset_peak`.
        baseline: bytes in use before counting started that are not yet freed.
        mallocs, frees, unknown_frees: event counts (``unknown_frees``: frees of
            pointers this counter never saw).
    """

    def __init__(self, baseline: int = 0):
        if baseline < 0:
            raise ValueError(f"baseline must be >= 0 bytes, got {baseline}")
        self._lock = threading.RLock()
        self._sizes: dict[int, int] = {}  # pointer -> bytes (CUDA pointers are unique per process)
        self.baseline = int(baseline)
        self.allocated = int(baseline)
        self.peak = int(baseline)
        self.mallocs = self.frees = self.unknown_frees = 0

    def malloc(self, mem_size: int, mem_ptr: int) -> int:
        """Counts a block handed out by the pool; returns the change in bytes."""
        if not mem_ptr or mem_size <= 0:
            return 0  # malloc failed (CuPy passes pointer 0) or a zero-size array
        with self._lock:
            stale = self._sizes.get(mem_ptr)
            delta = mem_size - (stale or 0)  # reused without our seeing its free: replace it
            self._sizes[mem_ptr] = mem_size
            self.allocated += delta
            if self.allocated > self.peak:
                self.peak = self.allocated
            self.mallocs += 1
            return delta

    def free(self, mem_size: int, mem_ptr: int) -> int:
        """Uncounts a block returned to the pool; returns the change in bytes (<= 0)."""
        if not mem_ptr:
            return 0
        with self._lock:
            size = self._sizes.pop(mem_ptr, None)
            if size is None:
                self.unknown_frees += 1
                size = min(mem_size, self.baseline)
                self.baseline -= size
            self.allocated -= size
            self.frees += 1
            return -size

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.allocated

    def live_blocks(self) -> int:
        """Blocks counted and not yet freed."""
        return len(self._sizes)


def _hook_event(delta: int) -> None:
    if delta and _timelines and _gpu_counter is not None:
        _record_event("cuda", _gpu_counter.allocated, delta, _default_category[-1] or "other")


@functools.cache
def pool_hook_class(base):
    """The pool hook as a subclass of ``base`` (``cupy.cuda.MemoryHook``).

    CuPy calls the hook methods with keyword arguments only (``device_id``, ``size``,
    ``mem_size``, ``mem_ptr``, ``pmem_id``); ``name`` is the key of the hook in CuPy's
    thread-local hook table. Built from a parameter so tests can build it on a stand-in
    base class without CuPy.
    """

    class PoolHook(base):
        name = "inplace_lab_memory"

        def __init__(self, counter: PoolCounter):
            self.counter = counter

        def malloc_postprocess(self, *, mem_size, mem_ptr, **_):
            _hook_event(self.counter.malloc(mem_size, mem_ptr))

        def free_postprocess(self, *, mem_size, mem_ptr, **_):
            _hook_event(self.counter.free(mem_size, mem_ptr))

    return PoolHook


def _pool_in_use(cp) -> int:
    """Bytes CuPy's current allocator has in use on the current device (0 if unknown)."""
    pool = getattr(cp.cuda.get_allocator(), "__self__", None)
    if not isinstance(pool, cp.cuda.MemoryPool):
        warnings.warn(
            "CuPy's allocator is not a cupy.cuda.MemoryPool (set_allocator was changed, or "
            "MemoryAsyncPool is in use): memory hooks see no allocations, so GPU memory reads "
            "as 0. Use the default pool to measure GPU memory.",
            RuntimeWarning,
            stacklevel=3,
        )
        return 0
    return int(pool.used_bytes())


def enable_gpu_hook() -> PoolCounter:
    """Counts GPU memory exactly: every ``malloc``/``free`` of CuPy's memory pool.

    Registers a ``cupy.cuda.MemoryHook`` for the CALLING THREAD (CuPy keeps hooks in a
    thread-local table: allocations in other threads are not seen until those threads
    call this too; all threads feed one :class:`PoolCounter`). Idempotent per thread.
    Call it after choosing the device and before allocating: memory already in use on
    the current device (``MemoryPool.used_bytes()``) starts the count as its baseline.

    While a hook is registered, :func:`allocated_bytes`, :func:`max_allocated_bytes`,
    :func:`breakdown` and :func:`record_timeline` without a device report the GPU. Only
    CuPy's pool is seen: device memory allocated around it (the CUDA context, whatever
    a CUDA library allocates for itself) is not counted.

    Returns:
        The shared :class:`PoolCounter` (``.allocated``, ``.peak``).

    Raises:
        RuntimeError: CuPy is not installed or sees no GPU.
    """
    global _gpu_counter, _hook_threads
    cp = backend.cupy_module()
    if cp is None:
        raise RuntimeError(
            "the GPU memory hook needs CuPy and a CUDA device: install the GPU extra "
            "(pip install -e '.[gpu]') on a machine with CUDA"
        )
    if getattr(_hook_local, "hook", None) is not None:
        return _gpu_counter
    if _gpu_counter is None:
        _gpu_counter = PoolCounter(baseline=_pool_in_use(cp))
        _gpu_peak_by_category.update(_gpu_by_category)
    hook = pool_hook_class(cp.cuda.MemoryHook)(_gpu_counter)
    hook.__enter__()
    _hook_local.hook = hook
    _hook_threads += 1
    return _gpu_counter


def disable_gpu_hook() -> None:
    """Unregisters the calling thread's hook; when no thread has one, queries report the host again."""
    global _gpu_counter, _hook_threads
    hook = getattr(_hook_local, "hook", None)
    if hook is None:
        return
    hook.__exit__(None, None, None)
    _hook_local.hook = None
    _hook_threads -= 1
    if _hook_threads <= 0:
        _hook_threads = 0
        _gpu_counter = None


def gpu_counter() -> PoolCounter | None:
    """The GPU pool counter while a hook is registered (in any thread), else None."""
    return _gpu_counter


def gpu_hook_enabled() -> bool:
    """Whether the calling thread has registered the pool hook."""
    return getattr(_hook_local, "hook", None) is not None


@contextlib.contextmanager
def gpu_hook():
    """``with gpu_hook() as counter:`` the pool hook for the block (kept if it was already on)."""
    was_on = gpu_hook_enabled()
    counter = enable_gpu_hook()
    try:
        yield counter
    finally:
        if not was_on:
            disable_gpu_hook()
