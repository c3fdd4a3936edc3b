"""The docs hold: docs/INPLACE.md's op table says what each op's Function class declares,
and every command in the README and docs/ runs as written."""

import os
import re
import subprocess
import sys

import pytest

import framework as fw
from framework.ops import elementwise as E
from framework.ops import masking as M

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CLASSES = {
    "relu_": E.Relu,
    "leaky_relu_": E.LeakyReluInplace,
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
    "masked_fill_": M.MaskedFill,
    "tril_": M.Tril,
    "triu_": M.Triu,
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
    assert free == (not overwritten_is_saved) or name in ("mul_", "div_"), name  # x only for y's gradient


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
    if name in ("tril_", "triu_"):
        x = x.reshape(8, 8)
    if name == "masked_fill_":
        args = (x.detach() > 0, 0.0)
    getattr(x, name)(*args)
    copied = fw.memory.stats().get("inplace_copy_bytes", 0) - before
    assert (copied > 0) == ("copy of x" in cost and not cost.startswith("free ")) or name == "mul_"
    if name == "mul_":
        assert copied == x.nbytes  # by a tensor that needs a gradient: a copy of x


# --------------------------------------------------------------------- commands in the docs

DOCS = ["README.md"] + sorted(
    os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")
)
# The history records commands as they were run then; the current docs must run now.
HISTORY = {os.path.join("docs", "BENCHMARKS-HISTORY.md")}


def doc_commands():
    """``(doc, command)``: each ``python ...`` command of the docs' bash blocks and inline
    code, one per ``&&``-separated part, with what comes before ``python`` (environment
    variables, ``mpiexec -n 2``) left out."""
    found = []
    for doc in DOCS:
        if doc in HISTORY:
            continue
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            text = f.read()
        spans = [line for block in re.findall(r"```bash\n(.*?)```", text, re.S) for line in block.splitlines()]
        spans += re.findall(r"`([^`\n]*\bpython [^`\n]*)`", re.sub(r"```.*?```", "", text, flags=re.S))
        for span in spans:
            for part in span.split("&&"):
                part = part.split("#")[0].strip()
                m = re.search(r"(?:^|\s)python (\S.*)$", part)
                if m and "..." not in part and "<" not in part and "your_tests" not in part:
                    found.append((doc, m.group(1).strip()))
    return sorted(set(found))


def _help(target):
    r = subprocess.run(
        [sys.executable, *target, "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


_helps: dict = {}


def test_the_docs_have_commands():
    docs = {doc for doc, _ in doc_commands()}
    assert {"README.md", "docs/USAGE.md", "docs/BENCHMARKS.md", "docs/GPU.md"} <= docs


@pytest.mark.parametrize("doc, command", doc_commands())
def test_every_command_in_the_docs_runs_as_written(doc, command):
    """The script or module exists, takes every option the command gives it, and the
    config the command names loads with its overrides (the jobs themselves are not run:
    the tests of each script run them)."""
    import shlex

    words = shlex.split(command)
    if words[:2] == ["-m", "pytest"]:
        return
    if words[0] == "-m":
        target, args = words[:2], words[2:]
        path = os.path.join(ROOT, *words[1].split(".")) + ".py"
    else:
        target, args = words[:1], words[1:]
        path = os.path.join(ROOT, words[0])
    rel = os.path.relpath(path, ROOT)
    assert os.path.isfile(path), f"{doc}: {command}: no {rel}"
    options = [word.split("=")[0] for word in args if word.startswith("--")]
    if options:
        key = tuple(target)
        if key not in _helps:
            _helps[key] = _help(target)
        for option in options:
            assert option in _helps[key], f"{doc}: {command}: {rel} has no option {option}"
    if "--config" in args:
        from trainers.config import load_config

        config = args[args.index("--config") + 1]
        overrides = [args[i + 1] for i, w in enumerate(args) if w == "--set"]
        load_config(os.path.join(ROOT, config), overrides)
    if "--policies" in args:
        sys.path.insert(0, os.path.join(ROOT, "scripts"))
        try:
            from compare_inplace import parse_policies
        finally:
            sys.path.pop(0)
        parse_policies(args[args.index("--policies") + 1])
