"""nn layers: forward against NumPy references, float64 gradchecks of inputs and parameters,
the inplace policy at activation sites, and BatchNorm's running statistics."""

import math

import numpy as np
import pytest

import framework as fw
from framework import memory, nn
from framework.nn import functional as F
from framework.testing import assert_close, gradcheck


@pytest.fixture(autouse=True)
def _seed():
    fw.manual_seed(0)  # (tests/conftest.py puts the inplace policy back after each test)


def rand(*shape, dtype=fw.float64, requires_grad=False, low=-1.0, high=1.0):
    a = np.random.default_rng(sum(shape) + len(shape)).uniform(low, high, shape)
    return fw.tensor(a, dtype=dtype, requires_grad=requires_grad)


def np_of(t):
    return t.detach().numpy()


def check_layer_grads(layer, *inputs, fn=None, atol=1e-5, rtol=1e-4):
    """gradcheck of ``layer`` w.r.t. its float64 inputs AND its parameters."""
    layer.double()
    params = [p for p in layer.parameters() if p.requires_grad]
    call = fn or (lambda *xs: layer(*xs))
    n = len(inputs)
    assert gradcheck(lambda *args: call(*args[:n]), [*inputs, *params], atol=atol, rtol=rtol)


# --- Linear ------------------------------------------------------------------------------------


def test_linear_forward_batched_and_init_bounds():
    lin = nn.Linear(4, 5)
    assert lin.weight.shape == (5, 4) and lin.bias.shape == (5,)
    assert isinstance(lin.weight, nn.Parameter)
    bound = 1 / math.sqrt(4)  # kaiming_uniform_(a=sqrt(5)) gives 1/sqrt(fan_in), as the bias
    assert np.abs(np_of(lin.weight)).max() <= bound and np.abs(np_of(lin.bias)).max() <= bound
    x = rand(2, 3, 4, dtype=fw.float32)
    out = lin(x)
    assert out.shape == (2, 3, 5) and out.dtype == np.float32
    assert_close(out, np_of(x) @ np_of(lin.weight).T + np_of(lin.bias), rtol=1e-5)
    nobias = nn.Linear(4, 5, bias=False)
    assert nobias.bias is None
    assert_close(nobias(x), np_of(x) @ np_of(nobias.weight).T, rtol=1e-5)
    one = lin(x[0, 0])  # a single sample (1-D input)
    assert_close(one, out[0, 0], rtol=1e-6)
    with pytest.raises(RuntimeError, match="in_features=4"):
        lin(fw.zeros(2, 3))


@pytest.mark.parametrize("bias", [True, False])
def test_linear_gradcheck(bias):
    lin = nn.Linear(3, 2, bias=bias)
    check_layer_grads(lin, rand(2, 4, 3, requires_grad=True))


@pytest.mark.parametrize("policy", ["on", "off"])
def test_linear_bias_add_is_an_inplace_site(policy):
    lin = nn.Linear(64, 32)
    x = rand(16, 64, dtype=fw.float32)
    fw.inplace.set_policy(policy)
    base = memory.allocated_bytes()
    memory.reset_peak()
    out = lin(x)
    peak = memory.max_allocated_bytes() - base
    assert memory.allocated_bytes() - base == out.nbytes
    # on: the bias goes into the matmul output; off: the sum is a second buffer
    assert peak == (out.nbytes if policy == "on" else 2 * out.nbytes)
    assert_close(out, np_of(x) @ np_of(lin.weight).T + np_of(lin.bias), rtol=1e-5)


# --- Conv2d and pooling ---------------------------------------------------------------------------


def conv_ref(x, w, b, stride, pad):
    x = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    n, _, h, wd = x.shape
    o, _, kh, kw = w.shape
    oh, ow = (h - kh) // stride + 1, (wd - kw) // stride + 1
    out = np.zeros((n, o, oh, ow))
    for i in range(oh):
        for j in range(ow):
            patch = x[:, :, i * stride : i * stride + kh, j * stride : j * stride + kw]
            out[:, :, i, j] = np.einsum("nchw,ochw->no", patch, w)
    return out if b is None else out + b[None, :, None, None]


@pytest.mark.parametrize("stride,padding,bias", [(1, 0, True), (2, 1, True), (1, 1, False)])
def test_conv2d_forward_and_gradcheck(stride, padding, bias):
    conv = nn.Conv2d(2, 3, 3, stride=stride, padding=padding, bias=bias)
    assert conv.weight.shape == (3, 2, 3, 3)
    bound = 1 / math.sqrt(2 * 9)
    assert np.abs(np_of(conv.weight)).max() <= bound
    x = rand(2, 2, 5, 5, dtype=fw.float32)
    ref = conv_ref(np_of(x), np_of(conv.weight), np_of(conv.bias) if bias else None, stride, padding)
    assert_close(conv(x), ref, rtol=1e-4, atol=1e-5)
    check_layer_grads(conv, rand(1, 2, 5, 5, requires_grad=True))


def pool_windows(x, k, s, pad, fill):
    x = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)), constant_values=fill)
    h, w = x.shape[2:]
    oh, ow = (h - k) // s + 1, (w - k) // s + 1
    return np.stack([[x[:, :, i * s : i * s + k, j * s : j * s + k] for j in range(ow)] for i in range(oh)])


def test_pools_forward_and_gradcheck():
    x = rand(2, 3, 6, 6, dtype=fw.float32)
    xn = np_of(x)
    # windows: (oh, ow, N, C, k, k)
    mp = nn.MaxPool2d(3, stride=2, padding=1)
    assert_close(mp(x), pool_windows(xn, 3, 2, 1, -np.inf).max(axis=(4, 5)).transpose(2, 3, 0, 1))
    ap = nn.AvgPool2d(2)
    assert_close(ap(x), pool_windows(xn, 2, 2, 0, 0).mean(axis=(4, 5)).transpose(2, 3, 0, 1), rtol=1e-5)
    assert_close(nn.AdaptiveAvgPool2d(1)(x), xn.mean(axis=(2, 3), keepdims=True), rtol=1e-5)
    assert_close(nn.AdaptiveAvgPool2d((3, 2))(x), xn.reshape(2, 3, 3, 2, 2, 3).mean(axis=(3, 5)), rtol=1e-5)
    xg = rand(1, 2, 4, 4, requires_grad=True)
    for layer in (nn.MaxPool2d(2), nn.AvgPool2d(2, stride=1, padding=1), nn.AdaptiveAvgPool2d((2, 2))):
        check_layer_grads(layer, xg)


# --- BatchNorm ----------------------------------------------------------------------------------


def bn_ref(x, w, b, eps, axes):
    mean = x.mean(axis=axes, keepdims=True)
    var = x.var(axis=axes, keepdims=True)
    shape = [1] * x.ndim
    shape[1] = -1
    return (x - mean) / np.sqrt(var + eps) * w.reshape(shape) + b.reshape(shape)


@pytest.mark.parametrize(
    "cls,shape,axes",
    [
        (nn.BatchNorm1d, (8, 3), (0,)),
        (nn.BatchNorm1d, (4, 3, 5), (0, 2)),
        (nn.BatchNorm2d, (4, 3, 2, 3), (0, 2, 3)),
    ],
)
def test_batchnorm_training_updates_running_stats_in_place(cls, shape, axes):
    bn = cls(3)
    with fw.no_grad():
        bn.weight.copy_(fw.tensor([0.5, 1.0, 2.0]))
        bn.bias.copy_(fw.tensor([0.1, -0.2, 0.3]))
    x = rand(*shape, dtype=fw.float32)
    xn = np_of(x).astype(np.float64)
    rm, rv = bn.running_mean, bn.running_var
    arrays, versions = (rm._data, rv._data), (rm._version, rv._version)
    out = bn(x)
    assert_close(out, bn_ref(xn, np_of(bn.weight), np_of(bn.bias), 1e-5, axes), rtol=1e-4, atol=1e-5)
    # updated in place: same tensors, same storage, one version bump each
    assert bn.running_mean is rm and bn.running_var is rv
    assert rm._data is arrays[0] and rv._data is arrays[1]
    assert (rm._version, rv._version) == (versions[0] + 1, versions[1] + 1)
    n = xn.size // 3
    assert_close(rm, 0.1 * xn.mean(axis=axes), rtol=1e-5, atol=1e-6)
    assert_close(rv, 0.9 + 0.1 * xn.var(axis=axes) * n / (n - 1), rtol=1e-5)
    assert int(bn.num_batches_tracked.item()) == 1


def test_batchnorm_eval_uses_running_stats():
    bn = nn.BatchNorm2d(2)
    with fw.no_grad():
        bn.running_mean.copy_(fw.tensor([1.0, -1.0]))
        bn.running_var.copy_(fw.tensor([4.0, 0.25]))
        bn.weight.copy_(fw.tensor([2.0, 3.0]))
    bn.eval()
    x = rand(3, 2, 2, 2, dtype=fw.float32)
    versions = (bn.running_mean._version, bn.running_var._version)
    out = bn(x)
    rm, rv = np.array([1.0, -1.0]), np.array([4.0, 0.25])
    ref = (np_of(x) - rm[None, :, None, None]) / np.sqrt(rv[None, :, None, None] + 1e-5)
    ref = ref * np.array([2.0, 3.0])[None, :, None, None]
    assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert (bn.running_mean._version, bn.running_var._version) == versions
    assert int(bn.num_batches_tracked.item()) == 0
    assert_close(bn.running_mean, rm)


def test_batchnorm_momentum_none_is_cumulative_average():
    bn = nn.BatchNorm1d(2, momentum=None)
    means = []
    for k in range(3):
        x = rand(5 + k, 2, dtype=fw.float32)
        means.append(np_of(x).mean(axis=0))
        bn(x)
    assert int(bn.num_batches_tracked.item()) == 3
    assert_close(bn.running_mean, np.mean(means, axis=0), rtol=1e-5, atol=1e-6)


def test_batchnorm_options():
    bn = nn.BatchNorm1d(3, affine=False)
    assert bn.weight is None and list(bn.parameters()) == []
    x = rand(6, 3, dtype=fw.float32)
    assert_close(bn(x), bn_ref(np_of(x), np.ones(3), np.zeros(3), 1e-5, (0,)), rtol=1e-4, atol=1e-5)
    free = nn.BatchNorm1d(3, track_running_stats=False)
    assert free.running_mean is None and [n for n, _ in free.named_buffers()] == []
    free.eval()  # no running stats: batch statistics in eval too
    assert_close(free(x), bn_ref(np_of(x), np.ones(3), np.zeros(3), 1e-5, (0,)), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="expected 4D input"):
        nn.BatchNorm2d(3)(x)
    with pytest.raises(ValueError, match="expected 2D or 3D input"):
        nn.BatchNorm1d(3)(fw.zeros(2, 3, 1, 1))
    with pytest.raises(ValueError, match="channels"):
        nn.BatchNorm1d(4)(x)


@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_gradcheck(training):
    bn = nn.BatchNorm2d(2)
    with fw.no_grad():
        bn.weight.copy_(fw.tensor([0.7, 1.3]))
        bn.bias.copy_(fw.tensor([0.2, -0.1]))
        bn.running_var.fill_(1.5)
    bn.train(training)
    check_layer_grads(bn, rand(3, 2, 2, 2, requires_grad=True))


# --- InPlaceABN ------------------------------------------------------------------------------------


def test_inplace_abn_overwrites_input_and_matches_reference():
    abn = nn.InPlaceABN(3, negative_slope=0.1)
    with fw.no_grad():
        abn.weight.copy_(fw.tensor([0.5, 1.0, 2.0]))
        abn.bias.copy_(fw.tensor([0.1, -0.2, 0.3]))
    x = rand(4, 3, 2, 2, dtype=fw.float32, requires_grad=True)
    h = x * 1  # a non-leaf, as a conv output would be
    xn = np_of(h).astype(np.float64)
    v = h._version
    out = abn(h)
    assert out is h and h._version > v
    # InPlace-ABN scales by |weight| + eps (invertible for any weight)
    z = bn_ref(xn, np_of(abn.weight) + 1e-5, np_of(abn.bias), 1e-5, (0, 2, 3))
    assert_close(out, np.where(z > 0, z, 0.1 * z), rtol=1e-4, atol=1e-5)
    assert_close(abn.running_mean, 0.1 * xn.mean(axis=(0, 2, 3)), rtol=1e-5, atol=1e-6)
    out.sum().backward()
    assert x.grad is not None and abn.weight.grad is not None
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in an in-place operation"):
        abn(fw.zeros(2, 3, 1, 1, requires_grad=True))
    with pytest.raises(ValueError, match="negative_slope > 0"):
        nn.InPlaceABN(3, negative_slope=0.0)


@pytest.mark.parametrize("training", [True, False])
def test_inplace_abn_gradcheck(training):
    abn = nn.InPlaceABN(2)
    with fw.no_grad():
        abn.weight.copy_(fw.tensor([0.7, 1.3]))
        abn.bias.copy_(fw.tensor([0.2, -0.1]))
    abn.train(training)
    check_layer_grads(abn, rand(3, 2, 2, 2, requires_grad=True), fn=lambda x: abn(x * 1))


# --- activations and the inplace policy ---------------------------------------------------------------

ACTIVATIONS = [
    (lambda inplace: nn.ReLU(inplace=inplace), lambda a: np.maximum(a, 0)),
    (lambda inplace: nn.LeakyReLU(0.2, inplace=inplace), lambda a: np.where(a > 0, a, 0.2 * a)),
    (lambda inplace: nn.Sigmoid(inplace=inplace), lambda a: 1 / (1 + np.exp(-a))),
    (lambda inplace: nn.Tanh(inplace=inplace), np.tanh),
]


@pytest.mark.parametrize("make,ref", ACTIVATIONS)
def test_activation_forward_and_gradcheck(make, ref):
    x = rand(3, 4, requires_grad=True)
    for inplace in (None, False, True):
        for policy in ("on", "off"):
            fw.inplace.set_policy(policy)
            assert_close(make(inplace)(x * 1), ref(np_of(x)), rtol=1e-6)
            check_layer_grads(make(inplace), x, fn=lambda t, layer=make(inplace): layer(t * 1))  # noqa: B008 (one layer for every call)


def address(t) -> int:
    """Where ``t``'s values live (holding the array itself would stop a site from writing)."""
    return t._data.__array_interface__["data"][0]


def wrote_over(out, h, shared):
    """Whether a site wrote its result over ``h``: a policy site returns a new tensor at
    ``h``'s address (``shared``, taken before the call) and consumes ``h``."""
    if out is h:
        return False
    if address(out) != shared:
        return False
    with pytest.raises(fw.inplace.ConsumedTensorError, match="consumed by the inplace site"):
        h + 1
    assert "consumed by" in repr(h)
    return True


@pytest.mark.parametrize("make,slope", [(ACTIVATIONS[0][0], 0.0), (ACTIVATIONS[1][0], 0.2)])
def test_activation_policy_decides_inplace(make, slope):
    x = rand(64, 32, dtype=fw.float32, requires_grad=True)
    # (policy, the module's inplace=, the site writes over h and consumes it, out is h)
    for policy, inplace, site_wrote, same in [
        ("on", None, True, False),
        ("auto", None, False, False),
        ("off", None, False, False),
        ("on", False, False, False),
        ("off", True, False, True),
        ("on", True, False, True),
    ]:
        fw.inplace.set_policy(policy)
        h = x * 2
        before = np_of(h).copy()
        shared = address(h)
        base = memory.allocated_bytes()
        out = make(inplace)(h)  # h stays named: auto may not write over it
        grown = memory.allocated_bytes() - base
        assert (out is h) == same, (policy, inplace)
        assert wrote_over(out, h, shared) == site_wrote, (policy, inplace)
        assert grown == (0 if site_wrote or same else h.nbytes), (policy, inplace)
        if not (site_wrote or same):
            np.testing.assert_array_equal(np_of(h), before)  # input untouched
        out.sum().backward()  # d/dx act(2x) = 2 act'(2x), whichever path ran
        assert_close(x.grad, np.where(before > 0, 2.0, 2.0 * slope))
        x.grad = None
        del out, h, shared


def test_auto_writes_over_a_temporary_and_nobody_can_tell():
    x = rand(128, 128, dtype=fw.float32, requires_grad=True)  # 64 KiB: worth the proof
    for make in (lambda: nn.ReLU(), lambda: nn.Tanh(inplace=None)):
        fw.inplace.set_policy("auto")
        before = memory.stats().get("auto_inplace_ops", 0)
        base = memory.allocated_bytes()
        out = make()(x * 2)
        assert memory.allocated_bytes() - base == out.nbytes  # x * 2's buffer only
        assert memory.stats()["auto_inplace_ops"] == before + 1
        out.sum().backward()
        g = x.grad.numpy().copy()
        x.grad = None
        fw.inplace.set_policy("off")
        ref = make()(x * 2)
        ref.sum().backward()
        np.testing.assert_array_equal(np_of(out), np_of(ref))
        np.testing.assert_array_equal(g, x.grad.numpy())
        x.grad = None
        del out, ref


def test_auto_leaves_leaky_relu_out_of_place_while_a_gradient_is_recorded():
    # Out of place it saves its input, in place its result (PyTorch's leaky_relu and
    # leaky_relu_): in place, the add_ below would make backward raise, where off runs it
    x = rand(128, 128, dtype=fw.float32, requires_grad=True)
    grads = {}
    for policy in ("off", "auto"):
        fw.inplace.set_policy(policy)
        before = memory.stats().get("auto_inplace_ops", 0)
        out = nn.LeakyReLU(0.2)(x * 2)
        assert out.grad_fn.name() == "LeakyReluBackward0"
        assert memory.stats().get("auto_inplace_ops", 0) == before
        out.add_(1).sum().backward()
        grads[policy] = x.grad.numpy().copy()
        x.grad = None
    np.testing.assert_array_equal(grads["off"], grads["auto"])
    del out
    with fw.no_grad():  # nothing is saved: auto writes over the temporary
        base = memory.allocated_bytes()
        out = nn.LeakyReLU(0.2)(x * 2)
        assert memory.allocated_bytes() - base == out.nbytes
        assert memory.stats()["auto_inplace_ops"] == before + 1
        np.testing.assert_array_equal(np_of(out), np.where(np_of(x) > 0, 2 * np_of(x), 0.4 * np_of(x)))


def test_relu_policy_site_falls_back_on_a_leaf_explicit_raises():
    x = rand(3, dtype=fw.float32, requires_grad=True)
    fw.inplace.set_policy("on")
    out = nn.ReLU()(x)  # the inplace path could only raise: the site takes the other one
    assert out is not x and not np.shares_memory(np_of(out), np_of(x))
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        nn.ReLU(inplace=True)(x)
    with fw.no_grad():
        out = nn.ReLU()(x)  # nor under no_grad: the leaf is what its .grad belongs to
        assert not np.shares_memory(np_of(out), np_of(x))
        y = x.detach().clone()
        shared = address(y)
        assert wrote_over(nn.ReLU()(y), y, shared)


def test_policy_site_falls_back_when_its_input_is_saved_for_backward():
    fw.inplace.set_policy("on")
    x = rand(4, 6, dtype=fw.float32, requires_grad=True)
    h = nn.ReLU()(x * 1)  # relu_ keeps its output for backward
    before = memory.stats().get("inplace_site_fallbacks", 0)
    out = nn.Dropout(0.5)(h)  # writing over h would break ReLU's backward: out of place
    assert out is not h and memory.stats()["inplace_site_fallbacks"] == before + 1
    out.sum().backward()
    assert x.grad is not None
    h = nn.ReLU()(x * 1)
    nn.Dropout(0.5, inplace=True)(h)  # explicit: obeyed, and backward names the culprit
    with pytest.raises(RuntimeError, match="modified by dropout_"):
        h.sum().backward()
    h = nn.Sigmoid()(x * 1)  # sigmoid (out of place) keeps its own output: LeakyReLU falls back
    assert nn.LeakyReLU()(h) is not h


def test_functional_activations():
    x = rand(2, 5, dtype=fw.float32)
    h = x.clone()
    assert F.relu(h, inplace=True) is h and F.relu(x) is not x
    assert_close(F.relu_(x.clone()), np.maximum(np_of(x), 0))
    assert_close(F.leaky_relu(x, 0.3), np.where(np_of(x) > 0, np_of(x), 0.3 * np_of(x)))
    h = x.clone()
    assert F.leaky_relu(h, 0.3, inplace=True) is h
    assert_close(F.sigmoid(x), 1 / (1 + np.exp(-np_of(x))), rtol=1e-6)
    assert_close(F.tanh(x), np.tanh(np_of(x)), rtol=1e-6)
    e = np.exp(np_of(x) - np_of(x).max(axis=1, keepdims=True))
    sm = e / e.sum(axis=1, keepdims=True)
    assert_close(F.softmax(x, dim=1), sm, rtol=1e-5)
    assert_close(nn.Softmax(dim=-1)(x), sm, rtol=1e-5)
    assert_close(nn.LogSoftmax(dim=1)(x), np.log(sm), rtol=1e-5, atol=1e-6)
    assert_close(F.flatten(rand(2, 3, 4)), np_of(rand(2, 3, 4)).reshape(-1))


# --- Dropout -----------------------------------------------------------------------------------------


def test_dropout_training_eval_and_policy():
    x = fw.ones(4000, requires_grad=True)
    d = nn.Dropout(0.25)
    out = d(x * 1)
    vals = np_of(out)
    assert set(np.unique(vals)) <= {0.0, np.float32(1 / 0.75)}
    assert abs((vals == 0).mean() - 0.25) < 0.03
    d.eval()
    h = x * 1
    assert d(h) is h
    d.train()
    for policy, expect in (("on", True), ("auto", False), ("off", False)):
        fw.inplace.set_policy(policy)
        h = x * 1
        shared = address(h)
        assert wrote_over(d(h), h, shared) == expect
    fw.inplace.set_policy("on")
    h = x * 1
    assert nn.Dropout(0.0)(h) is h  # p = 0 writes nothing: the identity, nothing consumed
    with pytest.raises(ValueError, match="between 0 and 1"):
        nn.Dropout(1.5)
    assert repr(nn.Dropout(0.2, inplace=True)) == "Dropout(p=0.2, inplace=True)"


def test_dropout_gradcheck_with_a_fixed_mask():
    d = nn.Dropout(0.4)

    def fn(t):
        fw.manual_seed(3)  # the same mask at every evaluation
        return d(t * 1)

    check_layer_grads(d, rand(5, 4, requires_grad=True), fn=fn)


# --- shape helpers ---------------------------------------------------------------------------------


def test_flatten_and_identity():
    x = rand(2, 3, 4, 5, dtype=fw.float32)
    f = nn.Flatten()(x)
    assert f.shape == (2, 60) and f._vc is x._vc  # a view: shares storage and version
    assert nn.Flatten(1, 2)(x).shape == (2, 12, 5)
    assert nn.Flatten(0)(x).shape == (120,)
    ident = nn.Identity(54, unused=True)
    assert ident(x) is x
    check_layer_grads(nn.Flatten(), rand(2, 2, 3, requires_grad=True))


# --- losses ----------------------------------------------------------------------------------------------


def ce_ref(x, t, smoothing=0.0, reduction="mean"):
    logp = x - x.max(axis=1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(axis=1, keepdims=True))
    c = x.shape[1]
    loss = -(1 - smoothing) * logp[np.arange(len(t)), t] - smoothing / c * logp.sum(axis=1)
    return {"mean": loss.mean(), "sum": loss.sum(), "none": loss}[reduction]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_loss(reduction, smoothing):
    x = rand(5, 4, requires_grad=True)
    t = fw.tensor([0, 3, 1, 1, 2])
    loss = nn.CrossEntropyLoss(reduction=reduction, label_smoothing=smoothing)
    assert_close(loss(x, t), ce_ref(np_of(x), t.numpy(), smoothing, reduction), rtol=1e-10)
    assert_close(F.cross_entropy(x, t, reduction=reduction, label_smoothing=smoothing), loss(x, t))
    assert gradcheck(lambda a: loss(a, t), [x])


def test_nll_and_mse_loss():
    x = rand(5, 4, requires_grad=True)
    t = fw.tensor([0, 3, 1, 1, 2])
    logp = F.log_softmax(x, dim=1)
    assert_close(nn.NLLLoss()(logp, t), ce_ref(np_of(x), t.numpy()), rtol=1e-10)
    assert gradcheck(lambda a: nn.NLLLoss(reduction="sum")(F.log_softmax(a, dim=1), t), [x])
    y = rand(5, 4) * 0.5
    for reduction, f in (("mean", np.mean), ("sum", np.sum), ("none", lambda a: a)):
        mse = nn.MSELoss(reduction=reduction)
        assert_close(mse(x, y), f((np_of(x) - np_of(y)) ** 2), rtol=1e-10)
        assert gradcheck(lambda a, m=mse: m(a, y), [x])
    assert repr(nn.MSELoss(reduction="sum")) == "MSELoss(reduction=sum)"
    with pytest.raises(ValueError, match="reduction"):
        nn.MSELoss(reduction="avg")
    with pytest.raises(NotImplementedError, match="class weights"):
        nn.CrossEntropyLoss(weight=fw.ones(4))


# --- a small network under both policies ---------------------------------------------------------------


@pytest.mark.parametrize("norm", ["bn", "abn"])
def test_convnet_same_result_under_both_policies(norm):
    def run(policy):
        fw.inplace.set_policy(policy)
        fw.manual_seed(7)
        unit = [nn.BatchNorm2d(4), nn.ReLU()] if norm == "bn" else [nn.InPlaceABN(4)]
        net = nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1),
            *unit,
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(4 * 3 * 3, 8),
            nn.LeakyReLU(),
            nn.Dropout(0.2),
            nn.Linear(8, 3),
        )
        x = fw.randn(6, 2, 6, 6)
        t = fw.tensor([0, 1, 2, 0, 1, 2])
        loss = nn.CrossEntropyLoss()(net(x), t)
        loss.backward()
        return loss.item(), [np_of(p.grad) for p in net.parameters()]

    loss_on, grads_on = run("on")
    loss_off, grads_off = run("off")
    assert loss_on == pytest.approx(loss_off, rel=1e-6)
    for a, b in zip(grads_on, grads_off):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_inplace_relu_buffer_is_freed_by_backward_like_out_of_place():
    # Was a bug: an inplace node kept ctx.out (its target's buffer) after forward.
    x = rand(1000, dtype=fw.float32, requires_grad=True)
    kept = {}
    for policy in ("on", "off"):
        fw.inplace.set_policy(policy)
        loss = (nn.ReLU()(x * 2) * 3).sum()
        base = memory.allocated_bytes()
        loss.backward()  # frees what ReLU saved; `loss` (and its graph) stays alive
        kept[policy] = memory.allocated_bytes() - base
        x.grad = None
        del loss
    assert kept["on"] == kept["off"]


# --- every layer type on the test's backend against the same layer on the CPU ----------------------
# (the ``backend`` fixture: "cpu", and "cuda" where CuPy sees a GPU; skipped cleanly elsewhere)


def _values(shape, seed):
    return np.random.default_rng(seed).uniform(-1.0, 1.0, shape)


def _target(kind, shape):
    if kind == "classes":  # (N,) class indices for (N, C) logits
        return np.random.default_rng(5).integers(0, shape[1], shape[0])
    return _values(shape, 6)  # a float target of the input's shape


def _leaky_abn(n):
    return nn.InPlaceABN(n, negative_slope=0.1)


def _small_convnet():
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(3 * 2 * 3, 4),
        nn.Tanh(),
        nn.Linear(4, 2),
    )


# (id, layer factory, input shape, train mode, target kind or None)
BACKEND_LAYERS = [
    ("Linear", lambda: nn.Linear(4, 3), (2, 5, 4), True, None),
    ("Linear(bias=False)", lambda: nn.Linear(4, 3, bias=False), (3, 4), True, None),
    ("Conv2d(s2,p1)", lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1), (2, 2, 6, 5), True, None),
    ("Conv2d(1x3,nobias)", lambda: nn.Conv2d(2, 4, (1, 3), bias=False), (1, 2, 4, 5), True, None),
    ("BatchNorm1d", lambda: nn.BatchNorm1d(3), (6, 3), True, None),
    ("BatchNorm1d(NCL,momentum=None)", lambda: nn.BatchNorm1d(3, momentum=None), (4, 3, 5), True, None),
    ("BatchNorm2d", lambda: nn.BatchNorm2d(3), (4, 3, 4, 5), True, None),
    ("BatchNorm2d.eval", lambda: nn.BatchNorm2d(3), (4, 3, 4, 5), False, None),
    ("InPlaceABN", lambda: _leaky_abn(3), (4, 3, 4, 4), True, None),
    ("InPlaceABN.eval", lambda: _leaky_abn(3), (4, 3, 4, 4), False, None),
    ("ReLU", nn.ReLU, (4, 5), True, None),
    ("LeakyReLU(0.2)", lambda: nn.LeakyReLU(0.2), (4, 5), True, None),
    ("Sigmoid", nn.Sigmoid, (4, 5), True, None),
    ("Tanh", nn.Tanh, (4, 5), True, None),
    ("Softmax(1)", lambda: nn.Softmax(dim=1), (4, 5), True, None),
    ("LogSoftmax(-1)", lambda: nn.LogSoftmax(dim=-1), (4, 5), True, None),
    ("MaxPool2d(2)", lambda: nn.MaxPool2d(2), (2, 3, 6, 7), True, None),
    ("MaxPool2d(3,s2,p1)", lambda: nn.MaxPool2d(3, stride=2, padding=1), (2, 3, 6, 7), True, None),
    ("AvgPool2d(2)", lambda: nn.AvgPool2d(2), (2, 3, 6, 7), True, None),
    ("AdaptiveAvgPool2d((2,3))", lambda: nn.AdaptiveAvgPool2d((2, 3)), (2, 3, 6, 7), True, None),
    ("AdaptiveAvgPool2d(1)", lambda: nn.AdaptiveAvgPool2d(1), (2, 3, 6, 7), True, None),
    ("Flatten", nn.Flatten, (2, 3, 4), True, None),
    ("Identity", nn.Identity, (2, 3), True, None),
    ("Sequential convnet", _small_convnet, (2, 2, 4, 6), True, None),
    ("CrossEntropyLoss(smoothing)", lambda: nn.CrossEntropyLoss(label_smoothing=0.1), (5, 4), True, "classes"),
    ("NLLLoss(sum)", lambda: nn.NLLLoss(reduction="sum"), (5, 4), True, "classes"),
    ("MSELoss(none)", lambda: nn.MSELoss(reduction="none"), (5, 4), True, "values"),
]


def _run_layer(make, shape, training, target, device):
    """Forward and backward of a float64 layer on ``device``; everything back on the host.

    The layer is built (and initialised) on the CPU and moved with ``Module.to``, so both
    devices start from the same weights.
    """
    fw.manual_seed(0)
    layer = make().double().to(device)
    layer.train(training)
    x = fw.tensor(_values(shape, 4), dtype=fw.float64, device=device, requires_grad=True)
    args = () if target is None else (fw.tensor(_target(target, shape), device=device),)
    if target == "values":
        args = (args[0].double(),)
    out = layer(x * 1, *args)  # a non-leaf input: InPlaceABN and inplace sites may write it
    assert out.device == fw.device(device)
    w = fw.tensor(np.random.default_rng(7).standard_normal(out.shape), dtype=fw.float64, device=device)
    (out * w).sum().backward()
    return {
        "out": out.detach().numpy(),
        "x.grad": x.grad.numpy(),
        **{f"{k}.grad": p.grad.numpy() for k, p in layer.named_parameters()},
        **{k: b.numpy() for k, b in layer.named_buffers()},
    }


@pytest.mark.parametrize("make,shape,training,target", [pytest.param(*c[1:], id=c[0]) for c in BACKEND_LAYERS])
def test_layer_on_backend_matches_the_cpu(make, shape, training, target, backend):
    got = _run_layer(make, shape, training, target, backend)
    want = _run_layer(make, shape, training, target, "cpu")
    assert got.keys() == want.keys()
    for key in want:
        # float64 on both: only the order of operations differs (GPU reductions, FMA)
        np.testing.assert_allclose(got[key], want[key], rtol=1e-9, atol=1e-12, err_msg=key)


def test_the_backend_layer_table_covers_every_layer_type():
    tested = {type(c[1]()).__name__ for c in BACKEND_LAYERS} | {"Dropout", "Module", "ModuleList"}
    tested |= {type(m).__name__ for m in _small_convnet().modules()}
    assert set(nn.layers.__all__) <= tested, set(nn.layers.__all__) - tested


@pytest.mark.parametrize("inplace", [False, True])
def test_dropout_on_backend_matches_its_mask(inplace, backend):
    # The two devices draw different random streams: check the layer against its own mask,
    # recomputed on the host from the input (the mask itself is the device's draw).
    p = 0.3
    fw.manual_seed(0)
    x = fw.tensor(_values((40, 50), 4), dtype=fw.float64, device=backend, requires_grad=True)
    y = nn.Dropout(p, inplace=inplace)(x * 1)
    assert y.device == fw.device(backend)
    w = np.random.default_rng(7).standard_normal(y.shape)
    (y * fw.tensor(w, device=backend)).sum().backward()
    xs, ys = x.detach().numpy(), y.detach().numpy()
    keep = ys != 0
    assert 0.6 < keep.mean() < 0.8  # P(keep) = 0.7 over 2000 values
    np.testing.assert_allclose(ys, np.where(keep, xs / (1 - p), 0.0), rtol=1e-12)
    np.testing.assert_allclose(x.grad.numpy(), np.where(keep, w / (1 - p), 0.0), rtol=1e-12)
    fw.manual_seed(0)
    again = nn.Dropout(p)(fw.tensor(_values((40, 50), 4), dtype=fw.float64, device=backend))
    np.testing.assert_array_equal(again.numpy() != 0, keep)  # seeded: the same mask on this device
