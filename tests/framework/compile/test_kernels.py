"""The kernel table, op by op: replay is bitwise the eager op (forward and backward).

Each case compiles ``x -> op(...) -> (y * w).sum() -> backward`` (``w`` random, so the
gradient reaching the op is not constant), calls it a few times with new inputs and
compares the result and every gradient bit for bit with the same function run eagerly.
Cases cover the direct kernels (kernels.FORWARD/BACKWARD), broadcasting, and the ops
that write through ``out=`` into a planned buffer or, re-inplaced, into their input.
"""

import numpy as np
import pytest

import framework as fw
from framework.compile import kernels
from framework.ops import elementwise as E
from framework.ops import linalg as L
from framework.ops import reduce as R
from framework.ops.view import Permute, View

rng = np.random.default_rng(0)


def _t(*shape, grad=True, positive=False):
    a = rng.standard_normal(shape).astype(np.float32)
    if positive:
        a = np.abs(a) + 0.5
    return fw.tensor(a, requires_grad=grad)


# name -> (function of the inputs, input makers)
CASES = {
    "add": (lambda a, b: a + b, [lambda: _t(4, 5), lambda: _t(4, 5)]),
    "add_broadcast": (lambda a, b: a + b, [lambda: _t(4, 5), lambda: _t(5)]),
    "add_scalar_alpha": (lambda a, b: a.add(b, alpha=0.5), [lambda: _t(4, 5), lambda: _t(4, 5)]),
    "sub": (lambda a, b: a - b, [lambda: _t(3, 6), lambda: _t(3, 6)]),
    "sub_broadcast": (lambda a, b: a - b, [lambda: _t(3, 6), lambda: _t(1, 6)]),
    "mul": (lambda a, b: a * b, [lambda: _t(4, 5), lambda: _t(4, 5)]),
    "mul_scalar": (lambda a: a * 0.25, [lambda: _t(4, 5)]),
    "mul_broadcast": (lambda a, b: a * b, [lambda: _t(4, 5), lambda: _t(5)]),
    "div": (lambda a, b: a / b, [lambda: _t(4, 5), lambda: _t(4, 5, positive=True)]),
    "neg": (lambda a: -a, [lambda: _t(7)]),
    "div_no_grad_divisor": (lambda a, b: (a * 1.0) / b.detach(), [lambda: _t(4, 5), lambda: _t(4, 5, positive=True)]),
    "exp": (lambda a: a.exp(), [lambda: _t(3, 4)]),
    "tanh": (lambda a: a.tanh(), [lambda: _t(3, 4)]),
    "relu": (lambda a: a.relu(), [lambda: _t(3, 4)]),
    "sigmoid": (lambda a: a.sigmoid(), [lambda: _t(3, 4)]),
    "matmul": (lambda a, b: a @ b, [lambda: _t(3, 4), lambda: _t(4, 5)]),
    "matmul_transposed": (lambda a, b: a @ b.t(), [lambda: _t(3, 4), lambda: _t(5, 4)]),
    "linear": (lambda a, w, b: fw.nn.functional.linear(a, w, b), [lambda: _t(3, 4), lambda: _t(5, 4), lambda: _t(5)]),
    "linear_no_bias": (lambda a, w: fw.nn.functional.linear(a, w), [lambda: _t(3, 4), lambda: _t(5, 4)]),
    "linear_3d": (
        lambda a, w, b: fw.nn.functional.linear(a, w, b),
        [lambda: _t(2, 3, 4), lambda: _t(5, 4), lambda: _t(5)],
    ),
    "sum_all": (lambda a: a.sum() * 1.0, [lambda: _t(3, 4)]),
    "sum_dim": (lambda a: a.sum(dim=1), [lambda: _t(3, 4)]),
    "sum_keepdim": (lambda a: a.sum(dim=0, keepdim=True), [lambda: _t(3, 4)]),
    "view": (lambda a: a.view(2, 6), [lambda: _t(3, 4)]),
    "permute": (lambda a: a.permute(1, 0) * 1.0, [lambda: _t(3, 4)]),
    # ops without a direct kernel: the op's own code, writing through out= (OUT_CAPABLE)
    "softmax": (lambda a: a.softmax(-1), [lambda: _t(3, 4)]),
    "log_softmax": (lambda a: a.log_softmax(-1), [lambda: _t(3, 4)]),
    "leaky_relu": (lambda a: a.leaky_relu(0.1), [lambda: _t(3, 4)]),
    "clamp": (lambda a: a.clamp(-0.5, 0.5), [lambda: _t(3, 4)]),
    "sqrt": (lambda a: a.sqrt(), [lambda: _t(3, 4, positive=True)]),
    "log": (lambda a: a.log(), [lambda: _t(3, 4, positive=True)]),
    "sin": (lambda a: a.sin(), [lambda: _t(3, 4)]),
    "pow": (lambda a: a**3, [lambda: _t(3, 4)]),
    "abs": (lambda a: a.abs(), [lambda: _t(3, 4)]),
    "maximum": (lambda a, b: fw.maximum(a, b), [lambda: _t(3, 4), lambda: _t(3, 4)]),
    "dropout": (lambda a: fw.nn.functional.dropout(a, 0.3), [lambda: _t(5, 6)]),
    # chains whose middle values die: re-inplaced
    "chain": (lambda a, b: ((a * b + 1.0).tanh() - b).relu().exp(), [lambda: _t(4, 5), lambda: _t(4, 5)]),
}

LOWERED = {
    "add",
    "add_broadcast",
    "sub",
    "sub_broadcast",
    "mul",
    "mul_scalar",
    "div",
    "neg",
    "exp",
    "tanh",
    "relu",
    "sigmoid",
    "matmul",
    "matmul_transposed",
    "linear",
    "linear_no_bias",
    "sum_all",
    "sum_dim",
    "sum_keepdim",
    "view",
    "permute",
    "chain",
}


def _run(fn, makers, compiled, calls, seed):
    global rng
    rng = np.random.default_rng(seed)
    shape = fn(*[m() for m in makers]).shape
    w = fw.tensor(np.linspace(-1, 2, int(np.prod(shape)), dtype=np.float32).reshape(shape))
    fw.manual_seed(seed)
    rng = np.random.default_rng(seed)

    def step(*xs):
        for x in xs:
            x.grad = None
        y = fn(*xs)
        (y * w).sum().backward()
        return y

    f = fw.compile(step, modules=[], optimizers=[]) if compiled else step
    out = []
    for _ in range(calls):
        xs = [m() for m in makers]
        y = f(*xs)
        out.append(
            [y.detach().numpy().copy()] + [np.array(np.nan) if x.grad is None else x.grad.numpy().copy() for x in xs]
        )
    return out, f


@pytest.mark.parametrize("policy", ["off", "on"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_replay_is_bitwise_the_eager_op(name, policy):
    fw.inplace.set_policy(policy)
    fn, makers = CASES[name]
    eager, _ = _run(fn, makers, False, 3, seed=1)
    replayed, f = _run(fn, makers, True, 3, seed=1)
    for a, b in zip(eager, replayed):
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert x.tobytes() == y.tobytes(), name
    if name in LOWERED:
        ops = [
            n
            for n in f.program.nodes
            if n.kind == "call" and not n.name.startswith("Mul") or n.kind == "call" and name.startswith("mul")
        ]
        assert any(n.info.get("lowered") for n in ops), f"{name} did not run on a direct kernel"


def test_tables_are_consistent():
    assert kernels.INPLACE_FORM <= kernels.OUT_CAPABLE
    for op in kernels.FORWARD:
        assert op in kernels.BACKWARD or op in kernels.FORWARD_ONLY, f"{op.__name__}: no backward kernel"
    for op in (View, Permute):
        assert op in kernels.BACKWARD
    assert {E.Add, E.Mul, L.Matmul, L.Linear, R.Sum} <= set(kernels.FORWARD)


def test_an_op_outside_the_tables_allocates_its_own_output_and_the_plan_says_so():
    fw.inplace.set_policy("off")
    x = fw.tensor(np.arange(12, dtype=np.float32).reshape(3, 4), requires_grad=True)

    def step(x):
        x.grad = None
        y = fw.cat([x, x], dim=0)  # Cat: no out= path
        (y * 2.0).sum().backward()
        return y.sum()

    f = fw.compile(step, modules=[], optimizers=[])
    f(x)
    f(x)
    plan = f.plan
    cat_out = next(n for n in f.program.nodes if n.name == "Cat").outputs[0]
    c = plan.classes.of[cat_out]
    assert plan.placement[c] == "kernel" and "allocates its own output" in plan.why[c]
