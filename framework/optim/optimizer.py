"""Optimizer: parameter groups, state, ``zero_grad``, ``state_dict`` (PyTorch's API).

Parameter updates are an inplace SITE of the policy (:mod:`framework.inplace`):

- ``on``: ``step()`` updates each parameter and its state tensors IN PLACE under
  ``no_grad`` with the tensors' inplace ops (``p.add_``, ``buf.mul_``, ...). Storage is
  reused and every version bumps, so a graph recorded before ``step()`` raises in
  backward instead of using the new values.
- ``off``: ``step()`` evaluates the SAME arithmetic with out-of-place ops and rebinds the
  results: the parameter object stays (``p._data`` is the new array, counted as
  ``parameters``) and each state tensor is replaced by a new one (``optimizer_state``).
  The parameter's EXISTING version counter is bumped, so a graph recorded before
  ``step()`` raises exactly as under ``on``. Tensors that aliased the old storage
  (``p.detach()``, views, a ``state_dict()`` taken earlier) keep the old values under
  ``off`` and see the new ones under ``on``; the version bump marks them stale in both.

Both paths run the same floating point operations in the same order, so results are
bitwise identical (a test trains 20 steps under each and compares).

Memory: state buffers are allocated under ``memory.category("optimizer_state")``; the
temporaries of a step (``grad + wd * p``, ``sqrt(v)``, ...) are ``workspace``.
"""

from __future__ import annotations

import copy

import numpy as np

from .. import backend, memory
from .. import inplace as _inplace
from ..autograd import node as _node  # _node.capture: framework.compile's recorder, or None
from ..autograd.grad_mode import enable_grad, no_grad
from ..callsite import call_site
from ..nn.module import _zero_grad
from ..ops.elementwise import AddScaled
from ..ops.kernels import on_gpu
from ..tensor import Tensor, _wrap
from .flat import FlatGroup, own
from .kernels import FUSED_DTYPES


class _Required:
    """Marks a hyperparameter without a default (``lr`` of SGD)."""

    def __repr__(self):
        return "<required parameter>"


required = _Required()

_SET_MESSAGE = (
    "optimizer parameters need to be organized in ordered collections, but the ordering of tensors in sets "
    "will change between runs. Please use a list instead."
)


class _Updater:
    """Tensor updates that run in place (policy ``on``) or out of place (``off``).

    Each method returns the updated tensor: the same object in place, a new one out of
    place. The arithmetic (and its rounding) is the same either way.
    """

    __slots__ = ("inplace",)

    def __init__(self, inplace: bool):
        self.inplace = inplace

    def add(self, t: Tensor, other, alpha=1) -> Tensor:
        """``t + alpha * other``; a scaled tensor update writes over ``t`` with no temporary of its size."""
        if self.inplace:
            _inplace.count_owned("optimizer", t._data.nbytes)
        if alpha != 1 and isinstance(other, Tensor) and other.shape == t.shape and other.dtype == t.dtype:
            return AddScaled.apply_(t, other, alpha=alpha) if self.inplace else AddScaled.apply(t, other, alpha=alpha)
        return t.add_(other, alpha=alpha) if self.inplace else t.add(other, alpha=alpha)

    def mul(self, t: Tensor, other) -> Tensor:
        if self.inplace:
            _inplace.count_owned("optimizer", t._data.nbytes)
        return t.mul_(other) if self.inplace else t.mul(other)

    def div(self, t: Tensor, other) -> Tensor:
        if self.inplace:
            _inplace.count_owned("optimizer", t._data.nbytes)
        return t.div_(other) if self.inplace else t.div(other)

    def sqrt(self, t: Tensor) -> Tensor:
        if self.inplace:
            _inplace.count_owned("optimizer", t._data.nbytes)
        return t.sqrt_() if self.inplace else t.sqrt()


class Optimizer:
    """Base class: holds ``param_groups`` (dicts with ``"params"`` and hyperparameters)
    and per-parameter ``state``; subclasses implement :meth:`step` via :meth:`_update`.

    Args:
        params: an iterable of tensors, or of dicts ``{"params": [...], "lr": ...}`` that
            override ``defaults`` per group.
        defaults: the hyperparameters of groups that do not set them.
    """

    #: GradScaler may hand a GPU step its found-inf flag as ``self.found_inf`` (PyTorch's
    #: contract with its fused optimizers): see :meth:`step`.
    _step_supports_amp_scaling = True

    def __init__(self, params, defaults: dict):
        self.defaults = dict(defaults)
        self.state: dict = {}
        self.param_groups: list[dict] = []
        self._flat: dict = {}  # group index -> (signature, [FlatGroup], params outside them)
        # (group index, device, dtype) -> one-element float64 device array: steps that GradScaler's
        # flag skipped on the device since the host last subtracted them from the step counts
        self._amp_skipped: dict = {}
        self._amp = None  # (found_inf, skipped) while a flat group's fused kernel may take the flag
        self._amp_used = False  # the fused kernel took it
        self._amp_host = None  # the flag, read on the host once in a step where a path needs it
        if isinstance(params, Tensor):
            raise TypeError(
                "params argument given to the optimizer should be an iterable of Tensors or dicts, but got a Tensor"
            )
        if isinstance(params, (set, frozenset)):
            raise TypeError(_SET_MESSAGE)
        groups = list(params)
        if not groups:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for g in groups:
            self.add_param_group(g)

    def add_param_group(self, param_group: dict) -> None:
        """Adds a group (e.g. layers unfrozen later); missing hyperparameters take defaults."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        params = param_group["params"]
        if isinstance(params, Tensor):
            params = [params]
        elif isinstance(params, (set, frozenset)):
            raise TypeError(_SET_MESSAGE)
        else:
            params = list(params)
        for p in params:
            if not isinstance(p, Tensor):
                raise TypeError(f"optimizer can only optimize Tensors, but one of the params is {type(p).__name__}")
            if not p.is_leaf:
                raise ValueError("can't optimize a non-leaf Tensor")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter group contains the same parameter more than once")
        group = {"params": params}
        for k, v in param_group.items():
            if k != "params":
                group[k] = v
        for k, default in self.defaults.items():
            if default is required and k not in group:
                raise ValueError(f"parameter group didn't specify a value of required optimization parameter {k}")
            group.setdefault(k, default)
        existing = {id(p) for g in self.param_groups for p in g["params"]}
        if existing & {id(p) for p in params}:
            raise ValueError("some parameters appear in more than one parameter group")
        self._check_group(group)
        self.param_groups.append(group)

    def _check_group(self, group: dict) -> None:
        """Validates a group's hyperparameters (subclasses raise ValueError)."""

    def state_bytes(self) -> int:
        """Bytes of this optimizer's state tensors, each buffer once (views of one flat
        state array count as that array): what the floor of a step counts, whatever else
        the process holds."""
        roots = {}
        for st in self.state.values():
            for v in st.values():
                if isinstance(v, Tensor):
                    root = memory.root_buffer(v._data)
                    roots[id(root)] = root.nbytes
        return sum(roots.values())

    # --- gradients ---------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Resets every parameter's gradient: to ``None`` (default), or to zeros in place.

        Gradients that are views of a flat gradient buffer are zeroed with one fill per
        buffer. With ``set_to_none`` the flat buffer goes with its last view (the next step
        gathers the new gradients into a new one), as per-parameter arrays did.
        """
        covered: set = set()
        site = call_site()
        if not set_to_none:
            for _sig, flats, _rest in self._flat.values():
                for fg in flats:
                    for g in fg.zero_grad() or ():
                        g._vc.bump("zero_ (zero_grad over the flat gradient buffer)", site)
                        covered.add(id(g))
        for group in self.param_groups:
            for p in group["params"]:
                if p._grad is not None and id(p._grad) not in covered:
                    _zero_grad(p, set_to_none)

    # --- the step ------------------------------------------------------------------------
    def step(self, closure=None):
        """One update of every parameter that has a gradient.

        Parameters of one group, device and dtype are updated together over flat buffers
        (:mod:`framework.optim.flat`) when each of them has a gradient and their state
        agrees (e.g. Adam's step count); the others, and every parameter while
        :mod:`framework.compile` captures the step, one by one. Both run the same
        arithmetic, element for element.

        Args:
            closure: optional; re-evaluates the model and returns the loss (run with
                grad enabled before the update).

        Returns:
            the closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with enable_grad():
                loss = closure()
        u = _Updater(_inplace.enabled())
        site = call_site()
        found_inf = self.__dict__.get("found_inf")  # GradScaler's flag (a GPU's, on the device)
        self._amp_host = None
        if found_inf is None and self._amp_skipped:
            self._fold_amp_skipped()
        with no_grad(), memory.category("workspace"):
            for gi, group in enumerate(self.param_groups):
                rest = group["params"]
                if _node.capture is None:
                    rest = self._flat_step(gi, group, u, site)
                if rest and found_inf is not None and self._found_inf_on_host(found_inf):
                    continue  # a path that cannot take the flag: skipped, as read on the host
                for p in rest:
                    if p.grad is None:
                        continue
                    st = self.state.setdefault(p, {})
                    new_p = self._update(p, p.grad, st, group, u)
                    if new_p is not p:
                        _rebind(p, new_p, type(self).__name__, site)
        return loss

    # --- flat buffers --------------------------------------------------------------------
    def _flat_groups(self, gi: int, group: dict):
        """The group's :class:`FlatGroup` s and the parameters outside them (frozen ones),
        rebuilt when the group's parameters, their ``requires_grad`` or their storage
        changed since the last step, or when their gradients moved into a flat array they
        could read as it is (see :meth:`FlatGroup.could_borrow`)."""
        params = group["params"]
        sig = [(id(p), p._requires_grad) for p in params]
        cached = self._flat.get(gi)
        if cached is not None and cached[0] == sig and all(fg.valid() and not fg.could_borrow() for fg in cached[1]):
            return cached[1], cached[2]
        if self._amp_skipped:  # the groups change: the host's step counts first
            self._fold_amp_skipped()
        by_key: dict = {}
        rest = []
        for p in params:
            if p._requires_grad:
                by_key.setdefault((type(p._data), p.device, p._data.dtype), []).append(p)
            else:
                rest.append(p)
        flats = [FlatGroup(ps) for ps in by_key.values()]
        self._flat[gi] = (sig, flats, rest)
        return flats, rest

    def _flat_step(self, gi: int, group: dict, u: _Updater, site) -> list:
        """Updates what it can over flat buffers; returns the parameters left to update one
        by one. With GradScaler's ``found_inf``, a GPU's fused kernels take the flag (and
        update nothing where it is set); other paths read it on the host first."""
        found_inf = self.__dict__.get("found_inf")
        flats, rest = self._flat_groups(gi, group)
        rest = list(rest)
        for fg in flats:
            amp = None
            if found_inf is not None:
                if on_gpu(fg.param) and fg.dtype in FUSED_DTYPES and self._fused_takes_flag(group, fg):
                    key = (gi, backend.device_of(fg.param).index, fg.dtype)
                    skipped = self._amp_skipped.get(key)
                    if skipped is None:
                        skipped = self._amp_skipped[key] = fg.xp.zeros((1,), dtype=np.float64)
                    amp = (found_inf, skipped)
                elif self._found_inf_on_host(found_inf):
                    continue  # skipped
            self._amp, self._amp_used = amp, False
            try:
                done = self._flat_update(fg, group, u, site)
            finally:
                self._amp = None
            if self._amp_used:
                fg.xp.add(amp[1], amp[0], out=amp[1])  # one more step the flag may have skipped
            if not done:
                rest.extend(fg.params)
        return rest

    def _fused_takes_flag(self, group: dict, fg: FlatGroup) -> bool:
        """Whether this optimizer's fused kernel can take GradScaler's flag for ``fg`` and
        skip on the device exactly as a skipped step (subclasses that can say True)."""
        return False

    def _found_inf_on_host(self, found_inf) -> bool:
        """GradScaler's flag read back (once per step: one host sync), for a path that cannot
        take it on the device; the host's step counts are brought up to date first."""
        if self._amp_host is None:
            self._fold_amp_skipped()
            self._amp_host = bool(backend.to_numpy(found_inf)[0])
        return self._amp_host

    def _fold_amp_skipped(self) -> None:
        """Subtracts the steps GradScaler's flag skipped on the device from the step counts
        (``state["step"]``) of their parameters: one read per flat group, where the host
        needs the counts (``state_dict``, a path without the flag, new flat groups)."""
        for (gi, device, dtype), skipped in self._amp_skipped.items():
            k = int(round(float(backend.to_numpy(skipped)[0])))
            if not k or gi >= len(self.param_groups):
                continue
            for p in self.param_groups[gi]["params"]:
                st = self.state.get(p)
                if st and isinstance(st.get("step"), int) and p._data.dtype == dtype and p.device.index == device:
                    st["step"] -= k
        self._amp_skipped.clear()

    def _flat_update(self, fg: FlatGroup, group: dict, u: _Updater, site) -> bool:
        """One update of ``fg``'s parameters over its flat buffers; False (nothing done)
        when some parameter has no gradient or their states differ."""
        params = fg.params
        if any(p._grad is None for p in params):
            return False
        states = [self.state.get(p) or {} for p in params]
        keys = tuple(states[0])
        first = states[0]
        tensor_keys = [k for k in keys if isinstance(first[k], Tensor)]
        for p, st in zip(params, states):
            if tuple(st) != keys:
                return False
            for k in keys:
                v = st[k]
                if k in tensor_keys:
                    if not isinstance(v, Tensor) or v._data.shape != p._data.shape or v._data.dtype != fg.dtype:
                        return False
                    if type(v._data) is not type(p._data) or v.device != p.device:
                        return False
                elif isinstance(v, Tensor) or v != first[k]:
                    return False
        grad = fg.grads()
        given = {k: fg.state_flat(k, [st[k] for st in states]) if k in tensor_keys else first[k] for k in keys}
        new_param, final = self._update_over(fg.param, grad, given, group, u, fg.chunks(not u.inplace))
        who = type(self).__name__
        in_place = new_param is fg.param
        if not in_place:
            fg.set_param(new_param)
        for p in params:
            if in_place:
                p._vc.bump(f"add_ ({who}.step over the flat parameter buffer)", site)
            else:
                p._vc.bump(f"{who}.step (inplace policy off: new storage)", site)
        tensors = {}
        for k, flat in final.items():
            if not backend.is_array(flat):
                continue
            tensors[k], same = fg.set_state(k, flat)
            if same:  # updated in place
                for t in tensors[k]:
                    t._vc.bump(f"{who}.step (optimizer state over a flat buffer)", site)
        for i, p in enumerate(params):
            st = self.state.setdefault(p, {})
            for k, v in final.items():
                st[k] = tensors[k][i] if k in tensors else v
        return True

    def _update_over(self, param, grad, state: dict, group: dict, u: _Updater, chunks) -> tuple:
        """Runs the rule (:meth:`_update_flat`) over 1-D buffers of one length, chunk by chunk:
        a :class:`FlatGroup`'s, or a ZeRO shard's (:mod:`framework.distributed.zero`).

        Args:
            param, grad: the parameters' and the gradients' buffers (views of larger ones
                allowed).
            state: each state key's buffer of that length, or its value (Adam's ``step``);
                empty before the first step.
            group: the hyperparameters.
            u: in place (policies ``auto``, ``on``) or out of place (``off``).
            chunks: the ``(lo, hi)`` slices to walk; out of place, one: the whole buffer.

        Returns:
            ``(param, state)``: the parameters' buffer after the step (``param`` itself when
            updated in place, else a new one) and each key's buffer or value after it (the
            given buffers when updated in place, new ones where the step made them).
        """
        whole = not u.inplace  # out of place: the results are the new flat buffers themselves
        new_param, new_state, final = None, {}, {}
        # Every tensor handed to the rule wraps a slice, a view: policy auto never writes
        # over a view, so only the rule's explicit updates (u.*) touch the flat buffers.
        for lo, hi in chunks:
            p_t = _wrap(param[lo:hi])
            given = {k: (_wrap(v[lo:hi]) if backend.is_array(v) else v) for k, v in state.items()}
            final = dict(given)
            new_p = self._update_flat(p_t, _wrap(grad[lo:hi]), final, group, u)
            taken = [grad, new_param, *new_state.values()]
            if new_p is not p_t:  # into a new buffer out of place, else back into the flat one
                dst = new_param if whole else param
                new_param = self._place(new_p._data, dst, param, lo, hi, whole, "parameters", taken)
            for k, v in final.items():
                if isinstance(v, Tensor) and v is not given.get(k):  # a new state tensor (the first step makes them)
                    dst = new_state.get(k, None if whole else state.get(k))
                    new_state[k] = self._place(v._data, dst, param, lo, hi, whole, "optimizer_state", taken)
        out = {}
        for k, v in final.items():
            out[k] = new_state[k] if k in new_state else state[k] if isinstance(v, Tensor) else v
        return (param if new_param is None else new_param), out

    def _unflatten(self) -> None:
        """Gives every parameter, and each gradient and state tensor of the flat buffers,
        its own array again (same values, same tensor objects); the next eager step builds
        new flat buffers. :mod:`framework.compile` calls it: a captured program plans one
        buffer per parameter."""
        for _sig, flats, _rest in self._flat.values():
            for fg in flats:
                fg.unflatten()
        self._flat.clear()

    @staticmethod
    def _place(array, flat, like, lo: int, hi: int, whole: bool, category: str, taken):
        """Puts a slice's new values (``array``) into ``flat``, the buffer they go to (None:
        a new one of ``like``'s length and dtype), and returns that buffer. Out of place
        (``whole``) a fresh result becomes the new buffer as it is; otherwise the values
        are copied into their slice."""
        if whole and flat is None and own(array, like.size, taken):
            memory.retag(array, category)
            return array
        xp = backend.get_array_module(like)
        if flat is None:
            flat = memory.empty((like.size,), like.dtype, xp, category)
        xp.copyto(flat[lo:hi], array)
        return flat

    def _update_flat(self, p: Tensor, grad: Tensor, state: dict, group: dict, u: _Updater) -> Tensor:
        """The update of a slice of flat buffers (1-D ``p``, ``grad`` and state tensors).

        The rule is :meth:`_update`'s, run over the whole slice: a fixed number of
        whole-buffer operations per dtype, whatever the number of parameters. This is the
        one place where a device runs a fused kernel instead: on a GPU, for the dtypes of
        :data:`framework.optim.kernels.FUSED_DTYPES`, :meth:`_update_fused` (one
        ``ElementwiseKernel`` per step and dtype) under every policy, so that no policy
        changes a number there; the CPU keeps the rule.
        """
        if on_gpu(p._data) and p._data.dtype in FUSED_DTYPES:
            new_p = self._update_fused(p, grad, state, group, u.inplace)
            if new_p is not None:
                return new_p
        return self._update(p, grad, state, group, u)

    def _update_fused(self, p: Tensor, grad: Tensor, state: dict, group: dict, inplace: bool) -> Tensor | None:
        """:meth:`_update` of a GPU's flat slice as one fused kernel
        (:mod:`framework.optim.kernels`), or None where this optimizer has none (the rule
        then runs op by op).

        In place (``inplace``) the kernel writes over ``p`` and the state tensors and
        returns ``p``; otherwise it writes new buffers (:func:`_fused_out`), stores new
        state tensors with :meth:`_set_state` and returns the new parameter tensor.
        """
        return None

    def _update(self, p: Tensor, grad: Tensor, state: dict, group: dict, u: _Updater) -> Tensor:
        """Updates one parameter; returns ``p`` (updated in place) or its new value.

        Store new state tensors with :meth:`_set_state`; allocate fresh ones inside
        ``memory.category("optimizer_state")``.
        """
        raise NotImplementedError(f"{type(self).__name__} must define _update (the rule for one parameter)")

    @staticmethod
    def _set_state(state: dict, key: str, value: Tensor) -> None:
        """Stores a state tensor, counting a new buffer as ``optimizer_state``."""
        if state.get(key) is not value:
            memory.retag(value._data, "optimizer_state")
            state[key] = value

    # --- state dict ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """``{"state": {index: {name: value}}, "param_groups": [{..., "params": [indices]}]}``.

        Parameters are named by their position over all groups, as in PyTorch. The state
        tensors are the live ones (not copies): serialise them, or ``copy.deepcopy`` the
        dict, to keep a snapshot.
        """
        if self._amp_skipped:
            self._fold_amp_skipped()
        index: dict[int, int] = {}
        groups = []
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = [index.setdefault(id(p), len(index)) for p in g["params"]]
            groups.append(packed)
        state = {index[id(p)]: dict(s) for p, s in self.state.items() if id(p) in index and s}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores hyperparameters and state saved by :meth:`state_dict`.

        State tensors are copied (to each parameter's device; floating ones to its dtype)
        into new ``optimizer_state`` buffers. Values may be tensors or NumPy arrays.

        Raises:
            ValueError: when the number of groups, or of parameters in a group, differs.
        """
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("optimizer state_dict must be a dict with keys 'state' and 'param_groups'")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state dict has a different number of parameter groups ({len(saved_groups)}) than the "
                f"optimizer ({len(self.param_groups)})"
            )
        for i, (g, sg) in enumerate(zip(self.param_groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(
                    f"loaded state dict contains a parameter group that doesn't match the size of optimizer's "
                    f"group: group {i} has {len(sg['params'])} parameters in the state dict, "
                    f"{len(g['params'])} in the optimizer"
                )
        id_map = {}
        for g, sg in zip(self.param_groups, saved_groups):
            for p, idx in zip(g["params"], sg["params"]):
                id_map[idx] = p
        new_state: dict = {}
        with no_grad(), memory.category("optimizer_state"):
            for idx, s in state_dict["state"].items():
                p = id_map.get(int(idx))
                if p is None:
                    continue
                new_state[p] = {k: _cast_state(v, p, k) for k, v in s.items()}
        new_groups = []
        for g, sg in zip(self.param_groups, saved_groups):
            ng = {k: copy.deepcopy(v) for k, v in sg.items() if k != "params"}
            ng["params"] = g["params"]
            new_groups.append(ng)
        self.state = new_state
        self.param_groups = new_groups
        self._amp_skipped.clear()  # the loaded counts are the truth

    def __repr__(self) -> str:
        s = type(self).__name__ + " ("
        for i, g in enumerate(self.param_groups):
            s += f"\nParameter Group {i}"
            for k in sorted(g):
                if k != "params":
                    s += f"\n    {k}: {g[k]}"
        return s + "\n)"


def _cast_state(value, p: Tensor, key: str):
    if isinstance(value, Tensor):
        array = value._data
    elif backend.is_array(value):  # a NumPy or CuPy array
        array = value
    else:
        return copy.deepcopy(value)
    array = backend.to_device(array, p.device)
    if array.dtype.kind == "f" and key != "step":
        array = array.astype(p.dtype, copy=False)
    array = array.copy()
    return _wrap(memory.track(array, "optimizer_state"))


def _fused_out(array, inplace: bool, category: str):
    """Where a fused update writes the new values of ``array``: over it in place, else
    into a new buffer of ``category``."""
    return array if inplace else memory.empty(array.shape, array.dtype, backend.get_array_module(array), category)


def _rebind(p: Tensor, new: Tensor, who: str, site) -> None:
    """The ``off`` path's commit: ``p`` gets ``new``'s storage; its version bumps."""
    if new.shape != p.shape or new.dtype != p.dtype:
        raise RuntimeError(
            f"{who}.step computed a value of shape {tuple(new.shape)} and dtype {new.dtype} for a parameter of "
            f"shape {tuple(p.shape)} and dtype {p.dtype}"
        )
    p._data = new._data
    memory.retag(p._data, "parameters")
    # The old storage is gone from p, but graphs recorded before the step saved it with
    # p's version counter: bump that counter so they raise in backward, as under `on`.
    p._vc.bump(f"{who}.step (inplace policy off: new storage)", site)
