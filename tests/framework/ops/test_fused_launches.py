"""Launch and host-sync budgets of the fused GPU ops, counted by the CuPy stand-in.

On a GPU every launch costs 7-10 µs from Python whatever it does, and a host read stalls
the step: BatchNorm is its per-channel sums (two reductions over an (N, C, H, W) map: per
sample, then over the batch; one over an (N, C) one) + one elementwise kernel each way, an activation one
kernel each way, cross entropy one kernel each way plus the batch mean, and none of them
reads a value back to the host. Each budget is checked three ways: the fused kernels
launched (kind ``"kernel"``), no launch of any other kind from the op's own code (so no
plain ufunc or reduction slipped in; this part bites where the stand-in counts its
ufuncs and reductions too), and no host read at all (``.get()``, ``float()``, ``bool()``,
``int()``, ``.item()``, ``.tolist()`` patched to fail, on every branch of the stand-in).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import framework as fw
from framework import backend
from framework.ops.loss import check_targets, cross_entropy
from framework.ops.norm import batch_norm, inplace_abn
from tests.conftest import requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

OP_FILES = tuple(os.path.join("framework", "ops", f) for f in ("norm.py", "elementwise.py", "kernels.py", "loss.py"))


@pytest.fixture
def counting():
    if backend.cupy_choice() != "standin":
        pytest.skip("launch counting needs the CuPy stand-in")
    from framework.testing.cupy_standin import counting

    return counting


@pytest.fixture
def no_host_reads(monkeypatch):
    """Every way a device value reaches the host fails inside the test."""
    from framework.testing.cupy_standin import ndarray

    def refuse(*args, **kwargs):
        raise AssertionError("a host read (a synchronization) inside a fused GPU op")

    for name in ("get", "item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(ndarray, name, refuse)


def _op_kinds(c) -> dict:
    """Launches by kind made from the ops' own files (a kernel's launch site is kernels.py)."""
    out: dict = {}
    for (kind, site), n in c.launch_sites.items():
        if os.path.normpath(site.rsplit(":", 1)[0]).endswith(OP_FILES):
            out[kind] = out.get(kind, 0) + n
    return out


def _t(shape, seed=0, requires_grad=False, dtype=np.float32):
    a = np.random.default_rng(seed).standard_normal(shape).astype(dtype)
    return fw.tensor(a, device="cuda", requires_grad=requires_grad)


# The per-channel sums of a map with spatial axes: partial sums per sample and channel, then
# their sum over the batch (framework/ops/norm.py's _channel_sums); of an (N, C) map, one reduction.
SUMS = 2


def _check(c, kernels):
    assert c.by_kind().get("kernel", 0) == kernels, c.by_site()
    assert _op_kinds(c) == ({"kernel": kernels} if kernels else {}), c.by_site()
    assert c.host_syncs == 0, c.by_site(syncs=True)


@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_training_sums_and_one_kernel_each_way(counting, no_host_reads, affine):
    x = _t((8, 4, 5, 5), requires_grad=True)
    w, b = (_t((4,), 1, True), _t((4,), 2, True)) if affine else (None, None)
    h = x.clone()  # a non-leaf whose backward launches nothing
    g = _t((8, 4, 5, 5), 3)
    with counting.count() as fwd:
        y = batch_norm(h, None, None, w, b, training=True)
    _check(fwd, SUMS + 1)  # the per-channel sums, then the normalization
    with counting.count() as bwd:
        y.backward(g)
    _check(bwd, SUMS + 1)  # the sums of g and g * x_hat, then x's gradient
    # and, written by that last kernel, the weight's and bias's gradients as arrays of
    # their own: the engine adopts them with no copy
    assert bwd.launches == SUMS + 1, bwd.by_site()
    if affine:
        assert w.grad._data.base is None and b.grad._data.base is None


def test_batch_norm_running_stats_cost_two_tiny_kernels(counting, no_host_reads):
    rm, rv = fw.zeros(4, device="cuda"), fw.ones(4, device="cuda")
    versions = rm._version, rv._version
    x = _t((8, 4, 3, 3))
    with counting.count() as c:
        batch_norm(x, rm, rv, training=True)
    _check(c, SUMS + 1 + 2)  # + one update per buffer, each deriving its statistic from the sums
    assert (rm._version, rv._version) == (versions[0] + 1, versions[1] + 1)


@pytest.mark.parametrize("need", ["all", "x", "weight"])
def test_batch_norm_eval_two_kernels_each_way(counting, no_host_reads, need):
    rm, rv = fw.zeros(4, device="cuda"), fw.ones(4, device="cuda")
    x = _t((8, 4, 3, 3), requires_grad=need in ("all", "x"))
    w = _t((4,), 1, requires_grad=need in ("all", "weight"))
    b = _t((4,), 2, requires_grad=need == "all")
    with counting.count() as fwd:
        y = batch_norm(x, rm, rv, w, b, training=False)
    _check(fwd, 2)  # a private (mean, invstd) copy of the running statistics, then the affine map
    with counting.count() as bwd:
        y.backward(_t((8, 4, 3, 3), 3))
    _check(bwd, {"all": SUMS + 1, "x": 1, "weight": SUMS}[need])


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("bias_grad", [False, True])
def test_inplace_abn_sums_and_one_kernel_each_way(counting, no_host_reads, training, residual, bias_grad):
    x = _t((8, 4, 3, 3), requires_grad=True)
    w, b = _t((4,), 1, True), _t((4,), 2, bias_grad)  # x, weight, (bias) and (residual)
    r = _t((8, 4, 3, 3), 4, requires_grad=True) if residual else None
    rm, rv = fw.zeros(4, device="cuda"), fw.ones(4, device="cuda")
    h = x.clone()  # a non-leaf whose backward launches nothing
    rm, rv = (None, None) if training else (rm, rv)  # training without running statistics
    gy = _t((8, 4, 3, 3), 3)
    with counting.count() as fwd:
        y = inplace_abn(h, rm, rv, w, b, training=training, residual=r)
    _check(fwd, SUMS + 1 if training else 2)
    with counting.count() as bwd:
        y.backward(gy)
    _check(bwd, SUMS + 1)  # the sums, then the gradients of x, weight (bias and residual) in one kernel
    assert bwd.launches == SUMS + 1, bwd.by_site()  # weight's and bias's are arrays of their own: no copy
    assert w.grad._data.base is None and (b.grad._data.base is None if bias_grad else b.grad is None)


@pytest.mark.parametrize("shape", [(8, 4), (8, 4, 3, 3)])
def test_inplace_abn_without_weight_gradient_is_the_sums_and_one_kernel_back(counting, no_host_reads, shape):
    x = _t(shape, requires_grad=True)
    y = inplace_abn(x.clone(), None, None, _t((4,), 1), _t((4,), 2), training=True)
    with counting.count() as bwd:
        y.backward(_t(shape, 3))
    _check(bwd, (SUMS if len(shape) > 2 else 1) + 1)


def test_inplace_abn_weight_gradient_without_x_gradient(counting, no_host_reads):
    # No kernel over the input runs for x: weight's gradient is its own kernel over C values.
    w = _t((4,), 1, requires_grad=True)
    y = inplace_abn(_t((8, 4, 3, 3)), None, None, w, _t((4,), 2), training=True)
    with counting.count() as bwd:
        y.backward(_t((8, 4, 3, 3), 3))
    _check(bwd, SUMS + 1)


@pytest.mark.parametrize("name", ["relu", "leaky_relu", "sigmoid", "tanh"])
@pytest.mark.parametrize("inplace", [False, True])
def test_activations_one_kernel_each_way(counting, no_host_reads, name, inplace):
    x = _t((4, 5, 6), requires_grad=True)
    h = x.clone()  # a non-leaf whose backward launches nothing
    with counting.count() as fwd:
        y = getattr(h, name + "_")() if inplace else getattr(fw, name)(h)
    _check(fwd, 1)
    assert (y is h) == inplace
    with counting.count() as bwd:
        y.backward(_t((4, 5, 6), 1))
    _check(bwd, 1)


def test_residual_add_backward_launches_nothing(counting, no_host_reads):
    a, b = _t((4, 5), requires_grad=True), _t((4, 5), 1, requires_grad=True)
    h, r = a.clone(), b.clone()
    with counting.count() as fwd:
        y = h + r
    assert fwd.by_kind().get("kernel", 0) == 0 and fwd.host_syncs == 0
    assert sum(_op_kinds(fwd).values()) <= 1  # one add (counted where the stand-in counts ufuncs)
    with counting.count() as bwd:
        y.backward(_t((4, 5), 2))
    assert bwd.host_syncs == 0
    assert _op_kinds(bwd) == {}  # the same gradient goes to both inputs


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_one_kernel_each_way_and_no_host_read(counting, no_host_reads, reduction, smoothing):
    x = _t((16, 10), requires_grad=True)
    t = fw.tensor(np.arange(16) % 10, device="cuda")
    with counting.count() as fwd:
        loss = cross_entropy(x, t, reduction=reduction, label_smoothing=smoothing)
    # the deferred target check and the per-row loss (and the batch mean or sum: a plain
    # reduction, counted where the stand-in counts reductions)
    assert fwd.by_kind().get("kernel", 0) == 2 and fwd.host_syncs == 0
    assert _op_kinds(fwd).get("kernel", 0) == 2 and sum(_op_kinds(fwd).values()) <= 2 + (reduction != "none")
    with counting.count() as bwd:
        loss.backward(_t(loss.shape, 5) if reduction == "none" else None)
    assert bwd.by_kind().get("kernel", 0) == 1 and bwd.host_syncs == 0


def test_cross_entropy_bad_targets_give_nan_at_once_and_raise_at_the_check(counting):
    x = _t((4, 3), requires_grad=True)
    loss = cross_entropy(x, fw.tensor(np.array([0, 1, 7, 2]), device="cuda"), reduction="none")
    got = loss.detach().numpy()
    assert np.isnan(got[2]) and np.all(np.isfinite(got[[0, 1, 3]]))  # never another row's value
    with pytest.raises(
        IndexError, match=r"cross_entropy: Target 7 is out of bounds: class indices must be in \[0, 2\]"
    ):
        check_targets()


def test_target_checks_are_read_back_every_check_every_calls(monkeypatch):
    from framework.ops import loss as loss_module

    check_targets()
    monkeypatch.setattr(loss_module, "CHECK_EVERY", 3)
    x = _t((4, 3))
    bad, good = (fw.tensor(np.array(v), device="cuda") for v in ([0, 5, 1, 2], [0, 1, 2, 0]))
    cross_entropy(x, bad)
    cross_entropy(x, good)
    assert len(loss_module._pending) == 2
    with pytest.raises(IndexError, match="Target 5 is out of bounds"):
        cross_entropy(x, good)  # the third call reads the three checks back
    assert loss_module._pending == []


def test_target_checks_of_two_devices_are_read_back_per_device():
    if backend.device_count() < 2:
        pytest.skip("needs two GPUs")
    check_targets()
    for dev, target in (("cuda:0", [0, 1]), ("cuda:1", [0, -3])):
        with backend.device_context(backend.device(dev)):  # kernels run on the current device
            x = fw.tensor(np.zeros((2, 3), np.float32), device=dev)
            cross_entropy(x, fw.tensor(np.array(target), device=dev))
    with pytest.raises(IndexError, match="Target -3 is out of bounds"):
        check_targets()
