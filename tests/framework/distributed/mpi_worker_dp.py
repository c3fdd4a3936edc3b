"""Worker launched by test_data_parallel.py under ``mpiexec -n 2``; exits 0 when every check passes.

Usage: mpi_worker_dp.py POLICY [CHECK ...]   # POLICY on|off; CHECKs default to all
With ``DP_DEVICE=cuda`` (and ``DP_BACKEND=mpi|nccl``) the model and data live on each
rank's GPU and the gradients go through that communicator (the "equivalence" check).
Prints ``rank R: CHECK ok`` for each check that passed. An assertion on any rank aborts the
whole job (install_abort_on_exception), so a failure never hangs the other rank.
"""

import os
import sys

import numpy as np

import framework as fw
from framework import inplace, nn
from framework.distributed.comm import for_device, get_world, install_abort_on_exception
from framework.distributed.data_parallel import DataParallel

B, D_IN, D_HID, D_OUT = 8, 16, 32, 4
BUCKET_MB = 0.0005  # ~0.5 KB: several buckets, so launch order matters
DEVICE = os.environ.get("DP_DEVICE", "cpu")


def mlp(seed):
    fw.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, D_HID), nn.ReLU(), nn.Linear(D_HID, D_OUT))


class Branchy(nn.Module):
    """``fc(x)`` plus ``extra(x)`` when asked; ``extra`` is registered last (bucket 0)."""

    def __init__(self, seed):
        super().__init__()
        fw.manual_seed(seed)
        self.fc = nn.Linear(D_IN, D_OUT)
        self.extra = nn.Linear(D_IN, D_OUT)

    def forward(self, x, use_extra):
        out = self.fc(x)
        return out + self.extra(x) if use_extra else out


def data(seed, n):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, D_IN)).astype(np.float32)
    y = rng.standard_normal((n, D_OUT)).astype(np.float32)
    return x, y


def params_of(model):
    return [p.detach().numpy().copy() for p in model.parameters()]


def assert_close(got, want, what):
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5, err_msg=what)


def on_device(x):
    return fw.tensor(x, device=DEVICE)


def check_equivalence(world):
    """2 ranks x half of batch 2B == 1 process on batch 2B, after 10 SGD steps."""
    r, n = world.rank, world.size
    model = mlp(seed=100 + r).to(DEVICE)  # different on each rank: the broadcast must fix it
    dp = DataParallel(model, comm=world, bucket_mb=BUCKET_MB)
    assert len(dp.buckets) >= 3, dp.buckets
    opt = fw.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9)
    ref = mlp(seed=100) if r == 0 else None
    ref_opt = fw.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9) if ref is not None else None
    if ref is not None:
        assert_close(params_of(model), params_of(ref), "broadcast")
    loss_fn = nn.MSELoss()
    for step in range(10):
        x, y = data(step, n * B)
        opt.zero_grad()
        loss = loss_fn(dp(on_device(x[r * B : (r + 1) * B])), on_device(y[r * B : (r + 1) * B]))
        loss.backward()
        assert all(b.launched for b in dp.buckets), "buckets not launched from backward hooks"
        dp.finish()
        dp.finish()  # idempotent
        opt.step()
        if ref is not None:
            ref_opt.zero_grad()
            loss_fn(ref(fw.tensor(x)), fw.tensor(y)).backward()
            ref_opt.step()
    mine = params_of(model)
    everyone = world.allgather_object(mine)
    assert_close(everyone[1], everyone[0], "ranks differ")
    if ref is not None:
        assert_close(mine, params_of(ref), "data parallel != single process")


def check_views(world):
    """Under on every p.grad is a view of its bucket (same memory every step); off: not."""
    r = world.rank
    model = mlp(seed=7)
    dp = DataParallel(model, comm=world, bucket_mb=BUCKET_MB)
    opt = fw.optim.SGD(dp.parameters(), lr=0.1)
    loss_fn = nn.MSELoss()
    ptrs = None
    for step in range(2):
        x, y = data(50 + step, 2 * B)
        opt.zero_grad()
        loss_fn(dp(fw.tensor(x[r * B : (r + 1) * B])), fw.tensor(y[r * B : (r + 1) * B])).backward()
        dp.finish()
        grads = [p.grad.numpy() for p in model.parameters()]
        for p in model.parameters():
            b = dp.bucket_of(p)
            if dp.inplace:
                assert np.shares_memory(p.grad._data, b.buffer), "grad is not a bucket view"
            else:
                assert b.buffer is None and b.recv is None
                assert p.grad._data.base is None, "off: grad should own its memory"
        for i in range(len(grads)):
            for j in range(i + 1, len(grads)):
                assert not np.shares_memory(grads[i], grads[j])
        now = [g.ctypes.data for g in grads]
        if dp.inplace and ptrs is not None:
            assert now == ptrs, "on: the bucket views moved between steps"
        ptrs = now
        opt.step()
    assert dp.inplace == (inplace.get_policy() == "on")


def check_unused(world):
    """A parameter unused on one rank (and then on all) neither deadlocks nor misses grads."""
    r, n = world.rank, world.size
    dp = DataParallel(Branchy(seed=11), comm=world, bucket_mb=BUCKET_MB)
    model = dp.module
    assert dp.bucket_of(model.extra.bias).index == 0  # registered last -> launched first
    ref = Branchy(seed=0)
    loss_fn = nn.MSELoss()
    for step in range(3):
        ref.load_state_dict(model.state_dict())
        x, y = data(200 + step, n * B)
        uses = [k == 1 for k in range(n)] if step < 2 else [False] * n
        dp.zero_grad()
        loss_fn(dp(fw.tensor(x[r * B : (r + 1) * B]), uses[r]), fw.tensor(y[r * B : (r + 1) * B])).backward()
        # Bucket 0 (extra, fc.bias) is incomplete where extra is unused: nothing may launch.
        assert [b.launched for b in dp.buckets] == [uses[r]] * len(dp.buckets), step
        dp.finish()
        # Reference: every rank's local gradient computed here, then averaged.
        want = [np.zeros_like(p.detach().numpy()) for p in ref.parameters()]
        for k in range(n):
            ref.zero_grad()
            loss_fn(ref(fw.tensor(x[k * B : (k + 1) * B]), uses[k]), fw.tensor(y[k * B : (k + 1) * B])).backward()
            for w, p in zip(want, ref.parameters()):
                if p.grad is not None:
                    w += p.grad.numpy() / n
        got = [p.grad.numpy() for p in model.parameters()]
        assert_close(got, want, f"unused-parameter step {step}")
        if step == 2:
            assert not np.any(model.extra.weight.grad.numpy())
        with fw.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * p.grad)


def check_no_sync(world):
    """Two micro-batches (the first inside no_sync) == one step on the big batch."""
    r, n = world.rank, world.size
    model = mlp(seed=300 + r)
    dp = DataParallel(model, comm=world, bucket_mb=BUCKET_MB)
    opt = fw.optim.SGD(dp.parameters(), lr=0.1)
    ref = mlp(seed=300)
    ref_opt = fw.optim.SGD(ref.parameters(), lr=0.1)
    loss_fn = nn.MSELoss()
    for step in range(3):
        x, y = data(400 + step, n * 2 * B)
        mine_x, mine_y = x[r * 2 * B : (r + 1) * 2 * B], y[r * 2 * B : (r + 1) * 2 * B]
        opt.zero_grad()
        with dp.no_sync():
            (loss_fn(dp(fw.tensor(mine_x[:B])), fw.tensor(mine_y[:B])) / 2).backward()
        dp.finish()  # no-op: nothing to sync yet
        assert all(not b.launched for b in dp.buckets)
        (loss_fn(dp(fw.tensor(mine_x[B:])), fw.tensor(mine_y[B:])) / 2).backward()
        dp.finish()
        ref_opt.zero_grad()
        loss_fn(ref(fw.tensor(x)), fw.tensor(y)).backward()
        assert_close(
            [p.grad.numpy() for p in model.parameters()],
            [p.grad.numpy() for p in ref.parameters()],
            f"no_sync grads step {step}",
        )
        opt.step()
        ref_opt.step()
    assert_close(params_of(model), params_of(ref), "no_sync parameters")


CHECKS = {
    "equivalence": check_equivalence,
    "views": check_views,
    "unused": check_unused,
    "no_sync": check_no_sync,
}


if __name__ == "__main__":
    world = get_world()
    install_abort_on_exception(world)
    assert world.size >= 2, "run under mpiexec -n 2"
    inplace.set_policy(sys.argv[1])
    if DEVICE != "cpu":
        gpu = world.local_rank % fw.backend.device_count()
        fw.backend.use_device(fw.backend.Device("cuda", gpu))
        DEVICE = f"cuda:{gpu}"
        world = for_device(world, DEVICE, os.environ["DP_BACKEND"])
        assert world.backend == os.environ["DP_BACKEND"], world
    for name in sys.argv[2:] or list(CHECKS):
        CHECKS[name](world)
        world.barrier()
        print(f"rank {world.rank}: {name} ok", flush=True)
