"""Figures: the memory timeline of one step, and the comparison of inplace policies.

A memory timeline is drawn against the position in the step, not against time: each
phase (forward, backward, optimizer) is scaled to one unit of width and its allocation
events are spread evenly over it, in order. Two runs of the same step then line up
phase by phase, and a slower run (or a busy machine) cannot stretch its curve and make
time look like memory.

Figures are ``matplotlib.figure.Figure`` objects with their own Agg canvas: nothing
goes through pyplot, so no global backend is chosen and nothing needs closing.

The timeline of one step is also TensorBoard's ``memory/timeline`` image, which
TensorBoard scales to the width of a card (a grid of columns at least 335 pixels wide):
it is drawn at 480 x 320 pixels with 10-point text, so that it reads at that size.

Each policy keeps one colour, line style and marker in every figure (:func:`policy_style`):
``off``, the reference, is black and solid; curves that are equal (``off`` and ``auto``
compute the same numbers) stay visible, one dashed over the other.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from .tables import MB

__all__ = ["plot_comparison", "plot_timeline", "policy_style", "timeline_positions"]

_PHASE_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868"}
_OTHER_COLORS = ("#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974", "#64b5cd")
_POSITION_LABEL = "position in the step (allocations in order; each phase scaled to one width)"
_TIMELINE_SIZE = (4.8, 3.2)  # inches at 100 dpi: 480 x 320 pixels, TensorBoard's card width or a little more
_TIMELINE_FONT = 10

# One look per policy (colours told apart by people with any common colour blindness:
# Okabe and Ito's palette); a policy not listed takes the next of _SPARE_STYLES.
_POLICY_STYLES = {
    "off": ("#000000", "-", "o"),
    "auto": ("#0072b2", "--", "s"),
    "on": ("#e69f00", "-.", "^"),
    "on+abn": ("#009e73", ":", "D"),
    "off+abn": ("#56b4e9", ":", "v"),
    "auto+abn": ("#cc79a7", ":", "P"),
    "compiled": ("#d55e00", (0, (5, 1, 1, 1)), "X"),
}
_SPARE_STYLES = (("#999999", "-", "*"), ("#f0e442", "--", "h"), ("#8c564b", "-.", "p"))


def policy_style(names: Sequence[str]) -> dict[str, tuple]:
    """``name -> (colour, line style, marker)`` for the policies drawn together, each one distinct."""
    spare = iter(_SPARE_STYLES * (1 + len(names) // len(_SPARE_STYLES)))
    return {name: _POLICY_STYLES.get(name) or next(spare) for name in names}


def _field(obj, name: str):
    if isinstance(obj, Mapping):
        return obj.get(name, [])
    return getattr(obj, name, [])


def timeline_positions(timeline) -> tuple[list[float], list[float], list[str]]:
    """Places a timeline's events at their position in the step.

    Args:
        timeline: ``framework.memory.Timeline`` or a dict with ``events`` (tuples
            ``(seconds, allocated_bytes, delta_bytes, category, phase)``) and ``marks``
            (tuples ``(seconds, phase)``).

    Returns:
        ``(x, allocated_mb, phases)``: phase ``i`` of ``phases`` spans ``[i, i + 1)``
        and holds its ``n`` events at ``i, i + 1/n, ...``; events before the first
        phase mark (the baseline) count as the first phase's.
    """
    events = list(_field(timeline, "events"))
    marks = sorted(_field(timeline, "marks"), key=lambda m: m[0])
    phases: list[str] = []
    for phase in [m[1] for m in marks] + [e[4] if len(e) > 4 else "" for e in events]:
        if phase and phase not in phases:
            phases.append(phase)
    if not phases:
        phases = [""]
    of_event = [(e[4] if len(e) > 4 and e[4] else phases[0]) for e in events]
    counts = {p: of_event.count(p) for p in phases}
    seen = dict.fromkeys(phases, 0)
    x = []
    for phase in of_event:
        i = phases.index(phase)
        x.append(i + seen[phase] / counts[phase])
        seen[phase] += 1
    return x, [e[1] / MB for e in events], phases


def _shade_phases(ax, phases: Sequence[str]) -> None:
    colors = dict(_PHASE_COLORS)
    spare = itertools.cycle(_OTHER_COLORS)
    for i, phase in enumerate(phases):
        if phase:
            ax.axvspan(i, i + 1, color=colors.setdefault(phase, next(spare)), alpha=0.12, lw=0)
    ax.set_xticks([i + 0.5 for i in range(len(phases))], [p or "step" for p in phases])
    ax.set_xlim(0, len(phases))


def _new_figure(size):
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415

    fig = Figure(figsize=size, dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def plot_timeline(timeline, floor_bytes: int | None = None, title: str | None = None, top_mb: float | None = None):
    """Draws allocated MB through one step, with phases shaded, the peak and the floor.

    Args:
        timeline: What :func:`timeline_positions` takes.
        floor_bytes: The step's floor, drawn as a dashed line.
        title: The figure's title.
        top_mb: The top of the MB axis: give every run of an experiment the same (their
            highest peak) so that their images compare at a glance; None: this one's own.
    """
    fig = _new_figure(_TIMELINE_SIZE)
    ax = fig.add_subplot()
    ax.tick_params(labelsize=_TIMELINE_FONT - 1)
    ax.set_xlabel("position in the step (each phase one width)", fontsize=_TIMELINE_FONT - 1)
    ax.set_ylabel("allocated MB", fontsize=_TIMELINE_FONT)
    ax.set_title(title or "memory timeline", fontsize=_TIMELINE_FONT + 1)
    x, mb, phases = timeline_positions(timeline)
    if not x:
        ax.text(0.5, 0.5, "no allocations recorded", ha="center", va="center", transform=ax.transAxes)
        return fig
    _shade_phases(ax, phases)
    ax.step(x + [len(phases)], mb + [mb[-1]], where="post", color="black", lw=1.4)
    peak = max(range(len(mb)), key=mb.__getitem__)
    ax.plot([x[peak]], [mb[peak]], "o", color="crimson", ms=5)
    right_half = x[peak] > 0.6 * len(phases)
    ax.annotate(
        f"peak {mb[peak]:.1f}",
        (x[peak], mb[peak]),
        xytext=(-6 if right_half else 6, 4),
        textcoords="offset points",
        ha="right" if right_half else "left",
        va="bottom",
        fontsize=_TIMELINE_FONT,
        color="crimson",
        bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85},
    )
    own_top = max(mb + ([floor_bytes / MB] if floor_bytes is not None else []))
    top = max(top_mb or 0.0, own_top)
    if floor_bytes is not None:
        floor = floor_bytes / MB
        ax.axhline(floor, color="dimgray", ls="--", lw=1.2)
        ax.text(
            0.01 * len(phases),
            floor,
            f"floor {floor:.1f}",
            fontsize=_TIMELINE_FONT - 1,
            color="dimgray",
            va="bottom",
            ha="left",
        )
    ax.set_ylim(0, top * 1.2 if top > 0 else 1.0)
    return fig


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points ``(samples/s, peak MB)`` no other point beats on both (as fast
    or faster AND as low or lower, better in one), by rising speed: the levers worth taking."""
    front = [
        i
        for i, (speed, peak) in enumerate(points)
        if not any(s >= speed and p <= peak and (s > speed or p < peak) for s, p in points)
    ]
    return sorted(front, key=lambda i: points[i][0])


def _pareto(ax, runs, styles) -> None:
    """Peak memory against throughput, a point per variant (its median over the timing
    rounds, a bar over their range); the variants no other beats on both joined by a line."""
    points, fastest = [], 0.0
    for r in runs:
        samples = list(r["samples_per_sec"])
        if not samples:
            continue
        speed = statistics.median(samples)
        color, _, marker = styles[r["name"]]
        ax.errorbar(
            speed,
            r["peak_mb"],
            xerr=[[speed - min(samples)], [max(samples) - speed]],
            fmt=marker,
            color=color,
            ms=8,
            capsize=3,
            label=r["name"],
        )
        ax.annotate(r["name"], (speed, r["peak_mb"]), textcoords="offset points", xytext=(6, 6), fontsize=8)
        points.append((speed, r["peak_mb"]))
        fastest = max(fastest, max(samples))
    front = pareto_front(points)
    if len(front) > 1:
        ax.plot([points[i][0] for i in front], [points[i][1] for i in front], color="gray", ls=":", lw=1)
    # From 0 (the trade-off reads in proportions), with room right of the fastest round and
    # above the highest peak for a marker and its name
    highest = max((p for _, p in points), default=0.0)
    ax.set_xlim(0, fastest * 1.2 if fastest > 0 else 1.0)
    ax.set_ylim(0, highest * 1.2 if highest > 0 else 1.0)
    ax.set_xlabel("samples / s (median of the timing rounds; bar: their range)")
    ax.set_ylabel("peak MB")
    ax.set_title("peak against throughput (dotted: the Pareto front)")


def plot_comparison(runs: Sequence[Mapping[str, Any]], title: str | None = None):
    """Draws peak and floor memory, throughput per round and the memory timelines.

    Args:
        runs: One mapping per policy, in order, with ``name``, ``peak_mb``, ``floor_mb``,
            ``samples_per_sec`` (a list: one value per timing round) and ``timeline``
            (or None).
        title: Figure title.

    Returns:
        A ``Figure``: peak beside floor per policy (labelled bars), peak against samples/s
        (a point per policy: the Pareto view of the levers), and every policy's timeline
        of one step against the position in the step.
    """
    import numpy as np  # noqa: PLC0415

    fig = _new_figure((12, 7.5))
    if title:
        fig.suptitle(title)
    grid = fig.add_gridspec(2, 2)
    names = [r["name"] for r in runs]
    styles = policy_style(names)
    colors = [styles[n][0] for n in names]
    where = np.arange(len(runs))

    ax = fig.add_subplot(grid[0, 0])
    width = 0.38
    peak = ax.bar(where - width / 2, [r["peak_mb"] for r in runs], width, color=colors, label="peak")
    floor = ax.bar(
        where + width / 2,
        [r["floor_mb"] for r in runs],
        width,
        color=colors,
        alpha=0.45,
        hatch="//",
        edgecolor="white",
        label="floor (hatched)",
    )
    for bars in (peak, floor):
        ax.bar_label(bars, fmt="%.1f", fontsize=8, padding=2)
    ax.set_xticks(where, names)
    ax.set_ylabel("MB")
    ax.margins(y=0.15)
    ax.set_title("memory per training step: peak and floor (hatched)")

    _pareto(fig.add_subplot(grid[0, 1]), runs, styles)

    ax = fig.add_subplot(grid[1, :])
    phases: list[str] = []
    for r in runs:
        if r.get("timeline") is None:
            continue
        x, mb, run_phases = timeline_positions(r["timeline"])
        if x:
            phases = phases or run_phases
            color, line, marker = styles[r["name"]]
            xs, ys = x + [len(run_phases)], mb + [mb[-1]]
            # Markers at a few points, offset per policy: equal curves still show each one.
            offset = names.index(r["name"]) * max(1, len(xs) // (12 * len(names)))
            every = (offset % max(len(xs), 1), max(1, len(xs) // 12))
            ax.step(
                xs,
                ys,
                where="post",
                color=color,
                ls=line,
                lw=1.5,
                marker=marker,
                ms=5,
                markevery=every,
                label=r["name"],
            )
    if phases:
        _shade_phases(ax, phases)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=9, loc="upper right")
    ax.set_xlabel(_POSITION_LABEL)
    ax.set_ylabel("allocated MB")
    ax.set_title("memory timeline of one training step")
    return fig
