"""Honest allocation accounting: live bytes, peak, a timeline, and a breakdown by category.

On the CPU the counter follows array *buffers*, not tensors: every array that backs a
tensor, a gradient, a saved-for-backward value or an op workspace is registered here by
its root buffer (the array that owns the memory). A weak reference with a callback
uncounts the buffer at the moment NumPy frees it, so views, ``detach()`` and ``.data``
never count memory twice, and memory kept alive by any holder stays counted. A test
holds this counter against ``tracemalloc``'s NumPy domain.

On a GPU, a CuPy memory hook on the pool counts every ``malloc`` and ``free`` instead
(see :func:`enable_gpu_hook`).

Categories describe why a buffer exists: ``parameters``, ``gradients``,
``optimizer_state``, ``activations`` (op outputs in the forward pass), ``workspace``
(op temporaries such as im2col buffers), ``inplace_copies`` (inputs an inplace op had
to copy because its backward needs them: memory inplace did NOT save), ``other``.
Separately, :func:`saved_bytes` counts the distinct buffers that autograd nodes hold
for backward, which is the activation part of a training step's memory floor.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import Counter

import numpy as np

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
_live: dict[int, "_BufferRef"] = {}  # id(root buffer) -> its weak reference
_saved_refcount: dict[int, int] = {}  # id(root buffer) -> saved tensors holding it
_saved_size: dict[int, int] = {}  # id(root buffer) -> its bytes, while saved
_saved_bytes = 0
_default_category: list = [None]
_timelines: list["Timeline"] = []
_stats: Counter = Counter()
_gpu_hook = None


class _BufferRef(weakref.ref):
    """Weak reference to a root buffer that remembers what it counted."""

    __slots__ = ("key", "nbytes", "category")


def _on_free(ref: _BufferRef) -> None:
    global _allocated
    if _live.pop(ref.key, None) is None:
        return
    nbytes = ref.nbytes
    _allocated -= nbytes
    _by_category[ref.category] -= nbytes
    if _timelines:
        _record_event(-nbytes, ref.category)


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
    Arrays that are not NumPy arrays (CuPy) are counted by the GPU pool hook instead.

    Raises:
        ValueError: the category is not one of :data:`CATEGORIES`.
    """
    global _allocated, _peak
    if category is not None and category not in _by_category:
        raise _bad_category(category)
    if not isinstance(array, np.ndarray):
        return array
    # This runs for every op output and every gradient: keep the common case short.
    root = array if array.base is None else root_buffer(array)
    key = id(root)
    if key in _live:
        return array
    nbytes = root.nbytes
    if not nbytes:
        return array
    cat = category or _default_category[-1] or fallback
    if cat not in _by_category:
        raise _bad_category(cat)  # a bad fallback (the block's name was checked on entry)
    # Creating the weakref may run the cyclic GC, which may free other buffers and run
    # _on_free: read the counters only after it, so no decrement is overwritten.
    ref = _BufferRef(root, _on_free)
    ref.key = key
    ref.nbytes = nbytes
    ref.category = cat
    _live[key] = ref
    in_cat = _by_category[cat] + nbytes
    _by_category[cat] = in_cat
    if in_cat > _peak_by_category[cat]:
        _peak_by_category[cat] = in_cat
    total = _allocated + nbytes
    _allocated = total
    if total > _peak:
        _peak = total
    if _timelines:
        _record_event(nbytes, cat)
    return array


def retag(array, category: str) -> None:
    """Moves ``array``'s buffer to another category (e.g. a tensor becoming a Parameter)."""
    if category not in _by_category:
        raise _bad_category(category)
    if not isinstance(array, np.ndarray):
        return
    track(array, category)
    ref = _live.get(id(root_buffer(array)))
    if ref is None or ref.category == category:
        return
    _by_category[ref.category] -= ref.nbytes
    ref.category = category
    _by_category[category] += ref.nbytes
    if _by_category[category] > _peak_by_category[category]:
        _peak_by_category[category] = _by_category[category]


def is_tracked(array) -> bool:
    return isinstance(array, np.ndarray) and id(root_buffer(array)) in _live


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
    from .backend import get_array_module  # noqa: PLC0415

    return get_array_module(array)


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

def note_saved(array) -> None:
    """An autograd node now holds ``array`` for backward (any device)."""
    global _saved_bytes
    if not hasattr(array, "shape"):
        return  # a Python scalar operand
    track(array, "activations")
    root = root_buffer(array)
    key = id(root)
    if key not in _saved_refcount:
        _saved_size[key] = root.nbytes
        _saved_bytes += root.nbytes
    _saved_refcount[key] = _saved_refcount.get(key, 0) + 1


def note_released(array) -> None:
    """An autograd node no longer holds ``array`` (backward ran, or the graph died)."""
    global _saved_bytes
    if not hasattr(array, "shape"):
        return
    key = id(root_buffer(array))
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

def allocated_bytes() -> int:
    """Bytes of live buffers (GPU pool bytes when the GPU hook is on)."""
    return _gpu_hook.allocated if _gpu_hook is not None and _gpu_hook.active else _allocated


def max_allocated_bytes() -> int:
    """High-water mark of :func:`allocated_bytes` since the last :func:`reset_peak`."""
    return _gpu_hook.peak if _gpu_hook is not None and _gpu_hook.active else _peak


def reset_peak() -> None:
    """Starts a new peak measurement from the current allocation."""
    global _peak
    _peak = _allocated
    _peak_by_category.update(_by_category)
    if _gpu_hook is not None:
        _gpu_hook.peak = _gpu_hook.allocated


def breakdown() -> dict[str, int]:
    """Live bytes per category (every category present, zeros included)."""
    return dict(_by_category)


def peak_breakdown() -> dict[str, int]:
    """Per-category high-water marks since the last :func:`reset_peak`."""
    return dict(_peak_by_category)


def stats() -> dict[str, int]:
    """Event counters: inplace ops run, bytes copied for inplace backward, ..."""
    return dict(_stats)


def count(event: str, n: int = 1) -> None:
    """Adds ``n`` to the event counter ``event`` (see :func:`stats`)."""
    _stats[event] += n


def reset_stats() -> None:
    _stats.clear()


# --- timeline -----------------------------------------------------------------------

class Timeline:
    """Allocation events recorded inside :func:`record_timeline`.

    ``events`` is a list of ``(seconds since start, allocated bytes after the event,
    delta bytes, category, phase)``; ``phase`` is whatever :func:`mark` last set
    (``forward``, ``backward``, ``optimizer``, ...).
    """

    def __init__(self):
        self.start = time.perf_counter()
        self.events: list[tuple[float, int, int, str, str]] = []
        self.phase = ""
        self.marks: list[tuple[float, str]] = []

    @property
    def peak(self) -> int:
        return max((e[1] for e in self.events), default=_allocated)


def _record_event(delta: int, cat: str) -> None:
    now = time.perf_counter()
    for tl in _timelines:
        tl.events.append((now - tl.start, _allocated, delta, cat, tl.phase))


def mark(phase: str) -> None:
    """Names the phase that the following timeline events belong to."""
    now = time.perf_counter()
    for tl in _timelines:
        tl.phase = phase
        tl.marks.append((now - tl.start, phase))


@contextlib.contextmanager
def record_timeline():
    """Records every allocation and free inside the block: ``with record_timeline() as tl``."""
    tl = Timeline()
    tl.events.append((0.0, _allocated, 0, "other", ""))
    _timelines.append(tl)
    try:
        yield tl
    finally:
        _timelines.remove(tl)


# --- GPU ------------------------------------------------------------------------------

def enable_gpu_hook():
    """Counts CuPy pool allocations exactly (``malloc``/``free`` of the memory pool).

    CuPy's pool reports used and total bytes but no peak; this hook keeps the
    high-water mark. Hooks are thread-local in CuPy: call this from the training thread.
    """
    global _gpu_hook
    if _gpu_hook is not None:
        return _gpu_hook
    import cupy  # noqa: PLC0415

    class _PoolHook(cupy.cuda.MemoryHook):
        name = "inplace_lab_counter"

        def __init__(self):
            self.allocated = 0
            self.peak = 0
            self.active = True

        def malloc_postprocess(self, device_id, size, mem_size, mem_ptr, pmem_id):
            self.allocated += mem_size
            if self.allocated > self.peak:
                self.peak = self.allocated

        def free_postprocess(self, device_id, mem_size, mem_ptr, pmem_id):
            self.allocated -= mem_size

    _gpu_hook = _PoolHook()
    _gpu_hook.__enter__()
    return _gpu_hook
