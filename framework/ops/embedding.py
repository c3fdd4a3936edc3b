"""``embedding``: rows of a weight matrix picked by integer indices, as
``torch.nn.functional.embedding``.

Forward gathers ``weight[indices]`` (one gather); backward scatter-adds the gradient
into a zero matrix of the weight's shape (``np.add.at`` / ``cupyx.scatter_add``: repeated
indices add up; half types in float32, rounded once: :func:`framework.backend.scatter_add`).
It saves the indices (version-checked, as PyTorch does), never the weight. ``padding_idx``:
that row gets no gradient. There is no inplace form.

Indices out of range raise at once on the CPU; on a GPU, where CuPy does not check
indices, the check runs on the device and is read back with the losses' deferred target
checks (:func:`framework.ops.loss.check_targets`, called by the trainer at log points), so
a step never waits for the host. It is the losses' check (``loss.check_range``), so a
compiled step runs it at every call too.
"""

from __future__ import annotations

import numpy as np

from .. import backend, memory
from ..autograd.function import Function
from ..backend import get_array_module
from ..tensor import Tensor
from . import kernels_transformer as K
from . import loss as _loss
from .promotion import tensor_type_name
from .view import IndexAdd


class Embedding(Function):
    """``weight[indices]``; saves ``indices``."""

    saves = ("indices",)
    # PyTorch's EmbeddingBackward0 (padding_idx -1: none; only the defaults of the others)
    saved_attrs = {
        "padding_idx": lambda c: -1 if c.padding_idx is None else c.padding_idx,
        "scale_grad_by_freq": lambda c: False,
        "sparse": lambda c: False,
        "weight_sym_argsize_0": lambda c: c.wshape[0],
    }

    def forward(ctx, weight, indices, padding_idx=None):
        xp = get_array_module(weight)
        ctx.wshape, ctx.wdtype, ctx.padding_idx = weight.shape, weight.dtype, padding_idx
        return memory.track(xp.take(weight, indices, axis=0), "activations")

    def backward(ctx, g):
        indices = ctx.indices
        xp = get_array_module(g)
        if g.__class__ is not Tensor and _gathers(g, getattr(indices, "_data", indices), ctx.wshape, ctx.wdtype):
            return _gather_backward(g, getattr(indices, "_data", indices), ctx.wshape, ctx.padding_idx, xp), None
        if ctx.padding_idx is not None:  # the padding row gets no gradient
            g = xp.where(xp.expand_dims(getattr(indices, "_data", indices) == ctx.padding_idx, -1), 0, g)
        gw = memory.zeros(ctx.wshape, ctx.wdtype, get_array_module(getattr(indices, "_data", indices)), "gradients")
        index = (getattr(indices, "_data", indices),)
        if g.__class__ is Tensor:  # create_graph: the same scatter-add, as an op
            return IndexAdd.apply(gw, g, index=index), None
        backend.scatter_add(gw, index, g)
        return gw, None


# The deterministic gather kernel scans every index for every weight element: it runs where
# rows * indices stays below this (a character-level GPT: 89 rows x 1,024 indices), a
# scatter-add beyond (atomics: its sums' rounding can differ from call to call, as
# PyTorch's index_add_ on CUDA; docs/GPU.md).
GATHER_LIMIT = 1 << 24


def _gathers(g, indices, wshape, wdtype) -> bool:
    """Whether embedding's backward runs the fused gather kernel (a GPU array, dtypes it takes)."""
    if not K.embedding_backward.fits(g) or g.dtype != wdtype or indices.dtype.name not in ("int32", "int64"):
        return False
    return wshape[0] * indices.size <= GATHER_LIMIT


def _gather_backward(g, indices, wshape, padding_idx, xp):
    """The weight's gradient by one deterministic gather kernel (kernels_transformer.embedding_backward)."""
    d = wshape[1]
    g = g if g.flags.c_contiguous else memory.track(xp.ascontiguousarray(g), "workspace")
    idx = indices if indices.flags.c_contiguous else memory.track(xp.ascontiguousarray(indices), "workspace")
    gw = memory.empty(wshape, g.dtype, xp, "gradients")
    K.embedding_backward(g.reshape(-1, d), idx.reshape(-1), idx.size, d, -1 if padding_idx is None else padding_idx, gw)
    return gw


def embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False):
    """Rows ``weight[input]``: ``(*input.shape, embedding_dim)``.

    Args:
        input: int64 or int32 tensor of indices into the rows of ``weight`` (others
            raise PyTorch's RuntimeError).
        weight: ``(num_embeddings, embedding_dim)``.
        padding_idx: a row that gets no gradient (negative counts from the end).
        max_norm, norm_type, scale_grad_by_freq, sparse: PyTorch's; only their defaults
            are supported (NotImplementedError otherwise).
    """
    if not isinstance(input, Tensor) or input.dtype not in (np.int64, np.int32):  # Long, Int: PyTorch's
        got = tensor_type_name(input.dtype, input.device.type) if isinstance(input, Tensor) else type(input).__name__
        raise RuntimeError(
            f"Expected tensor for argument #1 'indices' to have one of the following scalar types: Long, Int; "
            f"but got {got} instead (while checking arguments for embedding)"
        )
    if weight.ndim != 2:
        raise RuntimeError(f"'weight' must be 2-D, got shape {tuple(weight.shape)}")
    if max_norm is not None or scale_grad_by_freq or sparse:
        raise NotImplementedError("embedding: max_norm, scale_grad_by_freq and sparse are not supported")
    if input.device != weight.device:
        raise RuntimeError(f"embedding: indices on {input.device}, weight on {weight.device}: move them to one device")
    if padding_idx is not None:
        n = weight.shape[0]
        if not -n <= padding_idx < n:
            raise AssertionError("Padding_idx must be within num_embeddings")
        padding_idx = padding_idx % n
    _loss.check_range(input, "embedding", weight.shape[0], what="Index")  # the losses' target check
    return Embedding.apply(weight, input, padding_idx=padding_idx)
