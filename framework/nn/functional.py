"""The functional form of every layer (``import framework.nn.functional as F``).

Signatures follow ``torch.nn.functional``. ``relu(x, inplace=False)`` and friends take
the inplace path only when asked explicitly (policy ``auto`` may still run them in place
when their input is provably dead); the policy sites are the modules
(``nn.ReLU(inplace=None)``) and :func:`residual_add`. Convolution, pooling, normalisation, dropout and losses live in
``framework.ops.{conv,norm,dropout,loss}`` and are imported when first called.
"""

from __future__ import annotations

from .. import inplace as _inplace
from .. import ops as _ops
from ..ops import attention as _attention
from ..ops import conv as _conv
from ..ops import dropout as _dropout
from ..ops import embedding as _embedding
from ..ops import gelu as _gelu
from ..ops import layer_norm as _layer_norm
from ..ops import linalg as _linalg
from ..ops import loss as _loss
from ..ops import norm as _norm
from ..tensor import Tensor

# --- linear and convolution ---------------------------------------------------------------


def linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``input @ weight.T + bias`` for inputs of shape ``(*, in_features)``.

    One op (:class:`framework.ops.linalg.Linear`), whose weight gradient comes out in the
    weight's own layout. The bias is added into the fresh product in place under the
    inplace policy (nobody else holds that product, so it is exact); under ``off`` the
    sum is a new array.
    """
    if weight.ndim != 2:
        raise RuntimeError(f"linear: weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}")
    if input.ndim == 0 or input.shape[-1] != weight.shape[1]:
        raise RuntimeError(
            f"linear: input's last dimension must be in_features={weight.shape[1]}, "
            f"got input of shape {tuple(input.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise RuntimeError(f"linear: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    return _linalg.Linear.apply(input, weight, bias, add_bias_inplace=_inplace.enabled())


def conv2d(input, weight, bias=None, stride=1, padding=0):
    """2-D convolution (cross-correlation) of ``(N, C, H, W)`` with ``(O, C, kH, kW)``."""
    return _conv.conv2d(input, weight, bias, stride=stride, padding=padding)


@_inplace.passes_ownership
def residual_add(input: Tensor, identity: Tensor, inplace: bool | None = None) -> Tensor:
    """``input + identity``, the add of a residual block: a site of the inplace policy.

    ``inplace=None`` follows the policy: ``auto`` writes the sum over ``input`` when it is
    provably dead (a BatchNorm output passed straight in, or ``out = residual_add(out,
    identity)``), ``on`` whenever autograd allows it, ``off`` never; a write consumes
    ``input``. ``True``/``False`` force a path (``True`` is ``input.add_(identity)``).
    ``add`` saves nothing for backward, so the inplace form is free.
    """
    if inplace is not None:
        return _ops.add_(input, identity) if inplace else _ops.add(input, identity)
    if _sum_fits(input, identity):
        where = _inplace.site_target(input, "residual_add")
        if where is not None:
            return _ops.add_(_inplace.consume(input, "residual_add", where), identity)
    return _ops.add(input, identity)


def _sum_fits(input: Tensor, other) -> bool:
    """``input + other`` has ``input``'s shape and dtype (so it can be written over input)."""
    if not isinstance(other, Tensor):
        return isinstance(other, (int, float)) and input.dtype.kind == "f"
    return other.dtype == input.dtype and _ops.broadcast_shapes(input.shape, other.shape) == input.shape


# --- activations ------------------------------------------------------------------------------


@_inplace.passes_ownership
def relu(input: Tensor, inplace: bool = False) -> Tensor:
    """max(x, 0); in place (on ``input``'s buffer, returning ``input``) when ``inplace``."""
    return _ops.relu_(input) if inplace else _ops.relu(input)


def relu_(input: Tensor) -> Tensor:
    return _ops.relu_(input)


@_inplace.passes_ownership
def leaky_relu(input: Tensor, negative_slope: float = 0.01, inplace: bool = False) -> Tensor:
    """x if x > 0 else negative_slope * x (the inplace form needs a slope >= 0)."""
    if inplace:
        return _ops.leaky_relu_(input, negative_slope)
    return _ops.leaky_relu(input, negative_slope)


def leaky_relu_(input: Tensor, negative_slope: float = 0.01) -> Tensor:
    return _ops.leaky_relu_(input, negative_slope)


@_inplace.passes_ownership
def sigmoid(input: Tensor) -> Tensor:
    return _ops.sigmoid(input)


@_inplace.passes_ownership
def tanh(input: Tensor) -> Tensor:
    return _ops.tanh(input)


@_inplace.passes_ownership
def softmax(input: Tensor, dim: int = -1) -> Tensor:
    return _ops.softmax(input, dim)


@_inplace.passes_ownership
def log_softmax(input: Tensor, dim: int = -1) -> Tensor:
    return _ops.log_softmax(input, dim)


def gelu(input: Tensor, approximate: str = "none") -> Tensor:
    """``input * Phi(input)``, or its tanh approximation (``approximate="tanh"``). Its
    backward reads its input, so it has no free inplace form (no site of the policy)."""
    return _gelu.gelu(input, approximate)


# --- Transformers ------------------------------------------------------------------------------


def embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False):
    """Rows of ``weight`` picked by the integer ``input``; the gradient is a scatter-add."""
    return _embedding.embedding(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, memory_efficient=False):
    """Layer normalization over the trailing ``normalized_shape`` dims.

    ``memory_efficient=True`` (Apex's ``FusedLayerNorm`` mode) keeps the output instead of
    the input for backward (which rebuilds the normalized input from it): the same numbers,
    one activation less held for backward where the output is kept anyway.
    """
    return _layer_norm.layer_norm(input, normalized_shape, weight, bias, eps, memory_efficient)


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """``softmax(query @ key^T * scale + attn_mask) @ value``, as one op that keeps no
    ``L x S`` matrix for backward (cuDNN's SDPA on a GPU where it runs)."""
    return _attention.scaled_dot_product_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
    )


@_inplace.passes_ownership
def dropout(input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    """Zeroes elements with probability ``p`` and scales the rest by ``1 / (1 - p)``."""
    return _dropout.dropout(input, p=p, training=training, inplace=inplace)


# --- pooling and shape -------------------------------------------------------------------------


def max_pool2d(input, kernel_size, stride=None, padding=0):
    return _conv.max_pool2d(input, kernel_size, stride=stride, padding=padding)


def avg_pool2d(input, kernel_size, stride=None, padding=0):
    return _conv.avg_pool2d(input, kernel_size, stride=stride, padding=padding)


def adaptive_avg_pool2d(input, output_size):
    return _conv.adaptive_avg_pool2d(input, output_size)


def flatten(input: Tensor, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    """Merges dims ``start_dim..end_dim`` (a view when the strides allow one)."""
    return _ops.flatten(input, start_dim, end_dim)


# --- normalisation -----------------------------------------------------------------------------


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    """Batch normalisation over all dims but 1; updates running stats in place when training."""
    return _norm.batch_norm(
        input, running_mean, running_var, weight, bias, training=training, momentum=momentum, eps=eps
    )


def inplace_abn(
    input,
    running_mean,
    running_var,
    weight,
    bias,
    training=False,
    momentum=0.1,
    eps=1e-5,
    negative_slope=0.01,
    residual=None,
    inplace=True,
):
    """``leaky_relu(BN(input) [+ residual])`` written over ``input`` (returned); backward inverts it.

    ``input`` must not be a leaf that requires grad (its values are overwritten);
    ``residual`` (e.g. a basic block's identity) is kept by reference, not copied.
    ``inplace=False`` computes the same function into a new tensor (same numbers).
    """
    return _norm.inplace_abn(
        input,
        running_mean,
        running_var,
        weight,
        bias,
        training=training,
        momentum=momentum,
        eps=eps,
        negative_slope=negative_slope,
        residual=residual,
        inplace=inplace,
    )


# --- losses ------------------------------------------------------------------------------------


def _no_weight(weight, fn: str) -> None:
    if weight is not None:
        raise NotImplementedError(f"{fn}: class weights are not supported")


def cross_entropy(input, target, weight=None, *, reduction: str = "mean", label_smoothing: float = 0.0):
    """Softmax cross entropy of logits ``(N, C)`` with class indices ``(N,)``."""
    _no_weight(weight, "cross_entropy")
    return _loss.cross_entropy(input, target, reduction=reduction, label_smoothing=label_smoothing)


def nll_loss(input, target, weight=None, *, reduction: str = "mean"):
    """Negative log likelihood of log-probabilities ``(N, C)`` with class indices ``(N,)``."""
    _no_weight(weight, "nll_loss")
    return _loss.nll_loss(input, target, reduction=reduction)


def mse_loss(input, target, *, reduction: str = "mean"):
    """Mean (or sum, or elementwise) squared error."""
    return _loss.mse_loss(input, target, reduction=reduction)


__all__ = [
    "linear",
    "conv2d",
    "relu",
    "relu_",
    "leaky_relu",
    "leaky_relu_",
    "sigmoid",
    "tanh",
    "softmax",
    "log_softmax",
    "gelu",
    "embedding",
    "layer_norm",
    "scaled_dot_product_attention",
    "dropout",
    "max_pool2d",
    "avg_pool2d",
    "adaptive_avg_pool2d",
    "flatten",
    "batch_norm",
    "inplace_abn",
    "cross_entropy",
    "nll_loss",
    "mse_loss",
]
