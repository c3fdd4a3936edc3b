"""Flat buffers for an optimizer: one per (parameter group, device, dtype) and per role.

A :class:`FlatGroup` holds the parameters of one parameter group that live on one device
with one dtype and require grad. Their values live in ONE flat array (each ``p._data`` is
a view of its slice), so are their gradients once the optimizer has seen them (each
``p.grad`` a view of the flat gradient array) and their optimizer state (each
``state[p]["exp_avg"]`` a view of a flat state array). An update is then a handful of
whole-buffer operations per dtype instead of a handful per parameter.

The per-parameter objects stay the truth: every step checks, by identity, that each
parameter, gradient and state tensor is still its view (a ``p.data = ...``, ``model.to()``,
``load_state_dict`` or a user-assigned ``p.grad`` breaks that) and gathers what is not
into a flat array first, so nothing the user does can make the flat copy stale.

Who owns a buffer: parameter and state arrays belong to the optimizer. A gradient that is
a plain array (made by backward, or assigned) is adopted: copied into the flat gradient
array and ``p.grad`` rebound to its view (same values). Gradients that are views of
someone else's flat array are read where they are and never rebound: DataParallel (policy
``on``) keeps each dtype's buckets in one array, the optimizer lays its flat buffers out in
that order (again, once, when the model was wrapped after it had built them) and then
reads the gradients there with no copy; gradients of another layout are gathered into a
``workspace`` copy for the step. So DataParallel owns
``.grad`` where it is used, the optimizer everywhere else, and neither rebinds the other's.

On the CPU a step walks the buffers in cache-sized chunks (:data:`CPU_CHUNK`), on a GPU
it runs over each whole buffer.
"""

from __future__ import annotations

import weakref

import numpy as np

from .. import memory
from ..backend import get_array_module
from ..ops import _element_offset
from ..tensor import _wrap

# On the CPU a step walks the flat buffers in chunks of this many elements (or of the
# largest parameter, when larger): its temporaries (Adam's sqrt(v), ...) stay cache-sized
# and at most a few such chunks larger than those of a per-parameter update.
CPU_CHUNK = 1 << 16


def _views(flat, params):
    out, off = [], 0
    for p in params:
        n = p._data.size
        out.append(flat[off : off + n].reshape(p._data.shape))
        off += n
    return out


def _gather(arrays, n, dtype, xp, category):
    """One new flat array holding ``arrays`` one after the other (one concatenate)."""
    flat = memory.empty((n,), dtype, xp, category)
    xp.concatenate([a.reshape(-1) for a in arrays], out=flat)
    return flat


def own(array, n, taken) -> bool:
    """Whether ``array`` (an op's result) can become a flat buffer as it is: a fresh
    contiguous 1-D owner of ``n`` elements that no other buffer already is."""
    if array.base is not None or array.ndim != 1 or array.size != n or not array.flags.c_contiguous:
        return False
    return all(array is not t for t in taken)


def _borrowable(params):
    """When every parameter's gradient is a view of one flat array (DataParallel's buffer
    of their dtype), tiling a contiguous range of it: ``(params in the order of their
    gradients there, that array, the range's first element)``; else None."""
    grads = [p._grad._data if p._grad is not None else None for p in params]
    if any(g is None or g.base is None or not g.flags.c_contiguous for g in grads):
        return None
    base = memory.root_buffer(grads[0])
    if base.ndim != 1 or base.dtype != grads[0].dtype or any(memory.root_buffer(g) is not base for g in grads[1:]):
        return None
    starts = [_element_offset(g, base) for g in grads]
    order = sorted(range(len(params)), key=starts.__getitem__)
    for a, b in zip(order, order[1:]):
        if starts[b] != starts[a] + grads[a].size:
            return None
    return [params[i] for i in order], base, starts[order[0]]


class FlatGroup:
    """Parameters of one group, device and dtype over flat buffers (see the module doc).

    Building it copies the parameters into a new flat array (category ``parameters``)
    and rebinds each ``p._data`` to its view; the old per-parameter arrays go away with
    their last reference.

    Attributes:
        params: the parameters, in group order (in their gradients' order when borrowed).
        borrow: ``(weakref to another owner's flat gradient array, first element)``, or None.
        numel, dtype, xp: the flat buffers' size, dtype and array module.
        param, pviews: the flat parameter array and each parameter's view of it.
        grad, gtensors: weak references to the flat gradient array (None until a step
            gathers one) and to each parameter's gradient tensor (a view of it).
        state, stensors: state name -> weak references to the flat array, and to each
            parameter's state tensor.
    """

    __slots__ = (
        "params",
        "numel",
        "dtype",
        "xp",
        "chunk",
        "param",
        "pviews",
        "grad",
        "gtensors",
        "borrow",
        "state",
        "stensors",
    )

    def __init__(self, params: list) -> None:
        borrow = _borrowable(params)
        self.borrow = None
        if borrow is not None:  # laid out in the order of the gradients' buffer, to read it as it is
            params, base, start = borrow
            self.borrow = (weakref.ref(base), start)
        self.params = params
        first = params[0]._data
        self.dtype, self.xp = first.dtype, get_array_module(first)
        self.numel = sum(p._data.size for p in params)
        biggest = max(p._data.size for p in params)
        self.chunk = max(CPU_CHUNK, biggest) if self.xp is np else self.numel
        # Gradients and state are held by the parameters' own tensors (p.grad, state[p]),
        # here only by weak references: dropping those (p.grad = None, state.clear())
        # frees the flat buffers as it freed per-parameter arrays.
        self.grad = None  # weakref to the flat gradient array
        self.gtensors: list = []  # weakrefs to each parameter's gradient tensor (a view)
        self.state: dict = {}  # key -> weakref to the flat state array
        self.stensors: dict = {}  # key -> weakrefs to each parameter's state tensor
        self.set_param(_gather([p._data for p in params], self.numel, self.dtype, self.xp, "parameters"))

    # --- parameters -------------------------------------------------------------------
    def set_param(self, flat) -> None:
        """Makes ``flat`` the parameters' storage (each ``p._data`` a view of it)."""
        memory.retag(flat, "parameters")
        self.param = flat
        self.pviews = _views(flat, self.params)
        for p, v in zip(self.params, self.pviews):
            p._data = v

    def valid(self) -> bool:
        """Whether every parameter still lives in the flat array."""
        return all(p._data is v for p, v in zip(self.params, self.pviews))

    # --- gradients --------------------------------------------------------------------
    def _ours(self, tensors: list, refs: list) -> list:
        if not refs:
            return [False] * len(tensors)
        return [t is r() for t, r in zip(tensors, refs)]

    def grads(self):
        """The gradients as one flat array (every parameter has one).

        Zero copies when each ``p.grad`` is already a view of the flat gradient array, or
        of the borrowed one (DataParallel's, see :func:`_borrowable`). Otherwise one
        gather into a new flat array: plain gradient arrays are adopted (``p.grad`` becomes
        a view of it, same values). Never into the slots of the current one: a parameter
        whose gradient is a new array let go of its view there, which the user may still
        hold (``kept = p.grad; p.grad = None``), and PyTorch leaves that tensor as it was.
        When some gradient views another buffer in another layout, the gather is a
        ``workspace`` copy for this step only and no ``p.grad`` is rebound.
        """
        grads = [p._grad for p in self.params]
        ours = self._ours(grads, self.gtensors)
        if all(ours):
            return self.grad()
        borrowed = self.borrowed(grads)
        if borrowed is not None:
            return borrowed
        srcs = [g._data for g in grads]
        if not all(o or s.base is None for o, s in zip(ours, srcs)):
            return _gather(srcs, self.numel, self.dtype, self.xp, "workspace")
        flat = _gather(srcs, self.numel, self.dtype, self.xp, "gradients")
        for p, v in zip(self.params, _views(flat, self.params)):
            p._grad = _wrap(v)
        self.grad = weakref.ref(flat)
        self.gtensors = [weakref.ref(p._grad) for p in self.params]
        return flat

    def borrowed(self, grads: list):
        """The slice of another owner's flat gradient array that holds ``grads`` in this
        group's order (each at its offset, as when the group was built), else None."""
        if self.borrow is None:
            return None
        base, start = self.borrow[0](), self.borrow[1]
        if base is None:
            return None
        off = start
        for g, v in zip(grads, self.pviews):
            a = g._data
            if a.base is None or memory.root_buffer(a) is not base or a.shape != v.shape or not a.flags.c_contiguous:
                return None
            if _element_offset(a, base) != off:
                return None
            off += a.size
        return base[start:off]

    def could_borrow(self) -> bool:
        """Whether the gradients now sit in another owner's flat array that this group does
        not read as it is but could, laid out anew (DataParallel wrapped the model after
        this group was built)."""
        if self.borrow is not None and self.borrow[0]() is not None:
            return False  # already laid out after a flat array that is still alive
        grads = [p._grad for p in self.params]
        if any(g is None for g in grads) or all(self._ours(grads, self.gtensors)):
            return False
        return _borrowable(self.params) is not None

    def zero_grad(self) -> list | None:
        """Zeroes every gradient with one fill when each is a plain view of the flat
        gradient array (ours or the borrowed one); returns the gradient tensors (their
        versions are the caller's to bump), or None when it did nothing."""
        grads = [p._grad for p in self.params]
        if any(g is None or g._grad_fn is not None or g._requires_grad for g in grads):
            return None
        flat = self.grad() if all(self._ours(grads, self.gtensors)) else self.borrowed(grads)
        if flat is None:
            return None
        flat.fill(0)
        return grads

    # --- state ----------------------------------------------------------------------------
    def state_flat(self, key: str, tensors: list):
        """The flat array of state ``key`` given each parameter's state tensor: the existing
        one when every tensor is its view, else a new ``optimizer_state`` gather."""
        if all(self._ours(tensors, self.stensors.get(key, []))):
            return self.state[key]()
        return _gather([t._data for t in tensors], self.numel, self.dtype, self.xp, "optimizer_state")

    def set_state(self, key: str, flat) -> tuple[list, bool]:
        """Makes ``flat`` state ``key``'s storage. Returns each parameter's state tensor
        (the same objects as before when ``flat`` is the current array) and whether they
        are those same objects."""
        ref = self.state.get(key)
        if ref is not None and ref() is flat:
            tensors = [r() for r in self.stensors[key]]
            if all(t is not None for t in tensors):
                return tensors, True
        memory.retag(flat, "optimizer_state")
        tensors = [_wrap(v) for v in _views(flat, self.params)]
        self.state[key] = weakref.ref(flat)
        self.stensors[key] = [weakref.ref(t) for t in tensors]
        return tensors, False

    def unflatten(self) -> None:
        """Copies every parameter, and each gradient and state tensor that is a view of a
        flat array, into an array of its own (the tensors stay the same objects)."""
        for p, v in zip(self.params, self.pviews):
            if p._data is v:
                p._data = memory.track(v.copy(), "parameters")
        grads = [p._grad for p in self.params]
        for g, ours in zip(grads, self._ours(grads, self.gtensors)):
            if ours:
                g._data = memory.track(g._data.copy(), "gradients")
        for refs in self.stensors.values():
            for r in refs:
                t = r()
                if t is not None:
                    t._data = memory.track(t._data.copy(), "optimizer_state")
        self.param = None
        self.pviews, self.gtensors, self.grad, self.state, self.stensors = [], [], None, {}, {}

    def chunks(self, whole: bool):
        """``(lo, hi)`` slices a step walks: the whole buffer on a GPU (or when ``whole``),
        cache-sized chunks on the CPU."""
        step = self.numel if whole else self.chunk
        return [(lo, min(lo + step, self.numel)) for lo in range(0, self.numel, step)]
