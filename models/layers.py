"""Building blocks shared by the models: policy-following activations and the ABN site.

``ABN`` is the BatchNorm + leaky ReLU SITE of a model built with ``norm="inplace_abn"``:
InPlace-ABN's function, written over its input where the inplace policy allows it and
into a new tensor otherwise (same numbers either way). Parameters and buffers are those
of ``nn.InPlaceABN`` (same state dict).
"""

from __future__ import annotations

import framework as fw
from framework import nn

LEAKY_SLOPE = 0.01

# What a model recomputes in backward instead of keeping (the config's top-level
# ``recompute``, Megatron's names): nothing; whole blocks (``full``: each block keeps its
# input only); or part of each block (``selective``: the GPT's attention core, Korthikanti
# et al.'s; a ResNet block's BatchNorms and activations, torchtitan's policy).
RECOMPUTE = ("none", "full", "selective")


def set_recompute(model, mode: str) -> None:
    """Makes ``model`` recompute ``mode`` (one of :data:`RECOMPUTE`) in backward.

    Raises:
        ValueError: an unknown mode, or a model without blocks to recompute.
    """
    check_choice("recompute", mode, RECOMPUTE)
    if hasattr(model, "set_recompute"):
        model.set_recompute(mode)
    elif mode != "none":
        raise ValueError(
            f"recompute: {mode} needs a model made of blocks (resnet*, gpt); {type(model).__name__} has none"
        )


class ABN(nn.InPlaceABN):
    """BatchNorm + leaky ReLU as InPlace-ABN, and a site of the inplace policy.

    Where the policy lets the site write over its input (``on``; ``auto`` when the input
    is provably dead, e.g. ``abn(conv(x))``), the function runs over the input's buffer
    and consumes it; otherwise (``off``) it writes a new tensor. Both paths compute the
    same function bit for bit: backward rebuilds everything from the output either way.
    """

    @fw.inplace.passes_ownership
    def forward(self, input, residual=None):
        where = fw.inplace.site_target(input, "ABN")
        if where is None:
            return self._abn(input, residual, inplace=False)
        return self._abn(fw.inplace.consume(input, "ABN", where), residual, inplace=True)


def make_activation(name: str) -> nn.Module:
    """The activation module ``name`` built with ``inplace=None`` (it follows the policy)."""
    if name == "relu":
        return nn.ReLU(inplace=None)
    if name == "leaky_relu":
        return nn.LeakyReLU(LEAKY_SLOPE, inplace=None)
    if name == "tanh":
        return nn.Tanh(inplace=None)
    if name == "sigmoid":
        return nn.Sigmoid(inplace=None)
    raise ValueError(f"unknown activation {name!r}")


def check_choice(what: str, value, choices) -> None:
    if value not in choices:
        shown = ", ".join("None" if c is None else repr(c) for c in choices)
        raise ValueError(f"{what} must be one of {shown}; got {value!r}")


def positive_int(what: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def positive_ints(what: str, value) -> tuple[int, ...]:
    """A positive int or a list of them, as a tuple; an error shows the whole value.

    (A string is refused as a whole: iterated, ``"foo"`` would be reported as ``'f'``.)
    """
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value
    ):
        raise ValueError(f"{what} must be a positive integer or a list of them (e.g. [64, 64]), got {value!r}")
    return tuple(value)
