"""Compiled steps on a GPU: bitwise equal to eager ``off``, and replayed as one CUDA graph
where the capture is legal.

On the CuPy stand-in (CI's GPU) stream capture refuses what CUDA and CuPy refuse
(allocations, host synchronizations, host transfers, cuBLAS), so a graph that captures
here allocates nothing from the pool and calls no cuBLAS inside the capture. The models'
training steps capture (their products through the cuDNN frontend, their allocations
served from the plan's one arena) and replay as copy-in plus one graph launch,
bitwise equal to eager; without the frontend the first Linear calls cuBLAS, and the test
checks the one-line reason and that the step keeps running uncaptured.
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest

import framework as fw
from framework import backend
from framework.compile.capture import CaptureError
from tests.conftest import CUPY_CHOICE, requires_gpu
from tests.mpi_util import needs_mpiexec, run_script

from .helpers import bitwise_equal, run

pytestmark = [pytest.mark.gpu, requires_gpu]

standin_only = pytest.mark.skipif(CUPY_CHOICE != "standin", reason="counts launches with the CuPy stand-in")


def _no_capture_left() -> bool:
    cp = backend.cupy_module()
    return not cp.cuda.get_current_stream().is_capturing() and not cp.cuda.Stream.null.is_capturing()


# --- bitwise equal to eager `off` on the same device -------------------------------------------

# 100 steps each; ResNet-20 at width 4 on 8x8 images (a few seconds on the stand-in once
# the step replays as a graph)
MODELS = [("mlp", None, 100), ("convnet", "bn", 100), ("resnet", "bn", 100), ("resnet", "inplace_abn", 100)]


@pytest.mark.parametrize("kind,norm,steps", MODELS, ids=[f"{k}-{n}" for k, n, _ in MODELS])
def test_compiled_on_the_gpu_matches_eager_off_bitwise(kind, norm, steps):
    eager_losses, eager_states, _ = run(kind, "off", False, steps, norm, device="cuda")
    losses, states, compiled = run(kind, "off", True, steps, norm, device="cuda")
    for k in range(steps):
        assert losses[k].tobytes() == eager_losses[k].tobytes(), f"loss differs at step {k}"
        assert bitwise_equal(states[k], eager_states[k]), f"state differs at step {k}"
    report = compiled.report()
    assert report["replays"] == steps - 2  # captured twice (the first step makes the momentum buffers)
    # the first replay runs uncaptured and records its allocations; the next captures the
    # graph, and every later step launches it
    assert report["replay_mode"] == "cuda graph"
    graph = compiled._current().executor.cuda_graph
    assert graph.captures == 1 and graph.launches == steps - 3 and graph.uncaptured == 0
    assert _no_capture_left()


@standin_only
@pytest.mark.parametrize("kind,norm", [("mlp", None), ("convnet", "bn")])
def test_a_replayed_training_step_is_the_input_copies_and_one_graph_launch(kind, norm, tmp_path):
    from framework.testing.cupy_standin import counting

    from .helpers import batches, make_model, train_step

    fw.inplace.set_policy("off")
    model = make_model(kind, norm).to("cuda")
    opt = fw.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    f = fw.compile(train_step(model, opt))
    kinds = []
    for x, y in batches(kind, 6):
        x, y = x.to("cuda"), y.to("cuda")
        with counting.count() as c:
            f(x, y)
        kinds.append((c.by_kind(), c.host_syncs))
    # two arguments copied in, the traced scalars (lr, momentum, ...) in ONE copy, one
    # launch, the returned loss copied out
    assert kinds[3:] == [({"copy": 3, "h2d": 1, "graph": 1}, 0)] * 3
    assert f.report()["replay_launches"] == 5
    graph = f._current().executor.cuda_graph
    assert len(graph.graph) > 50  # the whole step, in one graph
    # ONE arena holds the planned buffers and every allocation of the kernels (outputs,
    # temporaries, cuDNN workspaces): the graph's kernels touch it, the step's own inputs,
    # the graph's slots and the target check's flag, nothing else
    ex, plan = f._current().executor, f.plan
    assert f.report()["arena_kernel_allocations"] == len(plan.kernel_allocations) == len(graph.recorded.sizes) > 0
    assert ex.arena.nbytes == plan.arena_bytes
    used = {ref() for _, _, blocks in graph.graph._nodes for ref in blocks}
    own = {ex.arena.data.mem, graph.dscal.data.mem}
    own |= {a.data.mem for a in graph.slots.values()} | {a.data.mem for a in graph.bound.values() if a is not None}
    own |= {flag.data.mem for _, flag, _ in ex.flags.values()}
    assert len(ex.flags) == 1  # cross_entropy's target check
    assert ex.arena.data.mem in used and used <= own
    # the step sets the gradients to None first and updates its state in place: nothing it
    # leaves behind is read by the next step, so no allocation keeps its place for the
    # whole step (the gradients and the loss take theirs from when they are made)
    assert all(start > 0 for start, _ in graph.recorded.spans)
    # the plan's peak is that arena and what the step holds: nothing is allocated at replay
    values = f.program.values
    extra = (
        sum(values[v].nbytes for v in graph.slots)
        + 12 * len(ex.scal)
        + sum(values[v].nbytes for v in f.program.output_refs())
        + 8 * len(ex.flags)
    )
    assert plan.planned_peak_bytes == plan.persistent_bytes + plan.arena_bytes + extra
    text = f.explain(draw=str(tmp_path / "plan.png"), file=io.StringIO())
    assert "replays as: cuda graph, 5 launches a replay" in text
    assert f"the kernels' own allocations ({len(plan.kernel_allocations)}, " in text
    assert "allocated by their kernels (not in the arena)" not in text
    assert (tmp_path / "plan.png").stat().st_size > 0


def test_each_replay_of_the_graph_draws_a_new_dropout_mask():
    # The mask comes from the device generator inside the graph: each launch must draw the
    # next one, as each eager call does, never the one drawn at capture again
    import framework.nn.functional as F

    def step(x):
        return F.dropout(x, p=0.5, training=True)

    x = fw.ones(4096).to("cuda")
    runs = []
    for compiled in (False, True):
        fw.manual_seed(0)
        f = fw.compile(step, modules=[], optimizers=[]) if compiled else step
        runs.append([f(x).cpu().numpy() != 0 for _ in range(8)])
    assert f.report()["replay_mode"] == "cuda graph" and f._current().executor.cuda_graph.launches == 6
    masks = runs[1]
    assert all((masks[i] != masks[j]).any() for i in range(len(masks)) for j in range(i))
    assert [m.tobytes() for m in masks] == [m.tobytes() for m in runs[0]]  # eager's masks, in order


@pytest.fixture
def no_cudnn(monkeypatch):
    """Without the cuDNN frontend: matrix products through CuPy's cuBLAS."""
    monkeypatch.setenv(backend.CUDNN_ENV, "none")
    backend.forget_cudnn()
    yield
    backend.forget_cudnn()


def test_a_failed_capture_names_the_node_and_why_and_the_step_runs_uncaptured(no_cudnn):
    eager_losses, eager_states, _ = run("mlp", "off", False, 4, device="cuda")
    losses, states, compiled = run("mlp", "off", True, 4, device="cuda")
    assert [x.tobytes() for x in losses] == [x.tobytes() for x in eager_losses]
    assert all(bitwise_equal(a, b) for a, b in zip(states, eager_states))
    mode = compiled.report()["replay_mode"]
    assert "\n" not in mode
    # without the cuDNN frontend the products are cuBLAS's, which CuPy refuses in a capture
    assert mode == (
        "uncaptured: node 0 Linear at models/mlp.py:75 could not be captured: NotImplementedError: "
        "calling cuBLAS API during stream capture is currently unsupported"
    )
    assert compiled.report()["replay_launches"] is None
    graph = compiled._current().executor.cuda_graph
    assert graph.captures == 1 and graph.graph is None  # tried once, never again
    # no graph, so no arena for the kernels' allocations: the plan is the uncaptured one again
    plan = compiled.plan
    assert plan.kernel_allocations == [] and compiled.report()["arena_kernel_allocations"] == 0
    assert compiled._current().executor.arena.nbytes == plan.arena_bytes
    assert _no_capture_left()
    assert "replays as: uncaptured: node 0 Linear" in compiled.explain(file=io.StringIO())


def test_compiling_leaves_the_pool_hook_as_it_found_it():
    from framework import memory

    assert not memory.gpu_hook_enabled()
    run("mlp", "off", True, 3, device="cuda")
    assert not memory.gpu_hook_enabled() and memory.gpu_counter() is None


def test_cuda_graphs_can_be_turned_off():
    _, _, compiled = run("mlp", "off", True, 3, device="cuda", cuda_graph=False)
    assert compiled.report()["replay_mode"] == "uncaptured: CUDA graphs off (fw.compile(cuda_graph=False))"


# --- a step that captures: copy-in and one graph launch ------------------------------------------


class _Params(fw.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = fw.nn.Parameter(fw.ones(6))
        self.v = fw.nn.Parameter(fw.zeros(6))


def _legal_step(m):
    def step(x, a):
        with fw.no_grad():  # ops that write into their planned buffers: nothing allocates
            m.w.mul_(a)
            m.w.add_(x)
            m.v.add_(m.w)
            m.v.relu_()

    return step


def _xs(n, device):
    rng = np.random.default_rng(3)
    return [fw.from_numpy(rng.standard_normal(6).astype(np.float32)).to(device) for _ in range(n)]


def _train_legal(device, compiled, a_values, **kw):
    m = _Params().to(device)
    step = _legal_step(m)
    f = fw.compile(step, modules=[m], **kw) if compiled else step
    out = []
    for x, a in zip(_xs(len(a_values), device), a_values):
        f(x, a)
        out.append((m.w.detach().cpu().numpy().copy(), m.v.detach().cpu().numpy().copy()))
    return out, f


def _same(a, b) -> bool:
    return all(x.tobytes() == y.tobytes() and u.tobytes() == v.tobytes() for (x, u), (y, v) in zip(a, b))


@standin_only
def test_a_legal_step_replays_as_one_graph_launch_plus_the_input_copy():
    from framework.testing.cupy_standin import counting

    a_values = [0.5] * 8
    eager, _ = _train_legal("cuda", False, a_values)
    m = _Params().to("cuda")
    f = fw.compile(_legal_step(m), modules=[m])
    kinds = []
    for x, a in zip(_xs(8, "cuda"), a_values):
        with counting.count() as c:
            f(x, a)
        kinds.append(c.by_kind())
    assert m.w.detach().cpu().numpy().tobytes() == eager[-1][0].tobytes()
    assert m.v.detach().cpu().numpy().tobytes() == eager[-1][1].tobytes()
    # the argument's copy-in, the traced scalar ``a`` (read by mul_ from the device) in one
    # host-to-device copy, and ONE launch
    assert kinds[2:] == [{"copy": 1, "h2d": 1, "graph": 1}] * 6
    report = f.report()
    assert report["replay_mode"] == "cuda graph" and report["replay_launches"] == 3
    graph = f._current().executor.cuda_graph
    assert graph.captures == 1 and len(graph.graph) == 4  # the four ops, one kernel each
    assert _no_capture_left()


def test_a_legal_step_is_bitwise_equal_to_eager_over_100_steps():
    a_values = [0.5] * 100
    eager, _ = _train_legal("cuda", False, a_values)
    compiled, f = _train_legal("cuda", True, a_values)
    assert _same(eager, compiled)
    assert f.report()["replay_mode"] == "cuda graph"


@pytest.mark.parametrize("number", [float, np.float32, np.float64], ids=["float", "np.float32", "np.float64"])
def test_a_changed_traced_scalar_is_read_from_the_device(number):
    # 1/3 rounds differently in float32 and float64: w.mul_(a) multiplies in float32 for a
    # Python float, in float64 for a np.float64 (strongly typed), as eager does
    a_values = [number(v) for v in (0.5, 0.5, 0.5, 1 / 3, 0.5, 0.75)]
    eager, _ = _train_legal("cuda", False, a_values)
    compiled, f = _train_legal("cuda", True, a_values)
    assert _same(eager, compiled)
    graph = f._current().executor.cuda_graph
    assert graph.uncaptured == 0 and graph.captures == 1 and not graph.baked
    assert f.report()["replay_mode"] == "cuda graph"


def _pow_step(m):
    def step(x, a):
        with fw.no_grad():
            m.w.mul_(0.5)
            m.w.add_(x)
            m.v.add_(m.w.abs().pow(a))  # pow takes the exponent as a number: baked into the graph

    return step


def test_a_changed_baked_scalar_runs_that_call_uncaptured():
    # the scalar is baked into the graph: a call with another value must not launch it
    a_values = [0.5, 0.5, 0.5, 0.25, 0.5, 0.75]
    results = []
    for compiled in (False, True):
        m = _Params().to("cuda")
        f = fw.compile(_pow_step(m), modules=[m]) if compiled else _pow_step(m)
        for x, a in zip(_xs(len(a_values), "cuda"), a_values):
            f(x, a)
        results.append(m.v.detach().cpu().numpy().tobytes())
    assert results[0] == results[1]
    graph = f._current().executor.cuda_graph
    assert graph.uncaptured == 2 and graph.captures == 1 and graph.baked == {0}
    assert f.report()["replay_mode"] == (
        "uncaptured: traced scalars changed since the capture (their values are baked into the graph)"
    )


def test_a_rebound_parameter_captures_the_graph_again():
    m = _Params().to("cuda")
    f = fw.compile(_legal_step(m), modules=[m])
    xs = _xs(6, "cuda")
    for x in xs[:3]:
        f(x, 0.5)
    graph = f._current().executor.cuda_graph
    assert graph.captures == 1
    m.w._data = m.w._data.copy()  # its old address is baked into the graph
    for x in xs[3:]:
        f(x, 0.5)
    assert graph.captures == 2 and f.report()["replay_mode"] == "cuda graph"
    eager_m = _Params().to("cuda")
    step = _legal_step(eager_m)
    for x in xs:
        step(x, 0.5)
    assert m.w.detach().cpu().numpy().tobytes() == eager_m.w.detach().cpu().numpy().tobytes()


# --- guards: device index and strides --------------------------------------------------------------


def test_guards_include_the_device_index_and_the_strides():
    m = _Params().to("cuda")
    f = fw.compile(_legal_step(m), modules=[m])
    x = _xs(1, "cuda")[0]
    f(x, 0.5)
    f(x, 0.5)
    assert f.captures == 1
    strided = fw.from_numpy(np.arange(12, dtype=np.float32)).to("cuda")[::2]
    with pytest.warns(RuntimeWarning, match="strides"):
        f(strided, 0.5)
    assert f.captures == 2
    if backend.device_count() > 1:
        # the argument's device is guarded: cuda:1 does not replay the cuda:0 program, and
        # a step whose tensors live on two devices is refused (a program runs on one)
        with pytest.raises(CaptureError, match="several devices"):
            f(x.to("cuda:1"), 0.5)


def test_the_arena_is_one_allocation_on_the_device():
    # A step whose planned buffers are all live at its peak, so that the arena plan has the
    # lowest peak (the models' tiny steps here have theirs with no arena at all: every
    # buffer allocated when made, the lower bound, wins where the arena plan only ties it)
    fw.inplace.set_policy("off")
    w = fw.nn.Parameter(fw.ones(64, device="cuda"))
    opt = fw.optim.SGD([w], lr=0.1)

    def step(x):
        opt.zero_grad()
        loss = (x * w).tanh().sum()
        loss.backward()
        opt.step()
        return loss

    compiled = fw.compile(step)
    x = fw.from_numpy(np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)).to("cuda")
    for _ in range(4):  # the fourth call is the first replayed as a CUDA graph (and makes the arena)
        compiled(x)
    ex = compiled._current().executor
    assert compiled.report()["arena_bytes"] == ex.arena.nbytes > 0
    assert backend.device_of(ex.arena).type == "cuda"
    lo = ex.arena.data.ptr
    for arr in ex.static.values():
        assert lo <= arr.data.ptr < lo + ex.arena.nbytes  # every planned buffer is a view of it


# --- data parallel: the gradient average inside the graph ------------------------------------------


@pytest.mark.mpi
@needs_mpiexec
@pytest.mark.parametrize("comm_backend", ["nccl", "mpi"])
def test_two_ranks_average_inside_the_graph_with_nccl_and_outside_with_host_staging(comm_backend):
    # NCCL supports capture: its allreduce is a node of each rank's graph, replayed every step.
    # Host staging copies to the host and waits, which a capture refuses: that step runs
    # uncaptured, and says which node stopped it.
    if backend.device_count() < 2:
        pytest.skip("one GPU per rank: 2 ranks need 2 GPUs")
    worker = os.path.join(os.path.dirname(__file__), "mpi_worker_graph.py")
    code, out, err, _ = run_script(worker, [comm_backend], nprocs=2, timeout=180)
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "rank 0: ok" in out and "rank 1: ok" in out  # (the ranks' lines may interleave)
    if comm_backend == "nccl":
        assert out.count("ok cuda graph") == 2
    else:
        assert out.count("ok uncaptured: node 2 allreduce_mean_") == 2 and "is capturing" in out


# --- traced scalars on the device: a learning rate that changes every step ----------------------


def _scheduled(kind, norm, compiled, steps, optimizer):
    from .helpers import batches, make_model, snapshot, train_step

    fw.manual_seed(0)
    fw.inplace.set_policy("off")
    model = make_model(kind, norm).to("cuda")
    if optimizer == "sgd":
        opt = fw.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    else:
        opt = fw.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-4)
    step = train_step(model, opt)
    f = fw.compile(step) if compiled else step
    losses, states = [], []
    for k, (x, y) in enumerate(batches(kind, steps)):
        opt.param_groups[0]["lr"] = opt.defaults["lr"] * (0.97**k)  # a schedule: every step differs
        losses.append(f(x.to("cuda"), y.to("cuda")).detach().cpu().numpy().copy())
        states.append(snapshot(model, opt))
    return losses, states, f


@pytest.mark.parametrize(
    "kind,norm,optimizer,steps",
    [
        ("mlp", None, "sgd", 100),
        ("mlp", None, "adam", 100),
        ("convnet", "bn", "sgd", 100),
        ("resnet", "bn", "adam", 100),
        ("resnet", "inplace_abn", "sgd", 100),
    ],
    ids=["mlp-sgd", "mlp-adam", "convnet-sgd", "resnet-adam", "resnet-inplace_abn-sgd"],
)
def test_a_learning_rate_schedule_replays_the_graph_with_device_scalars(kind, norm, optimizer, steps):
    eager_losses, eager_states, _ = _scheduled(kind, norm, False, steps, optimizer)
    losses, states, f = _scheduled(kind, norm, True, steps, optimizer)
    for k in range(steps):
        assert losses[k].tobytes() == eager_losses[k].tobytes(), f"loss differs at step {k}"
        assert bitwise_equal(states[k], eager_states[k]), f"state differs at step {k}"
    graph = f._current().executor.cuda_graph
    assert f.report()["replay_mode"] == "cuda graph"
    # the learning rate (and Adam's step count) read from the device: never baked in, so
    # no call ran uncaptured, and each launch is preceded by ONE copy of the scalars
    assert graph.uncaptured == 0 and graph.launches == steps - 3 and not graph.baked
    assert f.report()["replay_launches"] == 5  # x, y in; the scalars; the graph; the loss out


@standin_only
def test_the_scalars_are_one_host_to_device_copy_before_the_launch():
    from framework.testing.cupy_standin import counting

    from .helpers import batches, make_model, train_step

    fw.inplace.set_policy("off")
    model = make_model("mlp").to("cuda")
    opt = fw.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    f = fw.compile(train_step(model, opt))
    kinds = []
    for k, (x, y) in enumerate(batches("mlp", 6)):
        opt.param_groups[0]["lr"] = 0.05 / (k + 1)
        x, y = x.to("cuda"), y.to("cuda")
        with counting.count() as c:
            f(x, y)
        kinds.append(c.by_kind())
    assert kinds[3:] == [{"copy": 3, "h2d": 1, "graph": 1}] * 3


def test_inputs_rebound_at_every_call_give_the_graph_up_and_the_plan_is_put_back():
    from .helpers import batches, make_model, train_step

    fw.inplace.set_policy("off")
    model = make_model("mlp", None).to("cuda")
    opt = fw.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    f = fw.compile(train_step(model, opt))
    first = next(iter(model.parameters()))
    laid_out = False
    for x, y in batches("mlp", 12):
        f(x.to("cuda"), y.to("cuda"))
        laid_out = laid_out or bool(f.plan.kernel_allocations)
        first._data = first._data.copy()  # a new array: the address the graph read is stale
    graph = f._current().executor.cuda_graph
    assert laid_out and graph.failed and graph.graph is None
    assert f.report()["replay_mode"] == (
        f"uncaptured: program inputs were rebound {graph.captures} times; the graph was given up"
    )
    # no graph: the plan's own layout again, the kernels allocating as eagerly
    assert f.plan.kernel_allocations == [] and f.report()["arena_kernel_allocations"] == 0
    arena = f._current().executor.arena
    assert (0 if arena is None else arena.nbytes) == f.plan.arena_bytes
    assert _no_capture_left()


# --- the capture's allocator is the capturing thread's own ---------------------------------------


def _mlp_run(compiled, batches):
    """The MLP trained on ``batches`` eagerly or compiled: (losses, the step callable)."""
    from .helpers import make_model, train_step

    fw.inplace.set_policy("off")
    model = make_model("mlp").to("cuda")
    opt = fw.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = train_step(model, opt)
    f = fw.compile(step) if compiled else step
    return f, (f(x.to("cuda"), y.to("cuda")).detach().cpu().numpy().copy() for x, y in batches)


def test_a_step_captures_inside_a_callers_using_allocator_block():
    # CuPy refuses set_allocator inside using_allocator (ValueError): the capture's own
    # allocator is thread-local too, and the caller's is back after it
    from .helpers import batches

    cp = backend.cupy_module()
    calls = []

    class CallersPool(cp.cuda.MemoryPool):  # the caller's allocator (RMM, managed memory, ...)
        def malloc(self, size):
            calls.append(size)
            return super().malloc(size)

    data = batches("mlp", 8)
    eager = list(_mlp_run(False, data)[1])
    allocator = CallersPool().malloc
    with cp.cuda.using_allocator(allocator):
        f, losses = _mlp_run(True, data)
        got = list(losses)
        assert cp.cuda.get_allocator() == allocator
    assert [x.tobytes() for x in got] == [x.tobytes() for x in eager]
    assert f.report()["replay_mode"] == "cuda graph" and calls  # the caller's allocator served the rest


def test_another_thread_allocating_during_the_capture_is_served_by_its_own_allocator():
    # A loader thread prefetching to the GPU while the graph is captured: its memory does
    # not come from the graph's arena, and it does not break the capture
    import threading

    from .helpers import batches

    cp = backend.cupy_module()
    data = batches("mlp", 8)
    eager = list(_mlp_run(False, data)[1])
    f, losses = _mlp_run(True, data)
    got = [next(losses) for _ in range(3)]  # two captures and the recorded replay: the next call captures
    ex, seen = f._current().executor, {}

    def loader():
        with cp.cuda.Device(0):
            batch = cp.arange(4096, dtype=cp.float32) * 2  # allocates (a new block) and computes
            seen.update(ptr=batch.data.ptr, last=float(batch[-1]))

    def with_a_loader(replay):
        def replay_with_a_loader():
            if cp.cuda.get_current_stream().is_capturing():
                t = threading.Thread(target=loader)
                t.start()
                t.join()
                seen["arena"] = (ex.arena.data.ptr, ex.arena.nbytes)
            replay()

        return replay_with_a_loader

    rebuild = ex.rebuild

    def rebuild_with_a_loader():  # the graph's layout generates the replay function again
        rebuild()
        ex._replay = with_a_loader(ex._replay)

    ex.rebuild = rebuild_with_a_loader
    got += list(losses)
    lo, n = seen["arena"]
    assert seen["last"] == 8190.0 and not lo <= seen["ptr"] < lo + n
    assert f.report()["replay_mode"] == "cuda graph" and ex.cuda_graph.captures == 1
    assert [x.tobytes() for x in got] == [x.tobytes() for x in eager]


@pytest.mark.parametrize("number", [np.float32, np.float64], ids=["np.float32", "np.float64"])
def test_a_numpy_learning_rate_that_changes_every_step_is_a_device_scalar(number):
    # A NumPy scalar is strongly typed (its own dtype beside an array, as CuPy and NumPy
    # promote it): its slot is of its dtype, read by the graph's kernels, never baked
    from .helpers import batches, make_model, snapshot, train_step

    runs = []
    for compiled in (False, True):
        fw.inplace.set_policy("off")
        model = make_model("mlp").to("cuda")
        opt = fw.optim.SGD(model.parameters(), lr=number(0.05), momentum=0.9, weight_decay=1e-4)
        f = fw.compile(train_step(model, opt)) if compiled else train_step(model, opt)
        out = []
        for k, (x, y) in enumerate(batches("mlp", 10)):
            opt.param_groups[0]["lr"] = number(0.05 * 0.97**k)
            out.append((f(x.to("cuda"), y.to("cuda")).detach().cpu().numpy().copy(), snapshot(model, opt)))
        runs.append(out)
    for k, ((loss, state), (want_loss, want_state)) in enumerate(zip(runs[1], runs[0])):
        assert loss.tobytes() == want_loss.tobytes() and bitwise_equal(state, want_state), f"step {k} differs"
    graph = f._current().executor.cuda_graph
    assert f.captures == 2 and f.report()["replay_mode"] == "cuda graph"
    assert not graph.baked and graph.uncaptured == 0 and graph.launches == 7


# --- a batch uploaded into the graph's static input slots ---------------------------------------


@standin_only
@pytest.mark.parametrize("kind,norm", [("mlp", None), ("convnet", "bn")])
def test_a_batch_uploaded_into_the_input_slots_is_on_the_device_once_and_copied_in_by_no_launch(kind, norm, gpu_run):
    from framework import memory
    from framework.testing.cupy_standin import counting

    from .helpers import batches, make_model, snapshot, train_step

    steps = 8
    eager_losses, eager_states, _ = run(kind, "off", False, steps, norm, device="cuda")
    fw.inplace.set_policy("off")
    model = make_model(kind, norm).to("cuda")
    opt = fw.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    f = fw.compile(train_step(model, opt))
    memory.enable_gpu_hook()  # (gpu_run turns it off after the test)
    in_slots, kinds, planned = [], [], []
    for k, (x, y) in enumerate(batches(kind, steps)):
        xs, ys = f.upload(x.numpy(), y.numpy(), device="cuda")
        graph = f.last.executor.cuda_graph if f.last is not None and f.last.executor is not None else None
        in_slots.append(graph is not None and xs._data is graph.slot_for(0) and ys._data is graph.slot_for(1))
        with counting.count() as c:
            loss = f(xs, ys)
        kinds.append(c.by_kind())
        planned.append(f.plan.planned_peak_bytes)
        assert loss.detach().cpu().numpy().tobytes() == eager_losses[k].tobytes(), f"loss differs at step {k}"
        assert bitwise_equal(snapshot(model, opt), eager_states[k]), f"state differs at step {k}"
    # the graph is captured at the 4th call (the arguments were ordinary tensors then, copied
    # in); from the 5th, upload writes each batch into the slots and the call copies nothing
    assert in_slots == [False] * 4 + [True] * 4
    assert kinds[3] == {"copy": 3, "h2d": 1, "graph": 1}
    assert kinds[4:] == [{"h2d": 1, "graph": 1, "copy": 1}] * 4  # the scalars, the graph, the loss out
    assert f.report()["replay_launches"] == 3
    # the planned peak counts the batch once: the slots ARE the arguments
    graph = f.last.executor.cuda_graph
    assert graph.slot_bytes == x.numpy().nbytes + y.numpy().nbytes
    assert planned[3] - planned[4] == graph.slot_bytes and planned[4:] == [planned[4]] * 4
    # measured: a call given a device batch of its own holds it beside the slots
    x, y = batches(kind, 1, seed=5)[0]
    peaks = []
    for own in (False, True):
        args = (
            (fw.tensor(x.numpy(), device="cuda"), fw.tensor(y.numpy(), device="cuda"))
            if own
            else f.upload(x.numpy(), y.numpy())
        )
        memory.reset_peak()
        f(*args)
        peaks.append(memory.max_allocated_bytes("cuda"))
        del args
    rounded = sum(-(-a.nbytes // 512) * 512 for a in (x.numpy(), y.numpy()))  # CuPy's pool blocks
    assert peaks[1] - peaks[0] == rounded
    assert planned[-1] == f.plan.planned_peak_bytes - graph.slot_bytes  # the last call copied in again
    # as PyTorch's static inputs, the tensors are the graph's: the next upload writes over them
    first = f.upload(x.numpy(), y.numpy())[0]
    f.upload(x.numpy() + 1, y.numpy())
    assert np.array_equal(first.cpu().numpy(), x.numpy() + 1)
    assert _no_capture_left()


def test_upload_gives_ordinary_tensors_where_no_slot_takes_the_array():
    from .helpers import batches, make_model, train_step

    with pytest.raises(ValueError, match=r"upload\(\): give device="):
        fw.compile(lambda x: x).upload(np.zeros(3))
    model = make_model("mlp").to("cuda")
    opt = fw.optim.SGD(model.parameters(), lr=0.05)
    f = fw.compile(train_step(model, opt))
    data = batches("mlp", 6)
    for x, y in data:
        f(*f.upload(x.numpy(), y.numpy(), device="cuda"))
    graph = f.last.executor.cuda_graph
    assert graph.mode() == "cuda graph"
    x, y = data[0]
    xs, ys = f.upload(x.numpy(), y.numpy())  # the last program's device
    assert xs._data is graph.slot_for(0) and xs.device == fw.device("cuda")
    # another shape, another dtype, a device array, a position the step has no slot for
    half, as_float, on_device = x.numpy()[:2], y.numpy().astype(np.float32), fw.tensor(x.numpy(), device="cuda")
    for got, want in zip(f.upload(half, as_float, on_device._data), (half, as_float, x.numpy())):
        assert all(got._data is not s for s in graph.slots.values())
        assert got.device == fw.device("cuda") and np.array_equal(got.cpu().numpy(), want)
    # on the CPU: copies, as fw.tensor
    cpu = fw.compile(train_step(make_model("mlp"), fw.optim.SGD(make_model("mlp").parameters(), lr=0.05)))
    (t,) = cpu.upload(x.numpy(), device="cpu")
    assert t.device == fw.device("cpu") and np.array_equal(t.numpy(), x.numpy()) and t._data is not x.numpy()


def _graphed(f, *arrays, **kw):
    for _ in range(5):  # captured twice, recorded, captured as a graph, launched
        f(*f.upload(*arrays, device="cuda"), **kw)
    graph = f.last.executor.cuda_graph
    assert graph.mode() == "cuda graph"
    return graph


def test_uploaded_arguments_passed_in_another_order_are_read_before_a_slot_is_written():
    f = fw.compile(lambda a, b: a * 2 - b)
    A, B = np.arange(4, dtype=np.float32), np.full(4, 10, dtype=np.float32)
    graph = _graphed(f, A, B)
    sa, sb = f.upload(A, B)
    assert sa._data is graph.slot_for(0) and sb._data is graph.slot_for(1)
    assert np.array_equal(f(sb, sa).cpu().numpy(), B * 2 - A)
    assert graph.copies_in == 2 and not graph.inputs_in_slots
    # a view of a slot, passed for another argument, the same
    sa, sb = f.upload(A, B)
    assert np.array_equal(f(sa, sa[:]).cpu().numpy(), A * 2 - A)
    # the tensors are the slots: a call writes its arguments into them
    assert np.array_equal(sb.cpu().numpy(), A)


def test_upload_gives_keyword_arguments_no_slot():
    # the program's arguments are the positional ones, then the keyword ones by name:
    # upload's positions are the positional arguments only
    f = fw.compile(lambda x, *, z, y: x + 10 * z + 100 * y)
    X, Z, Y = np.ones(3, np.float32), np.full(3, 2, np.float32), np.full(3, 3, np.float32)
    for _ in range(6):
        xs, zs, ys = f.upload(X, Z, Y, device="cuda")
        out = f(xs, z=zs, y=ys)
        assert np.array_equal(out.cpu().numpy(), X + 10 * Z + 100 * Y)
    graph = f.last.executor.cuda_graph
    assert graph.mode() == "cuda graph" and xs._data is graph.slot_for(0)
    assert graph.slot_for(1) is graph.slot_for(2) is None and graph.copies_in == 2


def test_a_call_run_uncaptured_counts_the_callers_batch_beside_the_slots_again():
    f = fw.compile(lambda x, k: (x * 2).sum() + k)
    X = np.ones((64, 64), np.float32)
    graph = _graphed(f, X, k=np.int64(1))  # a NumPy integer: baked into the graph
    (xs,) = f.upload(X)
    f(xs, k=np.int64(1))
    in_slots = f.plan.planned_peak_bytes
    assert graph.inputs_in_slots
    f(*f.upload(X), k=np.int64(2))  # another baked value: this call runs node by node
    assert graph.mode().startswith("uncaptured") and not graph.inputs_in_slots
    assert f.plan.planned_peak_bytes == in_slots + graph.slot_bytes
