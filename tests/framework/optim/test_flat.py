"""Optimizers over flat buffers: layout, whole-buffer steps, and the per-parameter numbers."""

import contextlib

import numpy as np
import pytest

import framework as fw
from framework import memory, nn, optim
from framework.autograd import function as _function
from framework.optim import flat as _flat
from tests.conftest import requires_gpu

POLICIES = ["on", "auto", "off"]

CASES = [
    (optim.SGD, dict(lr=0.1)),
    (optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    (optim.SGD, dict(lr=0.1, momentum=0.8, dampening=0.1, weight_decay=1e-2)),
    (optim.Adam, dict(lr=0.01, weight_decay=1e-3)),
    (optim.AdamW, dict(lr=0.01, betas=(0.8, 0.99))),
]


@pytest.fixture(autouse=True)
def _seed():
    fw.manual_seed(0)  # (tests/conftest.py puts the inplace policy back after each test)


def per_parameter(cls):
    """``cls`` with the flat path switched off: today's one-parameter-at-a-time update."""

    class PerParameter(cls):
        def _flat_step(self, gi, group, u, site):
            return group["params"]

    return PerParameter


# Shapes whose sizes straddle the CPU chunk (so a chunk boundary falls inside parameters)
SHAPES = [(7, 5), (3,), (130, 129), (1,), (64, 3, 3, 3), (17,), (400, 400)]


def make_params(device="cpu", dtypes=(fw.float32,)):
    rng = np.random.default_rng(5)
    return [
        nn.Parameter(fw.tensor(rng.standard_normal(s), dtype=dtypes[i % len(dtypes)], device=device))
        for i, s in enumerate(SHAPES)
    ]


def grads_for(params, steps, seed=6):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(p.shape) for p in params] for _ in range(steps)]


def run(cls, kwargs, policy, steps=4, device="cpu", dtypes=(fw.float32,), zero=None):
    fw.inplace.set_policy(policy)
    params = make_params(device, dtypes)
    opt = cls(params, **kwargs)
    out = []
    for gs in grads_for(params, steps):
        if zero is None:
            for p, g in zip(params, gs):
                p.grad = fw.tensor(g, dtype=p.dtype, device=device)
        else:  # gradients made by backward, accumulated into what zero_grad left
            opt.zero_grad(set_to_none=zero)
            loss = sum((p * fw.tensor(g, dtype=p.dtype, device=device)).sum() for p, g in zip(params, gs))
            loss.backward()
        opt.step()
        for p in params:
            out.append(fw.testing.to_numpy(p.detach()).copy())
            out.append(fw.testing.to_numpy(p.grad).copy())  # the step reads gradients, never writes them
            for _k, s in sorted(opt.state[p].items()):
                out.append(fw.testing.to_numpy(s).copy() if isinstance(s, fw.Tensor) else np.asarray(s))
    return out, params, opt


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("cls,kwargs", CASES)
def test_flat_step_is_bitwise_the_per_parameter_step(cls, kwargs, policy):
    assert sum(np.prod(s) for s in SHAPES) > 2 * _flat.CPU_CHUNK  # several chunks
    got = run(cls, kwargs, policy, dtypes=(fw.float32, fw.float64))[0]
    want = run(per_parameter(cls), kwargs, policy, dtypes=(fw.float32, fw.float64))[0]
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("cls,kwargs", CASES)
def test_on_the_gpu_the_fused_kernel_is_bitwise_the_rule_under_every_policy(cls, kwargs):
    # the rule op by op (one parameter at a time) against the fused kernel over flat buffers
    want = run(per_parameter(cls), kwargs, "on", device="cuda", dtypes=(fw.float32, fw.float64))[0]
    for policy in POLICIES:
        got = run(cls, kwargs, policy, device="cuda", dtypes=(fw.float32, fw.float64))[0]
        assert len(got) == len(want)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b, err_msg=policy)
    for zero in (True, False):  # gradients from backward, into what zero_grad left
        got = run(cls, kwargs, "auto", device="cuda", zero=zero)[0]
        for a, b in zip(got, run(per_parameter(cls), kwargs, "auto", device="cuda", zero=zero)[0]):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("zero", [True, False])
@pytest.mark.parametrize("cls,kwargs", [CASES[1], CASES[3]])
def test_backward_gradients_and_zero_grad_give_the_same_numbers(cls, kwargs, zero):
    got = run(cls, kwargs, "auto", zero=zero)[0]
    want = run(per_parameter(cls), kwargs, "auto", zero=zero)[0]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def _root(t):
    return memory.root_buffer(t._data)


@pytest.mark.parametrize("cls,kwargs", [CASES[1], CASES[3]])
def test_parameters_gradients_and_state_are_views_of_one_buffer_per_dtype(cls, kwargs, backend):
    _, params, opt = run(cls, kwargs, "auto", steps=2, device=backend, dtypes=(fw.float32, fw.float64))
    for dtype in (fw.float32, fw.float64):
        ps = [p for p in params if p.dtype == dtype]
        numel = sum(p.numel() for p in ps)
        keys = [k for k, v in opt.state[ps[0]].items() if isinstance(v, fw.Tensor)]
        assert keys
        for tensors in [ps, [p.grad for p in ps]] + [[opt.state[p][k] for p in ps] for k in keys]:
            assert len({id(_root(t)) for t in tensors}) == 1
            root = _root(tensors[0])
            assert root.shape == (numel,) and root.dtype == dtype
        assert _root(ps[0]) is not _root(ps[0].grad)
    assert _root(params[0]) is not _root(params[1])  # one buffer per dtype


def test_flat_buffers_replace_the_per_parameter_arrays_in_memory():
    fw.inplace.set_policy("auto")
    params = make_params()
    nbytes = sum(p.nbytes for p in params)
    before = memory.breakdown()
    opt = optim.Adam(params, lr=0.01)
    for gs in grads_for(params, 2):
        for p, g in zip(params, gs):
            p.grad = fw.tensor(g, dtype=p.dtype)
        opt.step()
    after = memory.breakdown()
    assert after["parameters"] == before["parameters"]
    assert after["optimizer_state"] - before["optimizer_state"] == 2 * nbytes
    assert after["gradients"] - before["gradients"] == nbytes
    opt.zero_grad()  # set_to_none: the flat gradient buffer goes with its views
    assert memory.breakdown()["gradients"] == before["gradients"]
    opt.state.clear()
    assert memory.breakdown()["optimizer_state"] == before["optimizer_state"]


def count_ops(monkeypatch):
    """Counts every op (``Function.apply``/``apply_``) run while the returned list grows."""
    calls = []
    real = _function._apply

    def counting(cls, inputs, params, inplace):
        calls.append(cls.__name__)
        return real(cls, inputs, params, inplace)

    monkeypatch.setattr(_function, "_apply", counting)
    return calls


def _counted_step(kind, kwargs, n, device, measure, dtypes=(fw.float32,)):
    """``measure()`` (a context manager yielding a count) around the 4th step of ``kind``
    over ``n`` parameters of ``dtypes`` (in turn), with fresh gradients each step."""
    params = [nn.Parameter(fw.randn(60 // n, 5, device=device, dtype=dtypes[i % len(dtypes)])) for i in range(n)]
    opt = kind(params, **kwargs)
    for _ in range(3):  # the first step creates the state
        for p in params:
            p.grad = fw.randn(*p.shape, device=device, dtype=p.dtype)
        opt.step()
    for p in params:
        p.grad = fw.randn(*p.shape, device=device, dtype=p.dtype)
    with measure() as counted:
        opt.step()
    return counted


@pytest.mark.parametrize("cls,kwargs", CASES)
def test_a_step_runs_as_many_ops_for_3_parameters_as_for_30(cls, kwargs, monkeypatch):
    fw.inplace.set_policy("auto")
    calls = count_ops(monkeypatch)

    @contextlib.contextmanager
    def ops():
        del calls[:]
        yield calls

    counts = {}
    for n, kind in ((3, cls), (30, cls), (3, per_parameter(cls)), (30, per_parameter(cls))):
        counts[n, kind is cls] = len(_counted_step(kind, kwargs, n, "cpu", ops))
    assert counts[3, True] == counts[30, True] > 0  # flat: independent of the parameter count
    assert counts[30, False] == 10 * counts[3, False]  # one by one: proportional to it
    assert counts[3, True] == counts[3, False] // 3


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("cls,kwargs", CASES)
def test_on_the_gpu_a_step_is_one_fused_kernel_per_dtype(cls, kwargs, policy):
    if fw.backend.cupy_choice() != "standin":
        pytest.skip("launch counting needs the CuPy stand-in")
    from framework.testing.cupy_standin import counting

    fw.inplace.set_policy(policy)
    dtypes = (fw.float32, fw.float64)
    flat = {n: _counted_step(cls, kwargs, n, "cuda", counting.count, dtypes) for n in (4, 30)}
    for c in flat.values():
        # per dtype: the new gradients gathered into the flat gradient buffer, one update kernel
        assert c.by_kind() == {"copy": 2, "kernel": 2}, c.by_site()
        assert c.host_syncs == 0
    one_by_one = _counted_step(per_parameter(cls), kwargs, 4, "cuda", counting.count, dtypes)
    assert one_by_one.launches > 4 and "kernel" not in one_by_one.by_kind()  # the rule, op by op


def test_on_the_gpu_a_step_is_one_pass_over_the_whole_buffer(backend, monkeypatch):
    seen = []
    real = optim.Adam._update_flat

    def spy(self, p, grad, state, group, u):
        seen.append(p.numel())
        return real(self, p, grad, state, group, u)

    monkeypatch.setattr(optim.Adam, "_update_flat", spy)
    params = make_params(backend)
    opt = optim.Adam(params, lr=0.01)
    for p in params:
        p.grad = fw.randn(*p.shape, device=backend)
    opt.step()
    numel = sum(p.numel() for p in params)
    if backend == "cpu":  # cache-sized chunks
        assert len(seen) == -(-numel // max(_flat.CPU_CHUNK, max(p.numel() for p in params))) > 1
        assert sum(seen) == numel
    else:
        assert seen == [numel]


def test_zero_grad_is_one_fill_and_keeps_the_views(monkeypatch):
    fw.inplace.set_policy("auto")
    params = make_params()
    opt = optim.SGD(params, lr=0.1, momentum=0.9)
    for p in params:
        p.grad = fw.randn(*p.shape)
    opt.step()
    grads = [p.grad for p in params]
    versions = [g._version for g in grads]
    fills = []
    real_zero = nn.module._zero_grad
    monkeypatch.setattr("framework.optim.optimizer._zero_grad", lambda p, s: fills.append(p) or real_zero(p, s))
    opt.zero_grad(set_to_none=False)
    assert fills == []  # no per-parameter zeroing
    assert all(p.grad is g for p, g in zip(params, grads))
    assert all(g._version == v + 1 for g, v in zip(grads, versions))
    assert all(not p.grad.numpy().any() for p in params)
    # backward accumulates into the views in place: the next step reads them, no gather
    loss = sum((p * p).sum() for p in params)
    loss.backward()
    assert all(p.grad is g for p, g in zip(params, grads))
    np.testing.assert_array_equal(params[0].grad.numpy(), 2 * params[0].detach().numpy())
    opt.zero_grad()
    assert all(p.grad is None for p in params)


def test_parameters_without_gradient_frozen_ones_and_a_new_group(monkeypatch):
    fw.inplace.set_policy("auto")
    a, b, c = (nn.Parameter(fw.ones(4) * k) for k in (1.0, 2.0, 3.0))
    frozen = nn.Parameter(fw.ones(3), requires_grad=False)
    opt = optim.SGD([a, b, frozen], lr=0.5, momentum=0.9)
    a.grad = fw.ones(4)
    opt.step()  # b has no gradient: both are updated one by one, b is left alone
    np.testing.assert_array_equal(a.detach().numpy(), 0.5)
    np.testing.assert_array_equal(b.detach().numpy(), 2.0)
    assert b not in opt.state or not opt.state[b]
    np.testing.assert_array_equal(frozen.detach().numpy(), 1.0)
    b.grad = fw.ones(4)
    a.grad = fw.ones(4)
    opt.step()  # momentum state differs (b has none): still one by one, same numbers
    np.testing.assert_array_equal(b.detach().numpy(), 1.5)
    np.testing.assert_allclose(a.detach().numpy(), 0.5 - 0.5 * 1.9)
    assert memory.root_buffer(frozen._data) is not memory.root_buffer(a._data)
    opt.add_param_group({"params": [c], "lr": 1.0})
    for p in (a, b, c):
        p.grad = fw.ones(4)
    opt.step()
    np.testing.assert_array_equal(c.detach().numpy(), 2.0)
    assert memory.root_buffer(c._data) is not memory.root_buffer(a._data)
    assert memory.root_buffer(a._data) is memory.root_buffer(b._data)


@pytest.mark.parametrize("policy", POLICIES)
def test_rebinding_a_parameter_or_its_gradient_is_seen_at_the_next_step(policy):
    fw.inplace.set_policy(policy)
    a, b = nn.Parameter(fw.zeros(3)), nn.Parameter(fw.zeros(2))
    opt = optim.SGD([a, b], lr=1.0)
    a.grad, b.grad = fw.ones(3), fw.ones(2)
    opt.step()
    a.data = fw.full((3,), 10.0)  # a new storage: the next step gathers it back
    g = fw.full((2,), 5.0)
    b.grad = g
    opt.step()
    np.testing.assert_array_equal(a.detach().numpy(), 9.0)
    np.testing.assert_array_equal(b.detach().numpy(), -6.0)
    np.testing.assert_array_equal(g.numpy(), 5.0)  # the assigned gradient is read, not written
    assert memory.root_buffer(a._data) is memory.root_buffer(b._data)


def test_a_gradient_viewing_another_buffer_is_read_and_left_in_place():
    """DataParallel's bucket views stay ``p.grad``: the optimizer copies, never rebinds."""
    fw.inplace.set_policy("auto")
    a, b = nn.Parameter(fw.zeros(3)), nn.Parameter(fw.zeros(2))
    opt = optim.SGD([a, b], lr=1.0)
    bucket = fw.tensor(np.arange(5.0), dtype=fw.float32)  # b then a, as a bucket orders them
    ga, gb = bucket[2:], bucket[:2]
    a.grad, b.grad = ga, gb
    before = memory.breakdown()["gradients"]
    opt.step()
    assert a.grad is ga and b.grad is gb
    np.testing.assert_array_equal(a.detach().numpy(), [-2.0, -3.0, -4.0])
    np.testing.assert_array_equal(b.detach().numpy(), [0.0, -1.0])
    assert memory.breakdown()["gradients"] == before  # the gather was workspace


@pytest.mark.parametrize("policy", POLICIES)
def test_a_graph_recorded_before_the_flat_step_raises(policy):
    fw.inplace.set_policy(policy)
    params = make_params()
    opt = optim.Adam(params, lr=0.1)
    loss = sum((p * p).sum() for p in params)
    loss.backward(retain_graph=True)
    versions = [p._version for p in params]
    opt.step()
    assert all(p._version > v for p, v in zip(params, versions))
    with pytest.raises(RuntimeError, match="modified by .*Adam.*test_flat.py"):
        loss.backward()


def test_state_dict_round_trip_through_flat_buffers():
    fw.inplace.set_policy("auto")
    _, params, opt = run(optim.Adam, dict(lr=0.01), "auto", steps=2)
    saved = opt.state_dict()
    assert saved["state"][0]["exp_avg"].shape == params[0].shape
    import copy  # noqa: PLC0415

    saved = copy.deepcopy(saved)
    params2 = [nn.Parameter(p.detach().clone()) for p in params]
    opt2 = optim.Adam(params2, lr=0.01)
    opt2.load_state_dict(saved)
    for gs in grads_for(params, 2, seed=9):
        for ps, o in ((params, opt), (params2, opt2)):
            for p, g in zip(ps, gs):
                p.grad = fw.tensor(g, dtype=p.dtype)
            o.step()
    for p, q in zip(params, params2):
        np.testing.assert_array_equal(p.detach().numpy(), q.detach().numpy())
    assert memory.root_buffer(opt2.state[params2[0]]["exp_avg"]._data).shape == (sum(p.numel() for p in params),)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind,optimizer", [("mlp", "adam"), ("resnet", "sgd")])
def test_a_step_compiled_after_eager_flat_steps_replays_like_eager_off(kind, optimizer, policy):
    """fw.compile gives the parameters their own arrays back before it captures (its plan
    has one buffer per parameter); eager steps after it build the flat buffers again."""
    from ..compile.helpers import batches, bitwise_equal, make_model, snapshot, train_step  # noqa: PLC0415

    runs = {}
    for mode in ("eager off", "mixed"):
        fw.inplace.set_policy("off" if mode == "eager off" else policy)
        model = make_model(kind)
        if optimizer == "sgd":
            opt = fw.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        else:
            opt = fw.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-4)
        step = train_step(model, opt)
        compiled = fw.compile(step)
        out = []
        for i, (x, y) in enumerate(batches(kind, 7)):
            f = compiled if mode == "mixed" and i in (2, 3, 4) else step  # eager, compiled, eager again
            out.append(f(x, y).detach().numpy().copy())
            out += snapshot(model, opt)
        if mode == "mixed":
            assert compiled.captures >= 1 and compiled.last.replays >= 1
            p = next(model.parameters())
            assert memory.root_buffer(p._data).size == sum(q.numel() for q in model.parameters())
        runs[mode] = out
    assert bitwise_equal(runs["eager off"], runs["mixed"])


@pytest.mark.parametrize("policy", ["off", "auto", "on"])
def test_a_kept_gradient_keeps_its_values_after_its_parameter_lets_go_of_it(policy):
    """After zero_grad(set_to_none=False) each .grad is a view of the flat array. A user who
    keeps one and sets p.grad = None gets a gradient of its own at the next backward, as in
    PyTorch: the next step must not copy it into the kept tensor's slot (it did, beside the
    other parameters' gradients still in the array)."""
    with fw.inplace.policy(policy):
        w1, w2 = nn.Parameter(fw.ones(3)), nn.Parameter(fw.ones(2))
        opt = optim.SGD([w1, w2], lr=0.1)
        for scale in (2.0, 3.0):
            opt.zero_grad(set_to_none=False)
            (w1.sum() * scale + w2.sum()).backward()
            opt.step()
        kept = w1.grad
        before = kept.numpy().copy()
        w1.grad = None
        opt.zero_grad(set_to_none=False)  # w2's gradient: zeroed in its slot
        (w1.sum() * 5.0 + w2.sum()).backward()
        opt.step()
        np.testing.assert_array_equal(kept.numpy(), before)
        np.testing.assert_array_equal(w1.grad.numpy(), [5.0, 5.0, 5.0])
