"""What autograd keeps for backward, tensor by tensor: the listing behind
:func:`framework.memory.saved_bytes`.

``saved_tensors(loss)`` walks the graph that backward would run from ``loss`` (or from
several outputs) and lists every saved tensor of every node, in forward order: the node,
the name it saved under (an input such as ``"x"``, ``"result"``, or what forward kept
with ``ctx.keep``: a dropout mask, LayerNorm's row statistics), shape, dtype, and the
buffer behind it. Views of one buffer (q, k and v of one projection) are one buffer:
:func:`held_bytes` counts each buffer once, as the memory counter does, so it equals the
growth of ``memory.saved_bytes()`` while the graph was built.
"""

from __future__ import annotations

import dataclasses

from .. import memory
from .node import _FREED, Node


@dataclasses.dataclass(frozen=True)
class SavedEntry:
    """One tensor a node keeps for backward.

    Attributes:
        node: the node's name (``"NativeLayerNormBackward0"``).
        name: what the node saved it as.
        shape, dtype: of the saved array (a view of ``buffer_bytes`` perhaps).
        nbytes: the saved array's own bytes.
        buffer_bytes: the bytes of the buffer it lives in (what memory counts).
        category: the buffer's memory category (``"activations"``, ``"parameters"``, ...).
        first: True for the first entry of its buffer (later ones share it: not counted again).
    """

    node: str
    name: str
    shape: tuple
    dtype: str
    nbytes: int
    buffer_bytes: int
    category: str
    first: bool


def _nodes_in_forward_order(roots) -> list:
    """The nodes reachable from ``roots``, each after every node it depends on (forward order)."""
    order, seen, stack = [], set(), [(r, False) for r in roots]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        for nxt in node.__dict__.get("next") or ():
            if isinstance(nxt, Node) and id(nxt) not in seen:
                stack.append((nxt, False))
    return order


def _saved_of(node) -> dict:
    saved = node.__dict__.get("_saved")
    inner = node.__dict__.get("fn")  # CopySlices: the inplace op's node holds the saved tensors
    if saved is None and isinstance(inner, Node):
        saved = inner.__dict__.get("_saved")
    return {} if saved is None or saved is _FREED else saved


def saved_tensors(*outputs) -> list[SavedEntry]:
    """Every tensor the graph of ``outputs`` keeps for backward, in forward order.

    A tensor a saved-tensor hook packed away is not kept; what the hook itself keeps is
    listed where the hook says (its ``held()``: a checkpoint's inputs, a selective
    checkpoint's cached outputs), once per hook, under the name it gives.
    """
    roots = [t.grad_fn for t in outputs if getattr(t, "grad_fn", None) is not None]
    entries, seen, hooks_seen = [], set(), set()

    def add(node_name, name, array):
        if array is None or not hasattr(array, "shape"):
            return
        root = memory.root_buffer(array)
        key = id(root)
        entries.append(
            SavedEntry(
                node=node_name,
                name=name,
                shape=tuple(array.shape),
                dtype=str(array.dtype),
                nbytes=int(array.nbytes),
                buffer_bytes=int(root.nbytes),
                category=memory.category_of(root),
                first=key not in seen,
            )
        )
        seen.add(key)

    for node in _nodes_in_forward_order(roots):
        for name, saved in _saved_of(node).items():
            if saved.packed is not None:
                hooks = saved.packed[0]
                held = getattr(hooks, "held", None)
                if held is not None and id(hooks) not in hooks_seen:
                    hooks_seen.add(id(hooks))
                    for holder, what, array in held():
                        add(holder, what, array)
                continue
            add(node.name(), name, saved.array)
    return entries


def held_bytes(entries, parameters: bool = False) -> int:
    """The bytes the listed tensors hold, each buffer once (without the parameters' buffers
    unless ``parameters``: the activation part of a step's floor)."""
    return sum(e.buffer_bytes for e in entries if e.first and (parameters or e.category != "parameters"))
