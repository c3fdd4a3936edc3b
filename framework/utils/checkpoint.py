"""Activation checkpointing, PyTorch's ``torch.utils.checkpoint`` (the non-reentrant one).

``checkpoint(fn, *args, use_reentrant=False)`` runs ``fn`` as usual, building its graph,
but every tensor that graph saves for backward is packed away by a saved-tensor hook
(:data:`framework.autograd.node.saved_hooks`): only ``fn``'s inputs are kept. When
backward first reads one of those tensors, ``fn`` runs again on the kept inputs (grad
on, the random generators put back where its forward found them), and the tensors it
saves fill the forward's places in order (the n-th saved tensor of the recomputation is
the forward's n-th); it stops as soon as the last place is filled. What it recomputed
lives until its node is done with it, or that backward ends.

The checks are PyTorch's, with more said, plus two it does not make:

- an input of ``fn`` modified in place after the forward raises when the recomputation
  needs it, naming the op and its line (the inputs are saved tensors);
- beyond PyTorch: a tensor from outside ``fn`` that is not one of its inputs (a
  closure's) and that changed after ``fn`` read it (later in the forward, or after it)
  raises too, and so does a recomputation that would write a second time into a tensor
  ``fn`` did not make: PyTorch recomputes silently with the new values;
- ``determinism_check="default"``: the recomputation saves as many tensors as the forward,
  with the same shapes, dtypes and devices (here also by the same op, under the same
  name), else :class:`CheckpointError` says which (with ``debug=True``, with the ops of
  both runs and their lines).

Selective checkpoint (:func:`create_selective_checkpoint_contexts`): a policy called with
each op of the forward says whether its output is kept (``*_SAVE``: the recomputation
takes it from the cache instead of running the op again) or recomputed. The op is the
framework's op class (a :class:`framework.autograd.function.Function`: ``Matmul``,
``Linear``, ``Conv2d``, ``ScaledDotProductAttention``, ...; docs/RECOMPUTE.md maps them to
PyTorch's aten ops). :func:`save_matmuls_policy` is torchtitan's default.

With the inplace policies: none changes a number (bit for bit against no checkpoint under
off, auto and on, dropout included, tests/framework/utils/). A tensor packed away still
counts as saved for every inplace site and for policy auto's proof (its version
counter's ``packed``), and the inputs are held, so nothing writes over what the
recomputation is checked against. The recomputation does not update BatchNorm's running
statistics again (``grad_mode.state.recomputing``; PyTorch moves them twice).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import weakref

from .. import memory
from .. import random as _random
from ..autograd import function as _function
from ..autograd import node as _node
from ..autograd.grad_mode import enable_grad, is_grad_enabled
from ..autograd.grad_mode import state as _grad_state
from ..autograd.node import SavedTensor, VersionCounter, modified_by
from ..backend import device_of
from ..callsite import call_site
from ..ops import autocast as _autocast
from ..ops.attention import ScaledDotProductAttention
from ..ops.conv import Conv2d
from ..ops.linalg import Linear, Matmul
from ..tensor import Tensor, _wrap

__all__ = [
    "CheckpointError",
    "CheckpointPolicy",
    "SelectiveCheckpointContext",
    "checkpoint",
    "checkpoint_sequential",
    "create_selective_checkpoint_contexts",
    "noop_context_fn",
    "save_matmuls_policy",
    "set_checkpoint_debug_enabled",
    "set_checkpoint_early_stop",
]

_DETERMINISM_CHECKS = ("default", "none")
_DEBUG_TIP = (
    "\nTip: to see the ops of the forward and of the recomputation with their lines, pass debug=True to "
    "checkpoint(...) or run it inside set_checkpoint_debug_enabled(True)."
)


class CheckpointError(RuntimeError):
    """The recomputation of a checkpointed function did not save what its forward saved."""


class _StopRecomputation(BaseException):
    """Raised by the recomputation's pack hook once the forward's last place is filled
    (early stop), caught by the checkpoint. A BaseException, so that an ``except
    Exception`` inside the function cannot swallow it."""


_early_stop: bool | None = None
_debug: bool | None = None


@contextlib.contextmanager
def set_checkpoint_early_stop(enable: bool):
    """Whether checkpoints run inside the block stop their recomputation as soon as it
    has filled every saved tensor (True, the default) or run the whole function again.
    Only the forward needs to be inside it."""
    global _early_stop
    prev, _early_stop = _early_stop, enable
    try:
        yield
    finally:
        _early_stop = prev


@contextlib.contextmanager
def set_checkpoint_debug_enabled(enabled: bool | None):
    """Overrides ``checkpoint(..., debug=)`` inside the block (None: each call's own)."""
    global _debug
    prev, _debug = _debug, enabled
    try:
        yield
    finally:
        _debug = prev


def noop_context_fn():
    """The default ``context_fn``: no context around the forward or the recomputation."""
    return contextlib.nullcontext(), contextlib.nullcontext()


def _metadata(saved, array, op) -> dict:
    """What the determinism check compares for one saved tensor."""
    return {
        "shape": tuple(array.shape),
        "dtype": array.dtype,
        "device": device_of(array),
        "op": op,
        "saved as": saved.name,
    }


def _show(meta) -> str:
    return ", ".join(f"{k}: {v}" for k, v in meta.items())


class _Holder:
    """What a saved tensor of a checkpointed forward keeps in place of its array: the
    array's metadata, and the values recomputed for it, one per backward (GraphTask)."""

    __slots__ = ("values", "meta", "__weakref__")

    def __init__(self, meta):
        self.values = {}
        self.meta = meta

    def drop(self, task) -> None:
        array = self.values.pop(task, None)
        if array is not None:
            memory.note_released(array)

    def __del__(self):
        try:
            for array in self.values.values():
                memory.note_released(array)
        except Exception:  # interpreter shutdown: module globals may be gone
            pass


class _Read:
    """A tensor from outside the checkpointed function that its forward read: the
    version it had then, which op read it first, what it was."""

    __slots__ = ("version", "op", "what")

    def __init__(self, version, op, what):
        self.version, self.op, self.what = version, op, what


class _Frame:
    """One call of :func:`checkpoint`: the function, its kept inputs, the holders of what
    its forward saved (it is that forward's pack hook), and what it needs to run again."""

    def __init__(self, fn, kwargs, early_stop, check, debug, recompute_context, preserve_rng_state):
        self.fn, self.kwargs = fn, kwargs
        self.label = f"checkpoint({getattr(fn, '__name__', None) or type(fn).__name__})"
        self.early_stop, self.check = early_stop, check
        self.recompute_context = recompute_context
        self.inputs = []  # per positional argument: (SavedTensor, edge) for a tensor, (None, value) else
        self.holders = []  # weak references to the forward's _Holders, in the order it saved
        self.reads = {}  # VersionCounter -> _Read: tensors from outside fn that its forward read
        self.writes = set()  # VersionCounters of tensors from outside fn that its forward wrote in place
        self.made = set()  # VersionCounters of the tensors the forward made (while it runs)
        self.rng = {} if preserve_rng_state else None  # generator key -> its state at fn's first draw
        self.autocast = _autocast.settings()  # recomputed under the forward's mixed precision
        self.recomputed = {}  # GraphTask -> True once recomputed in that backward
        self.forward_completed = False
        self.ignore_mismatch = False  # a backward inside the forward recomputed part of it
        self.op = None  # the op being applied, for the metadata of what it saves
        self.cache = None  # a selective checkpoint's cached outputs (_SelectiveCache)
        self.log = [] if debug else None  # the forward's ops and their lines (debug)
        self.recompute_log = None

    def name(self) -> str:  # as a node's, for the version error of an input
        return self.label

    # --- the inputs ---------------------------------------------------------------
    def save_inputs(self, args) -> None:
        """Keeps the inputs as saved tensors (their versions checked when they are used
        again), never packed by an enclosing checkpoint: every inplace site sees them held."""
        _node.saved_hooks.append(None)
        try:
            for i, a in enumerate(args):
                if isinstance(a, Tensor):
                    edge = a if (a.is_leaf and a.requires_grad) else a.grad_fn
                    self.inputs.append((SavedTensor(a._live(), a._vc, f"args[{i}]"), edge))
                else:
                    self.inputs.append((None, a))
        finally:
            _node.saved_hooks.pop()

    def get_inputs(self) -> list:
        """The inputs for the recomputation: a leaf that requires grad is itself; another
        tensor a new one around the kept values, with the original's history and version
        counter. Raises as any saved tensor does where one was modified in place since."""
        args = []
        for saved, edge in self.inputs:
            if saved is None:
                args.append(edge)
                continue
            array = saved.unpack(self)
            if isinstance(edge, Tensor):
                args.append(edge)
                continue
            t = _wrap(array)
            t._vc = saved.vc
            t._grad_fn = edge
            args.append(t)
        return args

    def check_reads(self) -> None:
        """Raises where a tensor from outside fn changed since its forward read it (later
        in that forward, or after it): the recomputation would read other values."""
        for vc, read in self.reads.items():
            if vc.value != read.version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: {read.what}, which {self.label} read in its forward (an input of {read.op}, "
                    f"from outside the function), is at version {vc.value}; expected version {read.version} "
                    f"instead.{modified_by(vc, read.version)} Recomputing the function would read the new values "
                    "and give a wrong gradient (PyTorch's checkpoint does that silently). Hint: modify it after "
                    "backward, or clone() it before modifying it."
                )

    # --- the forward's pack hook --------------------------------------------------
    def pack(self, saved, array):
        if not hasattr(array, "shape"):
            return array  # a Python scalar: kept as it is
        holder = _Holder(_metadata(saved, array, self.op))
        self.holders.append(weakref.ref(holder))
        return holder

    def unpack(self, holder):
        task = _node.graph_task
        temporary = task is None  # read outside a backward (grad_fn._saved_*): recomputed for this read
        if temporary:
            task = _node.GraphTask()
        try:
            if task not in self.recomputed:
                self.recompute(task)
            array = holder.values.get(task)
            if array is None:
                raise CheckpointError(
                    f"{self.label}: a tensor its forward saved was not recomputed: the recomputation stopped "
                    "before it (a backward inside the checkpointed function, with early stop off)." + _DEBUG_TIP
                )
            return array
        except CheckpointError as e:
            if self.log is None:
                raise
            raise CheckpointError(f"{e}\n\n{self.debug_logs()}") from None
        finally:
            if temporary:
                task.finish()

    def describe(self, holder) -> str:
        meta = holder.meta
        return f"[{meta['dtype']} tensor of shape {meta['shape']}]"

    def held(self):
        """What this checkpoint keeps for backward (autograd.saved's listing)."""
        for saved, _ in self.inputs:
            if saved is not None and saved.array is not None:
                yield self.label, saved.name, saved.array
        if self.cache is not None:
            yield from self.cache.held(self.label)

    # --- random draws -------------------------------------------------------------
    def watch_rng(self, key, gen) -> None:
        """The state of each generator at the function's first draw from it."""
        if key not in self.rng:
            self.rng[key] = _random.generator_state(gen)

    @contextlib.contextmanager
    def replay_rng(self):
        """Each generator the recomputation draws from starts where the forward's did,
        and is put back afterwards (PyTorch's ``fork_rng``)."""
        if self.rng is None:
            yield
            return
        around = {}

        def watch(key, gen):
            if key not in around:
                around[key] = (gen, _random.generator_state(gen))
                if key in self.rng:
                    _random.set_generator_state(gen, self.rng[key])

        _random.watchers.append(watch)
        try:
            yield
        finally:
            _random.watchers.remove(watch)
            for gen, state in around.values():
                _random.set_generator_state(gen, state)

    # --- the recomputation --------------------------------------------------------
    def recompute(self, task) -> None:
        self.recomputed[task] = True
        task.cleanups.append(functools.partial(self.forget, task))
        args = self.get_inputs()
        self.check_reads()
        run = _Recomputation(self, task)
        saved_before = memory.saved_bytes(parameters=False)
        prev = _node.op_mode, _node.graph_mode, _grad_state.recomputing
        _node.saved_hooks.append(run)
        _node.op_mode, _node.graph_mode, _grad_state.recomputing = run, False, True
        try:
            with enable_grad(), self.replay_rng(), _autocast.restored(self.autocast), self.recompute_context:
                self.fn(*args, **self.kwargs)
        except _StopRecomputation:
            pass
        finally:
            _node.op_mode, _node.graph_mode, _grad_state.recomputing = prev
            if _node.saved_hooks.pop() is not run:
                raise RuntimeError(f"{self.label}: saved-tensor hooks were left unbalanced by the recomputation")
            self.recompute_log = run.log
        memory.count("recompute_runs")
        memory.count("recomputed_ops", run.ops)
        memory.count("recomputed_bytes", max(memory.saved_bytes(parameters=False) - saved_before, 0))
        self.check_match(run)

    def forget(self, task) -> None:
        """Drops what was recomputed for ``task`` (its backward ended)."""
        self.recomputed.pop(task, None)
        for ref in self.holders:
            holder = ref()
            if holder is not None:
                holder.drop(task)

    def check_match(self, run) -> None:
        """PyTorch's determinism check: as many saved tensors, the same metadata."""
        if self.ignore_mismatch:
            return
        if run.count != len(self.holders):
            raise CheckpointError(
                f"{self.label}: A different number of tensors was saved during the original forward and "
                f"recomputation.\nNumber of tensors saved during forward: {len(self.holders)}\n"
                f"Number of tensors saved during recomputation: {run.count}.{_DEBUG_TIP}"
            )
        if not self.check:
            return
        different = []
        for idx, ref in enumerate(self.holders):
            holder = ref()
            if holder is not None and holder.meta != run.meta[idx]:
                different.append(
                    f"tensor at position {idx}:\nsaved metadata: {_show(holder.meta)}\n"
                    f"recomputed metadata: {_show(run.meta[idx])}\n"
                )
        if different:
            raise CheckpointError(
                f"{self.label}: Recomputed values for the following tensors have different metadata than during "
                "the forward pass.\n" + "".join(different) + _DEBUG_TIP
            )

    def debug_logs(self) -> str:
        fwd = "\n".join(self.log) or "(none)"
        rec = "\n".join(self.recompute_log or ()) or "(none)"
        return (
            f"Operations executed during the original forward:\n{fwd}\n\n"
            f"Operations executed during recomputation:\n{rec}"
        )


def _logged(cls) -> str:
    file, line = call_site()
    return f"{cls.__name__} at {file}:{line}"


class _Forward:
    """The op mode of a checkpointed forward: the tensors from outside the function it
    reads (at which version) and the ones its ops make; the selective cache, if any."""

    def __init__(self, frame):
        self.frame = frame
        self.cache = None  # _Caching while a selective checkpoint's forward context is entered

    def before(self, cls, inputs, inplace):
        frame = self.frame
        frame.op = cls.__name__
        made, reads = frame.made, frame.reads
        for i, t in enumerate(inputs):
            if isinstance(t, Tensor):
                vc = t._vc
                if vc.__class__ is not VersionCounter or vc in made:
                    continue
                if inplace and i == 0:
                    frame.writes.add(vc)
                elif vc not in reads:
                    reads[vc] = _Read(vc.value, cls.__name__, f"[{t.dtype} tensor of shape {tuple(t.shape)}]")
        if frame.log is not None:
            frame.log.append(_logged(cls))
        if self.cache is not None:
            self.cache.pending = None

    def kernel(self, ctx, cls, arrays, params, inplace):
        return _function._run_kernel(ctx, cls, arrays, params, inplace)

    def kept(self, ctx, arrays):
        if self.cache is not None:
            self.cache.pending = dict(arrays)

    def created(self, t):
        self.frame.made.add(t._vc)

    def after(self, ctx, cls, inputs, params, out, inplace):
        self.frame.op = None
        if not inplace and not cls.is_view:
            self.frame.made.add(out._vc)
        if self.cache is not None:
            self.cache.after(ctx, cls, inputs, params, out)


class _Recomputation:
    """The pack hook and op mode of one recomputation: fills the forward's holders, in
    order; refuses to write twice into a tensor from outside the function; takes the
    selective cache's outputs instead of running those ops."""

    def __init__(self, frame, task):
        self.frame, self.task = frame, task
        self.count = 0
        self.ops = 0
        self.meta = []
        self.op = None
        self.cache = None  # _Cached while a selective checkpoint's recompute context is entered
        self.log = [] if frame.log is not None else None

    def pack(self, saved, array):
        if not hasattr(array, "shape"):
            return array
        frame = self.frame
        idx = self.count
        if idx >= len(frame.holders):
            if not frame.forward_completed:  # a backward inside the forward, early stop off
                frame.ignore_mismatch = True
                return array
            raise CheckpointError(
                f"{frame.label}: trying to save more tensors during recomputation than during the original "
                "forward pass." + _DEBUG_TIP
            )
        self.count = idx + 1
        self.meta.append(_metadata(saved, array, self.op))
        holder = frame.holders[idx]()
        if holder is not None:  # (None: its node has run and freed it)
            holder.values[self.task] = array
            memory.note_saved(array)
        if frame.early_stop and self.count == len(frame.holders):
            raise _StopRecomputation
        return array  # the recomputed graph keeps it too (a backward inside the function may use it)

    def unpack(self, packed):  # pragma: no cover - pack never packs anything away
        return packed

    def before(self, cls, inputs, inplace):
        self.op = cls.__name__
        self.ops += 1
        if inplace and inputs[0]._vc in self.frame.writes:
            t = inputs[0]
            raise CheckpointError(
                f"{self.frame.label}: the recomputation would write in place ({cls.inplace_name}) into "
                f"[{t.dtype} tensor of shape {tuple(t.shape)}], which the function did not make: its forward wrote it "
                "already, and this would write it a second time (PyTorch's checkpoint does that silently). Write "
                "into a clone(), or move the write out of the checkpointed function."
            )
        if self.log is not None:
            self.log.append(_logged(cls))

    def kernel(self, ctx, cls, arrays, params, inplace):
        if self.cache is not None:
            return self.cache.kernel(ctx, cls, arrays, params, inplace)
        return _function._run_kernel(ctx, cls, arrays, params, inplace)

    def kept(self, ctx, arrays):
        pass

    def created(self, t):
        pass

    def after(self, ctx, cls, inputs, params, out, inplace):
        self.op = None


def _attach(mode_type, what):
    mode = _node.op_mode
    if not isinstance(mode, mode_type):
        raise RuntimeError(
            f"the {what} context of create_selective_checkpoint_contexts works only as checkpoint's context_fn: "
            "checkpoint(fn, *args, use_reentrant=False, context_fn=functools.partial("
            "create_selective_checkpoint_contexts, policy))"
        )
    return mode


# --- selective checkpoint ----------------------------------------------------------


class CheckpointPolicy(enum.Enum):
    """What a selective checkpoint does with an op's output (PyTorch's names):
    ``{MUST,PREFER}_SAVE`` keep it from the forward (the recomputation does not run the
    op), ``{MUST,PREFER}_RECOMPUTE`` run the op again. ``MUST`` and ``PREFER`` differ only
    for a compiler that may override ``PREFER``; eagerly they are the same."""

    MUST_SAVE = 0
    PREFER_SAVE = 1
    MUST_RECOMPUTE = 2
    PREFER_RECOMPUTE = 3


_SAVE = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


class SelectiveCheckpointContext:
    """What a selective checkpoint's policy is called with, beside the op and its
    arguments: ``is_recompute`` (always False: the policy is called in the forward only,
    as PyTorch's is now) and ``op_output``, the op's output tensor."""

    def __init__(self, *, is_recompute, op_output=None):
        self.is_recompute = is_recompute
        self.op_output = op_output


_RECOMPUTE = object()
_CONSUMED = object()
_SAC_MISMATCH = (
    "This can happen if the operations in the checkpointed region are nondeterministic or depend on global state "
    "that changed between forward and backward."
)


class _CachedOutput:
    """An op's output kept by a selective checkpoint (counted as saved for backward),
    with the version it had, what the op's kernel kept, and what it set on its node."""

    _BOOKKEEPING = frozenset({"next", "_saved", "needs_input_grad", "out", "_rebased", "_trace", "reuse_grad"})

    def __init__(self, cls, ctx, out, kept):
        self.op = cls.__name__
        self.vc, self.version = out._vc, out._vc.value
        _node.saved_hooks.append(None)  # kept here, not packed away by the checkpoint
        try:
            self.output = SavedTensor(out._data, None, "output")
            self.kept = {name: SavedTensor(a, None, name) for name, a in (kept or {}).items()}
        finally:
            _node.saved_hooks.pop()
        self.attrs = {k: v for k, v in ctx.__dict__.items() if k not in self._BOOKKEEPING}

    def value(self, allow_mutation: bool):
        if not allow_mutation and self.vc.value != self.version:
            raise RuntimeError(
                f"Tensor cached during selective activation checkpoint has been mutated: the output of {self.op} "
                f"is at version {self.vc.value}; it was cached at version {self.version}."
                f"{modified_by(self.vc, self.version)} Pass allow_cache_entry_mutation=True to "
                "create_selective_checkpoint_contexts to recompute from the new values."
            )
        return self.output.array


class _SelectiveCache:
    """The outputs a selective checkpoint keeps: op class -> {index of the call: entry}."""

    def __init__(self, policy_fn, allow_mutation):
        self.policy_fn, self.allow_mutation = policy_fn, allow_mutation
        self.entries: dict = {}

    def held(self, label):
        for cls, slots in self.entries.items():
            for idx, entry in slots.items():
                if isinstance(entry, _CachedOutput):
                    yield f"{label} selective", f"{cls.__name__}[{idx}] output", entry.output.array
                    for name, saved in entry.kept.items():
                        yield f"{label} selective", f"{cls.__name__}[{idx}] {name}", saved.array


class _Caching:
    """The forward context of a selective checkpoint: calls the policy with each op and
    keeps the outputs it says to save."""

    def __init__(self, cache):
        self.cache = cache
        self.counts: dict = {}
        self.pending = None  # what the current op's kernel kept
        self._mode = None

    def __enter__(self):
        self._mode = _attach(_Forward, "forward")
        self._mode.cache = self
        self._mode.frame.cache = self.cache
        self.counts.clear()
        return self

    def __exit__(self, *exc):
        self._mode.cache = None
        self._mode = None
        return False

    def after(self, ctx, cls, inputs, params, out):
        idx = self.counts.get(cls, 0)
        self.counts[cls] = idx + 1
        policy = self.cache.policy_fn(
            SelectiveCheckpointContext(is_recompute=False, op_output=out), cls, *inputs, **params
        )
        if isinstance(policy, bool):  # PyTorch's older policies return a bool
            policy = CheckpointPolicy.MUST_SAVE if policy else CheckpointPolicy.PREFER_RECOMPUTE
        if not isinstance(policy, CheckpointPolicy):
            raise TypeError(
                f"a selective checkpoint's policy must return a CheckpointPolicy (or a bool), got {policy!r} for "
                f"{cls.__name__}"
            )
        kept, self.pending = self.pending, None
        slots = self.cache.entries.setdefault(cls, {})
        # A view is recomputed whatever the policy says: it costs nothing, and it must
        # alias the recomputed input, not the forward's.
        if policy in _SAVE and not cls.is_view:
            slots[idx] = _CachedOutput(cls, ctx, out, kept)
        else:
            slots[idx] = _RECOMPUTE


class _Cached:
    """The recomputation context of a selective checkpoint: an op whose output was kept
    is not run again; its node gets the kept output (and what its kernel kept)."""

    def __init__(self, cache):
        self.cache = cache
        self.counts: dict = {}
        self.used: list = []
        self._mode = None

    def __enter__(self):
        self._mode = _attach(_Recomputation, "recompute")
        self._mode.cache = self
        self.counts.clear()
        self.used = []
        return self

    def __exit__(self, *exc):
        # Used entries are released at the end (not when used), so that every inplace
        # decision of the recomputation sees them held, as the forward's did.
        for cls, idx in self.used:
            self.cache.entries[cls][idx] = _CONSUMED
        self.used = []
        self._mode.cache = None
        self._mode = None
        return False

    def kernel(self, ctx, cls, arrays, params, inplace):
        idx = self.counts.get(cls, 0)
        self.counts[cls] = idx + 1
        slots = self.cache.entries.get(cls)
        if slots is None:
            raise RuntimeError(f"{cls.__name__} encountered during backward but not found in storage. {_SAC_MISMATCH}")
        entry = slots.get(idx)
        if entry is None:
            raise RuntimeError(
                f"{cls.__name__} invocation index {idx} encountered during backward but not found in storage. "
                f"{_SAC_MISMATCH}"
            )
        if entry is _CONSUMED:
            raise RuntimeError(
                "Trying to backward an extra time. You are only allowed to backward once on any region computed "
                "under selective activation checkpoint."
            )
        if entry is _RECOMPUTE:
            return _function._run_kernel(ctx, cls, arrays, params, inplace)
        array = entry.value(self.cache.allow_mutation)
        self.used.append((cls, idx))
        ctx.__dict__.update(entry.attrs)
        if entry.kept:
            ctx.keep(**{name: saved.array for name, saved in entry.kept.items()})
        return array


def create_selective_checkpoint_contexts(policy_fn_or_list, allow_cache_entry_mutation: bool = False):
    """The two contexts of a selective checkpoint, for ``checkpoint``'s ``context_fn``.

    Args:
        policy_fn_or_list: ``policy(ctx, op, *args, **kwargs) -> CheckpointPolicy`` called
            with each op of the forward (``op`` the op's class, ``args`` its inputs,
            ``kwargs`` its parameters, ``ctx`` a :class:`SelectiveCheckpointContext`); or a
            list of op classes, whose outputs are kept (``MUST_SAVE``) while everything
            else is recomputed (``PREFER_RECOMPUTE``).
        allow_cache_entry_mutation: let a kept output modified in place after the forward
            be used as it is now (by default that raises, as in PyTorch).

    Returns:
        ``(forward context, recomputation context)``, e.g.
        ``checkpoint(fn, x, use_reentrant=False, context_fn=functools.partial(
        create_selective_checkpoint_contexts, save_matmuls_policy))``.
    """
    if isinstance(policy_fn_or_list, list):
        ops = policy_fn_or_list
        for op in ops:
            if not (isinstance(op, type) and issubclass(op, _function.Function)):
                raise ValueError(
                    f"Expected op in `op_list` to be an op class (a framework.autograd.OpFunction such as "
                    f"framework.ops.linalg.Matmul) but got: {op!r} of type {type(op).__name__}."
                )

        def policy_fn(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    elif callable(policy_fn_or_list):
        policy_fn = policy_fn_or_list
    else:
        raise TypeError("policy_fn_or_list must be either a function or a list of ops.")
    cache = _SelectiveCache(policy_fn, bool(allow_cache_entry_mutation))
    return _Caching(cache), _Cached(cache)


#: The ops :func:`save_matmuls_policy` keeps: matrix products, convolutions, attention.
SAVED_BY_DEFAULT = frozenset({Matmul, Linear, Conv2d, ScaledDotProductAttention})


def save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """torchtitan's default selective policy: keep the outputs of matrix products
    (``Matmul``, ``Linear``), convolutions (``Conv2d``) and attention
    (``ScaledDotProductAttention``), the ops that cost the most to run again; recompute
    the elementwise ops, normalizations, dropout and views."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_BY_DEFAULT else CheckpointPolicy.PREFER_RECOMPUTE


# --- the entry points ----------------------------------------------------------------


def checkpoint(
    function,
    *args,
    use_reentrant: bool | None = None,
    context_fn=noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    **kwargs,
):
    """Runs ``function(*args, **kwargs)`` keeping only its inputs for backward; the rest
    is recomputed when backward needs it (PyTorch's non-reentrant checkpoint).

    Args:
        function: what to run; its outputs may be any structure, tensors or not.
        args: its positional inputs (kept, version-checked when used again).
        use_reentrant: False or None (the same here: the only variant this framework has);
            True raises.
        context_fn: returns two context managers, entered around the forward and around
            the recomputation (:func:`create_selective_checkpoint_contexts`).
        determinism_check: ``"default"`` (compare what the recomputation saves with what
            the forward saved) or ``"none"``.
        debug: on a :class:`CheckpointError`, list the ops of both runs with their lines.
        early_stop: stop the recomputation once everything backward needs is recomputed.
        preserve_rng_state: (keyword) replay the forward's random draws (dropout masks) in
            the recomputation; default True.
        kwargs: the other keyword arguments of ``function``.

    Returns:
        What ``function`` returns.
    """
    preserve = kwargs.pop("preserve_rng_state", True)
    if use_reentrant:
        raise ValueError(
            "checkpoint(use_reentrant=True) is not supported: this framework has only the non-reentrant "
            "checkpoint (PyTorch's recommended one); pass use_reentrant=False"
        )
    if _node.capture is not None:
        raise RuntimeError(
            "checkpoint is not supported inside a compiled step (fw.compile): the compiled step plans its memory "
            "itself; recompute there with fw.compile(step, memory_budget=...) (docs/COMPILE.md), or run the "
            "checkpointed model eagerly"
        )
    debug = _debug if _debug is not None else debug
    if debug and context_fn is not noop_context_fn:
        raise ValueError("debug=True is incompatible with non-default context_fn")
    if determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(f"determinism_check should be one of {list(_DETERMINISM_CHECKS)}, but got {determinism_check}")
    if not is_grad_enabled():
        return function(*args, **kwargs)
    forward_context, recompute_context = context_fn()
    frame = _Frame(
        function,
        kwargs,
        _early_stop if _early_stop is not None else early_stop,
        determinism_check == "default",
        debug,
        recompute_context,
        preserve,
    )
    frame.save_inputs(args)
    mode = _Forward(frame)
    prev_mode = _node.op_mode
    _node.saved_hooks.append(frame)
    _node.op_mode = mode
    if preserve:
        _random.watchers.append(frame.watch_rng)
    suppressed = True
    try:
        with forward_context:
            out = function(*args, **kwargs)
            suppressed = False
    finally:
        if preserve:
            _random.watchers.remove(frame.watch_rng)
        _node.op_mode = prev_mode
        if _node.saved_hooks.pop() is not frame:
            raise RuntimeError(f"{frame.label}: saved-tensor hooks were left unbalanced by the function")
    if suppressed:
        raise RuntimeError(
            "checkpoint: the forward context provided by context_fn suppressed an exception raised during the "
            "checkpointed forward. This is not supported because checkpoint cannot return a value for a failed "
            "forward."
        )
    frame.forward_completed = True
    frame.made = None
    return out


def checkpoint_sequential(functions, segments: int, input, use_reentrant: bool | None = None, **kwargs):
    """Runs ``functions`` (an ``nn.Sequential`` or a list of modules or functions) on
    ``input`` in ``segments`` chunks, each but the last checkpointed (PyTorch's).

    Args:
        functions: the model, run in order, each on the previous one's output.
        segments: how many chunks.
        input: the first one's input.
        use_reentrant: as :func:`checkpoint`'s.
        preserve_rng_state: (keyword) as :func:`checkpoint`'s.
    """
    preserve = kwargs.pop("preserve_rng_state", True)
    if kwargs:
        raise ValueError("Unexpected keyword arguments: " + ",".join(arg for arg in kwargs))

    def run_function(start, end, functions):
        def forward(input):
            for j in range(start, end + 1):
                input = functions[j](input)
            return input

        return forward

    if hasattr(functions, "children") and not isinstance(functions, (list, tuple)):
        functions = list(functions.children())
    segment_size = len(functions) // segments
    end = -1
    for start in range(0, segment_size * (segments - 1), segment_size):
        end = start + segment_size - 1
        input = checkpoint(
            run_function(start, end, functions), input, use_reentrant=use_reentrant, preserve_rng_state=preserve
        )
    return run_function(end + 1, len(functions) - 1, functions)(input)
