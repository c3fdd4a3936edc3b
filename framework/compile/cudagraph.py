"""A GPU program replayed as one CUDA graph (docs/COMPILE.md, "CUDA graphs").

A planned program runs its nodes in a fixed order on buffers that the plan fixed: that
is what CUDA's stream capture needs. :class:`GraphReplay` captures the executor's replay
function once on a side stream (``Stream.begin_capture`` / ``end_capture``); every later
call copies the step's tensor arguments into static input slots and launches the graph:
one launch, plus one copy per argument and one per returned tensor (copied out, since the
next launch writes over the graph's buffers). A caller that uploads its batch into the
slots (:meth:`GraphReplay.slot_for`, ``CompiledStep.upload``) saves the copies in and
holds its batch on the device once.

What CUDA and CuPy refuse during capture (an allocation, a host synchronization, a host
transfer, cuBLAS) makes the capture fail: the capture is ended (no stream is left
capturing), :attr:`GraphReplay.reason` says in one line which node could not be captured
and why, and the step keeps running uncaptured (the plan still applies).

The kernels allocate their outputs, temporaries and library workspaces as they do eagerly.
So the first replay runs uncaptured and records its pool allocations (sizes, lifetimes, and
the node each happened in, from a ticked copy of the replay function); before the next call
captures, the plan is laid out again (:meth:`GraphReplay._lay_out`): its planned buffers
and those allocations packed together into ONE arena on one timeline, so the plan's peak
is what the graph holds. The capture runs with an allocator that hands each allocation its
place there (:class:`_GraphPool`): nothing reaches CuPy's pool or cudaMalloc during the
capture. If no graph comes of it, the plan's layout is put back.

What a launch hands to the caller in the graph's memory (a leaf's ``.grad``) stays the
caller's, as after an eager step: before the memory is written again
(:meth:`GraphReplay.release`), a tensor the caller kept gets a copy of its values, and a
caller holding the memory some other way (a view) keeps the whole arena: the step takes a
new one. The capture's allocator is the capturing thread's only (``using_allocator``).

The traced scalars (learning rate, Adam's step count, ...) are read by the graph's kernels
from one small device buffer (:class:`_DeviceScalar`), rewritten by one host-to-device
copy before each launch; a scalar an op uses as a Python number is baked into the graph,
and the graph is launched only while the baked ones have their capture values (else the
call runs uncaptured). Every other program input (parameters, optimizer state) must still
be the array it was (else the graph is captured again, up to :data:`RECAPTURES` times).
"""

from __future__ import annotations

import bisect
import contextlib
import operator
import os
import re
import sys
import weakref

import numpy as np

from .. import backend, memory
from .plan import greedy_by_size

RECAPTURES = 3
POOL_ALIGN = 512  # CuPy's pool rounds every request to 512 bytes
# the memory category of a handed array copied out for a caller who kept it (release())
_CATEGORY = {"grad": "gradients", "arggrad": "gradients", "param": "parameters", "state": "optimizer_state"}
_OTHER = "other"  # a buffer or another tensor the step rebound


class _AllocationRecorder:
    """Records the pool allocations of one uncaptured replay on a device: the size of each
    (in allocation order), when it went back to the pool (a CuPy memory hook), and when
    each node began (:meth:`tick`, called by the executor's ticked replay function), all on
    one clock."""

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
        self.node_clock: dict = {}  # node index -> the clock when it began
        self.clock = 0

    def tick(self, node: int) -> None:
        self.node_clock[node] = self.clock
        self.clock += 1

    def recording(self, n_nodes: int, step_local: set) -> _Recording:
        """What the layout needs, with every time in clock units. An allocation still alive
        when the replay ended spans the whole step (the next step may read it: new
        optimizer state), unless it is in ``step_local`` (``id`` of its memory): values
        nothing reads after the next launch begins (the returned ones, copied out after
        the launch; gradients the next step drops first), which keep their place only
        from when they are made."""
        end = self.clock
        starts = [end] * (n_nodes + 1)  # starts[k]: when node k began; starts[n]: the end
        for k in range(n_nodes - 1, -1, -1):
            starts[k] = self.node_clock.get(k, starts[k + 1])
        local = {k for pmem, k in self.live.items() if pmem in step_local}
        spans = [
            (start if k in local else 0, end) if stop is None else (start, stop)
            for k, (start, stop) in enumerate(self.spans)
        ]
        return _Recording(list(self.sizes), spans, starts)


class _Recording:
    """The allocations of one replay (sizes in order, ``(alloc, free)`` clock times) and the
    clock time each node began (``starts``, one more for the end of the step)."""

    def __init__(self, sizes, spans, starts):
        self.sizes, self.spans, self.starts = sizes, spans, starts

    def node_of(self, t: int) -> int:
        """The node running at clock time ``t`` (the number of nodes at the end)."""
        return max(bisect.bisect_right(self.starts, t) - 1, 0)

    def layout(self, plan):
        """ONE arena for the planned buffers and the kernels' allocations, packed together
        (the plan's best-fit packer) on this clock: a planned buffer is live from the start
        of its first node to the start of the node after its last use. Returns
        ``(value offsets, allocation offsets, arena bytes)``."""
        starts, n = self.starts, len(self.starts) - 1
        items = []
        for vid in plan.offsets:
            first, last = plan.intervals[vid]
            items.append((("value", vid), plan.nbytes[vid], starts[max(first, 0)], starts[min(last + 1, n)]))
        for k, (size, (start, stop)) in enumerate(zip(self.sizes, self.spans)):
            items.append((("kernel", k), size, start, stop))
        offsets, nbytes = greedy_by_size(items, POOL_ALIGN)
        values = {vid: offsets["value", vid] for vid in plan.offsets}
        kernel = [offsets["kernel", k] for k in range(len(self.sizes))]
        return values, kernel, nbytes


class _GraphPool:
    """The allocator CuPy uses while the step is captured: the k-th allocation gets its
    planned place in the graph's arena (allocated before the capture), so nothing reaches
    CuPy's pool or cudaMalloc while the stream captures. A request that is not the
    recorded one (another size, one more) raises: the capture fails with that reason.

    It is the capturing thread's allocator only (``cupy.cuda.using_allocator``, which is
    thread-local, and works inside a caller's own ``using_allocator`` block, where CuPy
    refuses ``set_allocator``): another thread allocating meanwhile gets its memory from
    its own allocator, never from the arena."""

    def __init__(self, xp, arena, sizes, offsets):
        self.xp, self.arena, self.sizes, self.offsets = xp, arena, sizes, offsets
        self.next = 0
        self.previous = None
        self._using = None

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
        self._using = self.xp.cuda.using_allocator(self.malloc)
        self._using.__enter__()
        return self

    def __exit__(self, *exc):
        self._using.__exit__(*exc)


# The numbers a graph reads from the device: Python's (weakly typed: beside an array they
# take its dtype) and NumPy's floating scalars (strongly typed: they keep their own, as
# CuPy's CScalar and NumPy's NEP 50 promote them), by type -> their own dtype or None.
_DEVICE_NUMBERS = {int: None, float: None, np.float32: "float32", np.float64: "float64"}


class _DeviceScalar:
    """A traced scalar of a captured step, as its kernels see it: where an op multiplies an
    array by it (``Add``/``Sub``'s ``alpha``, ``Mul``, ``Div``, ``backend.add_scaled_``),
    the kernel reads a 0-d device array (a slot of :attr:`GraphReplay.dscal`, rewritten by
    one host-to-device copy before each launch), so the graph follows a learning-rate
    schedule. Comparisons read the host value (the capture recorded guards on them, checked
    at every call). Any other use (``float()``, Python arithmetic, another dtype) bakes the
    value into the graph: the slot is then compared at every call, and a call with another
    value runs uncaptured."""

    __array_priority__ = 1000  # ``array * scalar`` asks the scalar (CuPy's rule, as NumPy's)

    def __init__(self, owner, slot: int, value):
        self.owner, self.slot, self.value = owner, slot, value

    def on_device(self, dtype):
        """The number as an operand beside an array of ``dtype``, as eager passes it: a
        Python number in ``dtype`` (weak), a NumPy scalar in its own dtype (strong)."""
        return self.in_dtype(_DEVICE_NUMBERS.get(type(self.value)) or dtype)

    def in_dtype(self, dtype):
        """The number converted to ``dtype`` (as ``backend.add_scaled_`` takes any number)."""
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


class _Handout:
    """An array a graph launch hands to the caller in the graph's own memory: a leaf's new
    ``.grad``, or the new array of a rebound tensor. ``array`` is a base-less array over
    those bytes whose pointer holds a memory object of its own (``UnownedMemory``, which
    holds the arena; made once per capture), so that everything the caller makes from it
    holds a reference to one of three objects, as CuPy's references go: the array (the
    tensor, a tensor sharing it, a view: its ``base``), its pointer (``a.data``, an array
    made on it: ``cupy.ndarray(memptr=a.data)``, CuPy's ``as_strided``, a transpose), or its
    memory (any pointer made by arithmetic, ``a.data + n``, and the arrays on one:
    ``fw.as_strided``, basic indexing). ``refs`` are their reference counts while only the
    graph holds them. ``tensors``: the tensors the last launch handed it in.

    Not seen: an address held as a number (``a.data.ptr``, ``__cuda_array_interface__``),
    or memory built on one without an owner (``UnownedMemory(ptr, n, None)``): CuPy keeps
    no memory alive through them either (docs/COMPILE.md, "What a replay hands back")."""

    __slots__ = ("array", "refs", "tensors", "category")

    def __init__(self, array, category: str):
        self.array, self.category, self.tensors, self.refs = array, category, [], None


def _refs(array) -> tuple:
    """The reference counts that tell whether anything besides the graph holds ``array``'s
    memory: the array's, its pointer's and its memory object's (see :class:`_Handout`).
    Always called the same way, so the counts compare."""
    data = array.data
    return sys.getrefcount(array), sys.getrefcount(data), sys.getrefcount(data.mem)


class GraphReplay:
    """The CUDA-graph replay of one executor (a program on a GPU).

    Attributes:
        graph: the captured ``cupy.cuda.Graph``, or None.
        reason: why the step does not replay as a graph (None while it does or before the
            first try).
        captures: how many captures were tried; ``launches``: calls replayed by the graph;
        ``uncaptured``: calls that ran uncaptured after a graph existed (scalars changed).
        kept_copies: arrays the caller still held in a tensor at a later call, copied out
            of the graph's memory before it was written again (:meth:`release`);
        arenas_left: arenas left to a caller who held graph memory some other way.
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
        # positional argument index -> value id (keyword arguments are flattened after the
        # positional ones in name order: upload() gives them no slot)
        self.positions = {
            values[vid].source.key: vid for vid in self.args if values[vid].source.name.startswith("args[")
        }
        # whether the last launch's arguments were the slots themselves (the caller uploaded
        # into them: slot_for), so that the caller's batch is not on the device twice
        self.inputs_in_slots = False
        self.slot_bytes = 0
        self.copies_in = 0  # arguments copied into their slots at the last launch
        self.bound: dict = {}  # value id -> the array every other input was at capture
        self.scalars = None
        self.outputs: dict = {}  # value id -> the array the graph leaves it in
        # the allocations of one uncaptured replay (a _Recording), made at the first
        # replay; before the next call captures, they and the planned buffers are laid out
        # in ONE arena (the plan's, re-laid out: _lay_out), whose places the capture serves
        self.recorded = None
        self.kernel_offsets = None  # allocation k's offset in the arena, once laid out
        self._uncaptured_layout = None  # the plan's layout before, put back if no graph
        # the traced scalars on the device: float64 then float32 slots in one buffer
        self.dscal = None
        self.dscal_views: dict = {}  # dtype name -> [0-d view per slot]
        self.baked: set = set()  # slots whose value the graph baked in (compared at each call)
        # what the last launch handed to the caller in the graph's memory (gradients, rebound
        # arrays): released before anything writes that memory again (release())
        self.handed: list = []
        self.kept_copies = self.arenas_left = 0

    # --- calling -----------------------------------------------------------------------
    def run(self, scal) -> bool:
        """Runs the bound program through the graph (capturing it first when needed).
        Returns False when the caller must run it uncaptured."""
        if self.failed:
            return False
        if self.graph is not None:
            if any(scal[i] != self.scalars[i] for i in self.baked):
                self.uncaptured += 1
                self._count_inputs_once(in_slots=False)  # node by node: the caller's batch is its own
                self.reason = "traced scalars changed since the capture (their values are baked into the graph)"
                return False
            if any(self.executor.env[vid] is not arr for vid, arr in self.bound.items()):
                self.graph = None  # an input was rebound: its old address is in the graph
                if self.captures > RECAPTURES:
                    self.failed = True
                    self.reason = f"program inputs were rebound {self.captures} times; the graph was given up"
                    self._put_back()
                    return False
        if self.graph is None and self.recorded is None:
            return False  # this call runs uncaptured, its allocations recorded (recording())
        if self.graph is None:
            if self.kernel_offsets is None:
                self._lay_out()
            if not self._capture(scal):
                if self.failed:
                    self._put_back()
                return False
        self._launch()
        return True

    def release(self) -> None:
        """Before the graph's memory is written again (a launch, or a replay node by node on
        the graph's layout): what the last launch handed to the caller must stay as the
        caller left it, as after an eager step. Where only the handed tensors hold them (a
        kept ``.grad``), each gets a copy of its values (one copy each) and the graph its
        memory back. Anything else holding those bytes (a view, a tensor sharing the array,
        the array, its pointer, a pointer or array made from its memory: :class:`_Handout`)
        cannot be pointed elsewhere: the arena is left to them (freed when they let go), no
        tensor is copied (it keeps sharing memory with them), and the step takes a new
        arena, captured again (as PyTorch's CUDA graph trees record again when a live tensor
        would be overwritten)."""
        if not self.handed:
            return
        handed, self.handed = self.handed, []
        kept = [[t for t in map(_call, h.tensors) if t is not None and t._data is h.array] for h in handed]
        # pinned: something besides the handed tensors holds an array's memory. Then no
        # tensor is pointed at a copy (it would no longer share memory with that holder):
        # the whole arena is left to them.
        pinned = any(_refs(h.array) != (h.refs[0] + len(ts),) + h.refs[1:] for h, ts in zip(handed, kept))
        for h in handed:
            h.tensors = []
        if pinned:
            self._leave_arena()
            return
        with backend.device_context(self.device):
            for h, ts in zip(handed, kept):
                for t in ts:
                    t._data = memory.track(h.array.copy(), h.category)
                    self.kept_copies += 1
        self.handed = handed

    def _leave_arena(self) -> None:
        """The arena is held by the caller: a new one, and the graph captured again on it."""
        self.handed = []
        self.arenas_left += 1
        self.graph = None
        if self.captures > RECAPTURES:
            self.failed = True
            self.reason = f"the caller held the graph's memory past {self.arenas_left} calls; the graph was given up"
            self._put_back()  # binds a new arena too
        else:
            self.executor.rebuild()

    def handed_out(self, given: dict) -> None:
        """After a launch's write-backs: ``given`` maps each handed value to the tensors
        that now hold it (see :meth:`release`)."""
        for h in self.handed:
            h.tensors = [weakref.ref(t) for t in given.get(id(h.array), ())]

    def wants_recording(self) -> bool:
        """Whether the uncaptured replay about to run should be recorded (:meth:`recording`)."""
        return self.recorded is None and not self.failed

    @contextlib.contextmanager
    def recording(self):
        """Around an uncaptured replay of the ticked replay function (it is given the
        ``tick`` this yields): records its pool allocations and when each node began."""
        recorder = _AllocationRecorder(self.xp, self.device.index)
        with recorder.hook:
            yield recorder.tick
        local = {id(arr.data.mem) for arr in self._step_local_sinks()}
        self.recorded = recorder.recording(len(self.executor.program.nodes), local)

    def _step_local_sinks(self) -> list:
        """The arrays, at the end of a replay, that no later step reads as an input: what
        the step returns (copied out right after the launch, on the same stream) and the
        new gradients of leaves the step sets to None first (``zero_grad()``)."""
        program, env = self.executor.program, self.executor.env
        cleared = {id(leaf) for leaf in program.cleared_grads}
        vids = list(program.output_refs())
        vids += [
            wb.value
            for wb in program.writebacks
            if wb.how == "grad" and wb.value is not None and wb.source.kind == "grad" and id(wb.source.obj) in cleared
        ]
        return [env[vid] for vid in vids if env[vid] is not None]

    def _lay_out(self) -> None:
        """Lays the plan out again, for the graph: the planned buffers and every allocation
        the recorded replay made, in ONE arena (the executor binds it and regenerates its
        replay function); the plan's peak is then that arena and what the step holds."""
        ex = self.executor
        plan, program = ex.plan, ex.program
        values, kernel, nbytes = self.recorded.layout(plan)
        rec = self.recorded
        allocations = [
            (off, size, rec.node_of(start), rec.node_of(stop))
            for off, size, (start, stop) in zip(kernel, rec.sizes, rec.spans)
        ]
        vals = program.values
        self.slot_bytes = sum(vals[vid].nbytes for vid in self.args)
        self.inputs_in_slots = False  # the layout counts the slots beside the caller's arguments
        extra = (
            self.slot_bytes  # the static input slots
            + 12 * len(ex.scal)  # the device scalars (float64 and float32 slots)
            + sum(vals[vid].nbytes for vid in program.output_refs())  # the copies out
            + 8 * len(ex.flags)  # the checks' flags (a loss's target range)
        )
        self._uncaptured_layout = plan.layout()
        plan.hold_kernel_allocations(values, nbytes, allocations, extra)
        ex.rebuild()
        self.kernel_offsets = kernel

    def _put_back(self) -> None:
        """No graph after all: the plan's layout as it was (kernels allocate again)."""
        self.handed = []  # the arena they live in is left to their holders (rebuild binds a new one)
        self.inputs_in_slots = False
        if self._uncaptured_layout is not None:
            self.executor.plan.set_layout(self._uncaptured_layout)
            self.executor.rebuild()
            self._uncaptured_layout = None

    def _launch(self) -> None:
        env, xp = self.executor.env, self.xp
        with backend.device_context(self.device):
            copies = 0
            sources = {vid: env[vid] for vid in self.slots}
            for vid, slot in self.slots.items():
                src = sources[vid]
                if src is not slot and any(xp.may_share_memory(src, s) for s in self.slots.values()):
                    # memory of the slots (uploaded arguments passed in another order, or a
                    # view of one): read before any slot is written
                    sources[vid] = src.copy()
            for vid, slot in self.slots.items():
                if sources[vid] is not slot:  # else the caller uploaded into the slot (slot_for)
                    xp.copyto(slot, sources[vid])  # copy-in: the graph reads the slot
                    copies += 1
            self._count_inputs_once(in_slots=copies == 0)
            self.copies_in = copies
            if self._uploads():
                values = [v if type(v) in _DEVICE_NUMBERS else 0 for v in self.executor.scal]  # others: baked
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

    def slot_for(self, position: int):
        """The static input slot of the step's argument ``position`` while a graph is
        captured, else None. A caller that writes its next batch into the slot and passes
        the slot itself (``CompiledStep.upload``) saves the copy-in and the device copy of
        its batch; the next launch reads the slot, so it is the caller's until then only."""
        vid = self.positions.get(position)
        if self.graph is None or self.reason is not None or vid is None:
            return None
        return self.slots.get(vid)

    def _count_inputs_once(self, in_slots: bool) -> None:
        """The planned peak counts the caller's arguments (the step's inputs) and the slots
        apart; when the arguments ARE the slots, the batch is on the device once."""
        in_slots = in_slots and bool(self.slots)
        if in_slots != self.inputs_in_slots:
            self.executor.plan.shift_peak(-self.slot_bytes if in_slots else self.slot_bytes)
            self.inputs_in_slots = in_slots

    def _uploads(self) -> bool:
        """Whether the graph reads some traced scalar from the device."""
        return self.dscal is not None and len(self.baked) < len(self.executor.scal)

    def _device_scalars(self, scal) -> list:
        """The traced scalars as :class:`_DeviceScalar` (numbers only: Python's, NumPy's
        float32 and float64; others stay, baked)."""
        xp, n = self.xp, len(scal)
        if self.dscal is None or self.dscal.nbytes != 12 * n:
            self.dscal = memory.track(xp.empty(12 * n, dtype=xp.uint8), "workspace")
            f64, f32 = self.dscal[: 8 * n].view(xp.float64), self.dscal[8 * n :].view(xp.float32)
            self.dscal_views = {"float64": [f64[i] for i in range(n)], "float32": [f32[i] for i in range(n)]}
        out = []
        for i, v in enumerate(scal):
            if type(v) in _DEVICE_NUMBERS:
                out.append(_DeviceScalar(self, i, v))
            else:
                self.baked.add(i)
                out.append(v)
        return out

    def _capture(self, scal) -> bool:
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
                if self._capture_once(host, device_scalars=True):
                    return True
            finally:
                scal[:] = host
            if self.failed and not self._scalar_failure:
                return False
            self.failed, self.reason = False, None
        self.baked = set(range(len(host)))
        return self._capture_once(host, device_scalars=False)

    def _capture_once(self, scal, device_scalars: bool) -> bool:
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
            stream = xp.cuda.Stream(non_blocking=True)
            error = None
            with stream, _GraphPool(xp, ex.arena, self.recorded.sizes, self.kernel_offsets):
                stream.begin_capture()
                try:
                    ex._replay()
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
        self.handed = self._handouts(program)
        for h in self.handed:  # only the graph holds them now (outputs and handed)
            h.refs = _refs(h.array)
        self.reason = None
        return True

    def _handouts(self, program) -> list:
        """A :class:`_Handout` for each array a launch hands to the caller in the arena (a
        gradient, a rebound tensor's array), its array in :attr:`outputs` replaced by the
        handout's."""
        arena = self.executor.arena
        mem = arena.data.mem if arena is not None else None
        out = []
        for wb in program.writebacks:
            arr = self.outputs.get(wb.value) if wb.how in ("grad", "rebind") else None
            # in the arena (an input's own buffer updated in place, e.g. a gradient
            # accumulated into ``.grad``, stays the input's: eager updates it in place too)
            if arr is not None and arr.data.mem is mem and not any(h.array is arr for h in out):
                # memory of its own that holds the arena (CuPy's UnownedMemory with an owner)
                own_mem = self.xp.cuda.UnownedMemory(arr.data.ptr, arr.nbytes, arena, self.device.index)
                own = type(arr)(
                    arr.shape, arr.dtype, memptr=self.xp.cuda.MemoryPointer(own_mem, 0), strides=arr.strides
                )
                self.outputs[wb.value] = own
                out.append(_Handout(own, _CATEGORY.get(wb.source.kind, _OTHER)))
        return out

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
        """Launches of one graph replay: the graph, the argument copies (none for an
        argument the caller uploaded into its slot, as at the last launch), the copies out."""
        if self.graph is None:
            return None
        copies_in = len(self.slots) if self.launches == 0 else self.copies_in
        return 1 + copies_in + len(self.executor.program.output_refs()) + (1 if self._uploads() else 0)


def _call(ref):
    return ref()


def _relative(path: str) -> str:
    try:
        return os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
