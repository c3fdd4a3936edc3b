"""Differential property: no inplace policy ever changes a number in silence.

Hypothesis writes small programs as Python SOURCE (so the proof of policy ``auto`` sees
the bytecode a user's function has: named values, values reused after they went
through a site, names rebound, ``with no_grad():`` blocks, lists of tensors), over
sites (``nn.ReLU()``, ``nn.LeakyReLU()``, ``nn.Tanh(inplace=None)``, ``Dropout`` in
training and in eval, ``BatchNorm1d`` in training and eval, an ``nn.Sequential`` of
sites, ``F.residual_add``, InPlace-ABN's site), ordinary ops and explicit inplace ops.

Each program runs under ``off``, ``auto`` and ``on`` from the same state:

- ``auto``: every value the program holds, every gradient and every error is
  bit-for-bit what ``off`` gives;
- ``on``: the same, or a :class:`ConsumedTensorError` (a value read after a site wrote
  over it), or backward stopped by the version check naming the inplace op (a site whose
  inplace form keeps its output, which the program then changed itself: ``v = lrelu(h);
  v.add_(1)``, as PyTorch's ``inplace=True`` stops there too): never another number.

The same holds on the GPU (its fused kernels in place of the CPU's), checked on fewer
programs.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import framework as fw
from framework import inplace, memory, nn
from framework.inplace import ConsumedTensorError
from framework.nn import functional as F
from models.layers import ABN
from tests.conftest import requires_gpu

N, C = 4, 3

SITES = ["relu", "lrelu", "tanh_site", "drop_train", "drop_eval", "bn_train", "bn_eval", "seq", "abn"]
FUNCS = ["F.relu", "fw.tanh", "fw.sigmoid", "fw.neg", "lin"]


def expr(depth):
    """An expression over the names v0..v{k}: ``("name", i)`` or a call around one."""
    leaf = st.tuples(st.just("name"), st.integers(0, 30))
    if depth == 0:
        return leaf
    inner = expr(depth - 1)
    return st.one_of(
        leaf,
        st.tuples(st.just("site"), st.sampled_from(SITES), inner),
        st.tuples(st.just("func"), st.sampled_from(FUNCS), inner),
        st.tuples(st.just("method"), st.sampled_from(["exp", "relu", "tanh"]), inner),
        st.tuples(st.just("scalar"), st.sampled_from(["+", "*", "-"]), inner, st.sampled_from([0.5, 2.0, -1.0])),
        st.tuples(st.just("binary"), st.sampled_from(["+", "-", "*"]), inner, inner),
        st.tuples(st.just("residual"), inner, inner),
        st.tuples(st.just("stack"), inner, inner),
    )


statement = st.one_of(
    st.tuples(st.just("assign"), expr(2)),
    st.tuples(
        st.just("rebind"), st.integers(0, 30), st.sampled_from(SITES + FUNCS + ["+", "residual"]), st.integers(0, 30)
    ),
    st.tuples(st.just("list"), st.integers(0, 30), st.integers(0, 30)),
    st.tuples(st.just("explicit"), st.integers(0, 30), st.sampled_from(["add_", "mul_", "relu_", "setitem"])),
)
block = st.one_of(
    st.tuples(st.just("plain"), statement),
    st.tuples(st.just("no_grad"), st.lists(statement, min_size=1, max_size=3)),
)


class Writer:
    """Renders statements into the body of ``def program(x, c, m):``."""

    def __init__(self):
        self.names = ["x", "c", "h"]  # h = lin(x), a named intermediate from the start
        self.lists = []
        self.lines = ["    h = m.lin(x)"]

    def name(self, i):
        return self.names[i % len(self.names)]

    def render(self, e):
        kind = e[0]
        if kind == "name":
            return self.name(e[1])
        if kind == "site":
            return f"m.{e[1]}({self.render(e[2])})"
        if kind == "func":
            f = "m.lin" if e[1] == "lin" else e[1]
            return f"{f}({self.render(e[2])})"
        if kind == "method":
            arg = self.render(e[2])
            return f"({arg} * 0.25).{e[1]}()" if e[1] == "exp" else f"{arg}.{e[1]}()"
        if kind == "scalar":
            return f"({self.render(e[2])} {e[1]} {e[3]})"
        if kind == "binary":
            return f"({self.render(e[2])} {e[1]} {self.render(e[3])})"
        if kind == "residual":
            return f"F.residual_add({self.render(e[1])}, {self.render(e[2])})"
        return f"fw.stack([{self.render(e[1])}, {self.render(e[2])}]).sum(0)"

    def statement(self, s, indent):
        pad = "    " * indent
        kind = s[0]
        if kind == "assign":
            new = f"v{len(self.names)}"
            self.lines.append(f"{pad}{new} = {self.render(s[1])}")
            self.names.append(new)
        elif kind == "rebind":
            v, op, other = self.name(s[1]), s[2], self.name(s[3])
            if v in ("x", "c"):
                return  # the inputs stay bound: the final check reads them
            if op in SITES:
                rhs = f"m.{op}({v})"
            elif op == "lin":
                rhs = f"m.lin({v})"
            elif op in FUNCS:
                rhs = f"{op}({v})"
            elif op == "+":
                rhs = f"{v} + {other}"
            else:
                rhs = f"F.residual_add({v}, {other})"
            self.lines.append(f"{pad}{v} = {rhs}")
        elif kind == "list":
            new = f"l{len(self.lists)}"
            self.lines.append(f"{pad}{new} = [{self.name(s[1])}, {self.name(s[2])}]")
            self.lists.append(new)
            out = f"v{len(self.names)}"
            self.lines.append(f"{pad}{out} = m.relu({new}[0]) + {new}[1]")  # a site on a value a list holds
            self.names.append(out)
        else:
            v, op = self.name(s[1]), s[2]
            call = {
                "add_": f"{v}.add_(0.5)",
                "mul_": f"{v}.mul_(0.5)",
                "relu_": f"{v}.relu_()",
                "setitem": f"{v}[0] = 0.25",
            }[op]
            self.lines.append(f"{pad}{call}")

    def source(self, blocks) -> str:
        for b in blocks:
            if b[0] == "plain":
                self.statement(b[1], 1)
            else:
                self.lines.append("    with fw.no_grad():")
                before = len(self.lines)
                for s in b[1]:
                    self.statement(s, 2)
                if len(self.lines) == before:
                    self.lines.append("        pass")
        held = ", ".join(f"{n!r}: {n}" for n in self.names + self.lists)
        body = "\n".join(self.lines)
        return f"def program(x, c, m):\n{body}\n    return {{{held}}}\n"


class Model(nn.Module):
    """The sites and layers a program calls, rebuilt identically for every run."""

    def __init__(self):
        super().__init__()
        fw.manual_seed(0)
        self.lin = nn.Linear(C, C)
        self.relu = nn.ReLU()
        self.lrelu = nn.LeakyReLU(0.1)
        self.tanh_site = nn.Tanh(inplace=None)
        self.drop = nn.Dropout(0.5)
        self.drop_e = nn.Dropout(0.5)
        self.drop_e.eval()
        self.bn = nn.BatchNorm1d(C)
        self.bn_e = nn.BatchNorm1d(C)
        self.bn_e.eval()
        self.seq_ = nn.Sequential(nn.LeakyReLU(0.2), nn.ReLU())
        self.abn_ = ABN(C)

    def drop_train(self, t):
        return self.drop(t)

    def drop_eval(self, t):
        return self.drop_e(t)

    def bn_train(self, t):
        return self.bn(t)

    def bn_eval(self, t):
        return self.bn_e(t)

    def seq(self, t):
        return self.seq_(t)

    def abn(self, t):
        return self.abn_(t)


def run(source, policy, device="cpu", create_graph=False):
    """Runs the program under ``policy`` on ``device``; returns what the user can observe
    (with ``create_graph``: the first gradients, taken with history, and the gradients
    of their squared norm)."""
    scope = {"fw": fw, "F": F}
    exec(compile(source, "<generated program>", "exec"), scope)  # noqa: S102
    rng = np.random.default_rng(0)
    x = fw.tensor(rng.standard_normal((N, C)).astype(np.float32), requires_grad=True, device=device)
    c = fw.tensor(rng.standard_normal((N, C)).astype(np.float32), device=device)
    m = Model().to(device)
    fw.manual_seed(1)  # dropout masks: the same draws under every policy
    prev = inplace.set_auto_min_bytes(0)  # tiny tensors: prove every one
    try:
        with inplace.policy(policy), np.errstate(all="ignore"):
            return _observe(scope, x, c, m, create_graph)
    finally:
        inplace.set_auto_min_bytes(prev)


def _observe(scope, x, c, m, create_graph=False):
    """Runs the program and returns what the user can observe."""
    try:
        held = scope["program"](x, c, m)
    except ConsumedTensorError:
        return "consumed"
    except (RuntimeError, ValueError, IndexError) as e:
        return ("error", type(e).__name__, str(e).split(" at ")[0][:80])
    try:
        values = {k: [t.detach().numpy().copy() for t in (v if isinstance(v, list) else [v])] for k, v in held.items()}
        loss = None
        for k, (_, v) in enumerate(sorted(held.items())):
            for t in v if isinstance(v, list) else [v]:
                if t.requires_grad:
                    term = (t * float(k + 1)).sum()
                    loss = term if loss is None else loss + term
        backward_error = None
        first = None
        if loss is not None:
            try:
                if create_graph:
                    first = _double_backward(loss, [x, *m.parameters()])
                else:
                    loss.backward()
            except ConsumedTensorError:
                raise
            except RuntimeError as e:
                backward_error = str(e).split(" at ")[0][:80]
    except ConsumedTensorError:
        return "consumed"
    grads = [None if p.grad is None else p.grad.numpy().copy() for p in [x, *m.parameters()]]
    stats = [b.numpy().copy() for b in m.buffers()]
    return {"values": values, "grads": grads, "stats": stats, "backward_error": backward_error, "first": first}


def _double_backward(loss, leaves):
    """The gradients of ``loss`` taken with create_graph (returned as arrays), then
    ``sum(g * g)`` over them backpropagated into the leaves' ``.grad``."""
    leaves = [p for p in leaves if p.requires_grad]
    grads = fw.autograd.grad(loss, leaves, create_graph=True, allow_unused=True)
    penalty = None
    for g in grads:
        if g is not None and g.requires_grad:
            term = (g * g).sum()
            penalty = term if penalty is None else penalty + term
    first = [None if g is None else g.detach().numpy().copy() for g in grads]
    if penalty is not None:
        penalty.backward()
    return first


def same(a, b) -> bool:
    """Bit for bit the same observations (or the same error before anything was held)."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return a == b
    va, ga, sa, ea = a["values"], a["grads"], a["stats"], a["backward_error"]
    vb, gb, sb, eb = b["values"], b["grads"], b["stats"], b["backward_error"]
    if va.keys() != vb.keys() or ea != eb:
        return False
    for k in va:
        for p, q in zip(va[k], vb[k], strict=True):
            if not np.array_equal(p, q, equal_nan=True):
                return False
    fa, fb = a.get("first") or [], b.get("first") or []
    if len(fa) != len(fb):
        return False
    for p, q in zip(ga + sa + fa, gb + sb + fb, strict=True):
        if (p is None) != (q is None) or (p is not None and not np.array_equal(p, q, equal_nan=True)):
            return False
    return True


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(block, min_size=1, max_size=6))
def test_no_policy_changes_a_number(blocks):
    _check_policies(Writer().source(blocks), "cpu")


@pytest.mark.gpu
@requires_gpu
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(block, min_size=1, max_size=6))
def test_no_policy_changes_a_number_on_the_gpu(blocks):
    _check_policies(Writer().source(blocks), "cuda")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(block, min_size=1, max_size=5))
def test_no_policy_changes_a_higher_order_gradient(blocks):
    _check_policies(Writer().source(blocks), "cpu", create_graph=True)


@pytest.mark.gpu
@requires_gpu
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(block, min_size=1, max_size=5))
def test_no_policy_changes_a_higher_order_gradient_on_the_gpu(blocks):
    _check_policies(Writer().source(blocks), "cuda", create_graph=True)


def test_the_higher_order_programs_differentiate_a_gradient():
    """Not vacuous: a create_graph program has second-order gradients to compare."""
    source = Writer().source(
        [
            ("plain", ("assign", ("site", "relu", ("func", "lin", ("name", 0))))),
            ("plain", ("assign", ("site", "bn_train", ("func", "fw.tanh", ("name", 3))))),
        ]
    )
    ref = run(source, "off", create_graph=True)
    assert isinstance(ref, dict) and ref["backward_error"] is None, (source, ref)
    assert ref["first"] and any(f is not None for f in ref["first"])
    assert any(g is not None and np.abs(g).sum() > 0 for g in ref["grads"]), source
    assert same(run(source, "auto", create_graph=True), ref)


# the version check's error, as _observe keeps it (its first 80 characters)
VERSION_ERROR = "one of the variables needed for gradient computation has been modified by an inplace operation"[:80]


def stopped_by_the_version_check(on, ref) -> bool:
    """``on`` held off's values bit for bit, and its backward (where off's ran) stopped with
    the version check's error, which names the op that changed the saved tensor."""
    if not (isinstance(on, dict) and isinstance(ref, dict)) or ref["backward_error"] is not None:
        return False
    if not (on["backward_error"] or "").startswith(VERSION_ERROR):
        return False
    return same(
        {**on, "backward_error": None, "grads": [], "stats": [], "first": None},
        {**ref, "grads": [], "stats": [], "first": None},
    )


def _check_policies(source, device, create_graph=False):
    ref = run(source, "off", device, create_graph)
    assert ref != "consumed", source  # off never writes over a site's input
    auto = run(source, "auto", device, create_graph)
    assert same(auto, ref), source
    on = run(source, "on", device, create_graph)
    assert on == "consumed" or same(on, ref) or stopped_by_the_version_check(on, ref), source


def test_on_may_stop_at_the_version_check_where_a_site_kept_its_output_and_the_program_changed_it():
    """Found by Hypothesis: the leaky ReLU site runs in place under ``on`` and keeps its output
    for backward; the program then adds to that output itself. Off's backward runs; on's stops
    naming ``add_``, as PyTorch's ``LeakyReLU(inplace=True)`` does. Never another number."""
    lrelu_of_a_temporary = ("assign", ("site", "lrelu", ("func", "lin", ("name", 0))))
    source = Writer().source([("plain", lrelu_of_a_temporary), ("plain", ("explicit", 3, "add_"))])
    assert "v3 = m.lrelu(m.lin(x))" in source and "v3.add_(0.5)" in source
    ref, on = run(source, "off"), run(source, "on")
    assert ref["backward_error"] is None and on["backward_error"].startswith(VERSION_ERROR), (source, on)
    assert stopped_by_the_version_check(on, ref)
    _check_policies(source, "cpu")


def test_the_programs_reach_every_policy_path():
    """Not vacuous: a program of the kind drawn above is rewritten by auto, and makes on
    raise where it reads a value a site consumed."""
    source = Writer().source(
        [
            ("plain", ("assign", ("scalar", "*", ("func", "lin", ("name", 0)), 2.0))),  # v3 = lin(x) * 2.0
            ("plain", ("rebind", 3, "tanh_site", 0)),  # v3 = m.tanh_site(v3): rebound, so dead
            ("plain", ("assign", ("site", "relu", ("func", "lin", ("name", 0))))),  # relu(lin(x)): a temporary
            ("plain", ("assign", ("site", "relu", ("name", 2)))),  # relu(h): h is read again below
            ("plain", ("assign", ("binary", "+", ("name", 2), ("name", 5)))),
        ]
    )
    assert "v3 = m.tanh_site(v3)" in source and "v5 = m.relu(h)" in source
    memory.reset_stats()
    ref = run(source, "off")
    memory.reset_stats()
    assert same(run(source, "auto"), ref), source
    assert memory.stats().get("auto_inplace_ops.ReLU", 0) >= 1
    assert memory.stats().get("auto_inplace_ops.Tanh", 0) == 1
    assert run(source, "on") == "consumed"
