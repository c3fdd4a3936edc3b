from pathlib import Path

import numpy as np
import pytest

import framework as fw
from framework import nn
from framework.distributed.comm import SingleProcessCommunicator
from framework.distributed.sync_batchnorm import SyncBatchNorm, sync_batch_norm
from framework.ops.norm import batch_norm
from tests.mpi_util import needs_mpiexec, run_script

HERE = Path(__file__).resolve().parent
WORKER = HERE / "mpi_worker_syncbn.py"
TOL = dict(rtol=0, atol=1e-6)


class LogComm(SingleProcessCommunicator):
    """One process; logs every in-place reduction, and optionally doubles it (a twin rank)."""

    def __init__(self, double=False):
        super().__init__()
        self.double = double
        self.log = []

    def allreduce_(self, buf, op="sum"):
        super().allreduce_(buf, op)
        self.log.append((buf.dtype, buf.size))
        if self.double:
            buf *= 2
        return buf


def fresh(a):
    return fw.tensor(np.array(a, dtype=np.float64), requires_grad=True)


SHAPES = [pytest.param((7, 4), id="NC"), pytest.param((5, 3, 4, 2), id="NCHW")]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("affine", [True, False])
def test_single_process_matches_batch_norm(shape, affine):
    c = shape[1]
    rng = np.random.default_rng(0)
    comm = LogComm()
    sbn = SyncBatchNorm(c, momentum=0.2, affine=affine, comm=comm).double()
    rm, rv = fw.zeros(c, dtype=fw.float64), fw.ones(c, dtype=fw.float64)
    w = fresh(rng.uniform(0.5, 1.5, c)) if affine else None
    b = fresh(rng.standard_normal(c)) if affine else None
    if affine:
        with fw.no_grad():
            sbn.weight.copy_(w.detach())
            sbn.bias.copy_(b.detach())
    for _ in range(2):
        x = rng.standard_normal(shape) * 2 + 5
        g = fw.tensor(rng.standard_normal(shape))
        xs, xr = fresh(x), fresh(x)
        out = sbn(xs)
        want = batch_norm(xr, rm, rv, w, b, training=True, momentum=0.2)
        np.testing.assert_allclose(out.detach().numpy(), want.detach().numpy(), **TOL)
        (out * g).sum().backward()
        (want * g).sum().backward()
        np.testing.assert_allclose(xs.grad.numpy(), xr.grad.numpy(), **TOL)
        if affine:
            np.testing.assert_allclose(sbn.weight.grad.numpy(), w.grad.numpy(), **TOL)
            np.testing.assert_allclose(sbn.bias.grad.numpy(), b.grad.numpy(), **TOL)
            sbn.zero_grad()
            w.grad = b.grad = None
        np.testing.assert_allclose(sbn.running_mean.numpy(), rm.numpy(), **TOL)
        np.testing.assert_allclose(sbn.running_var.numpy(), rv.numpy(), **TOL)
    # one float64 buffer per forward (count, sum, sum of squares) and per backward (two sums)
    assert comm.log == [(np.float64, 2 * c + 1), (np.float64, 2 * c)] * 2
    assert sbn.running_mean._vc.value == 2 and sbn.running_var._vc.value == 2  # one copy_ per step
    assert int(sbn.num_batches_tracked.item()) == 2
    # eval: running stats, no communication
    sbn.eval()
    x = rng.standard_normal(shape)
    want = batch_norm(fw.tensor(x), rm, rv, w, b, training=False)
    np.testing.assert_allclose(sbn(fw.tensor(x)).detach().numpy(), want.detach().numpy(), **TOL)
    assert len(comm.log) == 4


def test_count_is_reduced_with_the_sums():
    """A twin rank with the same data: statistics unchanged, but the count doubles."""
    rng = np.random.default_rng(1)
    comm = LogComm(double=True)
    sbn = SyncBatchNorm(3, momentum=1.0, comm=comm).double()
    x = rng.standard_normal((4, 3, 2, 2))
    xs, xr = fresh(x), fresh(x)
    rm, rv = fw.zeros(3, dtype=fw.float64), fw.ones(3, dtype=fw.float64)
    out = sbn(xs)
    want = batch_norm(xr, rm, rv, training=True, momentum=1.0)
    np.testing.assert_allclose(out.detach().numpy(), want.detach().numpy(), **TOL)
    m = 4 * 2 * 2
    biased = x.transpose(1, 0, 2, 3).reshape(3, -1).var(axis=1)
    np.testing.assert_allclose(sbn.running_var.numpy(), biased * (2 * m) / (2 * m - 1), **TOL)
    g = fw.tensor(rng.standard_normal(x.shape))
    (out * g).sum().backward()
    (want * g).sum().backward()
    np.testing.assert_allclose(xs.grad.numpy(), xr.grad.numpy(), **TOL)


def test_float32_and_errors():
    comm = LogComm()
    sbn = SyncBatchNorm(2, comm=comm)
    x = fw.tensor(np.random.default_rng(2).standard_normal((6, 2)).astype(np.float32), requires_grad=True)
    out = sbn(x)
    assert out.dtype == fw.float32
    out.sum().backward()
    assert x.grad.dtype == fw.float32
    with pytest.raises(ValueError, match="more than 1 value"):
        sbn(fw.tensor(np.zeros((1, 2), dtype=np.float32)))
    with pytest.raises(ValueError, match="channels"):
        sbn(fw.zeros(4, 3))
    with pytest.raises(ValueError, match="2D"):
        sbn(fw.zeros(4))


def conv_bn():
    fw.manual_seed(3)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.BatchNorm1d(3, affine=False)),
    )


def test_convert_keeps_state_dict_and_parameters():
    model = conv_bn()
    model.train()
    model(fw.randn(5, 2, 3, 3))  # non-trivial running stats
    model[1].eval()
    before = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    comm = LogComm()
    conv = SyncBatchNorm.convert_sync_batchnorm(model, comm=comm)
    assert isinstance(conv[1], SyncBatchNorm) and isinstance(conv[3][2], SyncBatchNorm)
    assert conv[1].comm is comm and not conv[1].training and conv[3][2].training
    assert not conv[3][2].affine and conv[3][2].weight is None
    assert list(conv.parameters()) == params  # the same Parameter objects
    after = conv.state_dict()
    assert list(after) == list(before)
    for k in before:
        np.testing.assert_array_equal(after[k].numpy(), before[k])
    fresh_model = conv_bn()
    fresh_model.load_state_dict(after)  # loads back into plain BatchNorm
    assert set(SyncBatchNorm(4).state_dict()) == set(nn.BatchNorm2d(4).state_dict())
    bn = nn.BatchNorm1d(3)
    assert isinstance(SyncBatchNorm.convert_sync_batchnorm(bn), SyncBatchNorm)


# -- two ranks under mpiexec ------------------------------------------------------------------


def run_job(nprocs=2, timeout=30.0):
    return run_script(WORKER, (), nprocs, timeout)


_job: list = []


@pytest.mark.mpi
@needs_mpiexec
@pytest.mark.parametrize("check", ["flat", "conv", "convert", "gradpen"])
def test_two_ranks_uneven_batches(check):
    """Rank 0 holds 3 samples, rank 1 holds 5: == BatchNorm on all 8 in one process (1e-6)."""
    if not _job:
        _job.append(run_job())  # one mpiexec run does every check
    code, out, err, _ = _job[0]
    for rank in (0, 1):
        assert f"rank {rank}: {check} ok" in out, f"rc={code}\nstdout:\n{out}\nstderr:\n{err}"
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"


# -- higher-order gradients (create_graph) ----------------------------------------------------

HTOL = dict(rtol=1e-10, atol=1e-10)


def penalized(bn, x0, w0, b0, gy, order):
    """Input, weight and bias gradients of a gradient penalty through ``bn(x, w, b)``.

    ``L = sum(tanh(bn(x)) * gy)``; order 2: ``|dL/dx|^2``, order 3: ``|d|dL/dx|^2/dx|^2``.
    """
    x, w, b = fresh(x0), fresh(w0), fresh(b0)
    loss = (bn(x, w, b).tanh() * fw.tensor(gy)).sum()
    for _ in range(order - 1):
        (g,) = fw.autograd.grad(loss, x, create_graph=True)
        loss = (g * g).sum()
    loss.backward()
    return x.grad.numpy(), w.grad.numpy(), b.grad.numpy()


def sync(comm):
    return lambda x, w, b: sync_batch_norm(x, None, None, w, b, comm=comm)


def plain(x, w, b):
    return batch_norm(x, None, None, w, b, training=True)


@pytest.mark.parametrize("order", [2, 3])
@pytest.mark.parametrize("shape", SHAPES)
def test_higher_order_single_process_matches_batch_norm(shape, order):
    rng = np.random.default_rng(4)
    x, gy = rng.standard_normal(shape) * 2 + 1, rng.standard_normal(shape)
    w, b = rng.uniform(0.5, 1.5, shape[1]), rng.standard_normal(shape[1])
    comm = LogComm()
    for got, want in zip(penalized(sync(comm), x, w, b, gy, order), penalized(plain, x, w, b, gy, order)):
        np.testing.assert_allclose(got, want, **HTOL)
    c = shape[1]
    if order == 2:  # forward; statistics and sums of the create_graph backward; their two
        # backwards and BN's own (first-order) backward in the second pass
        assert comm.log == [(np.float64, 2 * c + 1)] + [(np.float64, 2 * c)] * 5


@pytest.mark.parametrize("shape", SHAPES)
def test_second_order_twin_rank_matches_the_concatenated_batch(shape):
    """Each rank's penalty over its own gradient, summed over the ranks (as data parallel
    training sums the ranks' losses): a twin rank holding the same data gives the input
    gradients and HALF the weight and bias gradients of one process on both batches."""
    rng = np.random.default_rng(5)
    x, gy = rng.standard_normal(shape) * 2 + 1, rng.standard_normal(shape)
    w, b = rng.uniform(0.5, 1.5, shape[1]), rng.standard_normal(shape[1])
    n = shape[0]
    gx, gw, gb = penalized(sync(LogComm(double=True)), x, w, b, gy, 2)
    rx, rw, rb = penalized(plain, np.concatenate([x, x]), w, b, np.concatenate([gy, gy]), 2)
    np.testing.assert_allclose(gx, rx[:n], **HTOL)
    np.testing.assert_allclose(gx, rx[n:], **HTOL)
    np.testing.assert_allclose(2 * gw, rw, **HTOL)
    np.testing.assert_allclose(2 * gb, rb, **HTOL)


def test_create_graph_gives_the_first_order_gradients():
    """The gradients taken with create_graph are the first-order ones (same reductions)."""
    rng = np.random.default_rng(6)
    x0 = rng.standard_normal((5, 3, 2, 2))
    gy = fw.tensor(rng.standard_normal(x0.shape))
    grads = []
    for create_graph in (False, True):
        x = fresh(x0)
        out = sync_batch_norm(x, None, None, comm=LogComm(double=True))
        (g,) = fw.autograd.grad((out.tanh() * gy).sum(), x, create_graph=create_graph)
        assert g.requires_grad == create_graph
        grads.append(g.detach().numpy())
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-12, atol=1e-14)


def test_second_order_float32_keeps_the_dtype():
    rng = np.random.default_rng(7)
    x0 = rng.standard_normal((6, 3, 2, 2)).astype(np.float32)
    gy = fw.tensor(rng.standard_normal(x0.shape).astype(np.float32))
    grads = []
    for bn in (sync(LogComm()), plain):
        x = fw.tensor(x0, requires_grad=True)
        (g,) = fw.autograd.grad((bn(x, None, None).tanh() * gy).sum(), x, create_graph=True)
        (g * g).sum().backward()
        assert g.dtype == x.grad.dtype == fw.float32
        grads.append(x.grad.numpy())
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-4, atol=1e-5)
