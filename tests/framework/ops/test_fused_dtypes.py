"""Every fused GPU kernel in every dtype it takes, against a float64 reference.

Each case runs an op (forward and backward) on the gpu leg in one dtype, where the fused
kernels of :mod:`framework.ops.kernels` and :mod:`framework.optim.kernels` run, and
compares its values and gradients with the same op run on the CPU in float64 on the same
(rounded) inputs, with that dtype's tolerance; it also records which kernels ran and in
which dtypes (:meth:`framework.ops.kernels._Kernel.binding`), and holds them to the
case's list. :func:`test_the_cases_run_every_kernel_in_every_dtype_it_takes` then checks
that the cases together run every kernel of :data:`framework.ops.kernels.KERNELS` with
every binding of its type letters that it declares.

On the CuPy stand-in the kernels run their NumPy references, which compute as the CUDA
source does (half types in float32, rounded where the source rounds); on a GPU, the CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest

import framework as fw
import framework.nn.functional as F
from framework.ops import kernels as K
from framework.ops import norm
from framework.ops.loss import check_targets, cross_entropy
from framework.optim import SGD, Adam
from framework.optim import kernels as optim_kernels
from framework.testing import to_numpy
from tests.conftest import requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

# A dtype's tolerance: relative to each value and, for values near zero, to the largest
# magnitude of the reference (gradients of normalizations cancel). A few units in the last
# place of the dtype: float16's is 2**-10, bfloat16's 2**-7, float32's 2**-23.
TOL = {"float16": 8e-3, "bfloat16": 6e-2, "float32": 2e-5, "float64": 1e-11}


# tril and triu take every dtype: the floating ones through _check, the others exactly
TRIANGLE_DTYPES = K.FLOATS + K.INTEGERS + ("bool", "complex64", "complex128")


def _cases():
    """(case name, binding of the type letters, kernels it must launch)"""
    out = []
    for t in K.FLOATS:
        for act in ("relu", "leaky_relu", "sigmoid", "tanh"):
            out.append((act, {"T": t}, (f"fused_{act}", f"fused_{act}_backward")))
        for s in K.INTEGERS:
            ce = ("fused_cross_entropy", "fused_cross_entropy_backward")
            out.append(("cross_entropy", {"T": t, "S": s}, ce))
            out.append(("bad_target", {"T": s}, ("fused_bad_target",)))
        for u in K.FLOATS:
            out.append(("running_stat_update", {"T": t, "U": u}, ("fused_running_stat_update",)))
        out.append(("running_stat_from_moments", {"T": t}, ("fused_running_stat_from_moments", "fused_bn_eval_stats")))
    for t in K.FLOATS:
        bn = (
            "fused_bn_moments",
            "fused_channel_sums",
            "fused_bn_forward",
            "fused_bn_grad_sums",
            "fused_bn_backward_affine",
        )
        out.append(("batch_norm", {"T": t}, bn))
        out.append(("batch_norm weight without grad", {"T": t}, ("fused_bn_backward",)))
        out.append(("batch_norm eval", {"T": t}, ("fused_bn_eval_stats", "fused_bn_forward", "fused_bn_scale")))
        for batch in (True, False):
            for dz in (True, False):
                for gw in (True, False):
                    name = (
                        f"fused_abn_backward_{'batch' if batch else 'given'}{'_dz' if dz else ''}{'_gw' if gw else ''}"
                    )
                    out.append((f"inplace_abn {batch} {dz} {gw}", {"T": t}, ("fused_abn_forward", name)))
        out.append(
            (
                "inplace_abn without x's gradient",
                {"T": t},
                ("fused_abn_grad_sums", "fused_abn_dz", "fused_abn_weight_grad"),
            )
        )
    for t in K.FLOATS:
        for i in ("uint8", "uint16", "uint32"):
            out.append((f"pool max {i}", {"T": t, "I": i}, ("fused_max_pool_backward",)))
        out.append(("pool avg", {"T": t}, ("fused_avg_pool_backward",)))
    for t in K.FLOATS:
        for i in ("int32", "int64"):
            out.append((f"embedding {i}", {"T": t, "I": i}, ("fused_embedding_backward",)))
        for a in ("none", "tanh"):
            out.append((f"gelu {a}", {"T": t}, (f"fused_gelu_{a}", f"fused_gelu_{a}_backward")))
        forward = ("fused_ln_moments", "fused_ln_forward")
        for me in ("", "_me"):
            mode = " memory_efficient" if me else ""
            affine = (f"fused_ln_feature_sums{me}", f"fused_ln_row_sums{me}", f"fused_ln_backward{me}_affine")
            out.append((f"layer_norm{mode}", {"T": t}, forward + affine))
            plain = (f"fused_ln_row_sums{me}", f"fused_ln_backward{me}")
            out.append((f"layer_norm{mode} without affine", {"T": t}, forward + plain))
            out.append((f"layer_norm{mode} weight without grad", {"T": t}, forward + plain))
        out.append(
            ("layer_norm without x's gradient", {"T": t}, forward + ("fused_ln_feature_sums", "fused_ln_affine_grads"))
        )
        attention = ("fused_attn_softmax", "fused_attn_probs", "fused_attn_delta", "fused_attn_scores_grad")
        for how in ("bool_mask", "float_mask", "causal_dropout"):
            out.append((f"attention {how}", {"T": t}, attention))
        out.append(("attention one_key", {"T": t}, attention[:2]))
    for t in TRIANGLE_DTYPES:
        out.append(("tril", {"T": t}, ("fused_tril",)))
        out.append(("triu", {"T": t}, ("fused_triu",)))
    for t in sorted(d.name for d in optim_kernels.FUSED_DTYPES):
        out.append(("sgd", {"T": t}, ("fused_sgd",)))
        out.append(("sgd momentum", {"T": t}, ("fused_sgd_momentum",)))
        out.append(("adam", {"T": t}, ("fused_adam",)))
        scaler = ("fused_amp_unscale", "fused_amp_update_scale")
        out.append(("sgd amp", {"T": t}, ("fused_sgd_amp",) + scaler))
        out.append(("sgd momentum amp", {"T": t}, ("fused_sgd_momentum_amp",) + scaler))
        out.append(("adam amp", {"T": t}, ("fused_adam_amp",) + scaler))
    out.append(("sgd amp bfloat16", {"T": "bfloat16"}, ("fused_amp_unscale",)))  # SGD by op, the flag read
    return out


CASES = _cases()


def _table(*first_words):
    """The cases whose name starts with one of ``first_words``, as pytest parameters."""
    return [
        pytest.param(case, b, names, id=f"{case}-{'-'.join(b.values())}")
        for case, b, names in CASES
        if case.split()[0] in first_words
    ]


def _agrees(b: dict, binding: dict) -> bool:
    """Whether a kernel's binding ``b`` is the case's on the letters both have (the others,
    such as C for the complex sums, follow from T)."""
    return all(b[letter] == v for letter, v in binding.items() if letter in b)


def test_the_cases_run_every_kernel_in_every_dtype_it_takes():
    declared = {(name, tuple(sorted(b.items()))) for name, k in K.KERNELS.items() for b in k.takes.types}
    covered = {
        (name, tuple(sorted(b.items())))
        for _, binding, names in CASES
        for name in names
        for b in K.KERNELS[name].takes.types
        if _agrees(b, binding)
    }
    assert sorted(declared - covered) == []


@pytest.fixture
def launched(monkeypatch):
    """The (kernel name, binding) of every fused kernel launched in the test."""
    calls = []
    call = K._Kernel.__call__

    def record(self, *args, **kwargs):
        calls.append((self.name, self.binding(args + ((kwargs["out"],) if "out" in kwargs else ()))))
        return call(self, *args, **kwargs)

    monkeypatch.setattr(K._Kernel, "__call__", record)
    return calls


def _dtype(name):
    return K.dtype_of(name)


def _rounded(a, dtype):
    """float64 values that ``dtype`` holds exactly: the inputs of both runs."""
    return np.asarray(a, np.float64).astype(_dtype(dtype)).astype(np.float64)


def _close(got, want, dtype, what):
    got = np.asarray(to_numpy(got)).astype(np.float64)
    want = np.asarray(to_numpy(want)).astype(np.float64)
    assert got.shape == want.shape, what
    tol = TOL[dtype]
    scale = np.abs(want).max() if want.size else 0.0
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale, err_msg=f"{what} in {dtype}")


def _run(fn, arrays, dtype, device, grads=True):
    """``fn(*tensors)`` on ``device`` in ``dtype`` and its gradients (backward of a fixed weighting)."""
    ts = [fw.tensor(a.astype(_dtype(dtype)), device=device, requires_grad=grads) for a in arrays]
    out = fn(*ts)
    if not grads:
        return [out]
    w = np.random.default_rng(7).standard_normal(out.shape).astype(_dtype(dtype))
    (out * fw.tensor(w, device=device)).sum().backward()
    return [out] + [t.grad for t in ts]


def _check(fn, arrays, dtype, what, grads=True):
    got = _run(fn, arrays, dtype, "cuda", grads)
    want = _run(fn, arrays, "float64", "cpu", grads)
    for i, (g, w) in enumerate(zip(got, want)):
        _close(g, w, dtype, f"{what}: {'output' if i == 0 else f'gradient {i}'}")


def _ran(launched, names, binding):
    missing = [n for n in names if not any(m == n and _agrees(b, binding) for m, b in launched)]
    assert missing == [], f"not launched in {binding}: {missing}; launched {launched}"


def _normal(shape, seed, dtype, scale=1.0, shift=0.0):
    return _rounded(np.random.default_rng(seed).standard_normal(shape) * scale + shift, dtype)


ACTIVATIONS = {
    "relu": fw.relu,
    "leaky_relu": lambda x: fw.leaky_relu(x, 0.1),
    "sigmoid": fw.sigmoid,
    "tanh": fw.tanh,
}


@pytest.mark.parametrize("case,binding,names", _table(*ACTIVATIONS))
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "0-d"])
def test_activation(launched, case, binding, names, layout):
    dtype, fn = binding["T"], ACTIVATIONS[case]
    x = _normal(() if layout == "0-d" else (4, 6), 0, dtype, 2.0)
    op = (lambda t: fn(t.t())) if layout == "transposed" else fn
    _check(op, [x], dtype, f"{case} ({layout})")
    _ran(launched, names, binding)


def _bn_data(dtype, shape=(6, 3, 2, 2)):
    c = shape[1]
    return _normal(shape, 1, dtype, 2.0, 0.5), _normal((c,), 2, dtype, 1.0, 1.0), _normal((c,), 3, dtype)


@pytest.mark.parametrize("case,binding,names", _table("batch_norm"))
def test_batch_norm(launched, case, binding, names):
    dtype = binding["T"]
    x, w, b = _bn_data(dtype)
    c = x.shape[1]
    mean, var = _normal((c,), 4, dtype, 0.3), _rounded(np.linspace(0.5, 2.0, c), dtype)

    def stats(device):
        return [fw.tensor(a.astype(_dtype(dtype)), device=device) for a in (mean, var)]

    if case == "batch_norm eval":
        _check(
            lambda x_, w_, b_: norm.batch_norm(x_, *stats(x_.device), w_, b_, training=False), [x, w, b], dtype, case
        )
    elif case == "batch_norm weight without grad":

        def op(x_):
            wt = fw.tensor(w.astype(_dtype(dtype)), device=x_.device)
            return norm.batch_norm(x_, None, None, wt, None, training=True)

        _check(op, [x], dtype, case)
    else:
        _check(lambda x_, w_, b_: norm.batch_norm(x_, None, None, w_, b_, training=True), [x, w, b], dtype, case)
    _ran(launched, names, binding)


# (input shape, kernel, stride, padding) whose window offsets need each index dtype: overlapping
# windows (stride below the kernel) and padding, where each input gradient gathers several
POOL_GEOMETRY = {
    "uint8": ((2, 3, 7, 6), 3, 2, 1),
    "uint16": ((1, 2, 20, 19), 17, 2, 3),  # 289 offsets
    "uint32": ((1, 1, 258, 257), 257, 1, 0),  # 66,049 offsets
}


@pytest.mark.parametrize("case,binding,names", _table("pool"))
def test_pool(launched, case, binding, names):
    dtype = binding["T"]
    shape, k, s, p = POOL_GEOMETRY[binding.get("I", "uint8")]
    x = _normal(shape, 1, dtype)
    pool = F.max_pool2d if case.startswith("pool max") else F.avg_pool2d
    _check(lambda x_: pool(x_, k, s, p), [x], dtype, case)
    _ran(launched, names, binding)


@pytest.mark.parametrize("case,binding,names", _table("inplace_abn"))
def test_inplace_abn(launched, case, binding, names):
    dtype = binding["T"]
    x, w, b = _bn_data(dtype)
    r = _normal(x.shape, 5, dtype)
    c = x.shape[1]
    mean, var = _normal((c,), 4, dtype, 0.3), _rounded(np.linspace(0.5, 2.0, c), dtype)
    if case == "inplace_abn without x's gradient":
        batch, need_r, affine, need_x = True, True, True, False
    else:
        batch, need_r, affine = (word == "True" for word in case.split()[1:])
        need_x = True

    def run(device, dt):
        t = _dtype(dt)
        xt = fw.tensor(x.astype(t), device=device, requires_grad=need_x)
        wt = fw.tensor(w.astype(t), device=device, requires_grad=affine)
        bt = fw.tensor(b.astype(t), device=device, requires_grad=affine)
        rt = fw.tensor(r.astype(t), device=device, requires_grad=need_r)
        stats = (None, None) if batch else tuple(fw.tensor(a.astype(t), device=device) for a in (mean, var))
        h = xt * 1 if need_x else xt.clone()
        y = norm.inplace_abn(h, *stats, wt, bt, training=batch, negative_slope=0.1, residual=rt)
        g = np.random.default_rng(7).standard_normal(y.shape).astype(t)
        out = y.detach().clone()
        (y * fw.tensor(g, device=device)).sum().backward()
        return [out] + [v.grad for v, needed in ((xt, need_x), (wt, affine), (bt, affine), (rt, need_r)) if needed]

    for i, (got, want) in enumerate(zip(run("cuda", dtype), run("cpu", "float64"))):
        _close(got, want, dtype, f"{case}: {'output' if i == 0 else f'gradient {i}'}")
    _ran(launched, names, binding)


@pytest.mark.parametrize("case,binding,names", _table("running_stat_update", "running_stat_from_moments"))
def test_running_statistics(launched, case, binding, names):
    t = _dtype(binding["T"])
    r = _rounded([0.5, -1.0, 2.0], binding["T"])
    if case == "running_stat_update":
        batch = _rounded([1.5, 0.25, -3.0], binding["U"])
        dev = fw.tensor(r.astype(t), device="cuda")
        norm.RunningStatUpdate.apply_(dev, fw.tensor(batch.astype(_dtype(binding["U"])), device="cuda"), momentum=0.3)
        _close(dev, 0.7 * r + 0.3 * batch, binding["T"], case)
    else:  # training updates the running statistics from the batch's sums; eval reads them
        x = _normal((8, 3), 1, "float32", 2.0, 0.5)
        rm, rv = fw.tensor(r.astype(t), device="cuda"), fw.tensor(np.abs(r).astype(t), device="cuda")
        norm.batch_norm(fw.tensor(x.astype(np.float32), device="cuda"), rm, rv, training=True, momentum=0.3)
        m = x.shape[0]
        want_m, want_v = 0.7 * r + 0.3 * x.mean(0), 0.7 * np.abs(r) + 0.3 * x.var(0) * m / (m - 1)
        _close(rm, want_m, binding["T"], case + " mean")
        _close(rv, want_v, binding["T"], case + " var")
        y = norm.batch_norm(fw.tensor(x.astype(np.float32), device="cuda"), rm, rv, training=False)
        stored_m, stored_v = (to_numpy(a).astype(np.float64) for a in (rm, rv))
        _close(y, (x - stored_m) / np.sqrt(stored_v + 1e-5), "float32", case + " eval")
    _ran(launched, names, binding)


@pytest.mark.parametrize("case,binding,names", _table("cross_entropy", "bad_target"))
def test_cross_entropy(launched, case, binding, names):
    if case == "bad_target":
        t = np.array([0, 3, 1, 2]).astype(_dtype(binding["T"]))
        x = _normal((4, 3), 0, "float32")
        cross_entropy(fw.tensor(x.astype(np.float32), device="cuda"), fw.tensor(t, device="cuda"))
        with pytest.raises(IndexError, match="Target 3 is out of bounds"):
            check_targets()
    else:
        dtype = binding["T"]
        t = np.array([0, 3, 1, 2, 4]).astype(_dtype(binding["S"]))
        x = _normal((5, 6), 0, dtype, 3.0)
        for reduction in ("mean", "none"):

            def op(x_, reduction=reduction):
                return cross_entropy(x_, fw.tensor(t, device=x_.device), reduction=reduction, label_smoothing=0.1)

            _check(lambda x_: op(x_).reshape(-1), [x], dtype, f"{case} {reduction}")
    _ran(launched, names, binding)


def test_half_cross_entropy_sums_past_65504_classes():
    """A row's sum of exponentials passes float16's largest finite value (65504) with more
    classes than that: summed in float32, the loss is log(C) (equal logits), not inf."""
    c = 70_000
    for device in ("cuda", "cpu"):
        x = fw.zeros(2, c, dtype=fw.float16, device=device, requires_grad=True)
        loss = cross_entropy(x, fw.tensor(np.array([0, c - 1]), device=device))
        assert abs(float(loss.item()) - np.log(c)) < 1e-2, device
        loss.backward()
        g = to_numpy(x.grad).astype(np.float64)
        assert np.isfinite(g).all() and abs(g.sum()) < 1e-2, device


@pytest.mark.parametrize("case,binding,names", _table("gelu"))
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "0-d"])
def test_gelu(launched, case, binding, names, layout):
    dtype, approximate = binding["T"], case.split()[1]
    x = _normal(() if layout == "0-d" else (4, 6), 0, dtype, 2.0)

    def op(t):
        return F.gelu(t.t() if layout == "transposed" else t, approximate=approximate)

    _check(op, [x], dtype, f"{case} ({layout})")
    _ran(launched, names, binding)


@pytest.mark.parametrize("case,binding,names", _table("layer_norm"))
@pytest.mark.parametrize("normalized", [(8,), (4, 8)])
def test_layer_norm(launched, case, binding, names, normalized):
    """Every backward path of the kernels: the weight's and bias's gradients (written by the
    x-gradient kernel or, without x's, by their own), none (no weight or bias: 1 and 0 as
    scalars), a weight without a gradient; from the input, or from the output (memory-efficient)."""
    dtype = binding["T"]
    me = "memory_efficient" in case
    x = _normal((3, 4, 8), 1, dtype, 2.0, 0.5)
    w, b = _normal(normalized, 2, dtype, 0.5, 1.0), _normal(normalized, 3, dtype)

    def constant(a, like):
        return fw.tensor(a.astype(like.dtype), device=like.device)

    if case.endswith("without affine"):
        _check(lambda x_: F.layer_norm(x_, normalized, memory_efficient=me), [x], dtype, case)
    elif case.endswith("weight without grad"):
        _check(lambda x_: F.layer_norm(x_, normalized, constant(w, x_), memory_efficient=me), [x], dtype, case)
    elif case.endswith("without x's gradient"):
        _check(lambda w_, b_: F.layer_norm(constant(x, w_), normalized, w_, b_), [w, b], dtype, case)
    else:
        _check(lambda x_, w_, b_: F.layer_norm(x_, normalized, w_, b_, memory_efficient=me), [x, w, b], dtype, case)
    _ran(launched, names, binding)


class _SameDraw:
    """The random generator of every device, drawing one fixed uniform: the dropout mask
    (a hash of the draw and each element's index) is then the same on the GPU and the CPU."""

    def __init__(self, xp):
        self.xp = xp

    def random(self, shape, dtype):
        return self.xp.full(shape, 0.6180339887, dtype)


@pytest.mark.parametrize("case,binding,names", _table("attention"))
def test_attention(launched, monkeypatch, case, binding, names):
    """The matmul + fused-kernel path (half types take it with a mask or dropout; without,
    cuDNN's SDPA where the frontend runs): a bool mask, a float mask with its gradient, the
    causal mask with dropout (the same draw on both devices), one key (the per-row values
    of the same shape as the scores: the contiguous layout; only v's gradient, since q's and
    k's are 0 for a softmax over one key, and a float's rounding residue)."""
    dtype, how = binding["T"], case.split()[1]
    lq, s = (6, 6) if how == "causal_dropout" else (5, 1 if how == "one_key" else 6)
    q, k, v = _normal((2, 3, lq, 8), 4, dtype), _normal((2, 3, s, 8), 5, dtype), _normal((2, 3, s, 4), 6, dtype)
    allowed = np.random.default_rng(8).random((lq, s)) < 0.7
    allowed[:, 0] = True  # no row fully masked
    if how == "causal_dropout":
        monkeypatch.setattr(fw.random, "generator", _SameDraw)

    def op(*t):
        if how == "float_mask":
            return F.scaled_dot_product_attention(*t)
        if how == "one_key":
            t = tuple(fw.tensor(a.astype(t[0].dtype), device=t[0].device) for a in (q, k)) + t
        mask = fw.tensor(allowed, device=t[0].device) if how in ("bool_mask", "one_key") else None
        p = 0.3 if how == "causal_dropout" else 0.0
        return F.scaled_dot_product_attention(*t, attn_mask=mask, dropout_p=p, is_causal=how == "causal_dropout")

    arrays = (
        [v] if how == "one_key" else [q, k, v] + ([_normal((2, 1, lq, s), 7, dtype)] if how == "float_mask" else [])
    )
    _check(op, arrays, dtype, case)
    _ran(launched, names, binding)


@pytest.mark.parametrize("case,binding,names", _table("tril", "triu"))
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_triangle(launched, case, binding, names, layout):
    """Every dtype: the floating ones with their gradient against float64, the others
    exactly as on the CPU (in their own dtype); the diagonal above and below the main one."""
    dtype = binding["T"]
    fn = getattr(fw, case)
    x = np.random.default_rng(9).standard_normal((2, 5, 6)) * 4
    for k in (-1, 0, 2):

        def op(t, k=k):
            return fn(t.transpose(-1, -2) if layout == "transposed" else t, diagonal=k)

        if dtype in K.FLOATS:
            _check(op, [_rounded(x, dtype)], dtype, f"{case} {k} ({layout})")
        else:
            a = (x + 1j * x[::-1] if dtype.startswith("complex") else x > 0 if dtype == "bool" else x).astype(dtype)
            got, want = op(fw.tensor(a, device="cuda")), op(fw.tensor(a))
            assert got.dtype == want.dtype == _dtype(dtype)
            np.testing.assert_array_equal(to_numpy(got), to_numpy(want), err_msg=f"{case} {k} ({layout}) in {dtype}")
    _ran(launched, names, binding)


@pytest.mark.parametrize("case,binding,names", _table("embedding"))
@pytest.mark.parametrize("padding_idx", [None, 2])
def test_embedding(launched, case, binding, names, padding_idx):
    dtype, index = binding["T"], binding["I"]
    idx = np.random.default_rng(3).integers(0, 5, size=(4, 7)).astype(index)  # rows picked several times
    w = _normal((5, 3), 1, dtype)
    _check(lambda w_: F.embedding(fw.tensor(idx, device=w_.device), w_, padding_idx=padding_idx), [w], dtype, case)
    _ran(launched, names, binding)


def test_embedding_backward_is_deterministic_and_independent_of_the_index_order():
    """The gather sums each row's gradients in index order: the same bits at every call."""
    idx = np.random.default_rng(0).integers(0, 3, size=4000)
    g = np.random.default_rng(1).standard_normal((4000, 8)).astype(np.float32)
    grads = []
    for _ in range(2):
        w = fw.zeros(3, 8, device="cuda", requires_grad=True)
        F.embedding(fw.tensor(idx, device="cuda"), w).backward(fw.tensor(g, device="cuda"))
        grads.append(to_numpy(w.grad))
    assert grads[0].tobytes() == grads[1].tobytes()
    want = np.zeros((3, 8), np.float32)
    for k in range(4000):  # float32 additions in index order, as the kernel's loop
        want[idx[k]] += g[k]
    np.testing.assert_array_equal(grads[0], want)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_embedding_gradients_add_up_in_float32(dtype):
    """A row picked 3,000 times gets 3,000 gradients of 0.1: added in float32 and rounded
    once, 300 (a float16 sum stalls at 256, where 0.1 is below half its spacing; bfloat16's
    much earlier), on both devices; CuPy 14.2's scatter_add takes no bfloat16 at all."""
    idx = np.zeros(3000, np.int64)
    for device in ("cuda", "cpu"):
        w = fw.zeros(4, 2, dtype=_dtype(dtype), device=device, requires_grad=True)
        out = F.embedding(fw.tensor(idx, device=device), w)
        out.backward(fw.full(out.shape, 0.1, dtype=_dtype(dtype), device=device))
        g = to_numpy(w.grad).astype(np.float64)
        want = np.float64(np.float32(np.float32(0.1).astype(_dtype(dtype))) * np.float32(3000))
        np.testing.assert_allclose(g[0], [want, want], rtol=TOL[dtype], err_msg=device)
        assert (g[1:] == 0).all()


@pytest.mark.parametrize("case,binding,names", [c for c in _table("sgd", "adam") if "amp" not in c.values[0]])
def test_optimizer(launched, case, binding, names):
    dtype = binding["T"]
    p0, g0 = _normal((5,), 0, dtype), _normal((5,), 1, dtype)

    def step(device, dt):
        p = fw.tensor(p0.astype(_dtype(dt)), device=device, requires_grad=True)
        opt = {
            "sgd": lambda: SGD([p], lr=0.1, weight_decay=0.01),
            "sgd momentum": lambda: SGD([p], lr=0.1, momentum=0.9, nesterov=True),
            "adam": lambda: Adam([p], lr=0.1, weight_decay=0.01),
        }[case]()
        for _ in range(2):
            p.grad = fw.tensor(g0.astype(_dtype(dt)), device=device)
            opt.step()
        return p

    _close(step("cuda", dtype), step("cpu", "float64"), dtype, case)
    _ran(launched, names, binding)


@pytest.mark.parametrize("case,binding,names", [c for c in _table("sgd", "adam") if "amp" in c.values[0]])
def test_optimizer_under_a_grad_scaler(launched, case, binding, names):
    """Three steps, the second with an inf gradient (skipped): GradScaler's kernels and the
    optimizers' flagged kernels on the GPU against the CPU in float64."""
    dtype = binding["T"]
    p0, g0 = _normal((5,), 0, dtype), _normal((5,), 1, dtype)

    def run(device, dt):
        p = fw.tensor(p0.astype(_dtype(dt)), device=device, requires_grad=True)
        opt = {
            "sgd": lambda: SGD([p], lr=0.1, weight_decay=0.01),
            "sgd momentum": lambda: SGD([p], lr=0.1, momentum=0.9, nesterov=True),
            "adam": lambda: Adam([p], lr=0.1, weight_decay=0.01),
        }[case.split(" amp")[0]]()
        scaler = fw.amp.GradScaler(device, init_scale=4.0, growth_interval=1)
        for k in range(3):
            g = g0 * (np.inf if k == 1 else 1.0)
            opt.zero_grad()
            scaler.scale((p * fw.tensor(g.astype(_dtype(dt)), device=device)).sum()).backward()
            scaler.step(opt)
            scaler.update()
        assert scaler.get_scale() == 8.0  # up, down, up
        return p

    with np.errstate(over="ignore", invalid="ignore"):
        _close(run("cuda", dtype), run("cpu", "float64"), dtype, case)
    _ran(launched, names, binding)


@pytest.mark.parametrize("act", ["relu", "tanh"])
def test_integer_tensors_run_their_activations_as_on_the_cpu(launched, act):
    """The kernels take floating dtypes only: an integer tensor's activation runs as CuPy's
    ufuncs, with NumPy's result on the CPU (relu keeps int64, tanh gives float64)."""
    x = np.array([1, -2, 3])
    got, want = getattr(fw, act)(fw.tensor(x, device="cuda")), getattr(fw, act)(fw.tensor(x))
    assert got.dtype == want.dtype and launched == []
    np.testing.assert_allclose(to_numpy(got), to_numpy(want), rtol=1e-6)
