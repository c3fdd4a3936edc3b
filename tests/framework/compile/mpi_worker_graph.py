"""Worker launched by test_cuda.py under ``mpiexec -n 2``: a compiled GPU step whose
update is averaged over the ranks (``allreduce_mean_``), against the same step eager.

Usage: mpi_worker_graph.py BACKEND   # nccl: NcclCommunicator, one GPU per rank;
                                     # mpi: host staging through MPI
Prints ``rank R: ok <replay_mode>`` and exits 0 when the compiled step is bitwise the eager one.
"""

import sys

import numpy as np

import framework as fw
from framework import backend as fw_backend
from framework.compile.collectives import allreduce_mean_
from framework.distributed.comm import NcclCommunicator, get_world


class Params(fw.nn.Module):
    def __init__(self, rank):
        super().__init__()
        self.w = fw.nn.Parameter(fw.from_numpy(np.arange(6, dtype=np.float32) * (rank + 1)))


def make_step(m, comm):
    def step(x):
        with fw.no_grad():
            m.w.mul_(0.5)
            m.w.add_(x)
        allreduce_mean_([m.w], comm)

    return step


def main(backend: str) -> int:
    world = get_world()
    r = world.rank
    dev = fw_backend.Device("cuda", world.local_rank % fw_backend.device_count())
    fw_backend.use_device(dev)
    comm = NcclCommunicator(world.mpi_comm) if backend == "nccl" else world
    rng = np.random.default_rng(10 + r)
    xs = [fw.from_numpy(rng.standard_normal(6).astype(np.float32)).to(dev) for _ in range(20)]
    eager, compiled = Params(r).to(dev), Params(r).to(dev)
    eager_step, f = make_step(eager, comm), fw.compile(make_step(compiled, comm), modules=[compiled])
    for x in xs:
        eager_step(x)
        f(x)
        a, b = eager.w.detach().cpu().numpy(), compiled.w.detach().cpu().numpy()
        assert a.tobytes() == b.tobytes(), (a, b)
    mode = f.report()["replay_mode"]
    if backend == "nccl":
        assert mode == "cuda graph", mode
        assert f._current().executor.cuda_graph.graph.kinds()["nccl"] == 1
    else:
        assert mode.startswith("uncaptured: node 2 allreduce_mean_"), mode
    print(f"rank {r}: ok {mode}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
