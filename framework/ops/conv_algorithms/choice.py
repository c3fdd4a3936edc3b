"""Which algorithm computes each pass of a convolution when conv2d chooses per layer.

Two choosing modes, each a table read top to bottom (first match wins); every other
name of ``framework.ops.conv.contraction`` forces one algorithm for every pass:

``"auto"`` (the default): only algorithms whose float32 rounding is that of im2col
(F(2x2, 3x3) Winograd's transforms add and subtract, nothing else)

======================================================  ===========  ===========  ===========
layers                                                  forward      weight grad  input grad
======================================================  ===========  ===========  ===========
3x3, stride 1, >= 32 input and output channels          winograd2    winograd2    winograd2
stride 1 (any kernel, any channels)                     grid         grid         grid
strided                                                 grid         grid         gemm
======================================================  ===========  ===========  ===========

``"fast"``: trades float32 precision for speed: Winograd F(4x4, 3x3) (4x fewer
multiplications; its transforms scale by up to 8 and 1/15, so its float32 results carry
3-6x the rounding of im2col: 1-2e-6 of the largest value instead of 2-6e-7)

======================================================  ===========  ===========  ===========
3x3, stride 1, >= 32 input and output channels          winograd4    winograd4    winograd4
stride 1                                                grid         grid         grid
strided                                                 grid         grid         gemm
======================================================  ===========  ===========  ===========

Why (measured on ResNet-20's layers, batch 64, float32, one thread, default workspace
limit; ``benchmarks/bench_conv.py`` prints every algorithm per layer and pass beside
PyTorch, docs/BENCHMARKS.md has the run): ``grid`` is GEMM-bound (~100 GFLOP/s on one
core with OpenBLAS). Winograd does fewer multiplications in its GEMMs but pays transforms
and layout changes per tile and channel, which grow with the channels while the saving
grows with their square: from 32 channels both beat ``grid`` (F(2x2) by ~15% at 32 and
~35% at 64 channels, F(4x4) by ~35% and ~50%); at 16 both are slower. Strided layers run
``grid`` over their input's phases (forward 1.1-2x faster than im2col ``gemm``, weight
gradient 1.05-1.15x), and the input gradient of ``gemm``: the transposed-convolution
form of ``grid`` needs stride 1.

Forward-only batches (evaluation under ``no_grad``) take the same forward column: measured
at batch 500 (configs/resnet20_cifar10.yaml's evaluation batch; ``python -m
benchmarks.bench_conv --threads 1 --clock cpu --batch 500``), the chosen algorithm is the
fastest of ``auto``'s for every ResNet-20 layer's forward, or within the rounds' spread
(the strided layers: ``grid`` and ``gemm`` within 10% either way), under every workspace
limit from 1 MiB up; no limit at all is 2-3x slower (the chunks leave the caches). So
there is no separate table for them; docs/BENCHMARKS.md has the run.

The rules are pure functions of the shapes (nothing is timed at run time), so a layer
always takes the same path and its results are reproducible. ``framework.ops.conv.explain``
shows the plan for a layer.

On a GPU (CuPy arrays) both modes take, for every layer and pass, ONE library call through
NVIDIA's cuDNN frontend (``cudnn``; ``cudnn_tf32`` under the ``tf32`` math mode), or,
where the frontend is not installed, ``im2col_gpu`` (one copy and one matmul a pass; a
warning, once, names the install): :mod:`.gpu`. The tables above are the CPU's, where
calls are cheap and caches small; a GPU pays 7-10 µs a call, so there the fewest calls
win. This function is the one place the device enters: the op, what it saves and its
inplace rules are the same on both.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import pooling as _pooling
from .gpu import frontend


class Plan(NamedTuple):
    """Algorithm names for the three passes of one convolution, and the rule that chose them."""

    forward: str
    grad_weight: str
    grad_input: str
    rule: str


def _winograd_layer(min_channels):
    def matches(g):
        return g.kernel == (3, 3) and g.stride == (1, 1) and min(g.x_shape[1], g.w_shape[0]) >= min_channels

    return matches


def _stride1(g):
    return g.stride == (1, 1)


def _any(g):
    return True


RULES = {
    "auto": (
        ("3x3, stride 1, >= 32 input and output channels", _winograd_layer(32), ("winograd2",) * 3),
        ("stride 1", _stride1, ("grid",) * 3),
        ("strided", _any, ("grid", "grid", "gemm")),
    ),
    "fast": (
        ("3x3, stride 1, >= 32 input and output channels", _winograd_layer(32), ("winograd4",) * 3),
        ("stride 1", _stride1, ("grid",) * 3),
        ("strided", _any, ("grid", "grid", "gemm")),
    ),
}
MODES = tuple(RULES)


#: conv2d's math modes (``framework.ops.conv.set_math_mode``): what float32 may round to
#: on a GPU. ``fp32``: full float32; ``tf32``: cuDNN's TF32 tensor-core engines allowed.
MATH_MODES = ("fp32", "tf32")


def plan(mode: str, geom, xp=np, math: str = "fp32") -> Plan:
    """The algorithms choosing mode ``mode`` (``"auto"`` or ``"fast"``) uses for ``geom``
    on the device of array module ``xp`` (NumPy: the CPU, the tables above; CuPy: a GPU),
    under math mode ``math`` (:data:`MATH_MODES`; the CPU computes float32 exactly either way)."""
    if xp is not np:
        if frontend() is None:
            return Plan(*("im2col_gpu",) * 3, f"{mode} on a GPU without the cuDNN frontend: im2col + matmul")
        name = "cudnn_tf32" if math == "tf32" else "cudnn"
        return Plan(*(name,) * 3, f"{mode} on a GPU: one cuDNN frontend call per pass, {math} math")
    for rule, matches, names in RULES[mode]:
        if matches(geom):
            return Plan(*names, f"{mode}: {rule}")
    raise AssertionError("the last rule matches every geometry")  # pragma: no cover


def pooling(xp) -> _pooling.Kernels:
    """The pooling kernels for the device of array module ``xp``: the CPU's (chunked by the
    workspace limit, a loop over window offsets) or the GPU's (a constant number of calls)."""
    return _pooling.CPU if xp is np else _pooling.GPU
