"""A small convolutional network: conv-norm-ReLU-maxpool blocks, then a linear head."""

from __future__ import annotations

from framework import nn

from .layers import ABN, LEAKY_SLOPE, check_choice, positive_int, positive_ints
from .registry import register_model

NORMS = (None, "bn", "inplace_abn")


@register_model("convnet")
class ConvNet(nn.Module):
    """``[Conv3x3 -> norm -> ReLU -> MaxPool2d(2)]`` per entry of ``channels``, then Linear.

    Args:
        in_channels: input image channels (1 for the 8x8 digits).
        num_classes: outputs of the linear head.
        channels: output channels of each block; each block halves height and width.
        image_size: input height and width; must survive the poolings (``image_size //
            2**len(channels) >= 1``).
        norm: ``"bn"`` (BatchNorm2d + ``ReLU(inplace=None)``), ``"inplace_abn"`` (the two
            fused into ``InPlaceABN``, leaky ReLU slope 0.01) or ``None`` (conv bias + ReLU).
    """

    def __init__(self, in_channels=1, num_classes=10, channels=(32, 64), image_size=8, norm="bn"):
        super().__init__()
        positive_int("in_channels", in_channels)
        positive_int("num_classes", num_classes)
        positive_int("image_size", image_size)
        channels = positive_ints("channels", channels)
        if not channels:
            raise ValueError("channels must name at least one block, e.g. channels=[32, 64]")
        check_choice("norm", norm, NORMS)
        out_size = image_size >> len(channels)
        if out_size < 1:
            raise ValueError(
                f"image_size={image_size} is too small for {len(channels)} blocks: each block halves "
                f"it (needs image_size >= {2 ** len(channels)}); use fewer channels entries"
            )
        self.in_channels, self.num_classes, self.channels = in_channels, num_classes, channels
        self.image_size, self.norm = image_size, norm

        layers = []
        prev = in_channels
        for c in channels:
            layers.append(nn.Conv2d(prev, c, 3, padding=1, bias=norm is None))
            if norm == "inplace_abn":
                layers.append(ABN(c, negative_slope=LEAKY_SLOPE))
            else:
                if norm == "bn":
                    layers.append(nn.BatchNorm2d(c))
                layers.append(nn.ReLU(inplace=None))
            layers.append(nn.MaxPool2d(2))
            prev = c
        self.features = nn.Sequential(*layers)
        self.flatten = nn.Flatten()
        self.head = nn.Linear(prev * out_size * out_size, num_classes)

    def forward(self, x):
        if x.ndim != 4 or x.shape[1] != self.in_channels or x.shape[2:] != (self.image_size,) * 2:
            raise ValueError(
                f"ConvNet(in_channels={self.in_channels}, image_size={self.image_size}) expects input "
                f"of shape (N, {self.in_channels}, {self.image_size}, {self.image_size}), "
                f"got {tuple(x.shape)}"
            )
        return self.head(self.flatten(self.features(x)))
