"""``cupy.cuda.memory_hook`` of the stand-in: ``MemoryHook``, registered per thread."""

from __future__ import annotations

import collections
import threading

_hooks_local = threading.local()


def get_memory_hooks() -> collections.OrderedDict:
    """The calling thread's registered hooks, by name (CuPy keeps them per thread)."""
    hooks = getattr(_hooks_local, "hooks", None)
    if hooks is None:
        hooks = _hooks_local.hooks = collections.OrderedDict()
    return hooks


class MemoryHook:
    """Base class of memory hooks, as ``cupy.cuda.MemoryHook``: register with ``with hook:``.

    Subclasses override any of ``alloc_preprocess``, ``alloc_postprocess``,
    ``malloc_preprocess``, ``malloc_postprocess``, ``free_preprocess`` and
    ``free_postprocess``; each is called with keyword arguments only. Registering two
    hooks of the same ``name`` in one thread raises KeyError.
    """

    name = "MemoryHook"

    def __enter__(self):
        hooks = get_memory_hooks()
        if self.name in hooks:
            raise KeyError(f"memory hook {self.name} already exists")
        hooks[self.name] = self
        return self

    def __exit__(self, *_):
        del get_memory_hooks()[self.name]

    def alloc_preprocess(self, **kwargs):
        pass

    def alloc_postprocess(self, **kwargs):
        pass

    def malloc_preprocess(self, **kwargs):
        pass

    def malloc_postprocess(self, **kwargs):
        pass

    def free_preprocess(self, **kwargs):
        pass

    def free_postprocess(self, **kwargs):
        pass


def _hooks():
    return tuple(get_memory_hooks().values()) if getattr(_hooks_local, "hooks", None) else ()
