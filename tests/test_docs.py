"""docs/INPLACE.md's op table must say what each op's Function class declares."""

import os
import re

import pytest

import framework as fw
from framework.ops import elementwise as E

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CLASSES = {
    "relu_": E.Relu,
    "leaky_relu_": E.LeakyRelu,
    "exp_": E.Exp,
    "sqrt_": E.Sqrt,
    "tanh_": E.Tanh,
    "sigmoid_": E.Sigmoid,
    "neg_": E.Neg,
    "add_": E.Add,
    "sub_": E.Sub,
    "div_": E.Div,
    "mul_": E.Mul,
    "sin_": E.Sin,
    "cos_": E.Cos,
    "log_": E.Log,
    "abs_": E.Abs,
    "pow_": E.Pow,
    "clamp_": E.Clamp,
}


def table_rows():
    with open(os.path.join(ROOT, "docs", "INPLACE.md"), encoding="utf-8") as f:
        text = f.read()
    block = text.split("<!-- inplace-table:start -->")[1].split("<!-- inplace-table:end -->")[0]
    rows = {}
    for line in block.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        for name in re.findall(r"`(\w+)`", cells[0]):
            rows[name] = cells
    return rows


def test_every_inplace_op_is_in_the_table():
    assert set(CLASSES) <= set(table_rows())


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_reads_column_matches_the_declared_saves(name):
    cells = table_rows()[name]
    declared = CLASSES[name].saves
    reads = re.sub(r"\(.*?\)", "", cells[1]).strip()
    listed = () if reads == "nothing" else tuple(r.strip() for r in reads.split(","))
    assert listed == declared, f"{name}: docs say {listed}, the op saves {declared}"
    overwritten_is_saved = "x" in declared
    free = cells[2].startswith("free")
    assert free == (not overwritten_is_saved) or name == "mul_", name


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_cost_column_matches_what_the_op_does(name):
    cost = table_rows()[name][2]
    x = fw.randn(64, requires_grad=True) * 1  # a non-leaf autograd lets us overwrite
    before = fw.memory.stats().get("inplace_copy_bytes", 0)
    args = {
        "mul_": (fw.randn(64, requires_grad=True),),
        "add_": (1.0,),
        "sub_": (1.0,),
        "div_": (2.0,),
        "pow_": (2.0,),
        "clamp_": (-0.5, 0.5),
    }.get(name, ())
    if name in ("sqrt_", "log_", "pow_"):
        x = x.abs() + 1
    getattr(x, name)(*args)
    copied = fw.memory.stats().get("inplace_copy_bytes", 0) - before
    assert (copied > 0) == ("copy of x" in cost and not cost.startswith("free ")) or name == "mul_"
    if name == "mul_":
        assert copied == x.nbytes  # by a tensor that needs a gradient: a copy of x
