"""Pass 0: recomputation under a memory budget (``fw.compile(step, memory_budget=b)``).

Backward reads values that forward made (``saves``) and what forward kernels keep in their
context (BatchNorm's statistics, dropout masks): eagerly, all of it lives from forward to
backward. This pass chooses which of those values backward computes again instead, just
before it reads them, by copying forward nodes into the backward part of the program.
``b`` is ``torch.compile``'s ``activation_memory_budget``: 1 keeps what eager keeps
(nothing is recomputed), 0 recomputes everything that can be, and in between the bytes
kept across the forward/backward boundary are at most ``min + b * (max - min)``, where
``max`` is eager's and ``min`` the least any choice keeps.

The choice is a minimum cut, as in PyTorch's ``min_cut_rematerialization_partition``
(torch/_functorch/partitioners.py). Every forward value is an edge ``in -> out`` whose
capacity is what keeping its buffer (its alias class) costs; a value backward reads
has ``out -> sink``; each op feeds its users (``out -> user in``, infinite); the source
reaches every value that cannot be made again (infinitely) and every op that can, at its
recompute cost. A value whose ``in`` ends on the sink's side is recomputed; a cut
``in -> out`` edge is a buffer kept. A forward op's private context (what its backward
reads besides saved values) is an edge ``in -> sink``: kept unless the op runs again.
Where PyTorch trades memory for time with a knapsack over the ops its heuristics banned,
this pass prices memory (bytes against the cost of the ops that run again) and takes the
lowest price whose cut keeps no more than the budget allows. Each cut is the cheapest at
its own price, so a higher price never keeps more bytes (for prices p < q with cuts A and
B: cost(A) + p bytes(A) <= cost(B) + p bytes(B) and cost(B) + q bytes(B) <= cost(A) + q
bytes(A) give bytes(B) <= bytes(A)): the kept bytes fall as ``b`` falls, and the chosen cut
is the cheapest recomputation that fits.

What is never recomputed (kept if backward needs it):

- ops that draw random numbers (dropout, ``normal_``, fused attention with dropout): the
  draw would be another one (:func:`framework.compile.dce.draws_random`);
- collectives, and writes into buffers that outlive the step (parameters, running
  statistics): effects, not values;
- an inplace write through a view, into a strided buffer, or whose backward rebuilds a
  base (``CopySlices``); other inplace writes run again out of place (the policy's
  promise: an op's inplace and out-of-place forms compute the same bits);
- a value whose buffer is written again before backward is done (the alias classes say
  which) cannot be kept: only recomputing it brings it back, from values that are still
  there;
- creation recipes other than ``zeros``, ``ones`` and ``full`` (which make the same
  values every time, and run again like ops).

A recomputed node is a ``call`` (or ``create``) like any other, and backward reads its
context: the re-inplace pass, dead-code elimination and the memory plan see an ordinary
program (a recomputed value dies at its last reader; a forward value backward no longer
reads dies in forward and may be written over there). The replayed step computes bitwise what eager
``off`` computes: the same kernels on the same values.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .alias import alias_classes, writers
from .dce import draws_random
from .plan import PERSISTENT
from .program import Node
from .refs import Ref, StatsOut

# The cost model of one op run again: its FLOPs at FLOP_RATE plus the bytes it reads and
# writes at BYTE_RATE (one CPU core with NumPy and OpenBLAS: matrix products near 100
# GFLOP/s, elementwise passes near 20 GB/s once out of cache). Only the order matters to
# the choice: cheap elementwise ops are recomputed first, matrix products last.
FLOP_RATE = 100e9
BYTE_RATE = 20e9
# Elementwise passes over the output of ops that are not matrix products (one by default).
_PASSES = {
    "BatchNorm": 4,
    "InPlaceABN": 5,
    "LayerNorm": 4,
    "Softmax": 3,
    "LogSoftmax": 3,
    "Gelu": 8,
    "CrossEntropy": 4,
}
# Creation recipes that make the same values every time (``fw.zeros`` in a shortcut's
# padding): run again like ops. ``empty`` is not one (its values are whatever was there).
_SAME_EVERY_TIME = ("zeros", "ones", "full")
# Prices of memory tried (bytes kept against picoseconds of recompute): 2 ** (k / 4) for k
# in this range. The budget takes the lowest one whose cut keeps no more than it allows.
_PRICES = range(-80, 161)


def check_budget(budget) -> float:
    """``memory_budget`` as a float in [0, 1]; a ValueError naming the value otherwise."""
    ok = isinstance(budget, (int, float)) and not isinstance(budget, bool)
    if ok:
        try:
            value = float(budget)
        except (TypeError, ValueError):  # pragma: no cover - a number type that refuses float()
            ok = False
        else:
            ok = math.isfinite(value) and 0.0 <= value <= 1.0
    if not ok:
        raise ValueError(
            f"fw.compile(memory_budget={budget!r}): the memory budget is a number in [0, 1], as torch.compile's "
            "activation_memory_budget (1 keeps the activations eager keeps, 0 recomputes all that can be)"
        )
    return value


@dataclass
class Recompute:
    """What the pass chose (``report()`` and ``explain()`` show it).

    Attributes:
        budget: the memory budget.
        kept_bytes: bytes kept across the forward/backward boundary by the choice (saved
            buffers and the private context of ops not run again).
        eager_bytes: the same with nothing recomputed (``b = 1``); None at budget 1, where
            the pass looks at nothing (the plan's ``saved_bytes`` is that number then).
        least_bytes: the least any choice keeps (``b = 0``); None at budget 1.
        nodes: how many forward nodes were copied into backward.
        why: why nothing was recomputed, where nothing was.
        banned: why forward ops that backward needs could not be recomputed: reason -> count.
    """

    budget: float
    kept_bytes: int | None = None
    eager_bytes: int | None = None
    least_bytes: int | None = None
    nodes: int = 0
    why: str = ""
    banned: dict = field(default_factory=dict)


def op_cost(node, program) -> tuple[int, int]:
    """``(flops, bytes)`` of running ``node`` once: FLOPs of its products (elementwise ops
    count one per output element and pass), and the bytes it reads and writes."""
    values = program.values
    ins = [values[t.id] for t in node.inputs if isinstance(t, Ref)]
    out = values[node.outputs[0]]
    moved = sum(v.nbytes for v in ins) + out.nbytes
    if node.kind == "create":  # one pass writing the output
        return math.prod(out.shape), out.nbytes
    if node.op.is_view:
        return 0, 0
    name = node.op.__name__
    numel = math.prod(out.shape)
    if name == "Linear":
        flops = 2 * numel * ins[0].shape[-1]
    elif name == "Matmul":
        flops = 2 * numel * (ins[0].shape[-1] if ins[0].shape else 1)
    elif name == "Conv2d":
        flops = 2 * numel * math.prod(ins[1].shape[1:])
    elif name == "ScaledDotProductAttention":
        q, k = ins[0].shape, ins[1].shape
        flops = 4 * math.prod(q[:-1]) * k[-2] * q[-1]
    else:
        flops = _PASSES.get(name, 1) * numel
    return int(flops), int(moved)


def seconds(flops: int, nbytes: int) -> float:
    """The cost model's time for ``flops`` and ``nbytes`` (see FLOP_RATE, BYTE_RATE)."""
    return flops / FLOP_RATE + nbytes / BYTE_RATE


def rematerialize(program, budget: float) -> Recompute:
    """Chooses what backward recomputes under ``budget`` and rewrites ``program`` so (see
    the module docstring). Runs before the other passes."""
    result = Recompute(budget)
    if budget >= 1:  # the program as captured (nothing is even looked at)
        result.why = "budget 1 keeps what eager keeps"
        return result
    nodes = program.nodes
    backward = [n.index for n in nodes if n.kind == "backward"]
    if not backward:
        result.why = "the step has no backward"
        return result
    graph = _Graph(program, backward[0], backward[-1])
    result.banned = graph.banned
    eager = graph.solve(0, 1)  # memory free: keep everything, recompute nothing
    least = graph.solve(graph.total_cost + 1, 1)  # bytes first, then the cheapest way to them
    if eager is None or least is None:  # pragma: no cover - a value backward reads can be neither kept nor made
        result.why = "no choice keeps what backward reads (the pass left the program as captured)"
        return result
    result.eager_bytes, result.least_bytes = eager.kept, least.kept
    if least.kept >= eager.kept:
        result.kept_bytes = eager.kept
        result.why = "nothing backward reads can be recomputed"
        return result
    target = least.kept + budget * (eager.kept - least.kept)
    chosen = least
    lo, hi = 0, len(_PRICES) - 1  # the lowest price whose cut fits (kept bytes fall as the price rises)
    while lo <= hi:
        mid = (lo + hi) // 2
        k = _PRICES[mid]
        price, scale = (round(2 ** (k / 4)), 1) if k >= 0 else (1, round(2 ** (-k / 4)))
        cut = graph.solve(price, scale)
        if cut is not None and cut.kept <= target:
            chosen, hi = cut, mid - 1
        else:
            lo = mid + 1
    result.kept_bytes = chosen.kept
    result.nodes = _rewrite(program, graph, chosen.recomputed)
    if not result.nodes:
        result.why = "keeping is cheaper than any recomputation within the budget"
    return result


@dataclass
class _Cut:
    kept: int  # bytes kept across the boundary
    recomputed: set  # value ids whose producer runs again in backward


class _Graph:
    """The flow network of one program (see the module docstring); :meth:`solve` cuts it
    at one price of memory."""

    def __init__(self, program, first_backward: int, last_backward: int):
        self.program = program
        nodes, values = program.nodes, program.values
        classes = alias_classes(program)
        written = writers(program, classes)
        # the values of forward (and the program's inputs), and what each is to backward
        vids = [
            v.id
            for v in values
            if (v.producer is None and v.source is not None) or (v.producer is not None and v.producer < first_backward)
        ]
        known = set(vids)
        self.values = vids
        self.required, self.pinned = set(), set()  # read by backward; read as they are (other readers, results)
        for n in nodes[first_backward:]:
            if n.kind == "backward":
                self.required.update(v for v in n.info.get("saved_values", ()) if v in known)
            else:
                self.pinned.update(v for v in n.value_refs() if v in known)
        self.pinned.update(v for v in program.sink_refs() if v in known)
        # what forward ops that have a backward keep in their context for it
        with_backward = {n.info["fwd"] for n in nodes if n.kind == "backward"}
        self.private = {}
        for n in nodes[:first_backward]:
            if n.kind == "call" and n.index in with_backward and n.outputs and n.outputs[0] in known:
                kept = sum(b for _, b in n.info.get("kept", ()))
                kept += sum(values[n.inputs[i].id].nbytes for i in n.info.get("saved_copies", {}).values())
                if kept:
                    self.private[n.outputs[0]] = kept
        copyslices = {n.info["fwd"] for n in nodes if n.kind == "backward" and n.info.get("copyslices")}
        self.kind, self.cost, self.save, self.banned, self.inputs = {}, {}, {}, {}, {}
        self.cls = {}  # value id -> its class (owner value id)
        self.gone = set()  # written over before backward is done: neither kept nor read as it was
        for vid in vids:
            v = values[vid]
            owner = values[classes.of[vid]]
            self.cls[vid] = owner.id
            born = -1 if v.producer is None else v.producer
            gone = any(born < w <= last_backward for w in written.get(classes.of[vid], ()))
            kind, why = self._kind(v, owner, copyslices)
            if why is not None and (vid in self.required or vid in self.private):
                self.banned[why] = self.banned.get(why, 0) + 1
            self.kind[vid] = kind
            if gone:
                self.gone.add(vid)
            if gone or kind == "view":
                self.save[vid] = None  # cannot be kept: written over, or a view (its base is kept)
            elif owner.source is not None and owner.source.kind in PERSISTENT:
                self.save[vid] = 0  # lives in the model or the optimizer anyway
            else:
                self.save[vid] = owner.nbytes
            if kind == "fixed":
                continue
            node = nodes[v.producer]
            if kind == "op":
                flops, moved = op_cost(node, program)
                self.cost[vid] = max(1, math.ceil(seconds(flops, moved) * 1e12))  # picoseconds
            refs = []
            for t in list(node.inputs) + list(node.params.values()):
                if not isinstance(t, StatsOut):
                    _refs(t, refs)
            self.inputs[vid] = [u for u in refs if u in known]
        self.total_cost = sum(self.cost.values())

    def _kind(self, v, owner, copyslices) -> tuple[str, str | None]:
        """``op`` (may run again), ``view`` (free: a view of what its input is then) or
        ``fixed`` (kept or nothing), with the reason for ``fixed`` where it is an op's."""
        if v.producer is None:
            return "fixed", None
        n = self.program.nodes[v.producer]
        if n.kind == "create" and n.info.get("label") in _SAME_EVERY_TIME:
            return "op", None
        if n.kind != "call" or not n.outputs or n.outputs[0] != v.id:
            return "fixed", None  # another recipe, a side output, the same array seen again after a write
        why = None
        if draws_random(n):
            why = "draws random numbers"
        elif n.params.get("comm") is not None:
            why = "talks to other processes"
        elif n.index in copyslices:
            why = "its backward rebuilds a base (CopySlices)"
        elif n.inplace:
            target = self.program.values[n.inputs[0].id]
            if owner.source is not None:
                why = "writes a buffer that outlives the step"
            elif (target.edge is not None and target.edge[0] != "write") or not _c_contiguous(target):
                why = "writes in place through a view or into a strided buffer"
        if why is not None:
            return "fixed", why
        return ("view", None) if n.op.is_view else ("op", None)

    def solve(self, price: int, scale: int) -> _Cut | None:
        """The minimum cut at ``price / scale`` (bytes kept against picoseconds recomputed),
        the one that recomputes least among equals; None if no finite cut exists."""
        flow = _Flow()
        src, snk = flow.vertex(), flow.vertex()
        ends = {}
        for vid in self.values:
            a, b = flow.vertex(), flow.vertex()
            ends[vid] = (a, b)
            save = self.save[vid]
            flow.edge(a, b, None if save is None else save * price)
            kind = self.kind[vid]
            if kind == "fixed" or vid in self.pinned:
                flow.edge(src, a, None)
            elif kind == "op":
                flow.edge(src, a, self.cost[vid] * scale)
            if (vid in self.required or vid in self.pinned) and vid not in self.gone:
                flow.edge(b, snk, None)  # (a value written over later is read before that, as it is)
            if vid in self.private:
                flow.edge(a, snk, self.private[vid] * price)
        for vid, refs in self.inputs.items():
            for u in refs:
                flow.edge(ends[u][1], ends[vid][0], None)
        if flow.max_flow(src, snk) is None:
            return None
        sink_side = flow.reaching(snk)
        recomputed = {vid for vid, (a, _) in ends.items() if a in sink_side and self.kind[vid] != "fixed"}
        # bytes as the floor counts them: each class backward (or a recomputed op) reads, once,
        # and the contexts of the ops not run again
        fed = {u for vid in recomputed for u in self.inputs[vid]}
        held = {
            self.cls[vid]: self.save[vid]
            for vid, (a, b) in ends.items()
            if a not in sink_side and b in sink_side and self.save[vid] and (vid in self.required or vid in fed)
        }
        kept = sum(held.values())
        kept += sum(n for vid, n in self.private.items() if ends[vid][0] not in sink_side)
        return _Cut(kept, recomputed)


def _refs(template, out: list) -> None:
    if isinstance(template, Ref):
        out.append(template.id)
    elif isinstance(template, (tuple, list)):
        for t in template:
            _refs(t, out)
    elif isinstance(template, dict):
        for t in template.values():
            _refs(t, out)


def _c_contiguous(v) -> bool:
    expect = v.dtype.itemsize
    for n, st in zip(reversed(v.shape), reversed(v.strides)):
        if n != 1 and st != expect:
            return False
        expect *= n
    return v.dense


# --- the rewrite ---------------------------------------------------------------------------------


def _rewrite(program, graph: _Graph, recomputed: set) -> int:
    """Copies the producers of ``recomputed`` into backward, each just before the first node
    that reads what it makes (or its context); points backward's reads at the copies.
    Returns how many nodes were copied."""
    nodes, values = program.nodes, program.values
    remap: dict = {}  # forward value id -> its recomputed value id
    copies: dict = {}  # forward node index -> its copy (a Node not yet in the program)
    order = sorted({values[v].producer for v in recomputed})
    temp = len(nodes)
    for i in order:
        f = nodes[i]
        v = f.outputs[0]
        if f.kind == "call" and f.op.is_view and f.inputs[0].id not in remap:
            continue  # a view of a buffer that is kept: backward reads the view itself
        copy = _copy_node(program, f, remap, temp)
        temp += 1
        copies[i] = copy
        remap[v] = copy.outputs[0]
    if not copies:
        return 0
    # backward reads the recomputed values, and the recomputed contexts
    for n in nodes:
        if n.kind != "backward":
            continue
        fwd = n.info["fwd"]
        owner = copies.get(fwd)
        if owner is not None:
            n.info["fwd"] = owner.index
            saved = owner.info["saved"]
        else:
            f = nodes[fwd]
            saved = f.info["saved"] = {k: remap.get(v, v) for k, v in f.info.get("saved", {}).items()}
        n.info["saved_values"] = list(saved.values())
    # where each copy goes: before the first node that reads it (a copy that reads another
    # copy places that one no later than itself)
    first_read: dict = {}  # value id, or ("ctx", node index) -> the first node that reads it
    for n in nodes:
        if n.kind != "backward":
            continue
        for vid in list(n.info["saved_values"]) + [("ctx", n.info["fwd"])]:
            first_read.setdefault(vid, n.index)
    position = {}
    for i in reversed(order):
        copy = copies.get(i)
        if copy is None:
            continue
        readers = [first_read.get(copy.outputs[0]), first_read.get(("ctx", copy.index))]
        readers = [p for p in readers if p is not None]
        if not readers:  # nothing reads it: not added
            for vid in copy.outputs + list(_side_outputs(copy)):
                values[vid].dead = True
                values[vid].producer = values[vid].edge = None
            continue
        position[i] = p = min(readers)
        for u in copy.value_refs():
            first_read[u] = min(first_read.get(u, p), p)
    before: dict = {}
    for i in order:
        if i in position:
            before.setdefault(position[i], []).append(copies[i])
    out = []
    for n in nodes:
        out.extend(before.get(n.index, ()))
        out.append(n)
    program.nodes = out
    program.renumber()
    return len(position)


def _copy_node(program, f, remap: dict, index: int):
    """A copy of forward node ``f`` reading the recomputed values (``remap``), out of place,
    with new output values (``index``: its temporary node index until renumbering)."""
    values = program.values

    def fix(t):
        if isinstance(t, Ref):
            return Ref(remap.get(t.id, t.id))
        if isinstance(t, StatsOut):
            return StatsOut({k: _new_like(program, values[vid], index, None) for k, vid in t.values.items()})
        if isinstance(t, (tuple, list)):
            return type(t)(fix(x) for x in t)
        if isinstance(t, dict):
            return {k: fix(x) for k, x in t.items()}
        return t

    inputs = [fix(t) for t in f.inputs]
    params = {k: fix(t) for k, t in f.params.items()}
    v = values[f.outputs[0]]
    edge = ("view", inputs[0].id) if f.kind == "call" and f.op.is_view else None
    out = _new_like(program, v, index, edge)
    info = {key: f.info[key] for key in ("needs", "kept", "saved_consts", "events") if key in f.info}
    if f.kind == "create":  # the recipe again (zeros, ones, full)
        info.update({key: f.info[key] for key in ("recipe", "shape", "dtype", "device", "label")})
    saved = {name: remap.get(vid, vid) for name, vid in f.info.get("saved", {}).items()}
    for name, i in f.info.get("saved_copies", {}).items():  # out of place: backward reads the input itself
        saved[name] = inputs[i].id
    saved = {name: (out if vid == f.outputs[0] else vid) for name, vid in saved.items()}
    info.update(saved=saved, saved_copies={}, recomputes=f.outputs[0], recompute_cost=op_cost(f, program))
    return Node(index, f.kind, op=f.op, inputs=inputs, params=params, outputs=[out], site=f.site, info=info)


def _new_like(program, v, producer: int, edge) -> int:
    w = program.new_value(v.shape, v.dtype, v.strides, producer, edge, None, v.dense, v.name)
    w.writable = v.writable
    return w.id


def _side_outputs(node):
    for t in node.params.values():
        if isinstance(t, StatsOut):
            yield from t.values.values()


# --- maximum flow ----------------------------------------------------------------------------


class _Flow:
    """A flow network with integer capacities (None: infinite); Dinic's algorithm."""

    def __init__(self):
        self.adj: list = []  # vertex -> edge ids
        self.to: list = []
        self.cap: list = []  # residual capacity; edge e ^ 1 is its reverse
        self.inf = 0  # more than every finite capacity together (set in max_flow)

    def vertex(self) -> int:
        self.adj.append([])
        return len(self.adj) - 1

    def edge(self, a: int, b: int, cap) -> None:
        self.adj[a].append(len(self.to))
        self.to.append(b)
        self.cap.append(cap)
        self.adj[b].append(len(self.to))
        self.to.append(a)
        self.cap.append(0)

    def max_flow(self, s: int, t: int):
        """The value of a maximum flow from ``s`` to ``t``; None when it is infinite."""
        finite = sum(c for c in self.cap if c)
        self.inf = inf = finite + 1
        cap = self.cap = [inf if c is None else c for c in self.cap]
        adj, to = self.adj, self.to
        total = 0
        while True:
            level = [-1] * len(adj)
            level[s] = 0
            queue = deque([s])
            while queue:
                u = queue.popleft()
                for e in adj[u]:
                    if cap[e] and level[to[e]] < 0:
                        level[to[e]] = level[u] + 1
                        queue.append(to[e])
            if level[t] < 0:
                return total if total < inf else None
            nxt = [0] * len(adj)
            while True:  # augmenting paths in the level graph, found iteratively
                path, u = [], s
                while u != t:
                    edges = adj[u]
                    while nxt[u] < len(edges):
                        e = edges[nxt[u]]
                        if cap[e] and level[to[e]] == level[u] + 1:
                            break
                        nxt[u] += 1
                    if nxt[u] == len(edges):  # a dead end: never try it again
                        if not path:
                            break
                        level[u] = -1
                        u = to[path.pop() ^ 1]
                        nxt[u] += 1
                        continue
                    path.append(e)
                    u = to[e]
                if u != t:
                    break
                push = min(cap[e] for e in path)
                for e in path:
                    cap[e] -= push
                    cap[e ^ 1] += push
                total += push
                if total >= inf:
                    return None

    def reaching(self, t: int) -> set:
        """The vertices that can still reach ``t`` in the residual network (after max_flow)."""
        adj, to, cap = self.adj, self.to, self.cap
        seen = {t}
        queue = deque([t])
        while queue:
            w = queue.popleft()
            for e in adj[w]:  # e: w -> u; its reverse e ^ 1: u -> w
                u = to[e]
                if u not in seen and cap[e ^ 1]:
                    seen.add(u)
                    queue.append(u)
        return seen
