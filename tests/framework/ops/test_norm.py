"""batch_norm and inplace_abn: forward against float64 NumPy references, running
statistics, gradients (finite differences and BN + leaky ReLU), the inplace contract,
and the memory InPlace-ABN saves."""

import numpy as np
import pytest

import framework as fw
from framework import memory
from framework.ops.norm import batch_norm, inplace_abn
from framework.testing import assert_close, gradcheck, gradgradcheck

SHAPES = [(6, 3), (4, 3, 2, 3)]


def _t(a, requires_grad=False, device="cpu"):
    return fw.tensor(np.asarray(a), dtype=np.asarray(a).dtype, requires_grad=requires_grad, device=device)


def _on(device):
    """``_t`` on ``device``: the tests that run on both legs start with ``_t = _on(backend)``
    (on the GPU the fused kernels run, checked against the same references)."""
    return lambda a, requires_grad=False: _t(a, requires_grad, device)


def _axes(shape):
    return (0,) + tuple(range(2, len(shape)))


def _cs(shape):
    return (1, shape[1]) + (1,) * (len(shape) - 2)


def ref_bn(x, mean, var, w, b, eps=1e-5):
    cs = _cs(x.shape)
    y = (x - mean.reshape(cs)) / np.sqrt(var.reshape(cs) + eps)
    if w is not None:
        y = y * w.reshape(cs)
    if b is not None:
        y = y + b.reshape(cs)
    return y


def ref_batch_stats(x):
    ax = _axes(x.shape)
    m = x.size // x.shape[1]
    mean = x.mean(axis=ax)
    var = ((x - mean.reshape(_cs(x.shape))) ** 2).mean(axis=ax)
    return mean, var, var * m / (m - 1)


def _data(shape, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(dtype)
    c = shape[1]
    w = rng.standard_normal(c).astype(dtype)
    b = rng.standard_normal(c).astype(dtype)
    return x, w, b


# --------------------------------------------------------------------------- batch_norm


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_training_forward_matches_reference(shape, affine, backend):
    _t = _on(backend)
    x, w, b = _data(shape)
    if not affine:
        w = b = None
    out = batch_norm(_t(x), None, None, None if w is None else _t(w), None if b is None else _t(b), training=True)
    mean, var, _ = ref_batch_stats(x)
    assert out.shape == shape and out.dtype == np.float64
    assert_close(out, ref_bn(x, mean, var, w, b), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_running_stats_after_several_steps(shape, backend):
    _t = _on(backend)
    momentum = 0.3
    c = shape[1]
    rm, rv = fw.zeros(c, dtype=fw.float64, device=backend), fw.ones(c, dtype=fw.float64, device=backend)
    ref_m, ref_v = np.zeros(c), np.ones(c)
    _, w, b = _data(shape)
    for step in range(4):
        x, _, _ = _data(shape, seed=step + 1)
        out = batch_norm(_t(x), rm, rv, _t(w), _t(b), training=True, momentum=momentum)
        mean, var, unbiased = ref_batch_stats(x)
        ref_m = (1 - momentum) * ref_m + momentum * mean
        ref_v = (1 - momentum) * ref_v + momentum * unbiased
        # The output uses the batch's BIASED variance, the running var its UNBIASED one.
        assert_close(out, ref_bn(x, mean, var, w, b), rtol=1e-12, atol=1e-12)
        assert_close(rm, ref_m, rtol=1e-12, atol=1e-12)
        assert_close(rv, ref_v, rtol=1e-12, atol=1e-12)


def test_running_stats_float32():
    x, w, b = _data((16, 4, 3, 3), dtype=np.float32)
    rm, rv = fw.zeros(4), fw.ones(4)
    batch_norm(_t(x), rm, rv, _t(w), _t(b), training=True)
    mean, _, unbiased = ref_batch_stats(x.astype(np.float64))
    assert rm.dtype == np.float32 and rv.dtype == np.float32
    assert_close(rm, 0.1 * mean, rtol=1e-5, atol=1e-6)
    assert_close(rv, 0.9 + 0.1 * unbiased, rtol=1e-5, atol=1e-6)


def test_running_stat_versions_bump_once_per_training_call():
    rm, rv = fw.zeros(3), fw.ones(3)
    x = fw.randn(5, 3, 2, 2)
    v0 = (rm._version, rv._version)
    for k in range(1, 4):
        batch_norm(x, rm, rv, training=True)
        assert (rm._version, rv._version) == (v0[0] + k, v0[1] + k)
    batch_norm(x, rm, rv, training=False)  # eval reads them, never writes
    assert (rm._version, rv._version) == (v0[0] + 3, v0[1] + 3)


def test_running_stat_update_allocates_nothing():
    """Inplace for the allocator too: no C-sized temporary (a wide C makes one visible to
    tracemalloc above the Python objects of the call), and 0 bytes on the counter."""
    import tracemalloc

    c = 100_000
    rm, rv = fw.zeros(c), fw.ones(c)
    x = fw.randn(4, c)
    batch_norm(x, rm, rv, training=True)  # warm up
    stats = {
        "mean": np.random.default_rng(0).random(c).astype(np.float32),
        "var": np.random.default_rng(1).random(c).astype(np.float32),
        "count": 4,
    }
    want_m = 0.9 * rm.numpy().astype(np.float64) + 0.1 * stats["mean"]
    want_v = 0.9 * rv.numpy().astype(np.float64) + 0.1 * stats["var"] * 4 / 3
    from framework.ops.norm import _update_running

    tracemalloc.start()
    try:
        base = memory.allocated_bytes()
        start = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        _update_running(rm, rv, stats, 0.1)
        grown = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()
    assert memory.allocated_bytes() == base
    assert grown < c * 4 // 4, grown  # well below one float32 C-array (400 kB)
    assert_close(rm, want_m, rtol=1e-6, atol=1e-7)
    assert_close(rv, want_v, rtol=1e-6, atol=1e-7)


def test_running_stat_update_is_seen_by_a_graph_that_saved_them():
    # A graph that used the running buffers (as inputs of other ops) sees the update.
    rm, rv = fw.zeros(3), fw.ones(3)
    w = fw.ones(3, requires_grad=True)
    y = (w * rm).sum()
    batch_norm(fw.randn(4, 3), rm, rv, training=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.parametrize("shape", SHAPES)
def test_batch_norm_eval_uses_running_stats(shape, backend):
    _t = _on(backend)
    x, w, b = _data(shape)
    c = shape[1]
    rng = np.random.default_rng(7)
    m, v = rng.standard_normal(c), rng.random(c) + 0.5
    rm, rv = _t(m), _t(v)
    out = batch_norm(_t(x), rm, rv, _t(w), _t(b), training=False)
    assert_close(out, ref_bn(x, m, v, w, b), rtol=1e-12, atol=1e-12)
    assert_close(rm, m, rtol=0, atol=0)
    assert_close(rv, v, rtol=0, atol=0)


def test_eval_without_running_stats_uses_batch_stats(backend):
    _t = _on(backend)
    x, w, b = _data((6, 3))
    mean, var, _ = ref_batch_stats(x)
    assert_close(batch_norm(_t(x), None, None, _t(w), _t(b)), ref_bn(x, mean, var, w, b), rtol=1e-12, atol=1e-12)


def test_eval_backward_ignores_later_running_stat_updates(backend):
    _t = _on(backend)
    x, w, b = _data((6, 3))
    rm, rv = fw.zeros(3, dtype=fw.float64, device=backend), fw.ones(3, dtype=fw.float64, device=backend)
    wt = _t(w, requires_grad=True)
    out = batch_norm(_t(x), rm, rv, wt, None, training=False)
    batch_norm(_t(x), rm, rv, training=True)  # moves the running stats in place
    out.sum().backward()
    assert_close(wt.grad, (x / np.sqrt(1 + 1e-5)).sum(axis=0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_batch_norm_gradcheck_training(shape, backend):
    _t = _on(backend)
    x, w, b = _data(shape)
    args = [_t(x, True), _t(w, True), _t(b, True)]
    assert gradcheck(lambda x, w, b: batch_norm(x, None, None, w, b, training=True), args)


def test_batch_norm_gradcheck_training_no_affine(backend):
    _t = _on(backend)
    x, _, _ = _data((4, 3, 2, 2))
    assert gradcheck(lambda x: batch_norm(x, None, None, training=True), [_t(x, True)])


@pytest.mark.parametrize("shape", SHAPES)
def test_batch_norm_gradcheck_eval(shape, backend):
    _t = _on(backend)
    x, w, b = _data(shape)
    c = shape[1]
    rm, rv = _t(np.linspace(-1, 1, c)), _t(np.linspace(0.5, 2, c))
    args = [_t(x, True), _t(w, True), _t(b, True)]
    assert gradcheck(lambda x, w, b: batch_norm(x, rm, rv, w, b, training=False), args)


@pytest.mark.parametrize("shape", SHAPES)
def test_batch_norm_second_derivatives(shape, backend):
    _t = _on(backend)
    x, w, b = _data(shape)
    c = shape[1]
    rm, rv = _t(np.linspace(-1, 1, c)), _t(np.linspace(0.5, 2, c))
    args = [_t(x, True), _t(w, True), _t(b, True)]
    gradgradcheck(lambda x, w, b: batch_norm(x, None, None, w, b, training=True), args)
    gradgradcheck(lambda x: batch_norm(x, None, None, training=True), args[:1])
    gradgradcheck(lambda x, w, b: batch_norm(x, rm, rv, w, b, training=False), args)
    # and through what comes after it (the usual case: a nonlinearity)
    gradgradcheck(lambda x, w, b: batch_norm(x, None, None, w, b, training=True).tanh(), args)


@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_partial_gradients_match_full(training, backend):
    _t = _on(backend)
    x, w, b = _data((4, 3, 2, 2))
    rm, rv = fw.zeros(3, dtype=fw.float64, device=backend), fw.ones(3, dtype=fw.float64, device=backend)
    g = np.random.default_rng(3).standard_normal(x.shape)
    full = [_t(x, True), _t(w, True), _t(b, True)]
    batch_norm(full[0], rm, rv, full[1], full[2], training=training).backward(_t(g))
    for k in range(3):
        part = [_t(a, i == k) for i, a in enumerate((x, w, b))]
        batch_norm(part[0], rm, rv, part[1], part[2], training=training).backward(_t(g))
        assert_close(part[k].grad, full[k].grad, rtol=1e-12, atol=1e-12)


def test_batch_norm_of_a_transposed_batch_of_128_or_more(backend):
    """(N, C) as the transpose of a (C, N) tensor, N >= 128: F-contiguous, so on a GPU
    CuPy sums its statistics on its CUB path, which renames the kernel's input inside its
    map expression (the stand-in raises CuPy's CompileException where that would break)."""
    x = np.random.default_rng(0).standard_normal((3, 200)) * 2 + 0.5
    xt = _on(backend)(x, True).t()
    out = batch_norm(xt, None, None, None, None, training=True)
    mean, var, _ = ref_batch_stats(x.T)
    assert_close(out, ref_bn(x.T, mean, var, None, None), rtol=1e-12, atol=1e-12)
    out.sum().backward()  # its gradient's sums take more inputs: never CUB's one-input path


def test_batch_norm_non_contiguous_input():
    x, w, b = _data((3, 4, 2, 5))
    xt = _t(x).permute(0, 3, 2, 1)  # (3, 5, 2, 4): channels = 5, a strided view
    out = batch_norm(xt, None, None, training=True)
    xc = np.ascontiguousarray(x.transpose(0, 3, 2, 1))
    mean, var, _ = ref_batch_stats(xc)
    assert_close(out, ref_bn(xc, mean, var, None, None), rtol=1e-12, atol=1e-12)


def test_batch_norm_saves_input_and_releases_after_backward():
    x = fw.randn(8, 4, 4, 4, requires_grad=True)
    w, b = fw.ones(4, requires_grad=True), fw.zeros(4, requires_grad=True)
    before = memory.saved_bytes()
    out = batch_norm(x, None, None, w, b, training=True)
    # x, weight, and the per-channel mean and inverse std
    assert memory.saved_bytes() - before == x.nbytes + w.nbytes + 2 * 4 * 4
    out.sum().backward()
    assert memory.saved_bytes() == before
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.grad_fn.backward(np.ones(out.shape, np.float32))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: batch_norm(fw.randn(4), None, None), "shape"),
        (lambda: batch_norm(fw.randn(4, 3), fw.zeros(4), fw.ones(4), training=True), "running_mean"),
        (lambda: batch_norm(fw.randn(4, 3), None, None, fw.ones(2)), "weight"),
        (lambda: batch_norm(fw.randn(1, 3), None, None, training=True), "more than 1 value per channel"),
        (lambda: inplace_abn(fw.randn(4, 3), None, None, None, None, negative_slope=0.0), "negative_slope"),
    ],
)
def test_bad_arguments_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --------------------------------------------------------------------------- inplace_abn


def _abn_and_reference(shape, training, slope=0.01, dtype=np.float64, seed=0, device="cpu"):
    """Gradients of InPlace-ABN and of BN(weight=|w|+eps) + leaky_relu on the same data."""
    _t = _on(device)
    x, w, b = _data(shape, seed=seed, dtype=dtype)
    w[0] = -abs(w[0]) - 0.5  # a negative weight: |w| and sign(w) matter
    c = shape[1]
    eps = 1e-5
    g = np.random.default_rng(seed + 11).standard_normal(shape).astype(dtype)
    results = []
    for fused in (True, False):
        rm, rv = _t(np.linspace(-0.5, 0.5, c).astype(dtype)), _t(np.linspace(0.5, 1.5, c).astype(dtype))
        xt, wt, bt = _t(x, True), _t(w, True), _t(b, True)
        h = xt * 1
        if fused:
            out = inplace_abn(h, rm, rv, wt, bt, training=training, eps=eps, negative_slope=slope)
        else:
            out = fw.leaky_relu(batch_norm(h, rm, rv, wt.abs() + eps, bt, training=training, eps=eps), slope)
        out.backward(_t(g))
        results.append([out.detach(), xt.grad, wt.grad, bt.grad, rm, rv])
    return results


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("slope", [0.01, 0.3])
def test_inplace_abn_matches_bn_plus_leaky_relu(shape, training, slope, backend):
    _t = _on(backend)
    fused, ref = _abn_and_reference(shape, training, slope, device=backend)
    names = ["output", "grad x", "grad weight", "grad bias", "running_mean", "running_var"]
    for name, a, e in zip(names, fused, ref):
        # The contract is 1e-4; in float64 they agree to rounding.
        assert_close(a, e, rtol=1e-9, atol=1e-9, msg=name)


def test_inplace_abn_float32_close_to_reference(backend):
    _t = _on(backend)
    fused, ref = _abn_and_reference((8, 4, 3, 3), True, dtype=np.float32, device=backend)
    for a, e in zip(fused, ref):
        assert a.dtype == np.float32
        assert_close(a, e, rtol=1e-4, atol=1e-4)


def test_inplace_abn_is_in_place():
    h = fw.randn(4, 3, 2, 2, requires_grad=True) * 1
    w, b = fw.ones(3, requires_grad=True), fw.zeros(3, requires_grad=True)
    buf, v = h._data, h._version
    out = inplace_abn(h, None, None, w, b, training=True)
    assert out is h
    assert out._data is buf and np.shares_memory(out._data, buf)
    assert h._version == v + 1
    assert h.grad_fn.name() == "InPlaceABNBackward0"


def test_inplace_abn_makes_no_copy_of_its_input():
    memory.reset_stats()
    h = fw.randn(4, 3, 2, 2, requires_grad=True) * 1
    inplace_abn(h, None, None, fw.ones(3, requires_grad=True), fw.zeros(3, requires_grad=True), training=True)
    assert memory.stats().get("inplace_copy_bytes", 0) == 0
    assert memory.stats().get("inplace_ops", 0) == 1


def test_inplace_abn_on_leaf_requiring_grad_raises_and_changes_nothing():
    x = fw.randn(4, 3, requires_grad=True)
    before = x.detach().numpy().copy()
    rm, rv = fw.zeros(3), fw.ones(3)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        inplace_abn(x, rm, rv, fw.ones(3), fw.zeros(3), training=True)
    assert np.array_equal(x.detach().numpy(), before)
    assert rm._version == 0 and rv._version == 0
    with fw.no_grad():  # allowed under no_grad, as every inplace op
        inplace_abn(x, rm, rv, fw.ones(3), fw.zeros(3), training=True)
    assert rm._version == 1


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("training", [True, False])
def test_inplace_abn_gradcheck(shape, training, backend):
    _t = _on(backend)
    x, w, b = _data(shape)
    w[1] = -0.7
    c = shape[1]
    rm, rv = _t(np.linspace(-1, 1, c)), _t(np.linspace(0.5, 2, c))
    args = [_t(x, True), _t(w, True), _t(b, True)]
    assert gradcheck(lambda x, w, b: inplace_abn(x * 1, rm, rv, w, b, training=training), args)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("training", [True, False])
def test_inplace_abn_second_derivatives(shape, training, backend):
    _t = _on(backend)
    x, w, b = _data(shape)
    w[1] = -0.7
    r = np.random.default_rng(4).standard_normal(shape)
    c = shape[1]
    rm, rv = _t(np.linspace(-1, 1, c)), _t(np.linspace(0.5, 2, c))
    args = [_t(x, True), _t(w, True), _t(b, True), _t(r, True)]
    gradgradcheck(lambda x, w, b: inplace_abn(x * 1, rm, rv, w, b, training=training), args[:3])
    gradgradcheck(lambda x, w, b, r: inplace_abn(x * 1, rm, rv, w, b, training=training, residual=r), args)
    gradgradcheck(lambda x: inplace_abn(x * 1, rm, rv, None, None, training=training).tanh(), args[:1])


def test_inplace_abn_gradcheck_no_affine(backend):
    _t = _on(backend)
    x, _, _ = _data((4, 3, 2, 2))
    assert gradcheck(lambda x: inplace_abn(x * 1, None, None, None, None, training=True), [_t(x, True)])


def test_inplace_abn_on_a_view_of_a_non_leaf():
    # CopySlices: the rest of the base keeps its gradient, the view gets ABN's.
    x, w, b = _data((5, 3, 2))
    args = [_t(x, True), _t(w, True), _t(b, True)]

    def fn(x, w, b):
        h = x * 1
        inplace_abn(h[1:], None, None, w, b, training=True)
        return h

    assert gradcheck(fn, args)


def test_inplace_abn_saved_output_is_version_checked():
    h = fw.randn(4, 3, requires_grad=True) * 1
    out = inplace_abn(h, None, None, fw.ones(3, requires_grad=True), fw.zeros(3), training=True)
    out.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("inplace_act", [False, True])
def test_memory_inplace_abn_keeps_one_activation_instead_of_two(inplace_act):
    shape = (8, 4, 16, 16)
    c = shape[1]
    x = fw.randn(*shape, requires_grad=True)
    act = x.nbytes
    w, b = fw.ones(c, requires_grad=True), fw.zeros(c, requires_grad=True)
    rm, rv = fw.zeros(c), fw.ones(c)

    h = x * 1  # stands for a conv output; saves nothing itself
    base = memory.saved_bytes()
    y = batch_norm(h, rm, rv, w, b, training=True)
    ref = y.leaky_relu_() if inplace_act else fw.leaky_relu(y)
    bn_leaky = memory.saved_bytes() - base
    ref.sum().backward()
    del ref, y, h

    h = x * 1
    base = memory.saved_bytes()
    out = inplace_abn(h, rm, rv, w, b, training=True)
    abn = memory.saved_bytes() - base
    small = 4 * c * 4  # per-channel vectors (weight, bias, statistics)
    assert 2 * act <= bn_leaky <= 2 * act + small  # BN input + leaky_relu output
    assert act <= abn <= act + small  # the output only: it is the input's buffer
    assert abs((bn_leaky - abn) - act) <= small
    out.sum().backward()
    assert memory.saved_bytes() == base


# --------------------------------------------------------------------------- inplace_abn + residual


def _abn_residual_and_reference(shape, training, slope=0.01, needs=(True, True, True, True), seed=0, device="cpu"):
    """Output, gradients (x, weight, bias, residual) and running stats of the fused op and
    of ``leaky_relu(batch_norm(x, weight=|w| + eps) + residual)`` on the same data."""
    _t = _on(device)
    x, w, b = _data(shape, seed=seed)
    w[0] = -abs(w[0]) - 0.5  # a negative weight: |w| and sign(w) matter
    r = np.random.default_rng(seed + 5).standard_normal(shape) * 1.5
    g = np.random.default_rng(seed + 11).standard_normal(shape)
    c, eps = shape[1], 1e-5
    results = []
    for fused in (True, False):
        rm, rv = _t(np.linspace(-0.5, 0.5, c)), _t(np.linspace(0.5, 1.5, c))
        xt, wt, bt, rt = (_t(a, n) for a, n in zip((x, w, b, r), needs))
        h = xt * 1 if needs[0] else xt  # a non-leaf, as a conv output
        if fused:
            out = inplace_abn(h, rm, rv, wt, bt, training=training, eps=eps, negative_slope=slope, residual=rt)
            assert out is h
        else:
            z = batch_norm(h, rm, rv, wt.abs() + eps, bt, training=training, eps=eps)
            out = fw.leaky_relu(z + rt, slope)
        out.backward(_t(g))
        results.append([out.detach(), xt.grad, wt.grad, bt.grad, rt.grad, rm, rv])
    return results


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("slope", [0.01, 0.3])
def test_inplace_abn_residual_matches_bn_plus_add_plus_leaky_relu(shape, training, slope, backend):
    _t = _on(backend)
    fused, ref = _abn_residual_and_reference(shape, training, slope, device=backend)
    names = ["output", "grad x", "grad weight", "grad bias", "grad residual", "running_mean", "running_var"]
    for name, a, e in zip(names, fused, ref):
        assert a is not None, name
        # The contract is 1e-6 in float64; they agree to rounding.
        assert_close(a, e, rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("k", range(4))
def test_inplace_abn_residual_partial_gradients(training, k, backend):
    _t = _on(backend)
    # Only one of x, weight, bias, residual needs a gradient: that one is still right.
    needs = tuple(i == k for i in range(4))
    fused, ref = _abn_residual_and_reference((4, 3, 2, 2), training, needs=needs, device=backend)
    for i in range(4):
        if i == k:
            assert_close(fused[1 + i], ref[1 + i], rtol=1e-9, atol=1e-9, msg=f"grad {i}")
        else:
            assert fused[1 + i] is None


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("training", [True, False])
def test_inplace_abn_residual_gradcheck(shape, training, backend):
    _t = _on(backend)
    x, w, b = _data(shape)
    w[1] = -0.7
    r = np.random.default_rng(4).standard_normal(shape)
    c = shape[1]
    rm, rv = _t(np.linspace(-1, 1, c)), _t(np.linspace(0.5, 2, c))
    args = [_t(x, True), _t(w, True), _t(b, True), _t(r, True)]
    assert gradcheck(lambda x, w, b, r: inplace_abn(x * 1, rm, rv, w, b, training=training, residual=r), args)


def test_inplace_abn_residual_gradcheck_no_affine_and_a_strided_residual(backend):
    _t = _on(backend)
    # The residual is a strided view (an option-A shortcut's subsampling).
    x, _, _ = _data((4, 3, 2, 2))
    r = np.random.default_rng(4).standard_normal((4, 3, 4, 4))

    def fn(x, r):
        return inplace_abn(x * 1, None, None, None, None, training=True, residual=r[:, :, ::2, ::2])

    assert gradcheck(fn, [_t(x, True), _t(r, True)])


def test_inplace_abn_residual_on_a_view_of_a_non_leaf():
    x, w, b = _data((5, 3, 2))
    r = np.random.default_rng(4).standard_normal((4, 3, 2))

    def fn(x, w, b, r):
        h = x * 1
        inplace_abn(h[1:], None, None, w, b, training=True, residual=r)
        return h

    assert gradcheck(fn, [_t(x, True), _t(w, True), _t(b, True), _t(r, True)])


@pytest.mark.parametrize("training", [True, False])
def test_inplace_abn_residual_gradients_are_separate_buffers(training):
    # dz is the residual's gradient; x's gradient must not be written into it.
    rm, rv = fw.zeros(3), fw.ones(3)
    x = fw.randn(4, 3, 2, 2, requires_grad=True)
    r = fw.randn(4, 3, 2, 2, requires_grad=True)
    inplace_abn(x * 1, rm, rv, fw.ones(3), None, training=training, residual=r).sum().backward()
    assert not np.shares_memory(x.grad.numpy(), r.grad.numpy())


def test_inplace_abn_residual_is_in_place_and_keeps_y_and_the_residual_without_copies():
    shape, c = (8, 4, 8, 8), 4
    act = int(np.prod(shape)) * 4
    w, b = fw.ones(c, requires_grad=True), fw.zeros(c, requires_grad=True)
    rm, rv = fw.zeros(c), fw.ones(c)
    # a non-leaf, e.g. the block input, whose node keeps nothing (x * 1 would keep the 1, as
    # PyTorch does, and could not run again in the second backward below)
    r = fw.randn(*shape, requires_grad=True) + 0.0
    h = fw.randn(*shape, requires_grad=True) * 1  # stands for a conv output
    buf, v, rv0 = h._data, h._version, r._version
    memory.reset_stats()
    base = memory.saved_bytes()
    out = inplace_abn(h, rm, rv, w, b, training=True, residual=r)
    saved = memory.saved_bytes() - base
    assert out is h and out._data is buf and h._version == v + 1
    assert r._version == rv0  # the residual is read, never written
    assert h.grad_fn.name() == "InPlaceABNBackward0"
    assert memory.stats().get("inplace_copy_bytes", 0) == 0
    assert memory.stats().get("inplace_ops", 0) == 3  # the op, and one update per running stat
    small = 3 * c * 4  # weight, bias, inverse std
    assert saved == 2 * act + small  # y (x's buffer) and the residual, by reference
    out.sum().backward()
    assert memory.saved_bytes() == base

    # A residual that another node already keeps (conv1 keeps the block input) costs nothing more.
    h = fw.randn(*shape, requires_grad=True) * 1
    kept = r * fw.ones(1, requires_grad=True)  # mul saves r for the scalar's gradient
    base = memory.saved_bytes()
    out = inplace_abn(h, rm, rv, w, b, training=True, residual=r)
    assert memory.saved_bytes() - base == act + small
    (out.sum() + kept.sum()).backward()


def test_inplace_abn_residual_modified_in_place_makes_backward_raise():
    h = fw.randn(4, 3, 2, 2, requires_grad=True) * 1
    r = fw.randn(4, 3, 2, 2, requires_grad=True) * 1
    out = inplace_abn(h, None, None, fw.ones(3, requires_grad=True), fw.zeros(3), training=True, residual=r)
    r.mul_(2)
    with pytest.raises(
        RuntimeError, match=r"modified by an inplace operation.*input 'residual' of InPlaceABNBackward0"
    ):
        out.sum().backward()


def test_inplace_abn_residual_not_needed_for_bias_only_is_not_kept():
    # Only the bias needs a gradient: x_hat is never rebuilt, the residual is not saved.
    shape = (4, 3, 2, 2)
    h, r = fw.randn(*shape), fw.randn(*shape)
    b = fw.zeros(3, requires_grad=True)
    base = memory.saved_bytes()
    out = inplace_abn(h, None, None, fw.ones(3), b, training=True, residual=r)
    assert memory.saved_bytes() - base == h.nbytes + 3 * 3 * 4  # y, weight, bias, inverse std
    out.sum().backward()
    assert b.grad is not None


@pytest.mark.parametrize(
    "residual, exc, match",
    [
        (lambda h: fw.randn(1, 3, 2, 2), ValueError, r"residual has shape \(1, 3, 2, 2\).*no broadcasting"),
        (lambda h: fw.randn(4, 3, 2), ValueError, "residual has shape"),
        (lambda h: fw.randn(4, 3, 2, 2, dtype=fw.float64), TypeError, "residual has dtype"),
        (lambda h: h.detach(), ValueError, "shares memory with input"),
        (lambda h: h[:, :1].expand(4, 3, 2, 2), ValueError, "shares memory with input"),
        (lambda h: np.ones((4, 3, 2, 2), np.float32), TypeError, "residual must be a Tensor"),
    ],
)
def test_inplace_abn_bad_residual_raises_and_changes_nothing(residual, exc, match):
    h = fw.randn(4, 3, 2, 2, requires_grad=True) * 1
    before, v = h.detach().numpy().copy(), h._version
    rm = fw.zeros(3)
    with pytest.raises(exc, match=match):
        inplace_abn(h, rm, fw.ones(3), None, None, training=True, residual=residual(h))
    assert np.array_equal(h.detach().numpy(), before) and h._version == v and rm._version == 0


def test_nn_inplace_abn_passes_the_residual():
    abn = fw.nn.InPlaceABN(3, negative_slope=0.1)
    x, w, b = _data((4, 3, 2, 2))
    r = np.random.default_rng(2).standard_normal(x.shape)
    h = _t(x)
    out = abn(h, residual=_t(r))
    assert out is h
    mean, var, _ = ref_batch_stats(x)
    z = ref_bn(x, mean, var, np.ones(3) + abn.eps, np.zeros(3)) + r
    assert_close(out, np.where(z > 0, z, 0.1 * z), rtol=1e-12, atol=1e-12)


# --- SyncBatchNorm's arithmetic on the test's backend: host buffers for the communicator ------------


class _TwinRanks:
    """A communicator whose reductions double every sum, as if a second rank held the same batch.

    Its buffers are host NumPy arrays (like MPI's), so on a GPU the statistics travel
    device -> host -> device.
    """

    def allreduce_(self, buf, op="sum"):
        assert isinstance(buf, np.ndarray) and op == "sum"
        buf *= 2
        return buf


@pytest.mark.parametrize("shape", SHAPES)
def test_batch_norm_with_a_communicator_on_backend_matches_the_cpu(shape, backend):
    from framework.distributed.sync_batchnorm import sync_batch_norm

    def run(device):
        rng = np.random.default_rng(3)
        c = shape[1]
        x = fw.tensor(rng.standard_normal(shape) * 2 + 1, device=device, requires_grad=True)
        w = fw.tensor(rng.uniform(0.5, 1.5, c), device=device, requires_grad=True)
        b = fw.tensor(rng.standard_normal(c), device=device, requires_grad=True)
        rm, rv = fw.zeros(c, dtype=fw.float64, device=device), fw.ones(c, dtype=fw.float64, device=device)
        out = sync_batch_norm(x * 1, rm, rv, w, b, momentum=0.3, comm=_TwinRanks())
        g = fw.tensor(rng.standard_normal(shape), device=device)
        (out * g).sum().backward()
        assert out.device == rm.device == x.grad.device == fw.device(device)
        return [t.detach().numpy() for t in (out, x.grad, w.grad, b.grad, rm, rv)]

    for got, want in zip(run(backend), run("cpu")):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_sync_batch_norm_second_derivatives(shape, backend):
    """create_graph through batch_norm with a communicator: the sums over ranks go through
    a differentiable all-reduce. The twin rank mirrors x, so finite differences of x move
    both ranks' data and check the cross-rank terms too."""
    from framework.distributed.sync_batchnorm import sync_batch_norm

    _t = _on(backend)
    x, w, b = _data(shape)
    args = [_t(x, True), _t(w, True), _t(b, True)]
    gradgradcheck(lambda x, w, b: sync_batch_norm(x * 1, None, None, w, b, comm=_TwinRanks()), args)
    gradgradcheck(lambda x: sync_batch_norm(x * 1, None, None, comm=_TwinRanks()).tanh(), args[:1])
