"""Differential programs against PyTorch 2.13 (the oracle), beside the policy generator
(tests/framework/test_policy_differential.py).

A seeded generator writes small programs as Python SOURCE over float64 leaves: ordinary
ops, views (``v[i]``, ``v[1:]``, ``v.t()``), inplace ops on tensors and on their views
(``exp_``, ``relu_``, ``mul_`` by a tensor that needs a gradient, ``v[0] = w``, ...),
``autograd.grad`` with respect to leaves and non-leaves (``create_graph``,
``retain_graph``, its gradients used again), ``backward`` (also a second one through a
graph already freed, and through the graph ``create_graph`` recorded). Each program runs
on PyTorch and here, under the policies ``off``, ``auto`` and ``on``: every value it
records must agree (float64, to rounding), and an error must stop both at the same
statement (the messages differ).

How many programs: ``ORACLE_PROGRAMS`` (default 300, in CI); ``ORACLE_PROGRAMS=3000``
is the slow run. The count that ran is printed at the end of the session
("oracle: N random programs ...", tests/conftest.py).
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

import framework as fw

PROGRAMS = int(os.environ.get("ORACLE_PROGRAMS", "300"))
BATCH = 25
STATEMENTS = (6, 14)
POLICIES = ("off", "auto", "on")

# (template, result shape): {a}, {b} are names of shape (3, 4); {c}, {d} of shape (4,)
UNARY = [
    "{a}.exp()",
    "{a}.tanh()",
    "{a}.sigmoid()",
    "{a}.relu()",
    "{a}.sin()",
    "{a} * 2.0",
    "{a} + 1.0",
    "F.leaky_relu({a}, 0.1)",
    "{a}.pow(2)",
    "{a} / ({b}.abs() + 1.0)",
    "{a} * {b}",
    "{a} + {c}",
    "{a} - {b}",
    "({a} * {c}).sigmoid()",
    "{a}.clone()",
    "m.maximum({a}, {b})",
    "{a}.abs()",
]
TO_ROW = [
    "{a}[{i}]",
    "{a}.sum(0)",
    "{a}.select(0, {i})",
    "{c}.exp()",
    "{c} * {d}",
    "{c} / ({d}.abs() + 1.0)",
    "{a}.t()[{j}].clone().view(-1)[:1].expand(4)",
    "{a}.mean(0) + {c}",
]
SQUARE_VIEWS = ["{a}[:]", "{a}.view(12).view(3, 4)", "{a}.t().t()"]
INPLACE = [
    "{a}.add_(1.0)",
    "{a}.mul_(2.0)",
    "{a}.exp_()",
    "{a}.tanh_()",
    "{a}.sigmoid_()",
    "{a}.relu_()",
    "{a}.sin_()",
    "{a}.div_({b}.detach().abs() + 1.0)",
    "{a}.div_({b}.abs() + 1.0)",
    "{a}.mul_({b})",
    "{a}[{i}].mul_(2.0)",
    "{a}[1:].exp_()",
    "{a}[{i}].tanh_()",
    "{a}.t()[{j}].add_(1.0)",
    "{a}[{i}] = {c}",
    "{a}[0:2].relu_()",
    "F.leaky_relu({a}, 0.1, inplace=True)",
    "{c}.mul_({d})",
    "{c}.sigmoid_()",
]


class Program:
    """Random statements over the names ``x``/``y`` (leaves, (3, 4)), ``z`` (a leaf, (4,))
    and the values they make; rendered as the body of ``program(m, F, x, y, z, rec)``."""

    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.square = ["x", "y"]  # names of shape (3, 4)
        self.rows = ["z"]  # names of shape (4,)
        self.nonleaf = []  # names that hold non-leaf tensors
        self.lines = []
        n = self.rng.randint(*STATEMENTS)
        for _ in range(n):
            self.statement()
        self.lines.append(f"rec('values', [{', '.join(self.square + self.rows)}])")

    def pick(self, names):
        return self.rng.choice(names)

    def fill(self, template):
        r = self.rng
        return template.format(
            a=self.pick(self.square),
            b=self.pick(self.square),
            c=self.pick(self.rows),
            d=self.pick(self.rows),
            i=r.randint(0, 2),
            j=r.randint(0, 3),
        )

    def new(self, shape_list, expr):
        name = f"v{len(self.lines)}"
        self.lines.append(f"{name} = {expr}")
        shape_list.append(name)
        self.nonleaf.append(name)

    def targets(self):
        pool = ["x", "y", "z"] + self.nonleaf
        return self.rng.sample(pool, k=min(len(pool), self.rng.randint(1, 3)))

    def scalar(self):
        name = self.pick(self.square + self.rows)
        return self.rng.choice([f"{name}.sum()", f"({name} * {name}).sum()", f"{name}.exp().mean()"])

    def statement(self):
        r = self.rng
        kind = r.choices(["unary", "row", "view", "inplace", "grad", "backward"], [5, 2, 1, 4, 2, 2])[0]
        if kind == "unary":
            self.new(self.square, self.fill(r.choice(UNARY)))
        elif kind == "row":
            self.new(self.rows, self.fill(r.choice(TO_ROW)))
        elif kind == "view":
            self.new(self.square, self.fill(r.choice(SQUARE_VIEWS)))
        elif kind == "inplace":
            # mostly on non-leaves (on a leaf that requires grad both libraries refuse)
            template = r.choice(INPLACE)
            if template.startswith("{c}"):
                rows = [n for n in self.rows if n in self.nonleaf] or self.rows
                self.lines.append(template.format(c=r.choice(rows), d=self.pick(self.rows)))
            else:
                square = [n for n in self.square if n in self.nonleaf]
                if not square or r.random() < 0.05:
                    square = self.square
                self.lines.append(self.fill(template.replace("{a}", r.choice(square))))
        elif kind == "grad":
            targets = self.targets()
            create, retain = r.random() < 0.4, r.random() < 0.5
            name = f"g{len(self.lines)}"
            self.lines.append(
                f"{name} = m.autograd.grad({self.scalar()}, [{', '.join(targets)}], "
                f"retain_graph={retain}, create_graph={create}, allow_unused=True)"
            )
            self.lines.append(f"rec('grad', list({name}))")
            if create:  # the gradients have history: use one again
                k = r.randrange(len(targets))
                self.lines.append(f"if {name}[{k}] is not None and {name}[{k}].requires_grad:")
                self.lines.append(
                    f"    rec('grad', list(m.autograd.grad(({name}[{k}] * {name}[{k}]).sum(), [x, y, z], "
                    f"allow_unused=True, retain_graph={r.random() < 0.5})))"
                )
        else:
            create, retain = r.random() < 0.3, r.random() < 0.5
            self.lines.append(f"{self.scalar()}.backward(retain_graph={retain}, create_graph={create})")
            self.lines.append("rec('grad', [x.grad, y.grad, z.grad])")
            self.lines.append("x.grad = y.grad = z.grad = None")

    def source(self):
        body = []
        for k, line in enumerate(self.lines):
            if line.startswith("    "):
                body.append("    " + line)
            else:
                body.append(f"    step[0] = {k}")
                body.append("    " + line)
        return "def program(m, F, x, y, z, rec, step):\n" + "\n".join(body) + "\n"


def run(program: Program, m):
    """The values a program records (NumPy copies) and the statement it stopped at with
    its error's type, or None."""
    namespace = {}
    exec(compile(program.source(), "<oracle program>", "exec"), namespace)  # noqa: S102 - our own generated source
    rng = np.random.default_rng(0)
    leaves = [m.tensor(rng.uniform(-1.5, 1.5, s), dtype=m.float64, requires_grad=True) for s in ((3, 4), (3, 4), (4,))]
    records, step = [], [0]

    def rec(kind, values):
        records.append((kind, [None if v is None else v.detach().numpy().copy() for v in values]))

    try:
        with np.errstate(all="ignore"):
            namespace["program"](m, m.nn.functional, *leaves, rec, step)
    except RuntimeError as e:
        return records, (step[0], type(e).__name__)
    return records, None


def compare(ours, theirs, source):
    (got, got_err), (want, want_err) = ours, theirs
    assert got_err == want_err, f"errors differ: here {got_err}, PyTorch {want_err}\n{source}"
    assert len(got) == len(want), f"records differ in number\n{source}"
    for (kind, a), (_, b) in zip(got, want):
        assert len(a) == len(b), source
        for u, v in zip(a, b):
            assert (u is None) == (v is None), f"{kind}: None here {u is None}, in PyTorch {v is None}\n{source}"
            if u is not None:
                np.testing.assert_allclose(u, v, rtol=1e-9, atol=1e-12, equal_nan=True, err_msg=source)


@pytest.mark.parametrize("batch", range((PROGRAMS + BATCH - 1) // BATCH))
def test_random_programs_match_pytorch(batch, torch, record_property):
    seeds = range(batch * BATCH, min(PROGRAMS, (batch + 1) * BATCH))
    for seed in seeds:
        program = Program(seed)
        theirs = run(program, torch)
        for policy in POLICIES:
            fw.inplace.set_policy(policy)
            compare(run(program, fw), theirs, f"seed {seed}, policy {policy}:\n{program.source()}")
    record_property("oracle_programs", len(seeds))


def test_the_generator_reaches_every_kind_of_statement():
    text = "\n".join(Program(seed).source() for seed in range(60))
    for needle in (
        "create_graph=True",
        "retain_graph=False",
        ".backward(",
        "_()",
        "] = ",
        "[1:]",
        ".t()",
        "m.autograd.grad(",
    ):
        assert needle in text, needle
    stops = [run(Program(seed), fw)[1] for seed in range(60)]
    assert any(s is None for s in stops) and any(s is not None for s in stops)  # both outcomes occur
