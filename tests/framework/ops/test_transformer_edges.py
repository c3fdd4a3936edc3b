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
from framework import memory
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


# --- attention with a fully masked query row ------------------------------------------------------


def _masked_rows(kind, shape, dtype=np.float64):
    """A mask of ``shape`` (L, S) whose row 1 is fully masked and row 2 half: bool (True:
    take part) or float (-inf: masked)."""
    keep = np.ones(shape, dtype=bool)
    keep[1] = False
    keep[2, ::2] = False
    return keep if kind == "bool" else np.where(keep, 0.0, -np.inf).astype(dtype)


@pytest.mark.parametrize("dropout", [0.0, 0.5], ids=["", "dropout"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_attention_of_a_fully_masked_row_is_zero_with_finite_gradients_as_torch(kind, dropout, torch, backend):
    # torch 2.13 (math and flash paths alike, on the CPU): zeros for that row, and every
    # gradient finite (the row's is zero); we had NaN, and NaN gradients for the whole head
    rng = np.random.default_rng(2)
    q, tq = _pair(torch, rng.standard_normal((2, 2, 4, 3)), backend)
    k, tk = _pair(torch, rng.standard_normal((2, 2, 5, 3)), backend)
    v, tv = _pair(torch, rng.standard_normal((2, 2, 5, 3)), backend)
    m = _masked_rows(kind, (4, 5))
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=fw.tensor(m, device=backend), dropout_p=dropout)
    ty = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=torch.tensor(m), dropout_p=dropout)
    gy = rng.standard_normal(y.shape)
    (y * fw.tensor(gy, device=backend)).sum().backward()
    (ty * torch.tensor(gy)).sum().backward()
    out = to_numpy(y)
    assert (out[:, :, 1] == 0).all() and np.isfinite(out).all()
    for ours, theirs in ((q, tq), (k, tk), (v, tv)):
        g = to_numpy(ours.grad)
        assert np.isfinite(g).all()
        if dropout == 0:  # with dropout the two draw different masks
            np.testing.assert_allclose(g, theirs.grad.numpy(), rtol=1e-10, atol=1e-12)
    assert (to_numpy(q.grad)[:, :, 1] == 0).all()
    if dropout == 0:
        np.testing.assert_allclose(out, ty.detach().numpy(), rtol=1e-10, atol=1e-12)


def test_a_fully_masked_row_of_a_float_mask_that_requires_grad_gets_a_zero_gradient(torch, backend):
    rng = np.random.default_rng(3)
    q, tq = _pair(torch, rng.standard_normal((2, 4, 3)), backend)
    m, tm = _pair(torch, _masked_rows("float", (4, 4)), backend)
    y = F.scaled_dot_product_attention(q, q, q, attn_mask=m)
    ty = torch.nn.functional.scaled_dot_product_attention(tq, tq, tq, attn_mask=tm)
    (y * y).sum().backward()
    (ty * ty).sum().backward()
    np.testing.assert_allclose(to_numpy(m.grad), tm.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(to_numpy(q.grad), tq.grad.numpy(), rtol=1e-10, atol=1e-12)
    assert (to_numpy(m.grad)[1] == 0).all()


def test_a_fully_masked_row_under_create_graph_has_finite_second_derivatives_as_torch(torch, backend):
    rng = np.random.default_rng(4)
    q, tq = _pair(torch, rng.standard_normal((1, 2, 4, 3)), backend)
    m = _masked_rows("bool", (4, 4))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    grads = []
    for x, lib, mask in ((q, fw, fw.tensor(m, device=backend)), (tq, torch, torch.tensor(m))):
        with sdpa_kernel(SDPBackend.MATH):  # torch's flash path has no second derivative
            y = lib.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=mask)
        (g,) = lib.autograd.grad((y * y).sum(), x, create_graph=True)
        (g * g).sum().backward()
        grads.append((g.detach(), x.grad))
    for ours, theirs in zip(grads[0], grads[1]):
        assert np.isfinite(to_numpy(ours)).all()
        np.testing.assert_allclose(to_numpy(ours), theirs.numpy(), rtol=1e-9, atol=1e-12)


def test_the_cpu_chunks_give_a_fully_masked_row_zeros_too(monkeypatch):
    # the chunked CPU path (a block of one sample's rows at a time) gives the same numbers
    from framework.ops import attention

    rng = np.random.default_rng(5)
    q = fw.tensor(rng.standard_normal((2, 2, 4, 3)), requires_grad=True)
    m = fw.tensor(_masked_rows("bool", (4, 5)))
    kv = fw.tensor(rng.standard_normal((2, 2, 5, 3)))
    whole = F.scaled_dot_product_attention(q, kv, kv, attn_mask=m)
    whole.sum().backward()
    gw = q.grad.numpy().copy()
    q.grad = None
    monkeypatch.setattr(attention, "CHUNK_SCORES_BYTES", 40)  # two rows a chunk
    chunked = F.scaled_dot_product_attention(q, kv, kv, attn_mask=m)
    chunked.sum().backward()
    # to rounding (a block of rows is a smaller product), the masked row exactly
    np.testing.assert_allclose(chunked.detach().numpy(), whole.detach().numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(q.grad.numpy(), gw, rtol=1e-12, atol=1e-14)
    assert (chunked.detach().numpy()[:, :, 1] == 0).all() and np.isfinite(q.grad.numpy()).all()


# --- the masks attention refuses, and its dropout probability ------------------------------------

_MASK_DTYPES = ["int64", "int32", "uint8", "int16", "float16", "float64", "bfloat16", "bool", "float32"]


@pytest.mark.parametrize("dtype", _MASK_DTYPES)
def test_attention_takes_the_mask_dtypes_torch_takes(dtype, torch):
    # bool, float32 or the query's dtype; an integer mask was added to the scores
    import ml_dtypes

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    a = np.ones((4, 4)).astype(np_dtype)
    q = np.random.default_rng(6).standard_normal((2, 3, 4, 8)).astype(np.float32)
    mask = torch.tensor(a.astype(np.float32)).to(getattr(torch, dtype))
    theirs = _raised(lambda: torch.nn.functional.scaled_dot_product_attention(*[torch.tensor(q)] * 3, attn_mask=mask))
    ours = _raised(lambda: F.scaled_dot_product_attention(*[fw.tensor(q)] * 3, attn_mask=fw.tensor(a)))
    assert ours == theirs


@pytest.mark.parametrize("case", ["1-d, 4-d inputs", "0-d, 4-d inputs", "1-d, 3-d inputs", "1-d, dropout", "1-d, grad"])
def test_attention_refuses_a_mask_of_fewer_than_2_dims_where_torch_does(case, torch):
    # torch 2.13's CPU flash check reads the mask's dim -2 (4-D inputs, no dropout, a mask
    # needing no gradient); its math path, taken otherwise, broadcasts it
    ndim = 3 if "3-d" in case else 4
    q = np.random.default_rng(7).standard_normal((2, 3, 4, 8)[4 - ndim :])
    m = np.zeros(() if case.startswith("0-d") else (4,))
    p = 0.5 if "dropout" in case else 0.0
    grad = "grad" in case
    theirs = _raised(
        lambda: torch.nn.functional.scaled_dot_product_attention(
            *[torch.tensor(q)] * 3, attn_mask=torch.tensor(m, requires_grad=grad), dropout_p=p
        )
    )
    ours = _raised(
        lambda: F.scaled_dot_product_attention(
            *[fw.tensor(q)] * 3, attn_mask=fw.tensor(m, requires_grad=grad), dropout_p=p
        )
    )
    assert ours == theirs


@pytest.mark.parametrize("p", [1.5, float("inf"), 1.0, 0.0])
def test_attention_refuses_a_dropout_probability_above_1_as_torch(p, torch):
    q = np.random.default_rng(8).standard_normal((2, 3, 4, 8))
    theirs = _raised(lambda: torch.nn.functional.scaled_dot_product_attention(*[torch.tensor(q)] * 3, dropout_p=p))
    ours = _raised(lambda: F.scaled_dot_product_attention(*[fw.tensor(q)] * 3, dropout_p=p))
    assert ours == theirs


@pytest.mark.parametrize("p", [-0.1, float("nan")])
def test_attention_refuses_a_negative_or_nan_dropout_probability(p, torch):
    # torch 2.13 refuses it for 4-D inputs (with a message about its flash kernel) and takes it
    # as no dropout on its math path; here always refused, with the range's message
    q = np.random.default_rng(8).standard_normal((2, 3, 4, 8))
    theirs = _raised(lambda: torch.nn.functional.scaled_dot_product_attention(*[torch.tensor(q)] * 3, dropout_p=p))
    assert theirs is not None and theirs[0] == "RuntimeError"
    with pytest.raises(RuntimeError, match="dropout probability has to be between 0 and 1, but got"):
        F.scaled_dot_product_attention(*[fw.tensor(q)] * 3, dropout_p=p)


# --- multinomial of weights it cannot draw from --------------------------------------------------

_WEIGHTS = {
    "zeros": [0.0, 0.0, 0.0],
    "nan": [1.0, float("nan"), 1.0],
    "inf": [1.0, float("inf"), 1.0],
    "negative": [1.0, -1.0, 1.0],
    "a row of zeros": [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]],
    "zeros before a negative": [[0.0, 0.0, 0.0], [1.0, -1.0, 1.0]],
    "nan before inf": [[1.0, 1.0, 1.0], [float("nan"), float("inf"), 1.0]],
    "inf before negative": [[float("inf"), -1.0, 1.0]],
    "fine": [[0.0, 2.0, 1.0], [1.0, 0.0, 0.0]],
}


@pytest.mark.parametrize("draws", [(1, False), (2, True), (1, True)], ids=["one", "two-replacement", "one-replacement"])
@pytest.mark.parametrize("name", list(_WEIGHTS))
def test_multinomial_refuses_what_torch_refuses(name, draws, torch, backend):
    n, replacement = draws
    w = np.asarray(_WEIGHTS[name], dtype=np.float32)
    theirs = _raised(lambda: torch.multinomial(torch.tensor(w), n, replacement=replacement))
    ours = _raised(lambda: fw.multinomial(fw.tensor(w, device=backend), n, replacement=replacement))
    assert ours == theirs


# --- masked_fill with a wider mask, embedding's index dtypes ---------------------------------------


def test_masked_fill_broadcasts_a_mask_wider_than_its_input_as_torch(torch, backend):
    # the ordinary form takes the broadcast shape (and sums the input's gradient back); the
    # inplace form cannot grow its input: PyTorch's RuntimeError
    rng = np.random.default_rng(9)
    x, tx = _pair(torch, rng.standard_normal((2, 1, 3)), backend)
    v, tv = _pair(torch, np.asarray(2.5), backend)
    m = rng.standard_normal((4, 1, 2, 3)) > 0
    y = x.masked_fill(fw.tensor(m, device=backend), v)
    ty = tx.masked_fill(torch.tensor(m), tv)
    w = rng.standard_normal(ty.shape)
    (y * fw.tensor(w, device=backend)).sum().backward()
    (ty * torch.tensor(w)).sum().backward()
    assert tuple(y.shape) == tuple(ty.shape) == (4, 2, 2, 3)
    np.testing.assert_array_equal(to_numpy(y), ty.detach().numpy())
    np.testing.assert_allclose(to_numpy(x.grad), tx.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(to_numpy(v.grad), tv.grad.numpy(), rtol=1e-12)
    a = np.zeros(3)
    wide = np.ones((2, 3), dtype=bool)
    ours = _raised(lambda: fw.tensor(a, device=backend).masked_fill_(fw.tensor(wide, device=backend), 1.0))
    assert ours == _raised(lambda: torch.tensor(a).masked_fill_(torch.tensor(wide), 1.0))


@pytest.mark.parametrize("dtype", ["uint8", "int8", "int16", "int32", "int64", "bool", "float32", "float64"])
def test_embedding_takes_the_index_dtypes_torch_takes(dtype, torch):
    w = np.random.default_rng(10).standard_normal((5, 2))
    idx = np.ones(3, dtype=dtype)
    theirs = _raised(lambda: torch.nn.functional.embedding(torch.tensor(idx), torch.tensor(w)))
    assert _raised(lambda: F.embedding(fw.tensor(idx), fw.tensor(w))) == theirs


@pytest.mark.parametrize("p", [1.5, -0.1, float("nan"), 1.0])
def test_dropout_refuses_the_probabilities_torch_refuses_with_its_exception(p, torch):
    x = np.ones(4, dtype=np.float32)
    assert _raised(lambda: F.dropout(fw.tensor(x), p)) == _raised(
        lambda: torch.nn.functional.dropout(torch.tensor(x), p)
    )
    theirs = _raised(lambda: torch.nn.Dropout(p)(torch.tensor(x)))
    t = fw.tensor(x)
    assert _raised(lambda: fw.nn.Dropout(p)(t)) == theirs
    assert t.numpy().tolist() == x.tolist()  # a refused call consumed nothing


# --- memory-efficient LayerNorm with tiny weights -------------------------------------------------


def _ln_grads(lib, x, w, b, g, **kw):
    ts = [lib.tensor(a, requires_grad=True) for a in (x, w, b)]
    y = lib.nn.functional.layer_norm(ts[0], (x.shape[-1],), ts[1], ts[2], **kw)
    y.backward(lib.tensor(g))
    return [np.asarray(t.grad.numpy(), dtype=np.float64) for t in ts], y.detach().numpy()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("tiny", [1e-6, 1e-30, 0.0])
def test_memory_efficient_layer_norm_is_right_for_tiny_weights(tiny, dtype, torch):
    # (y - bias) / weight cancels (1e-6 beside a bias of 0.1: the weight's gradient was off by
    # 0.05 in float32) or is 0 / 0; such features keep their input column, computed as the
    # standard mode computes them: bit for bit the standard mode's there, torch's to rounding
    rng = np.random.default_rng(11)
    x, g = rng.standard_normal((6, 8)).astype(dtype), rng.standard_normal((6, 8)).astype(dtype)
    w = rng.uniform(0.5, 1.5, 8).astype(dtype)
    b = rng.uniform(-0.5, 0.5, 8).astype(dtype)
    w[[1, 5]] = (tiny, -tiny)
    b[1] = 0.1
    ours, y = _ln_grads(fw, x, w, b, g, memory_efficient=True)
    standard, y_std = _ln_grads(fw, x, w, b, g)
    theirs, _ = _ln_grads(torch, x, w, b, g)
    assert y.tobytes() == y_std.tobytes()
    for name, a, s_, t in zip(("x", "weight", "bias"), ours, standard, theirs):
        assert np.isfinite(a).all(), name
        np.testing.assert_allclose(a, t, rtol=1e-4 if dtype == "float32" else 1e-10, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(a, s_, rtol=1e-5 if dtype == "float32" else 1e-12, atol=1e-6, err_msg=name)
    assert ours[1][[1, 5]].tobytes() == standard[1][[1, 5]].tobytes()  # the fallback features: exactly


def test_memory_efficient_layer_norm_keeps_an_input_column_per_untrusted_feature_only():
    from framework.ops import layer_norm as LN

    x = fw.randn(8, 64, requires_grad=True) * 1
    w, b = fw.ones(64), fw.zeros(64)
    before = memory.saved_bytes(parameters=False)
    y = F.layer_norm(x, (64,), w, b, memory_efficient=True)
    trusted = memory.saved_bytes(parameters=False) - before
    del y
    with fw.no_grad():
        w[3] = 0.0
        b[7], w[7] = 1.0, 0.05  # |b| > 16 |w|
    assert LN.untrusted_features(w.numpy(), b.numpy(), np.float32).tolist() == [3, 7]
    y = F.layer_norm(x, (64,), w, b, memory_efficient=True)
    # two input columns and each row's mean beside the output and 1/std
    assert memory.saved_bytes(parameters=False) - before == trusted + 2 * 8 * 4 + 8 * 4
    (gx,) = fw.autograd.grad(y.sum(), x, create_graph=False)
    assert np.isfinite(gx.numpy()).all()
    with pytest.raises(NotImplementedError, match="second derivative"):
        fw.autograd.grad(F.layer_norm(x, (64,), w, b, memory_efficient=True).sum(), x, create_graph=True)


@pytest.mark.gpu
def test_on_a_gpu_memory_efficient_layer_norm_refuses_an_untrusted_feature_with_nan(cupy):
    # no host read (a CUDA graph could not hold one): the rebuild of such a feature is NaN, so
    # every gradient that reads it, never a wrong number
    x = fw.randn(4, 8, device="cuda", requires_grad=True)
    w = fw.ones(8, device="cuda", requires_grad=True)
    b = fw.zeros(8, device="cuda", requires_grad=True)
    with fw.no_grad():
        w[2] = 1e-6
        b[2] = 0.1
    F.layer_norm(x, (8,), w, b, memory_efficient=True).sum().backward()
    assert np.isnan(to_numpy(w.grad)[2]) and np.isnan(to_numpy(x.grad)).all()
    assert np.isfinite(np.delete(to_numpy(w.grad), 2)).all() and np.isfinite(to_numpy(b.grad)).all()
    x.grad = w.grad = None
    with fw.no_grad():
        b[2] = 1e-5  # |b| <= 16 |w|, a normal number: rebuilt
    F.layer_norm(x, (8,), w, b, memory_efficient=True).sum().backward()
    assert np.isfinite(to_numpy(w.grad)).all() and np.isfinite(to_numpy(x.grad)).all()
