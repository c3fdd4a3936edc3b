"""GELU, exact (``x * Phi(x)``) and tanh-approximated, as ``torch.nn.functional.gelu``.

Backward reads the INPUT (``Phi(x) + x phi(x)`` is no function of the output: GELU is not
monotonic below -0.75, so its output cannot tell the input back), so an inplace GELU
would have to keep a copy of what it overwrites: there is no free inplace form, and GELU
is no site of the inplace policy (policy ``auto`` leaves it out of place too, as for
``sin``). PyTorch has no ``gelu_`` either.

On a GPU each direction is one fused kernel (:mod:`.kernels_transformer`). On the CPU the
exact GELU of float32 and half types runs :mod:`.gelu_cpu` (the normal CDF from NumPy's
SIMD ufuncs, about 4x faster than SciPy's ``erf`` forward and backward); float64 and the
tanh form run the kernels' NumPy references (SciPy's ``erf`` for float64's accuracy).
Half types compute in float32.

Under ``create_graph`` the gradient is :class:`GeluGrad` (``g * gelu'(x)``), an op whose
own backward holds ``gelu''``: derivatives of any order.
"""

from __future__ import annotations

import numpy as np

from ..autograd.function import Function
from ..backend import get_array_module
from ..tensor import Tensor
from . import gelu_cpu
from . import kernels_transformer as KT
from .kernels import launch, on_gpu
from .promotion import is_floating

APPROXIMATIONS = ("none", "tanh")


def _fast_cpu(x, approximate):
    """Whether :mod:`.gelu_cpu` computes this GELU on the CPU: the exact form below float64."""
    return approximate == "none" and x.dtype != np.float64


def _gelu_array(x, approximate, out=None):
    if on_gpu(x):
        return launch(KT.gelu[approximate], x, out=out)
    y = gelu_cpu.gelu(x, out) if _fast_cpu(x, approximate) else KT.gelu_reference(x, approximate)
    if out is None:
        return y.astype(x.dtype, copy=False)
    if y is not out:
        out[...] = y
    return out


class Gelu(Function):
    """``y = gelu(x)``; saves ``x``."""

    inplace_name = "gelu_"
    saves = ("x",)
    saved_attrs = {"approximate": lambda c: c.approximate}
    auto_inplace = True  # declared like every elementwise op; auto refuses it: backward reads x

    def forward(ctx, x, approximate="none"):
        ctx.approximate = approximate
        return _gelu_array(x, approximate, ctx.out)

    def backward(ctx, g):
        x = ctx.x
        if g.__class__ is Tensor:  # create_graph: an op with a backward of its own
            return GeluGrad.apply(g, x, approximate=ctx.approximate)
        return gelu_grad(g, x, ctx.approximate, out=g if ctx.reuse_grad else None)


def gelu_grad(g, x, approximate, out=None):
    """``g * gelu'(x)`` on arrays (one kernel on a GPU)."""
    if on_gpu(g):
        return launch(KT.gelu_backward[approximate], g, x, out=out)
    if _fast_cpu(x, approximate):
        gx = gelu_cpu.gelu_backward(g, x, out)
    else:
        gx = KT.gelu_derivative_reference(x, approximate, g)
    if out is None:
        return gx.astype(g.dtype, copy=False)
    if gx is not out:
        out[...] = gx
    return out


class GeluGrad(Function):
    """``g * gelu'(x)``: GELU's gradient as an op (under create_graph), so that it has a
    backward: ``d/dg = gelu'(x)`` (itself again), ``d/dx = g * gelu''(x)`` written with
    differentiable ops (``exp``, ``tanh``, products), so any order works."""

    saves = ("g", "x")
    saved_when = {"g": (1,), "x": (0, 1)}

    def forward(ctx, g, x, approximate="none"):
        ctx.approximate = approximate
        return gelu_grad(g, x, approximate)

    def backward(ctx, gg):
        x = ctx.x
        ggrad = gx = None
        if ctx.needs_input_grad[0]:
            if gg.__class__ is Tensor:
                ggrad = GeluGrad.apply(gg, x, approximate=ctx.approximate)
            else:
                ggrad = gelu_grad(gg, x, ctx.approximate)
        if ctx.needs_input_grad[1]:
            gx = gg * ctx.g * _second_derivative(x, ctx.approximate)
        return ggrad, gx


def _second_derivative(x, approximate):
    """``gelu''(x)`` with the array module of ``x`` (the tensor namespace under create_graph):
    exact ``phi(x) (2 - x^2)``; tanh: ``(1 - t^2) (u' - x t u'^2 + x u''/2)`` with
    ``u = sqrt(2/pi) (x + 0.044715 x^3)``, ``t = tanh(u)``."""
    xp = get_array_module(x)
    if approximate == "tanh":
        c, k = KT._SQRT_2_PI, KT._KAPPA
        t = xp.tanh(c * (x + k * x * x * x))
        du = c * (1 + 3 * k * x * x)
        return (1 - t * t) * (du - x * t * du * du + 0.5 * x * (6 * c * k * x))
    phi = xp.exp(-0.5 * x * x) * KT._INV_SQRT_2PI
    return phi * (2 - x * x)


def gelu(input, approximate: str = "none"):
    """``input * Phi(input)`` (``approximate="tanh"``: ``0.5 x (1 + tanh(sqrt(2/pi) (x +
    0.044715 x^3)))``), as ``torch.nn.functional.gelu``."""
    if not isinstance(input, Tensor):
        raise TypeError(f"gelu(): argument 'input' must be Tensor, not {type(input).__name__}")
    if approximate not in APPROXIMATIONS:
        raise RuntimeError(f"approximate argument must be either none or tanh, got {approximate!r}")
    if not is_floating(input.dtype):
        raise RuntimeError(f"\"GeluKernelImpl\" not implemented for '{input.dtype}'")
    return Gelu.apply(input, approximate=approximate)
