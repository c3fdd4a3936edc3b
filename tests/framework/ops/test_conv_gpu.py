"""conv2d on the GPU leg: one cuDNN frontend call per pass (the frontend's stand-in where
there is no GPU), or without the frontend one im2col copy and one matmul per pass.

Values against a float64 reference and finite differences on ResNet-20's geometries,
plans cached per geometry, the workspace counted, full float32 unless TF32 is chosen,
the fallback's one warning, and what each pass costs in calls: a constant, whatever the
batch and the kernel size."""

import os
import sys
import warnings

import numpy as np
import pytest

import framework as fw
from framework import backend as fw_backend
from framework import memory
from framework.ops import conv as C
from framework.ops.conv import conv2d
from framework.ops.conv_algorithms import ConvGeometry, gpu
from framework.testing import cupy_standin, gradcheck, to_numpy

pytestmark = pytest.mark.gpu

# ResNet-20's convolutions, small: 3x3 stride 1 and 2 with padding, 1x1 stride 2 shortcuts
# (unpadded), and an uneven kernel, stride and padding
GEOMETRIES = [
    ((2, 4, 8, 8), (4, 4, 3, 3), (1, 1), (1, 1)),
    ((2, 4, 8, 8), (6, 4, 3, 3), (2, 2), (1, 1)),
    ((2, 4, 8, 8), (6, 4, 1, 1), (2, 2), (0, 0)),
    ((2, 2, 5, 4), (3, 2, 3, 2), (2, 1), (1, 0)),
    ((1, 3, 4, 7), (2, 3, 1, 3), (3, 2), (0, 1)),
]
IDS = ["3x3-s1-p1", "3x3-s2-p1", "1x1-s2", "3x2-s21-p10", "1x3-s32-p01"]


@pytest.fixture(params=["cudnn", "im2col_gpu"])
def gpu_algorithm(request, monkeypatch):
    """The GPU's algorithm under test: the cuDNN frontend's (stand-in's), or the fallback
    of a machine without the frontend (its one warning silenced here, tested below)."""
    if fw_backend.cupy_module() is None:
        pytest.skip("needs CuPy or its stand-in")
    if request.param == "im2col_gpu":
        monkeypatch.setenv(fw_backend.CUDNN_ENV, "none")
        monkeypatch.setattr(gpu, "_warned", [True])
    fw_backend.forget_cudnn()
    if request.param == "cudnn" and fw_backend.cudnn_module() is None:
        pytest.skip("NVIDIA's cuDNN frontend is not installed: pip install nvidia-cudnn-frontend")
    yield request.param
    fw_backend.forget_cudnn()


@pytest.fixture
def cudnn_frontend():
    """The cuDNN frontend (its stand-in without a GPU)."""
    if fw_backend.cupy_module() is None:
        pytest.skip("needs CuPy or its stand-in")
    fw_backend.forget_cudnn()
    if fw_backend.cudnn_module() is None:
        pytest.skip("NVIDIA's cuDNN frontend is not installed: pip install nvidia-cudnn-frontend")
    yield
    fw_backend.forget_cudnn()


def _on_standin() -> bool:
    """Whether the cuDNN frontend here is the stand-in (its heuristics are known: documented there)."""
    return fw_backend.cudnn_module().__name__.endswith("cudnn_standin")


@pytest.fixture
def no_frontend(monkeypatch):
    """A machine without the cuDNN frontend, its warning not yet given in this process."""
    if fw_backend.cupy_module() is None:
        pytest.skip("needs CuPy or its stand-in")
    monkeypatch.setenv(fw_backend.CUDNN_ENV, "none")
    monkeypatch.setattr(gpu, "_warned", [False])
    fw_backend.forget_cudnn()
    yield
    fw_backend.forget_cudnn()


def ref_conv2d(x, w, stride, padding):
    """float64 cross-correlation, one output element at a time."""
    (sh, sw), (ph, pw) = stride, padding
    xp_ = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    n, _, hp, wp = xp_.shape
    co, _, kh, kw = w.shape
    out = np.zeros((n, co, (hp - kh) // sh + 1, (wp - kw) // sw + 1))
    for r in range(out.shape[2]):
        for c in range(out.shape[3]):
            window = xp_[:, :, r * sh : r * sh + kh, c * sw : c * sw + kw]
            out[:, :, r, c] = np.einsum("ncij,ocij->no", window, w)
    return out


def _rand(shape, seed, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _cuda(a, requires_grad=False):
    return fw.tensor(a, dtype=a.dtype, device="cuda", requires_grad=requires_grad)


@pytest.mark.parametrize("xs,ws,stride,padding", GEOMETRIES, ids=IDS)
def test_gpu_conv_matches_the_float64_reference_and_finite_differences(gpu_algorithm, xs, ws, stride, padding):
    x64, w64, b64 = _rand(xs, 1), _rand(ws, 2), _rand(ws[:1], 3)
    assert C.explain(xs, ws, stride, padding, device="cuda").forward == gpu_algorithm
    # float32 forward against the float64 reference
    x32, w32, b32 = (a.astype(np.float32) for a in (x64, w64, b64))
    y = conv2d(_cuda(x32), _cuda(w32), _cuda(b32), stride, padding)
    expected = ref_conv2d(x32, w32, stride, padding) + b32.reshape(1, -1, 1, 1)
    assert y.dtype == np.float32 and y.device.type == "cuda"
    np.testing.assert_allclose(to_numpy(y._data), expected, rtol=2e-6, atol=2e-6 * np.abs(expected).max())
    # float64: every gradient against central differences
    x, w, b = _cuda(x64, True), _cuda(w64, True), _cuda(b64, True)
    assert gradcheck(lambda x, w, b: conv2d(x, w, b, stride, padding), [x, w, b])


def test_gpu_conv_takes_non_contiguous_inputs(gpu_algorithm):
    x64, w64 = _rand((3, 8, 4, 8), 4), _rand((5, 4, 3, 3), 5)
    x = _cuda(x64).transpose(1, 2)[:, :, :, ::2]  # (3, 4, 8, 4), strided
    w = _cuda(np.ascontiguousarray(w64.transpose(1, 0, 2, 3))).transpose(0, 1)  # (5, 4, 3, 3), transposed
    y = conv2d(x, w, None, 1, 1)
    expected = ref_conv2d(x64.transpose(0, 2, 1, 3)[:, :, :, ::2], w64, (1, 1), (1, 1))
    np.testing.assert_allclose(to_numpy(y._data), expected, rtol=1e-12, atol=1e-12)


def test_gpu_conv_and_pools_on_an_empty_batch(gpu_algorithm):
    x, w = _cuda(np.zeros((0, 3, 6, 6)), True), _cuda(_rand((4, 3, 3, 3), 25), True)
    y = conv2d(x, w, None, 2, 1)
    assert y.shape == (0, 4, 3, 3)
    y.sum().backward()
    assert x.grad.shape == x.shape and not to_numpy(w.grad._data).any()
    for pool in (C.max_pool2d, C.avg_pool2d):
        assert pool(x, 3, 2, 1).shape == (0, 3, 3, 3)


def test_the_cpu_keeps_its_algorithms():
    assert C.explain((64, 64, 8, 8), (64, 64, 3, 3), 1, 1).forward == "winograd2"
    assert C.explain((64, 16, 32, 32), (32, 16, 3, 3), 2, 1).grad_input == "gemm"


def test_plans_are_built_once_per_geometry_dtype_and_pass(cudnn_frontend, monkeypatch):
    builds = []
    build = gpu._build
    monkeypatch.setattr(gpu, "_build", lambda *a: builds.append(a[1:3]) or build(*a))
    monkeypatch.setattr(gpu, "_plans", {})
    x, w = _cuda(_rand((2, 3, 6, 6), 6), True), _cuda(_rand((4, 3, 3, 3), 7), True)
    conv2d(x, w, None, 2, 1).sum().backward()
    assert sorted(op for op, _ in builds) == ["dgrad", "fprop", "wgrad"]
    builds.clear()
    x.grad = w.grad = None
    conv2d(x, w, None, 2, 1).sum().backward()  # the same geometry again: nothing built
    assert builds == []
    conv2d(x.detach().float(), w.detach().float(), None, 2, 1)  # another dtype: its own plan
    conv2d(x, w, None, 1, 1)  # another stride: its own plan
    assert [op for op, _ in builds] == ["fprop", "fprop"]
    assert len(gpu._plans) == 5


def test_the_cudnn_workspace_is_counted_and_freed(cudnn_frontend, monkeypatch):
    monkeypatch.setattr(gpu, "_plans", {})
    # The first of these forward passes whose plan needs a workspace (each of the stand-in's
    # does; on an H200 the smallest needed none, so larger ones follow)
    for n, c, hw in ((2, 3, 6), (8, 32, 16), (32, 64, 32)):
        x, w = _cuda(_rand((n, c, hw, hw), 8, np.float32)), _cuda(_rand((c, c, 3, 3), 9, np.float32))
        conv2d(x, w, None, 1, 1)  # builds the plan
        plan = gpu._plans[next(reversed(gpu._plans))]
        if plan.workspace_bytes > 0:
            break
    assert plan.workspace_bytes > 0, "no forward plan here needs a workspace: nothing to check"
    base = memory.breakdown("cuda")["workspace"]
    seen = []
    run = plan.graph.execute

    def recording(tensors, workspace, handle=None):
        seen.append((workspace.nbytes, memory.breakdown("cuda")["workspace"] - base))
        return run(tensors, workspace, handle=handle)

    monkeypatch.setattr(plan.graph, "execute", recording)
    conv2d(x, w, None, 1, 1)
    assert seen == [(plan.workspace_bytes, plan.workspace_bytes)]  # counted while cuDNN runs
    assert memory.breakdown("cuda")["workspace"] == base  # and freed after


@pytest.mark.filterwarnings("ignore:conv2d on the GPU:RuntimeWarning")
def test_the_fallback_workspace_is_its_im2col_columns_whole_batch(no_frontend):
    n, c, hw, co = 4, 3, 6, 5
    x, w = _cuda(_rand((n, c, hw, hw), 10, np.float32)), _cuda(_rand((co, c, 3, 3), 11, np.float32))
    base = memory.breakdown("cuda")["workspace"]
    memory.reset_peak()
    with C.workspace_limit(0):  # the CPU's limit does not chunk the GPU
        conv2d(x, w, None, 1, 1)
    cols = n * c * 9 * hw * hw * 4
    padded = n * c * (hw + 2) ** 2 * 4
    assert memory.peak_breakdown("cuda")["workspace"] - base == cols + padded
    assert memory.breakdown("cuda")["workspace"] == base


def test_a_pass_cudnn_cannot_run_is_computed_by_the_fallback_with_a_warning(cudnn_frontend, monkeypatch):
    cudnn = fw_backend.cudnn_module()

    def no_engine(cudnn_, op, *args):
        if op == "dgrad":
            raise cudnn.cudnnGraphNotSupportedError("no engine left")
        return build(cudnn_, op, *args)

    build = gpu._build
    monkeypatch.setattr(gpu, "_build", no_engine)
    monkeypatch.setattr(gpu, "_plans", {})
    x64, w64 = _rand((2, 3, 6, 6), 26), _rand((4, 3, 3, 3), 27)
    x, w = _cuda(x64, True), _cuda(w64, True)
    with pytest.warns(RuntimeWarning, match="cuDNN has no engine for dgrad"):
        assert gradcheck(lambda x, w: conv2d(x, w, None, 2, 1), [x, w])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per geometry
        conv2d(x, w, None, 2, 1).sum().backward()


def _off_alignment(a):
    """A device array with ``a``'s values starting one element past a 16-byte boundary: a
    view into a flat buffer after a 1-element parameter."""
    flat = fw_backend.cupy_module().zeros(a.size + 1, a.dtype)
    view = flat[1:].reshape(a.shape)
    view[...] = fw_backend.cupy_module().asarray(a)
    assert view.data.ptr % gpu.ALIGNMENT == a.dtype.itemsize
    return view


def test_buffers_off_the_16_byte_alignment_are_bound_through_aligned_copies(cudnn_frontend):
    """cuDNN's descriptors promise 16-byte aligned buffers: bound as they are, such views
    failed in cuBLASLt on an H200 (the stand-in refuses them, as a failed execution)."""
    from framework.ops import matmul_gpu

    xp = fw_backend.cupy_module()
    x64, w64 = _rand((2, 3, 6, 6), 30), _rand((4, 3, 3, 3), 31)
    y = conv2d(fw.Tensor._from_array(_off_alignment(x64)), fw.Tensor._from_array(_off_alignment(w64)), None, 1, 1)
    np.testing.assert_allclose(to_numpy(y._data), ref_conv2d(x64, w64, (1, 1), (1, 1)), rtol=1e-12, atol=1e-12)
    a, b = _rand((5, 4), 32), _rand((4, 3), 33)
    for dtype in (np.float64, np.float32):
        out = _off_alignment(np.zeros((5, 3), dtype))
        got = matmul_gpu.matmul(_off_alignment(a.astype(dtype)), _off_alignment(b.astype(dtype)), xp, out=out)
        assert got is out
        np.testing.assert_allclose(to_numpy(out), a @ b, rtol=1e-6 if dtype == np.float32 else 1e-12)


def test_float32_is_full_float32_unless_tf32_is_chosen(cudnn_frontend):
    x32, w32 = _rand((2, 16, 8, 8), 12, np.float32), _rand((8, 16, 3, 3), 13, np.float32)
    expected = ref_conv2d(x32.astype(np.float64), w32.astype(np.float64), (1, 1), (1, 1))
    scale = np.abs(expected).max()

    def error():
        y = conv2d(_cuda(x32), _cuda(w32), None, 1, 1)
        return np.abs(to_numpy(y._data) - expected).max() / scale

    assert C.get_math_mode() == "fp32"
    assert error() < 1e-6
    with C.math_mode("tf32"):
        assert C.explain(x32.shape, w32.shape, 1, 1, device="cuda").forward == "cudnn_tf32"
        # TF32 (10 mantissa bits) is allowed, not forced: cuDNN's heuristics pick the engine,
        # and on an H200 they picked a full-float32 one at this size (error 4e-7). The
        # stand-in's heuristics rank the tensor-core engine first, as on larger problems.
        assert (1e-5 if _on_standin() else 0) < error() < 1e-2
    assert error() < 1e-6  # and back
    x = _cuda(x32.astype(np.float64))
    with C.math_mode("tf32"):  # TF32 is float32's: float64 stays exact
        y = conv2d(x, _cuda(w32.astype(np.float64)), None, 1, 1)
    np.testing.assert_allclose(to_numpy(y._data), expected, rtol=1e-12, atol=1e-12 * scale)


def test_tensor_core_engines_are_deselected_for_float32_only(cudnn_frontend, monkeypatch):
    """float32 runs in full float32 (unless tf32 is chosen); float16 keeps its tensor-core
    engines, cuDNN's fastest for it (float16 inputs as they are, float32 accumulation)."""
    cudnn = fw_backend.cudnn_module()
    barred = {
        (t, tf32): cudnn.numerical_note.TENSOR_CORE in gpu.deselected_notes(cudnn, np.dtype(t), tf32)
        for t in ("float16", "float32", "float64")
        for tf32 in (False, True)
    }
    assert barred == {
        ("float16", False): False,
        ("float16", True): False,
        ("float32", False): True,
        ("float32", True): False,
        ("float64", False): False,
        ("float64", True): False,
    }
    if _on_standin():  # the engines the stand-in's heuristics pick
        monkeypatch.setattr(gpu, "_plans", {})
        for dtype in (np.float16, np.float32, np.float64):
            conv2d(_cuda(_rand((2, 4, 6, 6), 20, dtype)), _cuda(_rand((3, 4, 3, 3), 21, dtype)), None, 1, 1)
        engines = {key[6]: plan.graph._plan.name for key, plan in gpu._plans.items()}
        assert engines == {"float16": "tensor_core_fp16", "float32": "full_precision", "float64": "full_precision"}


def test_the_math_mode_of_the_forward_call_applies_to_its_backward(cudnn_frontend, monkeypatch):
    x32, w32 = _rand((2, 16, 8, 8), 14, np.float32), _rand((8, 16, 3, 3), 15, np.float32)
    grads, passes = {}, []
    run = gpu._run
    monkeypatch.setattr(
        gpu,
        "_run",
        lambda op, geom, a, b, shape, tf32, *rest: passes.append((op, tf32)) or run(op, geom, a, b, shape, tf32, *rest),
    )
    for mode in ("fp32", "tf32"):
        x, w = _cuda(x32, True), _cuda(w32, True)
        with C.math_mode(mode):
            y = conv2d(x, w, None, 1, 1)
        y.sum().backward()  # outside the block
        grads[mode] = to_numpy(w.grad._data)
    # each pass in its forward call's math mode (plans are cached per math mode)
    assert sorted(passes) == sorted([(op, tf32) for op in ("fprop", "wgrad", "dgrad") for tf32 in (False, True)])
    x64 = x32.astype(np.float64)
    exact = np.einsum("nchw->c", np.pad(x64, ((0, 0), (0, 0), (1, 1), (1, 1)))[:, :, 1:9, 1:9])  # w.grad[o, c, 1, 1]
    assert np.abs(grads["fp32"][0, :, 1, 1] - exact).max() < 1e-5 * np.abs(exact).max()
    if _on_standin():  # its heuristics take the TF32 engine where allowed (a real GPU's may not)
        assert np.abs(grads["tf32"][0, :, 1, 1] - exact).max() > 1e-5 * np.abs(exact).max()


def test_math_mode_setting():
    assert C.MATH_MODES == ("fp32", "tf32") and C.get_math_mode() == "fp32"
    C.set_math_mode("tf32")
    try:
        assert C.get_math_mode() == "tf32"
    finally:
        C.set_math_mode("fp32")
    with pytest.raises(ValueError, match="unknown conv2d math mode 'fp16'"):
        C.set_math_mode("fp16")


def test_without_the_frontend_one_warning_names_the_install(no_frontend):
    x, w = _cuda(_rand((2, 3, 6, 6), 16)), _cuda(_rand((4, 3, 3, 3), 17))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        conv2d(x, w, None, 1, 1)
        conv2d(x, w, None, 2, 0)
        C.explain((2, 3, 6, 6), (4, 3, 3, 3), device="cuda")
    messages = [str(c.message) for c in caught]
    assert len(messages) == 1 and "pip install nvidia-cudnn-frontend" in messages[0], messages


# --- what a pass costs ------------------------------------------------------------------------

_STANDIN_DIR = os.path.dirname(os.path.abspath(cupy_standin.__file__))


def _calls_into_the_array_module(fn):
    """How many calls into CuPy (the stand-in's Python functions and methods) come straight
    from the GPU algorithms' module while ``fn`` runs: what grows when a pass loops over
    chunks or kernel offsets."""
    here = gpu.__file__
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        caller = frame.f_back
        if event == "call" and caller is not None and caller.f_code.co_filename == here:
            if frame.f_code.co_filename.startswith(_STANDIN_DIR):
                calls += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def _pass_costs(n, k, stride):
    """Calls of the fallback's forward, weight gradient and input gradient."""
    x, w = _rand((n, 4, 8, 8), 18), _rand((6, 4, k, k), 19)
    y_hw = ((8 + 2 - k) // stride + 1,) * 2
    geom = ConvGeometry(x.shape, w.shape, (stride, stride), (1, 1), y_hw)
    xp = fw_backend.cupy_module()
    x, w, g = xp.asarray(x), xp.asarray(w), xp.asarray(_rand((n, 6) + y_hw, 20))
    algo = C.ALGORITHMS["im2col_gpu"]
    return (
        _calls_into_the_array_module(lambda: algo.forward(x, w, geom, 0, xp)),
        _calls_into_the_array_module(lambda: algo.grad_weight(x, g, geom, 0, xp)),
        _calls_into_the_array_module(lambda: algo.grad_input(g, w, geom, 0, xp, False)),
    )


@pytest.mark.parametrize("stride", [1, 2])
def test_the_fallback_makes_the_same_few_calls_whatever_the_batch_and_the_kernel(no_frontend, stride):
    if fw_backend.cupy_choice() != "standin":
        pytest.skip("counts calls into the CuPy stand-in's Python code")
    costs = {(n, k): _pass_costs(n, k, stride) for n in (1, 8) for k in (1, 3)}
    assert len(set(costs.values())) == 1, costs  # nothing chunked, no loop over kernel offsets
    assert max(costs[(8, 3)]) <= 20, costs  # the copies and the matmul, and the views and shapes around them


def _standin_counts_launches():
    from framework.testing.cupy_standin import counting

    cp = fw_backend.cupy_module()
    a = cp.ones(3)
    with counting.count() as c:
        cp.add(a, a)
    return c.launches > 0


@pytest.mark.parametrize("bias", [False, True])
def test_each_cudnn_pass_is_one_library_call_and_no_host_sync(cudnn_frontend, bias):
    from framework.testing.cupy_standin import counting

    if fw_backend.cupy_choice() != "standin":
        pytest.skip("counts launches on the CuPy stand-in")
    for n in (2, 16):
        x, w = _cuda(_rand((n, 4, 8, 8), 21), True), _cuda(_rand((6, 4, 3, 3), 22), True)
        b = _cuda(_rand((6,), 23), True) if bias else None
        conv2d(x, w, b, 2, 1)  # plans built
        with counting.count() as fwd:
            y = conv2d(x, w, b, 2, 1)
        g = _cuda(_rand(y.shape, 24))
        with counting.count() as bwd:
            y.backward(g)
        assert fwd.by_kind().get("cudnn") == 1 and bwd.by_kind().get("cudnn") == 2
        assert fwd.host_syncs == 0 and bwd.host_syncs == 0
        if _standin_counts_launches():  # the stand-in's own kernels counted too
            assert fwd.launches <= 1 + bias and bwd.launches <= 2 + bias, (fwd.by_kind(), bwd.by_kind())


# --- pooling on the GPU: the same results as the CPU's, in a constant number of calls ------------


def _on_both(fn, x, grad_seed=None):
    """``fn`` on the CPU and on the GPU: (cpu output, gpu output, cpu grad, gpu grad)."""
    results = []
    for device in ("cpu", "cuda"):
        t = fw.tensor(x, dtype=x.dtype, device=device, requires_grad=x.dtype.kind == "f")
        y = fn(t)
        grad = None
        if grad_seed is not None:
            y.backward(fw.tensor(_rand(y.shape, grad_seed), device=device))
            grad = to_numpy(t.grad._data)
        results.append((to_numpy(y.detach()._data), grad))
    (y_cpu, g_cpu), (y_gpu, g_gpu) = results
    return y_cpu, y_gpu, g_cpu, g_gpu


@pytest.mark.parametrize("pool", ["max", "avg"])
@pytest.mark.parametrize("kernel,stride,padding", [(2, 2, 0), (3, 2, 1), ((3, 2), (1, 2), (1, 0)), (3, 1, 1)])
def test_gpu_pools_agree_with_the_cpu_overlapping_windows_included(pool, kernel, stride, padding):
    if fw_backend.cupy_module() is None:
        pytest.skip("needs CuPy or its stand-in")
    fn = C.max_pool2d if pool == "max" else C.avg_pool2d
    x = np.round(_rand((3, 2, 7, 6), 30), 1)  # rounded: ties, which the first maximum wins
    y_cpu, y_gpu, g_cpu, g_gpu = _on_both(lambda t: fn(t, kernel, stride, padding), x, grad_seed=31)
    if pool == "max":
        np.testing.assert_array_equal(y_gpu, y_cpu)  # the same elements picked
    else:  # one reduction over the window instead of a sum offset by offset: another order
        np.testing.assert_allclose(y_gpu, y_cpu, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(g_gpu, g_cpu, rtol=1e-14, atol=1e-14)


def test_gpu_max_pool_first_maximum_nan_and_integers():
    if fw_backend.cupy_module() is None:
        pytest.skip("needs CuPy or its stand-in")
    x = np.array([[[[1.0, 3.0, 3.0, 0.0], [3.0, 2.0, np.nan, 5.0]]]])
    y_cpu, y_gpu, g_cpu, g_gpu = _on_both(lambda t: C.max_pool2d(t, 2), x, grad_seed=32)
    np.testing.assert_array_equal(y_gpu, y_cpu)
    assert np.isnan(y_gpu[0, 0, 0, 1]) and y_gpu[0, 0, 0, 0] == 3.0
    np.testing.assert_array_equal(g_gpu != 0, [[[[0, 1, 0, 0], [0, 0, 1, 0]]]])
    np.testing.assert_array_equal(g_gpu, g_cpu)
    ints = np.arange(-20, 0, dtype=np.int64).reshape(1, 1, 4, 5)
    y_cpu, y_gpu, _, _ = _on_both(lambda t: C.max_pool2d(t, 3, 2, 1), ints)
    assert y_gpu.dtype == np.int64
    np.testing.assert_array_equal(y_gpu, y_cpu)


def _pool_calls(pool, n, k):
    """Calls into CuPy straight from the pooling module: forward and backward."""
    from framework.ops.conv_algorithms import pooling

    fn = C.max_pool2d if pool == "max" else C.avg_pool2d
    x = _cuda(_rand((n, 3, 9, 9), 33), True)
    here = pooling.__file__
    calls = []

    def profile(frame, event, arg):
        caller = frame.f_back
        if event == "call" and caller is not None and caller.f_code.co_filename == here:
            if frame.f_code.co_filename.startswith(_STANDIN_DIR):
                calls.append(frame.f_code.co_name)

    y = fn(x, k, 2, 1)  # the window positions of this geometry made before counting
    y.backward(_cuda(_rand(y.shape, 34)))
    x.grad = None
    sys.setprofile(profile)
    try:
        y = fn(x, k, 2, 1)
        forward = len(calls)
        y.backward(_cuda(_rand(y.shape, 34)))
    finally:
        sys.setprofile(None)
    return forward, len(calls) - forward


@pytest.mark.parametrize("pool", ["max", "avg"])
def test_gpu_pools_make_the_same_few_calls_whatever_the_batch_and_the_kernel(pool):
    if fw_backend.cupy_choice() != "standin":
        pytest.skip("counts calls into the CuPy stand-in's Python code")
    costs = {(n, k): _pool_calls(pool, n, k) for n in (1, 8) for k in (2, 3)}
    assert len(set(costs.values())) == 1, costs  # nothing chunked, no loop over window offsets
    assert max(costs[(8, 3)]) <= 20, costs  # the copies, reductions, scatter and the views around them
