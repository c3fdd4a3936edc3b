"""Worker launched by test_sync_batchnorm.py under ``mpiexec -n 2``; exits 0 when every check passes.

Usage: mpi_worker_syncbn.py [CHECK ...]   # CHECKs default to all
Rank 0 holds 3 samples, rank 1 holds 5 (UNEVEN batches). Every rank also runs plain
BatchNorm on the concatenated 8-sample batch in its own process and compares its slice.
Prints ``rank R: CHECK ok`` for each check that passed. An assertion on any rank aborts the
whole job (install_abort_on_exception), so a failure never hangs the other rank.
"""

import sys

import numpy as np

import framework as fw
from framework import nn
from framework.distributed.comm import get_world, install_abort_on_exception
from framework.distributed.sync_batchnorm import SyncBatchNorm

SIZES = (3, 5)  # samples per rank
TOL = dict(rtol=0, atol=1e-6)


def my_slice(rank):
    start = sum(SIZES[:rank])
    return slice(start, start + SIZES[rank])


def reduced_sum(world, a):
    buf = np.ascontiguousarray(a, dtype=np.float64).copy()
    return world.allreduce_(buf, "sum")


def check_layer(world, shape, steps=3):
    """Outputs, input/weight/bias gradients and running stats == BatchNorm on the whole batch."""
    r = world.rank
    c = shape[0]
    n = sum(SIZES)
    sbn = SyncBatchNorm(c, momentum=0.3, comm=world).double()
    ref = (nn.BatchNorm1d(c, momentum=0.3) if len(shape) == 1 else nn.BatchNorm2d(c, momentum=0.3)).double()
    rng = np.random.default_rng(123)  # same data on every rank
    with fw.no_grad():
        w = rng.uniform(0.5, 1.5, c)
        b = rng.standard_normal(c)
        for m in (sbn, ref):
            m.weight.copy_(fw.tensor(w))
            m.bias.copy_(fw.tensor(b))
    for step in range(steps):
        x = rng.standard_normal((n, *shape)) * 3.0 + 2.0
        g = rng.standard_normal((n, *shape))
        sl = my_slice(r)
        xs = fw.tensor(x[sl].copy(), requires_grad=True)
        out = sbn(xs)
        (out * fw.tensor(g[sl].copy())).sum().backward()
        xr = fw.tensor(x, requires_grad=True)
        want = ref(xr)
        (want * fw.tensor(g)).sum().backward()
        np.testing.assert_allclose(out.detach().numpy(), want.detach().numpy()[sl], **TOL, err_msg=f"out {step}")
        np.testing.assert_allclose(xs.grad.numpy(), xr.grad.numpy()[sl], **TOL, err_msg=f"dx {step}")
        for name in ("weight", "bias"):
            got = reduced_sum(world, getattr(sbn, name).grad.numpy())
            np.testing.assert_allclose(got, getattr(ref, name).grad.numpy(), **TOL, err_msg=f"d{name} {step}")
        for name in ("running_mean", "running_var"):
            np.testing.assert_allclose(
                getattr(sbn, name).numpy(), getattr(ref, name).numpy(), **TOL, err_msg=f"{name} {step}"
            )
        assert int(sbn.num_batches_tracked.item()) == step + 1
        sbn.zero_grad()
        ref.zero_grad()
    # Eval: running statistics, no communication (rank 1 alone runs an extra eval forward).
    sbn.eval()
    ref.eval()
    x = rng.standard_normal((4, *shape))
    for _ in range(1 + r):
        np.testing.assert_allclose(sbn(fw.tensor(x)).detach().numpy(), ref(fw.tensor(x)).detach().numpy(), **TOL)


def check_flat(world):
    check_layer(world, (4,))


def check_conv(world):
    check_layer(world, (3, 4, 5))


def conv_bn(seed):
    fw.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 5 * 5, 3),
        nn.BatchNorm1d(3),
    ).double()


def check_convert(world):
    """A converted conv-bn model on uneven shards == the plain model on the whole batch."""
    r = world.rank
    model = SyncBatchNorm.convert_sync_batchnorm(conv_bn(7), comm=world)
    ref = conv_bn(7)
    assert isinstance(model[1], SyncBatchNorm) and isinstance(model[5], SyncBatchNorm)
    rng = np.random.default_rng(9)
    n = sum(SIZES)
    for step in range(2):
        x = rng.standard_normal((n, 2, 5, 5))
        g = rng.standard_normal((n, 3))
        sl = my_slice(r)
        model.zero_grad()
        ref.zero_grad()
        (model(fw.tensor(x[sl].copy())) * fw.tensor(g[sl].copy())).sum().backward()
        (ref(fw.tensor(x)) * fw.tensor(g)).sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            np.testing.assert_allclose(
                reduced_sum(world, p.grad.numpy()), q.grad.numpy(), rtol=0, atol=1e-6, err_msg=f"{name} step {step}"
            )
        mine, want = model.state_dict(), ref.state_dict()
        assert list(mine) == list(want)
        for k in want:
            np.testing.assert_allclose(mine[k].numpy(), want[k].numpy(), rtol=0, atol=1e-6, err_msg=k)


def check_gradpen(world):
    """A gradient penalty through two SyncBatchNorms (create_graph): each rank penalizes the
    input gradient of its own shard, the penalties summed over the ranks == the penalty of
    the plain model on the whole batch (input gradients per shard, parameter gradients summed)."""
    r = world.rank
    sl = my_slice(r)
    models = []
    for sync in (True, False):
        fw.manual_seed(11)
        m = nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1),
            nn.BatchNorm2d(3),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(3 * 4 * 4, 4),
            nn.BatchNorm1d(4),
            nn.Tanh(),
        ).double()
        models.append(SyncBatchNorm.convert_sync_batchnorm(m, comm=world) if sync else m)
    rng = np.random.default_rng(13)
    x, gy = rng.standard_normal((sum(SIZES), 2, 4, 4)), rng.standard_normal((sum(SIZES), 4))
    leaves = []
    for model, data, w in zip(models, (x[sl].copy(), x), (gy[sl].copy(), gy)):
        xt = fw.tensor(data, requires_grad=True)
        (g,) = fw.autograd.grad((model(xt) * fw.tensor(w)).sum(), xt, create_graph=True)
        (g * g).sum().backward()
        leaves.append(xt)
    np.testing.assert_allclose(leaves[0].grad.numpy(), leaves[1].grad.numpy()[sl], rtol=1e-9, atol=1e-9)
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        got = reduced_sum(world, p.grad.numpy())
        np.testing.assert_allclose(got, q.grad.numpy(), rtol=1e-9, atol=1e-9, err_msg=name)


CHECKS = {"flat": check_flat, "conv": check_conv, "convert": check_convert, "gradpen": check_gradpen}


if __name__ == "__main__":
    world = get_world()
    install_abort_on_exception(world)
    assert world.size == 2, "run under mpiexec -n 2"
    for name in sys.argv[1:] or list(CHECKS):
        CHECKS[name](world)
        world.barrier()
        print(f"rank {world.rank}: {name} ok", flush=True)
