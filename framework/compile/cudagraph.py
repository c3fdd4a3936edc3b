"""A GPU program replayed as one CUDA graph (docs/COMPILE.md, "CUDA graphs").

A planned program runs its nodes in a fixed order on buffers that the plan fixed: that
is what CUDA's stream capture needs. :class:`GraphReplay` captures the executor's replay
function once on a side stream (``Stream.begin_capture`` / ``end_capture``); every later
call copies the step's tensor arguments into static input slots and launches the graph:
one launch, plus one copy per argument and one per returned tensor (copied out, since the
next launch writes over the graph's buffers).

What CUDA and CuPy refuse during capture (an allocation, a host synchronization, a host
transfer, cuBLAS) makes the capture fail: the capture is ended (no stream is left
capturing), :attr:`GraphReplay.reason` says in one line which node could not be captured
and why, and the step keeps running uncaptured (the plan still applies).

The kernels allocate their outputs, temporaries and library workspaces as they do eagerly.
So the first replay runs uncaptured and records its pool allocations (sizes, lifetimes);
they are packed into one more device allocation, the graph's private arena, and the next
call captures with an allocator that hands each allocation its place there
(:class:`_GraphPool`): nothing reaches CuPy's pool or cudaMalloc during the capture.

The traced scalars (learning rate, Adam's step count, ...) are read by the graph's kernels
from one small device buffer (:class:`_DeviceScalar`), rewritten by one host-to-device
copy before each launch; a scalar an op uses as a Python number is baked into the graph,
and the graph is launched only while the baked ones have their capture values (else the
call runs uncaptured). Every other program input (parameters, optimizer state) must still
be the array it was (else the graph is captured again, up to :data:`RECAPTURES` times).
"""

from __future__ import annotations

import contextlib
import operator
import os
import re
import sys

import numpy as np

from .. import backend, memory
from .plan import greedy_by_size

RECAPTURES = 3
POOL_ALIGN = 512  # CuPy's pool rounds every request to 512 bytes


class _AllocationRecorder:
    """Records the pool allocations of one uncaptured replay on a device: the size of each
    (in allocation order) and when it went back to the pool (a CuPy memory hook)."""

    def __init__(self, xp, device_id: int):
        base = xp.cuda.MemoryHook
        recorder = self

        class Hook(base):
            name = "fw_compile_graph_pool"

            def malloc_postprocess(self, **kw):
                if kw["device_id"] == device_id and kw["mem_size"]:
                    recorder.live[kw["pmem_id"]] = len(recorder.sizes)
                    recorder.sizes.append(kw["mem_size"])
                    recorder.spans.append([recorder.clock, None])
                    recorder.clock += 1

            def free_postprocess(self, **kw):
                k = recorder.live.pop(kw["pmem_id"], None)
                if k is not None:
                    recorder.spans[k][1] = recorder.clock
                    recorder.clock += 1

        self.hook = Hook()
        self.sizes: list = []
        self.spans: list = []
        self.live: dict = {}
        self.clock = 0

    def layout(self):
        """``(offsets, arena bytes)``: each allocation's offset in one arena where no two
        that are live at once meet. An allocation still alive when the replay ended (a
        gradient, a returned value, new optimizer state) keeps its bytes for the whole step:
        the next launch must not write over it before reading it."""
        end = self.clock
        items = [
            (k, size, 0 if stop is None else start, end if stop is None else stop)
            for k, (size, (start, stop)) in enumerate(zip(self.sizes, self.spans))
        ]
        return greedy_by_size(items, POOL_ALIGN)


class _GraphPool:
    """The allocator CuPy uses while the step is captured: the k-th allocation gets its
    planned place in the graph's arena (allocated before the capture), so nothing reaches
    CuPy's pool or cudaMalloc while the stream captures. A request that is not the
    recorded one (another size, one more) raises: the capture fails with that reason."""

    def __init__(self, xp, arena, sizes, offsets):
        self.xp, self.arena, self.sizes, self.offsets = xp, arena, sizes, offsets
        self.next = 0
        self.previous = None

    def malloc(self, size: int):
        size = int(size)
        if size == 0:
            return self.previous(0)
        k = self.next
        rounded = -(-size // POOL_ALIGN) * POOL_ALIGN
        if k >= len(self.sizes) or self.sizes[k] != rounded:
            recorded = f"{self.sizes[k]} bytes" if k < len(self.sizes) else "none"
            raise RuntimeError(
                f"allocation {k} during the capture ({rounded} bytes) is not the recorded one ({recorded}): "
                "the step allocates differently from call to call"
            )
        self.next += 1
        base = self.arena.data
        return self.xp.cuda.MemoryPointer(base.mem, base.ptr - base.mem.ptr + self.offsets[k])

    def __enter__(self):
        self.previous = self.xp.cuda.get_allocator()
        self.xp.cuda.set_allocator(self.malloc)
        return self

    def __exit__(self, *_):
        self.xp.cuda.set_allocator(self.previous)


class _DeviceScalar:
    """A traced scalar of a captured step, as its kernels see it: where an op multiplies an
    array by it (``Add``/``Sub``'s ``alpha``, ``backend.add_scaled_``), the kernel reads a
    0-d device array of the array's dtype (a slot of :attr:`GraphReplay.dscal`, rewritten
    by one host-to-device copy before each launch), so the graph follows a learning-rate
    schedule. Comparisons read the host value (the capture recorded guards on them, checked
    at every call). Any other use (``float()``, Python arithmetic, another dtype) bakes the
    value into the graph: the slot is then compared at every call, and a call with another
    value runs uncaptured."""

    __array_priority__ = 1000  # ``array * scalar`` asks the scalar (CuPy's rule, as NumPy's)

    def __init__(self, owner, slot: int, value):
        self.owner, self.slot, self.value = owner, slot, value

    def on_device(self, dtype):
        views = self.owner.dscal_views.get(getattr(dtype, "name", str(dtype)))
        if views is None:
            return self._bake()
        return views[self.slot]

    def _bake(self):
        self.owner.baked.add(self.slot)
        return self.value

    def __float__(self):
        return float(self._bake())

    def __int__(self):
        return int(self._bake())

    def __index__(self):
        return self._bake().__index__()

    def __bool__(self):
        return bool(self.value)

    def __hash__(self):
        return hash(self.value)

    def __repr__(self):
        return f"<device scalar {self.slot}: {self.value!r}>"


def _arithmetic(op, reflected):
    def method(self, other):
        if isinstance(other, self.owner.xp.ndarray):  # an array on the device: the kernel reads the slot
            dev = self.on_device(other.dtype)
            return op(other, dev) if reflected else op(dev, other)
        return op(other, self._bake()) if reflected else op(self._bake(), other)

    return method


def _comparison(op):
    return lambda self, other: op(self.value, other)


for _name, _op in (("add", operator.add), ("sub", operator.sub), ("mul", operator.mul), ("truediv", operator.truediv)):
    setattr(_DeviceScalar, f"__{_name}__", _arithmetic(_op, False))
    setattr(_DeviceScalar, f"__r{_name}__", _arithmetic(_op, True))
for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    setattr(_DeviceScalar, f"__{_name}__", _comparison(getattr(operator, _name)))
_DeviceScalar.__neg__ = lambda self: -self._bake()
_DeviceScalar.__pos__ = lambda self: +self._bake()
_DeviceScalar.__abs__ = lambda self: abs(self._bake())
_DeviceScalar.__pow__ = lambda self, other: self._bake() ** other
_DeviceScalar.__rpow__ = lambda self, other: other ** self._bake()


class GraphReplay:
    """The CUDA-graph replay of one executor (a program on a GPU).

    Attributes:
        graph: the captured ``cupy.cuda.Graph``, or None.
        reason: why the step does not replay as a graph (None while it does or before the
            first try).
        captures: how many captures were tried; ``launches``: calls replayed by the graph;
        ``uncaptured``: calls that ran uncaptured after a graph existed (scalars changed).
    """

    def __init__(self, executor):
        self.executor = executor
        program = executor.program
        self.device = program.device
        self.xp = backend.xp_for(self.device)
        self.graph = None
        self.reason = None
        self.captures = self.launches = self.uncaptured = 0
        self.failed = False
        self._scalar_failure = False
        values = program.values
        self.args = [vid for vid in program.inputs if values[vid].source.kind == "arg"]
        self.slots: dict = {}  # value id -> static input slot (the step's tensor arguments)
        self.bound: dict = {}  # value id -> the array every other input was at capture
        self.scalars = None
        self.outputs: dict = {}  # value id -> the array the graph leaves it in
        # the allocations of one uncaptured replay (sizes, offsets, arena bytes), recorded
        # at the first replay; the capture (at the next) serves them from ``pool_arena``
        self.recorded = None
        self.pool_arena = None
        self._record_next = False
        # the traced scalars on the device: float64 then float32 slots in one buffer
        self.dscal = None
        self.dscal_views: dict = {}  # dtype name -> [0-d view per slot]
        self.baked: set = set()  # slots whose value the graph baked in (compared at each call)

    # --- calling -----------------------------------------------------------------------
    def run(self, replay, scal) -> bool:
        """Runs the bound program through the graph (capturing it first when needed).
        Returns False when the caller must run it uncaptured."""
        if self.failed:
            return False
        if self.graph is not None:
            if any(scal[i] != self.scalars[i] for i in self.baked):
                self.uncaptured += 1
                self.reason = "traced scalars changed since the capture (their values are baked into the graph)"
                return False
            if any(self.executor.env[vid] is not arr for vid, arr in self.bound.items()):
                self.graph = None  # an input was rebound: its old address is in the graph
                if self.captures > RECAPTURES:
                    self.failed = True
                    self.reason = f"program inputs were rebound {self.captures} times; the graph was given up"
                    return False
        if self.graph is None and self.recorded is None:
            self._record_next = True  # this call runs uncaptured, its allocations recorded
            return False
        if self.graph is None and not self._capture(replay, scal):
            return False
        self._launch()
        return True

    @contextlib.contextmanager
    def recording(self):
        """Around an uncaptured replay: records its pool allocations when the next capture
        needs them (see :class:`_GraphPool`)."""
        if not self._record_next:
            yield
            return
        self._record_next = False
        recorder = _AllocationRecorder(self.xp, self.device.index)
        with recorder.hook:
            yield
        offsets, nbytes = recorder.layout()
        self.recorded = (recorder.sizes, offsets, nbytes)

    def _launch(self) -> None:
        env, xp = self.executor.env, self.xp
        with backend.device_context(self.device):
            for vid, slot in self.slots.items():
                xp.copyto(slot, env[vid])  # copy-in: the graph reads the slot
            if self._uploads():
                values = [v if type(v) in (int, float) else 0 for v in self.executor.scal]  # others: baked
                n = len(values)
                host = np.empty(12 * n, dtype=np.uint8)
                host[: 8 * n].view(np.float64)[:] = values
                host[8 * n :].view(np.float32)[:] = values
                self.dscal.set(host)  # ONE host-to-device copy: this call's scalars
            self.graph.launch()
        for vid, arr in self.outputs.items():
            env[vid] = arr
        self.launches += 1
        self.reason = None

    def _uploads(self) -> bool:
        """Whether the graph reads some traced scalar from the device."""
        return self.dscal is not None and len(self.baked) < len(self.executor.scal)

    def _device_scalars(self, scal) -> list:
        """The traced scalars as :class:`_DeviceScalar` (numbers only; others stay, baked)."""
        xp, n = self.xp, len(scal)
        if self.dscal is None or self.dscal.nbytes != 12 * n:
            self.dscal = memory.track(xp.empty(12 * n, dtype=xp.uint8), "workspace")
            f64, f32 = self.dscal[: 8 * n].view(xp.float64), self.dscal[8 * n :].view(xp.float32)
            self.dscal_views = {"float64": [f64[i] for i in range(n)], "float32": [f32[i] for i in range(n)]}
        out = []
        for i, v in enumerate(scal):
            if type(v) in (int, float):
                out.append(_DeviceScalar(self, i, v))
            else:
                self.baked.add(i)
                out.append(v)
        return out

    def _capture(self, replay, scal) -> bool:
        """Captures with the traced scalars on the device; where the step uses one in a way
        that cannot read it from the device and the capture fails, captures again with every
        scalar baked in."""
        self.captures += 1
        host = list(scal)
        if host:
            self.baked = set()
            with backend.device_context(self.device):
                scal[:] = self._device_scalars(host)
            try:
                if self._capture_once(replay, host, device_scalars=True):
                    return True
            finally:
                scal[:] = host
            if self.failed and not self._scalar_failure:
                return False
            self.failed, self.reason = False, None
        self.baked = set(range(len(host)))
        return self._capture_once(replay, host, device_scalars=False)

    def _capture_once(self, replay, scal, device_scalars: bool) -> bool:
        ex, xp = self.executor, self.xp
        env, g = ex.env, ex.globals
        with backend.device_context(self.device):
            for vid in self.args:
                arr = env[vid]
                if not arr.flags.c_contiguous:
                    return self._give_up(f"argument {ex.program.values[vid].source.name} is not C-contiguous")
                if vid not in self.slots:
                    self.slots[vid] = xp.empty(arr.shape, dtype=arr.dtype)
            # the graph reads the slots: the generated code (globals) and the op-code
            # closures (env) must both see them while capturing
            given = {vid: env[vid] for vid in self.slots}
            for vid, slot in self.slots.items():
                env[vid] = slot
            for vid, name in ex.input_names:
                g[name] = env[vid]
            sizes, offsets, nbytes = self.recorded
            if self.pool_arena is None or self.pool_arena.nbytes < nbytes:
                self.pool_arena = None
                self.pool_arena = memory.track(xp.empty(max(nbytes, 1), dtype=xp.uint8), "workspace")
            stream = xp.cuda.Stream(non_blocking=True)
            error = None
            with stream, _GraphPool(xp, self.pool_arena, sizes, offsets):
                stream.begin_capture()
                try:
                    replay()
                except Exception as e:  # noqa: BLE001 - any refusal ends the capture, reported below
                    error = e
                    tb = sys.exc_info()[2]
                try:
                    graph = stream.end_capture()
                except Exception as e:  # noqa: BLE001 - an invalidated capture ends here (not capturing after)
                    if error is None:
                        error, tb = e, sys.exc_info()[2]
                    graph = None
        for vid, arr in given.items():  # the arguments themselves again: copied into the slots at launch
            env[vid] = arr
        ex.ctxs.clear()
        if error is not None:
            # a device scalar where the op needs a number: try again with the values baked in
            self._scalar_failure = device_scalars
            return self._give_up(self._which(error, tb))
        self.graph = graph
        self.scalars = tuple(scal)
        self.bound = {vid: env[vid] for vid in ex.program.inputs if vid not in self.slots}
        program = ex.program
        sinks = program.output_refs() + [
            wb.value for wb in program.writebacks if wb.value is not None and wb.how not in ("scalar", "const")
        ]
        self.outputs = {vid: env[vid] for vid in sinks if env[vid] is not None}
        self.reason = None
        return True

    def _give_up(self, reason: str) -> bool:
        self.failed = True
        self.graph = None
        self.reason = reason
        self.executor.ctxs.clear()
        return False

    def _which(self, error, tb) -> str:
        """One line: the node whose kernel could not be captured, and what was refused."""
        ex = self.executor
        filename = f"<fw.compile: {ex.program.name}>"
        line = None
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == filename:
                line = tb.tb_lineno
            tb = tb.tb_next
        what = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if line is None:
            return f"the capture failed outside the nodes ({what})"
        node = None
        lines = ex.source.splitlines()
        for text in reversed(lines[: line - 1]):
            m = re.match(r"\s*# (\d+): ", text)
            if m:
                node = ex.program.nodes[int(m.group(1))]
                break
        if node is None:
            return f"the capture failed ({what})"
        file, lineno = node.site
        site = f" at {_relative(file)}:{lineno}" if lineno else ""
        return f"node {node.index} {node.name}{site} could not be captured: {what}"

    # --- reporting -----------------------------------------------------------------------
    def mode(self) -> str:
        if self.graph is not None and self.reason is None:
            return "cuda graph"
        if self.reason is not None:
            return f"uncaptured: {self.reason}"
        return "not captured yet"

    def launches_per_replay(self) -> int | None:
        """Launches of one graph replay: the graph, the argument copies, the copies out."""
        if self.graph is None:
            return None
        return 1 + len(self.slots) + len(self.executor.program.output_refs()) + (1 if self._uploads() else 0)


def _relative(path: str) -> str:
    try:
        return os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
