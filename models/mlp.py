"""A multilayer perceptron whose activations follow the inplace policy."""

from __future__ import annotations

import math

from framework import nn

from .layers import ABN, LEAKY_SLOPE, check_choice, make_activation, positive_int, positive_ints
from .registry import register_model

ACTIVATIONS = ("relu", "tanh", "sigmoid", "leaky_relu")
NORMS = (None, "bn", "inplace_abn")


@register_model("mlp")
class MLP(nn.Module):
    """Flatten, then ``Linear -> [norm] -> activation -> [dropout]`` per hidden layer, then a head.

    Args:
        in_features: features after flattening (64 for the 8x8 digits).
        num_classes: outputs of the final linear layer.
        hidden: widths of the hidden layers (a list from YAML works).
        activation: ``"relu"``, ``"tanh"``, ``"sigmoid"`` or ``"leaky_relu"`` (slope 0.01);
            every activation module is built with ``inplace=None`` (follows the policy).
        dropout: dropout probability after each hidden activation (0 = none).
        norm: ``None``, ``"bn"`` (BatchNorm1d before the activation) or ``"inplace_abn"``:
            BatchNorm1d + activation fused into ``InPlaceABN`` (leaky ReLU, slope 0.01).
            InPlace-ABN needs an invertible activation, so ``"relu"`` becomes leaky ReLU
            with slope 0.01 and ``"tanh"``/``"sigmoid"`` are refused.
    """

    def __init__(self, in_features=64, num_classes=10, hidden=(128, 128), activation="relu", dropout=0.0, norm=None):
        super().__init__()
        positive_int("in_features", in_features)
        positive_int("num_classes", num_classes)
        hidden = positive_ints("hidden", hidden)
        check_choice("activation", activation, ACTIVATIONS)
        check_choice("norm", norm, NORMS)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
        if norm == "inplace_abn" and activation not in ("relu", "leaky_relu"):
            raise ValueError(
                f"norm='inplace_abn' fuses BatchNorm with leaky ReLU (it must invert the activation in "
                f"backward); activation={activation!r} cannot be fused: use norm='bn' or "
                "activation='leaky_relu'"
            )
        self.in_features, self.num_classes, self.hidden = in_features, num_classes, hidden
        self.activation, self.dropout, self.norm = activation, float(dropout), norm

        layers = [nn.Flatten()]
        prev = in_features
        for width in hidden:
            layers.append(nn.Linear(prev, width, bias=norm is None))
            if norm == "inplace_abn":
                layers.append(ABN(width, negative_slope=LEAKY_SLOPE))
            else:
                if norm == "bn":
                    layers.append(nn.BatchNorm1d(width))
                layers.append(make_activation(activation))
            if dropout > 0:
                layers.append(nn.Dropout(float(dropout), inplace=None))
            prev = width
        layers.append(nn.Linear(prev, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        per_sample = math.prod(x.shape[1:])
        if x.ndim < 2 or per_sample != self.in_features:
            raise ValueError(
                f"MLP(in_features={self.in_features}) got input of shape {tuple(x.shape)}: "
                f"{per_sample} features per sample after flattening (expected (N, ...) with "
                f"{self.in_features})"
            )
        return self.layers(x)
