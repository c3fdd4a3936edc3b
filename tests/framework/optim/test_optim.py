"""Optimizers against NumPy references of PyTorch's formulas, under both inplace policies."""

import copy
import pickle

import numpy as np
import pytest

import framework as fw
from framework import memory, nn, optim

POLICIES = ["on", "off"]


@pytest.fixture(autouse=True)
def _seed():
    fw.manual_seed(0)  # (tests/conftest.py puts the inplace policy back after each test)


# --- NumPy references (float64) of torch.optim's single-tensor updates ------------------------


def sgd_ref(p, grads, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
    p, buf, out = p.copy(), None, []
    for g in grads:
        d = g + weight_decay * p if weight_decay else g
        if momentum:
            buf = d.copy() if buf is None else momentum * buf + (1 - dampening) * d
            d = d + momentum * buf if nesterov else buf
        p = p - lr * d
        out.append(p.copy())
    return out


def adam_ref(p, grads, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=False):
    b1, b2 = betas
    p, m, v, out = p.copy(), np.zeros_like(p), np.zeros_like(p), []
    for t, g in enumerate(grads, 1):
        if decoupled:
            p = p * (1 - lr * weight_decay)
        elif weight_decay:
            g = g + weight_decay * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr / (1 - b1**t) * m / (np.sqrt(v) / np.sqrt(1 - b2**t) + eps)
        out.append(p.copy())
    return out


SGD_CASES = [
    dict(lr=0.1),
    dict(lr=0.1, weight_decay=0.05),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01),
    dict(lr=0.05, momentum=0.9, nesterov=True),
    dict(lr=0.05, momentum=0.5, nesterov=True, weight_decay=0.1),
]
ADAM_CASES = [
    (optim.Adam, dict(lr=0.01), False),
    (optim.Adam, dict(lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1), False),
    (optim.AdamW, dict(lr=0.01), True),  # default weight_decay 1e-2
    (optim.AdamW, dict(lr=0.03, betas=(0.5, 0.9), weight_decay=0.2), True),
]


def run_manual(opt_cls, kwargs, policy, steps=6, dtype=fw.float64):
    """Runs ``steps`` updates of two parameters (float64) with given gradients."""
    fw.inplace.set_policy(policy)
    rng = np.random.default_rng(1)
    p0 = [rng.standard_normal((3, 4)), rng.standard_normal(5)]
    grads = [[rng.standard_normal(a.shape) for _ in range(steps)] for a in p0]
    params = [nn.Parameter(fw.tensor(a, dtype=dtype)) for a in p0]
    opt = opt_cls(params, **kwargs)
    history = [[] for _ in params]
    for k in range(steps):
        for p, g in zip(params, grads):
            p.grad = fw.tensor(g[k], dtype=dtype)
        opt.step()
        for h, p in zip(history, params):
            h.append(p.detach().numpy().copy())
    return p0, grads, history


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kwargs", SGD_CASES)
def test_sgd_matches_reference(kwargs, policy):
    p0, grads, history = run_manual(optim.SGD, kwargs, policy)
    for a, g, h in zip(p0, grads, history):
        for got, want in zip(h, sgd_ref(a, g, **kwargs)):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("cls,kwargs,decoupled", ADAM_CASES)
def test_adam_matches_reference(cls, kwargs, decoupled, policy):
    p0, grads, history = run_manual(cls, kwargs, policy)
    ref_kwargs = dict(kwargs)
    if cls is optim.AdamW:
        ref_kwargs.setdefault("weight_decay", 1e-2)
    for a, g, h in zip(p0, grads, history):
        for got, want in zip(h, adam_ref(a, g, decoupled=decoupled, **ref_kwargs)):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("cls,kwargs", [(optim.SGD, k) for k in SGD_CASES] + [(c, k) for c, k, _ in ADAM_CASES])
def test_on_and_off_updates_are_bitwise_identical(cls, kwargs):
    on = run_manual(cls, kwargs, "on")[2]
    off = run_manual(cls, kwargs, "off")[2]
    for h_on, h_off in zip(on, off):
        for a, b in zip(h_on, h_off):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (
            optim.SGD,
            dict(
                lr=np.float64(0.1), momentum=np.float32(0.9), dampening=np.float64(0.1), weight_decay=np.float64(5e-4)
            ),
        ),
        (
            optim.Adam,
            dict(
                lr=np.float32(1e-2),
                betas=(np.float64(0.9), np.float32(0.99)),
                eps=np.float64(1e-8),
                weight_decay=np.float32(1e-3),
            ),
        ),
        (optim.AdamW, dict(lr=np.float64(1e-2), weight_decay=np.float64(0.05))),
    ],
)
def test_numpy_hyperparameters_are_numbers(cls, kwargs):
    # As in PyTorch, a NumPy scalar hyperparameter promotes nothing: float32 parameters stay
    # float32 under every policy, every policy gives the same bits, and the numbers are those
    # of the same Python floats up to the host's arithmetic (Adam's 1 - beta2**t is float32
    # arithmetic for a float32 beta2, in PyTorch too).
    as_python = {k: tuple(map(float, v)) if isinstance(v, tuple) else float(v) for k, v in kwargs.items()}
    floats = run_manual(cls, as_python, "off", dtype=fw.float32)[2]
    off = run_manual(cls, kwargs, "off", dtype=fw.float32)[2]
    for policy in ("on", "auto"):
        got = run_manual(cls, kwargs, policy, dtype=fw.float32)[2]
        for h_got, h_off, h_floats in zip(got, off, floats):
            for a, b, c in zip(h_got, h_off, h_floats):
                assert a.dtype == b.dtype == np.float32
                np.testing.assert_array_equal(a, b)
                np.testing.assert_allclose(b, c, rtol=1e-5, atol=1e-6)


# --- on and off: the same training run ------------------------------------------------------------


def make_model():
    return nn.Sequential(
        nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


def regression_data():
    rng = np.random.default_rng(3)
    x = fw.tensor(rng.standard_normal((32, 6)), dtype=fw.float32)
    y = fw.tensor(rng.standard_normal((32, 3)), dtype=fw.float32)
    return x, y


def train(model, opt, steps, data):
    x, y = data
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        out = model(x)
        loss = ((out - y) * (out - y)).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


OPTIMIZERS = [
    (optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    (optim.SGD, dict(lr=0.1, momentum=0.8, dampening=0.1)),
    (optim.Adam, dict(lr=0.01, weight_decay=1e-3)),
    (optim.AdamW, dict(lr=0.01)),
]


@pytest.mark.parametrize("cls,kwargs", OPTIMIZERS)
def test_policies_give_identical_training(cls, kwargs):
    runs = {}
    for policy in POLICIES:
        fw.inplace.set_policy(policy)
        fw.manual_seed(11)
        model = make_model()
        opt = cls(model.parameters(), **kwargs)
        losses = train(model, opt, 20, regression_data())
        runs[policy] = (losses, [p.detach().numpy().copy() for p in model.parameters()])
    assert runs["on"][0][-1] < runs["on"][0][0]  # it trains
    # the same arithmetic in the same order: equal to float32 rounding (in practice bitwise)
    np.testing.assert_allclose(runs["on"][0], runs["off"][0], rtol=1e-6, atol=0)
    for a, b in zip(runs["on"][1], runs["off"][1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("cls,kwargs", [OPTIMIZERS[1], OPTIMIZERS[2]])
def test_storage_and_memory_under_each_policy(cls, kwargs):
    p = nn.Parameter(fw.randn(64, 32))
    opt = cls([p], **kwargs)
    nbuf = 1 if cls is optim.SGD else 2
    for policy in POLICIES:
        fw.inplace.set_policy(policy)
        opt.state.clear()
        params_before = memory.breakdown()["parameters"]
        state_before = memory.breakdown()["optimizer_state"]
        p.grad = fw.randn(64, 32)
        opt.step()  # allocates the state
        assert memory.breakdown()["optimizer_state"] - state_before == nbuf * p.nbytes
        array = p._data
        state = dict(opt.state[p])
        p.grad = fw.randn(64, 32)
        base = memory.allocated_bytes()
        memory.reset_peak()
        opt.step()
        peak = memory.max_allocated_bytes() - base
        tensors = [k for k, v in state.items() if isinstance(v, fw.Tensor)]
        if policy == "on":
            assert p._data is array  # updated in place
            assert all(opt.state[p][k] is state[k] and opt.state[p][k]._data is state[k]._data for k in tensors)
            peak_on = peak
        else:
            assert p._data is not array and isinstance(p, nn.Parameter)  # rebound, same object
            assert all(opt.state[p][k] is not state[k] for k in tensors)
            assert peak > peak_on  # new parameter and state buffers before the old ones go
        del array, state
        assert memory.breakdown()["parameters"] == params_before
        assert memory.breakdown()["optimizer_state"] - state_before == nbuf * p.nbytes


# --- versions: a graph recorded before step() cannot backpropagate after it -----------------------


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("cls", [optim.SGD, optim.Adam])
def test_step_bumps_versions_and_stale_graph_raises(policy, cls):
    fw.inplace.set_policy(policy)
    w = nn.Parameter(fw.randn(4))
    opt = cls([w], lr=0.1)
    loss = (w * w).sum()  # saves w for backward
    loss.backward(retain_graph=True)
    v = w._version
    opt.step()
    assert w._version > v
    culprit = "add_" if policy == "on" else f"{cls.__name__}.step"
    with pytest.raises(RuntimeError, match=f"modified by .*{culprit}.*test_optim.py"):
        loss.backward()


# --- state dict ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("cls,kwargs", [OPTIMIZERS[0], OPTIMIZERS[2]])
def test_state_dict_round_trip_continues_identically(cls, kwargs, policy):
    fw.inplace.set_policy(policy)
    data = regression_data()
    fw.manual_seed(2)
    model = make_model()
    opt = cls(model.parameters(), **kwargs)
    train(model, opt, 5, data)
    saved_model = pickle.loads(pickle.dumps(model.state_dict()))
    saved_opt = pickle.loads(pickle.dumps(opt.state_dict()))
    assert sorted(saved_opt["state"]) == list(range(len(list(model.parameters()))))
    expected = train(model, opt, 5, data)

    fw.manual_seed(99)
    model2 = make_model()
    opt2 = cls(model2.parameters(), lr=123.0)
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    assert opt2.param_groups[0]["lr"] == kwargs["lr"]
    assert all(p2 in opt2.state for p2 in model2.parameters())
    assert train(model2, opt2, 5, data) == expected


def test_state_dict_format_and_load_errors():
    a, b, c = (nn.Parameter(fw.randn(2)) for _ in range(3))
    opt = optim.SGD([{"params": [a, b]}, {"params": [c], "lr": 0.5}], lr=0.1, momentum=0.9)
    for p in (a, b, c):
        p.grad = fw.ones(2)
    opt.step()
    sd = opt.state_dict()
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1], [2]]
    assert sd["param_groups"][1]["lr"] == 0.5 and sd["param_groups"][0]["momentum"] == 0.9
    assert set(sd["state"]) == {0, 1, 2} and set(sd["state"][0]) == {"momentum_buffer"}
    assert sd["state"][0]["momentum_buffer"] is opt.state[a]["momentum_buffer"]  # live, as PyTorch

    one_group = optim.SGD([a, b, c], lr=0.1)
    with pytest.raises(ValueError, match="different number of parameter groups"):
        one_group.load_state_dict(sd)
    other = optim.SGD([{"params": [a]}, {"params": [b, c]}], lr=0.1)
    with pytest.raises(ValueError, match="doesn't match the size of optimizer's group"):
        other.load_state_dict(sd)
    with pytest.raises(ValueError, match="'state' and 'param_groups'"):
        other.load_state_dict({"state": {}})
    # loading copies the state: later steps of one optimizer do not touch the other
    twin = optim.SGD([{"params": [a, b]}, {"params": [c]}], lr=0.1)
    twin.load_state_dict(copy.deepcopy(sd))
    buf = twin.state[a]["momentum_buffer"]
    assert buf is not opt.state[a]["momentum_buffer"] and memory.is_tracked(buf._data)
    np.testing.assert_array_equal(buf.numpy(), opt.state[a]["momentum_buffer"].numpy())


# --- param groups, validation, zero_grad -------------------------------------------------------------------


def test_param_groups_and_add_param_group():
    a, b = nn.Parameter(fw.zeros(2)), nn.Parameter(fw.zeros(2))
    opt = optim.SGD([{"params": [a]}, {"params": b, "lr": 1.0}], lr=0.1)
    for p in (a, b):
        p.grad = fw.ones(2)
    opt.step()
    np.testing.assert_allclose(a.detach().numpy(), -0.1)
    np.testing.assert_allclose(b.detach().numpy(), -1.0)
    c = nn.Parameter(fw.zeros(3))
    opt.add_param_group({"params": [c], "momentum": 0.5})
    assert opt.param_groups[2]["lr"] == 0.1 and opt.param_groups[2]["momentum"] == 0.5
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [a]})
    with pytest.raises(ValueError, match="same parameter more than once"):
        optim.SGD([a, a], lr=0.1)
    with pytest.raises(ValueError, match="empty parameter list"):
        optim.Adam([])
    with pytest.raises(TypeError, match="ordered collections"):
        optim.SGD({a, b}, lr=0.1)
    with pytest.raises(ValueError, match="required optimization parameter lr"):
        optim.SGD([a])
    with pytest.raises(ValueError, match="non-leaf"):
        optim.SGD([a * 2], lr=0.1)
    assert "Parameter Group 1\n    dampening: 0\n    lr: 1.0" in repr(opt)


def test_hyperparameter_validation():
    p = [nn.Parameter(fw.zeros(1))]
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero dampening"):
        optim.SGD(p, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero dampening"):
        optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        optim.SGD(p, lr=-1)
    with pytest.raises(ValueError, match="Invalid momentum"):
        optim.SGD(p, lr=0.1, momentum=-0.5)
    with pytest.raises(ValueError, match="Invalid weight_decay"):
        optim.AdamW(p, weight_decay=-1)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        optim.Adam(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="Invalid epsilon"):
        optim.Adam(p, eps=-1e-8)


@pytest.mark.parametrize("policy", POLICIES)
def test_zero_grad_and_skipping_params_without_grad(policy):
    fw.inplace.set_policy(policy)
    a, b = nn.Parameter(fw.ones(3)), nn.Parameter(fw.ones(3))
    opt = optim.Adam([a, b], lr=0.1)
    a.grad = fw.ones(3)
    opt.step()
    assert b not in opt.state and opt.state[a]["step"] == 1
    np.testing.assert_array_equal(b.detach().numpy(), 1.0)  # no grad: untouched
    g = a.grad
    opt.zero_grad(set_to_none=False)
    assert a.grad is g and not g.numpy().any() and b.grad is None
    opt.zero_grad()
    assert a.grad is None


def test_step_with_closure():
    w = nn.Parameter(fw.tensor([2.0]))
    opt = optim.SGD([w], lr=0.25)

    def closure():
        opt.zero_grad()
        loss = (w * w).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 4.0
    assert w.item() == 1.0  # 2 - 0.25 * 4


# --- every optimizer on the test's backend against the CPU ------------------------------------------
# (the ``backend`` fixture: "cpu", and "cuda" where CuPy sees a GPU; skipped cleanly elsewhere)


def run_on(device, opt_cls, kwargs, policy, steps=4):
    """``steps`` updates of two float64 parameters on ``device`` with given gradients; the
    parameter and state values after each step, on the host."""
    fw.inplace.set_policy(policy)
    rng = np.random.default_rng(1)
    p0 = [rng.standard_normal((3, 4)), rng.standard_normal(5)]
    grads = [[rng.standard_normal(a.shape) for _ in range(steps)] for a in p0]
    params = [nn.Parameter(fw.tensor(a, dtype=fw.float64, device=device)) for a in p0]
    opt = opt_cls(params, **kwargs)
    history = []
    for k in range(steps):
        for p, g in zip(params, grads):
            p.grad = fw.tensor(g[k], dtype=fw.float64, device=device)
        opt.step()
        for p in params:
            assert p.device == fw.device(device)
            history.append(p.detach().numpy().copy())
            for name, s in sorted(opt.state[p].items()):
                if isinstance(s, fw.Tensor):
                    assert s.device == fw.device(device), name
                    history.append(s.numpy().copy())
                else:
                    history.append(np.asarray(s))
    return history


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("cls,kwargs", [(optim.SGD, k) for k in SGD_CASES] + [(c, k) for c, k, _ in ADAM_CASES])
def test_optimizer_on_backend_matches_the_cpu(cls, kwargs, policy, backend):
    got = run_on(backend, cls, kwargs, policy)
    want = run_on("cpu", cls, kwargs, policy)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        # float64 on both: only the order of operations differs (FMA on the GPU)
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("cls,kwargs", OPTIMIZERS)
def test_training_on_backend_matches_the_cpu(cls, kwargs, backend):
    def run(device):
        fw.manual_seed(11)
        model = make_model().double().to(device)
        opt = cls(model.parameters(), **kwargs)
        x, y = (t.double().to(device) for t in regression_data())
        losses = train(model, opt, 5, (x, y))
        return losses, [p.detach().numpy() for p in model.parameters()], [b.numpy() for b in model.buffers()]

    got, want = run(backend), run("cpu")
    np.testing.assert_allclose(got[0], want[0], rtol=1e-9)
    for a, b in zip(got[1] + got[2], want[1] + want[2]):
        # The backends order float64 operations differently (FMA, BLAS kernels), ~1 ulp per
        # op. Adam-style updates divide by sqrt(v) + eps, which turns an ulp of a gradient
        # component near 0 into up to ~1e-11 of a parameter (AdamW here: 2.3e-11 of the
        # tensor's largest value with OpenBLAS's Haswell kernels, 2.8e-11 with its SkylakeX
        # ones), so the bound is relative to the tensor's scale; a wrong update is off by
        # ~lr = 1e-2.
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9 * np.abs(b).max())


@pytest.mark.parametrize("cls,kwargs", [OPTIMIZERS[0], OPTIMIZERS[2]])
def test_state_dict_moves_to_the_parameters_device(cls, kwargs, backend):
    # Saved on the CPU, loaded into the same model on the backend: it continues identically.
    data = [t.double() for t in regression_data()]
    fw.manual_seed(2)
    model = make_model().double()
    opt = cls(model.parameters(), **kwargs)
    train(model, opt, 3, data)
    saved_model = pickle.loads(pickle.dumps(model.state_dict()))
    saved_opt = pickle.loads(pickle.dumps(opt.state_dict()))
    expected = train(model, opt, 3, data)

    fw.manual_seed(99)
    model2 = make_model().double().to(backend)
    opt2 = cls(model2.parameters(), lr=123.0)
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    for p in model2.parameters():
        for s in opt2.state[p].values():
            if isinstance(s, fw.Tensor):
                assert s.device == fw.device(backend)
    got = train(model2, opt2, 3, [t.to(backend) for t in data])
    np.testing.assert_allclose(got, expected, rtol=1e-9)
