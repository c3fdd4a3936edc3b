"""Pass 3: dead-code elimination.

A node is kept when it has an effect or something needs what it made:

- an effect: it draws random numbers (dropout, ``normal_``, ``fw.randn``: removing it
  would shift the generator for every later draw), it writes into a program input's
  buffer (an optimizer update, a running statistic), it talks to other processes, or it
  checks values (a loss's target range);
- a need: a value it produced (an output, a side output, or a new version of a buffer
  it wrote) is read by a kept node, returned, or written back; reading a view or a
  version of a buffer needs the node that made the buffer; a kept backward node needs
  its forward node (its context).

Everything else goes: values nothing reads (a copy that re-inplace made redundant, an
op whose result the step dropped).
"""

from __future__ import annotations

from ..ops import attention as A
from ..ops import dropout as D
from ..ops import elementwise as E
from .alias import alias_classes

_RANDOM = (D.Dropout, E.Normal, E.Uniform)
_PURE_CREATE = ("zeros", "ones", "empty", "full")


def draws_random(node) -> bool:
    """Whether a ``call`` node draws from the framework's generator: removing it (or running
    it again) would change every later draw. Fused attention draws only with dropout."""
    if node.op in _RANDOM:
        return True
    return node.op is A.ScaledDotProductAttention and bool(node.params.get("dropout_p", 0))


def _has_effect(node, program, classes) -> bool:
    kind = node.kind
    if kind == "call":
        if draws_random(node) or node.params.get("comm") is not None:
            return True
        if node.inplace:
            owner = program.values[classes.of[node.outputs[0]]]
            return owner.source is not None
        return False
    if kind == "create":
        return node.info.get("label") not in _PURE_CREATE
    if kind == "check":  # raises, or keeps what it found for check_targets()
        return True
    if kind == "grad_sum" and node.inplace:
        return program.values[classes.of[node.outputs[0]]].source is not None
    return False


def eliminate_dead_code(program) -> list[str]:
    """Removes dead nodes (renumbering the rest); returns the names of those removed."""
    classes = alias_classes(program)
    values, nodes = program.values, program.nodes
    made_by: dict = {}
    for v in values:
        if v.producer is not None:
            made_by.setdefault(v.producer, []).append(v.id)
    used = set()

    def need(vid):
        while vid is not None and vid not in used:
            used.add(vid)
            edge = values[vid].edge
            vid = edge[1] if edge is not None else None

    for vid in program.sink_refs():
        need(vid)
    live = [False] * len(nodes)
    forced = set()
    for n in reversed(nodes):
        if n.index in forced or _has_effect(n, program, classes) or any(v in used for v in made_by.get(n.index, ())):
            live[n.index] = True
            for vid in n.value_refs():
                need(vid)
            if n.kind == "backward":
                forced.add(n.info["fwd"])
    removed = [n.name for n in nodes if not live[n.index]]
    if removed:
        program.nodes = [n for n in nodes if live[n.index]]
        dropped = {n.index for n in nodes if not live[n.index]}
        for v in values:
            if v.producer in dropped:
                v.producer, v.edge, v.dead = None, None, True
        program.renumber()
    return removed
