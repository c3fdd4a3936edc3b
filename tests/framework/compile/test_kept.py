"""A replayed step leaves what the caller keeps as an eager step leaves it.

After an eager step, the ``.grad`` tensors and the returned loss are the caller's: later
steps make new ones and never write over them. A compiled step must do the same, though
its buffers are planned once and reused at every call: gradients are planned outside the
arena, and a CUDA graph (whose arena holds them) copies out what the caller still holds
before it writes its memory again (docs/COMPILE.md, "What a replay hands back").
"""

from __future__ import annotations

import pytest

import framework as fw
from tests.conftest import requires_gpu

from .helpers import batches, make_model, train_step

STEPS = 12  # two captures, the recorded replay, then nine replays (graph launches on a GPU)
MODELS = [("mlp", None), ("convnet", "bn"), ("resnet", "bn")]


def _train(kind, norm, policy, device, compiled, keep):
    """Trains STEPS steps; ``keep(model, loss)`` is called after each and its result kept.
    Returns the kept results and the step callable."""
    fw.inplace.set_policy(policy)
    model = make_model(kind, norm).to(device)
    opt = fw.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    step = train_step(model, opt)
    f = fw.compile(step) if compiled else step
    kept = []
    for x, y in batches(kind, STEPS):
        loss = f(x.to(device), y.to(device))
        kept.append(keep(model, loss))
    return kept, f


def _values(model, loss) -> list:
    return [p.grad.cpu().numpy().copy() for p in model.parameters()] + [loss.detach().cpu().numpy().copy()]


def _references(model, loss) -> list:
    return [p.grad for p in model.parameters()] + [loss]


def _graph(f):
    return f._current().executor.cuda_graph


@pytest.mark.parametrize("kind,norm", MODELS, ids=[k for k, _ in MODELS])
@pytest.mark.parametrize("policy", ["off", "on"])
def test_kept_gradients_and_losses_keep_their_values_over_later_replays(kind, norm, policy, backend):
    eager, _ = _train(kind, norm, "off", backend, False, _values)
    kept, f = _train(kind, norm, policy, backend, True, _references)
    # every step's gradients and loss, read after all the steps: as eager `off` left them
    for k, (refs, want) in enumerate(zip(kept, eager)):
        for i, (t, w) in enumerate(zip(refs, want)):
            got = t.detach().cpu().numpy()
            assert got.tobytes() == w.tobytes(), f"step {k}: kept tensor {i} changed (or differs from eager)"
    if backend == "cuda":
        graph = _graph(f)
        assert f.report()["replay_mode"] == "cuda graph" and graph.launches == STEPS - 3
        # each launch but the last found the previous launch's gradients held: copied out
        n_grads = sum(1 for wb in f.program.writebacks if wb.how == "grad")
        assert graph.kept_copies == n_grads * (graph.launches - 1) > 0
        assert graph.arenas_left == 0 and graph.captures == 1


@pytest.mark.gpu
@requires_gpu
def test_a_replay_copies_nothing_when_the_caller_keeps_nothing():
    _, f = _train("convnet", "bn", "off", "cuda", True, lambda model, loss: None)
    graph = _graph(f)
    assert f.report()["replay_mode"] == "cuda graph" and graph.kept_copies == graph.arenas_left == 0


def _hold(how, g):
    """One way of holding gradient ``g`` (a tensor on the GPU) beside, or instead of, its
    tensor: whatever eager leaves intact after later steps."""
    cp = fw.backend.cupy_module()
    a = g._data
    ways = {
        "view": lambda: g[0],  # a view tensor: its array's base is the gradient's array
        "detached": g.detach,  # a tensor sharing the array
        "data": lambda: g.data,  # the same
        "as_strided": lambda: fw.as_strided(g, (2,), (1,), 1),  # an array over `a.data + 4`: no base
        "array": lambda: a,
        "pointer": lambda: a.data,
        "offset pointer": lambda: a.data + a.itemsize,  # a new MemoryPointer over the same memory
        "cupy as_strided": lambda: cp.lib.stride_tricks.as_strided(a, (2,), (a.itemsize,)),  # memptr=a.data
        "array over a pointer": lambda: cp.ndarray((2,), a.dtype, memptr=a.data + a.itemsize),
        "unowned memory": lambda: cp.ndarray(
            a.shape, a.dtype, memptr=cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(a.data.ptr, a.nbytes, a, 0), 0)
        ),
    }
    return ways[how]()


def _held_values(held, how, shape, dtype):
    """What ``held`` (see :func:`_hold`) shows now, as a NumPy array."""
    cp = fw.backend.cupy_module()
    if how == "pointer":
        return cp.ndarray(shape, dtype, memptr=held).get()
    if how == "offset pointer":
        return cp.ndarray((2,), dtype, memptr=held).get()
    return (held._data if isinstance(held, fw.Tensor) else held).get()


def _expected(want, how):
    """What ``how`` holds of the gradient ``want`` (its values after that step, eagerly)."""
    flat = want.reshape(-1)
    if how == "view":
        return want[0]
    if how in ("as_strided", "offset pointer", "array over a pointer"):
        return flat[1:3]
    if how == "cupy as_strided":
        return flat[:2]
    return want


def _holder(how, at=None):
    """What the caller keeps of the first parameter's gradient after each step (``at``: only
    after that step): see :func:`_hold`."""

    def hold(model, loss):
        if at is not None and len(model.__dict__.setdefault("_steps", [])) != at:
            model._steps.append(None)
            return None
        model.__dict__.setdefault("_steps", []).append(None)
        return _hold(how, next(iter(model.parameters())).grad)

    return hold


def _check_held(kept, eager, how):
    for k, held in enumerate(kept):
        if held is None:
            continue
        want = eager[k][0]
        got = _held_values(held, how, want.shape, want.dtype)
        assert got.tobytes() == _expected(want, how).tobytes(), f"step {k}: the held gradient changed"


HOLDERS = [
    "view",
    "detached",
    "data",
    "as_strided",
    "array",
    "pointer",
    "offset pointer",
    "cupy as_strided",
    "array over a pointer",
    "unowned memory",
]


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("how", HOLDERS)
def test_a_gradient_held_other_than_by_its_tensor_leaves_the_arena_to_its_holder(how):
    # A view of a gradient, a tensor sharing its array, an array or a pointer made from its
    # memory (fw.as_strided's `x.data + offset` has no base) cannot be pointed at a copy: the
    # graph leaves its arena to them and is captured again on a new one; the step goes on
    # replaying as a graph
    eager, _ = _train("mlp", None, "off", "cuda", False, _values)
    kept, f = _train("mlp", None, "off", "cuda", True, _holder(how, at=5))
    _check_held(kept, eager, how)
    graph = _graph(f)
    assert graph.arenas_left == 1 and graph.captures == 2
    assert f.report()["replay_mode"] == "cuda graph"


@pytest.mark.gpu
@requires_gpu
def test_a_gradient_tensor_held_with_a_view_of_it_keeps_sharing_its_memory():
    # the tensor is not pointed at a copy while a view holds its memory: eager's two share
    # memory, so do these (the arena is left to both)
    eager, _ = _train("mlp", None, "off", "cuda", False, _values)

    def hold(model, loss):
        steps = model.__dict__.setdefault("_steps", [])
        steps.append(None)
        g = next(iter(model.parameters())).grad
        return (g, fw.as_strided(g, (2,), (1,), 1)) if len(steps) == 6 else None

    kept, f = _train("mlp", None, "off", "cuda", True, hold)
    graph = _graph(f)
    assert graph.arenas_left == 1 and graph.kept_copies == 0
    t, view = kept[5]
    assert t._data.get().tobytes() == eager[5][0].tobytes()
    assert view._data.data.ptr == t._data.data.ptr + t._data.itemsize


@pytest.mark.gpu
@requires_gpu
def test_a_caller_holding_graph_memory_at_every_call_gives_the_graph_up():
    eager, _ = _train("mlp", None, "off", "cuda", False, _values)
    kept, f = _train("mlp", None, "off", "cuda", True, _holder("view"))
    _check_held(kept, eager, "view")
    graph = _graph(f)
    assert graph.failed and graph.arenas_left == graph.captures
    assert f.report()["replay_mode"] == (
        f"uncaptured: the caller held the graph's memory past {graph.arenas_left} calls; the graph was given up"
    )


def _accumulating(policy, device, compiled):
    """A step without zero_grad: each call's gradient is added to the last one's."""
    import framework.nn.functional as F

    from .helpers import snapshot

    fw.inplace.set_policy(policy)
    model = make_model("mlp").to(device)
    opt = fw.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    f = fw.compile(step) if compiled else step
    out = [
        (f(x.to(device), y.to(device)).detach().cpu().numpy().copy(), snapshot(model, opt))
        for x, y in batches("mlp", 10)
    ]
    return out, f


@pytest.mark.parametrize("policy", ["off", "auto"])
def test_a_step_that_accumulates_gradients_matches_eager(policy, backend):
    # The new gradient is the next call's input: under `off` a new tensor each call (the
    # graph must not hand it out in memory it writes again), under `auto` the old one
    # updated in place (bound: the graph replays).
    from .helpers import bitwise_equal

    eager, _ = _accumulating("off", backend, False)
    got, f = _accumulating(policy, backend, True)
    for k, ((loss, state), (want_loss, want_state)) in enumerate(zip(got, eager)):
        assert loss.tobytes() == want_loss.tobytes() and bitwise_equal(state, want_state), f"step {k} differs"
    if backend == "cuda" and policy == "auto":
        assert f.report()["replay_mode"] == "cuda graph"
