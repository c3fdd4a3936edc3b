"""CIFAR-style ResNets (He, Zhang, Ren, Sun, CVPR 2016, section 4.2) with inplace sites.

Layout for depth ``6n + 2``: a 3x3 stem conv with ``width`` channels, three stages of
``n`` basic blocks with ``width``, ``2 width`` and ``4 width`` channels on 32x32, 16x16 and
8x8 maps (the first block of stages 2 and 3 has stride 2), global average pooling and a
linear head. ``width=16`` gives the paper's networks (ResNet-20: 0.27M parameters).

Shortcut: option A of the paper, the one it uses on CIFAR-10: the identity, and where the
shape changes, the input subsampled with stride 2 (``x[:, :, ::2, ::2]``) with the new
channels zero-padded. It has no parameters (so parameter counts match the paper) and it
saves nothing for backward (slicing and concatenation need only shapes).

Inplace sites of a block (all follow ``framework.inplace``):

- the residual add, ``F.residual_add(bn2_out, identity)``: ``add_`` under ``on`` (and
  under ``auto``, which proves ``bn2_out`` dead: it arrives as a temporary), a new tensor
  under ``off``. ``bn2_out`` is BN2's output, which BatchNorm does not save for backward,
  and ``add`` saves nothing, so the inplace add is exact under autograd;
- the activation after it, ``ReLU(inplace=None)``, and the one after BN1;
- with ``norm="inplace_abn"``, instead: the two fused ``ABN`` sites (in place under
  ``on``, the unfused out-of-place form under ``off``).

Memory per basic block, counted in activation-sized buffers held for backward (``a`` =
conv1 output, ``b`` = unit-1 output = conv2 input, ``c`` = conv2 output, ``y`` = block
output; the block input is the previous block's ``y``):

- ``norm="bn"``: 4 (``a`` saved by BN1, ``b`` by ReLU and conv2, ``c`` by BN2, ``y`` by
  the ReLU and the next block). ``on`` and ``off`` hold the same 4; ``on`` saves only the
  transient buffers (ReLU and add outputs, gradient sums in backward). Measured: those
  transients are never alive at the step's peak, which is a conv backward's im2col
  workspace early in backward, so ResNet-20's peak is the same under ``on`` and ``off``.
- ``norm="inplace_abn"``: 2. Both units are fused in place. Unit 1 (BN1 + ReLU) becomes
  ``InPlaceABN`` (leaky ReLU, slope 0.01, written over ``a``; backward inverts the
  activation and the affine step), so ``a`` is gone. Unit 2 (BN2, the residual add and
  the activation) becomes ``InPlaceABN`` with ``residual=identity``: ``y = act(BN(c) +
  identity)`` written over ``c``; backward inverts ``act``, subtracts the identity and
  inverts the affine step, so ``c`` is gone too. The identity is saved by reference: in a
  stride-1 block it is the block input, kept anyway as conv1's input (no extra bytes).
  The stem's BN + ReLU is fused the same way (it is not followed by an add). Held: ``b``
  and ``y``, half of ``bn``'s 4 (REFERENCES: "a residual block keeps 3 buffers instead of
  6", "up to 50% memory saved").
- Exception, the two downsampling blocks (option A): their identity is a NEW tensor (the
  subsampled input with zero channels concatenated, one copy made by ``cat``; the fused
  op keeps that tensor without copying it again), the size of the block output: 3
  there. ResNet-20 in units of one stage-1 activation ``u`` (N x 16 x 32 x 32): ``bn``
  holds 2 (stem) + 3 x 4 + 3 x 4 / 2 + 3 x 4 / 4 = 23u; ``inplace_abn`` 1 + 3 x 2 + 3 x 2 /
  2 + 3 x 2 / 4 + (1/2 + 1/4) = 12.25u, 53% (the per-block count alone would give 50%),
  plus per-channel vectors, saved weights and the head's small (N, 64) tensors in both.

Under policy ``off`` every fused site takes the out-of-place path (``leaky_relu(
batch_norm(c, weight=|w| + eps) + identity)``, models/layers.py), so ``off`` stays the
unfused reference with the same function and the same parameters.

``set_recompute(mode)`` (the config's ``recompute``) checkpoints each basic block:
``"full"`` keeps the block's input only; ``"selective"`` keeps its convolutions' outputs
too and recomputes the BatchNorms, activations and the add (torchtitan's policy,
``framework.utils.checkpoint.save_matmuls_policy``). The stem and the head are not
checkpointed.
"""

from __future__ import annotations

import functools
import inspect

import framework as fw
from framework import nn
from framework.nn import functional as F
from framework.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, save_matmuls_policy

from .layers import ABN, LEAKY_SLOPE, RECOMPUTE, check_choice, positive_int
from .registry import register_model

# A selective checkpoint of a block: its convolutions' outputs kept, the rest recomputed.
_SELECTIVE = functools.partial(create_selective_checkpoint_contexts, save_matmuls_policy)

NORMS = ("bn", "inplace_abn")
DEPTHS = (8, 14, 20, 32)  # the registered aliases; any 6n + 2 is accepted


def conv3x3(in_planes: int, out_planes: int, stride: int = 1):
    return nn.Conv2d(in_planes, out_planes, 3, stride=stride, padding=1, bias=False)


class ShortcutA(nn.Module):
    """Option-A shortcut: identity, or strided subsampling with zero-padded extra channels."""

    def __init__(self, in_planes: int, planes: int, stride: int):
        super().__init__()
        self.in_planes, self.planes, self.stride = in_planes, planes, stride

    def forward(self, x):
        if self.stride == 1 and self.in_planes == self.planes:
            return x
        s = self.stride
        sub = x[:, :, ::s, ::s]
        if self.planes == self.in_planes:
            return sub
        n, _, h, w = sub.shape
        pad = fw.zeros(n, self.planes - self.in_planes, h, w, dtype=x.dtype, device=x.device)
        return fw.cat([sub, pad], dim=1)

    def extra_repr(self) -> str:
        if self.stride == 1 and self.in_planes == self.planes:
            return "identity"
        return f"{self.in_planes} -> {self.planes}, stride={self.stride}, zero-padded channels (option A)"


def norm_act(planes: int, norm: str):
    """BN + ReLU(inplace=None), or the two fused as InPlaceABN (leaky ReLU, slope 0.01)."""
    if norm == "inplace_abn":
        return ABN(planes, negative_slope=LEAKY_SLOPE)
    return nn.Sequential(nn.BatchNorm2d(planes), nn.ReLU(inplace=None))


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN, ``out += shortcut(x)``, ReLU (inplace sites follow the policy).

    With ``norm="inplace_abn"`` the second unit is one fused site, ``abn2(conv2_out,
    residual=identity)`` = ``leaky_relu(BN(conv2_out) + identity)`` (no ``bn2``/``relu``).
    ``recompute``: ``"none"``, ``"full"`` or ``"selective"`` (see the module's docstring).
    """

    recompute = "none"

    def __init__(self, in_planes: int, planes: int, stride: int = 1, norm: str = "bn"):
        super().__init__()
        self.conv1 = conv3x3(in_planes, planes, stride)
        self.unit1 = norm_act(planes, norm)
        self.conv2 = conv3x3(planes, planes)
        self.fused = norm == "inplace_abn"
        if self.fused:
            self.abn2 = ABN(planes, negative_slope=LEAKY_SLOPE)
        else:
            self.bn2 = nn.BatchNorm2d(planes)
            self.relu = nn.ReLU(inplace=None)
        self.shortcut = ShortcutA(in_planes, planes, stride)

    def forward(self, x):
        if self.recompute == "full":
            return checkpoint(self.block, x, use_reentrant=False)
        if self.recompute == "selective":
            return checkpoint(self.block, x, use_reentrant=False, context_fn=_SELECTIVE)
        return self.block(x)

    def block(self, x):
        # Written as nested calls, so that each output reaches the next layer as a
        # temporary that policy auto can prove dead (a name like ``out = ...`` would hold it).
        if self.fused:
            # BN2 + add + activation over conv2's output; the identity is kept by reference.
            return self.abn2(self.conv2(self.unit1(self.conv1(x))), residual=self.shortcut(x))
        # The residual add is a policy site: BN2's fresh output, which neither BN nor add saves.
        return self.relu(F.residual_add(self.bn2(self.conv2(self.unit1(self.conv1(x)))), self.shortcut(x)))


@register_model("resnet")
class ResNet(nn.Module):
    """CIFAR ResNet of ``depth = 6n + 2`` layers (8, 14, 20, 32, ...), option-A shortcuts.

    Args:
        depth: 6n + 2 with n >= 1 (``resnet8/14/20/32`` fix it).
        num_classes: outputs of the linear head.
        width: channels of the first stage (16 in the paper); stages use 1x, 2x, 4x.
        in_channels: input image channels.
        norm: ``"bn"`` (BatchNorm2d + ReLU) or ``"inplace_abn"`` (the stem's and each block's
            first BN + ReLU fused as ``InPlaceABN``, leaky ReLU slope 0.01; each block's
            second BN, residual add and activation fused as ``InPlaceABN`` with
            ``residual=identity``).
    """

    def __init__(self, depth=20, num_classes=10, width=16, in_channels=3, norm="bn"):
        super().__init__()
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 8 or (depth - 2) % 6:
            raise ValueError(
                f"CIFAR ResNet depth must be 6n + 2 with n >= 1 (e.g. {', '.join(map(str, DEPTHS))}); got {depth!r}"
            )
        positive_int("num_classes", num_classes)
        positive_int("width", width)
        positive_int("in_channels", in_channels)
        check_choice("norm", norm, NORMS)
        self.depth, self.num_classes, self.width = depth, num_classes, width
        self.in_channels, self.norm = in_channels, norm
        n = (depth - 2) // 6

        self.conv1 = conv3x3(in_channels, width)
        self.unit1 = norm_act(width, norm)
        blocks = []
        in_planes = width
        for stage, planes in enumerate((width, 2 * width, 4 * width)):
            for i in range(n):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(in_planes, planes, stride, norm))
                in_planes = planes
        self.layers = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(in_planes, num_classes)
        self._init_weights()

    def set_recompute(self, mode: str) -> None:
        """``"none"``, ``"full"`` or ``"selective"``: what each basic block recomputes."""
        check_choice("recompute", mode, RECOMPUTE)
        for block in self.layers:
            block.recompute = mode

    def _init_weights(self) -> None:
        """He-normal convolutions (fan_out, as torchvision); BN weight 1, bias 0."""
        init = getattr(nn, "init", None)
        kaiming = getattr(init, "kaiming_normal_", None)
        for m in self.modules():
            if isinstance(m, nn.Conv2d) and kaiming is not None:
                kaiming(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"ResNet(in_channels={self.in_channels}) expects input of shape "
                f"(N, {self.in_channels}, H, W), got {tuple(x.shape)}"
            )
        return self.fc(self.flatten(self.pool(self.layers(self.unit1(self.conv1(x))))))


def _alias(depth: int):
    def factory(**kwargs):
        return ResNet(depth=depth, **kwargs)

    sig = inspect.signature(ResNet)
    factory.__signature__ = sig.replace(parameters=[p for p in sig.parameters.values() if p.name != "depth"])
    factory.__name__ = factory.__qualname__ = f"resnet{depth}"
    factory.__doc__ = f"ResNet-{depth} (CIFAR, option-A shortcuts): ``ResNet(depth={depth}, ...)``."
    return register_model(f"resnet{depth}")(factory)


resnet8, resnet14, resnet20, resnet32 = (_alias(d) for d in DEPTHS)
