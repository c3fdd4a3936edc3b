"""Building blocks shared by the models: policy-following activations and the ABN site.

``ABN`` is the BatchNorm + leaky ReLU SITE of a model built with ``norm="inplace_abn"``.
``nn.InPlaceABN`` is always in place; a model's site follows the inplace policy like
every other site (DESIGN.md: ``off`` takes the out-of-place path at every site):

- policy ``on``: ``nn.InPlaceABN`` (written over its input; keeps only the output);
- policy ``off``: the same function out of place, ``leaky_relu(batch_norm(x, weight=|w| +
  eps, bias) [+ residual])``: BN keeps its input and the activation its output, as an
  unfused pair.

Both compute ``y = leaky_relu(x_hat * (|w| + eps) + b [+ residual])`` with the same
per-element arithmetic in forward; backward differs only by rounding (InPlace-ABN
rebuilds ``x_hat`` from ``y`` and the residual). Parameters and buffers are those of
``nn.InPlaceABN`` (same state dict).
"""

from __future__ import annotations

import framework as fw
from framework import nn
from framework.nn import functional as F

LEAKY_SLOPE = 0.01


class ABN(nn.InPlaceABN):
    """BatchNorm + leaky ReLU: fused in place under policy ``on``, unfused under ``off``."""

    @fw.inplace.passes_ownership
    def forward(self, input, residual=None):
        """``leaky_relu(BN(input) [+ residual])``: in place over ``input`` under ``on`` (and
        under ``auto`` when ``input`` arrives as a temporary, e.g. ``abn(conv(x))``)."""
        site = fw.inplace.can_write(input, None)
        if site:
            return super().forward(input, residual=residual)
        if input.dim() < 2 or input.shape[1] != self.num_features:
            raise ValueError(
                f"ABN({self.num_features}) expects an input of shape (N, {self.num_features}, ...), "
                f"got {tuple(input.shape)}"
            )
        if residual is not None and residual.shape != input.shape:
            raise ValueError(
                f"ABN({self.num_features}): residual has shape {tuple(residual.shape)}, expected the "
                f"input's shape {tuple(input.shape)}"
            )
        scale = self.weight.abs() + self.eps  # InPlace-ABN's |gamma| + eps keeps the affine step invertible
        z = F.batch_norm(input, self.running_mean, self.running_var, scale, self.bias,
                         training=self.training, momentum=self.momentum, eps=self.eps)
        if residual is not None:
            z = z + residual
        return F.leaky_relu(z, self.negative_slope, inplace=False)


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
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value):
        raise ValueError(f"{what} must be a positive integer or a list of them (e.g. [64, 64]), got {value!r}")
    return tuple(value)
