"""Stream capture on the CuPy stand-in: what CuPy and CUDA record, replay and refuse.

Real CuPy's own tests of ``cupy.cuda.Graph`` (``tests/cupy_tests/cuda_tests/test_graph.py``)
fix the API and the errors: ``Stream.begin_capture``/``end_capture``/``is_capturing``,
``Graph.launch``; a stream synchronization during capture is
``cudaErrorStreamCaptureUnsupported`` and invalidates the capture (``end_capture`` then
raises ``cudaErrorStreamCaptureInvalidated`` and leaves capture mode); a host
synchronization or a host-to-device copy CuPy makes itself raises RuntimeError ("is
capturing") and a cuBLAS call NotImplementedError, all before anything reaches CUDA, so
the capture goes on. A failed capture leaves the stream capturing until ``end_capture``,
as measured on an H200. Captures are in relaxed mode (CuPy's default): another thread
allocates as usual; an allocation by the capturing thread, which CUDA would bake into the
graph, is refused by name (the stand-in's one stricter rule).
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from framework.testing import cudnn_standin as sc
from framework.testing import cupy_standin as cp
from framework.testing.cupy_standin import counting
from framework.testing.cupy_standin.cuda.runtime import CUDARuntimeError

UNSUPPORTED = "cudaErrorStreamCaptureUnsupported"
INVALIDATED = "cudaErrorStreamCaptureInvalidated"


@pytest.fixture
def stream():
    s = cp.cuda.Stream(non_blocking=True)
    yield s
    if cp.cuda.graph.capture_of(s) is not None:  # a failing test must not leave the stream capturing
        try:
            s.end_capture()
        except CUDARuntimeError:
            pass


def _f32(*values):
    return cp.asarray(np.array(values, np.float32))


# --- what a capture records and a launch replays ---------------------------------------------


def test_captured_kernels_are_recorded_not_run_and_replayed_on_the_same_buffers(stream):
    x, out = _f32(1, 2, 3), _f32(0, 0, 0)
    with stream:
        stream.begin_capture()
        assert stream.is_capturing() and not cp.cuda.Stream.null.is_capturing()
        cp.multiply(x, 2, out=out)
        cp.add(out, x, out=out)
        graph = stream.end_capture()
    assert not stream.is_capturing()
    assert isinstance(graph, cp.cuda.Graph) and graph.kinds() == {"elementwise": 2}
    np.testing.assert_array_equal(out.get(), [0, 0, 0])  # nothing ran during the capture
    with counting.count() as c:
        graph.launch()
    assert c.by_kind() == {"graph": 1} and c.host_syncs == 0
    np.testing.assert_array_equal(out.get(), [3, 6, 9])
    x[...] = 10  # a replay reads what the buffers hold now; scalars were baked in
    graph.launch(stream)
    np.testing.assert_array_equal(out.get(), [30, 30, 30])


def test_every_recordable_kernel_kind_is_replayed(stream):
    x, y, filled, part = _f32(1, 2, 3, 4), _f32(0, 0, 0, 0), _f32(0, 0), _f32(0, 0, 0, 0)
    total, doubled_total = cp.zeros((), dtype=cp.float32), cp.zeros((), dtype=cp.float32)
    double = cp.ElementwiseKernel("T x", "T y", "y = x + x", "double_it")
    double.reference = lambda a, b: np.add(a, a, out=b)
    summed = cp.ReductionKernel("T x", "T y", "x", "a + b", "y = a", "0", "sum_it")
    summed.reference = lambda a, axis: a.sum(axis=axis)
    gen = cp.random.default_rng(0)
    noise = cp.empty(4, dtype=cp.float32)
    with stream:
        stream.begin_capture()
        double(x, y)  # ElementwiseKernel into given outputs
        summed(y, out=doubled_total)  # ReductionKernel into out=
        cp.sum(x, out=total)  # a CuPy reduction into out=
        filled.fill(7)
        cp.copyto(part, y)
        part[1:3] = 5
        gen.random(dtype=cp.float32, out=noise)
        graph = stream.end_capture()
    assert graph.kinds() == {"kernel": 2, "reduction": 1, "elementwise": 2, "copy": 1, "random": 1}
    assert not filled.get().any() and not part.get().any()
    graph.launch()
    np.testing.assert_array_equal(y.get(), [2, 4, 6, 8])
    assert total.get() == 10 and doubled_total.get() == 20
    np.testing.assert_array_equal(filled.get(), [7, 7])
    np.testing.assert_array_equal(part.get(), [2, 5, 5, 8])
    first = noise.get()
    graph.launch()
    second = noise.get()
    # the generator's state advances at every replay: no repeated draws
    assert ((first >= 0) & (first < 1)).all() and not np.array_equal(first, second)


def test_work_on_another_stream_is_not_captured(stream):
    x, out = _f32(1, 2), _f32(0, 0)
    other = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        with other:
            cp.multiply(x, 3, out=out)  # runs now, on a stream that does not capture
            assert out.get().sum() == 9  # and may synchronize
        graph = stream.end_capture()
    assert len(graph) == 0
    np.testing.assert_array_equal(out.get(), [3, 6])


def test_a_graph_launched_into_a_capture_is_a_child_graph(stream):
    x, out = _f32(1), _f32(0)
    with stream:
        stream.begin_capture()
        cp.add(out, x, out=out)
        inner = stream.end_capture()
        stream.begin_capture()
        inner.launch()
        inner.launch()
        outer = stream.end_capture()
    assert out.get()[0] == 0 and outer.kinds() == {"graph": 2}
    outer.launch()
    assert out.get()[0] == 2


def test_capture_state_errors(stream):
    with pytest.raises(RuntimeError, match=r"cannot capture on the default \(legacy\) stream"):
        cp.cuda.Stream.null.begin_capture()  # CuPy refuses it before CUDA
    with pytest.raises(CUDARuntimeError, match="cudaErrorIllegalState"):
        stream.end_capture()  # not capturing
    stream.begin_capture()
    with pytest.raises(CUDARuntimeError, match="cudaErrorIllegalState"):
        stream.begin_capture()
    stream.end_capture()
    with cp.cuda.Device(1):
        with pytest.raises(CUDARuntimeError, match="cudaErrorInvalidResourceHandle"):
            stream.begin_capture() or stream.end_capture().launch()


# --- what a capture refuses --------------------------------------------------------------------


BAKED = "while the current stream captures a CUDA graph. CUDA lets it through in relaxed capture mode"


@pytest.mark.parametrize(
    "allocate,source",
    [
        (lambda x: x + 1, "CuPy's memory pool allocated 512 bytes"),  # a new result
        (lambda x: cp.empty(300, dtype=cp.float32), "CuPy's memory pool allocated 1,536 bytes"),
        (lambda x: cp.empty(3, dtype=cp.float32), "CuPy's memory pool allocated 512 bytes"),  # a cached block
    ],
    ids=["result", "new-block", "cached-block"],
)
def test_an_allocation_in_the_capture_is_refused_by_name_and_invalidates_it(stream, allocate, source):
    # CUDA's relaxed mode (CuPy's default) would let it through and bake its address into
    # the graph; the pool hands the block out again afterwards: the stand-in names it
    x = _f32(1, 2)
    with stream:
        stream.begin_capture()
        with pytest.raises(RuntimeError, match=f"{source} on device 0 {BAKED}") as e:
            allocate(x)
        assert not isinstance(e.value, CUDARuntimeError)
        with pytest.raises(RuntimeError, match="an error has invalidated the capture sequence"):
            stream.is_capturing()  # a failed capture stays capturing (CuPy raises on asking) ...
        with pytest.raises(RuntimeError, match=BAKED):
            cp.empty(3, dtype=cp.float32)  # ... and the next allocation fails again
        with pytest.raises(CUDARuntimeError, match=INVALIDATED):
            stream.end_capture()  # a graph with a baked allocation is never handed out
    assert not stream.is_capturing()
    np.testing.assert_array_equal((x + 1).get(), [2, 3])  # and allows normal work after


def test_a_raw_allocation_in_the_capture_is_refused_by_name(stream):
    with stream, cp.cuda.using_allocator(None):  # no pool: cudaMalloc itself
        stream.begin_capture()
        with pytest.raises(
            RuntimeError, match=f"a raw allocation \\(cudaMalloc\\) allocated 8 bytes on device 0 {BAKED}"
        ):
            cp.empty(2, dtype=cp.float32)
        with pytest.raises(CUDARuntimeError, match=INVALIDATED):
            stream.end_capture()


def test_a_relaxed_capture_lets_the_thread_allocate_on_another_stream(stream):
    # Relaxed mode forbids no cudaMalloc; work on a stream that is not capturing is not recorded
    other = cp.cuda.Stream(non_blocking=True)
    out = _f32(0, 0)
    with stream:
        stream.begin_capture()
        with other:
            z = cp.zeros(1000, dtype=cp.float32)  # a new block, on a stream that does not capture
        cp.add(out, 1, out=out)
        graph = stream.end_capture()
    assert z.get().sum() == 0 and not out.get().any()
    graph.launch()
    np.testing.assert_array_equal(out.get(), [1, 1])


@pytest.mark.parametrize("mode", ["global", "thread-local"])
def test_a_strict_capture_forbids_its_thread_cudamalloc_on_any_stream(stream, mode):
    other = cp.cuda.Stream(non_blocking=True)
    modes = {
        "global": cp.cuda.runtime.streamCaptureModeGlobal,
        "thread-local": cp.cuda.runtime.streamCaptureModeThreadLocal,
    }
    cp.get_default_memory_pool().free_all_blocks()  # no cached block to serve it
    stream.begin_capture(modes[mode])
    with other, pytest.raises(CUDARuntimeError, match=UNSUPPORTED):
        cp.zeros(1000, dtype=cp.float32)  # cudaMalloc: a new block
    with pytest.raises(CUDARuntimeError, match=INVALIDATED):
        stream.end_capture()
    with cp.cuda.Device(1):  # another device's captures do not forbid anything on device 0
        stream1 = cp.cuda.Stream(non_blocking=True)
        stream1.begin_capture(cp.cuda.runtime.streamCaptureModeGlobal)
    with cp.cuda.Device(0):
        assert cp.zeros(1000, dtype=cp.float32).get().sum() == 0
    with cp.cuda.Device(1):
        stream1.end_capture()


def _in_thread(fn):
    """Runs ``fn`` in another thread (its own current stream: the legacy one); returns its
    result or raises its error."""
    out = {}

    def run():
        try:
            out["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


def test_another_thread_allocates_and_computes_during_a_relaxed_capture(stream):
    out = _f32(0, 0)
    with stream:
        stream.begin_capture()
        y = _in_thread(lambda: cp.arange(1000, dtype=cp.float32) * 2)  # a cudaMalloc and kernels
        cp.add(out, 1, out=out)
        graph = stream.end_capture()  # not invalidated, and the thread's kernels are not in it
    assert len(graph) == 1 and y.get()[-1] == 1998
    graph.launch()
    np.testing.assert_array_equal(out.get(), [1, 1])


def test_another_thread_cannot_cudamalloc_during_a_global_capture(stream):
    cp.get_default_memory_pool().free_all_blocks()  # no cached block to serve it
    stream.begin_capture(cp.cuda.runtime.streamCaptureModeGlobal)
    with pytest.raises(CUDARuntimeError, match=UNSUPPORTED):
        _in_thread(lambda: cp.empty(4096, dtype=cp.float32))
    with pytest.raises(CUDARuntimeError, match=INVALIDATED):
        stream.end_capture()


@pytest.mark.parametrize(
    "sync",
    [
        lambda a: a.get(),
        lambda a: float(a[0]),
        lambda a: bool(a[0]),
        lambda a: a[0].item(),
        lambda a: a.tolist(),
        lambda a: int(a[0]),
        lambda a: cp.asnumpy(a),
    ],
    ids=["get", "float", "bool", "item", "tolist", "int", "asnumpy"],
)
def test_a_host_synchronization_from_an_array_is_refused_by_cupy_and_the_capture_goes_on(stream, sync):
    a, out = _f32(1, 2), _f32(0, 0)
    with stream:
        stream.begin_capture()
        with pytest.raises(RuntimeError, match="is capturing") as e:
            sync(a)
        assert not isinstance(e.value, CUDARuntimeError)
        cp.add(a, a, out=out)
        graph = stream.end_capture()  # not invalidated: CuPy refused before calling CUDA
    graph.launch()
    np.testing.assert_array_equal(out.get(), [2, 4])


@pytest.mark.parametrize(
    "sync",
    [
        lambda s: s.synchronize(),
        lambda s: cp.cuda.Device(0).synchronize(),
        lambda s: cp.cuda.runtime.deviceSynchronize(),
        lambda s: s.record().synchronize(),
    ],
    ids=["stream", "device", "runtime", "event"],
)
def test_a_cuda_synchronization_is_refused_by_cuda_and_invalidates_the_capture(stream, sync):
    with stream:
        stream.begin_capture()
        with pytest.raises(CUDARuntimeError, match=UNSUPPORTED):
            sync(stream)
        with pytest.raises(CUDARuntimeError, match=INVALIDATED):
            stream.end_capture()
    assert not stream.is_capturing()
    stream.synchronize()


def test_querying_a_capturing_stream_invalidates_the_capture(stream):
    stream.begin_capture()
    assert stream.done is False
    with pytest.raises(CUDARuntimeError, match=INVALIDATED):
        stream.end_capture()
    assert stream.done is True


@pytest.mark.parametrize(
    "transfer",
    [lambda a: a.set(np.ones(2, np.float32)), lambda a: cp.asarray(np.ones(2, np.float32)), lambda a: a[[0, 1]]],
    ids=["set", "asarray", "host-index"],
)
def test_a_host_transfer_is_refused_by_cupy_and_the_capture_goes_on(stream, transfer):
    a, out = _f32(1, 2), _f32(0, 0)
    with stream:
        stream.begin_capture()
        with pytest.raises(RuntimeError, match="the current stream is capturing, so H2D transfers are disallowed") as e:
            transfer(a)
        assert not isinstance(e.value, CUDARuntimeError)
        cp.add(a, a, out=out)
        graph = stream.end_capture()  # CuPy refused before calling CUDA: the capture is valid
    np.testing.assert_array_equal(a.get(), [1, 2])
    graph.launch()
    np.testing.assert_array_equal(out.get(), [2, 4])


@pytest.mark.parametrize(
    "product",
    [
        lambda a, b, o: cp.matmul(a, b, out=o),
        lambda a, b, o: a @ b,
        lambda a, b, o: a.dot(b, out=o),
        lambda a, b, o: cp.dot(a, b, out=o),
        lambda a, b, o: cp.tensordot(a, b, 1),
        lambda a, b, o: cp.einsum("ij,jk->ik", a, b),
    ],
    ids=["matmul", "@", "ndarray.dot", "dot", "tensordot", "einsum"],
)
def test_cublas_is_refused_by_cupy_during_capture_and_the_capture_goes_on(stream, product):
    a = cp.asarray(np.eye(2, dtype=np.float32))
    out = cp.zeros((2, 2), dtype=cp.float32)
    with stream:
        stream.begin_capture()
        with pytest.raises(NotImplementedError, match="calling cuBLAS API during stream capture is currently unsup"):
            product(a, a, out)
        graph = stream.end_capture()
    assert len(graph) == 0 and not out.get().any()  # nothing written, nothing recorded


def test_a_launch_the_standin_cannot_record_is_refused_by_name(stream):
    a = _f32(2, 1)
    with stream:
        stream.begin_capture()
        with pytest.raises(NotImplementedError, match="'sort' launch during stream capture"):
            a.sort()
        stream.end_capture()


class _Slab:
    """An allocator that hands out memory that already exists (as a graph's private pool
    does): no cudaMalloc, no pool, so legal during capture."""

    def __init__(self, nbytes):
        self.slab = cp.empty(nbytes, dtype=cp.uint8)
        self.used = 0

    def __call__(self, size):
        ptr = cp.cuda.MemoryPointer(self.slab.data.mem, self.used)
        self.used += -(-size // 512) * 512
        assert self.used <= self.slab.nbytes
        return ptr


def test_kernels_that_allocate_from_existing_memory_are_recorded_and_replayed(stream):
    a, idx, acc = _f32(1, 2, 3), cp.asarray(np.array([0, 0, 2])), cp.zeros(3, dtype=cp.float32)
    slab, previous = _Slab(1 << 14), cp.cuda.get_allocator()
    cp.cuda.set_allocator(slab)
    try:
        with stream:
            stream.begin_capture()
            b = a * 2 + 1  # two kernels, each into a new array from the slab
            m = cp.argmax(b)  # a reduction into a new array
            z = cp.zeros(2, dtype=cp.float32)  # a memset
            z += a[:2]
            cp.add.at(acc, idx, a)  # a scatter: the index is read when the kernel runs
            graph = stream.end_capture()
    finally:
        cp.cuda.set_allocator(previous)
    assert graph.kinds() == {"elementwise": 3, "reduction": 1, "memset": 1, "scatter": 1}
    assert all(x.data.mem is slab.slab.data.mem for x in (b, m, z))
    with counting.count() as c:
        graph.launch()
    assert c.by_kind() == {"graph": 1}
    np.testing.assert_array_equal(b.get(), [3, 5, 7])
    assert int(m.get()) == 2
    np.testing.assert_array_equal(z.get(), [1, 2])
    np.testing.assert_array_equal(acc.get(), [3, 0, 3])
    a[...] = cp.asarray(np.array([5, 0, 0], dtype=np.float32))
    idx[...] = cp.asarray(np.array([1, 1, 1]))
    graph.launch()  # a replay reads what the buffers hold now
    np.testing.assert_array_equal(b.get(), [11, 1, 1])
    assert int(m.get()) == 0
    np.testing.assert_array_equal(z.get(), [5, 0])
    np.testing.assert_array_equal(acc.get(), [3, 5, 3])


def test_a_draw_into_a_new_array_from_existing_memory_is_recorded_and_advances(stream):
    gen = cp.random.default_rng(1)
    slab, previous = _Slab(1 << 12), cp.cuda.get_allocator()
    cp.cuda.set_allocator(slab)
    try:
        with stream:
            stream.begin_capture()
            u = gen.random(4, dtype=cp.float32)
            graph = stream.end_capture()
    finally:
        cp.cuda.set_allocator(previous)
    graph.launch()
    first = u.get().copy()
    graph.launch()
    assert (first != u.get()).any() and ((0 <= first) & (first < 1)).all()


def test_random_draws_that_allocate_are_refused(stream):
    gen = cp.random.default_rng(1)
    with stream:
        stream.begin_capture()
        with pytest.raises(RuntimeError, match=BAKED):
            gen.random(4, dtype=cp.float32)
        with pytest.raises(CUDARuntimeError, match=INVALIDATED):
            stream.end_capture()


# --- libraries: cuDNN and NCCL run on the stream their handle names ---------------------------


def _conv_graph(handle):
    g = sc.pygraph(
        io_data_type=sc.data_type.FLOAT,
        intermediate_data_type=sc.data_type.FLOAT,
        compute_data_type=sc.data_type.FLOAT,
        handle=handle,
    )
    x, w = g.tensor(name="x", dim=[1, 1, 3, 3]), g.tensor(name="w", dim=[1, 1, 1, 1])
    y = g.conv_fprop(x, w, padding=[0, 0], stride=[1, 1], dilation=[1, 1])
    y.set_output(True).set_dim([1, 1, 3, 3]).set_stride([9, 9, 3, 1])
    g.build([sc.heur_mode.A, sc.heur_mode.FALLBACK])
    return g, x, w, y


def test_a_cudnn_execution_on_the_capturing_stream_is_recorded(stream):
    handle = sc.create_handle()
    sc.set_stream(handle, stream.ptr)
    g, tx, tw, ty = _conv_graph(handle)
    x = cp.asarray(np.arange(9, dtype=np.float32).reshape(1, 1, 3, 3))
    w, y = cp.full((1, 1, 1, 1), 2.0, dtype=cp.float32), cp.zeros((1, 1, 3, 3), dtype=cp.float32)
    workspace = cp.empty(g.get_workspace_size(), dtype=cp.uint8)
    with stream:
        stream.begin_capture()
        g.execute({tx: x, tw: w, ty: y}, workspace, handle=handle)
        graph = stream.end_capture()
    assert graph.kinds() == {"cudnn": 1} and not y.get().any()
    with counting.count() as c:
        graph.launch()
    assert c.by_kind() == {"graph": 1}
    np.testing.assert_array_equal(y.get().ravel(), 2 * np.arange(9))


def test_a_cudnn_handle_on_the_legacy_stream_cannot_join_a_blocking_capture():
    blocking = cp.cuda.Stream()
    handle = sc.create_handle()  # on the legacy default stream
    g, tx, tw, ty = _conv_graph(handle)
    x, w, y = (cp.zeros(s, dtype=cp.float32) for s in ((1, 1, 3, 3), (1, 1, 1, 1), (1, 1, 3, 3)))
    workspace = cp.empty(g.get_workspace_size(), dtype=cp.uint8)
    with blocking:
        blocking.begin_capture()
        with pytest.raises(CUDARuntimeError, match="cudaErrorStreamCaptureImplicit"):
            g.execute({tx: x, tw: w, ty: y}, workspace, handle=handle)
        with pytest.raises(CUDARuntimeError, match=INVALIDATED):
            blocking.end_capture()


def test_a_graph_refuses_to_replay_on_memory_freed_since_the_capture(stream):
    x, out = _f32(1, 2), _f32(0, 0)
    with stream:
        stream.begin_capture()
        cp.add(x, x, out=out)
        graph = stream.end_capture()
    graph.launch()
    del x  # its block goes back to the pool: a GPU would replay on memory handed out again
    gc.collect()
    with pytest.raises(RuntimeError, match=r"kernel 0 \(elementwise\) of this graph uses device memory that was freed"):
        graph.launch()


def test_a_recorded_kernel_is_checked_when_it_is_recorded(stream):
    x, out = _f32(1.5, 2.5), cp.zeros(2, dtype=cp.int32)
    with stream:
        stream.begin_capture()
        with pytest.raises(TypeError, match="Cannot cast"):
            cp.add(x, x, out=out)  # float32 into int32 under same_kind: refused at the launch
        with pytest.raises(TypeError, match="Cannot cast"):
            cp.copyto(out, x)
        graph = stream.end_capture()
    assert len(graph) == 0 and not out.get().any()
