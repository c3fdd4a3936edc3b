"""The inplace tour: every scenario of the well-known inplace articles, run and explained.

    python examples/inplace_tour.py [--quick] [--plot PATH] [--no-torch]

Most people learned inplace from a few widely read articles: Paddle's introduction to
inplace, a Paddle article on inplace memory and speed, and a PyTorch article on leaves
and version counters. This tour runs each of their scenarios on this framework, prints
what happens (values, ``_version``, ``is_leaf``, ``grad_fn``, the error) with a one-line
reason, corrects the articles where they are wrong (``examples/tour_scenarios.py``), and
measures their experiment (``examples/tour_experiment.py``, with a bar chart).

Where PyTorch is installed (``pip install torch==2.13.0``) every scenario runs on it too
and both results are printed side by side. A difference the scenario does not explain is
printed as UNEXPECTED and the tour exits with status 1, so the tour cannot silently go
stale.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from anywhere, without installing the project
    sys.path.insert(0, ROOT)

import framework as fw  # noqa: E402
from examples.tour_experiment import (  # noqa: E402
    AUTO,
    DROPPED,
    IN_PLACE,
    KEPT,
    TORCH_VARIANTS,
    VARIANT_NOTES,
    VARIANTS,
    experiment,
)
from examples.tour_scenarios import CHAPTERS, SCENARIOS, Scenario  # noqa: E402

DEFAULT_PLOT = os.path.join("runs", "tour", "inplace_add.png")  # runs/ is not committed


# --- comparing and printing ------------------------------------------------------------------

_BACKWARD_NUMBER = re.compile(r"(Backward)\d+")


def comparable(value: str) -> str:
    """What must agree between the libraries: an error's type and first clause, grad_fn
    names without PyTorch's overload number (``ExpBackward0``), every other value exactly."""
    m = re.match(r"(\w+(Error|Exception)): (.*)", value, re.S)
    if m:
        return m.group(1) + ": " + re.split(r"[:(.]", m.group(3), maxsplit=1)[0].strip()
    return _BACKWARD_NUMBER.sub(r"\1", value)


def unexplained_differences(sc: Scenario, ours, theirs) -> list[str]:
    """Rows where the libraries differ and the scenario does not say why, and rows it says
    differ that no longer do (the explanation would be stale)."""
    if [key for key, _ in ours] != [key for key, _ in theirs]:
        return ["the two runs recorded different rows"]
    problems = []
    for (key, a), (_, b) in zip(ours, theirs):
        differ = comparable(a) != comparable(b)
        if differ and key not in sc.differs:
            problems.append(f"{key}: framework and PyTorch differ and the tour does not say why")
        if not differ and key in sc.differs:
            problems.append(f"{key}: the tour explains a difference that is gone")
    return problems


WIDTH = 100
KEY_WIDTH = 38
SHORT = 28


def _wrapped(prefix: str, text: str, indent: int) -> str:
    return textwrap.fill(
        text,
        WIDTH,
        initial_indent=prefix,
        subsequent_indent=" " * indent,
        break_long_words=False,
        break_on_hyphens=False,
    )


def print_scenario(sc: Scenario, ours, theirs=None) -> list[str]:
    """Prints one scenario; returns the unexplained differences."""
    print(f"\n[{sc.number}] {sc.title}   ({sc.source})")
    for i, (key, a) in enumerate(ours):
        b = theirs[i][1] if theirs is not None else None
        label = f"  {key:<{KEY_WIDTH}} "
        if b is None:
            print(_wrapped(label, a, len(label)))
        elif a == b:
            print(_wrapped(label, f"{a}   (torch: same)", len(label)))
        elif len(a) <= SHORT and len(b) <= SHORT:
            print(f"{label}{a:<{SHORT}} | torch: {b}")
        else:
            print(f"  {key}")
            print(_wrapped("      framework: ", a, 17))
            print(_wrapped("      torch:     ", b, 17))
    print(_wrapped("  why: ", sc.why, 7))
    if sc.more:
        print(_wrapped("  framework says more: ", sc.more, 7))
    problems = []
    if theirs is not None:
        for key, reason in sc.differs.items():
            print(_wrapped(f"  differs by design ({key}): ", reason, 7))
        problems = unexplained_differences(sc, ours, theirs)
        for p in problems:
            print(f"  UNEXPECTED: {p}")
    return problems


# --- 5. printing the experiment ------------------------------------------------------------


def _mb(nbytes) -> str:
    return f"{nbytes / 1e6:.1f}"


def _ms(seconds, reduce) -> str:
    return f"{reduce(seconds) * 1e3:.1f}" if seconds else "-"


def print_experiment(times, faults, memory, size, n_ops, repeats) -> None:
    print(
        f"\n5. The measured experiment: {n_ops} additions on a {size}x{size} float32 tensor "
        f"({size * size * 4 / 1e6:.1f} MB), {repeats} repeat(s), the variants alternating"
    )
    libs = list(times)
    print(f"\n  time of {n_ops} ops (ms) and page faults (median over the repeats)")
    print(f"  {'variant':<24}" + "".join(f"{lib + ' min':>16}{'median':>8}{'faults':>8}" for lib in libs))
    for v in VARIANTS:
        cells = [
            f"{_ms(times[lib].get(v), min):>16}{_ms(times[lib].get(v), statistics.median):>8}"
            f"{statistics.median(faults[lib][v]) if v in faults[lib] else '-':>8}"
            for lib in libs
        ]
        print(f"  {v:<24}" + "".join(cells))
    print("\n  memory on the framework (MB; tracemalloc also counts a few KB of Python objects)")
    print(f"  {'variant':<24}{'allocated':>12}{'peak (counter)':>17}{'peak (tracemalloc)':>21}{'live after':>13}")
    for v in VARIANTS:
        m = memory[v]
        print(f"  {v:<24}{_mb(m['allocated']):>12}{_mb(m['peak']):>17}{_mb(m['traced_peak']):>21}{_mb(m['live']):>13}")
    print()
    for v in VARIANTS:
        print(f"  {v:<24}{VARIANT_NOTES[v]}")
    if "torch" in times:
        print("  PyTorch's CPU allocator does not report to tracemalloc: its memory is not measured here.")
    med = {v: statistics.median(times["framework"][v]) for v in VARIANTS}
    print(
        _wrapped(
            "  what it shows: ",
            f"every variant does the same {n_ops} x {size * size:,} float32 additions, so inplace does not "
            f"lower the arithmetic. add_ allocates nothing ({_mb(memory[IN_PLACE]['allocated'])} MB) and peaks "
            f"at {_mb(memory[IN_PLACE]['peak'])} MB above the start. `x = x + y` allocates "
            f"{_mb(memory[DROPPED]['allocated'])} MB in all but peaks at one extra tensor "
            f"({_mb(memory[DROPPED]['peak'])} MB), since each result frees the previous one, and takes "
            f"{med[DROPPED] / med[IN_PLACE]:.1f}x add_'s time (the allocator hands the freed buffer back: two "
            f"buffers take turns). Keeping every result peaks at {_mb(memory[KEPT]['peak'])} MB and takes "
            f"{med[KEPT] / med[IN_PLACE]:.1f}x the time: each result is fresh memory the OS must map, and the "
            f"data no longer stays in the caches ({statistics.median(faults['framework'][KEPT])} page faults "
            f"against {statistics.median(faults['framework'][IN_PLACE])} for add_). "
            "Under policy auto the same `x = x + y` ran "
            f"{memory[AUTO]['auto_ops']} of {n_ops} additions in place ({_mb(memory[AUTO]['allocated'])} MB "
            f"allocated, {med[AUTO] / med[IN_PLACE]:.1f}x add_'s time). Inplace saves allocation and memory "
            "bandwidth, not arithmetic.",
            17,
        )
    )
    if "torch" in times:
        t_med = {v: statistics.median(times["torch"][v]) for v in TORCH_VARIANTS}
        print(
            _wrapped(
                "  on PyTorch: ",
                f"`x = x + y` takes {t_med[DROPPED] / t_med[IN_PLACE]:.1f}x add_'s time with "
                f"{statistics.median(faults['torch'][DROPPED])} page faults (against "
                f"{statistics.median(faults['framework'][DROPPED])} on the framework): its results land on fresh "
                "pages where NumPy reused the freed buffer; keeping every result takes "
                f"{t_med[KEPT] / t_med[IN_PLACE]:.1f}x add_'s time.",
                14,
            )
        )


def plot_experiment(times, memory, size, n_ops, path) -> None:
    """Bar chart: time per variant and library (median, min marked), and memory per variant."""
    import matplotlib  # noqa: PLC0415  (only this chapter needs it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 4.8))
    libs = list(times)
    width = 0.8 / len(libs)
    for i, lib in enumerate(libs):
        ks = [k for k, v in enumerate(VARIANTS) if v in times[lib]]
        xs = [k + (i - (len(libs) - 1) / 2) * width for k in ks]
        med = [statistics.median(times[lib][VARIANTS[k]]) * 1e3 for k in ks]
        low = [min(times[lib][VARIANTS[k]]) * 1e3 for k in ks]
        ax_t.bar(xs, med, width, label=f"{lib} (median)")
        ax_t.plot(xs, low, "k_", markersize=14, label="min" if i == 0 else None)
        for x, m in zip(xs, med):
            ax_t.annotate(f"{m:.0f}", (x, m), ha="center", va="bottom", fontsize=8)
    ax_t.set_xticks(range(len(VARIANTS)), VARIANTS, fontsize=8)
    ax_t.set_ylabel(f"ms for {n_ops} ops")
    ax_t.set_title(f"time: {n_ops} additions on {size}x{size} float32")
    ax_t.legend(fontsize=8)
    series = (
        ("allocated", "allocated in all"),
        ("peak", "peak (framework counter)"),
        ("traced_peak", "peak (tracemalloc)"),
    )
    width = 0.8 / len(series)
    for i, (field, label) in enumerate(series):
        xs = [k + (i - 1) * width for k in range(len(VARIANTS))]
        values = [memory[v][field] / 1e6 for v in VARIANTS]
        ax_m.bar(xs, values, width, label=label)
        for x, m in zip(xs, values):
            ax_m.annotate(f"{m:.0f}", (x, m), ha="center", va="bottom", fontsize=8)
    ax_m.set_xticks(range(len(VARIANTS)), VARIANTS, fontsize=8)
    ax_m.set_ylabel("MB above the start")
    ax_m.set_title("memory on the framework")
    ax_m.legend(fontsize=8)
    fig.suptitle("the same arithmetic: inplace saves allocation and memory traffic")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- the tour ---------------------------------------------------------------------------------


def import_torch():
    """PyTorch if it is installed, else None."""
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return None
    return torch


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Run every scenario of the well-known inplace articles.")
    parser.add_argument(
        "--quick", action="store_true", help="a short experiment (10 ops, 1 repeat) instead of 100 ops x 5 repeats"
    )
    parser.add_argument(
        "--plot",
        default=DEFAULT_PLOT,
        metavar="PATH",
        help=f"where to save the experiment's bar chart (.png; default {DEFAULT_PLOT})",
    )
    parser.add_argument("--no-torch", action="store_true", help="do not run the scenarios on PyTorch")
    args = parser.parse_args(argv)
    if not args.plot.lower().endswith(".png"):
        parser.error(f"--plot must name a .png file, got {args.plot!r}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:  # a bad --plot fails now, not after the whole tour ran
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
    except OSError as e:
        print(f"error: cannot make the folder of --plot {args.plot!r}: {e.strerror}", file=sys.stderr)
        return 2
    torch = None if args.no_torch else import_torch()
    if torch is not None:
        print(f"The inplace tour: this framework side by side with PyTorch {torch.__version__}")
    else:
        print("The inplace tour: this framework only (PyTorch is not installed or --no-torch was given)")
    problems = []
    chapter = None
    for sc in SCENARIOS:
        if sc.number.split(".")[0] != chapter:
            chapter = sc.number.split(".")[0]
            print(f"\n{chapter}. {CHAPTERS[chapter]}")
        ours = sc.run(fw)
        theirs = sc.run(torch) if torch is not None else None
        problems += print_scenario(sc, ours, theirs)
    size, n_ops, repeats = (1000, 10, 1) if args.quick else (1000, 100, 5)
    times, faults, memory = experiment(size, n_ops, repeats, torch)
    print_experiment(times, faults, memory, size, n_ops, repeats)
    try:
        plot_experiment(times, memory, size, n_ops, args.plot)
    except OSError as e:
        print(f"error: cannot write the bar chart to {args.plot!r}: {e.strerror}", file=sys.stderr)
        return 2
    print(f"\n  bar chart: {args.plot}")
    if problems:
        print(f"\n{len(problems)} UNEXPECTED difference(s) from PyTorch: see above")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
