"""The inplace tour (examples/inplace_tour.py and its two modules) keeps printing what the articles do.

Every row each scenario records on this framework is checked against the value or the
error it must show; where PyTorch is installed, the same scenarios run on it and every
row must agree with this framework's, except the differences the tour explains (which
must still be differences). The script itself runs end to end with ``--quick``; the
experiment's byte counts are checked exactly, its timings never.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import tracemalloc

import pytest

import framework as fw
from examples import inplace_tour as tour
from examples import tour_experiment as experiment
from examples import tour_scenarios as scenarios

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOUR = os.path.abspath(inspect.getsourcefile(tour))
SCENARIOS_FILE = os.path.abspath(inspect.getsourcefile(scenarios))

LEAF = "RuntimeError: a leaf Variable that requires grad is being used in an in-place operation ({})."
VIEW_OF_LEAF = "RuntimeError: a view of a leaf Variable that requires grad is being used in an in-place operation ({})."
VERSION = (
    "RuntimeError: one of the variables needed for gradient computation has been modified by an "
    "inplace operation: [float32 tensor of shape {shape}], which is {what}, is at version 1; "
    "expected version 0 instead. It was modified by {op} at {where} (version 1)."
)


def line_of(fn, statement: str, nth: int = 0) -> str:
    """``file:line`` of the ``nth`` line of ``fn`` that is ``statement`` (where an error must point)."""
    lines, first = inspect.getsourcelines(fn)
    hits = [first + i for i, line in enumerate(lines) if line.strip() == statement]
    assert len(hits) > nth, (statement, hits)
    return f"{SCENARIOS_FILE}:{hits[nth]}"


class StartsWith(str):
    """An expected error: the message must start with this text (hints may follow)."""


COS = "[0.8776, 0.5403, 0.0707]"  # cos([0.5, 1.0, 1.5])

EXPECTED = {
    "1.1": {"x._version before": "0", "y is x": "True", "x": "[2.0, 4.0, 6.0]", "x._version after": "1"},
    "1.2": {
        "a.mul_(2.0)": StartsWith(LEAF.format("mul_")),
        "a (unchanged)": "[1.0, 2.0, 3.0]",
        "a._version": "0",
        "a.is_leaf": "True",
    },
    "2.1": {"x.sin_()": StartsWith(LEAF.format("sin_")), "x (unchanged)": "[0.5, 1.0, 1.5]", "x._version": "0"},
    "2.2": {
        "y": "[1.4794, 1.8415, 1.9975]",
        "y._version": "1",
        "y.grad_fn": "AddBackward0",
        "x.grad": COS,
        "cos(x)": COS,
    },
    "2.3": {
        "bytes kept by h.sin_()": "12",
        "h.grad_fn": "SinBackward0",
        "x.grad": COS,
        "cos(x)": COS,
        "bytes kept by e.exp_()": "0",
        "bytes kept by r.relu_()": "0",
    },
    "3.1": {
        "b._version before": "0",
        "b._version after": "1",
        "b.is_leaf": "False",
        "b.grad_fn": "CopySlices",
        "b.sum().backward()": StartsWith(
            VERSION.format(
                shape="(3,)",
                what="the output of ExpBackward0",
                op="fill_",
                where=line_of(scenarios.version_counter, "b[0] = 1000"),
            )
        ),
    },
    "3.2": {
        "a[:] = 0": StartsWith(VIEW_OF_LEAF.format("fill_")),
        "a (unchanged)": "[1.0, 2.0, 3.0]",
        "a.is_leaf": "True",
        "a.grad_fn": "None",
        "a._version": "0",
    },
    "3.3": {"a.add_(10.)": StartsWith(LEAF.format("add_")), "a._version": "0"},
    "3.4": {
        "a.data.fill_(10.): a": "[10.0, 10.0, 10.0]",
        "a.data.fill_(10.): a._version": "0",
        "a.detach().fill_(11.): a": "[11.0, 11.0, 11.0]",
        "a.detach().fill_(11.): a._version": "1",
        "no_grad: a[:] = 12.: a": "[12.0, 12.0, 12.0]",
        "no_grad: a[:] = 12.: a._version": "2",
        "a.is_leaf, a.requires_grad": "(True, True)",
    },
    "3.5": {
        "a.data.fill_(0.): a._version": "0",
        "a.grad (cos(a) would be right)": "[1.0, 1.0, 1.0]",
        "b.detach().fill_(0.): b._version": "1",
        "z.sum().backward()": StartsWith(
            VERSION.format(
                shape="(3,)",
                what="input 'x' of SinBackward0",
                op="fill_",
                where=line_of(scenarios.data_is_unchecked, "b.detach().fill_(0.0)"),
            )
        ),
    },
    "3.6": {
        "after: f.sum().backward()": StartsWith(
            VERSION.format(
                shape="(1, 2)",
                what="input 'x' of MmBackward0",
                op="fill_",
                where=line_of(scenarios.write_before_or_after_use, "d[:] = 1", nth=0),
            )
        ),
        "d.grad_fn": "CopySlices",
        "before: f.sum().backward()": "no error",
        "w1.grad": "[[0.0, 0.0], [0.0, 0.0]]",
        "w2.grad": "[[1.0, 1.0], [1.0, 1.0]]",
    },
    "4.1": {"z is x": "False", "x.add_(y) is x": "True", "x == z after add_": "True"},
    "4.2": {
        "v.is_leaf": "False",
        "v.grad_fn": "MulBackward0",
        "w.grad (d loss / d w)": "[8.0, 10.0, 12.0]",
        "v.grad (d loss / d v)": "[4.0, 5.0, 6.0]",
    },
    "4.3": {
        "y.sum().backward()  (y = h + 1)": "no error",
        "x.grad": "[1.0, 1.0, 1.0]",
        "z.sum().backward()  (z = g * g)": StartsWith(
            VERSION.format(
                shape="(3,)",
                what="input 'x' of MulBackward0",
                op="add_",
                where=line_of(scenarios.error_only_when_read, "g.add_(5.0)"),
            )
        ),
    },
}


def test_every_scenario_is_checked():
    assert [sc.number for sc in scenarios.SCENARIOS] == list(EXPECTED)


@pytest.mark.parametrize("policy", fw.inplace.POLICIES)
@pytest.mark.parametrize("sc", scenarios.SCENARIOS, ids=lambda sc: sc.number)
def test_scenario_shows_what_it_must(sc, policy):
    # The scenarios' explicit inplace ops mean the same under every policy.
    fw.inplace.set_policy(policy)
    rows = sc.run(fw)
    expected = EXPECTED[sc.number]
    assert [key for key, _ in rows] == list(expected)
    for key, value in rows:
        want = expected[key]
        if isinstance(want, StartsWith):
            assert value.startswith(want), f"{sc.number} {key}:\n{value}\nmust start with\n{want}"
        else:
            assert value == want, f"{sc.number} {key}: {value} != {want}"


def test_differences_from_pytorch_are_the_ones_the_tour_explains(torch):
    for sc in scenarios.SCENARIOS:
        ours, theirs = sc.run(fw), sc.run(torch)
        assert tour.unexplained_differences(sc, ours, theirs) == [], sc.number


def test_comparable_keeps_what_must_agree():
    leaf = "RuntimeError: a leaf Variable that requires grad is being used in an in-place operation"
    assert tour.comparable(leaf + " (mul_). Wrap the update ...") == tour.comparable(leaf + ".")
    assert tour.comparable(leaf + ".") != tour.comparable("RuntimeError: a view of a leaf Variable ...")
    assert tour.comparable(leaf + ".") != tour.comparable("ValueError: a leaf Variable ...")
    assert tour.comparable("ExpBackward0") == tour.comparable("ExpBackward")
    assert tour.comparable("CopySlices") != tour.comparable("CopySlices(FillBackward)")
    assert tour.comparable("[1.0, 2.0]") != tour.comparable("[1.0, 2.5]")


def test_an_unexplained_difference_is_reported(capsys):
    sc = scenarios.SCENARIOS[0]
    ours = sc.run(fw)
    theirs = [(key, "something else") for key, _ in ours]
    problems = tour.print_scenario(sc, ours, theirs)
    assert len(problems) == len(ours)
    assert "UNEXPECTED: x._version before: framework and PyTorch differ" in capsys.readouterr().out


def test_printed_without_pytorch(capsys):
    sc = next(s for s in scenarios.SCENARIOS if s.number == "3.1")
    assert tour.print_scenario(sc, sc.run(fw)) == []
    out = capsys.readouterr().out
    assert "torch" not in out.replace("PyTorch", "")
    assert "  b._version after" in out and "why: ExpBackward0 saved its result b" in out


MB4 = 1000 * 1000 * 4
OBJECTS = 64 * 1024  # tracemalloc also sees the Python objects of the loop: far below this


def test_experiment_bytes_are_exact():
    n_ops = 3
    memory = experiment.measure_memory(1000, n_ops)
    assert not tracemalloc.is_tracing()  # started and stopped by the measurement
    inplace, dropped, kept, auto = (memory[v] for v in experiment.VARIANTS)
    assert (inplace["allocated"], inplace["peak"], inplace["live"]) == (0, 0, 0)
    assert 0 <= inplace["traced_peak"] < OBJECTS
    assert (dropped["allocated"], dropped["peak"], dropped["live"]) == (n_ops * MB4, MB4, 0)
    assert MB4 <= dropped["traced_peak"] < MB4 + OBJECTS
    assert (kept["allocated"], kept["peak"], kept["live"]) == (n_ops * MB4, n_ops * MB4, n_ops * MB4)
    assert n_ops * MB4 <= kept["traced_peak"] < n_ops * MB4 + OBJECTS
    # Policy auto runs the very code of `dropped` in place: x is dead at each step.
    assert (auto["allocated"], auto["peak"], auto["live"], auto["auto_ops"]) == (0, 0, 0, n_ops)
    assert dropped["auto_ops"] == inplace["auto_ops"] == kept["auto_ops"] == 0


def test_out_of_place_variants_stay_out_of_place_under_policy_auto():
    fw.inplace.set_policy("auto")
    memory = experiment.measure_memory(1000, 2)
    assert memory[experiment.DROPPED]["allocated"] == memory[experiment.KEPT]["allocated"] == 2 * MB4


def test_timings_and_faults_have_one_entry_per_repeat():
    seconds, faults = experiment.time_variants(fw, 10, 2, 2)
    assert list(seconds) == list(faults) == list(experiment.VARIANTS)
    assert all(len(s) == 2 and min(s) > 0 for s in seconds.values())
    assert all(len(f) == 2 and min(f) >= 0 for f in faults.values())


def test_timings_on_pytorch_have_its_variants(torch):
    seconds, faults = experiment.time_variants(torch, 10, 2, 1)
    assert list(seconds) == list(faults) == list(experiment.TORCH_VARIANTS)


def test_script_runs_end_to_end(tmp_path):
    chart = tmp_path / "charts" / "add.png"
    r = subprocess.run(
        [sys.executable, TOUR, "--quick", "--plot", str(chart)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    out = " ".join(r.stdout.split())  # the tour wraps long values
    for sc in scenarios.SCENARIOS:
        assert f"[{sc.number}] {sc.title}" in out
    assert "UNEXPECTED" not in out
    assert f"It was modified by fill_ at {line_of(scenarios.version_counter, 'b[0] = 1000')} (version 1)" in out
    assert "5. The measured experiment: 10 additions on a 1000x1000 float32 tensor (4.0 MB)" in out
    assert "x = x + y 40.0 4.0 4.0 0.0" in out  # allocated, peak (counter), peak (tracemalloc), live
    assert "Inplace saves allocation and memory bandwidth, not arithmetic." in out
    assert f"bar chart: {chart}" in out
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    try:
        import torch  # noqa: F401, PLC0415
    except ImportError:
        assert "this framework only (PyTorch is not installed" in out
    else:
        assert "(torch: same)" in out and "torch min" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--plot", "chart.svg"], "error: --plot must name a .png file, got 'chart.svg'"),
        (["--repeats", "3"], "error: unrecognized arguments: --repeats 3"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        tour.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


def test_unusable_plot_folder_exits_2(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert tour.main(["--plot", str(blocker / "sub" / "chart.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot make the folder of --plot")


def test_readme_and_docs_point_to_the_tour():
    for doc in ("README.md", os.path.join("docs", "INPLACE.md")):
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            assert "`python examples/inplace_tour.py`" in f.read(), doc
