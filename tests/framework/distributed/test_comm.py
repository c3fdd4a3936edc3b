import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from framework import backend as fw_backend
from framework.distributed.comm import (
    Communicator,
    NcclCommunicator,
    SingleProcessCommunicator,
    for_device,
    get_world,
    install_abort_on_exception,
)
from tests.conftest import CUDA_AVAILABLE, requires_gpu
from tests.mpi_util import HAVE_MPI4PY, needs_mpiexec, run_script, worker_env

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
WORKER = HERE / "mpi_worker_comm.py"


@pytest.fixture
def fresh_world():
    get_world.cache_clear()
    yield
    get_world.cache_clear()


@pytest.fixture
def restore_hooks():
    saved = sys.excepthook, threading.excepthook
    yield
    sys.excepthook, threading.excepthook = saved


def run_job(args, nprocs=None, timeout=20.0):
    return run_script(WORKER, args, nprocs, timeout)


# -- single process, in this process ---------------------------------------------------------


def single_process_worlds():
    worlds = [pytest.param(SingleProcessCommunicator, id="no-mpi")]
    if HAVE_MPI4PY:
        worlds.append(pytest.param(Communicator, id="mpi-singleton"))
    return worlds


@pytest.mark.parametrize("make", single_process_worlds())
def test_single_process_collectives(make):
    w = make()
    assert (w.rank, w.size, w.local_rank, w.local_size, w.is_main) == (0, 1, 0, 1, True)
    assert w.backend == ("mpi" if make is Communicator else "none")
    for dtype in (np.float32, np.float64, np.int64):
        buf = np.arange(6, dtype=dtype).reshape(2, 3)
        for op in ("sum", "max", "min"):
            assert w.allreduce_(buf, op=op) is buf
            np.testing.assert_array_equal(buf, np.arange(6).reshape(2, 3))
    buf = np.ones(4)
    handles = [w.iallreduce_(buf), w.iallreduce_(np.zeros(2, np.float32), op="max")]
    assert handles[0].wait() is buf and handles[0].test()
    np.testing.assert_array_equal(handles[1].wait(), np.zeros(2))
    send, recv = np.arange(3.0), np.zeros(3)
    assert w.allreduce_copy(send, recv) is recv
    np.testing.assert_array_equal(recv, send)
    recv2 = np.zeros(3)
    assert w.iallreduce_copy(send, recv2).wait() is recv2
    np.testing.assert_array_equal(recv2, send)
    b = np.arange(4, dtype=np.int64)
    assert w.broadcast_(b) is b and b.tolist() == [0, 1, 2, 3]
    assert w.allgather_object({"a": 1}) == [{"a": 1}]
    assert w.broadcast_object(("uid", 7)) == ("uid", 7)
    for op in ("sum", "max", "min", "mean"):
        assert w.allreduce_scalar(2.5, op=op) == 2.5
    assert isinstance(w.allreduce_scalar(np.float32(3)), float)
    w.barrier()


@pytest.mark.parametrize("make", single_process_worlds())
def test_argument_errors(make):
    w = make()
    with pytest.raises(ValueError, match="C-contiguous"):
        w.allreduce_(np.zeros((4, 4))[:, 1])
    with pytest.raises(ValueError, match="C-contiguous"):
        w.iallreduce_(np.zeros((4, 4)).T)
    with pytest.raises(ValueError, match="C-contiguous"):
        w.broadcast_(np.zeros(8)[::2])
    with pytest.raises(ValueError, match="C-contiguous"):
        w.allreduce_copy(np.zeros(8)[::2], np.zeros(4))
    with pytest.raises(ValueError, match="unknown reduction op 'prod'"):
        w.allreduce_(np.zeros(3), op="prod")
    with pytest.raises(ValueError, match="unknown reduction op 'mean'"):
        w.allreduce_(np.zeros(3), op="mean")
    with pytest.raises(ValueError, match="unknown reduction op"):
        w.allreduce_scalar(1.0, op="avg")
    with pytest.raises(TypeError, match="must be a NumPy or CuPy array, got list"):
        w.allreduce_([1.0, 2.0])
    with pytest.raises(TypeError, match="dtype float16"):
        w.allreduce_(np.zeros(3, np.float16))
    ro = np.zeros(3)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        w.allreduce_(ro)
    with pytest.raises(ValueError, match="same shape and dtype"):
        w.allreduce_copy(np.zeros(3), np.zeros(4))
    x = np.zeros(6)
    with pytest.raises(ValueError, match="overlap"):
        w.allreduce_copy(x[:4], x[2:])
    with pytest.raises(ValueError, match="root 1 out of range"):
        w.broadcast_(np.zeros(3), root=1)
    with pytest.raises(ValueError, match="root -1 out of range"):
        w.broadcast_object("x", root=-1)


class TwoRankWorld(SingleProcessCommunicator):
    """Claims 2 ranks (no collective is run): what for_device sees under mpiexec -n 2."""

    def __init__(self):
        super().__init__()
        self.size = 2


def test_for_device_on_cpu_is_the_world_itself():
    for world in (SingleProcessCommunicator(), TwoRankWorld()):
        assert for_device(world, "cpu") is world
        assert for_device(world, "cpu", "mpi") is world
    with pytest.raises(ValueError, match="'nccl' needs device 'cuda'"):
        for_device(TwoRankWorld(), "cpu", "nccl")
    with pytest.raises(ValueError, match="unknown distributed backend 'gloo'; use one of: auto, nccl, mpi"):
        for_device(TwoRankWorld(), "cpu", "gloo")


def test_for_device_one_process_or_mpi_backend_needs_no_nccl():
    one, two = SingleProcessCommunicator(), TwoRankWorld()
    assert for_device(one, "cuda") is one and for_device(one, "cuda:1", "nccl") is one
    assert for_device(two, "cuda", "mpi") is two  # GPU buffers are staged through the host


def test_for_device_without_gpu_says_what_to_do(without_cupy):
    with pytest.raises(RuntimeError, match=r"NCCL backend needs CuPy and a CUDA device.*distributed.backend 'mpi'"):
        for_device(TwoRankWorld(), "cuda", "nccl")
    with pytest.warns(RuntimeWarning, match="falling back to MPI with host staging"):
        world = TwoRankWorld()
        assert for_device(world, "cuda", "auto") is world


@pytest.mark.gpu
@pytest.mark.parametrize("version,wheel", [(12080, "nvidia-nccl-cu12"), (13000, "nvidia-nccl-cu13")])
def test_without_nccl_the_hint_names_the_wheel_of_the_cuda_version_in_use(monkeypatch, cupy, version, wheel):
    from framework import backend
    from framework.distributed.nccl import import_nccl

    monkeypatch.setattr(backend, "nccl_module", lambda: None)
    monkeypatch.setattr(cupy.cuda.runtime, "runtimeGetVersion", lambda: version)
    major = version // 1000
    with pytest.raises(
        RuntimeError,
        match=rf"CuPy \(CUDA {major}\) cannot load.*pip install {wheel} or pip install -e '.\[gpu-cuda{major}\]'",
    ):
        import_nccl()


def test_gpu_buffers_are_refused_where_they_cannot_go():
    with pytest.raises(TypeError, match="must be a NumPy or CuPy array, got memoryview"):
        SingleProcessCommunicator().allreduce_(memoryview(b"abcd"))


def test_get_world_is_cached(fresh_world):
    w = get_world()
    assert get_world() is w
    assert w.size == 1 and w.is_main
    expected = Communicator if HAVE_MPI4PY else SingleProcessCommunicator
    assert type(w) is expected
    assert repr(w).startswith(expected.__name__)


def test_get_world_without_mpi4py(fresh_world, monkeypatch):
    # A None entry in sys.modules makes `from mpi4py import MPI` raise ImportError.
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)
    w = get_world()
    assert type(w) is SingleProcessCommunicator
    assert w.backend == "none" and w.size == 1
    assert get_world() is w
    buf = np.ones(3, np.float32)
    assert w.allreduce_(buf) is buf


def test_import_does_not_load_mpi4py():
    code = "import sys, framework.distributed.comm; print('mpi4py.MPI' in sys.modules)"
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=30
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_abort_hook_single_process_keeps_default(restore_hooks):
    before = sys.excepthook, threading.excepthook
    install_abort_on_exception(SingleProcessCommunicator())
    assert (sys.excepthook, threading.excepthook) == before


def test_abort_hook_is_idempotent(restore_hooks, monkeypatch):
    class FakeWorld(SingleProcessCommunicator):
        aborted = []

        def abort(self, code=1):
            self.aborted.append(code)

    world = FakeWorld()
    world.rank, world.size = 1, 2
    install_abort_on_exception(world)
    hooks = sys.excepthook, threading.excepthook
    install_abort_on_exception(world)
    assert (sys.excepthook, threading.excepthook) == hooks
    assert hooks[0] is not sys.__excepthook__

    # Drive the hook directly (with a fake abort) and check the report format.
    import io

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    try:
        raise KeyError("marker-42")
    except KeyError:
        sys.excepthook(*sys.exc_info())
    assert FakeWorld.aborted == [1]
    lines = err.getvalue().splitlines()
    assert lines and all(line.startswith("[rank 1] ") for line in lines)
    assert "[rank 1] KeyError: 'marker-42'" in lines


def test_uncaught_exception_single_process_exits_nonzero():
    """No mpiexec: size 1, so the hook is not installed and Python's default applies."""
    code = (
        "from framework.distributed.comm import get_world, install_abort_on_exception\n"
        "install_abort_on_exception(get_world())\n"
        "raise RuntimeError('single-process-boom')\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=30
    )
    assert res.returncode == 1
    assert "Traceback" in res.stderr and "RuntimeError: single-process-boom" in res.stderr
    assert "[rank" not in res.stderr


# -- several ranks under mpiexec --------------------------------------------------------------


@pytest.mark.mpi
@needs_mpiexec
def test_collectives_two_ranks():
    code, out, err, _ = run_job(["collectives"], nprocs=2, timeout=30)
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "rank 0: ok" in out and "rank 1: ok" in out


def _gpu_count() -> int:
    return fw_backend.cupy_module().cuda.runtime.getDeviceCount() if CUDA_AVAILABLE else 0


@pytest.mark.gpu
@requires_gpu
@pytest.mark.skipif(not HAVE_MPI4PY, reason="NcclCommunicator bootstraps over MPI: needs mpi4py")
def test_nccl_and_staging_in_one_process(cupy):
    """Every collective of CuPy arrays, one rank: NCCL and the MPI host-staging path."""
    cp = cupy
    for comm in (Communicator(), NcclCommunicator(device=0)):
        buf = cp.arange(5, dtype=cp.float32)
        assert comm.allreduce_(buf) is buf
        h = comm.iallreduce_(buf, op="max")
        assert h.wait() is buf and h.test()
        recv = cp.zeros(5, cp.float32)
        assert comm.iallreduce_copy(buf, recv).wait() is recv
        assert comm.broadcast_(buf) is buf
        np.testing.assert_array_equal(recv.get(), np.arange(5))
        with pytest.raises(ValueError, match="C-contiguous"):
            comm.allreduce_(cp.zeros((4, 4), cp.float32)[:, 0])
    assert "device=cuda:0" in repr(NcclCommunicator(device=0))


@pytest.mark.mpi
@pytest.mark.gpu
@requires_gpu
@needs_mpiexec
@pytest.mark.parametrize("backend", ["mpi", "nccl"])
def test_gpu_collectives_two_ranks(backend):
    if backend == "nccl" and _gpu_count() < 2:
        pytest.skip("NCCL needs one GPU per rank: 2 ranks need 2 GPUs")
    code, out, err, _ = run_job(["gpu", backend], nprocs=2, timeout=120)
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "rank 0: ok" in out and "rank 1: ok" in out


@pytest.mark.mpi
@pytest.mark.gpu
@requires_gpu
@needs_mpiexec
def test_nccl_refuses_two_ranks_on_one_gpu():
    code, out, err, _ = run_job(["nccl_one_gpu"], nprocs=2, timeout=60)
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "rank 0: ok" in out and "rank 1: ok" in out


@pytest.mark.mpi
@needs_mpiexec
@pytest.mark.parametrize("where", ["main", "thread"])
def test_exception_on_one_rank_aborts_job(where):
    message = f"deliberate failure on rank one ({where})"
    code, out, err, elapsed = run_job(["crash", message, where], nprocs=2, timeout=20)
    assert code != 0, f"job exited 0\nstdout:\n{out}\nstderr:\n{err}"
    assert "[rank 1]" in err, err
    assert f"RuntimeError: {message}" in err, err
    assert elapsed < 20
