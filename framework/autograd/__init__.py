"""Autograd: the op contract, the backward engine, grad modes and custom Functions.

Two classes are called ``Function``, as in PyTorch (``torch.autograd.Function`` for
users, C++ nodes inside):

- ``framework.autograd.Function`` (module ``custom_function``) is PyTorch's user API:
  subclass it with static ``forward(ctx, ...)``/``backward(ctx, ...)`` on tensors,
  ``ctx.save_for_backward``, ``ctx.mark_dirty``, and call ``MyFn.apply(...)``.
- ``framework.autograd.OpFunction`` (``framework.autograd.function.Function``) is the
  base of the framework's built-in ops: forward and backward on raw arrays, saved
  tensors declared with ``saves``, the one apply path that makes inplace safe.

The modules form two layers (docs/DESIGN.md): ``grad_mode``, ``node`` (versions, saved
tensors, the node base) and ``engine`` work on arrays and nodes, below the Tensor class;
``function`` (the op contract and the apply path), ``custom_function``, ``graph`` and
``saved`` (what a graph keeps for backward, tensor by tensor) work on tensors, beside the
ops. This package imports only ``grad_mode`` itself; the rest is loaded on first use
(PEP 562), so that the lower layers can import ``framework.autograd.grad_mode`` without
pulling in the upper ones.
"""

from .grad_mode import (
    detect_anomaly,
    enable_grad,
    inference_mode,
    is_grad_enabled,
    is_inference_mode_enabled,
    no_grad,
    set_grad_enabled,
)

# public name -> (module, name in it)
_LAZY = {
    "backward": ("engine", "backward"),
    "grad": ("engine", "grad"),
    "Function": ("custom_function", "Function"),
    "FunctionCtx": ("custom_function", "FunctionCtx"),
    "OpFunction": ("function", "Function"),
    "SavedTensor": ("node", "SavedTensor"),
    "saved_tensors": ("saved", "saved_tensors"),
}


def __getattr__(name):
    import importlib  # noqa: PLC0415

    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    if name in ("graph", "custom_function", "function", "engine", "node", "saved"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Function",
    "FunctionCtx",
    "OpFunction",
    "SavedTensor",
    "backward",
    "detect_anomaly",
    "enable_grad",
    "grad",
    "graph",
    "inference_mode",
    "is_grad_enabled",
    "is_inference_mode_enabled",
    "no_grad",
    "saved_tensors",
    "set_grad_enabled",
]
