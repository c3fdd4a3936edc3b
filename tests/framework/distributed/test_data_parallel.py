from pathlib import Path

import numpy as np
import pytest

import framework as fw
from framework import inplace, memory, nn
from framework.distributed.comm import Communicator, Handle, SingleProcessCommunicator
from framework.distributed.data_parallel import DataParallel
from framework.nn.parameter import Parameter
from tests.conftest import CUDA_AVAILABLE, requires_gpu
from tests.framework.optim.test_flat import per_parameter
from tests.mpi_util import HAVE_MPI4PY, needs_mpiexec, run_script, worker_env

HERE = Path(__file__).resolve().parent
WORKER = HERE / "mpi_worker_dp.py"
POLICIES = ("on", "off")


def run_job(args, nprocs, timeout=30.0):
    return run_script(WORKER, args, nprocs, timeout)


@pytest.fixture(params=POLICIES)
def policy(request):
    with inplace.policy(request.param):
        yield request.param


def mlp(seed=0):
    fw.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def batch(seed=0, n=5):
    rng = np.random.default_rng(seed)
    return (
        fw.tensor(rng.standard_normal((n, 6)).astype(np.float32)),
        fw.tensor(rng.standard_normal((n, 3)).astype(np.float32)),
    )


def grads(model):
    return [p.grad.numpy().copy() for p in model.parameters()]


def values(model):
    return [p.detach().numpy().copy() for p in model.parameters()]


class TwinComm(SingleProcessCommunicator):
    """A 2-rank world in one process whose other rank has exactly this rank's gradients.

    Sums double, so averaged gradients equal the local ones; every collective is logged.
    """

    def __init__(self):
        super().__init__()
        self.size = 2
        self.log = []

    def broadcast_(self, buf, root=0):
        self.log.append(("bcast", buf.size))
        return buf

    def iallreduce_(self, buf, op="sum"):
        self.log.append(("inplace", buf.size))
        np.multiply(buf, 2, out=buf)
        return Handle(None, buf)

    def iallreduce_copy(self, sendbuf, recvbuf, op="sum"):
        assert not np.shares_memory(sendbuf, recvbuf)
        self.log.append(("copy", sendbuf.size))
        np.multiply(sendbuf, 2, out=recvbuf)
        return Handle(None, recvbuf)


def single_worlds():
    worlds = [pytest.param(SingleProcessCommunicator, id="no-mpi")]
    if HAVE_MPI4PY:
        worlds.append(pytest.param(Communicator, id="mpi-singleton"))
    return worlds


# -- one process: a passthrough --------------------------------------------------------------


@pytest.mark.parametrize("make", single_worlds())
def test_single_process_passthrough(make, policy):
    model, ref = mlp(), mlp()
    dp = DataParallel(model, comm=make())
    assert dp.module is model and dp.buckets == [] and dp.comm.size == 1
    assert list(dp.parameters()) == list(model.parameters())
    assert all(k.startswith("module.") for k in dp.state_dict())
    x, y = batch()
    out = dp(x)
    np.testing.assert_array_equal(out.detach().numpy(), ref(x).detach().numpy())
    nn.MSELoss()(out, y).backward()
    dp.finish()
    dp.finish()
    nn.MSELoss()(ref(x), y).backward()
    for g, w in zip(grads(model), grads(ref)):
        np.testing.assert_array_equal(g, w)
    with dp.no_sync():  # accumulates, as without the wrapper
        nn.MSELoss()(dp(x), y).backward()
    dp.finish()
    for g, w in zip(grads(model), grads(ref)):
        np.testing.assert_allclose(g, 2 * w, rtol=1e-6)


def train(policy_name, comm_factory, steps=3, accumulate=False):
    with inplace.policy(policy_name):
        model = mlp(seed=3)
        dp = DataParallel(model, comm=comm_factory(), bucket_mb=0.0001)
        opt = fw.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9)
        for step in range(steps):
            x, y = batch(seed=step, n=6)
            opt.zero_grad()
            if accumulate:
                with dp.no_sync():
                    (nn.MSELoss()(dp(x[:3]), y[:3]) / 2).backward()
                (nn.MSELoss()(dp(x[3:]), y[3:]) / 2).backward()
            else:
                nn.MSELoss()(dp(x), y).backward()
            dp.finish()
            opt.step()
        return values(model), grads(model), dp


@pytest.mark.parametrize("comm_factory", [SingleProcessCommunicator, TwinComm], ids=["single", "twin"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["step", "no_sync"])
def test_policies_give_identical_results(comm_factory, accumulate):
    on_vals, on_grads, _ = train("on", comm_factory, accumulate=accumulate)
    off_vals, off_grads, _ = train("off", comm_factory, accumulate=accumulate)
    plain_vals, plain_grads, _ = train("off", SingleProcessCommunicator, accumulate=False)
    for a, b, c in zip(on_vals + on_grads, off_vals + off_grads, plain_vals + plain_grads):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)


# -- the bucketed path in one process (TwinComm) ----------------------------------------------


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Parameter(fw.zeros(10, dtype=fw.float32))  # 40 B
        self.b = Parameter(fw.zeros(10, dtype=fw.float64))  # 80 B
        self.c = Parameter(fw.zeros(10, dtype=fw.float32))  # 40 B
        self.big = Parameter(fw.zeros(100, dtype=fw.float32))  # 400 B > bucket
        self.frozen = Parameter(fw.zeros(3), requires_grad=False)
        self.d = Parameter(fw.zeros(5, dtype=fw.float32))  # 20 B
        self.register_buffer("count", fw.zeros(1, dtype=fw.int64))

    def forward(self, x):
        return (x * self.a).sum() + (self.b.sum() + self.c.sum() + self.big.sum() + self.d.sum()) * 1.0


def test_bucket_layout(policy):
    model = Mixed()
    comm = TwinComm()
    dp = DataParallel(model, comm=comm, bucket_mb=100 / 2**20)  # 100-byte buckets
    names = {id(p): n for n, p in model.named_parameters()}
    layout = [(str(b.dtype), [names[id(q)] for q in b.params]) for b in dp.buckets]
    # Reverse registration order, per dtype, at most 100 B, the big one alone, frozen skipped;
    # "a" joins "c"'s still-open float32 bucket.
    assert layout == [("float32", ["d"]), ("float32", ["big"]), ("float32", ["c", "a"]), ("float64", ["b"])], layout
    assert [b.offsets for b in dp.buckets] == [[0], [0], [0, 10], [0]]
    assert [b.index for b in dp.buckets] == [0, 1, 2, 3]
    assert dp.bucket_of(model.frozen) is None
    # Parameters (5) and the buffer are broadcast from rank 0 at construction.
    assert comm.log.count(("bcast", 1)) == 1 and len(comm.log) == 7
    if policy == "on":
        for b in dp.buckets:
            assert b.buffer.dtype == b.dtype and b.buffer.size == b.numel
            assert memory.is_tracked(b.buffer)
    else:
        assert all(b.buffer is None for b in dp.buckets)
    with pytest.raises(ValueError, match="bucket_mb"):
        DataParallel(Mixed(), comm=TwinComm(), bucket_mb=0)
    with pytest.raises(TypeError, match="nn.Module"):
        DataParallel(lambda x: x, comm=TwinComm())


def test_grads_are_bucket_views_under_on_only(policy):
    model = mlp()
    comm = TwinComm()
    dp = DataParallel(model, comm=comm, bucket_mb=0.0001)
    assert len(dp.buckets) == 4
    comm.log.clear()
    x, y = batch()
    dp.zero_grad()
    nn.MSELoss()(dp(x), y).backward()
    # Every bucket was launched from the backward hooks, in bucket order, before finish().
    assert all(b.launched for b in dp.buckets)
    kind = "inplace" if policy == "on" else "copy"
    bcasts = [e for e in comm.log if e[0] == "bcast"]
    assert bcasts == []  # the model has no buffers
    assert comm.log == [(kind, b.numel) for b in dp.buckets]
    dp.finish()
    for p in model.parameters():
        b = dp.bucket_of(p)
        if policy == "on":
            assert np.shares_memory(p.grad._data, b.buffer)
        else:
            assert b.buffer is None and p.grad._data.base is None


def test_inplace_writes_into_gradients_bump_their_versions():
    """The allreduce (and the copy of a gradient into its bucket) change .grad in place:
    a graph that saved a gradient before finish() cannot backpropagate stale values."""
    with inplace.policy("on"):
        model = mlp()
        dp = DataParallel(model, comm=TwinComm(), bucket_mb=0.0001)
        x, y = batch()
        dp.zero_grad()
        nn.MSELoss()(dp(x), y).backward()
        p = next(model.parameters())
        w = fw.ones(p.shape, requires_grad=True)
        uses_grad = (w * p.grad).sum()  # MulBackward0 saves p.grad for w's gradient
        before = {id(q): q.grad._version for q in model.parameters()}
        dp.finish()
        for q in model.parameters():
            assert q.grad._version == before[id(q)] + 1
        with pytest.raises(RuntimeError, match="modified by allreduce_"):
            uses_grad.backward()


def test_broadcast_of_parameters_bumps_their_versions():
    model = mlp()
    versions = [p._version for p in model.parameters()]
    DataParallel(model, comm=TwinComm(), bucket_mb=0.0001)
    assert [p._version for p in model.parameters()] == [v + 1 for v in versions]


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        fw.manual_seed(5)
        self.fc = nn.Linear(6, 3)
        self.extra = nn.Linear(6, 3)

    def forward(self, x, use_extra=True):
        out = self.fc(x)
        return out + self.extra(x) if use_extra else out


def test_forward_before_finish_raises_and_unused_params_get_zeros(policy):
    model = Branchy()
    dp = DataParallel(model, comm=TwinComm(), bucket_mb=0.00005)
    x, y = batch()
    dp.zero_grad()
    nn.MSELoss()(dp(x), y).backward()
    with pytest.raises(RuntimeError, match=r"dp.finish\(\)"):
        dp(x)
    with fw.no_grad():
        dp(x)  # evaluation is fine
    dp.finish()
    assert np.any(model.extra.weight.grad.numpy())
    # extra is unused: its bucket (launched first) waits, then finish() sends zeros.
    dp.zero_grad()
    nn.MSELoss()(dp(x, use_extra=False), y).backward()
    assert dp.bucket_of(model.extra.bias).index == 0
    assert not any(b.launched for b in dp.buckets)
    dp.finish()
    assert not np.any(model.extra.weight.grad.numpy()) and not np.any(model.extra.bias.grad.numpy())
    ref = Branchy()
    nn.MSELoss()(ref(x, use_extra=False), y).backward()
    np.testing.assert_allclose(model.fc.weight.grad.numpy(), ref.fc.weight.grad.numpy(), rtol=1e-6)


def test_no_sync_launches_nothing(policy):
    model = mlp()
    comm = TwinComm()
    dp = DataParallel(model, comm=comm, bucket_mb=0.0001)
    comm.log.clear()
    x, y = batch()
    dp.zero_grad()
    with dp.no_sync():
        nn.MSELoss()(dp(x), y).backward()
        nn.MSELoss()(dp(x), y).backward()
    dp.finish()
    assert comm.log == [] and not any(b.launched for b in dp.buckets)
    ref = mlp()
    nn.MSELoss()(ref(x), y).backward()
    for g, w in zip(grads(model), grads(ref)):
        np.testing.assert_allclose(g, 2 * w, rtol=1e-6)


# -- two ranks under mpiexec ------------------------------------------------------------------


_jobs: dict = {}


def two_rank_job(policy_name):
    """One mpiexec run per policy runs every check (launching costs more than the checks)."""
    if policy_name not in _jobs:
        _jobs[policy_name] = run_job([policy_name], nprocs=2, timeout=30)
    return _jobs[policy_name]


@pytest.mark.mpi
@needs_mpiexec
@pytest.mark.parametrize("policy_name", POLICIES)
@pytest.mark.parametrize("check", ["equivalence", "views", "unused", "no_sync"])
def test_two_ranks(check, policy_name):
    code, out, err, _ = two_rank_job(policy_name)
    for rank in (0, 1):
        assert f"rank {rank}: {check} ok" in out, f"rc={code}\nstdout:\n{out}\nstderr:\n{err}"
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"


@pytest.mark.mpi
@pytest.mark.gpu
@requires_gpu
@needs_mpiexec
@pytest.mark.parametrize("policy_name", POLICIES)
@pytest.mark.parametrize("comm_backend", ["mpi", "nccl"])
def test_two_ranks_on_gpus(comm_backend, policy_name):
    """2 ranks x B on GPUs == 1 process x 2B: NCCL (one GPU per rank) or MPI host staging."""
    gpus = fw.backend.cupy_module().cuda.runtime.getDeviceCount() if CUDA_AVAILABLE else 0
    if comm_backend == "nccl" and gpus < 2:
        pytest.skip("NCCL needs one GPU per rank: 2 ranks need 2 GPUs")
    env = dict(worker_env(), DP_DEVICE="cuda", DP_BACKEND=comm_backend)
    code, out, err, _ = run_script(WORKER, [policy_name, "equivalence"], 2, timeout=180, env=env)
    for rank in (0, 1):
        assert f"rank {rank}: equivalence ok" in out, f"rc={code}\nstdout:\n{out}\nstderr:\n{err}"
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"


@pytest.fixture
def gathers(monkeypatch):
    """What the optimizers' flat buffers gather, by kind ("parameters", "gradients", ...)."""
    from framework.optim import flat  # noqa: PLC0415

    seen = []
    real = flat._gather
    monkeypatch.setattr(flat, "_gather", lambda *a: seen.append(a[4]) or real(*a))
    return seen


def test_an_optimizer_over_flat_buffers_reads_the_bucket_buffer_as_it_is(gathers):
    """Under ``on`` the buckets of a dtype are slices of one array; the optimizer lays its
    flat buffers out in that order and reads the gradients there: no gather, no rebinding,
    and zero_grad(set_to_none=False) is one fill of it. The numbers are those of the
    per-parameter update."""
    PerParameterSGD = per_parameter(fw.optim.SGD)
    runs = {}
    for cls in (fw.optim.SGD, PerParameterSGD):
        del gathers[:]
        with inplace.policy("on"):
            model = mlp()
            dp = DataParallel(model, comm=TwinComm(), bucket_mb=0.0001)
            assert len(dp.buckets) == 4
            whole = memory.root_buffer(dp.buckets[0].buffer)
            assert all(memory.root_buffer(b.buffer) is whole for b in dp.buckets)
            opt = cls(dp.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
            for step in range(3):
                x, y = batch(seed=step)
                opt.zero_grad(set_to_none=False)
                nn.MSELoss()(dp(x), y).backward()
                dp.finish()
                views = [p.grad for p in model.parameters()]
                opt.step()
                assert all(p.grad is v for p, v in zip(model.parameters(), views))  # still the bucket views
            runs[cls] = values(model)
        if cls is fw.optim.SGD:
            assert gathers == ["parameters"]  # the flat parameter buffer, once; never a gradient
            p = next(model.parameters())
            assert memory.root_buffer(p._data).size == whole.size
            opt.zero_grad(set_to_none=False)
            assert not whole.any()
    for a, b in zip(runs[fw.optim.SGD], runs[PerParameterSGD]):
        np.testing.assert_array_equal(a, b)


def test_an_optimizer_that_stepped_before_the_model_was_wrapped_borrows_the_buckets_after(gathers):
    PerParameterAdam = per_parameter(fw.optim.Adam)
    runs = {}
    for cls in (fw.optim.Adam, PerParameterAdam):
        del gathers[:]
        with inplace.policy("on"):
            model = mlp()
            opt = cls(model.parameters(), lr=0.01)
            x, y = batch(seed=0)
            nn.MSELoss()(model(x), y).backward()
            opt.step()  # flat buffers in registration order, gradients adopted
            flat_path = cls is fw.optim.Adam
            assert gathers == (["parameters", "gradients"] if flat_path else [])
            dp = DataParallel(model, comm=TwinComm(), bucket_mb=0.0001)
            whole = memory.root_buffer(dp.buckets[0].buffer)
            for step in range(1, 4):
                del gathers[:]
                opt.zero_grad()
                nn.MSELoss()(dp(batch(seed=step)[0]), y).backward()
                dp.finish()
                opt.step()
                if flat_path:  # the first step after wrapping lays the buffers out again
                    assert gathers == (["parameters", "optimizer_state", "optimizer_state"] if step == 1 else [])
                assert all(np.shares_memory(p.grad._data, whole) for p in model.parameters())
            if flat_path:
                p = next(model.parameters())
                assert memory.root_buffer(opt.state[p]["exp_avg"]._data).size == whole.size
            runs[cls] = values(model)
    for a, b in zip(runs[fw.optim.Adam], runs[PerParameterAdam]):
        np.testing.assert_array_equal(a, b)
