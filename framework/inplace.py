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


def enabled(explicit: bool | None = None) -> bool:
    """Whether an inplace site takes its inplace path.

    Args:
        explicit: a site's own setting (``ReLU(inplace=True)``); ``None`` follows the policy.
    """
    if explicit is not None:
        return bool(explicit)
    return _policy != "off"
