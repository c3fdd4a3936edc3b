"""The cuDNN frontend's stand-in: the real package's names and signatures (checked against
the real ``cudnn`` where it imports), its values against float64 loops, and what it
refuses that the real backend would get silently wrong."""

import importlib
import inspect

import numpy as np
import pytest

from framework.testing import cudnn_standin as sc
from framework.testing import cupy_standin as cp
from framework.testing.cupy_standin import counting


def _real_cudnn():
    try:
        return importlib.import_module("cudnn")
    except ImportError as e:  # the frontend imports without a GPU; it is just not installed
        pytest.skip(f"NVIDIA's cuDNN frontend is not installed here ({e}): pip install nvidia-cudnn-frontend")


def _public(obj):
    return [n for n in vars(obj) if not n.startswith("_")]


def _same_signature(ours, theirs, what):
    nb = getattr(theirs, "__nb_signature__", None)
    if nb is not None:  # a compiled (nanobind) function: its signature as text
        assert nb[0][0] == f"def {theirs.__name__}{inspect.signature(ours)}".replace("'", ""), (what, nb)
        return
    a, b = inspect.signature(ours), inspect.signature(theirs)
    ours_params = [(p.name, p.kind, p.default) for p in a.parameters.values()]
    their_params = [(p.name, p.kind, p.default) for p in b.parameters.values()]
    if [(n, k) for n, k, _ in ours_params] != [(n, k) for n, k, _ in their_params]:
        raise AssertionError(f"{what}: stand-in {a} vs real {b}")
    for (name, _, mine), (_, _, real) in zip(ours_params, their_params):
        # defaults: the same value, or both an enum member of one name (pybind's vs ours)
        same = mine == real or getattr(mine, "name", object()) == getattr(real, "name", None)
        assert same or mine is inspect.Parameter.empty and real is inspect.Parameter.empty, (what, name, mine, real)


def test_every_standin_name_is_the_real_packages_with_its_signature():
    real = _real_cudnn()
    for name in ("backend_version", "create_handle", "set_stream", "get_stream"):
        _same_signature(getattr(sc, name), getattr(real, name), name)
    for enum in ("data_type", "heur_mode", "numerical_note"):
        missing = set(getattr(sc, enum).__members__) - set(getattr(real, enum).__members__)
        assert not missing, (enum, missing)
    assert issubclass(real.cudnnGraphNotSupportedError, Exception)
    for name in _public(sc.pygraph):
        _same_signature(getattr(sc.pygraph, name), getattr(real.pygraph, name), f"pygraph.{name}")
    _same_signature(sc.pygraph.__init__, real.pygraph.__init__, "pygraph.__init__")
    real_tensor = type(real.pygraph().tensor(dim=[1, 1, 1, 1], data_type=real.data_type.FLOAT))
    for name in _public(sc.Tensor):
        _same_signature(getattr(sc.Tensor, name), getattr(real_tensor, name), f"Tensor.{name}")
    assert isinstance(real.Handle, type) and sc.Handle.__name__ == real.Handle.__name__


def _graph(op, x_shape, w_shape, y_shape, dtype=sc.data_type.FLOAT, tf32=False, pad=(1, 1), stride=(1, 1)):
    g = sc.pygraph(io_data_type=dtype, intermediate_data_type=dtype, compute_data_type=dtype, handle=sc.create_handle())
    shapes = {
        "fprop": (x_shape, w_shape, y_shape),
        "dgrad": (y_shape, w_shape, x_shape),
        "wgrad": (x_shape, y_shape, w_shape),
    }
    a_shape, b_shape, out_shape = shapes[op]
    a, b = g.tensor(name="a", dim=a_shape), g.tensor(name="b", dim=b_shape)
    conv = dict(padding=list(pad), stride=list(stride), dilation=[1, 1])
    out = {"fprop": g.conv_fprop, "dgrad": g.conv_dgrad, "wgrad": g.conv_wgrad}[op](a, b, **conv)
    out.set_output(True).set_dim(list(out_shape)).set_stride(sc._row_major(out_shape))
    g.build_operation_graph()
    g.create_execution_plans([sc.heur_mode.A, sc.heur_mode.FALLBACK])
    if not tf32:
        g.deselect_numeric_notes([sc.numerical_note.TENSOR_CORE])
    g.check_support()
    g.build_plans()
    return g, a, b, out


def _loop_conv(x, w, pad, stride):
    xp_ = np.pad(x, ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    co, _, kh, kw = w.shape
    ho, wo = (xp_.shape[2] - kh) // stride[0] + 1, (xp_.shape[3] - kw) // stride[1] + 1
    y = np.zeros((x.shape[0], co, ho, wo))
    for r in range(ho):
        for c in range(wo):
            y[:, :, r, c] = np.einsum(
                "ncij,ocij->no", xp_[:, :, r * stride[0] :][:, :, :kh, c * stride[1] :][..., :kw], w
            )
    return y


@pytest.mark.parametrize("pad,stride", [((1, 1), (1, 1)), ((1, 0), (2, 3)), ((0, 2), (2, 1))])
def test_the_three_passes_are_the_convolution_and_its_adjoints_in_float64(pad, stride):
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((2, 3, 7, 6)), rng.standard_normal((4, 3, 3, 2))
    y = _loop_conv(x, w, pad, stride)
    dy = rng.standard_normal(y.shape)
    dt = sc.data_type.DOUBLE
    results = {}
    for op, a, b, out_shape in (("fprop", x, w, y.shape), ("dgrad", dy, w, x.shape), ("wgrad", x, dy, w.shape)):
        g, ta, tb, tout = _graph(op, x.shape, w.shape, y.shape, dt, pad=pad, stride=stride)
        out = cp.empty(out_shape, dtype=np.float64)
        workspace = cp.empty(g.get_workspace_size(), dtype=np.uint8)
        da, db = cp.asarray(a), cp.asarray(b)  # the host-to-device copies are not the pass's
        with counting.count() as c:
            g.execute({ta: da, tb: db, tout: out}, workspace)
        assert c.by_kind() == {"cudnn": 1} and c.host_syncs == 0
        results[op] = out.get()
    np.testing.assert_allclose(results["fprop"], y, rtol=1e-12, atol=1e-12)
    # the adjoint identities: <conv(x, w), dy> = <x, dgrad(dy, w)> = <w, wgrad(x, dy)>
    inner = float((y * dy).sum())
    assert np.isclose((x * results["dgrad"]).sum(), inner, rtol=1e-12)
    assert np.isclose((w * results["wgrad"]).sum(), inner, rtol=1e-12)


def test_float32_is_tf32_unless_tensor_cores_are_deselected():
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((2, 8, 5, 5)).astype(np.float32), rng.standard_normal((4, 8, 3, 3)).astype(np.float32)
    exact = _loop_conv(x.astype(np.float64), w.astype(np.float64), (1, 1), (1, 1))
    errors = {}
    for tf32 in (False, True):
        g, tx, tw, ty = _graph("fprop", x.shape, w.shape, exact.shape, tf32=tf32)
        y = cp.empty(exact.shape, dtype=np.float32)
        g.execute({tx: cp.asarray(x), tw: cp.asarray(w), ty: y}, cp.empty(g.get_workspace_size(), dtype=np.uint8))
        errors[tf32] = np.abs(y.get() - exact).max() / np.abs(exact).max()
    assert errors[False] < 1e-7 and 1e-5 < errors[True] < 1e-2, errors


def test_what_the_real_backend_would_get_wrong_is_refused():
    g, tx, tw, ty = _graph("fprop", (2, 3, 5, 5), (4, 3, 3, 3), (2, 4, 5, 5))
    x, w = cp.zeros((2, 3, 5, 5), dtype=np.float32), cp.zeros((4, 3, 3, 3), dtype=np.float32)
    y, ws = cp.empty((2, 4, 5, 5), dtype=np.float32), cp.empty(g.get_workspace_size(), dtype=np.uint8)
    with pytest.raises(ValueError, match="the backend reads the declaration"):
        g.execute({tx: cp.zeros((2, 5, 5, 3), dtype=np.float32).transpose(0, 3, 1, 2), tw: w, ty: y}, ws)
    with pytest.raises(ValueError, match="declared"):
        g.execute({tx: x.astype(np.float64), tw: w, ty: y}, ws)
    with pytest.raises(RuntimeError, match="workspace"):
        g.execute({tx: x, tw: w, ty: y}, ws[:-1])
    with pytest.raises(ValueError, match="no buffer"):
        g.execute({tx: x, tw: w}, ws)
    with pytest.raises(TypeError, match="not a device array"):
        g.execute({tx: x.get(), tw: w, ty: y}, ws)
    with pytest.raises(sc.cudnnGraphNotSupportedError, match="do not form a convolution"):
        _graph("fprop", (2, 3, 5, 5), (4, 3, 3, 3), (2, 4, 4, 4))
    g = sc.pygraph(io_data_type=sc.data_type.DOUBLE, compute_data_type=sc.data_type.DOUBLE)
    out = g.conv_fprop(g.tensor(dim=[1, 1, 3, 3]), g.tensor(dim=[1, 1, 1, 1]), padding=[0, 0], stride=[1, 1])
    out.set_output(True).set_dim([1, 1, 3, 3]).set_stride([9, 9, 3, 1])
    g.build_operation_graph()
    g.create_execution_plans([sc.heur_mode.A])
    g.deselect_numeric_notes([sc.numerical_note.TENSOR_CORE])  # float64 has a full-precision engine
    g.build_plans()
    with pytest.raises(TypeError, match="stream pointer"):
        sc.set_stream(sc.create_handle(), cp.cuda.Stream())


def _matmul_graph(a_shape, a_stride, b_shape, b_stride, dtype=sc.data_type.FLOAT, tf32=False):
    g = sc.pygraph(io_data_type=dtype, intermediate_data_type=dtype, compute_data_type=dtype, handle=sc.create_handle())
    ta = g.tensor(name="A", dim=list(a_shape), stride=list(a_stride), data_type=dtype)
    tb = g.tensor(name="B", dim=list(b_shape), stride=list(b_stride), data_type=dtype)
    tc = g.matmul(ta, tb, compute_data_type=dtype)
    shape = [max(a_shape[0], b_shape[0]), a_shape[1], b_shape[2]]
    assert tc.get_dim() == shape  # the frontend infers C's dims from A's and B's
    tc.set_output(True).set_dim(shape).set_stride(sc._row_major(shape)).set_data_type(dtype)
    g.build_operation_graph()
    g.create_execution_plans([sc.heur_mode.A, sc.heur_mode.FALLBACK])
    if not tf32:
        g.deselect_numeric_notes([sc.numerical_note.TENSOR_CORE])
    g.check_support()
    g.build_plans()
    return g, ta, tb, tc


def test_matmul_is_the_batched_product_of_strided_operands_in_float64_one_launch():
    rng = np.random.default_rng(2)
    a = rng.standard_normal((3, 5, 4))
    b = rng.standard_normal((3, 6, 4))  # bound transposed: B = b^T by its strides, no copy
    da, db = cp.asarray(a), cp.asarray(b).transpose(0, 2, 1)
    g, ta, tb, tc = _matmul_graph(a.shape, (20, 4, 1), (3, 4, 6), (24, 1, 4), sc.data_type.DOUBLE)
    out = cp.empty((3, 5, 6), dtype=np.float64)
    ws = cp.empty(g.get_workspace_size(), dtype=np.uint8)
    with counting.count() as c:
        g.execute({ta: da, tb: db, tc: out}, ws)
    assert c.by_kind() == {"cudnn": 1} and c.host_syncs == 0
    np.testing.assert_allclose(out.get(), a @ b.transpose(0, 2, 1), rtol=1e-12, atol=1e-12)
    # a batch of one is broadcast over the other operand's batch
    g, ta, tb, tc = _matmul_graph((1, 5, 4), (20, 4, 1), (3, 4, 6), (24, 1, 4), sc.data_type.DOUBLE)
    out = cp.empty((3, 5, 6), dtype=np.float64)
    g.execute({ta: da[:1], tb: db, tc: out}, cp.empty(g.get_workspace_size(), dtype=np.uint8))
    np.testing.assert_allclose(out.get(), a[:1] @ b.transpose(0, 2, 1), rtol=1e-12, atol=1e-12)


def test_matmul_float32_is_tf32_whatever_is_deselected_and_refuses_bad_shapes():
    """As measured on an H200 (cuDNN 9.19, frontend 1.32): every engine of a float32 matmul
    is TF32, none noted TENSOR_CORE, so deselecting that note changes nothing."""
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((1, 8, 64)).astype(np.float32), rng.standard_normal((1, 64, 8)).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    errors = {}
    for tf32 in (False, True):
        g, ta, tb, tc = _matmul_graph(a.shape, (512, 64, 1), b.shape, (512, 8, 1), tf32=tf32)
        out = cp.empty(exact.shape, dtype=np.float32)
        g.execute({ta: cp.asarray(a), tb: cp.asarray(b), tc: out}, cp.empty(g.get_workspace_size(), dtype=np.uint8))
        errors[tf32] = np.abs(out.get() - exact).max() / np.abs(exact).max()
    assert 1e-5 < errors[False] == errors[True] < 1e-2, errors
    with pytest.raises(sc.cudnnGraphNotSupportedError, match="matmul of"):
        _matmul_graph((1, 8, 5), (40, 5, 1), (1, 4, 8), (32, 8, 1))
    with pytest.raises(sc.cudnnGraphNotSupportedError, match="matmul of"):
        _matmul_graph((2, 8, 4), (32, 4, 1), (3, 4, 8), (32, 8, 1))
    g = sc.pygraph(io_data_type=sc.data_type.FLOAT)
    with pytest.raises(NotImplementedError, match="padding"):
        g.matmul(g.tensor(dim=[1, 2, 2]), g.tensor(dim=[1, 2, 2]), padding=1.0)


def test_a_matmul_execution_is_recorded_into_a_capture_and_replayed_by_the_graph():
    a = cp.asarray(np.arange(6, dtype=np.float32).reshape(1, 2, 3))
    b = cp.asarray(np.ones((1, 3, 2), dtype=np.float32))
    g, ta, tb, tc = _matmul_graph((1, 2, 3), (6, 3, 1), (1, 3, 2), (6, 2, 1))
    out, ws = cp.zeros((1, 2, 2), dtype=np.float32), cp.empty(g.get_workspace_size(), dtype=np.uint8)
    handle = sc.create_handle()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        sc.set_stream(handle, stream.ptr)
        stream.begin_capture()
        g.execute({ta: a, tb: b, tc: out}, ws, handle=handle)
        graph = stream.end_capture()
    assert graph.kinds() == {"cudnn": 1} and not out.get().any()  # recorded, not run
    graph.launch()
    np.testing.assert_array_equal(out.get()[0], np.arange(6, dtype=np.float32).reshape(2, 3) @ np.ones((3, 2)))
