"""fw.amp.GradScaler against torch.amp.GradScaler (PyTorch 2.13) on one overflow sequence:
the same scales, the same skipped steps and the same parameters; its errors and its state;
and on the GPU leg the same run with nothing read back to the host per step.

The gradients are chosen, not computed: the loss is ``sum(p * G_t)``, so ``p.grad`` is
``scale * G_t`` exactly (a power of two times a float32), with an inf or a NaN in ``G_t``
at the chosen steps. The optimizers' updates are PyTorch's rules on both sides.
"""

from __future__ import annotations

import numpy as np
import pytest

import framework as fw
from framework.testing import to_numpy

# the injected infs overflow NumPy's products on the way: expected, and what the scaler handles
pytestmark = pytest.mark.filterwarnings(
    "ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning"
)

STEPS = 12
BAD = {1: np.inf, 2: -np.inf, 6: np.nan, 7: np.inf}  # step -> the bad value injected
GROWTH_INTERVAL = 2
SHAPES = [(3, 4), (4,)]


def _grads():
    rng = np.random.default_rng(0)
    out = []
    for step in range(STEPS):
        gs = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
        if step in BAD:
            gs[step % 2].flat[1] = BAD[step]
        out.append(gs)
    return out


INIT = [np.random.default_rng(1).standard_normal(s).astype(np.float32) for s in SHAPES]
OPTIMIZERS = {
    "sgd": lambda optim, ps: optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda optim, ps: optim.Adam(ps, lr=0.01),
    "adamw": lambda optim, ps: optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}


def _run_ours(opt_name, device="cpu", unscale_at=(3, 8), init_scale=2.0**16):
    params = [fw.tensor(a, device=device, requires_grad=True) for a in INIT]
    opt = OPTIMIZERS[opt_name](fw.optim, params)
    scaler = fw.amp.GradScaler(device, init_scale=init_scale, growth_interval=GROWTH_INTERVAL)
    scales, grads = [], _grads()
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum((p * fw.tensor(g, device=device)).sum() for p, g in zip(params, grads[step]))
        scaler.scale(loss).backward()
        if step in unscale_at:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, [to_numpy(p.detach()._data).copy() for p in params], scaler, opt


def _run_theirs(torch, opt_name, unscale_at=(3, 8), init_scale=2.0**16):
    params = [torch.tensor(a, requires_grad=True) for a in INIT]
    opt = OPTIMIZERS[opt_name](torch.optim, params)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=GROWTH_INTERVAL)
    scales, grads = [], _grads()
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum((p * torch.from_numpy(g)).sum() for p, g in zip(params, grads[step]))
        scaler.scale(loss).backward()
        if step in unscale_at:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, [p.detach().numpy().copy() for p in params], scaler, opt


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_the_same_scales_skips_and_parameters_as_torch(opt_name, torch):
    scales, params, scaler, opt = _run_ours(opt_name)
    tscales, tparams, tscaler, topt = _run_theirs(torch, opt_name)
    assert scales == tscales
    # the sequence exercised both ways: backoff at each bad step, growth after two good ones
    assert scales[:5] == [2.0**16, 2.0**15, 2.0**14, 2.0**14, 2.0**15]
    assert scaler.state_dict() == tscaler.state_dict()
    for a, b in zip(params, tparams):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
    if opt_name != "sgd":  # Adam's step counts the steps taken: 12 less the 4 skipped
        assert {st["step"] for st in opt.state.values()} == {STEPS - len(BAD)}
        assert {int(st["step"]) for st in topt.state.values()} == {STEPS - len(BAD)}


def test_errors_and_state_as_torch(torch):
    p = fw.zeros(2, requires_grad=True)
    opt = fw.optim.SGD([p], lr=0.1)
    scaler = fw.amp.GradScaler("cpu")
    assert scaler.get_scale() == 2.0**16 and scaler.is_enabled()
    with pytest.raises(RuntimeError, match="_scale is None"):
        scaler.unscale_(opt)
    scaler.scale(p.sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) is being called after step"):
        scaler.unscale_(opt)
    scaler.update()
    h = fw.zeros(2, dtype=fw.float16, requires_grad=True)
    scaler.scale(h.sum()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(fw.optim.SGD([h], lr=0.1))
    tp = torch.zeros(2, dtype=torch.float16, requires_grad=True)
    tscaler = torch.amp.GradScaler("cpu")
    tscaler.scale(tp.sum()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        tscaler.unscale_(torch.optim.SGD([tp], lr=0.1))
    # disabled: a no-op, as PyTorch's
    off = fw.amp.GradScaler("cpu", enabled=False)
    x = fw.ones(1)
    assert off.scale(x) is x and off.get_scale() == 1.0 and off.state_dict() == {}
    with pytest.raises(ValueError, match="growth factor"):
        fw.amp.GradScaler("cpu", growth_factor=1.0)


def test_a_state_dict_resumes_the_sequence(torch):
    """Stopped after step 4 and resumed from state dicts, the run ends as the one never stopped."""
    full = _run_ours("adam")
    params = [fw.tensor(a, requires_grad=True) for a in INIT]
    opt = fw.optim.Adam(params, lr=0.01)
    scaler = fw.amp.GradScaler("cpu", growth_interval=GROWTH_INTERVAL)
    grads, scales = _grads(), []
    for step in range(STEPS):
        if step == 5:  # a new scaler and optimizer from the saved state, as a resumed run
            saved_scaler, saved_opt = scaler.state_dict(), opt.state_dict()
            opt = fw.optim.Adam(params, lr=0.01)
            opt.load_state_dict(saved_opt)
            scaler = fw.amp.GradScaler("cpu")
            scaler.load_state_dict(saved_scaler)
            assert scaler.get_scale() == scales[-1] and scaler.get_growth_interval() == GROWTH_INTERVAL
        opt.zero_grad()
        loss = sum((p * fw.tensor(g)).sum() for p, g in zip(params, grads[step]))
        scaler.scale(loss).backward()
        if step in (3, 8):
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    assert scales == full[0]
    for a, b in zip(params, full[1]):
        np.testing.assert_array_equal(a.detach().numpy(), b)
    tscaler = torch.amp.GradScaler("cpu")
    tscaler.load_state_dict(scaler.state_dict())  # the same keys and types as PyTorch's
    assert tscaler.state_dict() == scaler.state_dict()


@pytest.mark.gpu
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_on_the_gpu_the_flag_stays_on_the_device(opt_name):
    """The same sequence on the GPU leg: the CPU's scales, skips and parameters, and from
    the second step on not one host synchronization per step (the flag goes to the fused
    kernels); Adam's step count comes out right once the host asks for it."""
    from framework.testing.cupy_standin import counting  # noqa: PLC0415

    cpu_scales, cpu_params, _, _ = _run_ours(opt_name)
    params = [fw.tensor(a, device="cuda", requires_grad=True) for a in INIT]
    opt = OPTIMIZERS[opt_name](fw.optim, params)
    scaler = fw.amp.GradScaler("cuda", growth_interval=GROWTH_INTERVAL)
    grads = [[fw.tensor(g, device="cuda") for g in gs] for gs in _grads()]
    syncs, scales = [], []
    for step in range(STEPS):
        with counting.count() as c:
            opt.zero_grad()
            loss = sum((p * g).sum() for p, g in zip(params, grads[step]))
            scaler.scale(loss).backward()
            if step in (3, 8):
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        syncs.append(c.host_syncs)
        scales.append(scaler.get_scale())  # read after the count: the test's own sync
    assert syncs[1:] == [0] * (STEPS - 1), syncs
    assert scales == cpu_scales
    for a, b in zip(params, cpu_params):
        np.testing.assert_allclose(to_numpy(a.detach()._data), b, rtol=2e-6, atol=1e-7)
    if opt_name != "sgd":
        assert {opt.state_dict()["state"][i]["step"] for i in range(2)} == {STEPS - len(BAD)}
