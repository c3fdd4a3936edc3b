"""cross_entropy, nll_loss, mse_loss: forward against float64 loop references, gradients
(finite differences and the closed form), what is saved, workspaces, and the errors."""

import math

import numpy as np
import pytest

import framework as fw
from framework import memory
from framework.ops.loss import check_targets, cross_entropy, mse_loss, nll_loss
from framework.testing import assert_close, gradcheck, gradgradcheck

REDUCTIONS = ["mean", "sum", "none"]


def _t(a, requires_grad=False, device="cpu"):
    a = np.asarray(a)
    return fw.tensor(a, dtype=a.dtype, requires_grad=requires_grad, device=device)


def _on(device):
    """``_t`` on ``device``: the tests that run on both legs start with ``_t = _on(backend)``
    (on the GPU the fused kernels run, checked against the same references)."""
    return lambda a, requires_grad=False: _t(a, requires_grad, device)


def _logits(n=5, c=4, seed=0, dtype=np.float64, scale=2.0):
    return (np.random.default_rng(seed).standard_normal((n, c)) * scale).astype(dtype)


TARGET = np.array([0, 3, 1, 2, 3], dtype=np.int64)


def _reduce(per_sample, reduction):
    per_sample = np.asarray(per_sample, dtype=np.float64)
    return {"mean": per_sample.mean(), "sum": per_sample.sum(), "none": per_sample}[reduction]


def ref_cross_entropy(x, target, reduction="mean", label_smoothing=0.0):
    out = []
    for row, y in zip(x.astype(np.float64), target):
        lse = math.log(sum(math.exp(v) for v in row))
        logp = [v - lse for v in row]
        c = len(row)
        q = [(1 - label_smoothing) * (k == y) + label_smoothing / c for k in range(c)]
        out.append(-sum(qk * lk for qk, lk in zip(q, logp)))
    return _reduce(out, reduction)


def ref_nll(x, target, reduction="mean"):
    return _reduce([-row[y] for row, y in zip(x, target)], reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("smoothing", [0.0, 0.1, 1.0])
def test_cross_entropy_forward(reduction, smoothing, backend):
    _t = _on(backend)
    x = _logits(dtype=np.float32)
    got = cross_entropy(_t(x), _t(TARGET), reduction=reduction, label_smoothing=smoothing)
    assert got.dtype == np.float32
    assert got.shape == (() if reduction != "none" else (5,))
    assert_close(got, ref_cross_entropy(x, TARGET, reduction, smoothing), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_cross_entropy_gradcheck(reduction, smoothing, backend):
    _t = _on(backend)
    gradcheck(lambda x: cross_entropy(x, _t(TARGET), reduction, smoothing), [_t(_logits(), True)])


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_cross_entropy_second_derivatives(reduction, smoothing, backend):
    _t = _on(backend)
    gradgradcheck(lambda x: cross_entropy(x, _t(TARGET), reduction, smoothing), [_t(_logits(), True)])


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_nll_and_mse_second_derivatives(reduction, backend):
    _t = _on(backend)
    x = _logits(seed=3)
    # nll is linear: its gradient has no history, its second derivative is 0
    gradgradcheck(lambda x: nll_loss(x, _t(TARGET), reduction), [_t(x, True)])
    gradgradcheck(lambda x: nll_loss(x.log_softmax(1), _t(TARGET), reduction), [_t(x, True)])
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4))
    gradgradcheck(lambda x, y: mse_loss(x, y, reduction), [_t(a, True), _t(b, True)])
    gradgradcheck(lambda x, y: mse_loss(x * x, y, reduction), [_t(a, True), _t(b)])


def test_cross_entropy_gradient_is_softmax_minus_onehot_over_n(backend):
    _t = _on(backend)
    x = _logits(seed=1)
    xt = _t(x, True)
    cross_entropy(xt, _t(TARGET)).backward()
    p = np.exp(x - x.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(5), TARGET] -= 1
    assert_close(xt.grad, p / 5, rtol=1e-12, atol=1e-14)


def test_cross_entropy_is_stable_for_large_logits(backend):
    _t = _on(backend)
    x = np.array([[1000.0, 0.0, -1000.0], [-1000.0, 1000.0, 999.0]], dtype=np.float32)
    xt = _t(x, True)
    loss = cross_entropy(xt, _t(np.array([0, 2])), reduction="none")
    assert np.all(np.isfinite(loss.detach().numpy()))
    assert_close(loss, [0.0, 1.0 + math.log1p(math.exp(-1.0))], rtol=1e-5, atol=1e-5)
    loss.sum().backward()
    assert np.all(np.isfinite(xt.grad.numpy()))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_half_precision_cross_entropy_sums_in_float32(dtype, reduction, backend):
    """Half-precision logits (bfloat16 too, as PyTorch) are computed with in float32 on
    every device: the losses and gradients are those of float64 on the same (rounded)
    logits, to the half type's rounding; the loss and the gradient keep the logits' dtype."""
    _t = _on(backend)
    dt = fw.float16 if dtype == "float16" else fw.bfloat16
    x = _logits(6, 9, seed=4, scale=4.0).astype(dt)
    xt = _t(x, True)
    loss = cross_entropy(xt, _t(np.array([0, 8, 1, 2, 3, 4])), reduction=reduction, label_smoothing=0.1)
    loss.sum().backward()
    x64 = _t(x.astype(np.float64), True)
    want = cross_entropy(x64, _t(np.array([0, 8, 1, 2, 3, 4])), reduction=reduction, label_smoothing=0.1)
    want.sum().backward()
    tol = 2.0**-8 if dtype == "float16" else 2.0**-5  # a few units of the half type's last place
    assert loss.dtype == dt and xt.grad.dtype == dt
    assert_close(loss.detach().float(), want.detach(), rtol=tol, atol=tol)
    assert_close(xt.grad.float(), x64.grad, rtol=tol, atol=tol * 0.1)


def test_cross_entropy_equals_nll_of_log_softmax(backend):
    _t = _on(backend)
    x = _logits(seed=2)
    a, b = _t(x, True), _t(x, True)
    la = cross_entropy(a, _t(TARGET))
    lb = nll_loss(fw.log_softmax(b, dim=1), _t(TARGET))
    assert_close(la, lb, rtol=1e-12, atol=1e-12)
    la.backward()
    lb.backward()
    assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)


def test_cross_entropy_saves_only_its_inputs():
    x = _t(_logits(64, 10, dtype=np.float32), True)
    h = x * 1  # a non-leaf, like the output of a Linear layer
    t = _t(np.arange(64) % 10)
    before = memory.saved_bytes()
    loss = cross_entropy(h, t)
    assert set(loss.grad_fn._saved) == {"x", "target"}
    assert memory.saved_bytes() - before == h.nbytes + t.nbytes  # no new (N, C) buffer kept
    h.mul_(2)  # the logits changed after the loss: backward must refuse, naming the op
    with pytest.raises(RuntimeError, match="NllLossBackward0.*mul_"):
        loss.backward()


def test_cross_entropy_workspace_is_counted_and_freed():
    x = _t(_logits(32, 7, dtype=np.float32), True)
    with memory.record_timeline() as tl:
        cross_entropy(x, _t(np.arange(32) % 7))
    ws = [e[2] for e in tl.events if e[3] == "workspace"]
    assert x.nbytes in ws and sum(ws) == 0


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_nll_loss_forward_and_gradcheck(reduction, backend):
    _t = _on(backend)
    x = _logits(seed=3)
    assert_close(nll_loss(_t(x), _t(TARGET), reduction), ref_nll(x, TARGET, reduction), rtol=1e-12)
    gradcheck(lambda x: nll_loss(x, _t(TARGET), reduction), [_t(x, True)])


def test_nll_loss_saves_only_the_target():
    loss = nll_loss(_t(_logits(), True) * 1, _t(TARGET))
    assert set(loss.grad_fn._saved) == {"target"}


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", [(), (5,), (2, 3, 4)])
def test_mse_loss_forward_and_gradcheck(reduction, shape):
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal(shape), rng.standard_normal(shape)
    assert_close(mse_loss(_t(a), _t(b), reduction), _reduce((a - b) ** 2, reduction), rtol=1e-12)
    gradcheck(lambda x, y: mse_loss(x, y, reduction), [_t(a, True), _t(b, True)])
    gradcheck(lambda x, y: mse_loss(x, y, reduction), [_t(a), _t(b, True)])  # only the target


def test_mse_loss_float32_keeps_dtype():
    a = np.ones((3, 2), np.float32)
    loss = mse_loss(_t(a, True), _t(a * 3))
    assert loss.dtype == np.float32 and float(loss) == 4.0


@pytest.mark.parametrize("fn", [cross_entropy, nll_loss])
@pytest.mark.parametrize("bad", [4, -1])
def test_out_of_range_targets_raise_on_every_device(fn, bad, backend):
    # CuPy would wrap such an index around silently: the loss checks the targets itself;
    # on a GPU without a host read in the step: check_targets() raises (the CPU raises at once).
    x = fw.tensor(_logits(), device=backend, requires_grad=True)
    target = fw.tensor(np.array([0, bad, 1, 2, 3]), device=backend)
    with pytest.raises(IndexError, match=f"Target {bad} is out of bounds: class indices must be in \\[0, 3\\]"):
        fn(x, target)
        check_targets()
    check_targets()  # raised once: nothing stays pending


@pytest.mark.parametrize("fn", [cross_entropy, nll_loss])
def test_class_loss_errors(fn):
    x = _t(_logits())
    with pytest.raises(IndexError, match="Target 4 is out of bounds"):
        fn(x, _t(np.array([0, 4, 1, 2, 3])))
    with pytest.raises(IndexError, match="Target -1 is out of bounds"):
        fn(x, _t(np.array([0, -1, 1, 2, 3])))
    with pytest.raises(TypeError, match="integer .*target.*got float32"):
        fn(x, _t(TARGET.astype(np.float32)))
    with pytest.raises(ValueError, match=r"expected target of shape \(5,\).*got \(4,\)"):
        fn(x, _t(TARGET[:4]))
    with pytest.raises(ValueError, match=r"of shape \(N, C\), got shape \(2, 5, 4\)"):
        fn(_t(np.zeros((2, 5, 4))), _t(TARGET))
    with pytest.raises(TypeError, match="expected floating"):
        fn(_t(np.zeros((5, 4), np.int64)), _t(TARGET))
    with pytest.raises(ValueError, match="'avg' is not a valid value for reduction"):
        fn(x, _t(TARGET), reduction="avg")
    with pytest.raises(TypeError, match="must be tensors"):
        fn(x, TARGET)


def test_cross_entropy_label_smoothing_range():
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        cross_entropy(_t(_logits()), _t(TARGET), label_smoothing=1.5)


def test_mse_loss_errors():
    with pytest.raises(ValueError, match=r"input shape \(3, 1\) and target shape \(3,\) differ"):
        mse_loss(_t(np.zeros((3, 1))), _t(np.zeros(3)))
    with pytest.raises(TypeError, match="same floating dtype"):
        mse_loss(_t(np.zeros(3)), _t(np.zeros(3, np.float32)))
    with pytest.raises(ValueError, match="not a valid value for reduction"):
        mse_loss(_t(np.zeros(3)), _t(np.zeros(3)), reduction=None)
