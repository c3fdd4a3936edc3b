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

Streams join a capture as CUDA's do ("Cross-stream Dependencies and Events" of its
programming guide): an event recorded on a capturing stream is a captured event (the
kernels recorded so far on that stream); a stream that waits on one joins the capture, its
kernels are recorded into the same graph, and the origin stream must wait on an event
recorded after them before its ``end_capture``, else ``cudaErrorStreamCaptureUnjoined``
(every stream of the capture leaves capture mode either way; ``end_capture`` on a stream
that joined is ``cudaErrorStreamCaptureUnmatched``). ``Event.done`` of a captured event
answers False and invalidates the capture (cudaEventQuery is not allowed there); a
capturing stream that waits on an event recorded outside the capture fails with
``cudaErrorStreamCaptureIsolation``, on one of another capture with
``cudaErrorStreamCaptureMerge``, and invalidates its capture.

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
_MERGE = 902
_UNMATCHED = 903
_UNJOINED = 904
_ISOLATION = 905
_ILLEGAL_STATE = 401
_MESSAGES = {  # cudaGetErrorString's, after CUDA's names (as CuPy's CUDARuntimeError shows them)
    _UNSUPPORTED: "cudaErrorStreamCaptureUnsupported: operation not permitted when stream is capturing",
    _INVALIDATED: "cudaErrorStreamCaptureInvalidated: operation failed due to a previous error during capture",
    _MERGE: "cudaErrorStreamCaptureMerge: operation would result in a merge of separate capture sequences",
    _UNMATCHED: "cudaErrorStreamCaptureUnmatched: capture was not ended in the same stream as it began",
    _UNJOINED: "cudaErrorStreamCaptureUnjoined: capturing stream has unjoined work",
    _ISOLATION: "cudaErrorStreamCaptureIsolation: dependency created on uncaptured work in another stream",
    _ILLEGAL_STATE: "cudaErrorIllegalState: the operation cannot be performed in the present state",
}
CUBLAS_MESSAGE = "calling cuBLAS API during stream capture is currently unsupported"
H2D_MESSAGE = "the current stream is capturing, so H2D transfers are disallowed"  # CuPy's, memory.pyx
CURAND_MESSAGE = "calling cuRAND API during stream capture is currently unsupported"


def cuda_error(status: int) -> runtime.CUDARuntimeError:
    return runtime.CUDARuntimeError(status, _MESSAGES[status])


class _Capture:
    """The state of one capture: the recorded kernels, whether it failed, and the streams
    in it: the origin stream (``stream``) and those that joined it by waiting on one of its
    events. ``frontier`` maps each stream's handle to the kernels its next one will depend
    on; ``deps`` holds each kernel's (what end_capture reads to see that every fork was
    joined back)."""

    __slots__ = ("stream", "mode", "thread", "nodes", "invalidated", "frontier", "deps")

    def __init__(self, stream, mode: int):
        self.stream = stream
        self.mode = mode
        self.thread = threading.get_ident()  # the thread that began it
        self.nodes: list = []  # (kind, fn, blocks)
        self.invalidated = False
        self.frontier: dict = {stream.ptr: frozenset()}
        self.deps: list = []

    def add(self, stream_ptr: int, node) -> None:
        """A kernel launched on stream ``stream_ptr`` (in the capture): after its frontier."""
        self.deps.append(self.frontier.get(stream_ptr, frozenset()))
        self.frontier[stream_ptr] = frozenset((len(self.nodes),))
        self.nodes.append(node)

    def unjoined(self) -> bool:
        """Whether a stream that joined has work the origin stream does not wait on."""
        seen, todo = set(), list(self.frontier[self.stream.ptr])
        while todo:  # the origin's frontier and everything before it
            k = todo.pop()
            if k not in seen:
                seen.add(k)
                todo.extend(self.deps[k])
        return any(not nodes <= seen for ptr, nodes in self.frontier.items() if ptr != self.stream.ptr)


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
    capture = _captures.get(stream.ptr)
    if capture is None:
        raise cuda_error(_ILLEGAL_STATE)
    if capture.stream.ptr != stream.ptr:  # a stream that joined: the origin ends the capture
        raise fail(capture, _UNMATCHED)
    for ptr in capture.frontier:  # every stream of the capture leaves capture mode
        _captures.pop(ptr, None)
    if not _captures:
        counting._capture_guard = None
    if capture.invalidated:
        raise cuda_error(_INVALIDATED)
    if capture.unjoined():
        raise cuda_error(_UNJOINED)
    return Graph(capture.nodes, stream.device_id)


def record_event(event, stream) -> None:
    """``event`` recorded on ``stream``: in a capture, a captured event (the kernels the
    stream's next one would depend on); else an event of work already done here."""
    capture = capture_of(stream)
    event._capture = capture
    event._nodes = capture.frontier.get(stream.ptr, frozenset()) if capture is not None else None


def wait_event(stream, event) -> None:
    """``stream`` waits on ``event`` (``cudaStreamWaitEvent``). Outside a capture, nothing
    to order here, except that waiting on an event recorded in a capture that goes on makes
    the stream join it: its work from then on is captured in that graph (and the origin
    stream must wait on it before ``end_capture``). A capturing stream may wait on an event
    of its own capture only: one of another capture is CUDA's cudaErrorStreamCaptureMerge,
    one recorded outside any capture cudaErrorStreamCaptureIsolation (both invalidate)."""
    captured = getattr(event, "_capture", None)
    if captured is not None and _captures.get(captured.stream.ptr) is not captured:
        captured = None  # its capture has ended: the event stands for work done
    mine = capture_of(stream)
    if mine is None:
        if captured is None:
            return
        if stream.ptr == 0:
            raise NotImplementedError(
                "cupy stand-in: the legacy default stream waiting on an event of a capture is not modelled"
            )
        _captures[stream.ptr] = captured  # the stream joins the capture
        captured.frontier[stream.ptr] = event._nodes
        return
    if captured is mine:
        mine.frontier[stream.ptr] = mine.frontier.get(stream.ptr, frozenset()) | event._nodes
        return
    if getattr(event, "_recorded_on", None) is None:
        return  # an event never recorded: nothing to wait for
    if captured is not None:
        captured.invalidated = True
        raise fail(mine, _MERGE)
    raise fail(mine, _ISOLATION)


def query_event(event) -> bool:
    """``Event.done``: True outside a capture (the work is done here). Querying an event
    recorded in a capture that goes on is invalid: the capture is invalidated, and CuPy's
    ``done`` answers False (cudaEventQuery's status is not cudaSuccess)."""
    captured = getattr(event, "_capture", None)
    if captured is not None and _captures.get(captured.stream.ptr) is captured:
        captured.invalidated = True
        return False
    return True


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


def fail(capture: _Capture, status: int = _UNSUPPORTED) -> runtime.CUDARuntimeError:
    """Invalidates ``capture`` and returns the error CUDA answers (the caller raises it)."""
    capture.invalidated = True
    return cuda_error(status)


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


def record(kind: str, fn, stream_ptr=None, arrays=()) -> bool:
    """Records kernel ``fn`` (a function that writes into existing device memory) into the
    capture of the current stream (or of stream ``stream_ptr``) and returns True; False
    when nothing captures (the caller then runs it and counts its launch). ``arrays``: the
    device arrays it reads and writes; a launch refuses to replay it once one's memory went
    back to the pool (on a GPU: a kernel on freed memory, silently wrong)."""
    if not _captures:
        return False
    if stream_ptr is None:
        stream_ptr = _current_stream().ptr
    capture = _captures.get(int(stream_ptr))
    if capture is None:
        return False
    if capture.invalidated:
        raise cuda_error(_INVALIDATED)
    blocks = [weakref.ref(a.data.mem) for a in arrays if getattr(a, "data", None) is not None and a.data.mem.ptr]
    capture.add(int(stream_ptr), (kind, fn, blocks))
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
    if _captures and record(kind, fn, stream_ptr, arrays):
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
            record("graph", replay, stream.ptr)
            return
        replay()
        counting.launch("graph")


runtime._any_capture = any_capture
runtime._fail = fail
