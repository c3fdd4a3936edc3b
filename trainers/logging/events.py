"""TensorBoard event files of one run, written with tensorboardX's public API.

Layout::

    <logdir>/<experiment>/<run>      run = default_run_name("on", 2) -> "inplace-on_np2"

Every run of an experiment writes the same tags (``train/loss``, ``memory/peak_mb``, ...)
into its own directory, so ``tensorboard --logdir <logdir>/<experiment>`` overlays the
runs of one experiment. Only rank 0 logs: other ranks build ``RunLogger(path,
enabled=False)``, whose methods are no-ops that import nothing and create no files.

Events are written synchronously, in the training thread, by ``tensorboardX.RecordWriter``
(exported by tensorboardX for writing an event file record by record); the summaries
come from ``tensorboardX.summary`` (``text``, ``image``, ``hparams``; scalars are
``Summary.Value`` records under the tag ``summary.scalar`` makes of the name). One log
point is one event holding every tag's value: TensorBoard reads it exactly as one
``add_scalar`` per tag.

Why not ``SummaryWriter`` or ``FileWriter``: they hand every event to a writer thread
through a ``multiprocessing.Queue`` (a feeder thread pickles it into a pipe, the writer
thread unpickles it), and those threads take the GIL from the training loop at every
event. ``benchmarks/bench_logging.py`` measured it on a loop of 0.5 ms steps with a log
point of 14 tags every 10 steps (docs/BENCHMARKS.md, "Logging overhead"; the loop's time
against no logging, medians of 20 interleaved rounds, four runs on a busy 2-core VM):
``RunLogger`` 1.04-1.09 (0.2-0.6 ms more per log point), ``FileWriter.add_summary`` with
the same one event per log point 1.11-1.16 (0.5-1.1 ms), ``SummaryWriter.add_scalar`` per
tag 1.13-1.31 (0.8-1.6 ms); ``RunLogger.scalars`` itself takes 70-90 us per call.
``FileWriter.flush()`` also returns before the queued events reach the file, whereas
:meth:`RunLogger.flush` writes and fsyncs every event logged so far; the trainer calls it
before each checkpoint, so a run killed after a checkpoint has lost no point logged
before it.
"""

from __future__ import annotations

import itertools
import math
import numbers
import os
import socket
import time
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from .plots import plot_timeline

__all__ = ["RunLogger", "default_run_name", "event_files", "read_scalars", "run_dir", "timeline_png"]

_EVENT_FILE_MARKER = ".out.tfevents."
_writer_ids = itertools.count()


# --------------------------------------------------------------------------- layout


def _path_component(value: str, what: str) -> str:
    value = str(value)
    if not value or value in (".", "..") or "/" in value or os.sep in value or (os.altsep and os.altsep in value):
        raise ValueError(
            f"{what} {value!r} must be one non-empty directory name without path "
            "separators, e.g. 'mlp_digits' or 'inplace-on_np1'"
        )
    return value


def default_run_name(policy: str, world_size: int, *extras: str | None) -> str:
    """Names a run after its inplace policy, world size and what else sets it apart.

    Args:
        policy: The inplace policy, ``"on"``, ``"off"`` or ``"auto"``.
        world_size: Number of MPI ranks (>= 1).
        *extras: Suffixes that tell apart runs with the same policy (``"inplace_abn"``,
            ``"compiled"``); None or empty ones are left out.

    Returns:
        ``inplace-<policy>_np<world_size>[_<extra>...]``, e.g. ``inplace-on_np1_inplace_abn``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or (world_size < 1):
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    name = "_".join([f"inplace-{policy}_np{int(world_size)}", *filter(None, extras)])
    return _path_component(name, "run name")


def event_files(run_dir: str | os.PathLike) -> list[str]:
    """The names of the TensorBoard event files in ``run_dir`` (none when it does not exist)."""
    path = os.fspath(run_dir)
    return [f for f in os.listdir(path) if _EVENT_FILE_MARKER in f] if os.path.isdir(path) else []


def timeline_png(run_dir: str | os.PathLike) -> str:
    """``<run>/timeline.png``: the memory timeline's image, written once the run logged it."""
    return os.path.join(os.fspath(run_dir), "timeline.png")


def run_dir(logdir: str | os.PathLike, experiment: str, run_name: str) -> str:
    """Returns ``<logdir>/<experiment>/<run_name>`` (not created; RunLogger does that)."""
    return os.path.join(
        os.fspath(logdir),
        _path_component(experiment, "experiment"),
        _path_component(run_name, "run name"),
    )


# --------------------------------------------------------------------------- RunLogger


class RunLogger:
    """Writes one run's TensorBoard events; a cheap no-op when ``enabled`` is False.

    Usage on every rank::

        with RunLogger(run_dir(cfg.logdir, cfg.experiment, name), enabled=rank == 0) as log:
            log.config_text(cfg_yaml)
            log.scalars(step, {"train/loss": loss, "memory/peak_mb": peak / MB})
            log.timeline_figure(step, timeline, floor_bytes=floor)
            log.hparams({"inplace": "on", "lr": 0.1}, {"hparam/peak_mb": peak / MB})

    Args:
        run_dir: The run's directory, created if missing.
        enabled: False on ranks other than 0: nothing is imported or created.
        flush_secs: Longest time an event waits in the file buffer before it is written
            (TensorBoard shows it after that); :meth:`flush` writes at once.
        purge_step: A run restarted in the same directory at this step: TensorBoard hides
            the events of the earlier attempt at steps >= ``purge_step`` (a
            ``SessionLog.START`` event, as ``SummaryWriter(purge_step=...)`` writes).
            A run resumed from a checkpoint at step N passes N + 1, so the points logged
            up to and including the checkpoint's step stay. A fresh run (0) also removes
            the earlier attempt's ``timeline.png``.
        append: Add to a run's directory without a purge, and without the warning about
            its event files (``scripts/compare_inplace.py`` adds each policy's timeline
            image once every policy has run, to draw them on one scale).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        enabled: bool = True,
        *,
        flush_secs: float = 10.0,
        purge_step: int | None = None,
        append: bool = False,
    ):
        self.run_dir = os.fspath(run_dir)
        self.enabled = bool(enabled)
        self._file = None  # the tensorboardX.RecordWriter of the event file, while open
        self._flush_secs = flush_secs
        self._warned_nonfinite = False
        self._last: dict[str, float] = {}  # tag -> last value written by scalars()
        self._last_step: int | None = None
        self._tags: dict[str, str] = {}  # tag as given -> tag as tensorboardX cleans it
        if not self.enabled:
            return
        from tensorboardX import RecordWriter  # noqa: PLC0415
        from tensorboardX.proto.event_pb2 import Event, SessionLog  # noqa: PLC0415
        from tensorboardX.proto.summary_pb2 import Summary  # noqa: PLC0415

        self._event_cls, self._summary_cls = Event, Summary
        os.makedirs(self.run_dir, exist_ok=True)
        earlier = event_files(self.run_dir)
        if purge_step == 0 and os.path.exists(self.timeline_path):
            os.unlink(self.timeline_path)  # the figure of the attempt this run replaces
        if earlier and purge_step is None and not append:
            warnings.warn(
                f"{self.run_dir} already holds event files of an earlier run; TensorBoard "
                "will mix their points with this run's. Use another run name, delete the "
                "directory, or pass purge_step= when resuming.",
                RuntimeWarning,
                stacklevel=2,
            )
        # TensorBoard reads a run's event files in name order. After the usual
        # "events.out.tfevents.<unix seconds>.<host>", nanoseconds order the files opened
        # within one second by creation (also across processes: a resumed run's purge
        # must come after the run it purges); pid and a counter keep them apart.
        name = (
            f"events{_EVENT_FILE_MARKER}{int(time.time()):010d}.{socket.gethostname()}"
            f".{time.time_ns():020d}.{os.getpid()}.{next(_writer_ids)}"
        )
        self._file = RecordWriter(os.path.join(self.run_dir, name))
        self._next_flush = time.monotonic() + flush_secs
        self._write(Event(file_version="brain.Event:2"), None)
        if purge_step is not None:
            self._write(Event(session_log=SessionLog(status=SessionLog.START)), purge_step)

    @property
    def timeline_path(self) -> str:
        """``<run>/timeline.png``: written with the ``memory/timeline`` image, the same PNG."""
        return timeline_png(self.run_dir)

    def _write(self, event, step: int | None) -> None:
        event.wall_time = time.time()
        if step is not None:
            event.step = int(step)
        self._file.write(event.SerializeToString())
        if time.monotonic() >= self._next_flush:
            self.flush()

    def _add(self, summary, step: int | None) -> None:
        self._write(self._event_cls(summary=summary), step)

    def _tag(self, tag: str) -> str:
        clean = self._tags.get(tag)
        if clean is None:
            from tensorboardX.summary import scalar  # noqa: PLC0415

            clean = self._tags[tag] = scalar(tag, 0.0).value[0].tag
        return clean

    # ---- scalars

    def _finite(self, step, tag: str, value) -> float | None:
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"metric {tag!r} must be a number, got {type(value).__name__} {value!r}") from None
        if math.isfinite(value):
            return value
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            warnings.warn(
                f"skipping non-finite value {value} for {tag!r} at step {step} (TensorBoard "
                "draws NaN and inf badly); further non-finite values are skipped silently",
                RuntimeWarning,
                stacklevel=3,
            )
        return None

    def scalars(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Writes ``tag -> number`` at ``step``; non-finite values are skipped.

        All values of one call go into one event (what ``add_scalar`` would write tag by
        tag; TensorBoard reads them the same way, at a fraction of the cost).
        """
        if self._file is None:
            return
        values = []
        for tag, value in metrics.items():
            value = self._finite(step, tag, value)
            if value is not None:
                clean = self._tag(tag)
                values.append(self._summary_cls.Value(tag=clean, simple_value=value))
                self._last[clean] = value
        step = int(step)
        if self._last_step is None or step > self._last_step:
            self._last_step = step
        if values:
            self._add(self._summary_cls(value=values), step)

    # ---- text

    def config_text(self, config_yaml: str, step: int = 0) -> None:
        """Logs the resolved config as text (tag ``config``) and writes ``config.yaml``."""
        if self._file is None:
            return
        from tensorboardX.summary import text  # noqa: PLC0415

        with open(os.path.join(self.run_dir, "config.yaml"), "w", encoding="utf-8") as f:
            f.write(config_yaml)
        longest = max((len(m) for m in _backtick_runs(config_yaml)), default=0)
        fence = "`" * max(3, longest + 1)
        self._add(text("config", f"{fence}yaml\n{config_yaml.rstrip()}\n{fence}"), step)

    # ---- figure

    def timeline_figure(
        self, step: int, timeline, floor_bytes: int | None = None, top_mb: float | None = None
    ) -> str | None:
        """Logs one step's memory timeline as image ``memory/timeline``; saves timeline.png.

        Args:
            step: Training step the timeline was recorded at.
            timeline: ``framework.memory.Timeline`` or a dict with ``events`` (tuples
                ``(seconds, allocated_bytes, delta_bytes, category, phase)``) and ``marks``
                (tuples ``(seconds, phase)``).
            floor_bytes: The step's memory floor, drawn as a horizontal line if given.
            top_mb: The top of the MB axis (the highest of the runs drawn to compare);
                None: this timeline's own peak.

        Returns:
            The path of ``timeline.png``, or None when disabled.
        """
        if self._file is None:
            return None
        import numpy as np  # noqa: PLC0415
        from tensorboardX.summary import image  # noqa: PLC0415

        fig = plot_timeline(timeline, floor_bytes=floor_bytes, title=f"memory in step {step}", top_mb=top_mb)
        fig.canvas.draw()
        summary = image("memory/timeline", np.asarray(fig.canvas.buffer_rgba()), dataformats="HWC")
        path = self.timeline_path
        with open(path, "wb") as f:  # the PNG the summary holds: one rendering for both
            f.write(summary.value[0].image.encoded_image_string)
        self._add(summary, step)
        return path

    # ---- layout

    def layout(self, categories: Mapping[str, Mapping[str, Iterable[str]]], step: int = 0) -> None:
        """Logs the CUSTOM SCALARS tab's layout: ``{category: {chart title: [tag regexes]}}``.

        Each chart draws every tag matching one of its regular expressions, for every run,
        in one plot: the runs of an experiment overlaid. TensorBoard merges the layouts of
        all runs (identical charts once), so every run may log the same one.
        """
        if self._file is None:
            return
        from tensorboardX.summary import custom_scalars  # noqa: PLC0415

        spec = {
            cat: {title: ["Multiline", list(tags)] for title, tags in charts.items()}
            for cat, charts in categories.items()
        }
        self._add(custom_scalars(spec), step)

    # ---- hparams

    def hparams(self, hparams: Mapping[str, Any], metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Logs the run's hyperparameters and headline metrics for the HPARAMS tab.

        ``SummaryWriter.add_hparams`` writes into a new run ``<run>/<name>`` (``name``
        defaults to ``time.time()``): an extra run in the dashboard, whose hparams row is
        not the run that holds the curves. The three summaries of
        ``tensorboardX.summary.hparams`` are written here into the run's own event file
        instead; TensorBoard then shows this run as the hparams session and reads each
        metric from this run's scalar series of that tag.

        Args:
            hparams: Name -> value; values other than bool/int/float/str are stringified.
                Use the same keys in every run of an experiment: TensorBoard takes the
                column list from one run.
            metrics: Tag -> number. A tag not yet written by :meth:`scalars` is written
                now as a scalar at ``step`` (prefer ``hparam/...`` tags); a tag that
                :meth:`scalars` already wrote is shown with that series' latest value.
            step: Step of the metric scalars; defaults to the last step logged.
        """
        if self._file is None:
            return
        from tensorboardX.summary import hparams as hparams_summaries  # noqa: PLC0415

        hp = {str(k): _hparam_value(v) for k, v in hparams.items()}
        if step is None:
            step = self._last_step if self._last_step is not None else 0
        values = {}
        for tag, value in metrics.items():
            value = self._finite(step, tag, value)
            if value is not None:
                values[self._tag(tag)] = value
        for summary in hparams_summaries(hp, values):
            self._add(summary, None)
        new = {tag: v for tag, v in values.items() if tag not in self._last}
        for tag, value in values.items():
            if tag in self._last and self._last[tag] != value:
                warnings.warn(
                    f"hparams metric {tag!r}={value} differs from the last value "
                    f"{self._last[tag]} that scalars() wrote for that tag; TensorBoard "
                    "shows the latter. Use a separate tag such as 'hparam/...'.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if new:
            self.scalars(step, new)

    # ---- lifetime

    def flush(self) -> None:
        """Writes every event logged so far to the file and fsyncs it."""
        if self._file is not None:
            self._file.flush()
            self._next_flush = time.monotonic() + self._flush_secs

    def close(self) -> None:
        """Flushes and closes the event file; later calls are no-ops."""
        if self._file is not None:
            self.flush()
            self._file.close()
            self._file = None

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _backtick_runs(text: str) -> Iterable[str]:
    run = ""
    for ch in text:
        if ch == "`":
            run += ch
        elif run:
            yield run
            run = ""
    if run:
        yield run


def _hparam_value(value):
    if isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    return str(value)


# --------------------------------------------------------------------------- reading back


def read_scalars(run_dir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """Reads every scalar series of a run's event files with TensorBoard's reader.

    Values come back as TensorBoard stores them: float32. Points hidden by a later
    ``purge_step`` are left out, as TensorBoard leaves them out.

    Returns:
        Tag -> ``[(step, value), ...]`` in the order written, tags sorted.
    """
    path = os.fspath(run_dir)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no run directory {path!r}")
    from tensorboard.backend.event_processing.event_accumulator import (  # noqa: PLC0415
        EventAccumulator,
    )

    acc = EventAccumulator(path, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in sorted(acc.Tags()["scalars"])}
