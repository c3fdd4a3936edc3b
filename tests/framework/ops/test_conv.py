"""conv2d and pooling: forward against naive float64 loop references (and scipy), gradients
against finite differences for every argument combination, what is saved, workspaces in
framework.memory (and the workspace limit that bounds them), and the errors a user can
cause."""

import itertools
import math

import numpy as np
import pytest

import framework as fw
from framework import memory
from framework.ops import conv as C
from framework.ops.conv import adaptive_avg_pool2d, avg_pool2d, conv2d, max_pool2d
from framework.testing import assert_close, gradcheck

from . import harness

# --- naive references: loops over every output element, float64 -------------------------


def _pair(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


def _padded(x, padding, value=0.0):
    ph, pw = _pair(padding)
    return np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=value)


def ref_conv2d(x, w, b=None, stride=1, padding=0):
    sh, sw = _pair(stride)
    xp_ = _padded(x, padding)
    n, _, hp, wp = xp_.shape
    co, _, kh, kw = w.shape
    ho, wo = (hp - kh) // sh + 1, (wp - kw) // sw + 1
    out = np.zeros((n, co, ho, wo))
    for i, o, r, c in itertools.product(range(n), range(co), range(ho), range(wo)):
        out[i, o, r, c] = np.sum(xp_[i, :, r * sh : r * sh + kh, c * sw : c * sw + kw] * w[o])
        if b is not None:
            out[i, o, r, c] += b[o]
    return out


def _ref_pool(x, kernel, stride, padding, reduce, value):
    kh, kw = _pair(kernel)
    sh, sw = _pair(stride if stride is not None else kernel)
    xp_ = _padded(x, padding, value)
    n, c, hp, wp = xp_.shape
    ho, wo = (hp - kh) // sh + 1, (wp - kw) // sw + 1
    out = np.zeros((n, c, ho, wo), dtype=x.dtype)
    for i, ch, r, col in itertools.product(range(n), range(c), range(ho), range(wo)):
        out[i, ch, r, col] = reduce(xp_[i, ch, r * sh : r * sh + kh, col * sw : col * sw + kw])
    return out


def ref_max_pool2d(x, kernel, stride=None, padding=0):
    return _ref_pool(x, kernel, stride, padding, np.max, -np.inf)


def ref_avg_pool2d(x, kernel, stride=None, padding=0):
    return _ref_pool(x, kernel, stride, padding, np.mean, 0.0)


def ref_adaptive_avg_pool2d(x, size):
    oh, ow = _pair(size)
    n, c, h, w = x.shape
    out = np.zeros((n, c, oh, ow))
    for i, j in itertools.product(range(oh), range(ow)):
        r0, r1 = (i * h) // oh, math.ceil((i + 1) * h / oh)
        c0, c1 = (j * w) // ow, math.ceil((j + 1) * w / ow)
        out[:, :, i, j] = x[:, :, r0:r1, c0:c1].mean(axis=(2, 3))
    return out


def _t(a, requires_grad=False):
    a = np.asarray(a)
    return fw.tensor(a, dtype=a.dtype, requires_grad=requires_grad)


def _rand(shape, seed=0, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# --- conv2d: every argument combination through the one op harness ----------------------
# (float32 forward vs the float64 loops, float64 gradcheck, inputs in three memory layouts)

X, W, B = (2, 2, 5, 4), (3, 2, 3, 2), (3,)
CONV_ARGS = [dict(stride=s, padding=p) for s, p in itertools.product([1, 2, (2, 1)], [0, 1, (1, 0)])]
CONV_SPECS = [
    harness.OpSpec(
        f"conv2d-s{a['stride']}-p{a['padding']}".replace(" ", ""),
        lambda x, w, b, a=a: conv2d(x, w, b, **a),
        lambda x, w, b, a=a: ref_conv2d(x, w, b, **a),
        [(X, W, B)],
        rtol=1e-4,
        atol=1e-5,
        budget=harness.Budget(4, 13),  # launches on a GPU today: cuDNN's passes, the bias and its sum
    )
    for a in CONV_ARGS
] + [
    harness.OpSpec(
        "conv2d-nobias-s2-p1",
        lambda x, w: conv2d(x, w, None, stride=2, padding=1),
        lambda x, w: ref_conv2d(x, w, None, stride=2, padding=1),
        [(X, W), ((1, 3, 4, 7), (2, 3, 1, 3))],
        rtol=1e-4,
        atol=1e-5,
        budget=harness.Budget(3, 10),
    )
]


@pytest.mark.parametrize("case", harness.cases(CONV_SPECS))
def test_conv2d_forward(case, backend):
    harness.check_forward(case, backend)


@pytest.mark.parametrize("case", harness.cases(CONV_SPECS))
def test_conv2d_backward(case, backend):
    harness.check_backward(case, backend)


@pytest.mark.parametrize("case", harness.cases(CONV_SPECS))
def test_conv2d_double_backward(case, backend):
    harness.check_double_backward(case, backend)


@pytest.mark.parametrize("limit", [None, 0], ids=["whole-batch", "one-image-chunks"])
@pytest.mark.parametrize("name", C.CONTRACTIONS + ("grid",))  # grid runs every geometry too
@pytest.mark.parametrize("stride,padding", [(1, 0), (2, 1), ((1, 2), (0, 1)), (3, 2)])
def test_every_contraction_matches_reference_and_gradcheck(name, stride, padding, limit):
    # Stride 3 with padding 2: some input columns are in no window (their gradient is 0)
    # and some kernel offsets reach the padding for some outputs (col2im clips them).
    x, w, b = _rand((3, 3, 5, 6), 1), _rand((4, 3, 3, 2), 2), _rand((4,), 3)
    want = ref_conv2d(x, w, b, stride, padding)
    xt, wt, bt = _t(x, True), _t(w, True), _t(b, True)
    with C.contraction(name), C.workspace_limit(limit):
        assert_close(conv2d(xt, wt, bt, stride, padding), want, rtol=1e-10, atol=1e-10)
        gradcheck(lambda x, w, b: conv2d(x, w, b, stride, padding), [xt, wt, bt])


@pytest.mark.parametrize("name", C.CONTRACTIONS)
def test_contractions_agree_in_float32(name):
    x, w = _t(_rand((3, 4, 7, 6), 4, np.float32), True), _t(_rand((5, 4, 3, 3), 5, np.float32), True)
    g = _t(_rand((3, 5, 7, 6), 6, np.float32))
    with C.contraction("batched"):
        y0 = conv2d(x, w, padding=1)
        want = fw.autograd.grad(y0, [x, w], g)
    with C.contraction(name):
        y = conv2d(x, w, padding=1)
        got = fw.autograd.grad(y, [x, w], g)
    assert y.dtype == np.float32 and y.shape == (3, 5, 7, 6)
    assert_close(y, y0, rtol=1e-5, atol=1e-5)
    for a, e in zip(got, want):
        assert a.dtype == np.float32
        assert_close(a, e, rtol=1e-4, atol=1e-4)


def test_contraction_setting():
    before = C.get_contraction()
    with C.contraction("gemm"):
        assert C.get_contraction() == "gemm"
    assert C.get_contraction() == before
    with pytest.raises(ValueError, match="unknown conv2d contraction 'fft'"):
        C.set_contraction("fft")


def test_conv2d_matches_scipy_correlate():
    signal = pytest.importorskip("scipy.signal")
    x, w = _rand((2, 3, 9, 8), 7), _rand((4, 3, 3, 5), 8)
    want = np.stack([np.stack([signal.correlate(x[n], w[o], mode="valid")[0] for o in range(4)]) for n in range(2)])
    assert_close(conv2d(_t(x), _t(w)), want, rtol=1e-10, atol=1e-10)


def test_conv2d_is_pytorch_argument_order_and_pairs():
    x, w, b = _rand((1, 2, 6, 6), 9), _rand((3, 2, 3, 3), 10), _rand((3,), 11)
    got = conv2d(_t(x), _t(w), _t(b), 2, 1)  # positional: stride, padding
    assert_close(got, ref_conv2d(x, w, b, 2, 1), rtol=1e-10, atol=1e-10)
    got = conv2d(_t(x), _t(w), bias=_t(b), stride=[1, 2], padding=(0, 1))
    assert_close(got, ref_conv2d(x, w, b, (1, 2), (0, 1)), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("wanted", ["x", "w", "b", "xw", "wb"])
def test_conv2d_computes_only_the_gradients_asked_for(wanted):
    x, w, b = _rand((2, 2, 5, 5), 12), _rand((3, 2, 3, 3), 13), _rand((3,), 14)
    full = [_t(a, True) for a in (x, w, b)]
    g = _t(_rand((2, 3, 5, 5), 15))
    want = fw.autograd.grad(conv2d(*full, padding=1), full, g)
    part = [_t(a, name in wanted) for a, name in zip((x, w, b), "xwb")]
    y = conv2d(*part, padding=1)
    got = fw.autograd.grad(y, [t for t in part if t.requires_grad], g)
    for a, e in zip(got, [e for e, name in zip(want, "xwb") if name in wanted]):
        assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_conv2d_saves_x_only_for_the_weight_gradient_and_w_only_for_the_input_gradient():
    x, w = _rand((2, 2, 5, 5), 16), _rand((3, 2, 3, 3), 17)
    node = conv2d(_t(x), _t(w, True)).grad_fn  # only w needs a grad: x is needed, w is not
    assert set(node._saved) == {"x"}
    node = conv2d(_t(x, True), _t(w)).grad_fn  # only x needs a grad: w is needed, x is not
    assert set(node._saved) == {"w"}
    node = conv2d(_t(x), _t(w), _t(np.zeros(3), True)).grad_fn  # bias only: nothing
    assert "_saved" not in node.__dict__
    with pytest.raises(AttributeError, match="did not save 'x'"):
        _ = conv2d(_t(x, True), _t(w)).grad_fn.x


def test_conv2d_backward_accepts_a_broadcast_gradient():
    """y.sum().backward() hands conv2d a zero-stride gradient; the products need a copy."""
    x, w = _t(_rand((2, 3, 6, 5), 18), True), _t(_rand((4, 3, 3, 3), 19), True)
    conv2d(x, w, padding=1).sum().backward()
    x2, w2 = _t(x.detach().numpy(), True), _t(w.detach().numpy(), True)
    gx, gw = fw.autograd.grad(conv2d(x2, w2, padding=1), [x2, w2], fw.ones(2, 4, 6, 5, dtype=fw.float64))
    assert_close(x.grad, gx, rtol=1e-12, atol=1e-12)
    assert_close(w.grad, gw, rtol=1e-12, atol=1e-12)


def test_inplace_on_conv_input_after_forward_is_caught_and_on_output_is_free():
    x0 = _t(_rand((1, 2, 4, 4), 20), True)
    w = _t(_rand((2, 2, 3, 3), 21), True)
    h = x0 * 1
    y = conv2d(h, w, padding=1)
    h.relu_()  # conv2d saved h for w's gradient
    with pytest.raises(RuntimeError, match="ConvolutionBackward0"):
        y.sum().backward()
    y = conv2d(x0 * 1, w, padding=1)
    z = y.relu_()  # conv2d did not save its output: relu_ after a conv is free and correct
    z.sum().backward()
    assert w.grad is not None


def test_conv2d_workspaces_are_counted_and_freed():
    """The im2col ``gemm`` buffers (padded input, cols); grid and Winograd: further below."""
    n, c, h, wd, co = 4, 3, 10, 10, 5
    x = _t(_rand((n, c, h, wd), 22, np.float32), True)
    w = _t(_rand((co, c, 3, 3), 23, np.float32), True)
    pad_bytes = n * c * (h + 2) * (wd + 2) * 4
    cols_bytes = n * c * 9 * h * wd * 4
    base = memory.breakdown()["workspace"]
    memory.reset_peak()
    # the whole batch in one chunk; backward uses the algorithm and limit of the forward call
    with memory.record_timeline() as tl, C.workspace_limit(None), C.contraction("gemm"):
        y = conv2d(x, w, padding=1)
    ws = [e for e in tl.events if e[3] == "workspace"]
    sizes = sorted(e[2] for e in ws if e[2] > 0)
    assert pad_bytes in sizes and cols_bytes in sizes, sizes
    assert sum(e[2] for e in ws) == 0, "forward left workspace allocated"
    assert memory.peak_breakdown()["workspace"] - base >= pad_bytes + cols_bytes
    assert memory.breakdown()["workspace"] == base
    memory.reset_peak()
    y.sum().backward()  # backward uses the limit in effect at the forward call
    assert memory.peak_breakdown()["workspace"] - base >= cols_bytes  # cols rebuilt for gw
    assert memory.breakdown()["workspace"] == base
    assert x.grad.shape == x.shape and w.grad.shape == w.shape


# --- the workspace limit: the batch in chunks ------------------------------------------------
#
# What a conv2d may hold as workspace (category ``workspace``) at any moment, as the module
# docstring states: at most ``max(limit, one image's workspace)`` of batch-sized buffers
# (padded chunk, im2col columns, GEMM output before its transpose, transposed output
# gradient, per-offset col2im buffer), plus at most ONE weight-sized buffer (in backward:
# the transposed weight for the input gradient, or the partial weight gradient of a
# chunk; in forward, only for a strided weight, its contiguous copy). There is no
# batch-sized padded buffer outside the limit: the input is padded chunk by chunk, and
# the input gradient is allocated once at the input's exact shape (``gradients``).

LIMIT = 256 * 2**10


def _workspace_during(fn):
    """``(result, peak workspace bytes above the start, workspace allocation sizes,
    allocation sizes per category)`` of ``fn()``; checks every workspace is freed."""
    base = memory.breakdown()["workspace"]
    memory.reset_peak()
    with memory.record_timeline() as tl:
        result = fn()
    assert memory.breakdown()["workspace"] == base, "workspace left allocated"
    peak = memory.peak_breakdown()["workspace"] - base
    by_cat = {}
    for e in tl.events:
        if e[2] > 0:
            by_cat.setdefault(e[3], []).append(e[2])
    return result, peak, by_cat.get("workspace", []), by_cat


def _conv_case(n, c, hw, co, seed=40):
    x = _t(_rand((n, c, hw, hw), seed, np.float32), True)
    w = _t(_rand((co, c, 3, 3), seed + 1, np.float32), True)
    return x, w


def _one_image_bytes(name, c, co, hw, stride, padding, g_strided=False):
    """Workspace one image needs in the costliest step of ``name`` (float32, 3x3);
    ``g_strided``: the output gradient is not contiguous (``y.sum().backward()``)."""
    ho = (hw + 2 * padding - 3) // stride + 1
    pad = c * (hw + 2 * padding) ** 2 * 4 if padding else 0
    k, p = c * 9, ho * ho
    if name == "gemm":
        return pad + (k + co) * p * 4
    # batched: cols + per-image weight products (+ a contiguous copy of a strided gradient)
    return pad + (k * p + co * k + (co * p if g_strided else 0)) * 4


@pytest.mark.parametrize("name", ["gemm", "batched"])
@pytest.mark.parametrize("stride,padding", [(1, 1), (2, 1), (1, 0)])
def test_conv2d_workspace_stays_within_the_limit_forward_and_backward(name, stride, padding):
    n, c, hw = 64, 8, 16
    x, w = _conv_case(n, c, hw, c)
    ho = (hw + 2 * padding - 3) // stride + 1
    full_cols = n * c * 9 * ho * ho * 4
    assert full_cols >= 4 * LIMIT  # the unchunked im2col would need 4.5x to 18x the limit
    g = _t(_rand((n, c, ho, ho), 42, np.float32))
    with C.contraction(name), C.workspace_limit(LIMIT):
        y, peak, allocs, _ = _workspace_during(lambda: conv2d(x, w, stride=stride, padding=padding))
        assert peak <= LIMIT, (peak, LIMIT)  # contiguous weight: nothing on top of the limit
        assert max(allocs) <= LIMIT
        assert sum(allocs) >= full_cols  # every column was built, a chunk at a time
        assert peak > LIMIT // 2  # chunks fill the budget rather than take one image each
        (gx, gw), peak, allocs, by_cat = _workspace_during(lambda: fw.autograd.grad(y, [x, w], g))
    assert peak <= LIMIT + w.nbytes, (peak, LIMIT)
    assert max(allocs) <= LIMIT
    # the gradients: exactly the input's and the weight's bytes, no padded buffer behind them
    assert max(by_cat["gradients"]) == x.nbytes and x.nbytes in by_cat["gradients"]
    assert gx.shape == x.shape and gw.shape == w.shape
    with C.contraction(name), C.workspace_limit(None):
        y0 = conv2d(x, w, stride=stride, padding=padding)
        gx0, gw0 = fw.autograd.grad(y0, [x, w], g)
    assert_close(y, y0, rtol=1e-5, atol=1e-5)
    assert_close(gx, gx0, rtol=1e-5, atol=1e-5)
    assert_close(gw, gw0, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", ["gemm", "batched"])
def test_conv2d_takes_one_image_per_chunk_when_one_image_exceeds_the_limit(name):
    n, c, hw = 5, 4, 12
    x, w = _conv_case(n, c, hw, 6, seed=43)
    one = _one_image_bytes(name, c, 6, hw, 1, 1)
    cols_one = c * 9 * hw * hw * 4
    with C.contraction(name), C.workspace_limit(1000):  # one image needs ~30x more
        y, peak, allocs, _ = _workspace_during(lambda: conv2d(x, w, padding=1))
        assert allocs.count(cols_one) == n  # one im2col buffer per image
        assert peak <= one
        _, peak, allocs, _ = _workspace_during(lambda: y.sum().backward())
    assert allocs.count(cols_one) == n
    assert peak <= _one_image_bytes(name, c, 6, hw, 1, 1, g_strided=True) + w.nbytes
    assert_close(y, ref_conv2d(x.detach().numpy(), w.detach().numpy(), padding=1), rtol=1e-4, atol=1e-4)


def test_conv2d_without_limit_builds_the_whole_batch_im2col():
    n, c, hw = 6, 4, 8
    x, w = _conv_case(n, c, hw, 4, seed=44)
    with C.contraction("gemm"), C.workspace_limit(None):
        _, peak, allocs, _ = _workspace_during(lambda: conv2d(x, w, padding=1))
    assert n * c * 9 * hw * hw * 4 in allocs


@pytest.mark.parametrize("name", C.CONTRACTIONS)
def test_conv2d_results_do_not_depend_on_the_limit(name):
    """float32 forward, input gradient and weight gradient under several limits, down to
    one image per chunk, against the whole batch at once: equal within float32 rounding
    (only the weight gradient's sum over the batch changes order)."""
    n, c, hw, co = 13, 6, 10, 5  # 13 images: chunks of unequal sizes
    x, w = _conv_case(n, c, hw, co, seed=45)
    b = _t(_rand((co,), 46, np.float32), True)
    g = _t(_rand((n, co, hw, hw), 47, np.float32))
    results = {}
    for limit in (None, 4 * 2**20, 96 * 2**10, 40 * 2**10, 0):
        with C.contraction(name), C.workspace_limit(limit):
            y = conv2d(x, w, b, padding=1)
            results[limit] = [y] + list(fw.autograd.grad(y, [x, w, b], g))
    want = results.pop(None)
    for limit, got in results.items():
        for a, e, what in zip(got, want, ("output", "grad x", "grad w", "grad b")):
            scale = float(np.abs(e.detach().numpy()).max())
            assert_close(a, e, rtol=1e-5, atol=1e-6 * scale, msg=f"{what}, limit {limit}")


def test_conv2d_backward_uses_the_limit_in_effect_at_forward():
    n, c, hw = 8, 4, 12
    x, w = _conv_case(n, c, hw, 4, seed=48)
    with C.contraction("gemm"), C.workspace_limit(0):
        y = conv2d(x, w, padding=1)
    with C.workspace_limit(None):
        _, peak, allocs, _ = _workspace_during(lambda: y.sum().backward())
    assert peak <= _one_image_bytes("gemm", c, 4, hw, 1, 1, g_strided=True) + w.nbytes
    assert allocs.count(c * 9 * hw * hw * 4) == n


def test_conv2d_strided_weight_copy_is_the_only_extra_in_forward():
    n, c, hw = 16, 4, 12
    x, _ = _conv_case(n, c, hw, 4, seed=49)
    w = _t(_rand((4, c, 3, 3), 50, np.float32).transpose(1, 0, 2, 3).copy().transpose(1, 0, 2, 3))
    assert not w.numpy().flags.c_contiguous
    limit = 32 * 2**10
    with C.contraction("gemm"), C.workspace_limit(limit):
        y, peak, _, _ = _workspace_during(lambda: conv2d(x, w, padding=1))
    assert limit // 2 < peak <= limit + w.nbytes
    assert_close(y, ref_conv2d(x.detach().numpy(), w.numpy(), padding=1), rtol=1e-4, atol=1e-4)


def test_conv2d_kernel_offsets_that_reach_only_padding():
    """A 1x1 input under a 3x3 kernel with padding 1: 8 of the 9 offsets see only zeros."""
    x, w = _rand((3, 2, 1, 1), 51), _rand((2, 2, 3, 3), 52)
    with C.workspace_limit(0):
        assert_close(conv2d(_t(x), _t(w), padding=1), ref_conv2d(x, w, padding=1), rtol=1e-10, atol=1e-10)
        gradcheck(lambda x, w: conv2d(x, w, padding=1), [_t(x, True), _t(w, True)])


def test_conv2d_and_pools_on_an_empty_batch():
    x, w = _t(np.zeros((0, 2, 5, 5), np.float32), True), _t(_rand((3, 2, 3, 3), 53, np.float32), True)
    y = conv2d(x, w, padding=1)
    assert y.shape == (0, 3, 5, 5)
    gx, gw = fw.autograd.grad(y, [x, w], fw.zeros(0, 3, 5, 5))
    assert gx.shape == x.shape and gw.shape == w.shape and not gw.numpy().any()
    for pool in (lambda t: max_pool2d(t, 3, 2, 1), lambda t: avg_pool2d(t, 3, 2, 1)):
        p = pool(x)
        assert p.shape == (0, 2, 3, 3)
        (gp,) = fw.autograd.grad(p, [x], fw.zeros(0, 2, 3, 3))
        assert gp.shape == x.shape


def test_workspace_limit_setting():
    assert C.DEFAULT_WORKSPACE_LIMIT == "auto"
    before = C.get_workspace_limit()
    with C.workspace_limit("auto"):
        assert C.get_workspace_limit() == "auto"
    with C.workspace_limit(1024):
        assert C.get_workspace_limit() == 1024
        with C.workspace_limit(None):
            assert C.get_workspace_limit() is None
        assert C.get_workspace_limit() == 1024
    assert C.get_workspace_limit() == before
    try:
        C.set_workspace_limit(2**20)
        assert C.get_workspace_limit() == 2**20
        C.set_workspace_limit(np.int64(0))
        assert C.get_workspace_limit() == 0 and type(C.get_workspace_limit()) is int
    finally:
        C.set_workspace_limit(before)
    with pytest.raises(ValueError, match="workspace limit must be >= 0"):
        C.set_workspace_limit(-1)
    for bad in (1.5, True, "4M"):
        with pytest.raises(TypeError, match="workspace limit must be an int"):
            C.workspace_limit(bad).__enter__()
    assert C.get_workspace_limit() == before


@pytest.mark.parametrize(
    "n,per_image,limit,sizes",
    [
        (10, 100, None, [10]),
        (10, 100, 10**6, [10]),
        (10, 100, 300, [3, 3, 3, 1]),  # as few chunks as fit, then as even as possible
        (13, 100, 500, [5, 5, 3]),
        (4, 100, 50, [1, 1, 1, 1]),  # one image over the limit: one per chunk
        (4, 100, 0, [1, 1, 1, 1]),
        (0, 100, 300, []),
    ],
)
def test_chunks(n, per_image, limit, sizes):
    got = C._chunks(n, per_image, limit)
    assert [s.stop - s.start for s in got] == sizes
    assert [s.start for s in got] == [sum(sizes[:i]) for i in range(len(sizes))]


@pytest.mark.parametrize(
    "pool,args,limit",
    [
        (max_pool2d, (3, 2, 1), 32 * 2**10),  # -inf padded input + 2 masks per chunk
        (max_pool2d, (2,), 4 * 2**10),  # masks only
        (avg_pool2d, (3, 2, 1), 32 * 2**10),  # zero padded input per chunk; backward: none
    ],
)
def test_pool_workspace_stays_within_the_limit(pool, args, limit):
    """Pooling is chunked by the same limit, with nothing on top of it, and its results
    do not depend on it (bit for bit: every value is computed in the same order)."""
    n, c, hw = 32, 8, 16
    x = _t(_rand((n, c, hw, hw), 54, np.float32), True)
    with C.workspace_limit(None):  # the whole batch at once
        y0, whole, _, _ = _workspace_during(lambda: pool(x, *args))
    assert whole > 3 * limit
    g = _t(_rand(y0.shape, 55, np.float32))
    (gx0,) = fw.autograd.grad(y0, [x], g)
    with C.workspace_limit(limit):
        y, peak, _, _ = _workspace_during(lambda: pool(x, *args))
        assert peak <= limit
        (gx,), peak, allocs, by_cat = _workspace_during(lambda: fw.autograd.grad(y, [x], g))
    assert peak <= limit
    assert max(by_cat["gradients"]) == x.nbytes  # exact shape, nothing padded
    np.testing.assert_array_equal(y.detach().numpy(), y0.detach().numpy())
    np.testing.assert_array_equal(gx.numpy(), gx0.numpy())


@pytest.mark.parametrize(
    "xshape,wshape,kw,err,match",
    [
        ((1, 3, 5, 5), (2, 4, 3, 3), {}, RuntimeError, "input has 3 channels .* expects 4"),
        (
            (1, 3, 2, 2),
            (2, 3, 3, 3),
            {},
            RuntimeError,
            r"padded input size per channel: \(2 x 2\). Kernel size: \(3 x 3\)",
        ),
        ((1, 3, 2, 2), (2, 3, 5, 5), {"padding": 1}, RuntimeError, r"\(4 x 4\). Kernel size: \(5 x 5\)"),
        ((3, 5, 5), (2, 3, 3, 3), {}, RuntimeError, "expected a 4-D input"),
        ((1, 3, 5, 5), (2, 3, 3), {}, RuntimeError, "expected a 4-D weight"),
        ((1, 3, 5, 5), (2, 3, 3, 3), {"stride": 0}, ValueError, "stride must be >= 1"),
        ((1, 3, 5, 5), (2, 3, 3, 3), {"padding": -1}, ValueError, "padding must be >= 0"),
        ((1, 3, 5, 5), (2, 3, 3, 3), {"stride": (1, 2, 3)}, ValueError, "int or a pair"),
        ((1, 3, 5, 5), (2, 3, 3, 3), {"stride": 1.5}, TypeError, "int or a pair"),
    ],
)
def test_conv2d_errors(xshape, wshape, kw, err, match):
    with pytest.raises(err, match=match):
        conv2d(_t(_rand(xshape)), _t(_rand(wshape)), **kw)


def test_conv2d_bias_and_dtype_errors():
    x, w = _t(_rand((1, 3, 5, 5))), _t(_rand((2, 3, 3, 3)))
    with pytest.raises(RuntimeError, match=r"bias must be a float64 vector of shape \(2,\)"):
        conv2d(x, w, _t(_rand((3,))))
    with pytest.raises(TypeError, match="same floating dtype"):
        conv2d(x, _t(_rand((2, 3, 3, 3), dtype=np.float32)))


# --- pooling -----------------------------------------------------------------------------

POOL_ARGS = [
    dict(kernel_size=2),  # stride defaults to the kernel
    dict(kernel_size=3, stride=2, padding=1),  # overlapping windows, padding
    dict(kernel_size=(2, 3), stride=(1, 2), padding=(1, 0)),  # non-square everything
    dict(kernel_size=3, stride=1),
]
PX = (2, 2, 5, 6)


def _pool_specs(name, fn, ref, budget):
    return [
        harness.OpSpec(f"{name}-{i}", lambda x, a=a: fn(x, **a), lambda x, a=a: ref(x, **a), [(PX,)], budget=budget)
        for i, a in enumerate(POOL_ARGS)
    ]


POOL_SPECS = (
    # Launch budgets on a GPU: what the GPU pooling paths make today.
    _pool_specs(
        "max_pool2d", max_pool2d, lambda x, **a: ref_max_pool2d(x, a.pop("kernel_size"), **a), harness.Budget(6, 9)
    )
    + _pool_specs(
        "avg_pool2d", avg_pool2d, lambda x, **a: ref_avg_pool2d(x, a.pop("kernel_size"), **a), harness.Budget(4, 8)
    )
    + [
        harness.OpSpec(
            f"adaptive_avg_pool2d-{s}".replace(" ", ""),
            lambda x, s=s: adaptive_avg_pool2d(x, s),
            lambda x, s=s: ref_adaptive_avg_pool2d(x, s),
            [(PX,)],
            budget=harness.Budget(41, 13),
        )
        for s in [1, (1, 3), (5, 2), (2, 4), 3]  # divisible and not: both paths
    ]
)


@pytest.mark.parametrize("case", harness.cases(POOL_SPECS))
def test_pool_forward(case, backend):
    harness.check_forward(case, backend)


@pytest.mark.parametrize("case", harness.cases(POOL_SPECS))
def test_pool_backward(case, backend):
    harness.check_backward(case, backend)


@pytest.mark.parametrize("case", harness.cases(POOL_SPECS))
def test_pool_double_backward(case, backend):
    harness.check_double_backward(case, backend)


def test_max_pool_saves_one_byte_per_output_and_not_the_input():
    x = _t(_rand((2, 3, 8, 8), 30, np.float32), True)
    h = x * 1
    before = memory.saved_bytes()
    y = max_pool2d(h, 2)
    node = y.grad_fn
    assert set(node._saved) == {"indices"}
    assert node.indices.dtype == np.uint8 and node.indices.shape == y.shape
    assert memory.saved_bytes() - before == y.numel()  # 1 byte per output, 16x less than h
    h.relu_()  # the pool did not save h: modifying it after the pool is fine
    y.sum().backward()
    del h  # relu_ saved its own output (h); the pool's indices went with backward
    assert memory.saved_bytes() == before
    with memory.record_timeline() as tl, fw.no_grad():
        y = max_pool2d(x, 2)  # no gradient wanted: no index array at all
    assert [e[2] for e in tl.events if e[2] > 0] == [y.nbytes, y.numel(), y.numel()]  # out, 2 bool masks


def test_max_pool_gradient_goes_to_the_first_maximum_and_nan_propagates():
    x = _t(np.array([[[[1.0, 3.0, 3.0, 0.0], [3.0, 2.0, np.nan, 5.0]]]]), True)
    y = max_pool2d(x, 2)
    assert np.isnan(y.detach().numpy()[0, 0, 0, 1]) and y.detach().numpy()[0, 0, 0, 0] == 3.0
    y.backward(fw.ones(1, 1, 1, 2, dtype=fw.float64))
    np.testing.assert_array_equal(x.grad.numpy()[0, 0], [[0, 1, 0, 0], [0, 0, 1, 0]])


def test_max_pool_integers_and_padding_never_wins():
    x = np.arange(-20, 0, dtype=np.int64).reshape(1, 1, 4, 5)
    got = max_pool2d(_t(x), 3, 2, 1)
    np.testing.assert_array_equal(got.numpy(), ref_max_pool2d(x.astype(float), 3, 2, 1))
    assert got.dtype == np.int64


def test_avg_pool_counts_padding_zeros():
    x = np.ones((1, 1, 2, 2))
    np.testing.assert_allclose(
        avg_pool2d(_t(x), 2, 1, 1).numpy()[0, 0], [[0.25, 0.5, 0.25], [0.5, 1, 0.5], [0.25, 0.5, 0.25]]
    )


def test_adaptive_avg_pool_none_keeps_a_size_and_1_is_the_global_mean():
    x = _rand((2, 3, 4, 6), 31)
    assert_close(adaptive_avg_pool2d(_t(x), 1), x.mean(axis=(2, 3), keepdims=True), rtol=1e-12)
    assert adaptive_avg_pool2d(_t(x), (None, 2)).shape == (2, 3, 4, 2)


def test_pool_workspace_is_counted():
    x = _t(_rand((2, 3, 6, 6), 32, np.float32), True)
    with memory.record_timeline() as tl, C.workspace_limit(None):
        y = max_pool2d(x, 3, 2, 1)
    ws = [e[2] for e in tl.events if e[3] == "workspace"]
    assert 2 * 3 * 8 * 8 * 4 in ws  # the -inf padded buffer
    assert sum(ws) == 0
    y.sum().backward()


@pytest.mark.parametrize(
    "fn,args,err,match",
    [
        (max_pool2d, (3, 1, 2), ValueError, "pad should be at most half of kernel size"),
        (avg_pool2d, (2, 2, 2), ValueError, "pad should be at most half of kernel size"),
        (max_pool2d, (7,), RuntimeError, "Kernel size can't be greater than actual input size"),
        (avg_pool2d, ((2, 7),), RuntimeError, "Kernel size can't be greater"),
        (max_pool2d, (0,), ValueError, "kernel_size must be >= 1"),
        (adaptive_avg_pool2d, (0,), ValueError, "output_size must be >= 1"),
        (adaptive_avg_pool2d, ((1, 2, 3),), ValueError, "output_size must be an int or a pair"),
    ],
)
def test_pool_errors(fn, args, err, match):
    with pytest.raises(err, match=match):
        fn(_t(_rand((1, 2, 5, 6))), *args)


def test_pool_rejects_3d_input():
    with pytest.raises(RuntimeError, match="expected a 4-D input"):
        max_pool2d(_t(_rand((2, 5, 6))), 2)
    with pytest.raises(RuntimeError, match="expected a 4-D input"):
        adaptive_avg_pool2d(_t(_rand((2, 5, 6))), 1)


def test_auto_limit_is_half_the_input_capped_at_4_mib():
    small = _t(_rand((2, 3, 8, 8), 40, np.float32))
    big = fw.zeros(64, 16, 64, 64)
    assert C._resolve_limit("auto", small) == small.nbytes // 2
    assert C._resolve_limit("auto", big) == C.AUTO_WORKSPACE_CAP
    assert C._resolve_limit(1234, big) == 1234 and C._resolve_limit(None, big) is None


@pytest.mark.parametrize("stride,cout", [(1, 3), (2, 3), (1, 5)])
def test_input_gradient_overwrites_a_dead_output_gradient_under_policy_on(stride, cout):
    """Stride-1 convs that keep the channel count write the input gradient back over the
    (dead) output gradient under policy on; other shapes allocate. Values never change."""
    grads = {}
    for policy in ("off", "on"):
        fw.manual_seed(1)
        x = fw.randn(6, 3, 8, 8, dtype=fw.float64, requires_grad=True)
        w = fw.randn(cout, 3, 3, 3, dtype=fw.float64, requires_grad=True)
        with fw.inplace.policy(policy), C.workspace_limit(0):  # one image per chunk
            y = conv2d(x, w, stride=stride, padding=1).tanh()
            # SumBackward0 hands tanh a broadcast view (never reused): tanh allocates under
            # both policies, and its fresh gradient is exclusive when it reaches conv2d.
            with memory.record_timeline() as tl:
                y.sum().backward()
        allocated = sum(e[2] for e in tl.events if e[2] > 0 and e[3] == "gradients")
        grads[policy] = (x.grad.numpy().copy(), w.grad.numpy().copy(), allocated)
    np.testing.assert_allclose(grads["on"][0], grads["off"][0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grads["on"][1], grads["off"][1], rtol=1e-12, atol=1e-12)
    x_bytes = 6 * 3 * 8 * 8 * 8
    saved = x_bytes if (stride == 1 and cout == 3) else 0
    assert grads["off"][2] - grads["on"][2] == saved, grads


# --- the stride-1 algorithms (grid, Winograd) and the per-layer choice ---------------------

STRIDE1 = C.GRID_AND_WINOGRAD


def _forced(name, **args):
    """conv2d with algorithm ``name`` forced for forward and backward (recorded with the node)."""

    def fn(x, w, b=None):
        with C.contraction(name):
            return conv2d(x, w, b, **args)

    return fn


# Through the op harness: float32 forward vs the float64 loops, float64 gradcheck, inputs
# in three memory layouts; sizes that are not whole Winograd tiles, padding 0 to 3 (3 > kh-1:
# the transposed convolution of the input gradient crops the output gradient). grid and
# F(2x2) meet im2col's tolerances; F(4x4) carries several times im2col's float32 rounding
# (its transforms scale by up to 8 and 1/15), the price of "fast" mode.
# Launches on a GPU today, forward and backward, per forced algorithm.
STRIDE1_BUDGETS = {
    "grid": harness.Budget(11, 31),
    "winograd2": harness.Budget(51, 91),
    "winograd4": harness.Budget(39, 75),
}
STRIDE1_SPECS = [
    harness.OpSpec(
        f"conv2d-{name}-p{p}",
        _forced(name, padding=p),
        lambda x, w, b, p=p: ref_conv2d(x, w, b, padding=p),
        [((2, 3, 5, 6), (4, 3, 3, 3), (4,))] + ([((1, 2, 4, 3), (3, 2, 3, 2), (3,))] if name == "grid" else []),
        rtol=1e-4,
        atol=1e-4 if name == "winograd4" else 1e-5,
        budget=STRIDE1_BUDGETS[name],
    )
    for name in STRIDE1
    for p in (0, 1, (2, 1), 3)
]


@pytest.mark.parametrize("case", harness.cases(STRIDE1_SPECS))
def test_stride1_algorithms_forward(case, backend):
    harness.check_forward(case, backend)


@pytest.mark.parametrize("case", harness.cases(STRIDE1_SPECS))
def test_stride1_algorithms_backward(case, backend):
    harness.check_backward(case, backend)


@pytest.mark.parametrize("case", harness.cases(STRIDE1_SPECS))
def test_stride1_algorithms_double_backward(case, backend):
    harness.check_double_backward(case, backend)


@pytest.mark.parametrize("limit", [None, 0, 3000], ids=["whole-batch", "one-image-chunks", "uneven-chunks"])
@pytest.mark.parametrize("name", STRIDE1)
@pytest.mark.parametrize(
    "hw,padding", [((8, 8), 1), ((7, 6), 1), ((9, 5), 0), ((5, 7), (2, 1)), ((4, 4), 3), ((1, 1), 1)]
)
def test_stride1_algorithms_match_reference_and_gradcheck(name, hw, padding, limit):
    x, w, b = _rand((5, 3) + hw, 60), _rand((4, 3, 3, 3), 61), _rand((4,), 62)
    want = ref_conv2d(x, w, b, 1, padding)
    xt, wt, bt = _t(x, True), _t(w, True), _t(b, True)
    with C.contraction(name), C.workspace_limit(limit):
        assert_close(conv2d(xt, wt, bt, 1, padding), want, rtol=1e-10, atol=1e-10)
        gradcheck(lambda x, w, b: conv2d(x, w, b, 1, padding), [xt, wt, bt])


@pytest.mark.parametrize("name,rel", [("grid", 2e-6), ("winograd2", 2e-6), ("winograd4", 5e-6)])
def test_stride1_algorithms_float32_error_on_a_resnet_layer(name, rel):
    """float32 forward, input and weight gradient against float64, relative to the largest
    value of each. Measured: grid 3-6e-7, F(2x2) 2-3e-7, F(4x4) 1-2e-6 (5e-6 with Lavin
    and Gray's points 0, +-1, +-2); the bounds leave room for other BLAS builds."""
    x = _rand((6, 32, 16, 16), 63, np.float32)
    w = (_rand((32, 32, 3, 3), 64) * 0.1).astype(np.float32)
    g = _rand((6, 32, 16, 16), 65, np.float32)
    xt, wt = _t(x, True), _t(w, True)
    with C.contraction(name):
        y = conv2d(xt, wt, padding=1)
        gx, gw = fw.autograd.grad(y, [xt, wt], _t(g))
    x64, w64, g64 = _t(x.astype(np.float64), True), _t(w.astype(np.float64), True), _t(g.astype(np.float64))
    with C.contraction("gemm"):
        y64 = conv2d(x64, w64, padding=1)
        gx64, gw64 = fw.autograd.grad(y64, [x64, w64], g64)
    for what, got, want in (("y", y, y64), ("grad x", gx, gx64), ("grad w", gw, gw64)):
        got, want = got.detach().numpy(), want.detach().numpy()
        assert got.dtype == np.float32
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= rel, (what, err)


@pytest.mark.parametrize("m", [2, 4])
def test_winograd_transforms_compute_the_correlation_exactly(m):
    """``A^T [(G g) * (B^T d)] = correlation of d with g`` in exact rational arithmetic for
    the 1-D matrices (the 2-D algorithm is their Kronecker product): every entry is a
    fraction with a small denominator, so ``limit_denominator`` recovers it exactly."""
    from fractions import Fraction

    from framework.ops.conv_algorithms.winograd import _MATRICES

    mats = {k: [[Fraction(v).limit_denominator(100) for v in row] for row in rows] for k, rows in _MATRICES[m].items()}
    bt, g, at = mats["BT"], mats["G"], mats["AT"]
    a = m + 2
    for i, k, j in itertools.product(range(m), range(3), range(a)):
        # y[i] = sum_k g[k] d[i + k]: the coefficient of g[k] d[j] must be [j == i + k]
        assert sum(at[i][t] * g[t][k] * bt[t][j] for t in range(a)) == (j == i + k), (i, k, j)


@pytest.mark.parametrize(
    "name,xshape,wshape,stride,match",
    [
        ("winograd2", (1, 2, 6, 6), (3, 2, 3, 3), 2, r"contraction 'winograd2' needs a 3x3 kernel and stride 1"),
        ("winograd4", (1, 2, 6, 6), (3, 2, 3, 3), (1, 2), "'winograd4' needs a 3x3 kernel and stride 1"),
        ("winograd2", (1, 2, 6, 6), (3, 2, 5, 5), 1, r"kernel \(5, 5\)"),
    ],
)
def test_forcing_an_algorithm_on_a_layer_it_cannot_run_is_a_clear_error(name, xshape, wshape, stride, match):
    with C.contraction(name), pytest.raises(ValueError, match=match):
        conv2d(_t(_rand(xshape)), _t(_rand(wshape)), stride=stride, padding=1)
    with pytest.raises(ValueError, match=match):
        C.explain(xshape, wshape, stride, 1, name=name)


def test_auto_and_fast_choose_per_layer_by_the_documented_rules():
    assert C.get_contraction() == "auto" and C.CHOOSING == ("auto", "fast")
    stage3, stage2, stage1 = (
        ((64, 64, 8, 8), (64, 64, 3, 3)),
        ((64, 32, 16, 16), (32, 32, 3, 3)),
        ((64, 16, 32, 32), (16, 16, 3, 3)),
    )
    plan = C.explain(*stage3, 1, 1)
    assert plan[:3] == ("winograd2",) * 3 and plan.rule.startswith("auto: 3x3, stride 1")
    assert C.explain(*stage2, 1, 1)[:3] == ("winograd2",) * 3
    assert C.explain(*stage1, 1, 1)[:3] == ("grid",) * 3  # < 32 channels
    assert C.explain((64, 64, 8, 8), (64, 64, 1, 1), 1, 0)[:3] == ("grid",) * 3  # not 3x3
    assert C.explain((64, 16, 32, 32), (32, 16, 3, 3), 2, 1)[:3] == ("grid", "grid", "gemm")  # strided
    assert C.explain(*stage3, 1, 1, name="fast")[:3] == ("winograd4",) * 3
    assert C.explain(*stage2, 1, 1, name="fast")[:3] == ("winograd4",) * 3
    assert C.explain(*stage1, 1, 1, name="fast")[:3] == ("grid",) * 3
    assert C.explain((64, 16, 32, 32), (32, 16, 3, 3), 2, 1, name="batched")[:3] == ("batched",) * 3
    with C.contraction("einsum"):
        assert C.explain((1, 2, 5, 5), (2, 2, 3, 3)).rule == "forced: contraction('einsum')"
    # the op records the plan it ran with, so backward uses the same algorithms
    x, w = _t(_rand((2, 64, 6, 6), 66), True), _t(_rand((64, 64, 3, 3), 67), True)
    node = conv2d(x, w, padding=1).grad_fn
    assert node.plan == C.explain(x.shape, w.shape, 1, 1) and node.plan.forward == "winograd2"
    with C.contraction("fast"):
        assert conv2d(x, w, padding=1).grad_fn.plan.forward == "winograd4"


@pytest.mark.parametrize("mode", C.CHOOSING)
def test_choosing_modes_match_the_reference_on_resnet_shaped_layers(mode):
    """Both modes on a small ResNet: 3x3 convs, stride 1 and 2, 16 to 64 channels."""
    for c, co, hw, s in [(3, 16, 8, 1), (16, 16, 8, 1), (16, 32, 8, 2), (32, 32, 4, 1), (64, 64, 4, 1)]:
        x, w = _rand((2, c, hw, hw), 80 + c), _rand((co, c, 3, 3), 90 + co)
        xt, wt = _t(x, True), _t(w, True)
        with C.contraction(mode):
            y = conv2d(xt, wt, stride=s, padding=1)
            assert_close(y, ref_conv2d(x, w, stride=s, padding=1), rtol=1e-10, atol=1e-10)
            # finite differences: element by element on the small cases, along random
            # directions where the weights have thousands of elements
            gradcheck(lambda x, w, s=s: conv2d(x, w, stride=s, padding=1), [xt, wt], fast_mode=c >= 16)


@pytest.mark.parametrize("name", STRIDE1)
def test_stride1_algorithm_results_do_not_depend_on_the_limit(name):
    """As for im2col (above); F(4x4) sums its weight gradient over the batch in the
    transformed domain, so the chunking moves its rounding ~10x more."""
    rel = 1e-5 if name == "winograd4" else 1e-6
    n, c, hw, co = 13, 6, 10, 5
    x, w = _conv_case(n, c, hw, co, seed=68)
    g = _t(_rand((n, co, hw, hw), 69, np.float32))
    results = {}
    for limit in (None, 96 * 2**10, 40 * 2**10, 0):
        with C.contraction(name), C.workspace_limit(limit):
            y = conv2d(x, w, padding=1)
            results[limit] = [y] + list(fw.autograd.grad(y, [x, w], g))
    want = results.pop(None)
    for limit, got in results.items():
        for a, e, what in zip(got, want, ("output", "grad x", "grad w"), strict=True):
            scale = float(np.abs(e.detach().numpy()).max())
            assert_close(a, e, rtol=1e-5, atol=rel * scale, msg=f"{what}, limit {limit}")


@pytest.mark.parametrize("stride,padding", [(2, 1), ((2, 3), (0, 2))])
def test_strided_grid_workspace_stays_within_the_limit(stride, padding):
    """Strided, grid holds its input's phases, cols and the product per image, chunked
    like stride 1; the input gradient is im2col's (its own bound)."""
    n, c, hw = 64, 8, 16
    x, w = _conv_case(n, c, hw, c, seed=72)
    with C.contraction("grid"), C.workspace_limit(LIMIT):
        y, peak, allocs, _ = _workspace_during(lambda: conv2d(x, w, stride=stride, padding=padding))
        assert peak <= LIMIT + w.nbytes, (peak, LIMIT)
        assert peak > LIMIT // 2  # chunks fill the budget rather than take one image each
        g = _t(_rand(y.shape, 73, np.float32))
        (gx, gw), peak, allocs, by_cat = _workspace_during(lambda: fw.autograd.grad(y, [x, w], g))
    assert peak <= LIMIT + w.nbytes, (peak, LIMIT)
    assert sorted(by_cat["gradients"]) == sorted([x.nbytes, w.nbytes])
    with C.contraction("gemm"), C.workspace_limit(None):
        y0 = conv2d(x, w, stride=stride, padding=padding)
        gx0, gw0 = fw.autograd.grad(y0, [x, w], g)
    assert_close(y, y0, rtol=1e-4, atol=1e-4)
    assert_close(gx, gx0, rtol=1e-4, atol=1e-4)
    assert_close(gw, gw0, rtol=1e-4, atol=1e-3)


def _stride1_extra_bytes(name, w):
    """What a stride-1 algorithm may hold on top of the limit (module docstrings): grid one
    weight-sized buffer; Winograd F(m x m) two transformed weights of (m+2)^2/9 weight sizes
    (the weight gradient's dU and a chunk's partial dU; forward: the transformed weight and,
    while it is made, one weight-sized copy)."""
    if name == "grid":
        return w.nbytes
    m = int(name[-1])
    return 2 * (m + 2) ** 2 * w.nbytes // 9


@pytest.mark.parametrize("name", STRIDE1)
@pytest.mark.parametrize("padding", [1, 0])
def test_stride1_workspace_stays_within_the_limit_forward_and_backward(name, padding):
    n, c, hw = 64, 8, 16
    x, w = _conv_case(n, c, hw, c, seed=70)
    ho = hw + 2 * padding - 2
    g = _t(_rand((n, c, ho, ho), 71, np.float32))
    extra = _stride1_extra_bytes(name, w)
    with C.contraction(name), C.workspace_limit(LIMIT):
        y, peak, allocs, _ = _workspace_during(lambda: conv2d(x, w, padding=padding))
        assert peak <= LIMIT + extra, (peak, LIMIT, extra)
        assert peak > LIMIT // 2  # chunks fill the budget rather than take one image each
        (gx, gw), peak, allocs, by_cat = _workspace_during(lambda: fw.autograd.grad(y, [x, w], g))
    assert peak <= LIMIT + extra, (peak, LIMIT, extra)
    assert max(allocs) <= LIMIT
    # the gradients: exactly the input's and the weight's bytes, no padded buffer behind them
    assert sorted(by_cat["gradients"]) == sorted([x.nbytes, w.nbytes])
    with C.workspace_limit(None):
        y0 = conv2d(x, w, padding=padding)
        gx0, gw0 = fw.autograd.grad(y0, [x, w], g)
    assert_close(y, y0, rtol=1e-4, atol=1e-4)
    assert_close(gx, gx0, rtol=1e-4, atol=1e-4)
    assert_close(gw, gw0, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("name", STRIDE1)
def test_stride1_workspaces_are_counted_and_freed(name):
    """Every buffer of a stride-1 algorithm is counted as workspace and freed by the end of
    each pass; the largest is the chunk's columns (grid) or transform buffer (Winograd)."""
    n, c, h, co = 4, 3, 8, 5
    x = _t(_rand((n, c, h, h), 72, np.float32), True)
    w = _t(_rand((co, c, 3, 3), 73, np.float32), True)
    hp = h + 2
    if name == "grid":  # cols over the grid (C*9, n, L); the input gradient's has Co rows per offset
        largest, largest_backward = (ch * 9 * n * ((h - 1) * hp + h) * 4 for ch in (c, max(c, co)))
    else:  # one transform buffer
        m = int(name[-1])
        largest = largest_backward = (m + 2) ** 2 * n * (h // m) ** 2 * max(c, co) * 4
    with C.contraction(name), C.workspace_limit(None):
        y, _, allocs, by_cat = _workspace_during(lambda: conv2d(x, w, padding=1))
        assert max(allocs) == largest, (sorted(allocs), largest)
        assert by_cat["activations"] == [y.nbytes]
        g = _t(_rand(y.shape, 74, np.float32))
        _, _, allocs, by_cat = _workspace_during(lambda: fw.autograd.grad(y, [x, w], g))
    assert max(allocs) == largest_backward
    assert sorted(by_cat["gradients"]) == sorted([x.nbytes, w.nbytes])


@pytest.mark.parametrize("name", STRIDE1 + ("gemm",))
def test_stride1_input_gradient_overwrites_a_dead_output_gradient_under_policy_on(name):
    """As for im2col: under policy on, a same-shape input gradient is written over the dead
    output gradient (no second activation-sized gradient); values do not change."""
    grads = {}
    for policy in ("off", "on"):
        fw.manual_seed(2)
        x = fw.randn(6, 3, 8, 8, dtype=fw.float64, requires_grad=True)
        w = fw.randn(3, 3, 3, 3, dtype=fw.float64, requires_grad=True)
        with fw.inplace.policy(policy), C.workspace_limit(0), C.contraction(name):
            y = conv2d(x, w, padding=1).tanh()
            with memory.record_timeline() as tl:
                y.sum().backward()
        allocated = sum(e[2] for e in tl.events if e[2] > 0 and e[3] == "gradients")
        grads[policy] = (x.grad.numpy().copy(), w.grad.numpy().copy(), allocated)
    np.testing.assert_allclose(grads["on"][0], grads["off"][0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grads["on"][1], grads["off"][1], rtol=1e-12, atol=1e-12)
    assert grads["off"][2] - grads["on"][2] == 6 * 3 * 8 * 8 * 8


@pytest.mark.parametrize("name", STRIDE1)
def test_stride1_algorithms_on_an_empty_batch(name):
    x, w = _t(np.zeros((0, 4, 6, 6), np.float32), True), _t(_rand((4, 4, 3, 3), 75, np.float32), True)
    with C.contraction(name):
        y = conv2d(x, w, padding=1)
        gx, gw = fw.autograd.grad(y, [x, w], fw.zeros(0, 4, 6, 6))
    assert y.shape == (0, 4, 6, 6) and gx.shape == x.shape and gw.shape == w.shape
    assert not gw.numpy().any()
