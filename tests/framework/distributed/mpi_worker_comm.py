"""Worker launched by test_comm.py under ``mpiexec -n N``; exits 0 when every check passes.

Usage: mpi_worker_comm.py collectives   # checks every collective
       mpi_worker_comm.py crash MESSAGE # rank 1 raises MESSAGE; the others block in a collective
"""

import sys
import threading

import numpy as np

from framework.distributed.comm import Communicator, get_world, install_abort_on_exception


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

    # Errors are raised before any communication, identically on every rank.
    try:
        world.allreduce_(np.zeros((4, 4), np.float32)[:, 0])
    except ValueError as e:
        assert "contiguous" in str(e)
    else:
        raise AssertionError("non-contiguous buffer accepted")
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
    elif mode == "crash":
        crash(world, sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "main")
    else:
        raise SystemExit(f"unknown mode {mode!r}")
