"""Shared helpers of the benchmarks: timing, machine description, tables, JSON.

Timings use ``time.perf_counter``. On a shared, noisy machine the minimum of several
repeats is the best estimate of what the code costs; the median says how noisy the
run was. Variants that are compared with each other are timed interleaved in one loop
(:func:`interleaved`) so that noise falls on all of them alike.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
from threadpoolctl import threadpool_info


def summarize(seconds: list[float]) -> dict:
    """``{"min": ..., "median": ..., "repeats": n}`` of a list of durations in seconds."""
    return {"min": min(seconds), "median": statistics.median(seconds), "repeats": len(seconds)}


def time_repeats(fn: Callable[[], object], repeats: int, warmup: int = 1, setup: Callable | None = None) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn`` (``setup`` runs untimed before each call)."""
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    out = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        result = fn()
        t1 = time.perf_counter()
        del result  # freeing the result is not part of the timed call
        out.append(t1 - t0)
    return out


def interleaved(
    variants: dict[str, Callable[[], object]], repeats: int, warmup: int = 1, setup: Callable[[str], None] | None = None
) -> dict[str, list[float]]:
    """Times every variant once per round, ``repeats`` rounds, rotating the order.

    Returns ``{name: [seconds per round]}``. ``setup(name)`` runs untimed before each
    call (e.g. to restore an input that an inplace variant overwrote). The garbage
    collector is off while timing so that a collection never lands in one variant.
    """
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for r in range(-warmup, repeats):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                if setup is not None:
                    setup(name)
                fn = variants[name]
                t0 = time.perf_counter()
                result = fn()
                t1 = time.perf_counter()
                del result
                if r >= 0:
                    times[name].append(t1 - t0)
    finally:
        if gc_was_enabled:
            gc.enable()
    return times


def cpu_model() -> str:
    """The CPU model from /proc/cpuinfo (``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    """What a reader needs to compare numbers: CPU, cores, versions, date."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count()
    try:
        load = round(os.getloadavg()[0], 2)  # other work on a shared machine skews medians
    except OSError:
        load = None
    return {
        "cpu": cpu_model(),
        "cores": cores,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "blas": blas_kernels(),
        "platform": platform.platform(),
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "load_average_1min": load,
    }


def blas_kernels() -> str:
    """NumPy's BLAS and the kernels it runs on this CPU, e.g. ``openblas 0.3.31, SkylakeX
    kernels``. OpenBLAS picks them from the CPU when it loads, unless the environment
    variable ``OPENBLAS_CORETYPE`` names them, and float32 products run up to 2x faster
    on one than on another (docs/BENCHMARKS.md, "2026-11-24: which BLAS kernels ran"), so every result
    says which ran and who chose them. (SciPy, loaded for the optimizers' axpy, brings an
    OpenBLAS of its own; it reads the same variable.)"""
    libs = [lib for lib in threadpool_info() if lib.get("user_api") == "blas"]
    if not libs:
        return "unknown"
    libs.sort(key=lambda lib: os.sep + "numpy" not in lib.get("filepath", ""))  # NumPy's own first
    arch = libs[0].get("architecture")
    line = f"{libs[0].get('internal_api')} {libs[0].get('version')}" + (f", {arch} kernels" if arch else "")
    forced = os.environ.get("OPENBLAS_CORETYPE")
    if forced and libs[0].get("internal_api") == "openblas":
        line += f" set by OPENBLAS_CORETYPE={forced}"
    return line


def machine_line(info: dict | None = None) -> str:
    info = info or machine_info()
    load = "" if info.get("load_average_1min") is None else f", load average {info['load_average_1min']}"
    blas = f" ({info['blas']})" if info.get("blas") else ""
    return (
        f"{info['cpu']}, {info['cores']} cores, Python {info['python']}, NumPy {info['numpy']}{blas}, "
        f"{info['date']}{load}"
    )


def legend(pairs: list[tuple[str, str]]) -> str:
    """A table's legend: a blank line (so that Markdown ends the table), then one line per
    ``(columns, meaning)`` pair, ``legend: columns: meaning``, as the trainer's tables end
    (``trainers.logging.tables.format_summary``). Every printed table of the benchmarks
    ends with one for its columns whose meaning is not obvious (what a ratio is against,
    min or median, units)."""
    return "\n" + "\n".join(f"legend: {columns}: {meaning}" for columns, meaning in pairs) if pairs else ""


def markdown_table(headers: list[str], rows: list[list], legend_pairs: list[tuple[str, str]] = ()) -> str:
    """A GitHub Markdown table; numbers are printed as they are given (format them first).
    ``legend_pairs`` adds its :func:`legend` below."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + ("\n" + legend(list(legend_pairs)) if legend_pairs else "")


def parser(description: str, default_repeats: int) -> argparse.ArgumentParser:
    """The options every benchmark has: ``--repeats``, ``--quick``, ``--json``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"timed repeats per variant (default {default_repeats}; 3 with --quick)",
    )
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats: a smoke run, not a measurement")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results to this JSON file")
    return p


def repeats_of(args, default: int) -> int:
    if args.repeats is not None:
        if args.repeats < 1:
            raise SystemExit("--repeats must be at least 1")
        return args.repeats
    return 3 if args.quick else default


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=False)
        f.write("\n")


def command_line() -> str:
    """How this process was started, for the record (``python -m pkg.mod ...`` when run so)."""
    args = " ".join(sys.argv[1:])
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        head = "python -m " + spec.name.removesuffix(".__main__")
    elif sys.argv and sys.argv[0]:
        head = "python " + os.path.relpath(sys.argv[0])
    else:
        head = "python"
    return f"{head} {args}".strip()
