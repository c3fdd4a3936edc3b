"""``cupy.cuda.Stream`` and ``Event`` of the stand-in: CuPy's API, ordering nothing.

Every stand-in operation has finished when its call returns, so on the CPU a stream
orders nothing and an event is ``done``. What is checked is what CuPy and CUDA check: a
stream is made current only on the device it was created on, a stream handle (``ptr``)
names a live stream, and an event is waited on only after it exists. In a capture, events
are CUDA's (:mod:`.graph`): a stream that waits on an event recorded in a capture joins
it, and querying or synchronizing such an event is invalid.
"""

from __future__ import annotations

import itertools
import threading
import weakref

from .. import counting
from . import graph as _graph
from . import runtime

_handles = itertools.count(0x5000)  # fake, unique, non-zero handles (0 is the null stream)
_live_streams: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # ptr -> Stream
_local = threading.local()  # .current: {device id: stream}; .stack: streams of ``with`` blocks


def _check_device(device_id: int) -> int:
    current = runtime.getDevice()
    if device_id == -1:
        return current
    if device_id != current:
        raise RuntimeError(
            f"The device that the stream is created on ({device_id}) does not match with the current device ({current})"
        )
    return device_id


class Event:
    """A CUDA event: ``record`` it on a stream, make another stream ``wait_event`` on it.

    On the stand-in the work before a record is already done: ``done`` is True, except for
    an event recorded in a capture that goes on, which stands for no work yet (see
    :func:`.graph.query_event`); a stream that waits on such an event joins the capture
    (:func:`.graph.wait_event`).
    """

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False):
        if interprocess and not disable_timing:
            raise ValueError("Timing must be disabled for interprocess events")
        self.ptr = next(_handles)
        self._recorded_on = None
        self._capture = None
        self._nodes = None

    @property
    def done(self) -> bool:
        return _graph.query_event(self)

    def record(self, stream=None) -> None:
        self._recorded_on = get_current_stream() if stream is None else stream
        _graph.record_event(self, self._recorded_on)

    def synchronize(self) -> None:
        """Returns at once (nothing is pending); a host synchronization on a GPU. Refused for
        an event recorded in a capture that is still going on (it stands for no work)."""
        capture = getattr(self, "_capture", None)
        if capture is not None and _graph.capture_of(capture.stream) is capture:
            raise _graph.fail(capture)
        counting.host_sync("synchronize")


class _BaseStream:
    def __init__(self, ptr: int, device_id: int):
        self.ptr = ptr
        self.device_id = device_id

    def __eq__(self, other) -> bool:
        return isinstance(other, _BaseStream) and other.ptr == self.ptr

    def __hash__(self) -> int:
        return self.ptr

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.ptr} (device {self.device_id})>"

    def __enter__(self):
        device_id = _check_device(self.device_id)
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        stack.append((device_id, _current().get(device_id)))
        _current()[device_id] = self
        return self

    def __exit__(self, *exc) -> None:
        device_id, previous = _local.stack.pop()
        if previous is None:
            _current().pop(device_id, None)
        else:
            _current()[device_id] = previous

    def use(self):
        """Makes this stream current for its device (the current device)."""
        _current()[_check_device(self.device_id)] = self
        return self

    @property
    def done(self) -> bool:
        """True (nothing is pending); querying a capturing stream invalidates its capture
        (CUDA's cudaStreamQuery fails there) and answers False."""
        capture = _graph.capture_of(self)
        if capture is not None:
            capture.invalidated = True
            return False
        return True

    def synchronize(self) -> None:
        """Returns at once (nothing is pending); a host synchronization on a GPU. On a
        capturing stream: ``cudaErrorStreamCaptureUnsupported``, and the capture is invalid."""
        capture = _graph.capture_of(self)
        if capture is not None:
            raise _graph.fail(capture)
        counting.host_sync("synchronize")

    def begin_capture(self, mode=None) -> None:
        """Starts capturing the work launched on this stream into a graph (``mode``: one of
        ``runtime.streamCaptureMode*``; CuPy's default is relaxed). The null stream cannot
        be captured."""
        _graph._begin(self, mode)

    def end_capture(self) -> _graph.Graph:
        """Ends the capture and returns the :class:`~.graph.Graph` of the recorded work. A
        capture that an illegal operation invalidated ends too, raising
        ``cudaErrorStreamCaptureInvalidated``; a stream that does not capture raises
        ``cudaErrorIllegalState``."""
        return _graph._end(self)

    def is_capturing(self) -> bool:
        """Whether the stream is in capture mode; for a capture an error invalidated (it stays
        in capture mode until ``end_capture``), CuPy's RuntimeError, as ``streamIsCapturing``
        raises on CUDA's cudaStreamCaptureStatusInvalidated."""
        capture = _graph.capture_of(self)
        if capture is not None and capture.invalidated:
            raise RuntimeError("the stream was capturing, but an error has invalidated the capture sequence")
        return capture is not None

    def record(self, event: Event | None = None) -> Event:
        """Records an event on this stream (a new one when ``event`` is None)."""
        if event is None:
            event = Event()
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        """Orders this stream after ``event``: nothing to order on the stand-in, except in a
        capture (:func:`.graph.wait_event`: a stream joins the capture of an event recorded
        in it; a capturing stream may wait on its own capture's events only)."""
        if not isinstance(event, Event):
            raise TypeError(f"wait_event takes a cupy.cuda.Event, got {type(event).__name__}")
        _graph.wait_event(self, event)


class Stream(_BaseStream):
    """A CUDA stream of the current device (``Stream.null`` is the default stream, ptr 0)."""

    null: Stream = None  # set below

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False, priority=None):
        if null:
            super().__init__(0, -1)
        else:
            super().__init__(next(_handles), runtime.getDevice())
            _live_streams[self.ptr] = self
        self.non_blocking = bool(non_blocking)


Stream.null = Stream(null=True)


def _current() -> dict:
    current = getattr(_local, "current", None)
    if current is None:
        current = _local.current = {}
    return current


def get_current_stream(device_id: int = -1) -> Stream:
    """The calling thread's current stream of a device (default: the current device)."""
    if device_id == -1:
        device_id = runtime.getDevice()
    return _current().get(device_id, Stream.null)


_graph._current_stream = get_current_stream


def _stream_device(ptr: int) -> int | None:
    """The device of a live stream handle; -1 for the null stream; None if no such stream."""
    if ptr == 0:
        return -1
    stream = _live_streams.get(ptr)
    return None if stream is None else stream.device_id
