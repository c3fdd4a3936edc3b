"""The inplace policy: one setting that switches every inplace SITE of a training run.

``on`` (the default) takes the inplace path at every site; ``off`` the out-of-place
path. The sites are: activation modules built with ``inplace=None`` (``ReLU``,
``LeakyReLU``, ``Dropout``), residual adds in models, BatchNorm+activation fused as
InPlace-ABN when a model asks for it, optimizer updates, gradient accumulation in the
backward engine, and (in data parallel training) gradients as views of the allreduce
buffer with ``MPI.IN_PLACE``.

Explicit calls such as ``x.add_(y)`` always mutate ``x``: that is their meaning, not a
policy decision. The policy never changes results, only memory (tests hold both
policies to the same losses).
"""

from __future__ import annotations

import contextlib

POLICIES = ("on", "off")

_policy = "on"


def get_policy() -> str:
    """The current policy name."""
    return _policy


def set_policy(name: str) -> None:
    """Sets the policy for the whole process: ``"on"`` or ``"off"``."""
    global _policy
    if isinstance(name, bool):  # YAML 1.1 reads bare on/off as booleans
        name = "on" if name else "off"
    if name == "auto":
        raise ValueError(
            "inplace policy 'auto' (proving inputs dead op by op) is not available yet; "
            "use 'on' or 'off'"
        )
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


def can_write(tensor, explicit: bool | None = None) -> bool:
    """Whether an inplace SITE writes over ``tensor`` (an activation's input, a residual sum).

    ``True``/``False`` (a module's own ``inplace=``) are obeyed as written, as in PyTorch:
    misuse raises at once or at backward. ``None`` follows the policy, except where the
    inplace path could only fail, so that ``on`` never raises where ``off`` works:
    ``tensor`` is (a view of) a leaf that requires grad, or a value autograd holds for
    backward (a ``Dropout`` after ``tanh``, whose backward reads its output). There the
    site takes the out-of-place path and counts ``inplace_site_fallbacks`` in
    :func:`framework.memory.stats`.
    """
    if explicit is not None:
        return bool(explicit)
    if _policy == "off":
        return False
    from . import memory  # noqa: PLC0415
    from .autograd.grad_mode import state  # noqa: PLC0415

    if state.enabled:
        base = tensor._base if tensor._base is not None else tensor
        if (base._requires_grad and base._grad_fn is None) or memory.saved_refcount(tensor._data) > 0:
            memory.count("inplace_site_fallbacks")
            return False
    return True


def enabled(explicit: bool | None = None) -> bool:
    """Whether an inplace site takes its inplace path.

    Args:
        explicit: a site's own setting (``ReLU(inplace=True)``); ``None`` follows the policy.
    """
    if explicit is not None:
        return bool(explicit)
    return _policy != "off"
