"""Autograd's nodes and versions: what backward works with, below tensors and ops.

- :class:`VersionCounter`: the version of a storage, shared by its views and
  ``detach()``; every inplace op bumps it, naming itself and its call site.
- :class:`SavedTensor`: an array a node keeps for backward, with the version it had;
  reading it back after an inplace change raises, naming the op that changed it.
- :class:`Node`: what the engine runs: its edges (``next``), ``run_backward``,
  ``release`` of its saved tensors, pre-hooks. Every op's node is a
  :class:`framework.autograd.function.Function`, a Node with the op contract on top.

This module works on arrays and nodes only; it imports nothing above ``memory``. Two
extension points let higher layers plug in without an import from here: ``capture``
(the recorder of :mod:`framework.compile` while a step is being captured) and
``before_backward`` (callbacks run as a backward starts).
"""

from __future__ import annotations

import numpy as np

from .. import memory

_FREED = object()

# The recorder of framework.compile while a step is being captured, else None: the one
# check the hot paths (the apply path, the engine) pay for compilation.
capture = None

# Callbacks run at the start of every backward (framework.tensor registers the one that
# moves retain_grad hooks to the tensors' latest nodes).
before_backward: list = []

# Higher-order gradients (``create_graph=True``). While the engine runs a backward that
# records history, ``graph_mode`` is True and saved tensors read back as tensors with
# history (so the SAME backward formula, run on tensors, builds the graph of its own
# derivative); ``higher`` is :mod:`framework.autograd.higher` (layer 5), which does the
# tensor-level work: set when it is imported, as ``capture`` is by the compiler.
graph_mode = False
higher = None

# Saved-tensor hooks (PyTorch's ``saved_tensors_hooks``): a stack of hook objects, pushed by
# :class:`framework.autograd.graph.saved_tensors_hooks` and by ``framework.utils.checkpoint``.
# A SavedTensor made while one is on top hands its array to the hook's ``pack(saved,
# array)`` and keeps what that returns in place of the array (the array itself: kept as
# usual); ``unpack(packed)`` gives the array back when backward reads it, after the
# version check. ``None`` on top suspends the hooks below it.
saved_hooks: list = []


class GraphTask:
    """One run of the engine (PyTorch's graph task), ``graph_task`` while it runs: what a
    checkpoint keys the values it recomputed by. ``cleanups`` run when the run ends."""

    __slots__ = ("cleanups",)

    def __init__(self):
        self.cleanups = []

    def finish(self) -> None:
        cleanups, self.cleanups = self.cleanups, []
        for fn in cleanups:
            fn()


# The backward the engine is running (a GraphTask), else None.
graph_task = None

# The op mode of a checkpointed region (framework.utils.checkpoint) while its forward or
# its recomputation runs, else None. It sees every op call, as PyTorch's TorchDispatchMode
# sees every call below autograd: the apply path (autograd.function) calls
# ``before(cls, inputs, inplace)`` once the inputs are read (after policy auto decided: a
# mode never holds a tensor, so no proof changes), ``kernel(ctx, cls, arrays, params,
# inplace)`` in place of the kernel, ``kept(ctx, arrays)`` with what the kernel keeps,
# ``after(ctx, cls, inputs, params, out, inplace)`` with the output; the creation
# functions call ``created(tensor)`` with each tensor they make.
op_mode = None


def _as_array(a):
    # NumPy ufuncs and reductions return scalars for 0-d results; tensors and gradients
    # must stay arrays (repr, .numpy(), out= and memory accounting expect one).
    return np.asarray(a) if isinstance(a, np.generic) else a


class VersionCounter:
    """The version of a storage, shared by its views and ``detach()``.

    ``writes`` remembers the last few inplace ops as ``(version after, op, (file, line))``
    so that a stale saved tensor can name the op that changed it. The defaults are class
    attributes: every tensor gets a counter, and most are never written, so a new one
    costs an allocation and nothing more.
    """

    value = 0
    writes = None
    # Saved tensors that recorded this version while a hook packed them away (they hold
    # no array, so nothing counts them as a reference): an inplace site never writes over
    # such a tensor, as it never writes over one autograd holds.
    packed = 0

    def bump(self, op_name: str, site) -> None:
        self.value += 1
        writes = self.writes
        if writes is None:
            self.writes = [(self.value, op_name, site)]
        else:
            writes.append((self.value, op_name, site))
            if len(writes) > 8:
                del writes[0]


def _describe(array) -> str:
    return f"[{array.dtype} tensor of shape {tuple(array.shape)}]"


def _describe_saved(saved) -> str:
    """``_describe`` of a saved tensor's array, or, where a hook packed it away, what the
    hook says of it (its ``describe(packed)``)."""
    if saved.array is not None:
        return _describe(saved.array)
    hooks, packed = saved.packed or (None, None)
    describe = getattr(hooks, "describe", None)
    return describe(packed) if describe is not None else "[a tensor a saved-tensor hook packed]"


# Called with every new SavedTensor of a tensor others can write, while
# autograd.graph.allow_mutation_on_saved_tensors() is active (None otherwise).
on_save = None


class SavedTensor:
    """An array that a node keeps for backward, with the version it had when saved.

    Made while a saved-tensor hook is active (:data:`saved_hooks`), it keeps what the
    hook's ``pack`` returned instead (``packed``: the hook and its value; ``array`` is
    None), and ``unpack`` asks the hook for the array, after the same version check.
    """

    __slots__ = ("array", "vc", "version", "name", "packed", "__weakref__")

    def __init__(self, array, vc, name):
        self.array = self.packed = None
        self.vc = vc  # None for private copies nobody else can modify
        self.version = vc.value if vc is not None else 0
        self.name = name
        if saved_hooks:
            hooks = saved_hooks[-1]
            if hooks is not None:
                packed = hooks.pack(self, array)
                if packed is not array:
                    self.packed = (hooks, packed)
                    if vc is not None:
                        vc.packed += 1
                    return
        self.array = array
        memory.note_saved(array)
        if on_save is not None and vc is not None:
            on_save(self)

    def unpack(self, node):
        vc = self.vc
        if vc is not None:
            if vc.value != self.version:
                raise RuntimeError(_version_error(self, node))
            if detached_inplace[0] and self.name != "result" and _input_detached(node, self.name):
                raise RuntimeError(
                    "Trying to use a saved tensor that has been detached in-place, i.e. with .detach_()."
                    "This is not supported, please use out-of-place `.detach()` instead"
                )
        packed = self.packed
        if packed is not None:
            return packed[0].unpack(packed[1])
        return self.array

    def release(self):
        if self.array is not None:
            memory.note_released(self.array)
            self.array = None
        elif self.packed is not None:
            self.packed = None
            if self.vc is not None:
                self.vc.packed -= 1

    def __del__(self):
        if self.array is None and self.packed is None:
            return
        try:
            self.release()
        except Exception:  # interpreter shutdown: module globals may be gone
            pass


detached_inplace = [False]  # set once any non-leaf was detached in place: only then is it checked


def _input_detached(node, name) -> bool:
    """Whether the input ``name`` of ``node`` was a non-leaf later detached in place:
    the node can no longer send its gradient anywhere (see ``Tensor.detach_``)."""
    edges = node.__dict__.get("next")
    if edges is None:
        return False
    for saved_name, idx, _ in type(node)._save_plan:
        if saved_name == name:
            edge = edges[idx] if 0 <= idx < len(edges) else None
            return isinstance(edge, Node) and edge.__dict__.get("_output_detached", False)
    return False


def modified_by(vc, version: int) -> str:
    """The sentence that names the writes of ``vc`` since ``version`` (the last eight are
    remembered), as ``' It was modified by add_ at train.py:10 (version 1).'``; ``''``
    when there were none."""
    writes = [w for w in (vc.writes or ()) if w[0] > version]
    if writes:
        parts = [f"{op} at {file}:{line} (version {v})" for v, op, (file, line) in writes]
        return " It was modified by " + ", then ".join(parts) + "."
    if vc.value > version:
        return " The op that modified it is no longer recorded (more than 8 inplace ops since)."
    return ""


def _version_error(saved: SavedTensor, node) -> str:
    what = "the output" if saved.name == "result" else f"input '{saved.name}'"
    msg = (
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: {_describe_saved(saved)}, which is {what} of {node.name()}, "
        f"is at version {saved.vc.value}; expected version {saved.version} instead."
    )
    return (
        msg
        + modified_by(saved.vc, saved.version)
        + (
            " Hint: make the inplace op out of place (e.g. x = x.exp() instead of x.exp_()), "
            "or clone() the tensor before modifying it."
        )
    )


class Node:
    """An autograd node: what the engine runs in backward.

    ``next`` holds, per input, the node (or leaf tensor) its gradient flows into, or
    None; ``needs_input_grad`` which inputs want one. ``run_backward`` calls
    ``backward``; ``release`` frees the saved tensors after it (a second backward then
    raises). Saved tensors are read back as attributes (``ctx.x``), version-checked.
    """

    saves: tuple = ()
    _save_plan: tuple = ()
    # PyTorch's name of the node (``grad_fn.name()``, what users print and compare):
    # ``<Class>Backward0`` unless a class (or, where PyTorch's overloads differ, a node in
    # forward) names it otherwise, e.g. ``PowBackward1`` for a tensor exponent.
    node_name = "NodeBackward0"
    reuse_grad = False  # set by the engine: backward may write its result over its grad
    # False for a node whose backward cannot run on tensors (create_graph raises there)
    differentiable_backward = True

    def backward(ctx, grad):  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(ctx).__name__} must define backward")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "node_name" not in cls.__dict__:
            cls.node_name = cls.__name__ + "Backward0"

    def name(self) -> str:
        return self.node_name

    def __getattr__(self, name):
        # Only reached for attributes not set in forward: the saved tensors.
        if name.startswith("_saved_"):
            return self.saved_by_torch_name(name[7:])
        saved = self.__dict__.get("_saved")
        if saved is _FREED:
            raise RuntimeError(_backward_twice_message(self))
        if saved is not None and name in saved:
            if graph_mode:
                return higher.saved_as_tensor(self, name, saved[name])
            return saved[name].unpack(self)
        if graph_mode and hasattr(type(self), "kept_as_tensors"):
            kept = self.kept_as_tensors()  # what another device's forward kept in another form
            if name in kept:
                return kept[name]
        if name in type(self).saves:
            raise AttributeError(
                f"{self.name()} did not save {name!r}: saved_when says it is needed only for "
                "inputs whose gradient was not requested"
            )
        raise AttributeError(f"{type(self).__name__!s} node has no attribute {name!r}")

    def saved_by_torch_name(self, name):  # pragma: no cover - every op node is a Function
        raise AttributeError(f"{type(self).__name__!s} node has no attribute '_saved_{name}'")

    def run_backward(self, grad):
        """Calls ``backward`` and checks the number of gradients it returned."""
        if self.__dict__.get("_saved") is _FREED:
            raise RuntimeError(_backward_twice_message(self))
        grads = self.backward(grad)
        if type(grads) is not tuple:
            grads = (grads,)
        for g in grads:
            if isinstance(g, np.generic):
                grads = tuple(_as_array(g) for g in grads)
                break
        if len(grads) != len(self.next):
            raise RuntimeError(f"{self.name()} returned {len(grads)} gradients, expected {len(self.next)}")
        return grads

    def release(self):
        """Frees the saved tensors (after a backward without ``retain_graph``)."""
        saved = self.__dict__.get("_saved")
        if saved is not None and saved is not _FREED:
            for s in saved.values():
                s.release()
            self._saved = _FREED
        elif saved is None and self.__dict__.get("_holds_constants"):
            self._saved = _FREED  # a scalar operand, which PyTorch saves as a tensor

    def register_prehook(self, fn):
        """``fn(grad_array) -> grad_array | None`` runs before this node's backward."""
        hooks = self.__dict__.setdefault("_pre_hooks", [])
        hooks.append(fn)
        return _HookHandle(hooks, fn)

    def __repr__(self):
        return f"<{self.name()}>"


class _HookHandle:
    __slots__ = ("_hooks", "_fn")

    def __init__(self, hooks, fn):
        self._hooks, self._fn = hooks, fn

    def remove(self):
        if self._fn in self._hooks:
            self._hooks.remove(self._fn)


def _backward_twice_message(node) -> str:
    return (
        f"Trying to backward through the graph a second time (or directly access saved tensors "
        f"after they have already been freed): {node.name()} has freed its saved tensors. "
        "Saved intermediate values of the graph are freed when you call .backward() or "
        "autograd.grad(). Specify retain_graph=True if you need to backward through the graph a "
        "second time or if you need to access saved tensors after calling backward."
    )
