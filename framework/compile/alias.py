"""Pass 1: alias classes (union-find over view, write and alias edges) and inplace chains.

Every value that shares memory with an earlier one carries the edge that made it so
(``view``: a view op, or a gradient passed on unchanged; ``write``: a new version written
in place; ``alias``: the same array seen again after a write through another view). A
union-find over those edges puts each value into the class of the buffer it lives in;
the class is named by the value that owns the buffer (a program input, or the first
output written into it). Memory is planned per class, and a class is live from its first
definition to the last read of any of its members.

An *inplace chain* is the sequence of nodes that write one class, in program order: for
a parameter updated by SGD under policy ``on``, ``[layers.0.weight, add_]``; for a
momentum buffer, ``[opt.state[...].momentum_buffer, mul_, add_]``. For every program input
the step updates (parameters, running statistics, optimizer state) this pass decides how
its write-back happens: ``bound`` when the final value already lives in the input's own
buffer (the chain ends where it started: no copy-out), else ``rebind`` (the tensor is
pointed at the new array, as eager ``off`` does; the plan then keeps that array out of
the arena, so it can be handed over).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


class UnionFind:
    """Disjoint sets over integers with path halving and union by rank."""

    def __init__(self, n: int = 0):
        self.parent = list(range(n))
        self.rank = [0] * n

    def find(self, x: int) -> int:
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, a: int, b: int) -> int:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return ra
        if self.rank[ra] < self.rank[rb]:
            ra, rb = rb, ra
        self.parent[rb] = ra
        if self.rank[ra] == self.rank[rb]:
            self.rank[ra] += 1
        return ra


@dataclass
class AliasClasses:
    """The result of :func:`alias_classes`.

    A class is named by its owner: the value that owns the buffer (the member without an
    edge: a program input, or the first output written into the buffer).

    Attributes:
        of: value id -> class id (the id of the class's owner value).
        members: class id -> value ids, in creation order.
    """

    of: dict
    members: dict

    def same(self, a: int, b: int) -> bool:
        return self.of[a] == self.of[b]


def alias_classes(program) -> AliasClasses:
    """Union-find over the program's view, write and alias edges (see the module docstring)."""
    values = program.values
    uf = UnionFind(len(values))
    for v in values:
        if v.edge is not None:
            uf.union(v.edge[1], v.id)
    members: dict = {}
    for v in values:
        members.setdefault(uf.find(v.id), []).append(v.id)
    # Name each class by its owner: the member without an edge (the buffer's first value).
    of, named = {}, {}
    for vids in members.values():
        owner = next((i for i in vids if values[i].edge is None), vids[0])
        named[owner] = vids
        for i in vids:
            of[i] = owner
    return AliasClasses(of, named)


def writers(program, classes: AliasClasses) -> dict:
    """class id -> indices of the nodes that write a new version into it, in program order."""
    out: dict = {}
    for v in program.values:
        if v.edge is not None and v.edge[0] == "write" and v.producer is not None:
            lst = out.setdefault(classes.of[v.id], [])
            if not lst or lst[-1] != v.producer:
                lst.append(v.producer)
    return out


def inplace_chains(program, classes: AliasClasses | None = None) -> list[list[str]]:
    """Each class written in place, as ``[first value's origin, op, op, ...]`` (input first).

    The origin is the input's name for a program input (``layers.0.weight``), else the
    name of the op that made the buffer.
    """
    classes = classes or alias_classes(program)
    chains = []
    for cls, nodes in sorted(writers(program, classes).items(), key=lambda kv: kv[1][0]):
        owner = program.values[cls]
        if owner.source is not None:
            head = owner.source.name
        elif owner.producer is not None:
            head = program.nodes[owner.producer].name
        else:
            head = f"%{cls}"
        chains.append([head] + [program.nodes[i].name for i in nodes])
    return chains


def bind_writebacks(program, classes: AliasClasses | None = None) -> AliasClasses:
    """Decides each write-back of an updated input: ``bound`` when its final value lives in
    the input's own class; ``rebind`` otherwise.

    Returns the classes it used.
    """
    classes = classes or alias_classes(program)
    inputs = input_index(program)
    out = []
    for wb in program.writebacks:
        if wb.how in ("scalar", "const", "grad") or wb.value is None:
            out.append(wb)
            continue
        src = inputs.get(source_key(wb.source))
        if src is not None and classes.same(src, wb.value):
            out.append(replace(wb, how="bound"))
        else:
            out.append(replace(wb, how="rebind"))
    program.writebacks = out
    return classes


def source_key(source) -> tuple:
    """A key that two sources reading the same place share (identity of their objects)."""
    obj = source.obj
    ids = tuple(id(o) for o in obj) if isinstance(obj, tuple) else id(obj)
    return source.kind, ids, source.key


def input_index(program) -> dict:
    """source key -> the program input read from it."""
    return {source_key(program.values[vid].source): vid for vid in program.inputs}


def unbound_inputs(program, classes: AliasClasses | None = None) -> list:
    """Write-backs of parameters, buffers and optimizer state whose chain does not end in
    the input's own buffer (rebound instead; the report names them)."""
    return [wb for wb in program.writebacks if wb.how == "rebind" and wb.source.mutable_state]
