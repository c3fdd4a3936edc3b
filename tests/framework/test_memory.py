"""framework.memory: the allocation counter, held against tracemalloc, and its API.

Two instruments are compared throughout:

* the framework counter (``memory.allocated_bytes`` / ``max_allocated_bytes``): the
  bytes of the root buffers of every array the framework tracks (tensors, gradients,
  saved tensors, workspaces), uncounted by a weakref callback when NumPy frees them;
* ``tracemalloc``: NumPy reports every array data allocation to it in domain 389047
  (``np.lib.tracemalloc_domain``). A snapshot filtered by ``DomainFilter`` gives the
  live array bytes exactly. tracemalloc keeps no per-domain peak, so peaks compare
  with the overall peak, which also holds Python objects (tensors, nodes, tuples):
  a few kilobytes next to the megabytes of array data measured here.

Every measurement is a delta from a baseline taken right before the measured code
(other tests may leave tensors alive; deltas do not care).
"""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

import framework as fw
from framework import memory

NUMPY_DOMAIN = np.lib.tracemalloc_domain
assert NUMPY_DOMAIN == 389047

N = 1 << 20  # 4 MiB of float32 per tensor: array data dominates every measurement
NBYTES = 4 * N
SLACK = 64 * 1024  # Python objects made by one op call stay far below this


def numpy_traced_bytes() -> int:
    """Live bytes of NumPy array data, as tracemalloc's NumPy domain reports them."""
    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.DomainFilter(True, NUMPY_DOMAIN)])
    return sum(t.size for t in snap.traces)


class Measured:
    """Counter and tracemalloc deltas of a block, from one baseline.

    ``counter_now`` / ``counter_peak``: framework counter, live and peak.
    ``numpy_now``: live NumPy array bytes (tracemalloc, NumPy domain only).
    ``traced_peak``: tracemalloc's overall peak (every domain: arrays + Python objects).
    """

    def __enter__(self):
        gc.collect()
        self._counter0 = memory.allocated_bytes()
        self._numpy0 = numpy_traced_bytes()
        memory.reset_peak()
        tracemalloc.reset_peak()
        self._traced0 = tracemalloc.get_traced_memory()[0]
        return self

    def __exit__(self, *exc):
        traced_now, traced_peak = tracemalloc.get_traced_memory()
        self.counter_now = memory.allocated_bytes() - self._counter0
        self.counter_peak = memory.max_allocated_bytes() - self._counter0
        self.traced_peak = traced_peak - self._traced0
        gc.collect()
        self.numpy_now = numpy_traced_bytes() - self._numpy0
        return False


@pytest.fixture(autouse=True)
def _no_stray_collections():
    """Deltas of a global counter: garbage left by earlier tests (exception tracebacks
    form cycles) must not be collected in the middle of a measurement."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture
def traced():
    """tracemalloc running during the test (it slows every allocation, so only here)."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        yield
    finally:
        if started:
            tracemalloc.stop()


def _nonleaf(n=N):
    """A tensor with history (so inplace on it is allowed while grad is on)."""
    return fw.randn(n, requires_grad=True) * 1.0


# --- the counter against tracemalloc on a training step ----------------------------------

BATCH, WIDTH, LAYERS, CLASSES = 512, 1024, 4, 10


def _mlp():
    fw.manual_seed(0)
    weights = [(fw.randn(WIDTH, WIDTH) * WIDTH**-0.5).requires_grad_() for _ in range(LAYERS)]
    biases = [fw.zeros(WIDTH, requires_grad=True) for _ in range(LAYERS)]
    head = (fw.randn(WIDTH, CLASSES) * WIDTH**-0.5).requires_grad_()
    x = fw.randn(BATCH, WIDTH)
    y = fw.tensor(np.random.default_rng(0).integers(0, CLASSES, BATCH))
    return weights, biases, head, x, y


def _loss(weights, biases, head, x, y):
    h = x
    for i, (w, b) in enumerate(zip(weights, biases)):
        h = h @ w + b
        h = h.relu() if i % 2 == 0 else h.tanh()
    logp = fw.log_softmax(h @ head, dim=1)
    return -logp[fw.arange(BATCH), y].mean()  # softmax cross-entropy


def _rel(a, b) -> float:
    return abs(a - b) / max(b, 1)


def test_counter_matches_tracemalloc_on_forward(traced):
    """Forward of a 4-layer MLP (512x1024 float32 activations): peak and live bytes agree."""
    model = _mlp()
    with Measured() as m:
        loss = _loss(*model)
    assert m.counter_peak > 4 * BATCH * WIDTH * 4  # at least the saved activations
    assert _rel(m.counter_peak, m.traced_peak) < 0.10, vars(m)
    assert _rel(m.counter_now, m.numpy_now) < 0.10, vars(m)
    del loss


def test_counter_matches_tracemalloc_live_bytes_after_step(traced):
    """After forward + backward: what is left (the gradients) is counted exactly."""
    model = _mlp()
    weights, biases, head = model[:3]
    with Measured() as m:
        _loss(*model).backward()
    grads = sum(p.nbytes for p in weights + biases + [head])
    assert m.counter_now == pytest.approx(grads, rel=0.01), vars(m)
    assert _rel(m.counter_now, m.numpy_now) < 0.10, vars(m)


def test_counter_matches_tracemalloc_peak_on_training_step(traced):
    """Forward + backward of the MLP: the two peaks agree within 10%."""
    model = _mlp()
    with Measured() as m:
        _loss(*model).backward()
    assert _rel(m.counter_peak, m.traced_peak) < 0.10, vars(m)


# --- what single ops allocate ---------------------------------------------------------------

OUT_OF_PLACE = {
    "add": lambda x, y: x + y,
    "mul_scalar": lambda x, y: x * 2.0,
    "exp": lambda x, y: x.exp(),
    "relu": lambda x, y: x.relu(),
    "tanh": lambda x, y: x.tanh(),
}

INPLACE = {
    "add_": lambda x, y: x.add_(y),
    "mul_scalar_": lambda x, y: x.mul_(2.0),
    "exp_": lambda x, y: x.exp_(),
    "relu_": lambda x, y: x.relu_(),
    "tanh_": lambda x, y: x.tanh_(),
    "sigmoid_": lambda x, y: x.sigmoid_(),
}


@pytest.mark.parametrize("name", sorted(OUT_OF_PLACE))
def test_out_of_place_op_allocates_exactly_its_output(traced, name):
    x, y = fw.randn(N), fw.randn(N)
    with Measured() as m:
        out = OUT_OF_PLACE[name](x, y)
    assert out.nbytes == NBYTES
    assert m.counter_now == m.counter_peak == NBYTES
    assert m.numpy_now == NBYTES
    assert NBYTES <= m.traced_peak < NBYTES + SLACK  # no hidden temporary either
    assert memory.is_tracked(out._data)


@pytest.mark.parametrize("grad", [False, True], ids=["plain", "autograd"])
@pytest.mark.parametrize("name", sorted(INPLACE))
def test_inplace_op_allocates_nothing(traced, name, grad):
    """Inplace forms that save nothing they overwrite cost 0 bytes, with autograd too."""
    x = _nonleaf() if grad else fw.randn(N)
    y = fw.randn(N)
    saved0 = memory.saved_bytes()
    with Measured() as m:
        out = INPLACE[name](x, y)
    assert out is x
    assert m.counter_now == m.counter_peak == 0
    assert m.numpy_now == 0
    assert m.traced_peak < SLACK
    if grad and name not in ("add_", "mul_scalar_"):
        assert memory.saved_bytes() - saved0 == NBYTES  # the result: x's own buffer, once


def test_views_allocate_nothing(traced):
    x = fw.randn(256, 4096)
    with Measured() as m:
        views = [x.view(4096, 256), x.T, x[1:], x[:, ::2], x.reshape(-1), x.unsqueeze(0), x[0].expand(8, 4096)]
    assert m.counter_now == m.counter_peak == 0
    assert m.numpy_now == 0
    assert all(not v._data.flags.owndata for v in views)


def test_detach_and_data_count_nothing_twice(traced):
    x = fw.randn(N)
    with Measured() as m:
        d, raw = x.detach(), x.data
        memory.track(d._data)  # tracking the same buffer again is a no-op
        memory.track(raw._data[::2])
    assert m.counter_now == m.numpy_now == 0
    before = memory.allocated_bytes()
    del x, d
    gc.collect()
    assert memory.allocated_bytes() == before  # .data still holds the buffer
    del raw
    gc.collect()
    assert memory.allocated_bytes() == before - NBYTES


def test_freeing_the_last_reference_uncounts():
    before = memory.allocated_bytes()
    x = fw.randn(N)
    view = x[::4]
    assert memory.allocated_bytes() - before == NBYTES
    del x
    assert memory.allocated_bytes() - before == NBYTES  # the view keeps the whole buffer alive
    del view
    assert memory.allocated_bytes() == before
    assert memory.max_allocated_bytes() >= before + NBYTES


# --- categories, saved bytes, timeline, peak -----------------------------------------------


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def test_breakdown_categories():
    w = fw.randn(N, requires_grad=True)
    b0 = memory.breakdown()
    h = w * 2.0
    assert _delta(memory.breakdown(), b0) == {"activations": NBYTES}
    b1 = memory.breakdown()
    h.sin_()  # backward needs sin's input, which the kernel overwrites: a copy is kept
    assert _delta(memory.breakdown(), b1) == {"inplace_copies": NBYTES}
    b2 = memory.breakdown()
    h.sum().backward()
    d = _delta(memory.breakdown(), b2)
    assert d["gradients"] == NBYTES  # w.grad
    assert d["inplace_copies"] == -NBYTES  # released with the graph
    assert sum(memory.breakdown().values()) == memory.allocated_bytes()


def test_inplace_copy_is_counted_in_stats():
    h = _nonleaf()
    memory.reset_stats()
    h.sin_()
    assert memory.stats().get("inplace_copy_bytes") == NBYTES
    assert memory.stats().get("inplace_ops") == 1


def test_saved_bytes_rise_in_forward_and_return_after_backward():
    w = fw.randn(N, requires_grad=True)
    s0 = memory.saved_bytes()
    h = (w * 1.0).tanh()  # tanh saves its result
    s1 = memory.saved_bytes()
    assert s1 - s0 == NBYTES
    h = h.exp()  # exp saves its result; the tanh output stays saved
    assert memory.saved_bytes() - s0 == 2 * NBYTES
    h.sum().backward()
    assert memory.saved_bytes() == s0


def test_saved_bytes_with_retain_graph_last_until_the_graph_dies():
    w = fw.randn(N, requires_grad=True)
    s0 = memory.saved_bytes()
    loss = (w * 1.0).tanh().sum()
    loss.backward(retain_graph=True)
    assert memory.saved_bytes() - s0 == NBYTES
    loss.backward()
    assert memory.saved_bytes() == s0


def test_a_buffer_saved_twice_is_counted_once():
    w = fw.randn(N, requires_grad=True)
    c = fw.randn(N, requires_grad=True)
    s0 = memory.saved_bytes()
    h = w * c  # saves w and c
    k = w * c  # saves them again
    assert memory.saved_bytes() - s0 == 2 * NBYTES
    assert memory.saved_refcount(w._data) == 2
    del h
    assert memory.saved_bytes() - s0 == 2 * NBYTES  # k still holds both
    del k
    assert memory.saved_bytes() == s0


def test_record_timeline_with_mark_phases():
    w = fw.randn(N, requires_grad=True)
    start = memory.allocated_bytes()
    with memory.record_timeline() as tl:
        memory.mark("forward")
        loss = (w * 2.0).tanh().sum()
        memory.mark("backward")
        loss.backward()
        del loss
    memory.mark("after")  # outside any timeline: ignored
    phases = [p for _, p in tl.marks]
    assert phases == ["forward", "backward"]
    times = [e[0] for e in tl.events]
    assert times == sorted(times)
    assert tl.events[0][1] == start
    for (_, prev, _, _, _), (_, now, delta, cat, _) in zip(tl.events, tl.events[1:]):
        assert now - prev == delta
        assert cat in memory.CATEGORIES
    fwd = [e for e in tl.events if e[4] == "forward"]
    bwd = [e for e in tl.events if e[4] == "backward"]
    assert any(e[2] == NBYTES and e[3] == "activations" for e in fwd)
    assert any(e[2] == NBYTES and e[3] == "gradients" for e in bwd)
    assert tl.peak == max(e[1] for e in tl.events) >= start + 2 * NBYTES
    assert tl.events[-1][1] == memory.allocated_bytes()


def test_reset_peak_starts_from_the_current_allocation():
    x = fw.randn(N)
    memory.reset_peak()
    base = memory.allocated_bytes()
    assert memory.max_allocated_bytes() == base
    assert memory.peak_breakdown() == memory.breakdown()
    tmp = x * 2.0
    del tmp
    assert memory.allocated_bytes() == base
    assert memory.max_allocated_bytes() == base + NBYTES
    assert memory.peak_breakdown()["activations"] == memory.breakdown()["activations"] + NBYTES
    memory.reset_peak()
    assert memory.max_allocated_bytes() == base
    assert memory.peak_breakdown() == memory.breakdown()


def test_category_context():
    b0 = memory.breakdown()
    with memory.category("workspace"):
        buf = memory.empty((N,), np.float32)
        with memory.category("optimizer_state"):
            state = fw.zeros(N) + 1.0  # an op output inside the block follows the block
        other = memory.zeros((N,), np.float32)
    explicit = memory.empty((N,), np.float32, category="parameters")
    after = memory.empty((N,), np.float32)
    assert _delta(memory.breakdown(), b0) == {
        "workspace": 2 * NBYTES,
        "optimizer_state": NBYTES,
        "parameters": NBYTES,
        "other": NBYTES,  # `after`: no block, no explicit category
    }
    del buf, state, other, explicit, after


def test_category_context_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown memory category 'activation'.*activations"):
        with memory.category("activation"):
            pass
    with memory.category("gradients"):
        pass  # the failed block left nothing pushed
    x = memory.empty((16,), np.float32)
    assert memory._live[id(x)].category == "other"


# --- bugs fixed in memory.py (each with its test) ------------------------------------------


def test_track_rejects_unknown_category_and_counts_nothing():
    """Was: any string became a category outside CATEGORIES, missing from breakdown()."""
    before = memory.allocated_bytes()
    with pytest.raises(ValueError, match="unknown memory category 'grads'"):
        memory.track(np.ones(N, np.float32), "grads")
    assert memory.allocated_bytes() == before
    known = memory.track(np.ones(N, np.float32))
    with pytest.raises(ValueError, match="unknown memory category 'grads'"):
        memory.track(known, "grads")  # also for a buffer that is already counted
    del known
    assert sum(memory.breakdown().values()) == memory.allocated_bytes()
    with pytest.raises(ValueError, match="unknown memory category"):
        memory.retag(np.ones(4, np.float32), "params")


def test_strided_views_are_not_counted_as_new_buffers():
    """Was: as_strided / sliding_window_view views (base is a DummyArray) counted at their
    logical size, as a second buffer: an im2col window view of a 4 MiB input counted 36 MiB."""
    x = memory.track(np.zeros((64, 128, 128), np.float32))
    before = memory.allocated_bytes()
    windows = np.lib.stride_tricks.sliding_window_view(x, (3, 3), axis=(1, 2))
    assert windows.nbytes > 8 * x.nbytes
    memory.track(windows)
    strided = np.lib.stride_tricks.as_strided(x, (4, 4), (4, 4))
    memory.track(strided)
    assert memory.allocated_bytes() == before
    assert memory.root_buffer(windows) is x and memory.root_buffer(strided) is x
    del x
    gc.collect()
    assert memory.allocated_bytes() == before  # the windows keep the input alive
    del windows, strided
    gc.collect()
    assert memory.allocated_bytes() == before - 64 * 128 * 128 * 4


def test_note_released_of_an_unsaved_array_changes_nothing():
    """Releasing what was never noted (e.g. a SavedTensor whose __init__ failed) is a no-op."""
    s0 = memory.saved_bytes()
    memory.note_released(np.ones(8, np.float32))
    assert memory.saved_bytes() == s0


def test_saved_bytes_without_parameters_leaves_out_the_weights_nodes_hold():
    import framework as fw

    w = fw.nn.Parameter(fw.randn(256, 256))  # retagged as parameters
    x = fw.randn(64, 256, requires_grad=True) * 1.0
    base_all, base_act = memory.saved_bytes(), memory.saved_bytes(parameters=False)
    y = (x @ w).tanh()  # matmul keeps x and w, tanh keeps its result
    assert memory.saved_bytes() - base_all == x.nbytes + w.nbytes + y.nbytes
    assert memory.saved_bytes(parameters=False) - base_act == x.nbytes + y.nbytes
    del y


# --- GPU accounting without a GPU ----------------------------------------------------------
#
# The GPU side has two parts that need no device: the pool counter (plain bookkeeping) and
# the CuPy-array breakdown. A stand-in "cupy" module drives them the way CuPy does: its
# MemoryHook base keeps hooks in a thread-local table keyed by ``name`` (registering the
# same name twice in one thread raises KeyError), and its pool rounds requests up to 512
# bytes and calls each hook of the CALLING thread with keyword arguments only, as
# cupy/cuda/memory.pyx does (malloc_postprocess(device_id=, size=, mem_size=, mem_ptr=,
# pmem_id=), free_postprocess(device_id=, mem_size=, mem_ptr=, pmem_id=)).

import threading  # noqa: E402
import types  # noqa: E402

from framework import backend  # noqa: E402
from framework.memory import PoolCounter  # noqa: E402

UNIT = 512  # CuPy's pool allocation unit


def _rounded(n: int) -> int:
    return -(-n // UNIT) * UNIT


class _FakeMemoryHook:
    _local = threading.local()
    name = "MemoryHook"

    @classmethod
    def table(cls) -> dict:
        t = getattr(cls._local, "hooks", None)
        if t is None:
            t = cls._local.hooks = {}
        return t

    def __enter__(self):
        t = self.table()
        if self.name in t:
            raise KeyError(f"memory hook {self.name} already exists")
        t[self.name] = self
        return self

    def __exit__(self, *_):
        del self.table()[self.name]


class _FakePooledMemory:
    def __init__(self, pool, ptr, size):
        self.pool, self.ptr, self.size = pool, ptr, size

    def __del__(self):
        self.pool.free(self.ptr, self.size)


class _FakePool:
    def __init__(self):
        self.next_ptr = 1 << 20
        self.in_use: dict[int, int] = {}

    def malloc(self, size):
        mem_size = _rounded(size)
        ptr, self.next_ptr = self.next_ptr, self.next_ptr + max(mem_size, UNIT)
        self.in_use[ptr] = mem_size
        for hook in list(_FakeMemoryHook.table().values()):
            hook.malloc_postprocess(device_id=0, size=size, mem_size=mem_size, mem_ptr=ptr, pmem_id=ptr)
        return _FakePooledMemory(self, ptr, mem_size)

    def free(self, ptr, size):
        del self.in_use[ptr]
        for hook in list(_FakeMemoryHook.table().values()):
            hook.free_postprocess(device_id=0, mem_size=size, mem_ptr=ptr, pmem_id=ptr)

    def used_bytes(self):
        return sum(self.in_use.values())


class _FakeData:
    def __init__(self, mem, offset=0):
        self.mem, self.ptr = mem, mem.ptr + offset


class FakeGpuArray:
    """Enough of cupy.ndarray for the accounting: base, nbytes, shape, data.mem.size."""

    pool: _FakePool = None

    def __init__(self, nbytes, base=None, data=None):
        self.base = base
        self.nbytes = nbytes
        self.shape = (nbytes // 4,)
        if data is not None:
            self.data = data
        elif base is not None:
            self.data = base.data
        else:
            self.data = _FakeData(self.pool.malloc(nbytes))

    def view(self):
        return FakeGpuArray(self.nbytes, base=self)


@pytest.fixture
def fake_cupy(monkeypatch):
    """``backend._cupy`` replaced by a stand-in with a memory pool; hooks removed afterwards."""
    pool = _FakePool()
    monkeypatch.setattr(FakeGpuArray, "pool", pool)
    module = types.SimpleNamespace(
        ndarray=FakeGpuArray,
        cuda=types.SimpleNamespace(MemoryHook=_FakeMemoryHook, MemoryPool=_FakePool, get_allocator=lambda: pool.malloc),
    )
    monkeypatch.setattr(backend, "_cupy", module)
    yield module, pool
    memory.disable_gpu_hook()
    assert memory.gpu_counter() is None


def test_pool_counter_counts_rounded_sizes_and_keeps_the_peak():
    c = PoolCounter()
    assert c.malloc(1024, 0x1000) == 1024
    assert c.malloc(512, 0x2000) == 512
    assert (c.allocated, c.peak) == (1536, 1536)
    assert c.free(1024, 0x1000) == -1024
    assert (c.allocated, c.peak) == (512, 1536)
    c.reset_peak()
    assert c.peak == 512
    assert c.malloc(2048, 0x3000) == 2048 and c.peak == 2560
    assert (c.mallocs, c.frees, c.live_blocks()) == (3, 1, 2)


def test_pool_counter_ignores_failed_and_empty_mallocs():
    c = PoolCounter()
    assert c.malloc(512, 0) == 0  # CuPy reports mem_ptr 0 when malloc raised (out of memory)
    assert c.malloc(0, 0x1000) == 0  # a zero-size array takes no pool memory
    assert c.free(512, 0) == 0
    assert (c.allocated, c.peak, c.mallocs, c.frees) == (0, 0, 0, 0)


def test_pool_counter_frees_with_the_size_it_counted():
    c = PoolCounter()
    c.malloc(1024, 0x1000)
    assert c.free(4096, 0x1000) == -1024  # the size of the malloc, whatever the free says
    assert c.allocated == 0


def test_pool_counter_baseline_absorbs_frees_of_memory_it_never_saw():
    c = PoolCounter(baseline=3072)
    assert (c.allocated, c.peak) == (3072, 3072)
    c.malloc(512, 0x1000)
    assert c.free(1024, 0x9000) == -1024  # allocated before counting started
    assert (c.baseline, c.allocated, c.unknown_frees) == (2048, 2560, 1)
    assert c.free(4096, 0x9100) == -2048  # never below zero: the rest was not ours
    assert (c.baseline, c.allocated) == (0, 512)
    with pytest.raises(ValueError, match="baseline"):
        PoolCounter(baseline=-1)


def test_pool_counter_replaces_a_pointer_handed_out_again():
    """A pointer reused by the pool means its free happened where no hook saw it: the new
    block replaces the old one instead of counting the memory twice."""
    c = PoolCounter()
    c.malloc(1024, 0x1000)
    assert c.malloc(512, 0x1000) == -512
    assert c.allocated == 512 and c.live_blocks() == 1


def test_pool_counter_is_reentrant_and_thread_safe():
    c = PoolCounter()
    with c._lock:  # a callback that runs inside another one (GC during a malloc) must not deadlock
        c.malloc(512, 0x1000)
        c.free(512, 0x1000)

    def churn(t):
        for i in range(2000):
            ptr = (t + 1) << 32 | (i + 1) * UNIT
            c.malloc(UNIT, ptr)
            c.free(UNIT, ptr)

    threads = [threading.Thread(target=churn, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert c.allocated == 0 and c.live_blocks() == 0 and c.mallocs == c.frees == 8001
    assert UNIT <= c.peak <= 4 * UNIT


def test_enable_gpu_hook_without_cupy_says_what_to_do(monkeypatch):
    monkeypatch.setattr(backend, "cupy_module", lambda: None)
    with pytest.raises(RuntimeError, match=r"needs CuPy and a CUDA device.*pip install"):
        memory.enable_gpu_hook()
    assert memory.gpu_counter() is None


def test_gpu_queries_without_the_hook_raise_a_clear_error():
    assert memory.gpu_counter() is None
    for query in (memory.allocated_bytes, memory.max_allocated_bytes):
        with pytest.raises(RuntimeError, match="enable_gpu_hook"):
            query("cuda")
    with pytest.raises(RuntimeError, match="enable_gpu_hook"), memory.record_timeline("cuda:0"):
        pass
    with pytest.raises(ValueError, match="unknown device"):
        memory.allocated_bytes("tpu")
    assert memory.allocated_bytes("cpu") == memory.allocated_bytes()  # no hook: the host


def test_gpu_hook_registers_per_thread_and_reports_the_pool(fake_cupy):
    cp, pool = fake_cupy
    before = pool.malloc(1000)  # in use before the hook: the baseline
    host = memory.allocated_bytes("cpu")
    counter = memory.enable_gpu_hook()
    assert memory.enable_gpu_hook() is counter  # idempotent in a thread (CuPy would raise KeyError)
    assert list(_FakeMemoryHook.table()) == ["inplace_lab_memory"] and memory.gpu_hook_enabled()
    assert counter.baseline == counter.allocated == UNIT * 2
    a = FakeGpuArray(4000)
    assert memory.allocated_bytes() == memory.allocated_bytes("cuda") == pool.used_bytes() == 2 * UNIT + 4096
    assert memory.allocated_bytes("cpu") == host  # the host counter is separate
    memory.reset_peak()
    b = FakeGpuArray(10_000)
    del b
    assert memory.max_allocated_bytes() == pool.used_bytes() + _rounded(10_000)
    del before  # allocated before the hook: comes out of the baseline
    assert memory.allocated_bytes() == pool.used_bytes() == 4096 and counter.baseline == 0

    # Another thread has no hook (CuPy's table is thread-local) until it registers one.
    def other_thread(register, out):
        if register:
            memory.enable_gpu_hook()
        keep = FakeGpuArray(UNIT)
        out.append(memory.allocated_bytes("cuda"))
        del keep
        if register:
            memory.disable_gpu_hook()

    seen = []
    for register in (False, True):
        th = threading.Thread(target=other_thread, args=(register, seen))
        th.start()
        th.join()
    assert seen == [4096, 4096 + UNIT]
    assert memory.gpu_counter() is counter and memory.gpu_hook_enabled()  # still on in this thread
    del a
    memory.disable_gpu_hook()
    assert _FakeMemoryHook.table() == {} and memory.gpu_counter() is None
    assert memory.allocated_bytes() == memory.allocated_bytes("cpu")  # back to the host


def test_gpu_hook_context_manager_and_foreign_allocator(fake_cupy, monkeypatch):
    cp, pool = fake_cupy
    with memory.gpu_hook() as counter:
        with memory.gpu_hook() as inner:  # nested: same counter, the hook stays until the outer ends
            assert inner is counter
        assert memory.gpu_hook_enabled()
    assert not memory.gpu_hook_enabled() and memory.gpu_counter() is None
    monkeypatch.setattr(cp.cuda, "get_allocator", lambda: lambda size: None)
    with pytest.warns(RuntimeWarning, match="not a cupy.cuda.MemoryPool"):
        counter = memory.enable_gpu_hook()
    assert counter.baseline == 0


def test_cupy_arrays_are_counted_by_category_at_nbytes(fake_cupy):
    cp, pool = fake_cupy
    counter = memory.enable_gpu_hook()
    host0, gpu0 = memory.breakdown("cpu"), memory.breakdown("cuda")
    assert memory.breakdown() == gpu0  # no device: the GPU while the hook is on
    w = memory.track(FakeGpuArray(1000), "parameters")
    x = memory.track(FakeGpuArray(3000))  # no category given: "other"
    with memory.category("activations"):
        y = memory.track(FakeGpuArray(2048))
    assert memory.track(y.view()) is not None and memory.is_tracked(y.view())
    assert _delta(memory.breakdown("cuda"), gpu0) == {"parameters": 1000, "other": 3000, "activations": 2048}
    assert memory.breakdown("cpu") == host0  # nothing moved to the host breakdown
    # The breakdown counts nbytes; the hook's total counts the pool's rounded blocks.
    assert counter.allocated - counter.baseline == _rounded(1000) + _rounded(3000) + 2048
    memory.retag(x, "optimizer_state")
    assert _delta(memory.breakdown("cuda"), gpu0) == {"parameters": 1000, "optimizer_state": 3000, "activations": 2048}
    memory.reset_peak()
    with memory.category("workspace"):
        tmp = memory.track(FakeGpuArray(5000))
    del tmp
    assert memory.peak_breakdown("cuda")["workspace"] == gpu0["workspace"] + 5000
    assert memory.breakdown("cuda")["workspace"] == gpu0["workspace"]
    del w, x, y
    assert memory.breakdown("cuda") == gpu0  # freed arrays are uncounted
    assert counter.allocated == counter.baseline


def test_a_strided_cupy_view_without_base_never_counts_beyond_its_allocation(fake_cupy):
    """CuPy's as_strided builds a view of another array's memory with no .base (conv windows)."""
    memory.enable_gpu_hook()
    buf = FakeGpuArray(4096)
    windows = FakeGpuArray(9 * 4096, data=buf.data)  # a 3x3 window view, 9x the logical bytes
    gpu0 = memory.breakdown("cuda")
    memory.track(windows, "workspace")
    assert _delta(memory.breakdown("cuda"), gpu0) == {"workspace": 4096}


def test_saved_bytes_without_parameters_on_the_gpu(fake_cupy):
    memory.enable_gpu_hook()
    w = memory.track(FakeGpuArray(4096), "parameters")
    x = FakeGpuArray(1024)
    base_all, base_act = memory.saved_bytes(), memory.saved_bytes(parameters=False)
    memory.note_saved(w)
    memory.note_saved(x)
    assert memory.saved_bytes() - base_all == 4096 + 1024
    assert memory.saved_bytes(parameters=False) - base_act == 1024  # the weight is a parameter
    assert memory.breakdown("cuda")["activations"] >= 1024  # note_saved tracks what it holds
    memory.note_released(w)
    memory.note_released(x)
    assert memory.saved_bytes() == base_all


def test_gpu_timeline_records_every_pool_event_and_not_the_host(fake_cupy):
    memory.enable_gpu_hook()
    keep = FakeGpuArray(UNIT)
    start = memory.allocated_bytes()
    with memory.record_timeline() as tl:
        assert tl.device == "cuda"
        memory.mark("forward")
        with memory.category("activations"):
            a = FakeGpuArray(1000)
        host = fw.randn(1024)  # a host buffer is not GPU memory: not in this timeline
        memory.mark("backward")
        b = FakeGpuArray(2 * UNIT)
        del a
    del host, b, keep
    assert tl.events[0][:3] == (0.0, start, 0)
    assert [(e[2], e[3], e[4]) for e in tl.events[1:]] == [
        (1024, "activations", "forward"),
        (2 * UNIT, "other", "backward"),
        (-1024, "other", "backward"),
    ]
    assert [e[1] for e in tl.events] == [start, start + 1024, start + 2048, start + 1024]
    assert tl.peak == start + 2048
    with memory.record_timeline("cpu") as host_tl:
        c = FakeGpuArray(UNIT)
        h = fw.randn(256)
    assert [e[2] for e in host_tl.events[1:]] == [1024]  # the host buffer only
    del c, h
