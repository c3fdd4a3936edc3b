"""nn.init: PyTorch's gains, fans, bounds and standard deviations; in place under no_grad."""

import math

import numpy as np
import pytest

import framework as fw
from framework import nn
from framework.nn import init


@pytest.fixture(autouse=True)
def _seed():
    fw.manual_seed(0)


def test_calculate_gain():
    assert init.calculate_gain("linear") == 1 and init.calculate_gain("conv2d") == 1
    assert init.calculate_gain("sigmoid") == 1
    assert init.calculate_gain("tanh") == pytest.approx(5 / 3)
    assert init.calculate_gain("relu") == pytest.approx(math.sqrt(2))
    assert init.calculate_gain("leaky_relu") == pytest.approx(math.sqrt(2 / (1 + 0.01**2)))
    assert init.calculate_gain("leaky_relu", math.sqrt(5)) == pytest.approx(math.sqrt(1 / 3))
    assert init.calculate_gain("selu") == 0.75
    with pytest.raises(ValueError, match="Unsupported nonlinearity"):
        init.calculate_gain("gelu")
    with pytest.raises(ValueError, match="not a valid number"):
        init.calculate_gain("leaky_relu", "big")


def test_fans():
    assert init._calculate_fan_in_and_fan_out(fw.empty(5, 3)) == (3, 5)
    assert init._calculate_fan_in_and_fan_out(fw.empty(8, 4, 3, 3)) == (36, 72)
    with pytest.raises(ValueError, match="fewer than 2 dimensions"):
        init.kaiming_uniform_(fw.empty(5))
    with pytest.raises(ValueError, match="Mode fan_avg not supported"):
        init.kaiming_normal_(fw.empty(5, 3), mode="fan_avg")


def stats(t):
    a = t.detach().numpy().astype(np.float64)
    return a.min(), a.max(), a.mean(), a.std()


@pytest.mark.parametrize("mode,fan", [("fan_in", 200), ("fan_out", 100)])
def test_kaiming(mode, fan):
    w = fw.empty(100, 200)
    assert init.kaiming_uniform_(w, a=0, mode=mode, nonlinearity="relu") is w
    bound = math.sqrt(2) * math.sqrt(3 / fan)
    lo, hi, mean, std = stats(w)
    assert -bound <= lo and hi <= bound and hi > 0.95 * bound
    assert std == pytest.approx(bound / math.sqrt(3), rel=0.03) and abs(mean) < 0.02 * bound
    init.kaiming_normal_(w, mode=mode, nonlinearity="relu")
    _, _, mean, std = stats(w)
    assert std == pytest.approx(math.sqrt(2 / fan), rel=0.03)
    # default nonlinearity leaky_relu with a = sqrt(5): PyTorch's Linear/Conv init, bound 1/sqrt(fan_in)
    init.kaiming_uniform_(w, a=math.sqrt(5))
    assert np.abs(w.numpy()).max() <= 1 / math.sqrt(200)


def test_xavier():
    w = fw.empty(30, 20, 3, 3)
    fan_in, fan_out = 20 * 9, 30 * 9
    init.xavier_uniform_(w, gain=2.0)
    a = 2.0 * math.sqrt(6 / (fan_in + fan_out))
    lo, hi, _, std = stats(w)
    assert -a <= lo and hi <= a and std == pytest.approx(a / math.sqrt(3), rel=0.03)
    init.xavier_normal_(w)
    assert stats(w)[3] == pytest.approx(math.sqrt(2 / (fan_in + fan_out)), rel=0.03)


def test_simple_fills():
    t = fw.empty(200, 100)
    init.uniform_(t, -2.0, 3.0)
    lo, hi, mean, _ = stats(t)
    assert -2 <= lo and hi <= 3 and mean == pytest.approx(0.5, abs=0.05)
    init.normal_(t, 1.0, 0.5)
    _, _, mean, std = stats(t)
    assert mean == pytest.approx(1.0, abs=0.01) and std == pytest.approx(0.5, rel=0.03)
    assert not init.zeros_(t).numpy().any()
    assert (init.ones_(t).numpy() == 1).all()
    assert (init.constant_(t, 0.25).numpy() == 0.25).all()
    d = fw.empty(3, 3, dtype=fw.float64)
    init.normal_(d)
    assert d.dtype == np.float64


def test_in_place_on_parameters_under_no_grad_with_version_bump():
    p = nn.Parameter(fw.zeros(4, 3))
    array = p._data
    v = p._version
    for fn in (
        init.kaiming_uniform_,
        init.kaiming_normal_,
        init.xavier_uniform_,
        init.xavier_normal_,
        init.uniform_,
        init.normal_,
        init.zeros_,
        init.ones_,
    ):
        assert fn(p) is p
    init.constant_(p, 2.0)
    assert p._data is array and p._version == v + 9
    assert p.is_leaf and p.requires_grad and p.grad_fn is None


def test_seeded_and_zero_element_warning():
    fw.manual_seed(5)
    a = init.kaiming_uniform_(fw.empty(3, 4)).numpy().copy()
    fw.manual_seed(5)
    np.testing.assert_array_equal(init.kaiming_uniform_(fw.empty(3, 4)).numpy(), a)
    with pytest.warns(UserWarning, match="zero-element"):
        init.kaiming_uniform_(fw.empty(0, 3))
    with pytest.raises(TypeError, match="expect a Tensor"):
        init.zeros_(np.zeros(3))


@pytest.mark.parametrize(
    "fill,check",
    [
        (lambda t: init.uniform_(t, -0.5, 0.5), lambda a: a.min() >= -0.5 and a.max() <= 0.5 and abs(a.mean()) < 0.02),
        (lambda t: init.normal_(t, 1.0, 0.1), lambda a: abs(a.mean() - 1) < 0.01 and abs(a.std() - 0.1) < 0.01),
        (lambda t: init.kaiming_uniform_(t, a=math.sqrt(5)), lambda a: np.abs(a).max() <= 1 / math.sqrt(100)),
        (init.xavier_normal_, lambda a: abs(a.std() - math.sqrt(2 / 300)) < 0.01),
    ],
    ids=["uniform_", "normal_", "kaiming_uniform_", "xavier_normal_"],
)
def test_random_init_on_backend_draws_on_the_device(fill, check, backend):
    w = nn.Parameter(fw.empty(200, 100, device=backend))
    out = fill(w)
    assert out is w and w.device == fw.device(backend) and w._version == 1
    assert check(w.detach().numpy().astype(np.float64))
    fw.manual_seed(0)
    a = fill(fw.empty(200, 100, device=backend)).numpy()
    fw.manual_seed(0)
    b = fill(fw.empty(200, 100, device=backend)).numpy()
    np.testing.assert_array_equal(a, b)  # fw.manual_seed reseeds the device's stream too
