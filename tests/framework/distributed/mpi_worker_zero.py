"""Worker launched by test_zero.py under ``mpiexec -n N``; exits 0 when every check passes.

Usage: mpi_worker_zero.py [CHECK ...]   # CHECKs default to all
With ``DP_DEVICE=cuda`` (and ``DP_BACKEND=mpi|nccl``) the model lives on each rank's GPU.
Prints ``rank R: CHECK ok`` for each check that passed; an assertion on any rank aborts the
whole job (install_abort_on_exception).
"""

import gc
import os
import sys

import numpy as np

import framework as fw
from framework import inplace, memory, nn
from framework.distributed.comm import for_device, get_world, install_abort_on_exception
from framework.distributed.data_parallel import DataParallel
from framework.distributed.zero import ZeroRedundancyOptimizer, model_state_bytes

B, D_IN, D_HID, D_OUT = 8, 16, 48, 4
BUCKET_MB = 0.004  # ~4 KB: several buckets, most of them shared out unevenly between the ranks
DEVICE = os.environ.get("DP_DEVICE", "cpu")
U = 2.0**-24  # float32's unit roundoff
OPTIMIZERS = {
    "adam": (fw.optim.Adam, dict(lr=1e-2, weight_decay=1e-2), 8),
    "adamw": (fw.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), 8),
    "sgd": (fw.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3), 4),
}


def mlp(seed):
    fw.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, D_HID), nn.ReLU(), nn.Linear(D_HID, D_HID), nn.Tanh(), nn.Linear(D_HID, D_OUT))


def data(seed, n):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, D_IN)).astype(np.float32), rng.standard_normal((n, D_OUT)).astype(np.float32)


def two_groups(model):
    """nanoGPT's groups: matrices decay, vectors do not (runs of each alternate in a shard)."""
    ps = list(model.parameters())
    return [{"params": [p for p in ps if p.ndim >= 2]}, {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}]


def train(world, stage, optimizer="adam", steps=4, groups=False, micro=1, state=None, after=None, reset=True):
    """``steps`` steps of the MLP over ``world``; ZeRO ``stage`` (0: a plain optimizer).

    Returns the parameters, the losses, the parameters/gradients/state bytes after the last
    step, the first step's averaged gradients (stage 2: this rank's shard) and the optimizer.
    """
    gc.collect()
    r, n = world.rank, world.size
    model = mlp(seed=3).to(DEVICE)
    dp = DataParallel(model, comm=world, bucket_mb=BUCKET_MB)
    cls, kwargs, _ = OPTIMIZERS[optimizer]
    params = two_groups(model) if groups else list(dp.parameters())
    if stage:
        opt = ZeroRedundancyOptimizer(params, cls, data_parallel=dp, stage=stage, **kwargs)
    else:
        opt = cls(params, **kwargs)
    if state is not None:
        opt.load_state_dict(state)
    loss_fn = nn.MSELoss()
    losses, first_grads = [], None
    for step in range(steps):
        x, y = data(step, n * B * micro)
        mine = slice(r * B * micro, (r + 1) * B * micro)
        x, y = fw.tensor(x[mine], device=DEVICE), fw.tensor(y[mine], device=DEVICE)
        if reset or step == 0:
            opt.zero_grad()
        total = 0.0
        for k in range(micro):
            part = slice(k * B, (k + 1) * B)
            if k < micro - 1:
                with dp.no_sync():
                    loss = loss_fn(dp(x[part]), y[part]) / micro
                    loss.backward()
            else:
                loss = loss_fn(dp(x[part]), y[part]) / micro
                loss.backward()
            total += loss.item()
        dp.finish()
        if step == 0:
            first_grads = first_step_grads(dp, opt, stage)
        if stage == 2:
            assert all(p.grad is None for p in model.parameters()), "stage 2 keeps no full gradient"
        opt.step()
        losses.append(world.allreduce_scalar(total, "mean"))
        if after is not None:
            after(step, opt)
    held = memory.breakdown(DEVICE)
    states = held["parameters"] + held["gradients"] + held["optimizer_state"]
    values = [p.detach().numpy().copy() for p in model.parameters()]
    return values, losses, states, first_grads, opt


def first_step_grads(dp, opt, stage):
    """The averaged gradients of the float32 flat order (stage 2: this rank's shard of them)."""
    if stage == 2:
        plan = opt.plans[np.dtype(np.float32)]
        return fw.backend.to_numpy(dp.grad_shard(np.float32))[: plan.hi - plan.lo].copy()
    order = dp.flat_order()[np.dtype(np.float32)]
    return np.concatenate([p.grad.numpy().reshape(-1) for p in order])


def same(a, b, what):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y, err_msg=what)


def check_equal(world):
    """Stage 1 is stage 0 bit for bit; stage 2 too on 2 ranks, within the sums' rounding on more."""
    n = world.size
    for optimizer in ("adam", "sgd"):
        ref, ref_losses, _, ref_grads, _ = train(world, 0, optimizer, groups=optimizer == "adam")
        for stage in (1, 2):
            got, losses, _, grads, opt = train(world, stage, optimizer, groups=optimizer == "adam")
            what = f"{optimizer} stage {stage} under {inplace.get_policy()}"
            if stage == 1 or n == 2:
                same(got, ref, what)
                assert losses == ref_losses, what
            else:
                plan = opt.plans[np.dtype(np.float32)]
                bound = 2 * (n - 1) * U * abs_sums(world)[plan.lo : plan.hi] / n + np.spacing(np.abs(grads))
                diff = np.abs(grads - ref_grads[plan.lo : plan.hi])
                assert (diff <= bound).all(), f"{what}: {diff.max()} > bound"
                np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=what)
                for g, w in zip(got, ref):
                    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=what)


def abs_sums(world):
    """sum over ranks of |g_r| of the first step's local gradients, in the float32 flat order."""
    model = mlp(seed=3).to(DEVICE)
    dp = DataParallel(model, comm=world, bucket_mb=BUCKET_MB)
    r = world.rank
    x, y = data(0, world.size * B)
    mine = slice(r * B, (r + 1) * B)
    with dp.no_sync():  # the local gradients
        nn.MSELoss()(dp(fw.tensor(x[mine], device=DEVICE)), fw.tensor(y[mine], device=DEVICE)).backward()
    order = dp.flat_order()[np.dtype(np.float32)]
    local = np.concatenate([np.abs(p.grad.numpy().reshape(-1)).astype(np.float64) for p in order])
    world.allreduce_(local)
    return local


def check_memory(world):
    """Parameters + gradients + Adam's state per rank within 2% of Rajbhandari et al.'s bytes."""
    n = world.size
    numel = sum(p.numel() for p in mlp(seed=0).parameters())
    for stage in (0, 1, 2):
        held = train(world, stage, steps=2)[2]
        want = model_state_bytes(numel, 4, 8, stage, n)
        assert abs(held - want) <= 0.02 * want, f"stage {stage}: {held} bytes held, the formula says {want:.0f}"
        everyone = world.allgather_object(held)
        if world.rank == 0:
            print(f"stage {stage} on {n} ranks: {everyone} bytes per rank, formula {want:.0f}", flush=True)


def check_state(world):
    """A consolidated state is the wrapped optimizer's: stage 1's equals stage 0's; loaded at
    another stage (and back) training goes on as if never stopped."""
    ref, _, _, _, ref_opt = train(world, 0, "adam", steps=3, groups=True)
    kept = {}

    def consolidate(step, opt):
        if step == 1:
            opt.consolidate_state_dict(to=0)
            kept["state"] = world.broadcast_object(opt.state_dict() if world.rank == 0 else None)

    got, _, _, _, opt = train(world, 1, "adam", steps=3, groups=True, after=consolidate)
    same(got, ref, "stage 1 with a consolidation")
    opt.consolidate_state_dict(to=0)
    full = world.broadcast_object(opt.state_dict() if world.rank == 0 else None)
    want = ref_opt.state_dict()
    assert full["param_groups"] == want["param_groups"]
    assert full["state"].keys() == want["state"].keys()
    for i, st in want["state"].items():
        assert list(full["state"][i]) == list(st)
        for k, v in st.items():
            np.testing.assert_array_equal(np.asarray(full["state"][i][k]), v.numpy() if hasattr(v, "numpy") else v)
    # stage 0's state dict loaded by stage 2 (as a checkpoint of another stage would be) ...
    resumed = train_from(world, 2, kept["state"], first_step=2)
    if world.size == 2:  # ... goes on as the uninterrupted run (bit for bit where the sums agree)
        same(resumed, ref, "stage 2 resumed from stage 1's state at step 2")
    # ... and a stage-0 state of every parameter comes back whole from the shards
    for stage in (1, 2):
        model = mlp(seed=3).to(DEVICE)
        dp = DataParallel(model, comm=world, bucket_mb=BUCKET_MB)
        zero = ZeroRedundancyOptimizer(two_groups(model), fw.optim.Adam, data_parallel=dp, stage=stage, lr=1e-2)
        zero.load_state_dict(want)
        zero.consolidate_state_dict(to=0)
        if world.rank == 0:
            back = zero.state_dict()
            for i, st in want["state"].items():
                for k, v in st.items():
                    np.testing.assert_array_equal(back["state"][i][k], v.numpy() if hasattr(v, "numpy") else v)


def train_from(world, stage, state, first_step):
    """Steps ``first_step``.. of :func:`train`'s run from a state dict (parameters rebuilt
    by replaying the first steps with stage 0: the checkpoint's model)."""
    r, n = world.rank, world.size
    model = mlp(seed=3).to(DEVICE)
    dp = DataParallel(model, comm=world, bucket_mb=BUCKET_MB)
    opt = fw.optim.Adam(two_groups(model), **OPTIMIZERS["adam"][1])
    loss_fn = nn.MSELoss()

    def one(step, opt):
        x, y = data(step, n * B)
        mine = slice(r * B, (r + 1) * B)
        opt.zero_grad()
        loss_fn(dp(fw.tensor(x[mine], device=DEVICE)), fw.tensor(y[mine], device=DEVICE)).backward()
        dp.finish()
        opt.step()

    for step in range(first_step):
        one(step, opt)
    saved_model = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    model = mlp(seed=99).to(DEVICE)  # a new run: the model from the checkpoint, the optimizer's state too
    model.load_state_dict(saved_model)
    dp = DataParallel(model, comm=world, bucket_mb=BUCKET_MB)
    adam = OPTIMIZERS["adam"][1]
    zero = ZeroRedundancyOptimizer(two_groups(model), fw.optim.Adam, data_parallel=dp, stage=stage, **adam)
    zero.load_state_dict(state)
    for step in range(first_step, 3):
        one(step, zero)
    return [p.detach().numpy().copy() for p in model.parameters()]


def check_accumulate(world):
    """Micro-batches under no_sync: stage 2 reduce-scatters the accumulated sum once. Without
    zero_grad between steps the gradients add up across steps (stage 2: in its shard, the
    step's average added to the one kept: the same up to rounding)."""
    ref, ref_losses, _, _, _ = train(world, 0, "adamw", steps=2, micro=2)
    for stage in (1, 2):
        got, losses, _, _, _ = train(world, stage, "adamw", steps=2, micro=2)
        if stage == 1 or world.size == 2:
            same(got, ref, f"accumulated, stage {stage}")
        else:
            np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    kept = train(world, 0, "sgd", steps=3, reset=False)[0]
    for got, want in zip(train(world, 2, "sgd", steps=3, reset=False)[0], kept):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg="gradients kept across steps")


def check_clip(world):
    """Stage 2's clipping by the norm of the shards equals clipping the full gradients."""
    from trainers.trainer import clip_grad_norm_  # noqa: PLC0415

    norms = {}
    for stage in (0, 2):
        model = mlp(seed=3).to(DEVICE)
        dp = DataParallel(model, comm=world, bucket_mb=BUCKET_MB)
        if stage:
            opt = ZeroRedundancyOptimizer(dp.parameters(), fw.optim.SGD, data_parallel=dp, stage=2, lr=0.1)
        else:
            opt = fw.optim.SGD(dp.parameters(), lr=0.1)
        r, n = world.rank, world.size
        x, y = data(7, n * B)
        mine = slice(r * B, (r + 1) * B)
        opt.zero_grad()
        (100 * nn.MSELoss()(dp(fw.tensor(x[mine], device=DEVICE)), fw.tensor(y[mine], device=DEVICE))).backward()
        dp.finish()
        norms[stage] = opt.clip_grad_norm_(0.5) if stage else clip_grad_norm_(list(model.parameters()), 0.5)
        opt.step()
        norms[f"params{stage}"] = [p.detach().numpy().copy() for p in model.parameters()]
    # the same gradients (2 ranks) summed in another order in float64; else float32 gradients within rounding
    close = 1e-12 if world.size == 2 else 1e-6
    assert norms[0] > 0.5 and abs(norms[2] - norms[0]) <= close * norms[0], (norms[0], norms[2])
    for a, b in zip(norms["params0"], norms["params2"]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


CHECKS = {
    "equal": check_equal,
    "memory": check_memory,
    "state": check_state,
    "accumulate": check_accumulate,
    "clip": check_clip,
}


if __name__ == "__main__":
    world = get_world()
    install_abort_on_exception(world)
    assert world.size >= 2, "run under mpiexec -n 2 or more"
    if DEVICE != "cpu":
        gpu = world.local_rank % fw.backend.device_count()
        fw.backend.use_device(fw.backend.Device("cuda", gpu))
        DEVICE = f"cuda:{gpu}"
        world = for_device(world, DEVICE, os.environ["DP_BACKEND"])
        memory.enable_gpu_hook()
    policies = os.environ.get("ZERO_POLICIES", "on,off,auto").split(",")
    for name in sys.argv[1:] or list(CHECKS):
        for policy in policies if name == "equal" else policies[:1]:
            with inplace.policy(policy):
                CHECKS[name](world)
        world.barrier()
        print(f"rank {world.rank}: {name} ok", flush=True)
