"""``cupy.cuda.Graph`` of the stand-in, and the rules of stream capture.

``Stream.begin_capture()`` puts a stream into capture mode; from then on the kernels CuPy
would launch on that stream are *recorded*, not run, and ``Stream.end_capture()`` returns
them as a :class:`Graph` whose ``launch()`` runs them again, in order, on the same
buffers: one launch of kind ``"graph"`` (:mod:`..counting`). A kernel's scalar arguments
are baked into the graph at capture, its arrays are addresses: a replay reads what those
buffers hold at the time.

A capture is in CUDA's relaxed mode unless ``begin_capture(mode)`` says otherwise (CuPy's
default), and belongs to the stream, so to the thread whose current stream it is. What
CUDA and CuPy refuse while a stream captures, the stand-in refuses the same way:

- a host synchronization from an array (``get``, ``float``, ``bool``, ``item``,
  ``tolist``, a mask's count, ...): CuPy checks first and raises ``RuntimeError`` (the
  message says the stream "is capturing"); the capture goes on;
- a host-to-device copy onto the capturing stream (``ndarray.set``, ``asarray`` of a host
  array, a host index): CuPy checks first and raises its own ``RuntimeError`` ("the
  current stream is capturing, so H2D transfers are disallowed"); the capture goes on;
- ``Stream.synchronize()``, ``Event.synchronize()`` of an event recorded in the capture,
  ``Device.synchronize()`` / ``runtime.deviceSynchronize()`` reach CUDA, which answers
  ``CUDARuntimeError`` ``cudaErrorStreamCaptureUnsupported`` and invalidates the capture:
  ``end_capture`` then raises ``cudaErrorStreamCaptureInvalidated`` (and leaves capture
  mode); so does a ``cudaMalloc`` (a new block of the pool, a raw allocation) from a
  thread a capture of the device forbids it to: its own capture in global or thread-local
  mode, another thread's in global mode; a relaxed capture forbids no other thread
  anything, so another thread allocates and launches on its own streams as usual;
- a cuBLAS call (``matmul``, ``dot``, ``tensordot``, ``einsum``, ...) and a cuRAND one:
  CuPy raises ``NotImplementedError("calling cuBLAS API during stream capture is
  currently unsupported")`` before calling the library; the capture goes on.

A stream whose capture failed stays capturing until ``end_capture`` is called, as on a
GPU. The stand-in is stricter than CUDA in one place, on purpose: an allocation from the
pool (or a raw one) by the thread whose current stream captures. In relaxed mode CUDA
lets it through, and its address is baked into the graph, while the pool hands the block
out again once the array is freed: on a GPU the graph's later launches write memory
something else owns, silently. The stand-in raises a ``RuntimeError`` that names it (and
invalidates the capture), so code that captures here allocates nothing from the pool
inside a graph. Memory an allocator (``cupy.cuda.using_allocator`` or ``set_allocator``)
hands out of an allocation that already exists (a plan's arena) is not an allocation CUDA
sees, and is served. And it records only the launches it knows how to replay (ufuncs and
kernels writing into ``out=``, ``copyto``, ``fill``, assignment into a view,
``ElementwiseKernel``/``ReductionKernel`` with their outputs given, ``Generator`` draws,
the cuDNN stand-in's ``execute``, NCCL's allreduce, and, their outputs allocated by the
current allocator: ufuncs and the routines that compute through NumPy, reductions and
argmax/argmin, ``zeros`` (a memset), scatters); any other launch during capture raises
``NotImplementedError`` naming it.
"""

from __future__ import annotations

import threading
import weakref

from .. import counting
from . import runtime

_UNSUPPORTED = 900
_INVALIDATED = 901
_ILLEGAL_STATE = 401
_MESSAGES = {
    _UNSUPPORTED: "cudaErrorStreamCaptureUnsupported: operation not permitted when stream is capturing",
    _INVALIDATED: "cudaErrorStreamCaptureInvalidated: operation failed due to a previous error during capture",
    _ILLEGAL_STATE: "cudaErrorIllegalState: the operation cannot be performed in the present state",
}
CUBLAS_MESSAGE = "calling cuBLAS API during stream capture is currently unsupported"
H2D_MESSAGE = "the current stream is capturing, so H2D transfers are disallowed"  # CuPy's, memory.pyx
CURAND_MESSAGE = "calling cuRAND API during stream capture is currently unsupported"


def cuda_error(status: int) -> runtime.CUDARuntimeError:
    return runtime.CUDARuntimeError(status, _MESSAGES[status])


class _Capture:
    """The state of one stream's capture: the recorded kernels, and whether it failed."""

    __slots__ = ("stream", "mode", "thread", "nodes", "invalidated")

    def __init__(self, stream, mode: int):
        self.stream = stream
        self.mode = mode
        self.thread = threading.get_ident()  # the thread that began it
        self.nodes: list = []  # (kind, fn)
        self.invalidated = False


_captures: dict[int, _Capture] = {}  # stream ptr -> its capture (all threads)
_current_stream = None  # set by .stream (which imports this module): get_current_stream


def _begin(stream, mode) -> None:
    if mode is None:
        mode = runtime.streamCaptureModeRelaxed  # CuPy's default
    if mode not in (
        runtime.streamCaptureModeGlobal,
        runtime.streamCaptureModeThreadLocal,
        runtime.streamCaptureModeRelaxed,
    ):
        raise runtime.CUDARuntimeError(1, "cudaErrorInvalidValue: invalid argument")
    if stream.ptr == 0:  # CuPy refuses the legacy default stream itself, before CUDA
        raise RuntimeError("cannot capture on the default (legacy) stream")
    if stream.ptr in _captures:
        raise cuda_error(_ILLEGAL_STATE)
    _captures[stream.ptr] = _Capture(stream, mode)
    counting._capture_guard = _guard


def _end(stream) -> Graph:
    capture = _captures.pop(stream.ptr, None)
    if not _captures:
        counting._capture_guard = None
    if capture is None:
        raise cuda_error(_ILLEGAL_STATE)
    if capture.invalidated:
        raise cuda_error(_INVALIDATED)
    return Graph(capture.nodes, stream.device_id)


def capture_of(stream):
    """The capture of ``stream`` (a Stream), or None."""
    return _captures.get(stream.ptr) if _captures else None


def current_capture():
    """The capture of the current device's current stream, or None."""
    if not _captures:
        return None
    return _captures.get(_current_stream().ptr)


def any_capture(device_id: int | None = None):
    """Some capture on ``device_id`` (None: any device), or None."""
    for capture in _captures.values():
        if device_id is None or capture.stream.device_id == device_id:
            return capture
    return None


def fail(capture: _Capture) -> runtime.CUDARuntimeError:
    """Invalidates ``capture`` and returns the error CUDA answers (the caller raises it)."""
    capture.invalidated = True
    return cuda_error(_UNSUPPORTED)


def check_allocation(device_id: int, nbytes: int, new_block: bool, source: str) -> None:
    """An allocation of ``nbytes`` on ``device_id`` while some stream captures (``new_block``:
    it calls cudaMalloc; ``source``: who allocates, for the message). By the thread whose
    current stream captures: baked into the graph, refused by name (see the module
    docstring). A cudaMalloc a capture forbids (its own thread's in global or thread-local
    mode, any thread's in global mode): CUDA's error, the capture invalidated."""
    capture = current_capture()
    if capture is not None and capture.stream.device_id == device_id:
        capture.invalidated = True
        raise RuntimeError(
            f"cupy stand-in: {source} allocated {nbytes:,} bytes on device {device_id} while the current stream "
            "captures a CUDA graph. CUDA lets it through in relaxed capture mode and bakes its address into the "
            "graph, but the memory goes back to the pool (or to cudaFree) when the array is freed, and the "
            "graph's later launches write memory something else owns: a silent corruption on a GPU. Allocate "
            "before the capture, or serve the capture from memory the graph owns (cupy.cuda.using_allocator)."
        )
    if not new_block:
        return
    thread = threading.get_ident()
    for other in _captures.values():
        if other.stream.device_id != device_id or other.mode == runtime.streamCaptureModeRelaxed:
            continue
        if other.mode == runtime.streamCaptureModeGlobal or other.thread == thread:
            raise fail(other)


def check_library(message: str) -> None:
    """A cuBLAS/cuRAND call: refused by CuPy while the current stream captures."""
    if current_capture() is not None:
        raise NotImplementedError(message)


def record(kind: str, fn, capture=None, arrays=()) -> bool:
    """Records kernel ``fn`` (a function that writes into existing device memory) into the
    capture of the current stream (or ``capture``) and returns True; False when nothing
    captures (the caller then runs it and counts its launch). ``arrays``: the device arrays
    it reads and writes; a launch refuses to replay it once one's memory went back to the
    pool (on a GPU: a kernel on freed memory, silently wrong)."""
    if capture is None:
        if not _captures:
            return False
        capture = current_capture()
        if capture is None:
            return False
    if capture.invalidated:
        raise cuda_error(_INVALIDATED)
    blocks = [weakref.ref(a.data.mem) for a in arrays if getattr(a, "data", None) is not None and a.data.mem.ptr]
    capture.nodes.append((kind, fn, blocks))
    return True


def run(kind: str, fn, size: int = 1, arrays=()) -> None:
    """Launches kernel ``fn`` on the current stream: recorded while it captures, else run
    now and counted (nothing for an empty output, as CuPy)."""
    if not size:
        return
    if not record(kind, fn, arrays=arrays):
        fn()
        counting.launch(kind)


def launch_on(stream_ptr: int, kind: str, fn, arrays=()) -> None:
    """A library kernel (cuDNN, NCCL) launched on the stream its handle or call names:
    recorded when that stream captures. Work on the legacy default stream while a blocking
    stream of the device captures is refused as CUDA refuses it; otherwise it runs now
    (uncaptured, as on a GPU)."""
    capture = _captures.get(int(stream_ptr)) if _captures else None
    if capture is not None:
        record(kind, fn, capture, arrays)
        return
    if int(stream_ptr) == 0 and _captures:
        for other in _captures.values():
            if other.stream.device_id == runtime.getDevice() and not other.stream.non_blocking:
                other.invalidated = True
                raise runtime.CUDARuntimeError(
                    906,
                    "cudaErrorStreamCaptureImplicit: operation would make the legacy stream depend on a "
                    "capturing blocking stream",
                )
    fn()
    counting.launch(kind, stream_checked=True)


_SYNC_KINDS_CUPY_CHECKS = frozenset(
    {"get", "float", "int", "bool", "complex", "item", "tolist", "tobytes", "mask", "nonzero"}
)


def _guard(event: str, kind: str) -> None:
    """Called by :mod:`..counting` for a launch or a host sync while some stream captures."""
    capture = current_capture()
    if capture is None:
        return
    if event == "sync":
        if kind in _SYNC_KINDS_CUPY_CHECKS:
            raise RuntimeError(
                f"the current stream is capturing: a host synchronization ({kind}) is not allowed during stream capture"
            )
        raise fail(capture)
    if kind == "h2d":  # CuPy checks the stream before calling CUDA: the capture goes on
        raise RuntimeError(H2D_MESSAGE)
    raise NotImplementedError(
        f"cupy stand-in: a {kind!r} launch during stream capture is not one it can record "
        f"(only kernels writing into given outputs are)"
    )


class Graph:
    """A captured CUDA graph (``cupy.cuda.Graph``): ``launch`` replays its kernels."""

    def __init__(self, nodes, device_id: int):
        self._nodes = list(nodes)
        self._device_id = device_id

    def __len__(self) -> int:  # the stand-in's own: how many kernels the graph holds
        return len(self._nodes)

    def kinds(self) -> dict:
        """The stand-in's own: ``{kind: kernels}`` the graph holds."""
        out: dict = {}
        for kind, _, _ in self._nodes:
            out[kind] = out.get(kind, 0) + 1
        return out

    def upload(self, stream=None) -> None:
        """Uploads the graph to the device (nothing to do on the stand-in)."""

    def launch(self, stream=None) -> None:
        """Runs the recorded kernels on ``stream`` (default: the current stream): one launch."""
        if runtime.getDevice() != self._device_id:
            raise runtime.CUDARuntimeError(400, "cudaErrorInvalidResourceHandle: invalid resource handle")
        stream = _current_stream() if stream is None else stream
        capture = capture_of(stream)
        nodes = self._nodes
        for i, (kind, _, blocks) in enumerate(nodes):
            if any(ref() is None or not ref().ptr for ref in blocks):
                raise RuntimeError(
                    f"cupy stand-in: kernel {i} ({kind}) of this graph uses device memory that was freed "
                    "since the capture; on a GPU the replay would read and write memory the pool has "
                    "handed out again. Keep every buffer a graph uses alive while the graph is launched."
                )

        def replay():
            for _kind, fn, _blocks in nodes:
                fn()

        if capture is not None:  # a graph launched into a capture becomes a child graph
            record("graph", replay, capture)
            return
        replay()
        counting.launch("graph")


runtime._any_capture = any_capture
runtime._fail = fail
