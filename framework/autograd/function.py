"""The op contract and the ONE generic apply path that makes inplace safe.

Every differentiable op is a small :class:`Function` subclass with ``forward`` and
``backward`` on raw arrays, and it declares what its backward reads::

    class Exp(Function):
        saves = ("result",)             # backward reads the output, not the input
        def forward(ctx, x):
            return xp.exp(x, out=ctx.out)   # ctx.out is x's buffer when inplace
        def backward(ctx, gy):
            return gy * ctx.result

``saves`` names forward's positional arguments or ``"result"``; ``saved_when`` may say
that a saved input is needed only when some inputs need a gradient (``mul`` needs ``y``
only for ``x``'s gradient). ``Op.apply(...)`` runs the op out of place, ``Op.apply_(...)``
in place on its first argument. :func:`_apply` does, for every op and in this order:
grad-mode check, leaf and overlap checks BEFORE the kernel touches anything, copies of
inputs that backward needs but the kernel would overwrite (counted as memory inplace did
not save), the kernel, the version bump with the call site of the inplace op, the
history (including the rebase of a view's base, PyTorch's CopySlices), and the saved
tensors with their versions; each step is a small function below.

This module works on tensors: it sits beside the ops, above the Tensor class. What it
builds on, and what the engine runs, is in :mod:`.node` (versions, saved tensors, the
node base), below the Tensor class (docs/DESIGN.md, "Layers").
"""

from __future__ import annotations

import inspect
import traceback
import weakref

import numpy as np

from .. import inplace as _inplace
from .. import memory
from ..backend import get_array_module
from ..callsite import call_site
from ..inplace.consumed import ConsumedData as _Consumed
from ..tensor import Tensor, _wrap  # this module is the ops layer: above the Tensor class
from . import node as _node
from .grad_mode import InferenceVersionCounter, no_grad, state
from .node import (  # noqa: F401  (SavedTensor, VersionCounter, _FREED: the op contract's names)
    _FREED,
    Node,
    SavedTensor,
    VersionCounter,
    _as_array,
    _backward_twice_message,
    _HookHandle,
)
from .view_meta import UntrackedView, rebase_message

#: What a ``saved_attrs`` getter returns where this node, under its PyTorch name, has no
#: such attribute (``PowBackward0`` saves no result; ``SumBackward0`` no dim).
ABSENT = object()


class Function(Node):
    """Base of every op; an instance is the autograd node (and the ``ctx``) of one call.

    Class attributes:
        saves: names of forward arguments (or ``"result"``) that backward reads.
        saved_when: ``{name: (input indices,)}``: save ``name`` only if one of those
            inputs needs a gradient. Names not listed are saved when any input does.
        is_view: the output is a view of the first input (shares its storage).
        differentiable: False for ops with no gradient (comparisons); no graph is built.
        inplace_name: the user-facing name of the inplace variant, for error messages.
    """

    saves: tuple = ()
    saved_when: dict = {}
    out = None  # the target's buffer while an inplace forward runs (see _apply)
    is_view = False
    differentiable = True
    inplace_name: str | None = None
    # PyTorch's names (derivatives.yaml) for what ``saves`` names, where they differ: a
    # node's saved value ``x`` is read back as ``grad_fn._saved_self``, as in PyTorch.
    saved_as = {"x": "self", "y": "other"}
    # PyTorch's other saved attributes (``grad_fn._saved_<name>``): name -> function of the
    # node (what forward kept), or ABSENT where this node has no such attribute.
    saved_attrs: dict = {}
    # Policy ``auto`` may run an out-of-place call in place when its first input is dead
    # (inplace.auto_target): True, or a function (inputs, params) -> bool for ops whose
    # inplace form exists only for some parameters.
    auto_inplace = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "forward" not in cls.__dict__ and "saves" not in cls.__dict__:
            return
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
        names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        plan = []
        for name in cls.saves:
            if name == "result":
                plan.append((name, -1, cls.saved_when.get(name)))
            elif name in names:
                plan.append((name, names.index(name), cls.saved_when.get(name)))
            else:
                raise TypeError(f"{cls.__name__}.saves names {name!r}, not an argument of forward {names}")
        cls._save_plan = tuple(plan)
        if cls.inplace_name is None:
            cls.inplace_name = cls.__name__.lower() + "_"

    # --- the public entry points -------------------------------------------------
    @classmethod
    def apply(cls, *inputs, **params):
        """Runs the op out of place and returns a new tensor (under policy ``auto``,
        possibly in ``inputs[0]``'s buffer when that tensor is provably dead)."""
        return _apply(cls, inputs, params, False)

    @classmethod
    def apply_(cls, *inputs, **params):
        """Runs the op in place on ``inputs[0]`` and returns that same tensor."""
        return _apply(cls, inputs, params, True)

    # --- to be written by each op ------------------------------------------------
    def forward(ctx, *args, **params):  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(ctx).__name__} must define forward")

    def backward(ctx, grad):  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(ctx).__name__} must define backward")

    def saved_by_torch_name(self, torch_name):
        """``grad_fn._saved_<torch_name>``: what this node saved, under PyTorch's name.

        A saved tensor comes back as a tensor sharing its storage and version counter
        (without history); a Python scalar operand as itself; None where the value was not
        saved because no gradient needed it (PyTorch's undefined tensor). The other
        attributes PyTorch saves (sizes, dims, slopes: :attr:`saved_attrs`) come from
        what forward kept. After backward freed the node, reading a tensor raises as a
        second backward would.
        """
        renamed = self.__dict__.get("torch_attrs")  # (see as_torch_node)
        if renamed is not None:
            value = renamed[torch_name] if torch_name in renamed else self.saved_value(torch_name)
        else:
            getter = type(self).saved_attrs.get(torch_name)
            value = getter(self) if getter is not None else self.saved_value(torch_name)
        if value is ABSENT:
            raise AttributeError(f"'{self.name()}' object has no attribute '_saved_{torch_name}'")
        return value

    def saved_value(self, torch_name):
        """The value ``saves`` holds under PyTorch's name ``torch_name`` (see
        :meth:`saved_by_torch_name`), or ABSENT where the op saves nothing by that name."""
        saved_as = type(self).saved_as
        for name, _, _ in type(self)._save_plan:
            if saved_as.get(name, name) == torch_name:
                break
        else:
            return ABSENT
        saved = self.__dict__.get("_saved")
        if saved is _FREED:
            raise RuntimeError(_backward_twice_message(self))
        if saved and name in saved:
            s = saved[name]
            t = _wrap(s.unpack(self))  # the version check of a backward, and its error
            if s.vc is not None:
                t._vc = s.vc
            return t
        return self.__dict__.get(name)  # a constant operand, or None: not saved

    def saved_names(self) -> list:
        """PyTorch's names of what this node saved (``_saved_<name>`` in ``dir()``)."""
        saved_as = type(self).saved_as
        renamed = self.__dict__.get("torch_attrs")
        getters = type(self).saved_attrs if renamed is None else {}
        names = {saved_as.get(name, name) for name, _, _ in type(self)._save_plan}
        names.update(getters)
        names.update(renamed or {})
        out = []
        for n in sorted(names):
            getter = getters.get(n)
            try:
                if getter is not None and getter(self) is ABSENT:
                    continue
            except RuntimeError:  # freed: still listed, as PyTorch lists it
                pass
            out.append(n)
        return out

    def __dir__(self):
        return sorted(set(super().__dir__()) | {"_saved_" + n for n in self.saved_names()})

    def as_torch_node(self, name: str, **attrs) -> None:
        """Names this node as PyTorch names the call that made it, where this framework
        runs that call through a more general op (``t()`` and ``transpose`` through
        permute, ``max()`` through amax, a number minus a tensor through sub): ``attrs``
        are the saved attributes PyTorch's node has, in place of this op's own
        :attr:`saved_attrs` (its saved tensors stay listed)."""
        self.node_name = name
        self.torch_attrs = attrs

    def keep(ctx, **arrays) -> None:
        """Holds arrays forward computed itself (statistics, masks, indices) for backward.

        ``saves`` names forward's arguments and result; anything else backward needs
        goes through here, so that it is handled like a saved tensor: counted by
        :func:`framework.memory.saved_bytes`, freed by ``release()`` after backward (a
        second backward then raises), and read back as ``ctx.<name>``. Nothing is kept
        when no input needs a gradient (no graph is built then).
        """
        if not (ctx.differentiable and any(ctx.needs_input_grad)):
            return
        if _node.op_mode is not None:
            _node.op_mode.kept(ctx, arrays)
        saved = ctx.__dict__.get("_saved")
        if saved is None:
            saved = ctx._saved = {}
        for name, array in arrays.items():
            saved[name] = SavedTensor(array, None, name)  # private: nobody else writes it


# --- the generic apply path -------------------------------------------------------


def edge_of(t):
    """What a gradient for tensor ``t`` flows into: its grad_fn, or the leaf itself."""
    fn = t.grad_fn
    return fn if fn is not None else t


def _check_inplace_target(cls, target, grad_on: bool, any_needs: bool = False) -> None:
    """Raises before the kernel runs, so a refused inplace op changes nothing.

    The rules are PyTorch's (``check_inplace`` and ``handle_view_on_rebase``), with its
    wording, plus the name of the inplace op.
    """
    if grad_on:
        base = target._base
        if base is None:
            if target._requires_grad and target._grad_fn is None:
                raise RuntimeError(
                    f"a leaf Variable that requires grad is being used in an in-place operation "
                    f"({cls.inplace_name}). Wrap the update in `with no_grad():` if it is an update "
                    "of the weights, or clone() the tensor first."
                )
        elif any_needs or target.requires_grad:
            # any_needs: the written value may bring history into a base that had none.
            _check_view_rewrite(cls, target)
            if base._grad_fn is None and (base._requires_grad or target._requires_grad):
                raise RuntimeError(
                    f"a view of a leaf Variable that requires grad is being used in an in-place "
                    f"operation ({cls.inplace_name}). Wrap it in `with no_grad():` or clone() first."
                )
    if target._vc.__class__ is InferenceVersionCounter and not state.inference:
        raise RuntimeError(
            "Inplace update to inference tensor outside InferenceMode is not allowed.You can make a clone "
            "to get a normal tensor before doing inplace update.See https://github.com/pytorch/rfcs/pull/17 "
            f"for more details. ({cls.inplace_name})"
        )
    if before_write is not None:
        before_write(target)
    data = target._data
    for size, stride in zip(data.shape, data.strides):
        if stride == 0 and size > 1:
            raise RuntimeError(
                f"unsupported operation: more than one element of the written-to tensor refers to "
                f"a single memory location ({cls.inplace_name} on an expanded tensor). Please clone() "
                "the tensor before performing the operation."
            )


# Called with the target of every inplace op before it is checked for overlap and
# written, while autograd.graph.allow_mutation_on_saved_tensors() is active.
before_write = None

# framework.ops.autocast.cast_inputs while an autocast region is enabled, else None:
# ``autocast(cls, inputs)`` returns the inputs as the region casts them for op ``cls``.
autocast = None


def _check_view_rewrite(cls, target) -> None:
    """Raises where an inplace op may not rewrite the history of the view ``target``:
    made without history (no_grad, inference mode), one of several views an op
    returned, or made by a custom Function (see ``framework.autograd.view_meta``)."""
    view_fn = target._view_fn
    creation = getattr(view_fn, "creation", None)
    if creation is None:
        return  # a view whose chain can be replayed: its base's history is rewritten
    fn = target._grad_fn
    name, nr = view_fn.describe(fn.name() if fn is not None else None)
    raise RuntimeError(f"{rebase_message(creation, name, nr)} (inplace op: {cls.inplace_name})")


def _save_inputs(ctx, cls, inputs, arrays, needs, inplace):
    """The SavedTensors of forward's inputs, and the bytes copied because the inplace
    kernel would overwrite them. A Python scalar operand (``x * 2.0``) is a constant,
    not a saved tensor: it becomes a plain attribute of ``ctx`` (readable after
    ``release()``), but the node counts as having saved it: PyTorch saves it as a
    tensor (a wrapped number), so after ``release()`` a second backward through the
    node raises, as there."""
    saved = {}
    copied = 0
    target = arrays[0] if inplace else None
    xp_may_share = None
    for name, idx, when in cls._save_plan:
        if idx < 0:
            continue
        if when is not None:
            for i in when:  # a loop, not any(): this runs for every op that saves
                if needs[i]:
                    break
            else:
                continue
        arr = arrays[idx]
        if not hasattr(arr, "shape"):
            ctx.__dict__[name] = arr
            ctx.__dict__["_holds_constants"] = True
            continue
        if inplace and idx == 0:
            if xp_may_share is None:
                xp_may_share = get_array_module(target).may_share_memory
            if arr is target or xp_may_share(arr, target):
                # Backward needs the value the kernel is about to overwrite: keep a copy
                # (PyTorch's original self). Correct, but it is exactly the memory this
                # inplace op did not save. Another input that shares the target's memory
                # (x.mul_(x)) is saved as itself, as in PyTorch: this op's version bump
                # then makes backward raise instead of reading the new values.
                copy = memory.track(arr.copy(), "inplace_copies")
                copied += copy.nbytes
                saved[name] = SavedTensor(copy, None, name)
                continue
        t = inputs[idx]
        saved[name] = SavedTensor(arr, t._vc if isinstance(t, Tensor) else None, name)
    return saved, copied


_NO_NEEDS = tuple((False,) * n for n in range(8))


def _apply(cls, inputs, params, inplace):
    """Runs one call of op ``cls``: the one path every op takes, in the order the inplace
    rules need.

    1. ``auto`` decides, before anything else holds the inputs, whether an ordinary call
       runs in place (:func:`framework.inplace.auto_target`);
    2. read the inputs: their arrays (a consumed tensor raises here) and which need grad;
    3. check the inplace target, before the kernel can change anything;
    4. keep what backward needs (a copy where the kernel would overwrite it);
    5. run the kernel;
    6. the output: the target with its version bumped, or a new tensor (a view shares
       its input's storage);
    7. record the history (the node's edges and saved tensors; a view's base gets
       ``CopySlices``).

    An ``auto`` rewrite hands the input's storage to a new tensor object, which the op
    then runs in place on, and leaves the input consumed (see :mod:`framework.inplace`).
    While a compiled step is captured, the recorder runs this path and records the call.
    Inside an autocast region an out-of-place call's inputs are first cast as autocast
    says (:mod:`framework.ops.autocast`); a call whose inputs were cast never runs in place.
    """
    cast = False
    if autocast is not None and not inplace:
        cast_inputs = autocast(cls, inputs)
        cast = cast_inputs is not inputs
        inputs = cast_inputs
        del cast_inputs  # policy auto's proof counts the references to the inputs
    if _node.capture is not None:
        return _node.capture.apply(cls, inputs, params, inplace)
    where = None
    if not inplace and not cast and cls.auto_inplace and _inplace._policy == "auto":
        where = _inplace.auto_target(cls, inputs, params)
        if where is not None:
            # Consumed before the kernel runs: if it raised half way, the old object could
            # still be read with half-written values.
            inputs = (
                inputs[0]._consume(cls.inplace_name[:-1] + " (run in place by policy auto)", where, "auto"),
            ) + inputs[1:]
            inplace = True
    # A view of an inference tensor is an inference tensor with no history, even with
    # grad on (PyTorch's rule: its storage's writes are not counted, so no view chain on
    # it could be checked).
    grad_on = state.enabled and not (cls.is_view and inputs[0]._vc.__class__ is InferenceVersionCounter)
    arrays, needs, any_needs = _read_inputs(cls, inputs, grad_on)
    mode = _node.op_mode  # (see node.op_mode: a checkpointed region's)
    if mode is not None:
        mode.before(cls, inputs, inplace)
    ctx = cls.__new__(cls)
    ctx.needs_input_grad = needs
    if inplace:
        _check_inplace_target(cls, inputs[0], grad_on, any_needs)
        ctx.out = arrays[0]
    saved = None
    copied = 0
    if any_needs:
        if cls._save_plan:
            saved, copied = _save_inputs(ctx, cls, inputs, arrays, needs, inplace)
        if state.anomaly:
            ctx._trace = traceback.format_stack()[:-2]
    if mode is None:
        result = _run_kernel(ctx, cls, arrays, params, inplace)
    else:
        result = mode.kernel(ctx, cls, arrays, params, inplace)
    if inplace:
        out = _write_target(ctx, cls, inputs[0], result, copied, where)
    else:
        out = _new_output(cls, inputs, params, result, grad_on)
    if any_needs:
        _record_history(ctx, cls, inputs, needs, out, saved, inplace)
    if mode is not None:
        mode.after(ctx, cls, inputs, params, out, inplace)
    return out


def _read_inputs(cls, inputs, grad_on):
    """The inputs' arrays, which inputs need a gradient, and whether any does.

    Every tensor input is checked here: a tensor an inplace site consumed raises
    :class:`framework.inplace.ConsumedTensorError` (one class comparison per input,
    beside the version check of saved tensors; benchmarks/bench_consumed_check.py).
    """
    arrays = []
    if not (grad_on and cls.differentiable):
        for a in inputs:
            if isinstance(a, Tensor):
                a = a._data
                if a.__class__ is _Consumed:
                    raise a.error()
            arrays.append(a)
        n = len(inputs)
        return arrays, (_NO_NEEDS[n] if n < 8 else (False,) * n), False
    needs = []
    any_needs = False
    for a in inputs:
        if isinstance(a, Tensor):
            d = a._data
            if d.__class__ is _Consumed:
                raise d.error()
            arrays.append(d)
            # Tensor.requires_grad, spelled out: the property call costs on every input
            r = a._grad_fn is not None or a._requires_grad or (a._base is not None and a.requires_grad)
            any_needs = any_needs or r
            needs.append(r)
        else:
            arrays.append(a)
            needs.append(False)
    return arrays, tuple(needs), any_needs


def _run_kernel(ctx, cls, arrays, params, inplace):
    """``cls.forward`` on the arrays; an inplace kernel that cannot write into its target
    (the result would be bigger, or of another dtype) raises a RuntimeError naming both."""
    try:
        result = cls.forward(ctx, *arrays, **params)
    except (ValueError, TypeError) as e:
        if inplace:
            raise RuntimeError(f"{cls.inplace_name}: {_refused_inplace(e, arrays)}") from None
        raise
    if isinstance(result, np.generic):
        result = _as_array(result)
    return result


def _write_target(ctx, cls, target, result, copied, where):
    """An inplace kernel ran: makes sure the result is in the target's buffer and bumps
    the version, remembering the op and the call site for version errors."""
    if copied:  # counted once the op has run: a refused op copied for nothing
        memory.count("inplace_copy_bytes", copied)
    out_arr = ctx.out
    ctx.out = None  # the node must not keep the target's buffer alive after forward
    if result is not out_arr:
        # Kernels should write through ctx.out; this keeps any other one correct.
        out_arr[...] = result
    # An auto rewrite's tensor was dead: no saved copy can go stale, so no version error
    # can ever name this write, and the call site is the one the proof already found.
    target._vc.bump(cls.inplace_name, where if where is not None else call_site())
    memory.count("inplace_ops")
    return target


def _new_output(cls, inputs, params, result, grad_on):
    """A new tensor around ``result``: a view shares its input's storage and version
    counter and remembers how to replay itself from its base; anything else is new memory."""
    out = _wrap(result)
    if cls.is_view:
        src = inputs[0]
        out._vc = src._vc
        if src._vc.__class__ is InferenceVersionCounter:
            return out  # an inference tensor: not a view for autograd (PyTorch)
        base = src._base if src._base is not None else src
        out._base = base
        if grad_on:
            out._view_fn = _compose_view_fn(src, cls, inputs[1:], params)
            out._view_base_fn = base._grad_fn
        else:
            out._view_fn = UntrackedView("inference_mode" if state.inference else "no_grad", src._vc.value)
    else:
        memory.track(result, None, "activations")
    return out


def _record_history(ctx, cls, inputs, needs, out, saved, inplace):
    """Makes ``ctx`` the node of ``out``: its edges to the inputs' nodes (or leaves), its
    saved tensors with their versions; an inplace op on a view rewrites its base's history
    (``CopySlices``), and the view regenerates its own from it when asked."""
    edges = []
    for t, n in zip(inputs, needs):
        if n:
            fn = t._grad_fn if t._base is None else t.grad_fn
            edges.append(t if fn is None else fn)
        else:
            edges.append(None)
    ctx.next = tuple(edges)
    for name, idx, when in cls._save_plan:
        if idx < 0 and (when is None or any(needs[i] for i in when)):
            if saved is None:
                saved = {}
            saved[name] = SavedTensor(out._data, out._vc, name)
    if saved:
        kept = ctx.__dict__.get("_saved")  # what forward passed to ctx.keep()
        if kept:
            saved.update(kept)
        ctx._saved = saved
    if inplace and out._base is not None:
        base = out._base
        rebased = base._grad_fn = CopySlices(base, out._view_fn, ctx)
        if saved and "result" in saved:
            # The saved result's history is the view's, regenerated from the new base
            # (PyTorch's SavedVariable of an inplace op on a view: the view's grad_fn,
            # held weakly): the second backward reaches ctx through CopySlices only.
            ctx._rebased = weakref.ref(rebased)
    else:
        out._grad_fn = ctx


def _refused_inplace(error, arrays) -> str:
    """Why an inplace kernel refused to run, naming the shapes on every array module.

    NumPy says "non-broadcastable output operand with shape (3,) doesn't match the
    broadcast shape (2,3)" when the result would not fit the written tensor; CuPy says
    only "Out shape is mismatched". Its message is replaced by NumPy's wording then.
    """
    msg = str(error)
    if "broadcast" in msg:
        return msg
    target = arrays[0]
    try:
        full = np.broadcast_shapes(*(getattr(a, "shape", ()) for a in arrays))
    except ValueError:
        return msg
    if full == target.shape:
        return msg
    return f"non-broadcastable output operand with shape {target.shape} doesn't match the broadcast shape {full}"


def _compose_view_fn(src, cls, rest, params):
    """A function that replays the chain of view ops from the base to this view."""
    prev = src._view_fn
    if prev.__class__ is UntrackedView:
        # the source view was made without history: its chain is unknown, and this view
        # is untracked too, as of the storage's version now
        return UntrackedView(prev.creation, src._vc.value)
    if getattr(prev, "creation", None) is not None:
        return prev  # a view of a view that forbids rewriting its history forbids it too
    if prev is None:
        return lambda b: cls.apply(b, *rest, **params)
    return lambda b: cls.apply(prev(b), *rest, **params)


def view_region(view_fn, array):
    """Applies a view chain recorded as ``view_fn`` to a raw array of the base's shape
    (to a tensor, with history, under ``create_graph``)."""
    if array.__class__ is Tensor:
        return view_fn(array)
    with no_grad():
        return view_fn(_wrap(array))._data


def _copy_in_order(grad, order):
    """A copy of ``grad`` (an array, or a tensor under create_graph) whose elements lie in
    memory in ``order`` (:func:`memory.dense_order`; None: C order), counted as a gradient."""
    if grad.__class__ is Tensor:
        if order is None:
            return grad.contiguous() if not grad.is_contiguous() else grad.clone()
        t = grad.permute(*order)
        t = t.contiguous() if not t.is_contiguous() else t.clone()  # C order of the permuted dims
        return t.permute(*memory.inverse_order(order))
    if order is None:
        return memory.track(grad.copy(), "gradients")
    out = memory.empty_in_order(grad.shape, grad.dtype, get_array_module(grad), order, "gradients")
    out[...] = grad
    return out


class CopySlices(Function):
    """The base's new history after an inplace op on one of its views (PyTorch's idea).

    Backward takes the gradient w.r.t. the whole new base, hands the view's region to
    the inplace op's backward, writes the gradient w.r.t. the view's old values back into
    that region, and passes the rest of the base's gradient through unchanged.
    """

    def __init__(self, base, view_fn, fn: Function):
        base_needs = base.requires_grad
        self.fn = fn
        self.view_fn = view_fn
        self.base_meta = base._data.shape, base._data.dtype
        # the base's gradient is laid out as the base, so that the view chain replays on it
        # as on the base (PyTorch: new_empty_strided(base.sizes(), base.strides()))
        self.base_order = memory.dense_order(base._data)
        self.next = (edge_of(base) if base_needs else None,) + fn.next[1:]
        self.needs_input_grad = (base_needs,) + fn.needs_input_grad[1:]

    node_name = "CopySlices"  # PyTorch's; the inplace op it replays is ``.fn``

    def backward(ctx, grad):
        # also on tensors (create_graph): copies are clones, the writes inplace ops
        gbase = _copy_in_order(grad, ctx.base_order)
        region = view_region(ctx.view_fn, gbase)
        grads = ctx.fn.run_backward(region.clone() if region.__class__ is Tensor else region.copy())
        if grads[0] is None:
            region[...] = 0
        else:
            region[...] = grads[0]
        return (gbase,) + grads[1:]

    def run_backward(self, grad):
        if self.__dict__.get("_saved") is _FREED:
            raise RuntimeError(_backward_twice_message(self))
        return self.backward(grad)

    def release(self):
        # PyTorch's CopySlices drops the op it replays: a second backward raises, also
        # where that op saved nothing (add_ on a view)
        self.fn.release()
        self._saved = _FREED


_inplace.passes_ownership(Function.apply)
