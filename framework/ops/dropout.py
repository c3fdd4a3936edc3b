"""Inverted dropout: zero each value with probability ``p``, scale the rest by 1 / (1 - p).

Backward needs only the mask, never the input or the output, so ``dropout(x,
inplace=True)`` overwrites ``x`` and keeps no copy of it. The mask is kept as a BOOL
array (1 byte per value, a quarter of a float32 activation) and the scale as a Python
float; PyTorch keeps a mask of the input's dtype. The mask is drawn from
:func:`framework.random.generator`, so ``fw.manual_seed`` makes it reproducible.
"""

from __future__ import annotations

from numbers import Real

import numpy as np

from .. import inplace as _inplace
from .. import memory
from .. import random as _random
from ..autograd.function import Function
from ..backend import get_array_module
from ..tensor import Tensor
from .promotion import is_floating

__all__ = ["dropout", "Dropout"]


class Dropout(Function):
    """``y = x * mask / (1 - p)``; keeps the bool mask, saves no tensor."""

    node_name = "MulBackward0"  # PyTorch 2.13's dropout on the CPU: input * mask

    inplace_name = "dropout_"
    auto_inplace = True
    saves = ()

    def forward(ctx, x, p=0.5):
        xp = get_array_module(x)
        # float32 uniforms are fine-grained enough (2**-24) for any p, and half the
        # size of float64 ones; the temporary is counted as workspace.
        u = memory.track(_random.generator(xp).random(x.shape, dtype=np.float32), "workspace")
        mask = u >= p  # P(keep) = 1 - p; p == 1 keeps nothing
        del u
        scale = 1.0 / (1.0 - p) if p < 1 else 0.0
        out = ctx.out if ctx.out is not None else memory.empty(x.shape, x.dtype, xp, "activations")
        xp.multiply(x, mask, out=out)
        if scale != 1.0:
            out *= scale
        ctx.scale = scale
        ctx.keep(mask=mask)
        return out

    def backward(ctx, g):
        xp = get_array_module(g)
        # Under policy on the engine may hand over a dead gradient to write into.
        if ctx.reuse_grad:
            gx = g
            _inplace.count_owned("backward_grad", g.nbytes)
        else:
            gx = memory.empty(g.shape, g.dtype, xp)
        gx = xp.multiply(g, ctx.mask, out=gx)  # (a new tensor under create_graph)
        if ctx.scale != 1.0:
            gx *= ctx.scale
        return gx


def check_probability(p) -> None:
    """PyTorch's checks of a dropout probability: outside [0, 1] its Python layer's
    ValueError; NaN (which passes that test) its kernel's RuntimeError."""
    if isinstance(p, bool) or not isinstance(p, Real):
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if p != p:
        raise RuntimeError(f"dropout probability has to be between 0 and 1, but got {p}")


@_inplace.passes_ownership
def dropout(input, p=0.5, training=True, inplace=False):
    """Inverted dropout, as ``torch.nn.functional.dropout``.

    Args:
        input: floating point tensor.
        p: probability of zeroing a value, in [0, 1].
        training: apply dropout (True) or return ``input`` itself (False).
        inplace: overwrite ``input`` (``Dropout.apply_``; a leaf that requires grad raises).

    Returns:
        A new tensor, or ``input`` itself when ``inplace``, ``p == 0`` or not training
        (the identity, as in PyTorch).
    """
    if not isinstance(input, Tensor):
        raise TypeError(f"dropout expects a Tensor input, got {type(input).__name__}")
    check_probability(p)
    if not training or p == 0 or input.numel() == 0:
        return input
    if not is_floating(input.dtype):
        raise TypeError(f"dropout expects a floating point input, got {input.dtype}")
    p = float(p)
    return Dropout.apply_(input, p=p) if inplace else Dropout.apply(input, p=p)
