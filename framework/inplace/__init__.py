"""The inplace policy: one setting, ``off | auto | on``, for every inplace SITE of a run.

A *site* is a place where the framework may write a result over its input instead of
into new memory: activation modules built with ``inplace=None`` (``nn.ReLU()``,
``nn.LeakyReLU()``, ``nn.Dropout()``), residual adds (``F.residual_add``), BatchNorm +
activation (InPlace-ABN in the models), and, under ``auto``, ordinary ops (``x.exp()``,
``a + b``, ``F.relu(x)``). Internal buffers nobody else can see follow the policy too
(:func:`enabled`): the bias added into a fresh matmul output, optimizer updates, gradient
accumulation in backward, gradients as views of the allreduce buffer.

- ``off``: every site out of place. The reference.
- ``auto`` (the default): a site writes in place only where :mod:`.proof` proves that
  nothing can read its input again. Same numbers as ``off``, bit for bit.
- ``on``: every site writes in place unless autograd or an alias forbids it (a leaf
  that requires grad, a tensor autograd saved for backward, memory shared with a view,
  ``.data``, ``.numpy()`` or ``detach()``). If the program reads the input again, it gets
  a :class:`ConsumedTensorError` that names the site and the line, never another number.

**A site that writes over its input consumes it**: it returns a new tensor object for the
result, and the input's old object raises on any later use (see :mod:`.consumed`).
Explicit inplace calls (``x.add_(y)``, ``nn.ReLU(inplace=True)``, ``x[i] = v``) are not
sites: they mutate exactly as in PyTorch, whatever the policy.

This module sits below ``nn`` and imports nothing above ``autograd``: the tensor class
and the entry points the proof is calibrated with are handed in by :func:`calibrate`.
"""

from __future__ import annotations

import contextlib
import sys
import warnings

from .. import memory
from ..autograd.grad_mode import state as _grad_state
from ..callsite import call_site, frame_site
from . import proof
from .consumed import ConsumedData, ConsumedTensorError
from .proof import passes_ownership

__all__ = [
    "POLICIES",
    "DEFAULT_POLICY",
    "get_policy",
    "set_policy",
    "policy",
    "enabled",
    "site_target",
    "consume",
    "auto_target",
    "auto_status",
    "auto_min_bytes",
    "set_auto_min_bytes",
    "passes_ownership",
    "ConsumedTensorError",
    "ConsumedData",
]

POLICIES = ("off", "auto", "on")
DEFAULT_POLICY = "auto"

_policy = DEFAULT_POLICY
_Tensor = None  # bound by calibrate()


def get_policy() -> str:
    """The current policy name."""
    return _policy


def set_policy(name: str) -> None:
    """Sets the policy for the whole process: ``"off"``, ``"auto"`` or ``"on"``."""
    global _policy
    if isinstance(name, bool):  # YAML 1.1 reads bare on/off as booleans
        name = "on" if name else "off"
    if name not in POLICIES:
        raise ValueError(f"unknown inplace policy {name!r}; use one of: {', '.join(POLICIES)}")
    _policy = name


@contextlib.contextmanager
def policy(name: str):
    """Runs the block under policy ``name``, then restores the previous one."""
    prev = _policy
    set_policy(name)
    try:
        yield
    finally:
        set_policy(prev)


def auto_status() -> str:
    """``""`` when policy ``auto`` can prove tensors dead on this interpreter, else why not
    (its sites then act as under ``off``)."""
    return proof.status


def enabled(explicit: bool | None = None) -> bool:
    """Whether a site over the framework's OWN buffers writes in place (a bias added into a
    fresh matmul output, optimizer updates, gradient accumulation): under ``auto`` and
    ``on``, yes, since nothing outside the framework can hold those buffers.

    Args:
        explicit: a site's own setting; ``None`` follows the policy.
    """
    if explicit is not None:
        return bool(explicit)
    return _policy != "off"


def count_owned(site: str, nbytes: int) -> None:
    """Counts, under policy ``auto``, a write over one of the framework's own buffers (an
    :func:`enabled` site): ``auto_owned_ops.<site>`` one more, ``auto_owned_bytes`` the
    ``nbytes`` that were not allocated. Kept apart from the ``auto_inplace_*`` counters of
    the ops auto proves dead (the proof's calibration and tests read those); the trainer
    adds the two into ``inplace/auto_*_per_step``. Under ``on`` and ``off`` it counts
    nothing. The sites: ``grad_accumulation`` (a gradient summed into the buffer of the
    one before), ``backward_grad`` (a backward writing its result over its incoming
    gradient), ``optimizer`` (a parameter or state update) and ``linear_bias`` (the bias
    added into linear's fresh product).
    """
    if _policy == "auto":
        # Straight into memory's plain-dict counters: this runs once per backward op.
        key = _owned_keys.get(site) or _owned_keys.setdefault(site, "auto_owned_ops." + site)
        counts = memory._plain_stats
        counts[key] = counts.get(key, 0) + 1
        counts["auto_owned_bytes"] = counts.get("auto_owned_bytes", 0) + nbytes


_owned_keys: dict = {}  # site -> its memory.stats() key


def site_target(tensor, site: str, *, saves_differ: bool = False):
    """Where a policy site may write its result over ``tensor``: ``(file, line)``, or None.

    Called by a site's pass-through frame (``forward`` or a functional site) with the
    tensor it received. None means: compute out of place. Otherwise the site runs its
    inplace form on ``consume(tensor, site, where)`` and returns that: the input is
    consumed BEFORE the write, so a kernel that raises half way leaves nothing readable
    with half-written values. ``saves_differ``: the site's out-of-place form saves its
    input for backward and its inplace form its result (leaky ReLU, as in PyTorch);
    under ``auto`` it then writes in place only where no gradient is recorded, since a
    later inplace op on the saved result would raise where ``off`` runs.
    """
    p = _policy
    if p == "off":
        return None
    if tensor._requires_grad and tensor._grad_fn is None and tensor._base is None:
        return None  # a leaf that requires grad is what its .grad belongs to (any grad mode)
    if memory.saved_refcount(tensor._data) or tensor._vc.packed:
        # Autograd holds it for backward (or a saved-tensor hook packed it, as a checkpoint
        # does, and backward checks its version): writing would make backward raise.
        memory.count("inplace_site_fallbacks")
        return None
    if not _sole_array(tensor):
        return None  # a view, .data, detach() or .numpy() shares the memory
    if p == "on":
        return call_site()
    if saves_differ and _grad_state.enabled and tensor.requires_grad:
        return None
    if proof.status or tensor._data.nbytes < _auto_min_bytes:
        return None  # auto proves nothing on this interpreter, or it is not worth it: as off
    frame = proof.dead_at(tensor, sys._getframe(1), "site")
    if frame is None:
        return None
    where = frame_site(frame)
    del frame
    memory.count("auto_inplace_ops." + site)
    memory.count("auto_inplace_bytes", tensor._data.nbytes)
    return where


def consume(tensor, site: str, where):
    """Hands ``tensor``'s storage and history to a new tensor object, which ``site`` writes
    its result into and returns; the old object is consumed: any later use raises,
    naming ``site`` and ``where``."""
    return tensor._consume(site, where, _policy)


def _sole_array(t) -> bool:
    """``t``'s array owns its memory and only ``t`` refers to it: no view of it, no node
    that saved it, no ``detach()`` or ``.data`` sharing it (each holds a reference)."""
    data = t._data
    return type(data) is not ConsumedData and data.base is None and sys.getrefcount(data) <= _SOLE_ARRAY_REFS


def _measure_sole_array() -> int:
    import numpy as np  # noqa: PLC0415

    class _Holder:  # stands for a tensor and its one slot
        pass

    h = _Holder()
    h._data = np.zeros(1)
    data = h._data  # noqa: F841  (what _sole_array's own local adds)
    return sys.getrefcount(data)


_SOLE_ARRAY_REFS = _measure_sole_array()


def _floating(dtype) -> bool:
    """IEEE floats, and bfloat16 (ml_dtypes: NumPy calls its kind "V"): autocast's activations."""
    return dtype.kind == "f" or dtype.name == "bfloat16"


def auto_target(cls, inputs, params):
    """Where policy ``auto`` runs op ``cls`` in place on ``inputs[0]``: ``(file, line)``, or None.

    Called by the apply path, before anything else, for ops that declare
    ``auto_inplace``. The first input must be worth it (at least :func:`auto_min_bytes`)
    and dead (:mod:`.proof`): not a leaf that requires grad, not a view, its array shared
    with nothing (so no other input can overlap it), nothing but the call holding it; the
    result must have its shape and dtype, and the op's backward must not read it (running
    in place would then only copy it). Ordered cheapest first: most calls stop early.
    """
    x = inputs[0]
    if x.__class__ is not _Tensor or x._base is not None:
        return None
    data = x._data
    if data.nbytes < _auto_min_bytes or not _floating(data.dtype) or (x._requires_grad and x._grad_fn is None):
        return None
    for other in inputs[1:]:
        if isinstance(other, _Tensor):
            od = other._data
            # a bool input is a mask (masked_fill's): it never sets the result's dtype
            other_dtype_ok = od.dtype == data.dtype or od.dtype.kind == "b"
            if od is data or not other_dtype_ok or (od.shape != data.shape and not _fits(od.shape, data.shape)):
                return None  # the same array twice, or a result without x's shape and dtype
            del od
        elif other.__class__ not in _SCALARS:
            return None
    saves_x = _saves_first_input.get(cls)
    if saves_x is None:
        saves_x = _saves_first_input[cls] = tuple(when for _, idx, when in cls._save_plan if idx == 0)
    if saves_x and _grad_state.enabled and cls.differentiable:
        needs = [isinstance(a, _Tensor) and (a._grad_fn is not None or a.requires_grad) for a in inputs]
        for when in saves_x:
            if when is None and any(needs) or when is not None and any(needs[i] for i in when):
                return None
    check = cls.auto_inplace
    if check is not True and not check(inputs, params):
        return None
    if proof.status:
        return None
    nbytes = data.nbytes
    del data  # the proof counts references: hold none of our own
    if not _sole_array(x) or x._vc.packed:
        return None  # shared, or saved for backward (held, or packed away by a saved-tensor hook)
    frame = proof.dead_at(x, sys._getframe(2), "apply")
    if frame is None:
        return None
    where = frame_site(frame)
    del frame
    memory.count(_stat_keys.get(cls) or _stat_keys.setdefault(cls, "auto_inplace_ops." + cls.__name__))
    memory.count("auto_inplace_bytes", nbytes)
    return where


_SCALARS = frozenset({int, float, bool})
DEFAULT_AUTO_MIN_BYTES = 64 * 1024
_auto_min_bytes = DEFAULT_AUTO_MIN_BYTES


def auto_min_bytes() -> int:
    """The smallest tensor (in bytes) that policy ``auto`` tries to write over."""
    return _auto_min_bytes


def set_auto_min_bytes(nbytes: int) -> int:
    """Sets the size below which policy ``auto`` does not try to prove a tensor dead.

    Below it, the proof costs more time than the memory is worth: a chain of ops on
    tiny tensors ran 1.9x slower under ``auto`` than under ``on`` before this threshold,
    while from 256 KiB on ``auto`` runs faster (no page faults for a new buffer); see
    docs/BENCHMARKS.md. NumPy's elision of temporaries stops at 256 KiB for the same
    reason. 0 makes ``auto`` try every tensor (the tests do, to exercise the proof).
    Returns the previous value.
    """
    global _auto_min_bytes
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"auto_min_bytes must be an integer >= 0, got {nbytes!r}")
    prev, _auto_min_bytes = _auto_min_bytes, nbytes
    return prev


def _fits(small, big) -> bool:
    """``small`` broadcasts to ``big`` without changing it."""
    return len(small) <= len(big) and all(s == 1 or s == b for s, b in zip(reversed(small), reversed(big)))


_saves_first_input: dict = {}  # op class -> saved_when conditions of its saved first input
_stat_keys: dict = {}  # op class -> its memory.stats() key


def calibrate(*, Tensor, make, neg, add, relu, residual_add, site, op_module, module_call) -> None:
    """Binds the tensor class and measures policy ``auto``'s reference counts (see
    :func:`.proof.calibrate`). Called once from ``framework/__init__.py``. If no path
    can be trusted on this interpreter, warns once: ``auto`` then acts as ``off``."""
    global _Tensor, _policy, _auto_min_bytes
    _Tensor = Tensor
    prev, _policy = _policy, "auto"
    prev_min, _auto_min_bytes = _auto_min_bytes, 0
    try:
        proof.calibrate(
            make=make,
            neg=neg,
            add=add,
            relu=relu,
            residual_add=residual_add,
            site=site,
            op_module=op_module,
            module_call=module_call,
            counter=lambda: memory.stats().get("auto_inplace_ops", 0),
        )
    finally:
        _policy = prev
        _auto_min_bytes = prev_min
    memory.reset_stats()
    if proof.status:
        warnings.warn(
            f"inplace policy 'auto' cannot prove tensors dead on this interpreter ({proof.status}); "
            "its sites act as under 'off' (correct, without the memory savings)",
            RuntimeWarning,
            stacklevel=2,
        )
