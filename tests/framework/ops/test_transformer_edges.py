"""The Transformer ops at their edges, each against PyTorch 2.13 (CPU) where it has one.

A fully masked query row of attention, an inplace op on the merged heads of attention's
output, the masks attention refuses, a memory-efficient LayerNorm with tiny weights,
``multinomial`` of weights it cannot draw from, ``masked_fill`` with a mask wider than
its input, ``embedding`` of byte indices and attention's dropout probability: what
PyTorch does, and on the gpu leg (the CuPy stand-in, or CuPy) the same.
"""

from __future__ import annotations

import numpy as np
import pytest

import framework as fw
import framework.nn.functional as F
from framework.testing import to_numpy


def _pair(torch, a, device="cpu", requires_grad=True):
    """The same float64 values as a tensor of ours (on ``device``) and one of PyTorch's."""
    ours = fw.tensor(a, device=device, requires_grad=requires_grad)
    theirs = torch.tensor(a, requires_grad=requires_grad)
    return ours, theirs


def _raised(fn) -> tuple:
    """``(exception type name, message)`` of what ``fn()`` raised, or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the tests compare what was raised
        return type(e).__name__, str(e)
    return None


# --- an inplace op on a view of a base laid out other than in C order ------------------------------


def test_an_inplace_op_on_the_merged_heads_of_attention_runs_backward_as_torch(torch):
    # attention's output is (B, H, L, E) laid out as (B, L, H, E): its merged-heads view is a
    # `view` of a transposed view; the gradient of the base is laid out as the base, so the
    # view replays on it (PyTorch's CopySlices: new_empty_strided(base.sizes(), base.strides()))
    a = np.random.default_rng(0).standard_normal((2, 3, 5, 4))
    q, tq = _pair(torch, a)
    y = F.scaled_dot_product_attention(q, q, q).transpose(1, 2).contiguous().view(2, 5, 12)
    y.add_(1)
    (y * y).sum().backward()
    ty = torch.nn.functional.scaled_dot_product_attention(tq, tq, tq).transpose(1, 2).contiguous().view(2, 5, 12)
    ty.add_(1)
    (ty * ty).sum().backward()
    np.testing.assert_allclose(q.grad.numpy(), tq.grad.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.gpu
def test_on_a_gpu_an_inplace_op_on_the_merged_heads_is_refused_by_autograd(cupy):
    # There backward reads the output (D = rowsum(dO * O), cuDNN's too), and the merged-heads
    # view writes into it (no copy: the layout is the merge's): autograd's version error,
    # naming the write, as PyTorch's CUDA kernels (whose output has this layout) give it
    q = fw.randn(2, 3, 5, 4, device="cuda", requires_grad=True)
    y = F.scaled_dot_product_attention(q, q, q).transpose(1, 2).contiguous().view(2, 5, 12)
    y.add_(1)
    with pytest.raises(RuntimeError, match="output of ScaledDotProductAttentionBackward0.* modified by add_"):
        y.sum().backward()


def test_an_inplace_op_on_a_view_of_a_transposed_base_runs_backward_as_torch(torch, backend):
    # the same for any base laid out in another order: a clone of a transposed tensor
    a = np.random.default_rng(1).standard_normal((3, 4))
    x, tx = _pair(torch, a, backend)
    for t in (x, tx):
        b = (t * 2).t().clone()  # (4, 3), laid out as (3, 4): a base, not a view
        v = b.t().view(12)
        v.exp_()
        b.sum().backward()
    np.testing.assert_allclose(to_numpy(x.grad), tx.grad.numpy(), rtol=1e-12)
    # and under create_graph: the second derivative too
    x2, tx2 = _pair(torch, a, backend)
    grads = []
    for t, lib in ((x2, fw), (tx2, torch)):
        b = (t * 2).t().clone()
        v = b.t().view(12)
        v.exp_()
        (g,) = lib.autograd.grad(b.sum(), t, create_graph=True)
        (g * g).sum().backward()
        grads.append(t.grad)
    np.testing.assert_allclose(to_numpy(grads[0]), grads[1].numpy(), rtol=1e-12)
