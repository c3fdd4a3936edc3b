"""Worker launched by test_comm.py under ``mpiexec -n N``; exits 0 when every check passes.

Usage: mpi_worker_comm.py collectives   # checks every collective on host arrays
       mpi_worker_comm.py gpu BACKEND   # the same collectives on CuPy arrays (mpi: host
                                        # staging; nccl: NcclCommunicator, one GPU per rank)
       mpi_worker_comm.py nccl_one_gpu  # NCCL on one GPU for every rank: refused everywhere
       mpi_worker_comm.py crash MESSAGE # rank 1 raises MESSAGE; the others block in a collective
"""

import sys
import threading

import numpy as np

from framework import backend as fw_backend
from framework.distributed.comm import (
    Communicator,
    NcclCommunicator,
    get_world,
    install_abort_on_exception,
    nccl_bootstrap,
)


class RecordingNccl:
    """Stands in for ``cupy.cuda.nccl`` in the bootstrap: each rank makes a different id,
    and the communicator records what it was built with."""

    def __init__(self, rank):
        self.rank = rank

    def get_unique_id(self):
        return tuple(range(self.rank, self.rank + 128))  # differs per rank: rank 0's must win

    def NcclCommunicator(self, ndev, uid, rank):  # noqa: N802 - CuPy's name
        return {"ndev": ndev, "uid": uid, "rank": rank}


def check_collectives(world: Communicator) -> None:
    r, n = world.rank, world.size
    assert n >= 2, n
    assert world.backend == "mpi"
    assert world.is_main == (r == 0)
    assert 0 <= world.local_rank < world.local_size <= n
    assert get_world() is world

    # allreduce_ in place: sum/max/min in float32, float64, int64; same object returned.
    for dtype in (np.float32, np.float64, np.int64):
        buf = (np.arange(6, dtype=dtype) + r).reshape(2, 3)
        ptr = buf.ctypes.data
        out = world.allreduce_(buf)
        assert out is buf and buf.ctypes.data == ptr
        expected = (np.arange(6) * n + n * (n - 1) // 2).reshape(2, 3)
        np.testing.assert_array_equal(buf, expected.astype(dtype))
        assert buf.dtype == dtype

        buf = np.array([r, -r, 10 * r], dtype=dtype)
        world.allreduce_(buf, op="max")
        np.testing.assert_array_equal(buf, np.array([n - 1, 0, 10 * (n - 1)], dtype=dtype))
        buf = np.array([r, -r], dtype=dtype)
        world.allreduce_(buf, op="min")
        np.testing.assert_array_equal(buf, np.array([0, -(n - 1)], dtype=dtype))

    # A view of a flat buffer (the gradient-bucket case) is reduced in place too.
    flat = np.full(10, float(r + 1), dtype=np.float32)
    world.allreduce_(flat[2:7])
    total = n * (n + 1) / 2
    np.testing.assert_array_equal(flat, [r + 1] * 2 + [total] * 5 + [r + 1] * 3)

    # Several outstanding non-blocking reductions, waited in reverse order.
    bufs = [np.full(1000 * (i + 1), float(r + i), dtype=np.float64) for i in range(5)]
    handles = [world.iallreduce_(b) for b in bufs]
    handles.append(world.iallreduce_(np.array([r], dtype=np.int64), op="max"))
    assert handles[-1].wait()[0] == n - 1
    for i in reversed(range(5)):
        out = handles[i].wait()
        assert out is bufs[i]
        np.testing.assert_array_equal(out, np.full(1000 * (i + 1), total - n + n * i))
        assert handles[i].test() and handles[i].wait() is bufs[i]  # idempotent
    h = world.iallreduce_(np.ones(3, np.float32))
    while not h.test():
        pass
    np.testing.assert_array_equal(h.wait(), np.full(3, n, np.float32))

    # Out of place: the send buffer is untouched.
    send = np.full(4, float(r), dtype=np.float32)
    recv = np.zeros(4, dtype=np.float32)
    assert world.allreduce_copy(send, recv) is recv
    np.testing.assert_array_equal(recv, np.full(4, n * (n - 1) / 2))
    np.testing.assert_array_equal(send, np.full(4, float(r)))
    recv2 = np.zeros(4, dtype=np.float32)
    assert world.iallreduce_copy(send, recv2, op="max").wait() is recv2
    np.testing.assert_array_equal(recv2, np.full(4, n - 1))

    # Broadcast from rank 0 and from the last rank.
    for root in (0, n - 1):
        buf = np.full((3, 2), float(r), dtype=np.float64)
        assert world.broadcast_(buf, root=root) is buf
        np.testing.assert_array_equal(buf, np.full((3, 2), float(root)))
    state = np.arange(5, dtype=np.int64) * (r + 1)
    world.broadcast_(state)
    np.testing.assert_array_equal(state, np.arange(5))

    # Python objects and metrics.
    assert world.allgather_object({"rank": r}) == [{"rank": i} for i in range(n)]
    assert world.allreduce_scalar(r + 1) == total
    assert world.allreduce_scalar(r + 1, op="mean") == total / n
    assert world.allreduce_scalar(float(r), op="max") == n - 1
    assert world.allreduce_scalar(np.float32(r), op="min") == 0.0
    assert isinstance(world.allreduce_scalar(1), float)
    for root in (0, n - 1):
        assert world.broadcast_object({"from": r, "data": [r] * 3}, root=root) == {"from": root, "data": [root] * 3}

    # The NCCL bootstrap: every rank builds its communicator with rank 0's unique id.
    made = nccl_bootstrap(world, RecordingNccl(r))
    assert made == {"ndev": n, "uid": tuple(range(128)), "rank": r}, made

    # Errors are raised before any communication, identically on every rank.
    try:
        world.allreduce_(np.zeros((4, 4), np.float32)[:, 0])
    except ValueError as e:
        assert "contiguous" in str(e)
    else:
        raise AssertionError("non-contiguous buffer accepted")
    world.barrier()


def check_gpu_collectives(world: Communicator, backend: str) -> None:
    """Collectives of CuPy arrays: staged through host memory (mpi) or over NCCL."""
    cp = fw_backend.cupy_module()  # CuPy, or its stand-in (INPLACE_LAB_CUPY)
    r, n = world.rank, world.size
    fw_backend.use_device(fw_backend.Device("cuda", world.local_rank % fw_backend.device_count()))
    comm = NcclCommunicator(world.mpi_comm) if backend == "nccl" else world
    assert comm.backend == backend
    total = n * (n + 1) / 2
    for dtype in (cp.float32, cp.float64, cp.int64):
        buf = cp.arange(6, dtype=dtype).reshape(2, 3) + r
        ptr = buf.data.ptr
        assert comm.allreduce_(buf) is buf and buf.data.ptr == ptr
        np.testing.assert_array_equal(buf.get(), (np.arange(6) * n + n * (n - 1) // 2).reshape(2, 3))
        buf = cp.array([r, -r], dtype=dtype)
        comm.allreduce_(buf, op="max")
        np.testing.assert_array_equal(buf.get(), [n - 1, 0])
    flat = cp.full(10, float(r + 1), dtype=cp.float32)
    comm.allreduce_(flat[2:7])
    np.testing.assert_array_equal(flat.get(), [r + 1] * 2 + [total] * 5 + [r + 1] * 3)
    bufs = [cp.full(1000 * (i + 1), float(r + i), dtype=cp.float32) for i in range(4)]
    handles = [comm.iallreduce_(b) for b in bufs]
    for i in reversed(range(4)):
        assert handles[i].wait() is bufs[i]
        np.testing.assert_array_equal(bufs[i].get(), np.full(1000 * (i + 1), total - n + n * i))
    send, recv = cp.full(4, float(r), cp.float32), cp.zeros(4, cp.float32)
    assert comm.allreduce_copy(send, recv) is recv
    np.testing.assert_array_equal(recv.get(), np.full(4, n * (n - 1) / 2))
    recv2 = cp.zeros(4, cp.float32)
    assert comm.iallreduce_copy(send, recv2, op="max").wait() is recv2
    np.testing.assert_array_equal(recv2.get(), np.full(4, n - 1))
    np.testing.assert_array_equal(send.get(), np.full(4, float(r)))
    for root in (0, n - 1):
        buf = cp.full((3, 2), float(r), dtype=cp.float64)
        assert comm.broadcast_(buf, root=root) is buf
        np.testing.assert_array_equal(buf.get(), np.full((3, 2), float(root)))
    host = np.full(3, float(r))  # host arrays still go over MPI
    comm.allreduce_(host)
    np.testing.assert_array_equal(host, np.full(3, n * (n - 1) / 2))
    fw_backend.synchronize(fw_backend.current_device())
    world.barrier()


NCCL_INVALID_USAGE = 5  # ncclInvalidUsage in nccl.h; cupy.cuda.nccl.NcclError.status holds it


def nccl_on_one_gpu(world: Communicator) -> None:
    """Every rank on GPU 0: NCCL refuses two ranks on one GPU, on every rank alike."""
    fw_backend.use_device(fw_backend.Device("cuda", 0))
    try:
        NcclCommunicator(world.mpi_comm, device=0)
    except RuntimeError as e:  # cupy.cuda.nccl.NcclError is a RuntimeError
        # NCCL's result code, not its wording: ncclInvalidUsage (5), as NCCL 2.28 answers.
        assert getattr(e, "status", None) == NCCL_INVALID_USAGE, f"{type(e).__name__}: {e}"
    else:
        raise AssertionError("two ranks made an NCCL communicator on one GPU")
    world.barrier()


def crash(world: Communicator, message: str, where: str) -> None:
    install_abort_on_exception(world)
    install_abort_on_exception(world)  # idempotent
    if world.rank == 1:
        if where == "thread":

            def fail():
                raise RuntimeError(message)

            t = threading.Thread(target=fail)
            t.start()
            t.join()
            world.barrier()  # not reached: the thread's exception aborts the job
        raise RuntimeError(message)
    # Other ranks wait in a collective that rank 1 never joins.
    world.allreduce_(np.ones(8, np.float32))
    world.barrier()


if __name__ == "__main__":
    world = get_world()
    mode = sys.argv[1]
    if mode == "collectives":
        check_collectives(world)
        print(f"rank {world.rank}: ok", flush=True)
    elif mode == "gpu":
        check_gpu_collectives(world, sys.argv[2])
        print(f"rank {world.rank}: ok", flush=True)
    elif mode == "nccl_one_gpu":
        nccl_on_one_gpu(world)
        print(f"rank {world.rank}: ok", flush=True)
    elif mode == "crash":
        crash(world, sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "main")
    else:
        raise SystemExit(f"unknown mode {mode!r}")
