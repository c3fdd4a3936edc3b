"""Figures: the memory timeline of one step, and the comparison of inplace policies.

A memory timeline is drawn against the position in the step, not against time: each
phase (forward, backward, optimizer) is scaled to one unit of width and its allocation
events are spread evenly over it, in order. Two runs of the same step then line up
phase by phase, and a slower run (or a busy machine) cannot stretch its curve and make
time look like memory.

Figures are ``matplotlib.figure.Figure`` objects with their own Agg canvas: nothing
goes through pyplot, so no global backend is chosen and nothing needs closing.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from .tables import MB

__all__ = ["plot_comparison", "plot_timeline", "timeline_positions"]

_PHASE_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868"}
_OTHER_COLORS = ("#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974", "#64b5cd")
_POSITION_LABEL = "position in the step (allocations in order; each phase scaled to one width)"


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


def plot_timeline(timeline, floor_bytes: int | None = None, title: str | None = None):
    """Draws allocated MB through one step, with phases shaded, the peak and the floor."""
    fig = _new_figure((8, 4))
    ax = fig.add_subplot()
    ax.set_xlabel(_POSITION_LABEL)
    ax.set_ylabel("allocated (MB)")
    ax.set_title(title or "memory timeline")
    x, mb, phases = timeline_positions(timeline)
    if not x:
        ax.text(0.5, 0.5, "no allocations recorded", ha="center", va="center", transform=ax.transAxes)
        return fig
    _shade_phases(ax, phases)
    ax.step(x + [len(phases)], mb + [mb[-1]], where="post", color="black", lw=1.2, label="allocated")
    peak = max(range(len(mb)), key=mb.__getitem__)
    events = list(_field(timeline, "events"))
    phase = events[peak][4] if len(events[peak]) > 4 else ""
    ax.plot([x[peak]], [mb[peak]], "o", color="crimson", ms=5)
    right_half = x[peak] > 0.6 * len(phases)
    ax.annotate(
        f"peak {mb[peak]:.1f} MB" + (f" ({phase})" if phase else ""),
        (x[peak], mb[peak]),
        xytext=(-6 if right_half else 6, 5),
        textcoords="offset points",
        ha="right" if right_half else "left",
        fontsize=8,
        color="crimson",
        bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.8},
    )
    if floor_bytes is not None:
        ax.axhline(floor_bytes / MB, color="gray", ls="--", lw=1, label=f"floor {floor_bytes / MB:.1f} MB")
    top = max(mb + ([floor_bytes / MB] if floor_bytes is not None else []))
    ax.set_ylim(0, top * 1.15 if top > 0 else 1.0)
    ax.legend(loc="lower right", fontsize=8)
    return fig


def plot_comparison(runs: Sequence[Mapping[str, Any]], title: str | None = None):
    """Draws peak and floor memory, throughput per round and the memory timelines.

    Args:
        runs: One mapping per policy, in order, with ``name``, ``peak_mb``, ``floor_mb``,
            ``samples_per_sec`` (a list: one value per timing round) and ``timeline``
            (or None).
        title: Figure title.

    Returns:
        A ``Figure``: peak beside floor per policy (labelled bars), each round's
        samples/s with the median, and every policy's timeline of one step against
        the position in the step.
    """
    import numpy as np  # noqa: PLC0415

    fig = _new_figure((12, 7.5))
    if title:
        fig.suptitle(title)
    grid = fig.add_gridspec(2, 2)
    names = [r["name"] for r in runs]
    where = np.arange(len(runs))

    ax = fig.add_subplot(grid[0, 0])
    width = 0.38
    peak = ax.bar(where - width / 2, [r["peak_mb"] for r in runs], width, color="tab:blue", label="peak")
    floor = ax.bar(
        where + width / 2,
        [r["floor_mb"] for r in runs],
        width,
        color="tab:gray",
        hatch="//",
        edgecolor="white",
        label="floor",
    )
    for bars in (peak, floor):
        ax.bar_label(bars, fmt="%.1f", fontsize=8, padding=2)
    ax.set_xticks(where, names)
    ax.set_ylabel("MB")
    ax.margins(y=0.15)
    ax.set_title("memory per training step: peak and floor")
    ax.legend(loc="lower right", fontsize=8)

    ax = fig.add_subplot(grid[0, 1])
    for i, r in enumerate(runs):
        samples = list(r["samples_per_sec"])
        if not samples:
            continue
        ax.plot([i] * len(samples), samples, "o", color="tab:green", alpha=0.6, ms=5)
        ax.hlines(statistics.median(samples), i - 0.3, i + 0.3, color="black", lw=2)
    ax.set_xticks(where, names)
    ax.set_xlim(-0.6, len(runs) - 0.4)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("samples / s")
    ax.set_title("throughput: one dot per timing round, bar = median")

    ax = fig.add_subplot(grid[1, :])
    phases: list[str] = []
    styles = itertools.cycle(["-", "--", ":", "-."])  # identical curves stay visible
    for r in runs:
        if r.get("timeline") is None:
            continue
        x, mb, run_phases = timeline_positions(r["timeline"])
        if x:
            phases = phases or run_phases
            ax.step(x + [len(run_phases)], mb + [mb[-1]], where="post", ls=next(styles), lw=1.4, label=r["name"])
    if phases:
        _shade_phases(ax, phases)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8, loc="lower right")
    ax.set_xlabel(_POSITION_LABEL)
    ax.set_ylabel("allocated MB")
    ax.set_title("memory timeline of one training step")
    return fig
