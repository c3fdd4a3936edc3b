"""Higher-order gradients: what ``create_graph=True`` needs above the engine.

One formula per derivative: every op's ``backward`` is written once, against "arrays"
that are raw NumPy/CuPy arrays in a first-order backward (the fast path, no graph) and
tensors with history under ``create_graph``. Three things make the same code run on
both, none of which costs the first-order path more than a type check it already did:

- the gradient a node receives is a tensor, and its saved tensors read back as tensors
  with history (:func:`saved_as_tensor`): an input as a tensor whose gradient flows
  into the input's node (or the leaf itself), the result as a tensor whose node is the
  op's own node (PyTorch's SavedVariable);
- ``get_array_module`` of a tensor is a small namespace of NumPy's names over the
  framework's differentiable ops (:mod:`framework.ops.tensor_xp`), so ``xp.multiply(g,
  y, out=...)`` records a Mul (``out=`` is ignored: nothing is written in place that
  another node may have saved);
- operators (``g * y``, ``-g``, ``g[index]``) are the tensors' own.

So the backward of an op, run under ``create_graph``, is itself a graph of
differentiable ops, whose backward is theirs: derivatives of any order, each derivative
written once. This module holds the engine's tensor-level steps (the leaf accumulation
of PyTorch's AccumulateGrad under grad mode, hooks, saved tensors as tensors); the
engine reaches it through ``autograd.node.higher``.
"""

from __future__ import annotations

from .. import memory
from ..backend import get_array_module
from ..tensor import Tensor, _wrap
from . import node as _node
from .grad_mode import enable_grad


def constant(array) -> Tensor:
    """A gradient given as an array (or made by the engine: ones for a scalar root)."""
    return _wrap(array)


def saved_as_tensor(node, name, saved) -> Tensor:
    """The saved value ``name`` of ``node`` as a tensor with history (version-checked as
    a first-order backward checks it)."""
    array = saved.unpack(node)
    idx = None
    for n, i, _ in type(node)._save_plan:
        if n == name:
            idx = i
            break
    if idx is None:
        # kept by forward: a function of the inputs the op recomputes with history
        # (batch statistics), or else a constant of the derivative (indices, masks)
        recompute = getattr(node, "kept_as_tensors", None)
        if recompute is not None:
            kept = recompute()
            if name in kept:
                return kept[name]
        return _wrap(array)
    if idx < 0:  # the result: its history is this node, or the view's that it was written into
        t = _wrap(array)
        t._grad_fn = _result_history(node, array)
    else:
        edges = node.__dict__.get("next") or ()
        edge = edges[idx] if idx < len(edges) else None
        if isinstance(edge, Tensor):
            return edge  # a leaf: its gradient can only flow into the leaf itself
        t = _wrap(array)
        t._grad_fn = edge
    if saved.vc is not None:
        t._vc = saved.vc  # a later inplace change of it is caught by the next backward too
    return t


def _result_history(node, array):
    """The node a saved result's gradient flows into: ``node`` itself, or, for an inplace
    op on a view (``y[0].exp_()``), the view's history regenerated from the base's
    ``CopySlices`` (as PyTorch's SavedVariable does): ``CopySlices`` calls ``node``, so
    a second backward through both would run ``node`` twice (and find it freed)."""
    ref = node.__dict__.get("_rebased")
    rebased = ref() if ref is not None else None
    if rebased is None:
        return node  # its graph is gone: nothing can reach the node through it any more
    shape, dtype = rebased.base_meta
    # A stand-in for the base: its values are never read, only its history, its shape and
    # its layout (a view op's backward needs nothing else; a `view` needs the strides).
    base = memory.empty_in_order(shape, dtype, get_array_module(array), rebased.base_order)
    base[...] = 0
    base = _wrap(base)
    base._grad_fn = rebased
    with enable_grad():
        return rebased.view_fn(base)._grad_fn


def input_edge(node, idx, shape, dtype, xp):
    """Input ``idx`` of ``node`` as a tensor with its history but no values (a zero-stride
    array of its shape and dtype), for an op that reads only its edge: the zero
    derivative of a mask (``MaskedGrad`` with ``mask=0``). None where it has no edge."""
    edges = node.__dict__.get("next") or ()
    edge = edges[idx] if idx < len(edges) else None
    if edge is None or isinstance(edge, Tensor):
        return edge  # a leaf: the gradient flows into the leaf itself
    t = _wrap(xp.broadcast_to(xp.zeros((), dtype=dtype), shape))
    t._grad_fn = edge
    return t


def run_leaf_hooks(leaf, grad):
    if leaf._hooks:
        for hook in tuple(leaf._hooks):
            r = hook(grad)
            if r is not None:
                grad = r
    return grad


def accumulate_leaf(leaf, grad) -> None:
    """PyTorch's AccumulateGrad with grad mode on: ``.grad`` becomes a copy of the
    gradient (with its history) in the leaf's layout (``clone_obey_contract``: a new
    tensor with the leaf's strides where the leaf is dense, ``copy_`` into it; else a
    contiguous clone), or the out-of-place sum with the existing one."""
    if not leaf._requires_grad:
        return
    grad = run_leaf_hooks(leaf, grad)
    if grad.shape != leaf._data.shape:
        raise RuntimeError(f"gradient of shape {grad.shape} for a leaf of shape {leaf._data.shape}")
    if grad.dtype != leaf._data.dtype:
        grad = grad.to(dtype=leaf._data.dtype)
    if leaf._grad is not None:
        leaf._grad = leaf._grad + grad
    elif memory.is_dense(leaf._data):
        leaf._grad = _wrap(memory.empty_layout(leaf._data, None, "gradients")).copy_(grad)
    else:
        leaf._grad = grad.clone()
    if leaf._post_acc_hooks:
        for hook in tuple(leaf._post_acc_hooks):
            hook(leaf)


_node.higher = __import__(__name__, fromlist=["_"])
