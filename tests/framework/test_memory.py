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
