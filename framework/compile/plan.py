"""Pass 4: liveness intervals and the memory plan (greedy by size, one arena).

Every alias class (see :mod:`framework.compile.alias`) is one buffer. Its *interval* is
``[first definition, last use]`` in node indices: a program input is live from ``-1``, a
value the step returns or writes back is live to the end. Each class gets a *placement*:

``external``  a program input's buffer (a parameter, a batch, optimizer state): not planned
``arena``     an offset in the one arena (the kernel writes through ``out=``)
``kernel``    the kernel allocates it at replay (ops that cannot write into a given buffer,
              side outputs, values returned to the caller, handed to persistent state or
              to a leaf's ``.grad``); it is freed after its last use, as eager would

Arena classes are placed greedy by size, largest first, each at the lowest offset (16-byte
aligned) that no already placed class with an overlapping interval occupies: TFLite's
arena planner and MXNet's memory planner. The plan's peak is

    persistent (external classes) + arena + max over nodes of
        (kernel classes live + private bytes live + the node's transient workspace)

where private bytes are what forward kernels keep in their context for backward (BatchNorm
statistics, dropout masks, copies an inplace op had to make), and the transient workspace
of each node was measured while capturing. The *lower bound* replaces the arena by the
bytes its classes hold at each node: what a step needs if every buffer is allocated when
made and freed after its last use.

The arena is allocated for the whole step, while the buffers kernels allocate come and
go: an arena holding every class it could would add its full size to the kernels' own
peak. So the planner also builds a second arena: the classes live at the step's peak
node (they are part of the peak anyway), then every other class that fits into a gap of
that arena without making it larger, then, while that lowers the peak, the largest class
live at the peak node that was left out; the classes left out are allocated when made,
like kernel-owned ones. A third plan has no arena at all (everything allocated when made:
the lower bound). The planner keeps the plan with the lowest peak and, among equals, the
largest arena (fewer allocations at replay).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import kernels
from .alias import AliasClasses, alias_classes

ALIGN = 16
# Program inputs that live in the model or the optimizer (parameters, module buffers,
# optimizer state, gradients): what backward reads from them is not saved for it.
PERSISTENT = ("param", "buffer", "state", "grad")


@dataclass
class Plan:
    """What replay needs (offsets, frees, contexts) and what the report shows (bytes)."""

    classes: AliasClasses
    placement: dict  # class id -> "external" | "arena" | "kernel"
    why: dict  # class id -> why a class is not in the arena
    intervals: dict  # class id -> (start, end)
    nbytes: dict  # class id -> bytes of its buffer
    offsets: dict = field(default_factory=dict)  # value id (class owner) -> arena offset
    arena_bytes: int = 0
    frees: dict = field(default_factory=dict)  # node index -> value ids to drop after it
    ctx_used: set = field(default_factory=set)  # forward nodes whose context a backward reads
    ctx_done: dict = field(default_factory=dict)  # node index -> forward node whose context ends there
    persistent_bytes: int = 0
    planned_peak_bytes: int = 0
    lower_bound_bytes: int = 0
    floor_bytes: int = 0
    saved_bytes: int = 0  # of the floor, what backward reads from forward (saved_bytes())
    live_curve: list = field(default_factory=list)  # bytes live after each node (planned)
    # A step replayed as a CUDA graph (see :meth:`hold_kernel_allocations`): what its
    # kernels allocate, placed in the arena as ``(offset, bytes, first node, last node)``
    kernel_allocations: list = field(default_factory=list)

    def hold_kernel_allocations(self, offsets: dict, arena_bytes: int, allocations: list, extra_bytes: int) -> None:
        """Makes this the plan of a step replayed as a CUDA graph: every buffer at a fixed
        place in ONE arena, the planned ones (``offsets``: value id -> offset) and what the
        kernels allocate (``allocations``), and nothing allocated while the step runs. The
        peak is then the arena plus what the step always holds (``persistent_bytes``) plus
        ``extra_bytes`` (the graph's input slots, device scalars and copies out)."""
        peak = self.persistent_bytes + arena_bytes + extra_bytes
        self.set_layout((dict(offsets), arena_bytes, list(allocations), peak, [peak] * len(self.live_curve)))

    def shift_peak(self, delta: int) -> None:
        """Moves the planned peak (and the flat curve of a CUDA graph's plan) by ``delta``
        bytes: what the step holds besides the arena changed (the caller's batch, uploaded
        into the graph's input slots, is no longer a second copy)."""
        self.planned_peak_bytes += delta
        self.live_curve = [b + delta for b in self.live_curve]

    def layout(self) -> tuple:
        """What :meth:`hold_kernel_allocations` changes (to put it back with :meth:`set_layout`)."""
        return (
            dict(self.offsets),
            self.arena_bytes,
            list(self.kernel_allocations),
            self.planned_peak_bytes,
            list(self.live_curve),
        )

    def set_layout(self, layout: tuple) -> None:
        self.offsets, self.arena_bytes, self.kernel_allocations, self.planned_peak_bytes, self.live_curve = layout


def liveness(program, classes: AliasClasses) -> dict:
    """class id -> (first definition, last use); -1 for inputs, len(nodes) for sinks."""
    end = len(program.nodes)
    iv: dict = {}
    for v in program.values:
        if v.dead:
            continue
        c = classes.of[v.id]
        start = -1 if v.producer is None else v.producer
        s, e = iv.get(c, (start, start))
        iv[c] = (min(s, start), max(e, start))
    for n in program.nodes:
        for vid in n.value_refs():
            c = classes.of[vid]
            s, e = iv[c]
            iv[c] = (s, max(e, n.index))
    for vid in program.sink_refs():
        c = classes.of[vid]
        iv[c] = (iv[c][0], end)
    return iv


def class_bytes(program, classes: AliasClasses) -> dict:
    """class id -> bytes of the buffer (its owner's size: views and versions fit inside)."""
    return {c: program.values[c].nbytes for c in classes.members}


def _returned_classes(program, classes) -> set:
    return {classes.of[v] for v in program.output_refs()}


def _handed_over(program, classes) -> set:
    """Classes whose array becomes persistent state (a rebind): they must own their memory."""
    return {classes.of[wb.value] for wb in program.writebacks if wb.how == "rebind" and wb.value is not None}


def _gradients(program, classes) -> set:
    """Classes whose array becomes a leaf's ``.grad``: the caller may keep it past the next
    call (as after an eager step), so no later buffer may share its bytes."""
    return {classes.of[wb.value] for wb in program.writebacks if wb.how == "grad" and wb.value is not None}


def place(program, classes: AliasClasses) -> tuple[dict, dict]:
    """The placement of every class and, for those not in the arena, why."""
    placement, why = {}, {}
    returned = _returned_classes(program, classes)
    handed = _handed_over(program, classes)
    grads = _gradients(program, classes)
    values, nodes = program.values, program.nodes
    for c in classes.members:
        owner = values[c]
        if owner.dead:
            placement[c] = "dead"
            continue
        if owner.source is not None:
            placement[c] = "external"
            continue
        reason = None
        producer = nodes[owner.producer] if owner.producer is not None else None
        if c in returned:
            reason = "returned to the caller"
        elif c in handed:
            reason = "becomes persistent state"
        elif c in grads:
            reason = "handed to the caller as a gradient"
        elif not owner.dense:
            reason = "strided output"
        elif producer is None or owner.id not in producer.outputs:
            reason = "side output of " + (producer.name if producer is not None else "?")
        elif not kernels.can_write_into(producer):
            reason = f"{producer.name} allocates its own output"
        if reason is None:
            placement[c] = "arena"
        else:
            placement[c] = "kernel"
            why[c] = reason
    return placement, why


def greedy_by_size(items: list[tuple[int, int, int, int]], align: int = ALIGN) -> tuple[dict, int]:
    """Offsets for ``(key, nbytes, start, end)`` intervals in one arena.

    Largest first (ties: earlier start); each at the lowest aligned offset where it does
    not meet any placed item whose interval overlaps its own (best fit among the gaps).
    Returns ``({key: offset}, arena bytes)``.
    """
    order = sorted(items, key=lambda it: (-it[1], it[2], it[0]))
    placed: list[tuple[int, int, int, int]] = []  # (offset, size, start, end), kept by offset
    offsets: dict = {}
    top = 0
    for key, size, start, end in order:
        size_al = -(-max(size, 1) // align) * align
        busy = sorted((o, s) for o, s, a, b in placed if a <= end and start <= b)
        best, best_gap, prev_end = None, None, 0
        for o, s in busy:
            gap = o - prev_end
            if gap >= size_al and (best_gap is None or gap < best_gap):
                best, best_gap = prev_end, gap
            prev_end = max(prev_end, -(-(o + s) // align) * align)
        if best is None:
            best = prev_end
        offsets[key] = best
        placed.append((best, size_al, start, end))
        top = max(top, best + size)
    return offsets, top


def overlapping(items, offsets) -> list:
    """Pairs of items whose intervals and byte ranges both overlap (must be empty)."""
    bad = []
    for i, (k1, s1, a1, b1) in enumerate(items):
        for k2, s2, a2, b2 in items[i + 1 :]:
            if a1 <= b2 and a2 <= b1:
                o1, o2 = offsets[k1], offsets[k2]
                if o1 < o2 + s2 and o2 < o1 + s1:
                    bad.append((k1, k2))
    return bad


def fit(placed: list, size: int, start: int, end: int, top: int, align: int = ALIGN):
    """The lowest aligned offset where ``size`` bytes fit below ``top`` among ``placed``
    ``(offset, size, start, end)`` items whose intervals overlap ``[start, end]``; None if none."""
    size_al = -(-max(size, 1) // align) * align
    busy = sorted((o, s) for o, s, a, b in placed if a <= end and start <= b)
    prev_end = 0
    for o, s in busy:
        if o - prev_end >= size_al:
            break
        prev_end = max(prev_end, -(-(o + s) // align) * align)
    return prev_end if prev_end + size <= top else None


def _span(iv_c, n):
    s, e = iv_c
    return max(s, 0), min(e, n - 1) + 1


def choose_arena(program, placement, iv, nb, kernel_curve, persistent: int = 0):
    """The arena classes and offsets with the lowest plan peak (see the module docstring).

    Returns ``(offsets, arena bytes, classes left out)``.
    """
    n = len(program.nodes)
    cands = [c for c, p in placement.items() if p == "arena"]
    items = {c: (c, nb[c], *iv[c]) for c in cands}
    kernel = np.asarray(kernel_curve, dtype=np.int64) if n else np.zeros(0, dtype=np.int64)
    full, full_top = greedy_by_size(list(items.values()))
    full_peak = full_top + (int(kernel.max()) if n else 0)
    if not cands or n == 0:
        return full, full_top, []
    # the node where everything allocated when made would peak
    live = kernel.copy()
    for c in cands:
        a, b = _span(iv[c], n)
        live[a:b] += nb[c]
    t = int(live.argmax())
    core = [it for it in items.values() if it[2] <= t <= it[3]]
    offsets, top = greedy_by_size(core)
    placed = {c: (offsets[c], -(-max(sz, 1) // ALIGN) * ALIGN, a, b) for c, sz, a, b in core}
    out = set()
    for c, size, a, b in sorted((it for it in items.values() if it[0] not in offsets), key=lambda it: (-it[1], it[2])):
        off = fit(list(placed.values()), size, a, b, top)
        if off is None:
            out.add(c)
        else:
            offsets[c] = off
            placed[c] = (off, -(-max(size, 1) // ALIGN) * ALIGN, a, b)
    curve = kernel.copy()
    for c in out:
        a, b = _span(iv[c], n)
        curve[a:b] += nb[c]
    # Then, while the peak falls: bring a left-out class live at the peak node into the
    # arena (at its lowest free offset, growing the arena if it must).
    for _ in range(256):
        t = int(curve.argmax())
        peak = top + int(curve[t])
        gain = None
        for c in sorted((c for c in out if iv[c][0] <= t <= iv[c][1]), key=lambda c: -nb[c]):
            _, size, a, b = items[c]
            off = fit(list(placed.values()), size, a, b, 1 << 62)
            new_top = max(top, off + size)
            trial = curve.copy()
            lo, hi = _span(iv[c], n)
            trial[lo:hi] -= nb[c]
            new_peak = new_top + int(trial.max())
            if new_peak < peak:
                gain = (c, off, new_top, trial)
                break
        if gain is None:
            break
        c, off, top, curve = gain
        out.discard(c)
        offsets[c] = off
        placed[c] = (off, -(-max(nb[c], 1) // ALIGN) * ALIGN, iv[c][0], iv[c][1])
    hybrid_peak = top + int(curve.max())
    # Everything allocated when made: the lower bound itself (no arena at all).
    plans = [
        (full_peak, full_top, full, []),
        (hybrid_peak, top, offsets, sorted(out)),
        (int(live.max()), 0, {}, sorted(cands)),
    ]
    best = min(p[0] for p in plans)
    # The lowest peak; among equals, the largest arena (fewer allocations at replay).
    peak, top, offsets, out = max((p for p in plans if p[0] == best), key=lambda p: p[1])
    return offsets, top, out


def plan_memory(program, classes: AliasClasses | None = None, transient: dict | None = None) -> Plan:
    """Places every class, packs the arena, and computes the peaks and the floor."""
    classes = classes or alias_classes(program)
    iv = liveness(program, classes)
    nb = class_bytes(program, classes)
    placement, why = place(program, classes)
    plan = Plan(classes, placement, why, iv, nb)
    _contexts(program, plan)
    transient = _workspace(program, plan, transient or {})
    kernel_curve = _kernel_curve(program, plan, transient)
    persistent = sum(nb[c] for c, p in placement.items() if p == "external")
    offsets, plan.arena_bytes, left_out = choose_arena(program, placement, iv, nb, kernel_curve, persistent)
    for c in left_out:
        placement[c] = "kernel"
        why[c] = "allocated when made: the plan's peak is lower with it outside the arena"
    items = [(c, nb[c], *iv[c]) for c, p in placement.items() if p == "arena"]
    bad = overlapping(items, offsets)
    if bad:  # pragma: no cover - a planner bug, caught here rather than as wrong numbers
        raise AssertionError(f"memory plan overlaps: {bad[:3]}")
    plan.offsets = offsets
    _frees(program, plan)
    _peaks(program, plan, transient)
    return plan


def _workspace(program, plan, inner: dict) -> dict:
    """node index -> its kernel's temporaries: the most it held beyond what was live before
    it (measured while capturing) less the new buffers it made and what it kept for
    backward, which the plan counts on its own (in the arena or from that node on). This
    assumes a kernel allocates its outputs before its temporaries peak, as the ops that
    write through ``out=`` do (dropout draws its uniforms first: there the estimate is low
    by up to its output's size; the report's measured replay peak shows the difference)."""
    out = {}
    for i, extra in inner.items():
        node = program.nodes[i]
        made = node.info.get("new_bytes", 0)
        kept = sum(b for _, b in node.info.get("kept", ()))
        w = extra - made - kept
        if node.info.get("planned_reuse"):
            # Re-inplaced into its gradient, the op's own backward may need a workspace to
            # write over it (Conv2d builds each chunk aside) that the capture did not see:
            # counted as up to its whole output, so the plan stays an upper bound.
            w = max(w, 0) + program.values[node.outputs[0]].nbytes
        if w > 0:
            out[i] = w
    return out


def _kernel_curve(program, plan, transient) -> list[int]:
    """Bytes at each node outside the arena and the inputs: kernel classes, private, transient."""
    n = len(program.nodes)
    curve = [transient.get(i, 0) + p for i, p in zip(range(n), _private(program, plan))]
    for c, p in plan.placement.items():
        if p != "kernel":
            continue
        s, e = plan.intervals[c]
        for i in range(max(s, 0), min(e, n - 1) + 1):
            curve[i] += plan.nbytes[c]
    return curve


def verify(program, plan: Plan) -> None:
    """Checks a planned program; raises AssertionError on the first violation.

    - no two arena buffers whose intervals overlap share a byte;
    - no value is read after a later write into its buffer (its class): the capture
      guaranteed it for the step as written (eager's version checks), the passes must keep
      it for every rewrite;
    - every value is defined before it is read.
    """
    items = [(c, plan.nbytes[c], *plan.intervals[c]) for c, p in plan.placement.items() if p == "arena"]
    bad = overlapping(items, plan.offsets)
    if bad:
        raise AssertionError(f"fw.compile plan: arena buffers overlap: {bad[:3]}")
    classes, values = plan.classes, program.values
    writes: dict = {}
    for v in values:
        if v.edge is not None and v.edge[0] == "write" and v.producer is not None and not v.dead:
            writes.setdefault(classes.of[v.id], []).append(v.producer)
    for n in program.nodes:
        for vid in n.value_refs():
            v = values[vid]
            born = -1 if v.producer is None else v.producer
            if v.dead or born > n.index or (v.producer is None and v.source is None):
                raise AssertionError(f"fw.compile plan: node {n.index} ({n.name}) reads %{vid} before it exists")
            for w in writes.get(classes.of[vid], ()):
                if born < w < n.index:
                    raise AssertionError(
                        f"fw.compile plan: node {n.index} ({n.name}) reads %{vid}, overwritten by node {w} "
                        f"({program.nodes[w].name}) since it was made at node {born}"
                    )


def _frees(program, plan: Plan) -> None:
    """Kernel-owned classes are dropped right after their last use (as eager frees them)."""
    end = len(program.nodes)
    for c, p in plan.placement.items():
        if p != "kernel":
            continue
        last = plan.intervals[c][1]
        if last >= end:
            continue
        plan.frees.setdefault(last, []).extend(plan.classes.members[c])


def _contexts(program, plan: Plan) -> None:
    last: dict = {}
    for n in program.nodes:
        if n.kind == "backward":
            last[n.info["fwd"]] = n.index
    plan.ctx_used = set(last)
    plan.ctx_done = {b: f for f, b in last.items()}


def _private(program, plan) -> list[int]:
    """Bytes each forward kernel keeps in its context until its backward (per node index)."""
    n = len(program.nodes)
    delta = [0] * (n + 1)
    done = {f: b for b, f in plan.ctx_done.items()}
    for node in program.nodes:
        if node.kind != "call" or node.index not in done:
            continue
        kept = sum(b for _, b in node.info.get("kept", ()))
        kept += sum(program.values[node.inputs[i].id].nbytes for i in node.info.get("saved_copies", {}).values())
        if kept:
            delta[node.index] += kept
            delta[done[node.index] + 1] -= kept
    out, run = [], 0
    for i in range(n):
        run += delta[i]
        out.append(run)
    return out


def _peaks(program, plan: Plan, transient: dict) -> None:
    n = len(program.nodes)
    persistent = sum(plan.nbytes[c] for c, p in plan.placement.items() if p == "external")
    kernel_live = [0] * (n + 1)
    arena_live = [0] * (n + 1)
    for c, p in plan.placement.items():
        if p in ("external", "dead"):
            continue
        s, e = plan.intervals[c]
        target = arena_live if p == "arena" else kernel_live
        for i in range(max(s, 0), min(e, n - 1) + 1):
            target[i] += plan.nbytes[c]
    private = _private(program, plan)
    curve, peak, bound = [], 0, 0
    for i in range(n):
        extra = kernel_live[i] + private[i] + transient.get(i, 0)
        curve.append(persistent + plan.arena_bytes + extra)
        peak = max(peak, extra)
        bound = max(bound, extra + arena_live[i])
    plan.persistent_bytes = persistent
    plan.planned_peak_bytes = persistent + plan.arena_bytes + peak
    plan.lower_bound_bytes = persistent + bound
    plan.live_curve = curve
    plan.floor_bytes = floor_bytes(program, plan)
    plan.saved_bytes = saved_bytes(program, plan)


def floor_bytes(program, plan: Plan) -> int:
    """Parameters + their gradients + optimizer state + what backward reads from forward.

    The last term: the classes (other than parameters) that a backward node reads as
    saved values and that exist at the first backward node, plus what forward kernels keep
    privately for backward.
    """
    values, classes = program.values, plan.classes
    params = state = 0
    seen = set()
    for vid in program.inputs:
        src = values[vid].source
        c = classes.of[vid]
        if c in seen:
            continue
        seen.add(c)
        if src.kind == "param":
            params += plan.nbytes[c]
        elif src.kind == "state":
            state += plan.nbytes[c]
    grads = sum(values[wb.value].nbytes for wb in program.writebacks if wb.how == "grad" and wb.value is not None)
    state += sum(
        values[wb.value].nbytes
        for wb in program.writebacks
        if wb.source.kind == "state"
        and wb.how == "rebind"
        and wb.value is not None
        and values[wb.value].source is None
        and classes.of[wb.value] not in seen
    )
    return params + grads + state + saved_bytes(program, plan)


def saved_bytes(program, plan: Plan) -> int:
    """What backward reads from forward, at the boundary between them (the first backward
    node, or the first node recomputed for backward): the classes (other than parameters)
    made before it that a backward node reads as saved values or a recomputed node reads
    (the batch counts; what lives in the model or the optimizer, :data:`PERSISTENT`, does
    not), plus what forward kernels keep privately for backward."""
    values, classes = program.values, plan.classes
    boundary = next((n.index for n in program.nodes if n.kind == "backward" or "recomputes" in n.info), None)
    if boundary is None:
        return 0
    held = set()
    for n in program.nodes[boundary:]:
        if n.kind == "backward":
            reads = n.info.get("saved_values", ())
        elif "recomputes" in n.info:
            reads = n.value_refs()
        else:
            continue
        for vid in reads:
            c = classes.of[vid]
            src = values[c].source
            if (src is None or src.kind not in PERSISTENT) and plan.intervals[c][0] < boundary:
                held.add(c)
    private = 0
    for last, f in plan.ctx_done.items():  # a forward context from before the boundary, used after it
        fnode = program.nodes[f]
        if f < boundary <= last and fnode.kind == "call":
            private += sum(k for _, k in fnode.info.get("kept", ()))
            private += sum(values[fnode.inputs[i].id].nbytes for i in fnode.info.get("saved_copies", {}).values())
    return sum(plan.nbytes[c] for c in held) + private
