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
array and ``p.grad`` rebound to its view. A gradient that is a view of someone else's
buffer (DataParallel's allreduce bucket) is left where it is and gathered into a workspace
copy for the step: DataParallel keeps owning ``.grad`` and the two never rebind it back and
forth.
"""

from __future__ import annotations

import weakref

import numpy as np

from .. import memory
from ..backend import get_array_module
from ..tensor import _wrap

# On the CPU a step walks the flat buffers in chunks of at least this many elements (and
# at least the largest parameter), so that its temporaries stay cache-sized and never
# exceed those of a per-parameter update by more than a few such chunks.
CPU_CHUNK = 1 << 14


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


class FlatGroup:
    """Parameters of one group, device and dtype over flat buffers (see the module doc).

    Building it copies the parameters into a new flat array (category ``parameters``)
    and rebinds each ``p._data`` to its view; the old per-parameter arrays go away with
    their last reference.

    Attributes:
        params: the parameters, in group order.
        numel, dtype, xp: the flat buffers' size, dtype and array module.
        param, pviews: the flat parameter array and each parameter's view of it.
        grad, gtensors: weak references to the flat gradient array (None until a step
            gathers one) and to each parameter's gradient tensor (a view of it).
        state, stensors: state name -> weak references to the flat array, and to each
            parameter's state tensor.
    """

    __slots__ = ("params", "numel", "dtype", "xp", "chunk", "param", "pviews", "grad", "gtensors", "state", "stensors")

    def __init__(self, params: list) -> None:
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

    def grads(self, fresh: bool):
        """The gradients as one flat array (every parameter has one).

        Zero copies when each ``p.grad`` is already a view of the flat gradient array.
        Otherwise one gather: plain gradient arrays are adopted (``p.grad`` becomes a view
        of the flat array, same values), into the existing flat array when ``fresh`` is
        False and every gradient is ours or plain, else into a new one. When some
        gradient views another buffer (DataParallel's bucket), the gather is a
        ``workspace`` copy for this step only and no ``p.grad`` is rebound.
        """
        grads = [p._grad for p in self.params]
        ours = self._ours(grads, self.gtensors)
        if all(ours):
            return self.grad()
        srcs = [g._data for g in grads]
        if not all(o or s.base is None for o, s in zip(ours, srcs)):
            return _gather(srcs, self.numel, self.dtype, self.xp, "workspace")
        current = self.grad() if self.grad is not None else None
        flat = current if not fresh and any(ours) else None
        if flat is None:
            flat = _gather(srcs, self.numel, self.dtype, self.xp, "gradients")
            ours = [False] * len(srcs)
        views = _views(flat, self.params)
        for p, s, v, o in zip(self.params, srcs, views, ours):
            if not o:
                if flat is current:  # a plain array beside views of ours: into its slot
                    v[...] = s
                p._grad = _wrap(v)
        self.grad = weakref.ref(flat)
        self.gtensors = [weakref.ref(p._grad) for p in self.params]
        return flat

    def zero_grad(self) -> list | None:
        """Zeroes every gradient with one fill when each is a plain view of the flat
        array; returns the gradient tensors (their versions are the caller's to bump), or
        None when it did nothing."""
        grads = [p._grad for p in self.params]
        if not all(self._ours(grads, self.gtensors)):
            return None
        if any(g._grad_fn is not None or g._requires_grad for g in grads):
            return None
        self.grad().fill(0)
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
