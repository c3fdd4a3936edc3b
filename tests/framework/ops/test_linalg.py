"""matmul / ``@`` with NumPy's rules: 1-D operands, 2-D, batched with broadcasting."""

from __future__ import annotations

import operator

import ml_dtypes
import numpy as np
import pytest

import framework as fw
from framework.nn import functional as F
from framework.testing import assert_close

from . import harness
from .harness import Budget, OpSpec

MATMUL_SHAPES = [
    ((3,), (3,)),  # dot: a 0-d result
    ((2, 3), (3,)),  # matrix @ vector
    ((3,), (3, 2)),  # vector @ matrix
    ((2, 3), (3, 4)),
    ((2, 2, 3), (3,)),  # batch @ vector
    ((3,), (2, 3, 2)),  # vector @ batch
    ((2, 2, 3), (3, 2)),  # batch @ matrix: the matrix broadcasts over the batch
    ((2, 1, 2, 3), (3, 3, 2)),  # both batch dims broadcast
]


def _linear_ref(x, w, b):
    return np.matmul(x, w.T) + b


LINEAR_SHAPES = [((4,), (3, 4), (3,)), ((2, 4), (3, 4), (3,)), ((2, 5, 4), (3, 4), (3,))]

SPECS = [
    # Launches on a GPU: strided layouts cost cuBLAS a copy of the operand first, as in CuPy; a
    # float32 product (the forward's, checked in float32) three more: its operands widened to
    # float64 and its result rounded back (framework/ops/matmul_gpu.py: cuDNN's float32 is TF32).
    OpSpec("F.linear", F.linear, _linear_ref, LINEAR_SHAPES, budget=Budget(4 + 3, 13)),
    OpSpec(
        "F.linear without bias",
        lambda x, w: F.linear(x, w),
        lambda x, w: np.matmul(x, w.T),
        [(s[0], s[1]) for s in LINEAR_SHAPES],
        budget=Budget(3 + 3, 10),
    ),
    OpSpec("matmul", fw.matmul, np.matmul, MATMUL_SHAPES, budget=Budget(6 + 3, 18)),
    OpSpec("@", operator.matmul, np.matmul, MATMUL_SHAPES, budget=Budget(6 + 3, 18)),
    OpSpec("x.matmul", lambda x, y: x.matmul(y), np.matmul, [((2, 3), (3, 2))], budget=Budget(3 + 3, 10)),
]


@pytest.mark.parametrize("case", harness.cases(SPECS))
def test_forward(case, backend):
    harness.check_forward(case, backend)


@pytest.mark.parametrize("case", harness.cases(SPECS, need="grad"))
def test_backward(case, backend):
    harness.check_backward(case, backend)


@pytest.mark.parametrize("case", harness.cases(SPECS, need="grad"))
def test_double_backward(case, backend):
    harness.check_double_backward(case, backend)


def test_matmul_gradient_by_hand():
    x = fw.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    y = fw.tensor([5.0, 6.0], requires_grad=True)
    (x @ y).sum().backward()
    assert x.grad.tolist() == [[5.0, 6.0], [5.0, 6.0]]  # d/dx_ij = y_j
    assert y.grad.tolist() == [4.0, 6.0]  # column sums of x


def test_only_the_needed_gradient_is_computed():
    x = fw.randn(2, 3, requires_grad=True)
    w = fw.randn(3, 4)  # a constant: its gradient is never computed nor its input saved
    out = x @ w
    assert out.grad_fn.needs_input_grad == (True, False)
    out.sum().backward()
    assert_close(x.grad, np.tile(w.numpy().sum(1), (2, 1)))


def test_matmul_dtypes():
    assert (fw.randn(2, 3) @ fw.randn(3)).dtype == fw.float32
    assert (fw.randn(2, 3, dtype=fw.float64) @ fw.randn(3, dtype=fw.float64)).dtype == fw.float64


def test_matmul_errors():
    with pytest.raises(RuntimeError, match="at least 1D"):
        fw.tensor(2.0) @ fw.randn(2)
    with pytest.raises((ValueError, RuntimeError), match="size 2 is different from 3"):
        fw.randn(2, 3) @ fw.randn(2, 3)


def test_linear_weight_gradient_is_adopted_in_its_own_layout():
    """grad_weight = grad.T @ x comes out C-contiguous: the engine adopts it as .grad."""
    lin = fw.nn.Linear(64, 32)
    x = fw.randn(16, 64)
    lin(x).sum().backward()
    g = lin.weight.grad._data
    assert g.flags.c_contiguous and g.base is None
    assert_close(lin.weight.grad, np.ones((16, 32), np.float32).T @ x.numpy(), rtol=1e-5)


@pytest.fixture
def frontend_or_not(request, monkeypatch):
    """The GPU leg with the cuDNN frontend (its stand-in without a GPU), or without it."""
    from framework import backend as fw_backend

    if fw_backend.cupy_module() is None:
        pytest.skip("needs CuPy or its stand-in")
    if request.param == "none":
        monkeypatch.setenv(fw_backend.CUDNN_ENV, "none")
    fw_backend.forget_cudnn()
    if request.param == "frontend" and fw_backend.cudnn_module() is None:
        pytest.skip("NVIDIA's cuDNN frontend is not installed: pip install nvidia-cudnn-frontend")
    yield request.param
    fw_backend.forget_cudnn()


@pytest.mark.gpu
@pytest.mark.parametrize("frontend_or_not", ["frontend", "none"], indirect=True)
def test_gpu_matrix_products_go_through_the_cudnn_frontend_where_it_is_installed(frontend_or_not):
    """Linear's and matmul's products on a GPU: one cuDNN execution each (capturable into a
    CUDA graph), transposed operands declared by their strides; CuPy's cuBLAS without it."""
    from framework.testing import cupy_standin, to_numpy
    from framework.testing.cupy_standin import counting

    if fw.backend.cupy_module() is not cupy_standin:
        pytest.skip("counts launches with the CuPy stand-in")
    rng = np.random.default_rng(5)
    xs, ws, bs = rng.standard_normal((6, 4)), rng.standard_normal((3, 4)), rng.standard_normal(3)
    x, w, b = (fw.tensor(a.astype(np.float32)).to("cuda").requires_grad_() for a in (xs, ws, bs))
    with counting.count() as c:
        y = F.linear(x, w, b)
        y.backward(fw.ones_like(y))
    products = c.by_kind().get("cudnn", 0) if frontend_or_not == "frontend" else c.by_kind().get("matmul", 0)
    assert products == 3, c.by_kind()  # forward, grad_x, grad_w
    assert c.by_kind().get("matmul" if frontend_or_not == "frontend" else "cudnn", 0) == 0, c.by_kind()
    assert c.host_syncs == 0
    tol = dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(to_numpy(y), xs @ ws.T + bs, **tol)
    np.testing.assert_allclose(to_numpy(x.grad), np.ones((6, 3)) @ ws, **tol)
    np.testing.assert_allclose(to_numpy(w.grad), np.ones((6, 3)).T @ xs, **tol)
    a3, b3 = rng.standard_normal((2, 3, 5)), rng.standard_normal((2, 5, 4))
    with counting.count() as c:
        z = fw.matmul(fw.tensor(a3).to("cuda"), fw.tensor(b3).to("cuda"))
    assert c.by_kind().get("cudnn" if frontend_or_not == "frontend" else "matmul", 0) == 1, c.by_kind()
    np.testing.assert_allclose(to_numpy(z), a3 @ b3, rtol=1e-12, atol=1e-12)


def test_bfloat16_products_are_bfloat16_rounded_once(backend):
    """bfloat16 matrices multiply in float32 and the product is rounded once to bfloat16, as
    PyTorch's: NumPy returns float32, CuPy bfloat16 for 2-d operands and, in 14.2, nothing
    above (the framework makes those in float32 itself); gradients too."""
    from framework.testing import to_numpy

    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(3)
    a3, b3 = (rng.standard_normal(s).astype(bf16) for s in ((2, 3, 5), (2, 5, 4)))
    z2 = fw.matmul(fw.tensor(a3[0], device=backend), fw.tensor(b3[0], device=backend))
    assert z2.dtype == bf16
    np.testing.assert_array_equal(to_numpy(z2), (a3[0].astype(np.float32) @ b3[0].astype(np.float32)).astype(bf16))
    x, y = (fw.tensor(a, device=backend, requires_grad=True) for a in (a3, b3))
    z = fw.matmul(x, y)
    assert z.dtype == bf16
    want = (a3.astype(np.float32) @ b3.astype(np.float32)).astype(bf16)
    np.testing.assert_array_equal(to_numpy(z), want)
    z.backward(fw.ones_like(z))
    ones = np.ones((2, 3, 4), np.float32)
    np.testing.assert_array_equal(to_numpy(x.grad), (ones @ b3.astype(np.float32).transpose(0, 2, 1)).astype(bf16))
    np.testing.assert_array_equal(to_numpy(y.grad), (a3.astype(np.float32).transpose(0, 2, 1) @ ones).astype(bf16))


def test_float16_products_on_the_cpu_are_made_in_float32_and_rounded_once():
    """NumPy's float16 product has no BLAS; the CPU makes it in float32 and rounds once
    (the value of a float32 product of the same float16 matrices, rounded)."""
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal(s).astype(np.float16) for s in ((2, 3, 40), (2, 40, 5)))
    want = (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16)
    x, y = fw.tensor(a, requires_grad=True), fw.tensor(b, requires_grad=True)
    out = x @ y
    assert out.dtype == fw.float16
    np.testing.assert_array_equal(out.detach().numpy(), want)
    out.sum().backward()
    assert x.grad.dtype == fw.float16 and y.grad.dtype == fw.float16
