"""2-D convolution and pooling on NCHW arrays: ``conv2d``, ``max_pool2d``, ``avg_pool2d``,
``adaptive_avg_pool2d``: the ops (argument checks, what is saved for backward, which
kernel runs each pass). How the kernels compute lives in :mod:`framework.ops.conv_algorithms`.

conv2d:

* **algorithms** (the setting is called the *contraction*, :func:`contraction`):
  ``"auto"`` (the default) picks one per layer and pass by a fixed rule on the shapes
  (:mod:`.conv_algorithms.choice`; :func:`explain` shows the choice for a layer):
  Winograd F(2x2, 3x3) for 3x3 stride-1 layers with >= 32 channels, im2col over the
  padded grid (``"grid"``) for other stride-1 layers, and for strided ones ``"grid"``
  over the input's phases with im2col ``"gemm"``'s input gradient; all of them round
  like im2col. ``"fast"`` takes Winograd F(4x4, 3x3) from 32 channels
  instead: faster, with 3-6x the float32 rounding. Any one algorithm can be forced for
  every pass: the im2col contractions :data:`CONTRACTIONS` (``"batched"``, ``"gemm"``,
  ``"tensordot"``, ``"einsum"``: every geometry) or one of :data:`GRID_AND_WINOGRAD`
  (``"grid"``: every geometry, ``"winograd2"``, ``"winograd4"``: 3x3 stride 1; forcing
  one on a layer it cannot run raises a ValueError).
* **saved for backward**: ``x`` only when the weight needs a gradient, ``w`` only when the
  input does; nothing else (the bias gradient needs only the output gradient).
* **workspace**: every padding, im2col, transform and temporary buffer goes through
  :mod:`framework.memory` (category ``workspace``), so the counter sees it. The batch is
  cut into chunks of whole images, as many per chunk as fit in the **workspace limit**
  (:func:`set_workspace_limit`; ``"auto"``, the default, is half the input's bytes, at
  most 4 MiB), so the workspaces that grow with the batch are chunk-sized:
  ``workspace peak <= max(limit, one image's workspace) + W`` where ``W`` is what does
  not grow with the batch: for im2col and grid one weight-sized buffer (a transposed or
  contiguous copy of the weight, or a chunk's partial weight gradient); for Winograd
  F(m x m) ``2 (m+2)^2 / 9`` weight sizes (the transformed weight, ``(m+2)^2 / 9`` weight
  sizes, plus a weight-sized copy while it is made; in the weight gradient, the gradient
  of the transformed weight and a chunk's partial one, as large). The tests hold every
  algorithm to this bound, forward and backward; each algorithm's module lists its
  chunk-sized buffers per image. The limit in effect when conv2d is called applies to its
  backward as well (it is recorded with the node, like the algorithm).
  ``set_workspace_limit(None)`` removes the bound (the whole batch in one chunk).
* **outputs and gradients are not workspace**: the output (``activations``) and the input
  and weight gradients (``gradients``) are allocated once, at their exact shapes (no
  padded buffer stays alive behind them). Under policy ``on``, when the engine proved
  the output gradient dead and it has the input's shape, the input gradient is written
  back over it chunk by chunk instead (stride-1 layers that keep the channel count).

**on a GPU** (CuPy arrays) the choosing modes take ONE cuDNN frontend call per pass
(``pip install nvidia-cudnn-frontend``), or without it one im2col copy and one matmul per
pass (and one warning); nothing is chunked there and the workspace limit does not apply
(:mod:`.conv_algorithms.gpu`). **Math mode** (:func:`set_math_mode`): ``"fp32"`` (the
default) keeps float32 convolutions in full float32 on the GPU; ``"tf32"`` lets cuDNN use
its TF32 tensor-core engines (float32 inputs rounded to 10 mantissa bits: faster, errors of
~1e-3 of the values). The CPU computes in full float32 either way. The mode in effect when
conv2d is called applies to its backward too.

Pooling is chunked by the same limit where it needs workspace that grows with the batch
(:mod:`.conv_algorithms.pooling`); on a GPU it is not chunked, and makes a constant number
of calls (the windows in one copy or reduction, the backward in one scatter-add). Max
pooling saves the argmax of each window as a window offset in the smallest unsigned dtype
that holds ``kh*kw`` offsets (one byte per output, instead of the input): a private array,
so an inplace op on the pooled input after the pool (a later ``relu_``) costs nothing and
cannot break its backward.
"""

from __future__ import annotations

import contextlib

import numpy as np

from .. import inplace as _inplace
from ..autograd import higher
from ..autograd.function import Function
from ..backend import get_array_module, parse_device, xp_for
from ..tensor import Tensor
from .conv_algorithms import ALGORITHMS, ConvGeometry
from .conv_algorithms import choice as _choice
from .conv_algorithms import pooling as _pooling
from .conv_algorithms.workspace import (  # noqa: F401  (the settings' home is conv2d's API)
    AUTO_WORKSPACE_CAP,
    DEFAULT_WORKSPACE_LIMIT,
    get_workspace_limit,
    set_workspace_limit,
    workspace_limit,
)
from .conv_algorithms.workspace import chunks as _chunks  # noqa: F401  (tests read it)
from .conv_algorithms.workspace import resolve_limit as _resolve_limit
from .elementwise import MaskedGrad
from .promotion import half_on_cpu, is_floating, narrow, widen
from .view import IndexAdd

#: The im2col contractions: every geometry (stride, padding, kernel).
CONTRACTIONS = ("batched", "gemm", "tensordot", "einsum")
#: The algorithms beyond im2col: grid (every geometry; strided layers over the input's
#: phases, with im2col's input gradient) and Winograd (3x3 stride 1 only).
GRID_AND_WINOGRAD = ("grid", "winograd2", "winograd4")
#: Modes that choose an algorithm per layer and pass (:mod:`.conv_algorithms.choice`).
CHOOSING = _choice.MODES  # ("auto", "fast")
AUTO = "auto"
_default = [AUTO]
#: conv2d's math modes: ``"fp32"`` (the default) and ``"tf32"`` (TF32 tensor cores on a GPU).
MATH_MODES = _choice.MATH_MODES
_math = ["fp32"]


def get_math_mode() -> str:
    """conv2d's math mode now: ``"fp32"`` or ``"tf32"`` (see the module's docstring)."""
    return _math[-1]


def set_math_mode(name: str) -> None:
    """Makes ``name`` (``"fp32"`` or ``"tf32"``) conv2d's math mode."""
    _math[0] = _check_math(name)


@contextlib.contextmanager
def math_mode(name: str):
    """``with math_mode("tf32"): ...``: conv2d calls inside use that math mode."""
    _math.append(_check_math(name))
    try:
        yield
    finally:
        _math.pop()


def _check_math(name):
    if name not in MATH_MODES:
        raise ValueError(f"unknown conv2d math mode {name!r}; use one of {', '.join(MATH_MODES)}")
    return name


def get_contraction() -> str:
    """The algorithm conv2d uses now: a choosing mode (:data:`CHOOSING`) or one of
    :data:`CONTRACTIONS` and :data:`GRID_AND_WINOGRAD`."""
    return _default[-1]


def set_contraction(name: str) -> None:
    """Makes ``name`` the algorithm conv2d uses (``"auto"``, ``"fast"``: chosen per layer)."""
    _default[0] = _check_contraction(name)


@contextlib.contextmanager
def contraction(name: str):
    """``with contraction("gemm"): ...``: conv2d calls inside use that algorithm."""
    _default.append(_check_contraction(name))
    try:
        yield
    finally:
        _default.pop()


def _check_contraction(name):
    if name not in CHOOSING + CONTRACTIONS + GRID_AND_WINOGRAD:
        names = ", ".join(CHOOSING + CONTRACTIONS + GRID_AND_WINOGRAD)
        raise ValueError(f"unknown conv2d contraction {name!r}; use one of {names}")
    return name


def _plan(name, geom, xp=np, math="fp32") -> _choice.Plan:
    """The algorithms of the three passes: a choosing mode's rule (for the device of ``xp``
    and math mode ``math``), else ``name`` forced."""
    if name in CHOOSING:
        return _choice.plan(name, geom, xp, math)
    reason = ALGORITHMS[name].unsupported(geom)
    if reason is not None:
        raise ValueError(f"conv2d: contraction {name!r} {reason}; use 'auto' or one of {', '.join(CONTRACTIONS)}")
    return _choice.Plan(name, name, name, f"forced: contraction({name!r})")


def explain(input_shape, weight_shape, stride=1, padding=0, name=None, device="cpu") -> _choice.Plan:  # noqa: A002
    """Which algorithm each pass of ``conv2d`` would use for these shapes, and why.

    ``name`` (a choosing mode or an algorithm) defaults to the current setting; ``device``
    (``"cpu"`` or ``"cuda"``) is where the arrays would live; the math mode is the current one. Returns a
    :class:`~.conv_algorithms.choice.Plan` ``(forward, grad_weight, grad_input, rule)``,
    e.g. for ResNet-20's 64-channel layers ``explain((64, 64, 8, 8), (64, 64, 3, 3), 1,
    1).forward == "winograd2"``.
    """
    stride = _pair(stride, "stride", "conv2d", 1)
    padding = _pair(padding, "padding", "conv2d", 0)
    out_hw = _out_size("conv2d", tuple(input_shape[2:]), tuple(weight_shape[2:]), stride, padding)
    geom = ConvGeometry(tuple(input_shape), tuple(weight_shape), stride, padding, out_hw)
    xp = xp_for(parse_device(device))
    return _plan(_check_contraction(name or get_contraction()), geom, xp, get_math_mode())


# --- argument and geometry helpers ------------------------------------------------------


def _pair(value, name: str, fn: str, minimum: int) -> tuple[int, int]:
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{fn}: {name} must be an int or a pair of ints, got {value!r}")
        pair = tuple(value)
    else:
        pair = (value, value)
    for v in pair:
        if isinstance(v, bool) or not isinstance(v, int) and not hasattr(v, "__index__"):
            raise TypeError(f"{fn}: {name} must be an int or a pair of ints, got {value!r}")
    pair = (int(pair[0]), int(pair[1]))
    if min(pair) < minimum:
        raise ValueError(f"{fn}: {name} must be >= {minimum}, got {value!r}")
    return pair


def _out_size(fn, hw, kernel, stride, padding):
    """Output (Ho, Wo); raises when the kernel does not fit in the padded input."""
    ph, pw = hw[0] + 2 * padding[0], hw[1] + 2 * padding[1]
    if kernel[0] > ph or kernel[1] > pw:
        raise RuntimeError(
            f"{fn}: calculated padded input size per channel: ({ph} x {pw}). Kernel size: "
            f"({kernel[0]} x {kernel[1]}). Kernel size can't be greater than actual input size; "
            "use a smaller kernel, more padding, or a larger input"
        )
    return (ph - kernel[0]) // stride[0] + 1, (pw - kernel[1]) // stride[1] + 1


def _check_4d(fn, x, what="input"):
    if x.ndim != 4:
        raise RuntimeError(f"{fn}: expected a 4-D {what} (N, C, H, W), got shape {tuple(x.shape)}")


class Conv2d(Function):
    """2-D cross-correlation (PyTorch's conv2d) of NCHW ``x`` with ``w`` (Co, C, kh, kw)."""

    node_name = "ConvolutionBackward0"

    saves = ("x", "w")
    saved_when = {"x": (1,), "w": (0,)}  # x only for w's gradient, w only for x's
    saved_as = {"x": "input", "w": "weight"}  # PyTorch's ConvolutionBackward0
    saved_attrs = {
        "bias_sym_sizes_opt": lambda c: (c.geom.w_shape[0],) if c.has_bias else (0,),
        "stride": lambda c: c.geom.stride,
        "padding": lambda c: c.geom.padding,
        "dilation": lambda c: (1, 1),
        "transposed": lambda c: False,
        "output_padding": lambda c: (0, 0),
        "groups": lambda c: 1,
    }

    def forward(ctx, x, w, b=None, stride=(1, 1), padding=(0, 0), contraction=AUTO, limit=None, math="fp32"):
        fn = "conv2d"
        _check_4d(fn, x)
        if w.ndim != 4:
            raise RuntimeError(f"{fn}: expected a 4-D weight (C_out, C_in, kh, kw), got shape {tuple(w.shape)}")
        if x.shape[1] != w.shape[1]:
            raise RuntimeError(
                f"{fn}: input has {x.shape[1]} channels (shape {tuple(x.shape)}) but the weight "
                f"{tuple(w.shape)} expects {w.shape[1]} input channels; check C_in of the layer"
            )
        if x.dtype != w.dtype or not is_floating(x.dtype):
            raise TypeError(f"{fn}: input ({x.dtype}) and weight ({w.dtype}) must have the same floating dtype")
        if b is not None and (b.shape != (w.shape[0],) or b.dtype != w.dtype):
            raise RuntimeError(
                f"{fn}: bias must be a {w.dtype} vector of shape ({w.shape[0]},), got {b.dtype} {tuple(b.shape)}"
            )
        xp = get_array_module(x)
        out_hw = _out_size(fn, x.shape[2:], w.shape[2:], stride, padding)
        geom = ConvGeometry(tuple(x.shape), tuple(w.shape), tuple(stride), tuple(padding), out_hw)
        ctx.geom, ctx.limit, ctx.modes = geom, limit, (contraction, math)
        ctx.has_bias = b is not None
        ctx.plan = plan = _plan(contraction, geom, xp, math)
        half = half_on_cpu(x.dtype, xp)
        if half is not None:
            x, w, b = widen(x), widen(w), widen(b)
        out = ALGORITHMS[plan.forward].forward(x, w, geom, limit, xp)
        if b is not None:
            out += b.reshape(1, -1, 1, 1)
        return out if half is None else narrow(out, half, "activations")

    def backward(ctx, g):
        xp = get_array_module(g)
        geom, limit, plan = ctx.geom, ctx.limit, ctx.plan
        need_x, need_w, need_b = ctx.needs_input_grad
        gx = gw = gb = None
        if g.__class__ is Tensor:  # create_graph: the two passes as ops, differentiable
            gb = g.sum(axis=(0, 2, 3)) if need_b else None
            conv = (geom, limit, plan, ctx.modes)
            gw = _grad_weight(ctx.x, g, conv) if need_w else None
            gx = _grad_input(g, ctx.w, conv) if need_x else None
            return gx, gw, gb
        half = half_on_cpu(g.dtype, xp)
        if half is not None:  # computed in float32 (see half_on_cpu), each gradient rounded once
            g32 = widen(g)
            gb = narrow(g32.sum(axis=(0, 2, 3)), half, "gradients") if need_b else None
            if need_w:
                gw = narrow(ALGORITHMS[plan.grad_weight].grad_weight(widen(ctx.x), g32, geom, limit, xp), half)
            if need_x:
                gx = ALGORITHMS[plan.grad_input].grad_input(g32, widen(ctx.w), geom, limit, xp, False)
                gx = narrow(gx, half)
            return gx, gw, gb
        if need_b:
            gb = g.sum(axis=(0, 2, 3))
        if need_w:
            gw = ALGORITHMS[plan.grad_weight].grad_weight(ctx.x, g, geom, limit, xp)
        if need_x:
            # A policy site: under 'on', when the engine proved g dead and g has the input's
            # shape (stride-1 convs that keep the channel count: most of a ResNet), each
            # image's input gradient depends only on that image's output gradient, so it is
            # built chunk by chunk and written back over the chunk of g it came from (the
            # weight and bias gradients are done by then): no second activation-sized
            # gradient exists at this step's peak.
            overwrite = ctx.reuse_grad and g.shape == geom.x_shape and g.flags.c_contiguous
            if overwrite:
                _inplace.count_owned("backward_grad", g.nbytes)
            gx = ALGORITHMS[plan.grad_input].grad_input(g, ctx.w, geom, limit, xp, overwrite)
        return gx, gw, gb


# The three passes of conv2d, each written once (the algorithms' kernels) and run on
# arrays, or on tensors as ops (create_graph): ``conv`` is (geometry, limit, plan, modes)
# of the conv2d call they belong to.


def _conv(x, w, conv):
    """conv2d of ``x`` and ``w`` (no bias) in the geometry and modes of ``conv``."""
    geom, limit, plan, (contraction, math) = conv
    if x.__class__ is Tensor or w.__class__ is Tensor:
        return Conv2d.apply(
            x, w, None, stride=geom.stride, padding=geom.padding, contraction=contraction, limit=limit, math=math
        )
    return ALGORITHMS[plan.forward].forward(x, w, geom, limit, get_array_module(x))


def _grad_input(g, w, conv):
    if g.__class__ is Tensor or w.__class__ is Tensor:
        return Conv2dGradInput.apply(g, w, conv=conv)
    geom, limit, plan, _ = conv
    return ALGORITHMS[plan.grad_input].grad_input(g, w, geom, limit, get_array_module(g), False)


def _grad_weight(x, g, conv):
    if x.__class__ is Tensor or g.__class__ is Tensor:
        return Conv2dGradWeight.apply(x, g, conv=conv)
    geom, limit, plan, _ = conv
    return ALGORITHMS[plan.grad_weight].grad_weight(x, g, geom, limit, get_array_module(x))


class Conv2dGradInput(Function):
    """conv2d's input gradient as an op (a transposed convolution of ``g`` by ``w``), for
    backward under create_graph. It is bilinear; its backward is conv2d of the incoming
    gradient with ``w`` (for ``g``) and conv2d's weight gradient (for ``w``)."""

    node_name = "ConvolutionBackwardBackward0"  # parts of PyTorch's one double-backward node

    saves = ("g", "w")
    saved_when = {"g": (1,), "w": (0,)}

    def forward(ctx, g, w, conv=None):
        ctx.conv = conv
        return _grad_input(g, w, conv)

    def backward(ctx, h):
        need_g, need_w = ctx.needs_input_grad
        gg = _conv(h, ctx.w, ctx.conv) if need_g else None
        gw = _grad_weight(h, ctx.g, ctx.conv) if need_w else None
        return gg, gw


class Conv2dGradWeight(Function):
    """conv2d's weight gradient as an op (the correlation of ``x`` with ``g``), for
    backward under create_graph. Bilinear; its backward is conv2d's input gradient (for
    ``x``) and conv2d of ``x`` with the incoming gradient (for ``g``)."""

    node_name = "ConvolutionBackwardBackward0"  # parts of PyTorch's one double-backward node

    saves = ("x", "g")
    saved_when = {"x": (1,), "g": (0,)}

    def forward(ctx, x, g, conv=None):
        ctx.conv = conv
        return _grad_weight(x, g, conv)

    def backward(ctx, h):
        need_x, need_g = ctx.needs_input_grad
        gx = _grad_input(ctx.g, h, ctx.conv) if need_x else None
        gg = _conv(ctx.x, h, ctx.conv) if need_g else None
        return gx, gg


def conv2d(input, weight, bias=None, stride=1, padding=0):  # noqa: A002  (PyTorch's names)
    """2-D convolution (cross-correlation, as PyTorch's ``conv2d``) over NCHW input.

    Args:
        input: ``(N, C_in, H, W)`` float tensor.
        weight: ``(C_out, C_in, kh, kw)`` tensor of the same dtype.
        bias: optional ``(C_out,)`` tensor.
        stride: int or (sh, sw), >= 1.
        padding: int or (ph, pw) zeros on each side, >= 0.

    Returns:
        ``(N, C_out, Ho, Wo)`` with ``Ho = (H + 2 ph - kh) // sh + 1`` (same for W).

    The batch is processed in chunks that keep the workspace within
    :func:`get_workspace_limit` (forward and this call's backward).
    """
    stride = _pair(stride, "stride", "conv2d", 1)
    padding = _pair(padding, "padding", "conv2d", 0)
    return Conv2d.apply(
        input,
        weight,
        bias,
        stride=stride,
        padding=padding,
        contraction=get_contraction(),
        limit=_resolve_limit(get_workspace_limit(), input),
        math=get_math_mode(),
    )


# --- pooling ----------------------------------------------------------------------------------


def _pool_args(fn, kernel_size, stride, padding):
    kernel = _pair(kernel_size, "kernel_size", fn, 1)
    stride = kernel if stride is None or stride == () or stride == [] else _pair(stride, "stride", fn, 1)
    padding = _pair(padding, "padding", fn, 0)
    if padding[0] > kernel[0] // 2 or padding[1] > kernel[1] // 2:
        raise ValueError(
            f"{fn}: pad should be at most half of kernel size, but got pad={padding} and kernel_size={kernel}"
        )
    return kernel, stride, padding


class MaxPool2d(Function):
    """Max over each window; saves the window offset of each max (one byte per output)."""

    node_name = "MaxPool2DWithIndicesBackward0"

    def forward(ctx, x, kernel=(2, 2), stride=(2, 2), padding=(0, 0), limit=None):
        _check_4d("max_pool2d", x)
        out_hw = _out_size("max_pool2d", x.shape[2:], kernel, stride, padding)
        ctx.geom = (x.shape, kernel, stride, padding, out_hw, limit)
        track_index = any(ctx.needs_input_grad)
        xp = get_array_module(x)
        out, idx = _choice.pooling(xp).max_pool_forward(x, kernel, stride, padding, out_hw, limit, track_index, xp)
        if track_index:
            ctx.keep(indices=idx)
        return out

    def backward(ctx, g):
        x_shape, kernel, stride, padding, out_hw, limit = ctx.geom
        if g.__class__ is Tensor:
            # create_graph: the same routing as a scatter-add op (IndexAdd), whose
            # backward reads each output's gradient back from its max's position
            # the scatter, onto zeros with an edge to x that carries the zero
            # derivative of the max's position (PyTorch's max_pool2d double backward)
            x = higher.input_edge(ctx, 0, x_shape, g.dtype, get_array_module(g._data))
            return _max_pool_scatter(g, ctx.indices._data, ctx.geom, x)
        xp = get_array_module(g)
        kernels = _choice.pooling(xp)
        return kernels.max_pool_backward(g, ctx.indices, x_shape, kernel, stride, padding, out_hw, limit, xp)


def _max_pool_scatter(g, idx, geom, x=None):
    """``g`` (a tensor) added at the input position of each window's max, as an op; onto
    zeros that, given the input ``x`` (a tensor), carry an edge to it (of derivative zero)."""
    x_shape, kernel, stride, padding, out_hw, _ = geom
    n, c, h, w = x_shape
    xp = get_array_module(idx)
    k = idx.astype(np.int64)
    rows = xp.arange(out_hw[0]).reshape(-1, 1) * stride[0] + k // kernel[1] - padding[0]
    cols = xp.arange(out_hw[1]).reshape(1, -1) * stride[1] + k % kernel[1] - padding[1]
    flat = (rows * w + cols).reshape(n * c, -1)
    planes = xp.arange(n * c).reshape(-1, 1)
    zeros = Tensor._from_array(xp.zeros((n * c, h * w), dtype=g.dtype))
    if x is not None:
        zeros = MaskedGrad.apply(zeros.reshape(x_shape), x, mask=0).reshape(n * c, h * w)
    return IndexAdd.apply(zeros, g.reshape(n * c, -1), index=(planes, flat)).reshape(x_shape)


class AvgPool2d(Function):
    """Mean over each window, padding zeros included in the count (PyTorch's default)."""

    node_name = "AvgPool2DBackward0"

    def forward(ctx, x, kernel=(2, 2), stride=(2, 2), padding=(0, 0), limit=None):
        fn = "avg_pool2d"
        _check_4d(fn, x)
        if not is_floating(x.dtype):
            raise TypeError(f"{fn}: expected a floating input, got {x.dtype}")
        out_hw = _out_size(fn, x.shape[2:], kernel, stride, padding)
        ctx.geom, ctx.limit = (x.shape, kernel, stride, padding, out_hw), limit
        xp = get_array_module(x)
        half = half_on_cpu(x.dtype, xp)  # each window's sum in float32 on the CPU, rounded once
        out = _choice.pooling(xp).avg_pool_forward(
            x if half is None else widen(x), kernel, stride, padding, out_hw, limit, xp
        )
        return out if half is None else narrow(out, half, "activations")

    def backward(ctx, g):
        if g.__class__ is Tensor:  # create_graph: the same pass as an op
            return AvgPool2dGrad.apply(g, geom=ctx.geom, limit=ctx.limit)
        x_shape, kernel, stride, padding, out_hw = ctx.geom
        xp = get_array_module(g)
        half = half_on_cpu(g.dtype, xp)
        gx = _choice.pooling(xp).avg_pool_backward(
            g if half is None else widen(g), x_shape, kernel, stride, padding, out_hw, xp
        )
        return gx if half is None else narrow(gx, half)


class AvgPool2dGrad(Function):
    """avg_pool2d's backward as an op (each output's gradient spread evenly over its
    window), for create_graph. It is linear, and its backward is avg_pool2d itself."""

    node_name = "AvgPool2DBackwardBackward0"

    def forward(ctx, g, geom=None, limit=None):
        ctx.geom, ctx.limit = geom, limit
        x_shape, kernel, stride, padding, out_hw = geom
        xp = get_array_module(g)
        return _choice.pooling(xp).avg_pool_backward(g, x_shape, kernel, stride, padding, out_hw, xp)

    def backward(ctx, h):
        _, kernel, stride, padding, out_hw = ctx.geom
        if h.__class__ is Tensor:
            return AvgPool2d.apply(h, kernel=kernel, stride=stride, padding=padding, limit=ctx.limit)
        xp = get_array_module(h)
        return _choice.pooling(xp).avg_pool_forward(h, kernel, stride, padding, out_hw, ctx.limit, xp)


class AdaptiveAvgPool2dSeparable(Function):
    """Adaptive mean pooling for any sizes: ``Ph @ x @ Pw.T`` (bins overlap when sizes do not divide)."""

    node_name = "AdaptiveAvgPool2DBackward0"

    def forward(ctx, x, output_size=(1, 1)):
        xp = get_array_module(x)
        ph = _pooling.adaptive_matrix(xp, x.shape[2], output_size[0], x.dtype)
        pw = _pooling.adaptive_matrix(xp, x.shape[3], output_size[1], x.dtype)
        ctx.ph, ctx.pw = ph, pw  # tiny (out x in) matrices, not inputs: plain attributes
        rows = xp.matmul(ph, x)  # (N, C, oh, W)
        return xp.matmul(rows, pw.T)

    def backward(ctx, g):
        xp = get_array_module(g)
        return xp.matmul(xp.matmul(ctx.ph.T, g), ctx.pw)


def max_pool2d(input, kernel_size, stride=None, padding=0):  # noqa: A002
    """Max pooling over NCHW input (PyTorch's ``max_pool2d``, ``ceil_mode=False``).

    Args:
        input: ``(N, C, H, W)`` tensor.
        kernel_size: int or (kh, kw).
        stride: int or pair; defaults to ``kernel_size``.
        padding: int or pair of implicit ``-inf`` padding, at most half the kernel.

    Backward routes each output's gradient to the first maximum of its window (NaN counts
    as the maximum). Saves one small index per output, not the input.
    """
    kernel, stride, padding = _pool_args("max_pool2d", kernel_size, stride, padding)
    return MaxPool2d.apply(
        input, kernel=kernel, stride=stride, padding=padding, limit=_resolve_limit(get_workspace_limit(), input)
    )


def avg_pool2d(input, kernel_size, stride=None, padding=0):  # noqa: A002
    """Average pooling over NCHW input (PyTorch's ``avg_pool2d``: ``count_include_pad=True``).

    Args:
        input: ``(N, C, H, W)`` float tensor.
        kernel_size: int or (kh, kw).
        stride: int or pair; defaults to ``kernel_size``.
        padding: int or pair of implicit zero padding, at most half the kernel; the zeros
            count in each window's mean.
    """
    kernel, stride, padding = _pool_args("avg_pool2d", kernel_size, stride, padding)
    return AvgPool2d.apply(
        input, kernel=kernel, stride=stride, padding=padding, limit=_resolve_limit(get_workspace_limit(), input)
    )


def adaptive_avg_pool2d(input, output_size):  # noqa: A002
    """Averages NCHW input down to ``output_size`` (int, or (oh, ow) where None keeps that size).

    When the input size is a multiple of the output size this is ``avg_pool2d`` with
    kernel = stride = H // oh (W likewise); otherwise each output averages PyTorch's bin
    ``[floor(i H / oh), ceil((i + 1) H / oh))``, computed as two small matrix products.
    """
    fn = "adaptive_avg_pool2d"
    _check_4d(fn, input)
    if isinstance(output_size, (tuple, list)):
        if len(output_size) != 2:
            raise ValueError(f"{fn}: output_size must be an int or a pair, got {output_size!r}")
        size = tuple(input.shape[2 + k] if s is None else s for k, s in enumerate(output_size))
    else:
        size = (output_size, output_size)
    size = _pair(size, "output_size", fn, 1)
    h, w = input.shape[2:]
    if h == 0 or w == 0:
        raise RuntimeError(f"{fn}: input of shape {tuple(input.shape)} has an empty spatial dimension")
    if h % size[0] == 0 and w % size[1] == 0:
        kernel = (h // size[0], w // size[1])
        return AvgPool2d.apply(
            input, kernel=kernel, stride=kernel, padding=(0, 0), limit=_resolve_limit(get_workspace_limit(), input)
        )
    if not is_floating(input.dtype):
        raise TypeError(f"{fn}: expected a floating input, got {input.dtype}")
    return AdaptiveAvgPool2dSeparable.apply(input, output_size=size)
