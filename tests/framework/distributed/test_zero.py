"""ZeRO (framework/distributed/zero.py): shard plans, the paper's bytes, one process, and the
multi-rank checks of mpi_worker_zero.py under mpiexec (2 and 4 ranks; GPUs on the gpu leg)."""

from pathlib import Path

import numpy as np
import pytest

import framework as fw
from framework import inplace, nn
from framework.distributed.comm import SingleProcessCommunicator
from framework.distributed.data_parallel import DataParallel
from framework.distributed.zero import ShardPlan, ZeroRedundancyOptimizer, model_state_bytes
from tests.conftest import requires_gpu
from tests.mpi_util import needs_mpiexec, run_script, worker_env

WORKER = Path(__file__).resolve().parent / "mpi_worker_zero.py"


class Sized:
    """What a plan reads of a parameter: its number of elements."""

    def __init__(self, n):
        self.n = n

    def numel(self):
        return self.n


def test_a_plan_cuts_the_flat_order_into_equal_contiguous_parts():
    params = [Sized(5), Sized(3), Sized(6)]  # 14 elements over 4 ranks: parts of 4, 2 of padding
    plans = [ShardPlan(np.float32, params, 4, r) for r in range(4)]
    assert [(p.first, p.lo, p.hi) for p in plans] == [(0, 0, 4), (4, 4, 8), (8, 8, 12), (12, 12, 14)]
    assert all(p.part == 4 and p.padded == 16 and p.numel == 14 for p in plans)
    assert plans[0].offsets == [0, 5, 8]
    # a bucket of elements 3..9: each rank's share, in rank order (a reduce-scatter's counts)
    assert plans[0].counts(3, 9) == [1, 4, 1, 0]
    assert plans[0].counts(0, 16) == [4, 4, 4, 4]
    # rank 1's part [4, 8): the last element of the first parameter and the whole second one
    assert plans[1].pieces(4, 8) == [(params[0], 4, 5, 0), (params[1], 0, 3, 1)]
    tiny = ShardPlan(np.float32, [Sized(2)], 4, 3)  # fewer elements than ranks: rank 3 holds none
    assert (tiny.part, tiny.lo, tiny.hi) == (1, 2, 2)


def test_the_papers_bytes_per_rank():
    # Rajbhandari et al.: fp32 Adam keeps 16 bytes per parameter; stage 1 8 + 8/N, stage 2 4 + 12/N
    psi = 1000
    assert [model_state_bytes(psi, 4, 8, s, 4) / psi for s in (0, 1, 2)] == [16, 10, 7]
    assert [model_state_bytes(psi, 4, 8, s, 2) / psi for s in (0, 1, 2)] == [16, 12, 10]
    assert model_state_bytes(psi, 4, 0, 2, 2) / psi == 6  # plain SGD: gradients sharded, no state
    with pytest.raises(ValueError, match="stage must be 0, 1 or 2"):
        model_state_bytes(psi, 4, 8, 3, 2)


def mlp():
    fw.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize("policy", ["on", "off"])
def test_one_process_steps_the_wrapped_optimizer_as_it_is(policy):
    """As torch's ZeroRedundancyOptimizer on one rank: the optimizer's own step and state."""
    runs = []
    for zero in (False, True):
        with inplace.policy(policy):
            model = mlp()
            dp = DataParallel(model, comm=SingleProcessCommunicator())
            if zero:
                opt = ZeroRedundancyOptimizer(dp.parameters(), fw.optim.Adam, data_parallel=dp, stage=2, lr=0.01)
                assert opt.plans == {} and isinstance(opt.optim, fw.optim.Adam)
            else:
                opt = fw.optim.Adam(dp.parameters(), lr=0.01)
            x = fw.tensor(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4))
            for _ in range(3):
                opt.zero_grad()
                (dp(x) ** 2).sum().backward()
                dp.finish()
                opt.step()
            state = opt.state_dict()
            runs.append(([p.detach().numpy().copy() for p in model.parameters()], state))
    for a, b in zip(runs[0][0], runs[1][0]):
        np.testing.assert_array_equal(a, b)
    assert runs[1][1]["state"][0]["step"] == 3


def test_bad_arguments_say_what_is_wrong():
    model = mlp()
    dp = DataParallel(model, comm=SingleProcessCommunicator())
    with pytest.raises(ValueError, match="stage must be 1"):
        ZeroRedundancyOptimizer(dp.parameters(), fw.optim.SGD, data_parallel=dp, stage=3, lr=0.1)
    with pytest.raises(TypeError, match="Optimizer class"):
        ZeroRedundancyOptimizer(dp.parameters(), fw.optim.SGD(dp.parameters(), lr=0.1), data_parallel=dp)
    with pytest.raises(TypeError, match="must be a DataParallel"):
        ZeroRedundancyOptimizer(model.parameters(), fw.optim.SGD, data_parallel=model, lr=0.1)
    opt = ZeroRedundancyOptimizer(dp.parameters(), fw.optim.SGD, data_parallel=dp, lr=0.1)
    with pytest.raises(RuntimeError, match="for stage 2"):
        opt.clip_grad_norm_(1.0)


def test_one_process_collectives_of_the_shards():
    comm = SingleProcessCommunicator()
    send = np.arange(6, dtype=np.float32)
    recv = np.empty(6, np.float32)
    assert comm.ireduce_scatter(send, recv, [6]).wait() is recv
    np.testing.assert_array_equal(recv, send)
    with pytest.raises(ValueError, match="sum to the 1-D sendbuf's 6 elements"):
        comm.ireduce_scatter(send, recv, [5])
    assert comm.allgather_(send) is send
    out = np.empty(6, np.float32)
    np.testing.assert_array_equal(comm.allgather_copy(send, out), send)
    assert comm.gather_object("x") == ["x"]


_jobs: dict = {}


def zero_job(nprocs, env=None, checks=()):
    key = (nprocs, tuple(sorted((env or {}).items())), checks)
    if key not in _jobs:
        _jobs[key] = run_script(WORKER, list(checks), nprocs, timeout=120, env=dict(worker_env(), **(env or {})))
    return _jobs[key]


def assert_passed(job, nprocs, check):
    code, out, err, _ = job
    for rank in range(nprocs):
        assert f"rank {rank}: {check} ok" in out, f"rc={code}\nstdout:\n{out}\nstderr:\n{err}"
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"


@pytest.mark.mpi
@needs_mpiexec
@pytest.mark.parametrize("check", ["equal", "memory", "state", "accumulate", "clip"])
def test_two_ranks(check):
    """Stages 1 and 2 give stage 0's numbers bit for bit under every policy, hold the paper's
    bytes, save and load their state in the optimizer's format, accumulate and clip."""
    assert_passed(zero_job(2), 2, check)


@pytest.mark.mpi
@needs_mpiexec
@pytest.mark.parametrize("check", ["equal", "memory", "state"])
def test_four_ranks(check):
    """Four ranks (on two cores): stage 2's reduce-scatter sums in another order than the
    allreduce, within the bound; the bytes per rank are the paper's."""
    job = zero_job(4, {"ZERO_POLICIES": "on,off"}, ("equal", "memory", "state"))
    assert_passed(job, 4, check)


@pytest.mark.mpi
@pytest.mark.gpu
@requires_gpu
@needs_mpiexec
@pytest.mark.parametrize("comm_backend", ["nccl", "mpi"])
def test_two_ranks_on_gpus(comm_backend):
    """NCCL's reduceScatter, reduce and allGather (one GPU per rank), or MPI host staging."""
    if comm_backend == "nccl" and fw.backend.device_count() < 2:
        pytest.skip("NCCL needs one GPU per rank: 2 ranks need 2 GPUs")
    env = {"DP_DEVICE": "cuda", "DP_BACKEND": comm_backend, "ZERO_POLICIES": "on,off"}
    job = zero_job(2, env, ("equal", "memory"))
    for check in ("equal", "memory"):
        assert_passed(job, 2, check)
