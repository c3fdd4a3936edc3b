"""The Transformer ops on the GPU: cuDNN's SDPA where the frontend offers it (float16 /
bfloat16, no dropout, no explicit mask), the matmul + fused-kernel path elsewhere, the
fused kernels' launch counts, half precision, the frontend stand-in's SDPA API, and the
4-D products attention needs on the capturable cuDNN matmul.

Launches are counted by the CuPy stand-in (real CuPy counts nothing: those tests skip).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import framework as fw
import framework.nn.functional as F
from framework import backend
from framework.testing import assert_close, to_numpy
from tests.conftest import requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]


@pytest.fixture
def counting():
    if backend.cupy_choice() != "standin":
        pytest.skip("launch counting needs the CuPy stand-in")
    from framework.testing.cupy_standin import counting

    return counting


def _t(shape, seed=0, dtype=np.float32, requires_grad=False):
    a = np.random.default_rng(seed).standard_normal(shape).astype(dtype)
    return fw.tensor(a, device="cuda", requires_grad=requires_grad)


def _reference_attention(q, k, v, causal):
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v, p


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_half_precision_attention_is_one_cudnn_execute_each_way(counting, dtype, causal):
    if backend.cudnn_module() is None:
        pytest.skip("needs the cuDNN frontend")
    q, k, v = (_t((2, 3, 6, 8), s, dtype, True) for s in range(3))
    with counting.count() as fwd:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert fwd.by_kind() == {"cudnn": 1}, fwd.by_site()
    host = [to_numpy(t.detach()) for t in (q, k, v)]
    want, probs = _reference_attention(*host, causal)
    tol = 2e-3 if dtype == np.float16 else 2e-2
    assert_close(to_numpy(out.detach()).astype(np.float64), want, rtol=tol, atol=tol)
    g = np.random.default_rng(9).standard_normal(out.shape)
    with counting.count() as bwd:
        grads = fw.autograd.grad(out, (q, k, v), fw.tensor(g.astype(dtype), device="cuda"))
    assert bwd.by_kind().get("cudnn") == 1 and bwd.by_kind().get("kernel", 0) == 0, bwd.by_kind()
    # float64 gradients of the same (rounded) inputs, on the CPU
    cpu = [fw.tensor(a.astype(np.float64), requires_grad=True) for a in host]
    want_grads = fw.autograd.grad(
        F.scaled_dot_product_attention(*cpu, is_causal=causal), cpu, fw.tensor(g.astype(dtype).astype(np.float64))
    )
    for got, w in zip(grads, want_grads):
        assert got.dtype == dtype
        assert_close(to_numpy(got).astype(np.float64), w.numpy(), rtol=5 * tol, atol=5 * tol)


def test_float32_attention_runs_the_fused_kernels_not_cudnn_sdpa(counting):
    """cuDNN's SDPA takes no float32: forward the scores and the output on the cuDNN matmul
    and one row kernel, backward five products and three kernels, none of them a host read.
    Each float32 product is made in float64 (framework/ops/matmul_gpu.py): its two operands
    widened (two elementwise launches) and its result rounded back (one copy)."""
    q, k, v = (_t((2, 3, 6, 8), s, requires_grad=True) for s in range(3))
    with counting.count() as fwd:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    kinds = fwd.by_kind()
    assert kinds == {"cudnn": 2, "elementwise": 2 * 2, "copy": 2, "kernel": 1}, fwd.by_site()
    assert fwd.host_syncs == 0
    g = _t(out.shape, 5)
    with counting.count() as bwd:
        fw.autograd.grad(out, (q, k, v), g)
    # the products (scores, dV, dP, dQ, dK) and the kernels (probabilities, D = rowsum(dO * O), dS)
    assert bwd.by_kind() == {"cudnn": 5, "elementwise": 2 * 5, "copy": 5, "kernel": 3}, bwd.by_site()
    assert bwd.host_syncs == 0


@pytest.mark.parametrize("why", ["head dim 12", "dropout", "bool mask"])
def test_half_precision_attention_falls_back_where_cudnn_does_not_take_it(why):
    e = 12 if why == "head dim 12" else 8
    q, k, v = (_t((1, 2, 5, e), s, np.float16, True) for s in range(3))
    kwargs = {"dropout_p": 0.2} if why == "dropout" else {}
    mask = fw.tensor(np.tril(np.ones((5, 5), bool)), device="cuda") if why == "bool mask" else None
    fw.manual_seed(0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)
    if why != "dropout":
        want, _ = _reference_attention(*(to_numpy(t.detach()) for t in (q, k, v)), why == "bool mask")
        assert_close(to_numpy(out.detach()).astype(np.float64), want, rtol=3e-3, atol=3e-3)
    grads = fw.autograd.grad(out.float().sum(), (q, k, v))
    assert all(np.isfinite(to_numpy(g).astype(np.float64)).all() for g in grads)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("me", [False, True])
def test_layer_norm_is_two_kernels_forward_three_backward(counting, affine, me):
    x = _t((4, 5, 16), requires_grad=True)
    h = x.clone()  # a non-leaf whose backward launches nothing
    w = _t((16,), 1, requires_grad=True) if affine else None
    b = _t((16,), 2, requires_grad=True) if affine else None
    with counting.count() as fwd:
        y = F.layer_norm(h, (16,), w, b, memory_efficient=me)
    assert fwd.by_kind() == {"kernel": 2} and fwd.host_syncs == 0, fwd.by_site()
    g = _t((4, 5, 16), 3)
    with counting.count() as bwd:
        y.backward(g)
    # the per-feature sums (with an affine), the per-row sums, x's gradient (which writes w's and b's)
    assert bwd.by_kind() == {"kernel": 3 if affine else 2}, bwd.by_site()
    if affine:
        assert w.grad._data.base is None and b.grad._data.base is None  # arrays of their own: adopted, no copy


def test_layer_norm_weight_gradient_alone_is_two_kernels(counting):
    w = _t((16,), 1, requires_grad=True)
    y = F.layer_norm(_t((4, 16)), (16,), w, _t((16,), 2))
    g = _t((4, 16), 3)
    with counting.count() as bwd:
        y.backward(g)
    assert bwd.by_kind() == {"kernel": 2}, bwd.by_site()


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_is_one_kernel_each_way(counting, approximate):
    h = _t((4, 5, 6), requires_grad=True).clone()
    with counting.count() as fwd:
        y = F.gelu(h, approximate=approximate)
    assert fwd.by_kind() == {"kernel": 1}
    g = _t((4, 5, 6), 1)
    with counting.count() as bwd:
        y.backward(g)
    assert bwd.by_kind() == {"kernel": 1}


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_half_precision_kernels_compute_in_float32(dtype):
    """The kernels' arithmetic runs in acc_t<T> (float for half types): LayerNorm and GELU
    in float16 / bfloat16 agree with float64 to the half type's rounding."""
    from scipy.special import erf

    x = _t((3, 32), dtype=dtype)
    w, b = _t((32,), 1, dtype), _t((32,), 2, dtype)
    xn, wn, bn = (to_numpy(t).astype(np.float64) for t in (x, w, b))
    mean = xn.mean(-1, keepdims=True)
    want = (xn - mean) / np.sqrt(xn.var(-1, keepdims=True) + 1e-5) * wn + bn
    tol = 1e-2 if dtype == np.float16 else 6e-2
    got = F.layer_norm(x, (32,), w, b)
    assert got.dtype == dtype
    assert_close(to_numpy(got).astype(np.float64), want, rtol=tol, atol=tol)
    assert_close(to_numpy(F.gelu(x)).astype(np.float64), 0.5 * xn * (1 + erf(xn / math.sqrt(2))), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_four_dim_products_go_through_the_cudnn_matmul_without_copies(counting, dtype):
    """Attention's (batch, heads, rows, columns) products on the capturable cuDNN matmul,
    a transposed operand declared by its strides, an output written into a transposed view:
    no copy, but float32's widening to float64 and rounding back (framework/ops/matmul_gpu.py)."""
    if backend.cudnn_module() is None:
        pytest.skip("needs the cuDNN frontend")
    from framework.ops.matmul_gpu import matmul

    cp = backend.cupy_module()
    qkv = cp.asarray(np.random.default_rng(0).standard_normal((2, 5, 3 * 12)).astype(dtype))
    q = qkv[..., :12].reshape(2, 5, 3, 4).transpose(0, 2, 1, 3)  # views of one buffer, as nanoGPT's
    k = qkv[..., 12:24].reshape(2, 5, 3, 4).transpose(0, 2, 1, 3)
    out = cp.empty((2, 5, 3, 5), dtype).transpose(0, 2, 1, 3)
    with counting.count() as c:
        matmul(q, cp.swapaxes(k, -1, -2), cp, out=out)
    widening = {"elementwise": 2, "copy": 1} if dtype == np.float32 else {}
    assert c.by_kind() == {"cudnn": 1, **widening}, c.by_site()
    host = to_numpy(qkv)
    hq = host[..., :12].reshape(2, 5, 3, 4).transpose(0, 2, 1, 3)
    hk = host[..., 12:24].reshape(2, 5, 3, 4).transpose(0, 2, 1, 3)
    assert_close(to_numpy(out), hq @ np.swapaxes(hk, -1, -2), rtol=1e-5, atol=1e-5)


# --- the frontend stand-in's SDPA API ---------------------------------------------------------------


@pytest.fixture
def cudnn():
    if backend.cupy_choice() != "standin":
        pytest.skip("checks the stand-in's frontend")
    from framework.testing import cudnn_standin

    return cudnn_standin


def _graph(cudnn, io):
    return cudnn.pygraph(
        io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT
    )


def test_standin_sdpa_refuses_float32_as_cudnn_does(cudnn):
    g = _graph(cudnn, cudnn.data_type.FLOAT)
    q, k, v = (g.tensor(name=n, dim=[1, 2, 4, 8], stride=[64, 32, 8, 1]) for n in "QKV")
    o, stats = g.sdpa(q=q, k=k, v=v, attn_scale=0.35, generate_stats=True)
    o.set_output(True).set_dim([1, 2, 4, 8]).set_stride([64, 32, 8, 1])
    stats.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match="float16 and bfloat16"):
        g.build([cudnn.heur_mode.A])


def test_standin_sdpa_checks_its_arguments_as_the_frontend(cudnn):
    g = _graph(cudnn, cudnn.data_type.HALF)
    q, k, v = (g.tensor(name=n, dim=[1, 2, 4, 8], stride=[64, 32, 8, 1]) for n in "QKV")
    with pytest.raises(RuntimeError, match="Exactly one of"):
        g.sdpa(q=q, k=k, v=v)
    with pytest.raises(RuntimeError, match="cannot be set at the same time"):
        g.sdpa(q=q, k=k, v=v, generate_stats=True, use_causal_mask=True, diagonal_band_right_bound=0)
    with pytest.raises(NotImplementedError, match="dropout"):
        g.sdpa(q=q, k=k, v=v, generate_stats=True, dropout=(0.1, q, q))
    o, stats = g.sdpa(q=q, k=k, v=v, is_inference=True)
    assert stats is None and o.get_dim() == [1, 2, 4, 8]
    g2 = _graph(cudnn, cudnn.data_type.HALF)
    q2, k2, v2 = (g2.tensor(name=n, dim=[1, 2, 4, 12], stride=[96, 48, 12, 1]) for n in "QKV")
    o2, _ = g2.sdpa(q=q2, k=k2, v=v2, generate_stats=False)
    o2.set_output(True).set_stride([96, 48, 12, 1])
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match="multiples of 8"):
        g2.build()


@pytest.mark.parametrize("k", [1, 2])
def test_layer_norm_saves_pytorchs_row_statistics_on_the_gpu_as_on_the_cpu(k):
    # NativeLayerNormBackward0's _saved_result1/_saved_result2 (mean and 1/std per row): the
    # GPU keeps each row's moments instead, and gives them back as the CPU's
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4, 5))
    shape = x.shape[-k:]
    nodes = []
    for device in ("cpu", "cuda"):
        t = fw.tensor(x, device=device, requires_grad=True)
        w = fw.tensor(rng.standard_normal(shape), device=device, requires_grad=True)
        nodes.append(F.layer_norm(t, shape, w, None).grad_fn)
    cpu, gpu = nodes
    assert gpu.name() == "NativeLayerNormBackward0" and gpu._saved_normalized_shape == shape
    for attr in ("_saved_result1", "_saved_result2"):
        ours, ref = to_numpy(getattr(gpu, attr)), to_numpy(getattr(cpu, attr))
        assert ours.shape == ref.shape == x.shape[: 4 - k] + (1,) * k
        assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    assert gpu._saved_bias is None
