"""Models and their registry: errors, shapes, gradients, policy equivalence, memory."""

from __future__ import annotations

import math

import numpy as np
import pytest

import framework as fw
import models
from framework import memory, nn, optim
from models import available_models, build_model, register_model, registry

# Small versions of every model (and every norm / activation path), with an input shape.
SMALL = {
    "mlp": (dict(in_features=64, hidden=(16, 12)), (6, 1, 8, 8)),
    "mlp-tanh-dropout": (dict(in_features=64, hidden=(16,), activation="tanh", dropout=0.25), (6, 64)),
    "mlp-sigmoid": (dict(in_features=64, hidden=(16,), activation="sigmoid"), (6, 64)),
    "mlp-leaky-bn": (dict(in_features=64, hidden=(16, 12), activation="leaky_relu", norm="bn"), (6, 1, 8, 8)),
    "mlp-inplace_abn": (dict(in_features=64, hidden=(16, 12), norm="inplace_abn"), (6, 1, 8, 8)),
    "convnet": (dict(channels=(4, 8)), (6, 1, 8, 8)),
    "convnet-none": (dict(channels=(4, 8), norm=None), (6, 1, 8, 8)),
    "convnet-inplace_abn": (dict(channels=(4, 8), norm="inplace_abn"), (6, 1, 8, 8)),
    "resnet": (dict(depth=8, width=4, in_channels=3), (4, 3, 8, 8)),
    "resnet-inplace_abn": (dict(depth=8, width=4, norm="inplace_abn"), (4, 3, 8, 8)),
    "resnet14": (dict(width=4, num_classes=5), (2, 3, 8, 8)),
}


def _build(key):
    kwargs, shape = SMALL[key]
    return build_model(key.split("-")[0], **kwargs), shape


def _batch(shape, num_classes=10, seed=0):
    rng = np.random.default_rng(seed)
    x = fw.tensor(rng.standard_normal(shape).astype(np.float32))
    y = fw.tensor(rng.integers(0, num_classes, size=shape[0]).astype(np.int64))
    return x, y


# --- registry ----------------------------------------------------------------------------


def test_available_models():
    names = available_models()
    assert names.index("resnet8") < names.index("resnet14") < names.index("resnet32")
    for name in ("mlp", "convnet", "resnet", "resnet8", "resnet14", "resnet20", "resnet32"):
        assert name in names


def test_unknown_model_suggests_and_lists():
    with pytest.raises(ValueError) as e:
        build_model("resnt20")
    msg = str(e.value)
    assert "'resnt20'" in msg and "did you mean 'resnet20'" in msg.lower()
    for name in available_models():
        assert name in msg


def test_unknown_model_without_close_match_still_lists():
    with pytest.raises(ValueError, match=r"unknown model 'transformer'.*Available models: convnet, gpt, mlp"):
        build_model("transformer")


def test_unknown_kwarg_names_key_suggests_and_lists_valid():
    with pytest.raises(ValueError) as e:
        build_model("mlp", hiden=(8,))
    msg = str(e.value)
    assert "'hiden'" in msg and "did you mean 'hidden'" in msg
    for key in ("in_features", "num_classes", "hidden", "activation", "dropout", "norm"):
        assert key in msg


def test_alias_fixes_depth():
    assert build_model("resnet8", width=2).depth == 8
    with pytest.raises(ValueError, match=r"'depth'.*Valid arguments: num_classes, width, in_channels, norm"):
        build_model("resnet20", depth=32)


def test_names_are_case_insensitive_and_cfg_sections_work():
    assert isinstance(build_model("ResNet8", width=2), models.ResNet)

    class Section:
        name = "mlp"
        args = {"hidden": [8]}  # YAML gives lists

    m = build_model(Section())
    assert isinstance(m, models.MLP) and m.hidden == (8,)


def test_register_model(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    @register_model("tiny_test_model")
    def tiny(num_classes=3):
        return nn.Linear(4, num_classes)

    assert "tiny_test_model" in available_models()
    assert build_model("tiny_test_model", num_classes=2).out_features == 2
    with pytest.raises(ValueError, match="already registered"):
        register_model("tiny_test_model")(lambda: None)
    with pytest.raises(ValueError, match="non-empty"):
        register_model("")


@pytest.mark.parametrize(
    "name, kwargs, match",
    [
        ("resnet", dict(depth=21), r"6n \+ 2"),
        ("resnet", dict(depth=2), r"6n \+ 2"),
        ("resnet", dict(norm=None), "norm must be one of"),
        ("mlp", dict(activation="gelu"), "activation must be one of"),
        ("mlp", dict(activation="tanh", norm="inplace_abn"), "cannot be fused"),
        ("mlp", dict(dropout=1.0), "dropout"),
        ("mlp", dict(hidden=(8, 0)), "hidden"),
        ("convnet", dict(norm="ln"), "norm must be one of"),
        ("convnet", dict(channels=(4, 4, 4, 4), image_size=8), "too small"),
    ],
)
def test_bad_values(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_model(name, **kwargs)


def test_wrong_input_shape_is_a_clear_error():
    with pytest.raises(ValueError, match="MLP"):
        build_model("mlp", in_features=64)(fw.randn(2, 1, 7, 7))
    with pytest.raises(ValueError, match="ConvNet"):
        build_model("convnet", channels=(2,))(fw.randn(2, 3, 8, 8))


def test_resnet20_has_the_papers_parameter_count():
    n = sum(p.numel() for p in build_model("resnet20").parameters())
    assert 0.26e6 < n < 0.28e6  # He et al. 2016, table 6: 0.27M


# --- shapes and gradients -----------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(SMALL))
def test_output_shape_and_every_parameter_gets_a_gradient(key):
    fw.manual_seed(0)
    model, shape = _build(key)
    num_classes = SMALL[key][0].get("num_classes", 10)
    x, y = _batch(shape, num_classes)
    out = model(x)
    assert out.shape == (shape[0], num_classes)
    nn.CrossEntropyLoss()(out, y).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{key}: {name} got no gradient"
        assert p.grad.shape == p.shape
        assert np.isfinite(p.grad.numpy()).all(), name


@pytest.mark.parametrize("depth", [8, 14, 20, 32])
def test_resnet_aliases(depth):
    model = build_model(f"resnet{depth}", width=2)
    assert model.depth == depth
    assert len(model.layers) == 3 * (depth - 2) // 6
    assert model(fw.randn(2, 3, 8, 8)).shape == (2, 10)


def test_resnet_downsampling_shortcut_is_option_a():
    model = build_model("resnet8", width=4)
    assert sum(p.numel() for p in model.layers[1].shortcut.parameters()) == 0
    x = fw.randn(2, 4, 8, 8)
    with fw.no_grad():
        y = model.layers[1].shortcut(x).numpy()
    assert y.shape == (2, 8, 4, 4)
    np.testing.assert_array_equal(y[:, :4], x.numpy()[:, :, ::2, ::2])
    np.testing.assert_array_equal(y[:, 4:], 0)


# --- the inplace policy changes memory, never results -------------------------------------


def _train_losses(key, policy, steps=20, batch=32):
    with fw.inplace.policy(policy):
        fw.manual_seed(1)
        model, shape = _build(key)
        x, y = _batch((batch,) + shape[1:], SMALL[key][0].get("num_classes", 10), seed=2)
        opt = optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
        loss_fn = nn.CrossEntropyLoss()
        losses = []
        before = memory.stats().get("inplace_ops", 0)
        for _ in range(steps):
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return np.array(losses), memory.stats().get("inplace_ops", 0) - before


@pytest.mark.parametrize("key", sorted(SMALL))
def test_policy_on_and_off_give_the_same_losses(key):
    """20 SGD steps (momentum 0.9) on one batch of 32, float32: the same losses.

    relu_, add_, the optimizer's and the engine's inplace paths do the same arithmetic
    as their out-of-place forms, so those runs are bitwise equal. InPlace-ABN's backward
    rebuilds x_hat from its output instead of reading its input: equal up to float32
    rounding (about 1e-7 relative here), well inside the 1e-6 bound.
    """
    on, n_on = _train_losses(key, "on")
    off, n_off = _train_losses(key, "off")
    assert np.isfinite(on).all() and on[-1] < on[0], on  # it trains
    np.testing.assert_allclose(on, off, rtol=1e-6, atol=0)
    if "inplace_abn" not in key:
        np.testing.assert_array_equal(on, off)
    assert n_on > n_off  # the on run really took inplace paths


# --- memory ---------------------------------------------------------------------------------


def test_inplace_abn_holds_fewer_bytes_for_backward():
    """BN + ReLU hold conv output and activation; InPlace-ABN only the activation."""

    def saved(policy, norm):
        with fw.inplace.policy(policy):
            fw.manual_seed(0)
            model = build_model("resnet8", width=4, norm=norm)
            x, y = _batch((8, 3, 8, 8))
            loss = nn.CrossEntropyLoss()(model(x), y)
            n = memory.saved_bytes()
            loss.backward()
            return n

    off, on, abn = saved("off", "bn"), saved("on", "bn"), saved("on", "inplace_abn")
    assert on == off  # inplace ReLU / add change transient buffers, not what backward holds
    assert abn < on


def _peak_of_step(policy, norm, batch=32, size=32):
    """Peak bytes of one forward+backward above the baseline (model, batch and grads of
    nothing yet), with the saved-for-backward bytes at the forward/backward boundary."""
    import gc

    gc.collect()
    with fw.inplace.policy(policy):
        fw.manual_seed(0)
        model = build_model("resnet20", width=16, norm=norm)
        x, y = _batch((batch, 3, size, size), seed=0)
        loss_fn = nn.CrossEntropyLoss()
        gc.collect()
        base = memory.allocated_bytes()
        memory.reset_peak()
        loss = loss_fn(model(x), y)
        saved = memory.saved_bytes()
        loss.backward()
        peak = memory.max_allocated_bytes() - base
    del loss, model
    gc.collect()
    return peak, saved


def test_resnet20_peak_memory_on_below_off_and_inplace_abn_lower_still():
    off, saved_off = _peak_of_step("off", "bn")
    on, saved_on = _peak_of_step("on", "bn")
    abn, saved_abn = _peak_of_step("on", "inplace_abn")
    mb = 2**20
    report = (
        f"peak above baseline: off {off / mb:.2f} MB, on {on / mb:.2f} MB, on+InPlaceABN {abn / mb:.2f} MB; "
        f"saved for backward: {saved_off / mb:.2f} / {saved_on / mb:.2f} / {saved_abn / mb:.2f} MB"
    )
    assert on < off, report
    assert abn < on, report
    # BN + ReLU fused saves the conv output of the stem and of every block's first unit:
    # 10 of the 38 activation-sized buffers (see models/resnet.py).
    assert saved_abn < saved_on, report
    assert math.isfinite(abn)


# --- fully fused basic block (InPlace-ABN with the residual) --------------------------------


def test_resnet_inplace_abn_fuses_the_second_unit_with_the_residual():
    model = build_model("resnet8", width=4, norm="inplace_abn")
    for block in model.layers:
        assert isinstance(block.abn2, nn.InPlaceABN)
        assert not hasattr(block, "bn2") and not hasattr(block, "relu")
    block = model.layers[0]
    x = fw.randn(2, 4, 8, 8, requires_grad=True)
    results = {}
    for policy in ("on", "off"):
        with fw.inplace.policy(policy):
            x.grad = None
            block.zero_grad(set_to_none=True)
            inp = x * 1
            memory.reset_stats()
            y = block(inp)
            writes = memory.stats().get("inplace_ops", 0)  # running statistics count too
            # InPlace-ABN's function under every policy: over conv2's output (on) or into a
            # new tensor (off), with the identity added before the activation
            assert y.grad_fn.name() == "InPlaceABNBackward0"
            assert y.grad_fn.next[0].name().startswith("Conv")
            assert inp._version == 0  # the identity is untouched
            y.backward(fw.ones_like(y))
            results[policy] = (
                writes,
                y.detach().numpy().copy(),
                x.grad.numpy().copy(),
                [p.grad.numpy().copy() for p in block.parameters()],
            )
    (writes_on, y_on, gx_on, gp_on), (writes_off, y_off, gx_off, gp_off) = results["on"], results["off"]
    assert writes_on == writes_off + 2  # on wrote over the two conv outputs instead of new buffers
    np.testing.assert_array_equal(y_on, y_off)  # ... and no policy changes a number
    np.testing.assert_array_equal(gx_on, gx_off)
    for a, b in zip(gp_on, gp_off):
        np.testing.assert_array_equal(a, b)


def _block_saved(block, x):
    """Bytes a block's forward adds to the saved-for-backward set, less its weights."""
    base = memory.saved_bytes()
    y = block(x)
    weights = sum(p.nbytes for p in block.parameters() if memory.saved_refcount(p._data))
    saved = memory.saved_bytes() - base - weights
    y.sum().backward()
    return saved, y


@pytest.mark.parametrize("stride, in_planes, planes", [(1, 4, 4), (2, 4, 8)])
def test_fused_block_keeps_two_activations_plus_its_input(stride, in_planes, planes):
    """A fused block holds x (conv1's input), b (unit-1 output) and y; the identity is x
    itself (stride 1) or, for an option-A downsampling block, the zero-padded subsampled
    tensor that cat makes ONCE and the fused op keeps without copying it again."""
    from models.resnet import BasicBlock

    n, h = 2, 8
    with fw.inplace.policy("on"):
        block = BasicBlock(in_planes, planes, stride, norm="inplace_abn")
        x = fw.randn(n, in_planes, h, h, requires_grad=True) * 1
        memory.reset_stats()
        saved, y = _block_saved(block, x)
    out = y.nbytes  # b, y and a downsampling identity all have the output's size
    small = 2 * planes * 4  # inverse std of the two ABN units (weight and bias are parameters)
    identity = out if stride != 1 else 0
    assert saved == x.nbytes + 2 * out + identity + small
    assert memory.stats().get("inplace_copy_bytes", 0) == 0


def _resnet20_saved_activations(norm, batch=8, size=16):
    """Saved-for-backward bytes at the forward/backward boundary, less the parameters
    that nodes hold (weights are parameters; they are not activations)."""
    with fw.inplace.policy("on"):
        fw.manual_seed(0)
        model = build_model("resnet20", norm=norm)
        x, y = _batch((batch, 3, size, size))
        base = memory.saved_bytes()
        loss = nn.CrossEntropyLoss()(model(x), y)
        saved = memory.saved_bytes() - base
        params = sum(
            t.nbytes for t in list(model.parameters()) + list(model.buffers()) if memory.saved_refcount(t._data)
        )
        loss.backward()
    return saved - params


def test_resnet20_inplace_abn_saves_about_half_the_activation_bytes_of_bn():
    """The per-block count of REFERENCES: 4 activation-sized tensors per block with BN, 2
    with both units fused. In units of one stage-1 activation ``u`` (N x 16 x H x W), stage
    2 and 3 tensors being u/2 and u/4, with the network input (3/16 u, conv1 keeps it):

    - bn: stem 2u + 3 x 4u + 3 x 4u/2 + 3 x 4u/4 = 23u, + input = 23.1875u;
    - inplace_abn: stem 1u + 3 x 2u + 3 x 2u/2 + 3 x 2u/4 = 11.5u, + the two option-A
      identities (u/2 + u/4, new tensors made by cat) = 12.25u, + input = 12.4375u.

    Ratio 12.4375 / 23.1875 = 53.6% (<= 55%); the blocks alone are at 50% exactly.
    Beyond that only per-channel vectors and the head's (N, 64) and (N, 10) tensors.
    """
    batch, size = 8, 16
    u = batch * 16 * size * size * 4
    bn = _resnet20_saved_activations("bn", batch, size)
    abn = _resnet20_saved_activations("inplace_abn", batch, size)
    small = 16 * 1024  # 688 BN channels x <= 3 vectors x 4 B, head tensors: about 8 KB at N=8
    assert 0 <= bn - 23.1875 * u <= small, bn / u
    assert 0 <= abn - 12.4375 * u <= small, abn / u
    assert abn <= 0.55 * bn, abn / bn
