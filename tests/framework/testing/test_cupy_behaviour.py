"""CuPy's odd behaviours, one table, checked on the stand-in and on real CuPy alike.

Each row is something real CuPy does that NumPy does not (measured on CuPy 14.2 with an
H200, see docs/GPU.md; the stream-capture rows read from CuPy 14.2's source and its own
tests, not yet run on a GPU); the stand-in must do the same. The rows run on
:mod:`framework.testing.cupy_standin` everywhere, and on real CuPy wherever it sees a GPU
(skipped with the reason elsewhere), so a difference shows on the first GPU run.
"""

from __future__ import annotations

import importlib
import importlib.util
import re

import numpy as np
import pytest


def _real_cupy():
    """Real CuPy, or the reason it cannot run here."""
    if importlib.util.find_spec("cupy") is None:
        return None, "CuPy is not installed"
    try:
        cupy = importlib.import_module("cupy")
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, "CuPy sees no GPU"
    except Exception as e:  # noqa: BLE001 - any failure means: no usable CuPy here
        return None, f"CuPy cannot be used: {type(e).__name__}: {e}"
    return cupy, None


@pytest.fixture(params=["standin", pytest.param("cupy", marks=pytest.mark.gpu)])
def xp(request):
    if request.param == "standin":
        return importlib.import_module("framework.testing.cupy_standin")
    cupy, why = _real_cupy()
    if cupy is None:
        pytest.skip(f"needs real CuPy and a GPU: {why}")
    return cupy


def _arange(xp):
    return xp.arange(6, dtype=xp.float32)


def _nccl_error(xp, status):
    if importlib.util.find_spec(xp.__name__ + ".cuda.nccl") is None:
        pytest.skip(f"{xp.__name__}.cuda.nccl is missing")
    nccl = importlib.import_module(xp.__name__ + ".cuda.nccl")
    if not getattr(nccl, "available", False):
        pytest.skip(f"{xp.__name__}.cuda.nccl is not available here")
    e = nccl.NcclError(status)
    return e.status, str(e)


def _raised(fn, *args) -> str | None:
    """What ``fn(*args)`` raised, as ``"Type: first line"`` (a CUDA error by its name only),
    or None."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - the row compares what was raised
        text = str(e).splitlines()[0] if str(e) else ""
        if type(e).__name__ == "CUDARuntimeError":
            text = text.split(":")[0]
        return f"{type(e).__name__}: {text}"
    return None


def _captured(xp, body):
    """``body(stream)`` run while a new non-blocking stream captures (relaxed mode, CuPy's
    default); returns ``(what body returned, how the capture ended)``: ``"graph"`` or the
    CUDA error ``end_capture`` raised."""
    s = xp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        try:
            got = body(s)
        finally:
            ended = _raised(s.end_capture) or "graph"
    return got, ended


def _bfloat16_matmul(xp):
    import ml_dtypes  # noqa: PLC0415  (a dependency of the project)

    a = xp.asarray(np.eye(2).astype(ml_dtypes.bfloat16))
    return (a @ a).dtype.name


def _bfloat16_add_at(xp):
    import ml_dtypes  # noqa: PLC0415  (a dependency of the project)

    a = xp.zeros(3, dtype=ml_dtypes.bfloat16)
    return _raised(xp.add.at, a, xp.asarray([0, 0]), xp.ones(2, dtype=ml_dtypes.bfloat16))


def _raw_in_array_out(xp, out_shape, in_shape=(6,)):
    """An elementwise kernel over raw inputs: its (non-raw) output gives the loop size."""
    k = xp.ElementwiseKernel("raw T a", "T out", "out = a[i % a.size()] * 2", "behaviour_raw_in_array_out")
    if hasattr(xp, "counting"):  # the stand-in runs a NumPy reference in place of CUDA
        k.reference = lambda a, out: out.__setitem__(
            ..., (a.reshape(-1)[np.arange(out.size) % a.size] * 2).reshape(out.shape)
        )
    out = xp.zeros(out_shape, dtype=xp.float32)
    k(_arange(xp).reshape(in_shape), out)
    return out.get().tolist()


def _done_once_synchronized(event):
    event.synchronize()
    return event.done


def _set_refused(xp):
    a = xp.zeros(2, dtype=xp.float32)
    return _captured(xp, lambda s: _raised(a.set, np.ones(2, np.float32)))


def _matmul_refused(xp):
    a = xp.ones((2, 2), dtype=xp.float32)
    out = xp.zeros((2, 2), dtype=xp.float32)
    return _captured(xp, lambda s: _raised(lambda: xp.matmul(a, a, out=out)))


def _recorded_then_replayed(xp):
    """A kernel into an existing array: not run at capture, run again at each launch."""
    a = xp.zeros(2, dtype=xp.float32)
    s = xp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        xp.add(a, 1, out=a)
        g = s.end_capture()
    seen = [a.get().tolist()]
    for _ in range(2):
        g.launch(stream=s)
        s.synchronize()
        seen.append(a.get().tolist())
    return seen


def _other_thread_during_capture(xp):
    """Another thread allocates (a cudaMalloc) and computes while a relaxed capture goes on:
    relaxed mode forbids it nothing, and its work is not in the graph."""
    import threading

    out = {}

    def work():
        with xp.cuda.Device(0):
            y = xp.arange(300000, dtype=xp.float32) * 2
            out["last"] = float(y[-1])

    def body(s):
        t = threading.Thread(target=work)
        t.start()
        t.join()
        return out.get("last")

    return _captured(xp, body)


def _forked(xp, join: bool):
    """Capture on ``s`` forks onto ``s2`` (``s2`` waits on an event recorded in the capture:
    it joins the capture) and, when ``join``, joins back (``s`` waits on an event recorded
    on ``s2``). Returns ``(s2 capturing while forked, a after the capture, a after one launch,
    how the capture ended)``: the kernel launched on ``s2`` is in the graph."""
    a = xp.zeros(2, dtype=xp.float32)
    s, s2 = xp.cuda.Stream(non_blocking=True), xp.cuda.Stream(non_blocking=True)
    graphs: list = []
    with s:
        s.begin_capture()
        try:
            s2.wait_event(s.record())
            joined = s2.is_capturing()
            with s2:
                xp.add(a, 1, out=a)
            if join:
                s.wait_event(s2.record())
        finally:
            ended = _raised(lambda: graphs.append(s.end_capture())) or "graph"
    after_capture = a.get().tolist()
    for graph in graphs:
        graph.launch(stream=s)
        s.synchronize()
    return joined, after_capture, a.get().tolist(), ended, s2.is_capturing()


def _event_done_in_capture(xp):
    """``Event.done`` of an event recorded in the capture: cudaEventQuery fails (CuPy's
    ``done`` answers False) and the capture is invalid."""
    return _captured(xp, lambda s: s.record().done)


def _wait_on_an_uncaptured_event(xp):
    """A capturing stream waits on an event recorded before the capture began."""
    e = xp.cuda.Stream(non_blocking=True).record()
    return _captured(xp, lambda s: _raised(s.wait_event, e))


def _set_allocator_inside_using_allocator(xp):
    with xp.cuda.using_allocator(xp.get_default_memory_pool().malloc):
        return _raised(xp.cuda.set_allocator, None)


def _using_allocator_is_thread_local(xp):
    import threading

    mine = xp.cuda.MemoryPool().malloc
    seen = {}
    with xp.cuda.using_allocator(mine):
        t = threading.Thread(target=lambda: seen.update(other=xp.cuda.get_allocator() == mine))
        t.start()
        t.join()
        here = xp.cuda.get_allocator() == mine
    return here, seen["other"], xp.cuda.get_allocator() == mine


def _served_from_existing_memory(xp):
    """Inside a capture, an allocator handing out memory that already exists (no pool, no
    cudaMalloc): a kernel's new result is recorded and replayed in it."""
    slab = xp.zeros(1024, dtype=xp.uint8)
    x = xp.ones(4, dtype=xp.float32)

    def malloc(size):
        return slab.data

    s = xp.cuda.Stream(non_blocking=True)
    with s, xp.cuda.using_allocator(malloc):
        s.begin_capture()
        y = x + 1
        g = s.end_capture()
    g.launch(stream=s)
    s.synchronize()
    return y.get().tolist(), y.data.ptr == slab.data.ptr


def _references(xp, make):
    """How a view or array made from ``a`` refers to it: ``(data is a.data, data.mem is
    a.data.mem, base is a)``: what holds ``a``'s memory alive."""
    a = xp.zeros((2, 3), dtype=xp.float32)  # an array that owns its memory: base None
    v = make(xp, a)
    return v.data is a.data, v.data.mem is a.data.mem, v.base is a


def _axis_error(axis, ndim):
    return AxisErrorRow(f"axis {axis} is out of bounds for array of dimension {ndim}")


_MOMENT = "__device__ complex<double> moment(double v) { return complex<double>(v, v * v); }"


def _cub_moments(xp, map_expr, order, preamble=""):
    """A one-input ReductionKernel over the 256 rows of a (256, 2) input in ``order``: its
    result's first value, or the name of the exception it raises. CuPy takes its CUB path
    for the F-ordered input (the reduced axis first), where it renames ``x`` to ``in0`` with
    str.replace over the map expression."""
    k = xp.ReductionKernel(
        "T x",
        "complex128 s",
        map_expr,
        "a + b",
        "s = a",
        "0",
        "behaviour_moments",
        reduce_type="complex<double>",
        preamble=preamble,
    )
    if hasattr(xp, "counting"):  # the stand-in runs a NumPy reference in place of CUDA
        k.reference = lambda x, axis: x.astype(np.float64).sum(axis) + 1j * (x.astype(np.float64) ** 2).sum(axis)
    a = xp.ones((256, 2), dtype=xp.float32, order=order)
    try:
        return complex(k(a, axis=0)[0].get())
    except Exception as e:  # noqa: BLE001 - the row is which exception
        return type(e).__name__


class AxisErrorRow:
    """An expected ``numpy.exceptions.AxisError`` with this message."""

    def __init__(self, message: str):
        self.message = message


# (id, f(xp), expected value or AxisErrorRow)
ROWS = [
    (
        "asarray of a permuted host array: C-contiguous",
        lambda xp: xp.asarray(np.zeros((2, 3, 4), np.float32).transpose(1, 2, 0)).strides,
        (32, 8, 4),
    ),
    (
        "asarray of an F-contiguous host array: F-contiguous",
        lambda xp: xp.asarray(np.asfortranarray(np.zeros((2, 3), np.float32))).strides,
        (4, 8),
    ),
    (
        "ElementwiseKernel: raw inputs, the output sets the loop",
        lambda xp: _raw_in_array_out(xp, (2, 3)),
        [[0, 2, 4], [6, 8, 10]],
    ),
    (
        "ElementwiseKernel: raw inputs, no output",
        lambda xp: _raised(xp.ElementwiseKernel("raw T a", "T out", "out = a[i]", "behaviour_raw_only"), _arange(xp)),
        "ValueError: Loop size is undecided.",
    ),
    # shares_memory compares element addresses from a kernel; a 0-d element's is a local's.
    ("shares_memory: two distinct 0-d arrays", lambda xp: xp.shares_memory(xp.asarray(1.0), xp.asarray(2.0)), True),
    ("shares_memory: a 0-d array with itself", lambda xp: (lambda a: xp.shares_memory(a, a))(xp.asarray(1.0)), True),
    ("shares_memory: x[1] (0-d view) with x", lambda xp: (lambda x: xp.shares_memory(x[1], x))(_arange(xp)), False),
    ("shares_memory: x with x[1]", lambda xp: (lambda x: xp.shares_memory(x, x[1]))(_arange(xp)), False),
    ("shares_memory: x[1:2] (1 element) with x", lambda xp: (lambda x: xp.shares_memory(x[1:2], x))(_arange(xp)), True),
    (
        "shares_memory: x[None] of 0-d with x",
        lambda xp: (lambda x: xp.shares_memory(x[None], x))(xp.asarray(1.0)),
        False,
    ),
    (
        "shares_memory: broadcast of 0-d with it",
        lambda xp: (lambda x: xp.shares_memory(xp.broadcast_to(x, (2, 3)), x))(xp.asarray(1.0)),
        False,
    ),
    ("shares_memory: interleaved halves", lambda xp: (lambda x: xp.shares_memory(x[::2], x[1::2]))(_arange(xp)), False),
    ("shares_memory: overlapping slices", lambda xp: (lambda x: xp.shares_memory(x[:4], x[3:]))(_arange(xp)), True),
    ("shares_memory: empty with itself", lambda xp: (lambda x: xp.shares_memory(x, x))(xp.zeros(0)), False),
    ("shares_memory: two arrays", lambda xp: xp.shares_memory(_arange(xp), _arange(xp)), False),
    # may_share_memory compares byte bounds within one allocation.
    ("may_share_memory: x[1] with x", lambda xp: (lambda x: xp.may_share_memory(x[1], x))(_arange(xp)), True),
    (
        "may_share_memory: interleaved halves",
        lambda xp: (lambda x: xp.may_share_memory(x[::2], x[1::2]))(_arange(xp)),
        True,
    ),
    (
        "may_share_memory: two distinct 0-d arrays",
        lambda xp: xp.may_share_memory(xp.asarray(1.0), xp.asarray(2.0)),
        False,
    ),
    # bfloat16 products: cuBLAS's for 2-d matrices, a bfloat16 result (NumPy's is float32).
    ("matmul of 2-d bfloat16", _bfloat16_matmul, "bfloat16"),
    # add.at with integer indices: atomicAdd's dtypes only (cupy/_core/_routines_indexing.pyx).
    (
        "add.at of bfloat16 with integer indices",
        _bfloat16_add_at,
        "TypeError: cupy.add.at only supports int32, int64, float16, float32, float64, uint32, uint64 as data type",
    ),
    # Reductions and scans check the axis strictly: NumPy lets 0 and -1 through on 0-d.
    ("sum(axis=-1) of 0-d", lambda xp: xp.asarray(1.0).sum(axis=-1), _axis_error(-1, 0)),
    ("amax(axis=-1, keepdims) of 0-d", lambda xp: xp.amax(xp.asarray(1.0), axis=-1, keepdims=True), _axis_error(-1, 0)),
    ("max(axis=0) of 0-d", lambda xp: xp.asarray(1.0).max(axis=0), _axis_error(0, 0)),
    ("mean(axis=(0,)) of 0-d", lambda xp: xp.asarray(1.0).mean(axis=(0,)), _axis_error(0, 0)),
    ("cumsum(axis=0) of 0-d", lambda xp: xp.asarray(1.0).cumsum(axis=0), _axis_error(0, 0)),
    ("sum(axis=2) of 2-d", lambda xp: xp.zeros((2, 3)).sum(axis=2), _axis_error(2, 2)),
    ("sum(axis=()) of 0-d", lambda xp: float(xp.asarray(2.5).sum(axis=())), 2.5),
    ("sum(axis=None, keepdims) of 0-d", lambda xp: xp.asarray(2.5).sum(keepdims=True).shape, ()),
    # Stream capture (CuPy's tests/cupy_tests/cuda_tests/test_graph.py, cupy/cuda/stream.pyx,
    # memory.pyx): CuPy refuses some calls itself, before CUDA (the capture goes on); CUDA
    # refuses others and invalidates the capture. Relaxed mode (CuPy's default) forbids other
    # threads nothing.
    (
        "capture: begin_capture on the legacy stream",
        lambda xp: _raised(xp.cuda.Stream.null.begin_capture),
        "RuntimeError: cannot capture on the default (legacy) stream",
    ),
    (
        "capture: ndarray.set (a host-to-device copy), refused by CuPy",
        _set_refused,
        ("RuntimeError: the current stream is capturing, so H2D transfers are disallowed", "graph"),
    ),
    (
        "capture: Stream.synchronize, refused by CUDA",
        lambda xp: _captured(xp, lambda s: _raised(s.synchronize)),
        ("CUDARuntimeError: cudaErrorStreamCaptureUnsupported", "CUDARuntimeError: cudaErrorStreamCaptureInvalidated"),
    ),
    (
        "capture: Stream.done (a query), invalidates",
        lambda xp: _captured(xp, lambda s: s.done)[1],
        "CUDARuntimeError: cudaErrorStreamCaptureInvalidated",
    ),
    (
        "capture: cuBLAS (matmul), refused by CuPy",
        _matmul_refused,
        ("NotImplementedError: calling cuBLAS API during stream capture is currently unsupported", "graph"),
    ),
    (
        "capture: a kernel is recorded, not run; each launch runs it",
        _recorded_then_replayed,
        [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]],
    ),
    ("capture: another thread allocates and computes meanwhile", _other_thread_during_capture, (599998.0, "graph")),
    ("capture: an allocator serving existing memory", _served_from_existing_memory, ([2.0, 2.0, 2.0, 2.0], True)),
    # Cross-stream capture (CUDA's programming guide, "Cross-stream Dependencies and Events"):
    # a stream that waits on an event recorded in a capture joins it; the origin stream must
    # wait on the forked work before end_capture. Querying a captured event is invalid, and
    # so is a capturing stream waiting on work outside the capture.
    (
        "capture: a stream waiting on a captured event joins it",
        lambda xp: _forked(xp, True),
        (True, [0.0, 0.0], [1.0, 1.0], "graph", False),
    ),
    (
        "capture: a fork not joined back fails end_capture",
        lambda xp: _forked(xp, False),
        (True, [0.0, 0.0], [0.0, 0.0], "CUDARuntimeError: cudaErrorStreamCaptureUnjoined", False),
    ),
    (
        "capture: is_capturing of an invalidated capture",
        lambda xp: _captured(xp, lambda s: (_raised(s.synchronize), _raised(s.is_capturing)))[0][1],
        "RuntimeError: the stream was capturing, but an error has invalidated the capture sequence",
    ),
    (
        "capture: Event.done of a captured event",
        _event_done_in_capture,
        (False, "CUDARuntimeError: cudaErrorStreamCaptureInvalidated"),
    ),
    (
        "capture: waiting on an event from before the capture",
        _wait_on_an_uncaptured_event,
        ("CUDARuntimeError: cudaErrorStreamCaptureIsolation", "CUDARuntimeError: cudaErrorStreamCaptureInvalidated"),
    ),
    # (after synchronizing: queried at once, a just-recorded event was not done yet on an H200)
    (
        "Event.done outside a capture",
        lambda xp: _done_once_synchronized(xp.cuda.Stream(non_blocking=True).record()),
        True,
    ),
    (
        "using_allocator: set_allocator inside it",
        _set_allocator_inside_using_allocator,
        "ValueError: Can't change the global allocator inside `using_allocator` context manager",
    ),
    ("using_allocator: the calling thread's only", _using_allocator_is_thread_local, (True, False, False)),
    # ReductionKernel: CuPy's CUB path renames the input inside other identifiers too.
    (
        "ReductionKernel, CUB path: x inside complex renamed",
        lambda xp: _cub_moments(xp, "complex<double>(x, (double)x * x)", "F"),
        "CompileException",
    ),
    (
        "ReductionKernel, no CUB path (C order)",
        lambda xp: _cub_moments(xp, "complex<double>(x, (double)x * x)", "C"),
        256 + 256j,
    ),
    (
        "ReductionKernel, CUB path: x alone",
        lambda xp: _cub_moments(xp, "moment((double)x)", "F", _MOMENT),
        256 + 256j,
    ),
    # What holds an array's memory (cupy/cuda/memory.pyx, cupy/_core/core.pyx,
    # _routines_indexing.pyx, cupy/lib/stride_tricks.py): a pointer holds its memory object,
    # `+` makes a new pointer over the same one (CuPy's `+=` moves the pointer itself, and its
    # arrays with it: the stand-in refuses it, test_cupy_standin.py); a view made by `_view`
    # shares its owner's pointer, one made by indexing gets `a.data + offset`; both name the
    # owner as base; as_strided is `ndarray(memptr=x.data)`, with no base.
    (
        "MemoryPointer: p + 4 holds the same memory",
        lambda xp: (lambda a: (a.data + 4).mem is a.data.mem)(_arange(xp)),
        True,
    ),
    ("view: transpose", lambda xp: _references(xp, lambda xp, a: a.T), (True, True, True)),
    ("view: reshape", lambda xp: _references(xp, lambda xp, a: a.reshape(3, 2)), (True, True, True)),
    ("view: view()", lambda xp: _references(xp, lambda xp, a: a.view()), (True, True, True)),
    ("view: a[1:]", lambda xp: _references(xp, lambda xp, a: a[1:]), (False, True, True)),
    ("view: a[:] (no offset)", lambda xp: _references(xp, lambda xp, a: a[:]), (False, True, True)),
    ("view: a[1:][:, 1:] names the owner", lambda xp: _references(xp, lambda xp, a: a[1:][:, 1:]), (False, True, True)),
    (
        "as_strided: memptr=x.data, no base",
        lambda xp: _references(xp, lambda xp, a: xp.lib.stride_tricks.as_strided(a, (2,), (4,))),
        (True, True, False),
    ),
    (
        "UnownedMemory: holds its owner",
        lambda xp: (lambda a: xp.cuda.UnownedMemory(a.data.ptr, a.nbytes, a, 0)._owner is a)(_arange(xp)),
        True,
    ),
    # NCCL errors: NcclError(status), the message CuPy's name and NCCL's string.
    (
        "NcclError(5)",
        lambda xp: _nccl_error(xp, 5),
        (5, "NCCL_ERROR_INVALID_USAGE: invalid usage (run with NCCL_DEBUG=WARN for details)"),
    ),
    (
        "NcclError(4)",
        lambda xp: _nccl_error(xp, 4),
        (4, "NCCL_ERROR_INVALID_ARGUMENT: invalid argument (run with NCCL_DEBUG=WARN for details)"),
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_behaves_as_cupy(xp, row):
    _, fn, expected = row
    if isinstance(expected, AxisErrorRow):
        with pytest.raises(np.exceptions.AxisError, match=re.escape(expected.message)):
            fn(xp)
        return
    got = fn(xp)
    assert got == expected and type(got) is type(expected), f"{xp.__name__}: {got!r}, CuPy gives {expected!r}"
