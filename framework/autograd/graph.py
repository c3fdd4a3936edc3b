"""Graph-level tools with PyTorch's names (``torch.autograd.graph``).

- :class:`allow_mutation_on_saved_tensors`: inside it, modifying in place a tensor that
  autograd saved for backward is allowed: the saved value is copied just before the
  write, so backward still sees the value it saved (and computes the right gradient).
  The copies are memory the inplace op did not save (category ``inplace_copies``).
- :func:`increment_version`: bumps a tensor's version counter, as an inplace op would.
- :class:`saved_tensors_hooks`: every tensor autograd saves inside it goes through a
  pack hook, and comes back through an unpack hook when backward reads it (the
  mechanism ``framework.utils.checkpoint`` is built on).
"""

from __future__ import annotations

import itertools
import weakref

from .. import memory
from ..backend import get_array_module
from ..callsite import call_site
from ..tensor import Tensor, _wrap
from . import function as _function
from . import node as _node

_OUT_OF_CONTEXT = (
    "Trying to backward outside of the 'allow_mutation_on_saved_tensors' context in which the graph was "
    "originally recorded."
)


class _ClosedContext:
    """The version counter given to tensors saved inside a context that has exited:
    reading it (when backward unpacks them) raises, as in PyTorch."""

    __slots__ = ()
    writes = None

    @property
    def value(self):
        raise AssertionError(_OUT_OF_CONTEXT)


class allow_mutation_on_saved_tensors:
    """Context manager: tensors saved for backward may be modified in place inside it.

    Every tensor autograd saves inside the block is tracked; just before an inplace op
    writes memory that a tracked saved tensor still needs (same storage, overlapping
    memory, unchanged version), that saved value is copied and the node keeps the copy.
    One copy is made per saved array and version, however many nodes saved it, and it
    is freed with the last node that holds it. ``ctx.cloned`` holds the live copies.

    Backward through a graph recorded inside the block must run inside it (PyTorch's
    rule): afterwards it raises ``AssertionError``. Blocks cannot be nested.
    """

    def __enter__(self):
        if _function.before_write is not None:
            raise RuntimeError("allow_mutation_on_saved_tensors contexts cannot be nested")
        self.cloned = weakref.WeakValueDictionary()  # live copies
        self._tracked = {}  # version counter -> [weakref to SavedTensor]
        self._ids = itertools.count()
        _node.on_save = self._on_save
        _function.before_write = self._before_write
        return self

    def __exit__(self, *exc):
        _node.on_save = None
        _function.before_write = None
        closed = _ClosedContext()
        for refs in self._tracked.values():
            for ref in refs:
                saved = ref()
                if saved is not None and saved.array is not None:
                    saved.vc = closed
        self._tracked.clear()
        return False

    def _on_save(self, saved) -> None:
        self._tracked.setdefault(saved.vc, []).append(weakref.ref(saved))

    def _before_write(self, target) -> None:
        vc = target._vc
        refs = self._tracked.get(vc)
        if not refs:
            return
        live = [s for s in (r() for r in refs) if s is not None and s.array is not None]
        self._tracked[vc] = [weakref.ref(s) for s in live]
        version = vc.value
        may_share = get_array_module(target._data).may_share_memory
        copies = {}  # one copy per saved array, shared by every node that saved it
        for saved in live:
            if saved.vc is not vc or saved.version != version or not may_share(saved.array, target._data):
                continue
            old = saved.array
            copy = copies.get(id(old))
            if copy is None:
                copy = copies[id(old)] = memory.track(old.copy(), "inplace_copies")
                self.cloned[next(self._ids)] = copy
            memory.note_released(old)
            memory.note_saved(copy)
            saved.array, saved.vc = copy, None  # a private copy: nobody else writes it


class saved_tensors_hooks:
    """Context manager: how autograd keeps the tensors it saves for backward inside it.

    ``pack_hook(tensor)`` is called with each tensor an op saves (a tensor sharing its
    memory and version counter, without history) and may return anything; autograd keeps
    that instead of the tensor. When backward needs the tensor, ``unpack_hook(packed)``
    must return a tensor with the same values (after the usual version check: a saved
    tensor modified in place still raises). The innermost context applies; a tensor is
    packed by the hooks active when it was saved, wherever backward runs. As PyTorch's
    ``torch.autograd.graph.saved_tensors_hooks``; a pack hook that returns its argument
    keeps the tensor as usual.
    """

    def __init__(self, pack_hook, unpack_hook):
        self.pack_hook = pack_hook
        self.unpack_hook = unpack_hook

    def __enter__(self):
        _node.saved_hooks.append(self)
        return self

    def __exit__(self, *exc):
        if not _node.saved_hooks or _node.saved_hooks[-1] is not self:
            raise RuntimeError("saved_tensors_hooks contexts must be exited in the order they were entered")
        _node.saved_hooks.pop()
        return False

    def pack(self, saved, array):
        t = _wrap(array)
        if saved.vc is not None:
            t._vc = saved.vc
        packed = self.pack_hook(t)
        return array if packed is t else packed

    def unpack(self, packed):
        t = self.unpack_hook(packed)
        if not isinstance(t, Tensor):
            raise TypeError(f"unpack_hook must return a Tensor, got {type(t).__name__}")
        return t._live()


def increment_version(tensor) -> None:
    """Bumps the version counter of ``tensor`` (or of each tensor in an iterable), as an
    inplace op would, so saved copies of it become stale. A no-op for inference tensors."""
    tensors = tensor if isinstance(tensor, (list, tuple)) else (tensor,)
    site = call_site()
    for t in tensors:
        t._vc.bump("increment_version", site)


__all__ = ["allow_mutation_on_saved_tensors", "increment_version", "saved_tensors_hooks"]
