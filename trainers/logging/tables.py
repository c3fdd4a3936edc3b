"""Plain-text tables of run results, with numbers formatted by what their key names.

``format_summary`` prints the table ``scripts/train.py`` and ``scripts/compare_inplace.py``
end with; ``format_value`` formats one value (also in the progress display).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MB", "format_summary", "format_value"]

MB = 2**20
"""Bytes per "MB" in every ``*_mb`` tag and table (MiB, as CUDA and PyTorch report)."""


def _kind(key: str) -> str:
    k = key.lower().replace(" ", "_").replace("-", "_")
    if k.endswith(("_pct", "_percent", "%")):
        return "pct"
    if "accuracy" in k or k.endswith(("/acc", "_acc")) or k == "acc":
        return "fraction"
    if k.endswith(("_mb", "/mb")) or k == "mb":
        return "mb"
    if "per_sec" in k or k.endswith(("/s", "_rate", "_per_s")):
        return "rate"
    if "loss" in k:
        return "loss"
    if k.endswith(("_ms", "/ms")):
        return "ms"
    if k.endswith(("ratio", "_x")):
        return "ratio"
    return ""


def format_value(key: str, value) -> str:
    """Formats a number by what its key names (spaces count as ``_``: "peak MB").

    ``*_mb`` and rates (``*per_sec*``, ``*/s``): 1 decimal; ``*loss*``: 4 significant
    digits; ``*_pct``: a percentage already in percent; ``*accuracy*``: a fraction shown
    in percent; ``*_ms``: 2 decimals; ``*ratio``: ``1.23x``; ints as ints; other
    floats with 4 significant digits; None as ``-``.
    """
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return str(value)
    if isinstance(value, numbers.Integral) and _kind(key) not in ("fraction", "ratio"):
        return str(int(value))
    value = float(value)
    if not math.isfinite(value):
        return str(value)
    kind = _kind(key)
    if kind == "pct":
        return f"{value:.1f}%"
    if kind == "fraction":
        return f"{value * 100:.2f}%"
    if kind in ("mb", "rate"):
        return f"{value:.1f}"
    if kind == "ms":
        return f"{value:.2f}"
    if kind == "ratio":
        return f"{value:.2f}x"
    return f"{value:.4g}"


def format_summary(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[tuple[str, str]],
    legend: Sequence[tuple[str, str]] = (),
) -> str:
    """Renders rows as a plain-text table with aligned columns, then its legend.

    Args:
        rows: One mapping per row; a missing key shows ``-``.
        columns: ``(key, header)`` pairs, in order. Values are formatted by
            :func:`format_value` from the key; a column whose values are all numbers
            is right-aligned, any other column left-aligned.
        legend: ``(headers, meaning)`` pairs: what the columns that are not obvious
            mean, one line each, ``headers: meaning``. ``headers`` names one or more
            columns (``"saved MB, saved %"``); a line whose first column is not in the
            table is left out.

    Returns:
        Header, a rule of dashes, one line per row, then the legend's lines, without
        trailing spaces.
    """
    cells = [[format_value(key, row.get(key)) for key, _ in columns] for row in rows]
    widths, right = [], []
    for j, (key, header) in enumerate(columns):
        widths.append(max([len(header)] + [len(r[j]) for r in cells]))
        present = [row.get(key) for row in rows if row.get(key) is not None]
        right.append(bool(present) and all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in present))

    def line(texts):
        parts = [t.rjust(w) if r else t.ljust(w) for t, w, r in zip(texts, widths, right)]
        return "  ".join(parts).rstrip()

    out = [line([h for _, h in columns]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    headers = {h for _, h in columns}
    out += [f"{names}: {meaning}" for names, meaning in legend if names.split(", ")[0] in headers]
    return "\n".join(out)
