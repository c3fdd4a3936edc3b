"""PyTorch's ``torch.autograd.Function``: user-defined ops with their own backward.

    class Exp(fw.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = x.exp()
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, grad):
            (y,) = ctx.saved_tensors
            return grad * y

    y = Exp.apply(x)

This is the user-facing ``Function``: ``forward`` and ``backward`` work on tensors and
run without recording history. It is not the base of the framework's own ops
(``framework.autograd.function.Function``, exported as ``fw.autograd.OpFunction``,
which works on raw arrays and declares what it saves); both follow the same inplace
rules. What ``apply`` does, as in PyTorch (``torch/csrc/autograd/python_function.cpp``):

- ``ctx.save_for_backward(*tensors)``: kept with their versions; ``ctx.saved_tensors``
  raises if one was modified in place since, or after backward freed them. A saved
  input comes back as the same tensor object.
- ``ctx.mark_dirty(*tensors)``: the forward modified these inputs in place. Their
  version is bumped, and they become outputs of this node (an input that is a view
  rewrites its base's history, PyTorch's CopySlices). The leaf rules apply: a leaf that
  requires grad, or a view of one, may not be modified.
- ``ctx.mark_non_differentiable(*tensors)``: these outputs never require grad.
- ``ctx.needs_input_grad``: one bool per argument of ``apply``.
- An input returned as-is becomes a new view of it, and every view returned refuses
  inplace ops (its history is the user's backward, which autograd cannot replay).

Several outputs share one backward call: each tensor output gets a small node of its
own (so hooks and ``retain_grad`` see that output's gradient) that hands its gradient
to the main node, which calls ``backward`` once with all of them (zeros for outputs
that got none, unless ``ctx.set_materialize_grads(False)``).
"""

from __future__ import annotations

import functools
import warnings
import weakref

import numpy as np

from ..backend import device_of, get_array_module
from ..ops.broadcast import astype, sum_to
from ..tensor import Tensor, _wrap
from . import node as _node
from .function import _FREED, CopySlices, SavedTensor, _backward_twice_message, _check_inplace_target, edge_of
from .function import Function as OpFunction
from .grad_mode import no_grad, state
from .view_meta import ForbiddenReplay


class FunctionCtx(OpFunction):
    """The ``ctx`` of a custom Function: also the autograd node of the call (``y.grad_fn``)."""

    _save_plan = ()  # saved tensors are managed here, not declared

    def save_for_backward(self, *tensors) -> None:
        """Keeps tensors (or None) for backward; read them back with ``saved_tensors``."""
        for i, t in enumerate(tensors):
            if t is not None and not isinstance(t, Tensor):
                raise TypeError(
                    f"save_for_backward can only save variables, but argument {i} is of type {type(t).__name__}"
                )
        self._to_save = tensors

    def mark_dirty(self, *tensors) -> None:
        """Declares the inputs that forward modified in place."""
        self._dirty = tensors

    def mark_non_differentiable(self, *tensors) -> None:
        """Declares outputs that never require grad (masks, indices)."""
        self._non_differentiable = tensors

    def set_materialize_grads(self, value: bool) -> None:
        """With False, backward gets None (not zeros) for outputs that got no gradient."""
        self._materialize = bool(value)

    @property
    def saved_tensors(self) -> tuple:
        """The saved tensors, checked against the versions they had when saved."""
        saved = self.__dict__.get("_saved_list")
        if saved is _FREED:
            raise RuntimeError(_backward_twice_message(self))
        if saved is None:  # inside forward, before apply processed them
            return tuple(self.__dict__.get("_to_save", ()))
        return tuple(_unpack(self, entry) for entry in saved)

    # --- node machinery --------------------------------------------------------------
    def name(self) -> str:
        return type(self).__name__

    def release(self):
        saved = self.__dict__.get("_saved_list")
        if saved is not None and saved is not _FREED:
            for entry in saved:
                if entry is not None:
                    entry[1].release()
            self._saved_list = _FREED

    def run_backward(self, grad):
        slots = self.__dict__.get("_buffer")
        if slots is None:  # one tensor output: its gradient came straight here
            received = {self._single_output: grad}
        else:  # several: each output's node left its gradient in the buffer
            received, self._buffer = slots, {}
        grads_out = []
        for i, meta in enumerate(self._out_meta):
            g = received.get(i) if meta is not None else None
            if g is None and meta is not None and self.__dict__.get("_materialize", True):
                shape, dtype, xp = meta
                g = xp.zeros(shape, dtype=dtype)
            # (under create_graph the gradients are tensors with history already)
            grads_out.append(g if g is None or g.__class__ is Tensor else _wrap(g))
        result = type(self)._forward_cls.backward(self, *grads_out)
        return self._check_gradients(result)

    def _check_gradients(self, result) -> tuple:
        """The arrays for each input edge, from what the user's backward returned."""
        if not isinstance(result, tuple):
            result = (result,)
        inputs = self._inputs_meta
        if len(result) < len(inputs) or any(g is not None for g in result[len(inputs) :]):
            raise RuntimeError(
                f"function {self.name()} returned an incorrect number of gradients (expected {len(inputs)}, "
                f"got {len(result)})"
            )
        arrays = []
        for i, (g, meta, edge) in enumerate(zip(result, inputs, self.next)):
            if g is None:
                arrays.append(None)
                continue
            if meta is None:
                raise RuntimeError(
                    f"function {self.name()} returned a gradient different than None at position {i + 1}, but "
                    "the corresponding forward input was not a Variable"
                )
            if not isinstance(g, Tensor):
                raise TypeError(
                    f"function {self.name()} returned a {type(g).__name__} as gradient {i}, expected a Tensor or None"
                )
            if edge is None:
                arrays.append(None)
                continue
            arrays.append(_fit_gradient(self, i, g if _node.graph_mode else g._data, meta))
        return tuple(arrays)


class _OutputNode(OpFunction):
    """The grad_fn of one output of a custom Function with several outputs.

    Its backward leaves the output's gradient with the main node and passes on a
    0-d placeholder, so the main node runs once, after all its outputs' gradients.
    """

    _save_plan = ()

    def __init__(self, main, index):
        self.main = main
        self.index = index
        self.next = (main,)
        self.needs_input_grad = (True,)

    def name(self) -> str:
        return self.main.name()

    def run_backward(self, grad):
        self.main._buffer[self.index] = grad
        return (get_array_module(grad).zeros((), dtype=grad.dtype),)

    def release(self):
        pass

    def __getattr__(self, name):  # saved_tensors, needs_input_grad, ... of the call
        if name == "main":
            raise AttributeError(name)
        return getattr(self.main, name)


class _DirtyViewNode(OpFunction):
    """The node of a custom Function seen with the modified view as its FIRST input,
    the layout ``CopySlices`` expects of an inplace op."""

    _save_plan = ()

    def __init__(self, node, k):
        order = [k] + [i for i in range(len(node.next)) if i != k]
        self.node, self.order = node, order
        self.next = tuple(node.next[i] for i in order)
        self.needs_input_grad = tuple(node.needs_input_grad[i] for i in order)

    def name(self) -> str:
        return self.node.name()

    def run_backward(self, grad):
        grads = self.node.run_backward(grad)
        return tuple(grads[i] for i in self.order)

    def release(self):
        self.node.release()


class Function:
    """Base class of user-defined differentiable operations (PyTorch's API).

    Subclass it with static ``forward(ctx, *args)`` and ``backward(ctx, *grads)`` (or
    ``forward(*args)`` plus ``setup_context(ctx, inputs, output)``), and call
    ``MyFunction.apply(*args)``. See the module docstring for the ``ctx`` API.
    """

    _backward_cls = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # The class of this Function's nodes: y.grad_fn is "<Name>Backward", as in PyTorch.
        cls._backward_cls = type(
            f"{cls.__name__}Backward", (FunctionCtx,), {"_forward_cls": cls, "__module__": cls.__module__}
        )

    @staticmethod
    def forward(ctx, *args, **kwargs):
        raise NotImplementedError("You must implement the forward function for custom autograd.Function.")

    @staticmethod
    def backward(ctx, *grad_outputs):
        raise NotImplementedError(
            "You must implement either the backward or vjp method for your custom autograd.Function to use it "
            "with backward mode AD."
        )

    setup_context = None  # PyTorch 2's optional split of forward: forward(*args) + setup_context

    @classmethod
    def apply(cls, *args, **kwargs):
        """Runs ``forward`` without recording history and connects its outputs to ``backward``."""
        if cls._backward_cls is None:
            raise RuntimeError("apply() is called on a subclass of fw.autograd.Function, not on Function itself")
        ctx = cls._backward_cls.__new__(cls._backward_cls)
        ctx.needs_input_grad = tuple(isinstance(a, Tensor) and a.requires_grad for a in args)
        record = state.enabled and any(ctx.needs_input_grad)
        if record:  # the edges before forward runs (it may rewrite inputs in place)
            ctx.next = tuple(edge_of(a) if need else None for a, need in zip(args, ctx.needs_input_grad))
        with no_grad():
            if cls.setup_context is not None:
                outputs = cls.forward(*args, **kwargs)
                cls.setup_context(ctx, args, outputs)
            else:
                outputs = cls.forward(ctx, *args, **kwargs)
        return _wrap_outputs(ctx, args, outputs, record)


def once_differentiable(fn):
    """Marks a backward that cannot itself be differentiated (every backward here runs
    without recording history, so this only documents it, as in PyTorch)."""

    @functools.wraps(fn)
    def wrapper(ctx, *args):
        with no_grad():
            return fn(ctx, *args)

    return wrapper


# --- apply's steps --------------------------------------------------------------------


def _contains(seq, t) -> bool:
    return any(x is t for x in seq)


def _wrap_outputs(ctx, args, outputs, record):
    """PyTorch's ``_wrap_outputs``: history, views, dirty inputs and saved tensors."""
    is_tuple = isinstance(outputs, tuple)
    outs = list(outputs) if is_tuple else [outputs]
    dirty = ctx.__dict__.get("_dirty", ())
    non_diff = ctx.__dict__.get("_non_differentiable", ())
    inputs = [a for a in args if isinstance(a, Tensor)]
    for t in dirty:
        if not _contains(outs, t):
            raise RuntimeError(
                "Some elements marked as dirty during the forward method were not returned as output. The inputs "
                "that are modified inplace must all be outputs of the Function."
            )
    for t in dirty:
        t._vc.bump("mark_dirty", ("<custom Function>", 0))  # PyTorch's _mark_dirty bumps too

    tensor_positions = [i for i, o in enumerate(outs) if isinstance(o, Tensor)]
    ctx._out_meta = [(o.shape, o.dtype, o.xp) if isinstance(o, Tensor) else None for o in outs]
    ctx._inputs_meta = [(a.shape, a.dtype, a.device) if isinstance(a, Tensor) else None for a in args]
    if record:
        if len(tensor_positions) == 1:
            ctx._single_output = tensor_positions[0]
        else:
            ctx._buffer = {}
    output_nodes = {}

    def node_for(i):
        if not record or ctx.__dict__.get("_buffer") is None:
            return ctx
        if i not in output_nodes:
            output_nodes[i] = _OutputNode(ctx, i)
        return output_nodes[i]

    for i in tensor_positions:
        o = outs[i]
        is_input, is_dirty = _contains(inputs, o), _contains(dirty, o)
        differentiable = record and not _contains(non_diff, o) and o.dtype.kind == "f"
        if not differentiable:
            if not o.requires_grad:
                if is_input and not is_dirty:
                    o = outs[i] = _alias(o)  # a distinct tensor object, as PyTorch returns
            elif is_input:
                o = outs[i] = o.detach()
            elif o._base is None:
                o.detach_()
        elif is_dirty:
            if not is_input:
                _dirty_non_input(o)
                o._grad_fn = node_for(i)
            else:
                _rebase_dirty(ctx, args, o, node_for(i), len(tensor_positions))
        elif is_input:
            o = outs[i] = _alias(o)
            o._grad_fn = node_for(i)
        else:
            o._grad_fn = node_for(i)
        if o._base is not None and not (is_input and is_dirty):
            _forbid_inplace(o, ctx, i)  # recorded or not, as in PyTorch
    ctx.__dict__.pop("_dirty", None)  # the node must not keep its outputs alive
    ctx.__dict__.pop("_non_differentiable", None)
    if record:
        _save(ctx, inputs, dirty, outs)
    return tuple(outs) if is_tuple else outs[0]


def _alias(t):
    """A new view of all of ``t``, made without history."""
    with no_grad():
        return t.view_as(t)


def _forbid_inplace(view, ctx, i) -> None:
    """A view returned by a custom Function: its history is the user's backward, which
    an inplace op could not rewrite (PyTorch's IN_CUSTOM_FUNCTION)."""
    view._view_fn = ForbiddenReplay("custom_function", ctx.name(), i)
    view._view_base_fn = view._base._grad_fn


def _dirty_non_input(t) -> None:
    if t._base is not None:
        raise RuntimeError(
            "ctx.mark_dirty() received a tensor that was not an input. Only input Tensors that have been "
            "modified inplace should be passed to ctx.mark_dirty()."
        )
    warnings.warn(
        "Only input Tensors should be given to ctx.mark_dirty(). If a Tensor is not an input, there is no need "
        "to pass it to mark_dirty().",
        UserWarning,
        stacklevel=4,
    )


class _CustomInplace:
    """What the inplace checks name a custom Function's inplace write by."""

    def __init__(self, name):
        self.inplace_name = f"{name} (ctx.mark_dirty)"


def _rebase_dirty(ctx, args, t, node, n_tensor_outputs) -> None:
    """An input the forward modified in place becomes an output of this node."""
    op = _CustomInplace(ctx.name())
    if t._base is None:
        _check_inplace_target(op, t, True, True)
        t._grad_fn = node
        return
    if n_tensor_outputs > 1 and getattr(t._view_fn, "creation", None) is None and t._view_fn is not None:
        raise RuntimeError(
            "If your Function modifies inplace an input that is a view of another Tensor, your Function cannot "
            "return more than one Tensor. This is not supported by the current autograd engine. You should either "
            "make sure the input is not a view (using .clone() for example) or make your Function only return one "
            "Tensor (potentially splitting it into two Functions: one doing the inplace that returns a single "
            "Tensor and a second one that does the other operations)."
        )
    _check_inplace_target(op, t, True, True)
    k = next(i for i, a in enumerate(args) if a is t)
    fn = node if k == 0 else _DirtyViewNode(node, k)
    base = t._base
    base._grad_fn = CopySlices(base, t._view_fn, fn)
    # the view's own grad_fn is rebuilt from the base's new history when read


def _save(ctx, inputs, dirty, outs) -> None:
    """The tensors of save_for_backward, with their versions as of now (after forward
    and mark_dirty): a saved plain input keeps its identity; outputs, dirty inputs and
    intermediates are kept as arrays, so that no reference cycle keeps them alive."""
    entries = []
    for i, t in enumerate(ctx.__dict__.get("_to_save", ())):
        if t is None:
            entries.append(None)
            continue
        keep = t if (_contains(inputs, t) and not _contains(dirty, t)) else None
        had_history = t._grad_fn is not None
        # an output's node (weakly: the node must not keep itself alive), for create_graph
        node = weakref.ref(t._grad_fn) if keep is None and _contains(outs, t) and t._grad_fn is not None else None
        entries.append((keep, SavedTensor(t._data, t._vc, f"saved_tensors[{i}]"), had_history, node))
    ctx._saved_list = entries
    ctx.__dict__.pop("_to_save", None)


def _unpack(ctx, entry):
    if entry is None:
        return None
    keep, saved, had_history, node = entry
    array = saved.unpack(ctx)  # raises if modified in place since it was saved
    if keep is None:
        t = _wrap(array)
        t._vc = saved.vc
        if node is not None and _node.graph_mode:  # create_graph: a saved output with its history
            t._grad_fn = node()
        return t
    if had_history and keep._grad_fn is None and keep._base is None:
        raise RuntimeError(
            "Trying to use a saved tensor that has been detached in-place, i.e. with .detach_().This is not "
            "supported, please use out-of-place `.detach()` instead"
        )
    return keep


def _fit_gradient(ctx, i, g, meta):
    """PyTorch's ``validate_outputs``: a gradient of the input's shape (summed from a
    broadcastable one), dtype and device."""
    shape, dtype, device = meta
    if g.shape != shape:
        try:
            target = np.broadcast_shapes(g.shape, shape)
        except ValueError:
            target = None
        if target != tuple(g.shape):
            raise RuntimeError(
                f"Function {ctx.name()} returned an invalid gradient at index {i} - got {list(g.shape)} but "
                f"expected shape compatible with {list(shape)}"
            )
        g = sum_to(g, shape)
    if g.dtype != dtype:
        g = astype(g, dtype)
    got = g.device if g.__class__ is Tensor else device_of(g)  # a tensor under create_graph
    if got != device:
        raise RuntimeError(
            f"Function {ctx.name()} returned an invalid gradient at index {i} - expected device {device} but got {got}"
        )
    return g
