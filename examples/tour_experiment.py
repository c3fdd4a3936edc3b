"""Chapter 5 of the inplace tour: the articles' experiment, ``add_`` against ``add``, measured.

100 additions on a 1000x1000 float32 tensor, in place and out of place (the result
dropped, or every result kept alive as autograd keeps activations), and the same
out-of-place code under policy ``auto``. Timing (min and median over repeats, the
variants alternating) and page faults on both libraries; bytes on this framework, by its
counter and by ``tracemalloc``. ``examples/inplace_tour.py`` prints and plots them.
"""

from __future__ import annotations

import gc
import time
import tracemalloc

try:
    import resource  # page faults; Unix only
except ImportError:  # pragma: no cover  (Windows)
    resource = None

import framework as fw

IN_PLACE = "x.add_(y)"
DROPPED = "x = x + y"
KEPT = "xs.append(xs[-1] + y)"
AUTO = "x = x + y, auto"
VARIANTS = (IN_PLACE, DROPPED, KEPT, AUTO)
TORCH_VARIANTS = (IN_PLACE, DROPPED, KEPT)  # PyTorch's eager mode has no policy auto
VARIANT_NOTES = {
    IN_PLACE: "in place",
    DROPPED: "out of place (policy off), each result frees the previous one",
    KEPT: "out of place, every result kept alive (as autograd keeps activations)",
    AUTO: "the same code under policy auto: x is proven dead at each step and the add runs in place",
}


def _run_variant(lib, variant, holder, y, n_ops):
    """Runs ``n_ops`` additions; returns what the variant keeps (the last x, or all results).

    ``holder`` is a one-element list with x, popped only in :func:`_additions`: nothing
    else refers to x, so that ``x = x + y`` frees each previous result as it goes.
    """
    if lib is not fw:
        return _additions(variant, holder, y, n_ops)
    # `x = x + y` stays out of place under policy off; under auto the framework proves x
    # dead and runs it in place (its own answer to this experiment).
    with fw.inplace.policy("auto" if variant == AUTO else "off"):
        return _additions(DROPPED if variant == AUTO else variant, holder, y, n_ops)


def _additions(variant, holder, y, n_ops):
    x = holder.pop()
    if variant == IN_PLACE:
        for _ in range(n_ops):
            x.add_(y)
        return x
    if variant == DROPPED:
        for _ in range(n_ops):
            x = x + y
        return x
    xs = [x]
    del x
    for _ in range(n_ops):
        xs.append(xs[-1] + y)
    return xs


def _page_faults() -> int:
    """Minor page faults of this process so far (0 where the OS does not say)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0


def time_variants(lib, size, n_ops, repeats) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """Seconds and page faults per run of each variant, the variants alternating in each repeat.

    A page fault is the OS handing the process a fresh page of memory (zeroed) the first
    time it is touched: what allocating new memory costs beyond the allocator's call.
    """
    variants = VARIANTS if lib is fw else TORCH_VARIANTS
    seconds = {v: [] for v in variants}
    faults = {v: [] for v in variants}
    y = lib.ones(size, size)
    for _ in range(repeats):
        for variant in variants:
            holder = [lib.ones(size, size)]
            gc.collect()
            faults0 = _page_faults()
            start = time.perf_counter()
            kept = _run_variant(lib, variant, holder, y, n_ops)
            seconds[variant].append(time.perf_counter() - start)
            faults[variant].append(_page_faults() - faults0)
            del kept
    return seconds, faults


def measure_memory(size, n_ops) -> dict[str, dict[str, int]]:
    """Bytes each variant allocates, on this framework, by its counter and by tracemalloc.

    ``allocated``: every buffer allocated during the run, added up (from the framework's
    allocation timeline); ``peak``: the counter's high-water mark above the start;
    ``traced_peak``: tracemalloc's (every Python allocation, so a few KB of objects too);
    ``live``: what the counter still counts once the run returned its result;
    ``auto_ops``: the ops policy auto ran in place.
    """
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    out = {}
    try:
        y = fw.ones(size, size)
        for variant in VARIANTS:
            holder = [fw.ones(size, size)]
            gc.collect()
            base = fw.memory.allocated_bytes()
            auto_ops = fw.memory.stats().get("auto_inplace_ops", 0)
            fw.memory.reset_peak()
            tracemalloc.reset_peak()
            traced_base = tracemalloc.get_traced_memory()[0]
            with fw.memory.record_timeline("cpu") as timeline:
                kept = _run_variant(fw, variant, holder, y, n_ops)
            traced_peak = tracemalloc.get_traced_memory()[1] - traced_base
            out[variant] = {
                "allocated": sum(delta for _, _, delta, _, _ in timeline.events if delta > 0),
                "peak": fw.memory.max_allocated_bytes() - base,
                "traced_peak": traced_peak,
                "live": fw.memory.allocated_bytes() - base,
                "auto_ops": fw.memory.stats().get("auto_inplace_ops", 0) - auto_ops,
            }
            del kept
    finally:
        if started:
            tracemalloc.stop()
    return out


def experiment(size, n_ops, repeats, torch=None):
    """Times and measures the variants; returns ``(seconds, page faults, memory)``, the first
    two by library (``framework``, ``torch``) and variant."""
    times, faults = {}, {}
    times["framework"], faults["framework"] = time_variants(fw, size, n_ops, repeats)
    memory = measure_memory(size, n_ops)
    if torch is not None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # NumPy's elementwise add runs on one core too
        try:
            times["torch"], faults["torch"] = time_variants(torch, size, n_ops, repeats)
        finally:
            torch.set_num_threads(threads)
    return times, faults, memory
