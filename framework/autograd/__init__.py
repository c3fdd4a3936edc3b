"""Autograd: the Function contract, the backward engine and grad modes.

``function`` and ``engine`` import the Tensor class, which itself needs grad modes at
import time, so they are loaded on first use (PEP 562) rather than here.
"""

from .grad_mode import detect_anomaly, enable_grad, is_grad_enabled, no_grad, set_grad_enabled

_LAZY = {"backward": "engine", "grad": "engine", "Function": "function", "SavedTensor": "function"}


def __getattr__(name):
    if name in _LAZY:
        import importlib  # noqa: PLC0415

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Function",
    "SavedTensor",
    "backward",
    "detect_anomaly",
    "enable_grad",
    "grad",
    "is_grad_enabled",
    "no_grad",
    "set_grad_enabled",
]
