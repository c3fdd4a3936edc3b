"""TensorBoard event files of one run, written with tensorboardX's public API.

Layout::

    <logdir>/<experiment>/<run>      run = default_run_name("on", 2) -> "inplace-on_np2"

Every run of an experiment writes the same tags (``train/loss``, ``memory/peak_mb``, ...)
into its own directory, so ``tensorboard --logdir <logdir>/<experiment>`` overlays the
runs of one experiment. Only rank 0 logs: other ranks build ``RunLogger(path,
enabled=False)``, whose methods are no-ops that import nothing and create no files.

Events go through ``tensorboardX.FileWriter.add_summary``; the summaries are built by
``tensorboardX.summary`` (``scalar``, ``text``, ``image``, ``hparams``), the builders
``SummaryWriter.add_*`` use. One log point is one event that holds every tag's value:
TensorBoard reads it exactly as one ``add_scalar`` per tag, and it costs one pass
through the writer's queue instead of fourteen (``benchmarks/bench_logging.py``:
about 0.1 ms per log point against 0.55 ms for fourteen ``add_scalar`` calls).

``FileWriter.flush()`` does not wait for the events still queued for its writer thread;
``close()`` does. So :meth:`RunLogger.flush` closes the event file, and the next event
opens a new one in the same directory: after ``flush()`` every event logged so far is
in the file (the trainer flushes before each checkpoint, so a run killed after a
checkpoint has lost no point logged before it).
"""

from __future__ import annotations

import itertools
import math
import numbers
import os
import time
import warnings
from typing import Any, Iterable, Mapping

from .plots import plot_timeline

__all__ = ["RunLogger", "default_run_name", "read_scalars", "run_dir"]

_EVENT_FILE_MARKER = ".out.tfevents."
_writer_ids = itertools.count()


# --------------------------------------------------------------------------- layout


def _path_component(value: str, what: str) -> str:
    value = str(value)
    if not value or value in (".", "..") or "/" in value or os.sep in value or (
        os.altsep and os.altsep in value
    ):
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
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or (
        world_size < 1
    ):
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    name = "_".join([f"inplace-{policy}_np{int(world_size)}", *filter(None, extras)])
    return _path_component(name, "run name")


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
        flush_secs: Longest time an event waits in the writer before it reaches the file
            (TensorBoard shows it after that); :meth:`flush` writes at once.
        purge_step: A run restarted in the same directory at this step: TensorBoard hides
            the events of the earlier attempt at steps >= ``purge_step`` (a
            ``SessionLog.START`` event, as ``SummaryWriter(purge_step=...)`` writes).
            A run resumed from a checkpoint at step N passes N + 1, so the points logged
            up to and including the checkpoint's step stay.
    """

    def __init__(self, run_dir: str | os.PathLike, enabled: bool = True, *,
                 flush_secs: float = 10.0, purge_step: int | None = None):
        self.run_dir = os.fspath(run_dir)
        self.enabled = bool(enabled)
        self._writer = None  # the open tensorboardX.FileWriter, or None between files
        self._closed = not self.enabled
        self._flush_secs = flush_secs
        self._warned_nonfinite = False
        self._last: dict[str, float] = {}  # tag -> last value written by scalars()
        self._last_step: int | None = None
        if not self.enabled:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        earlier = [f for f in os.listdir(self.run_dir) if _EVENT_FILE_MARKER in f]
        if earlier and purge_step is None:
            warnings.warn(
                f"{self.run_dir} already holds event files of an earlier run; TensorBoard "
                "will mix their points with this run's. Use another run name, delete the "
                "directory, or pass purge_step= when resuming.",
                RuntimeWarning, stacklevel=2,
            )
        if purge_step is None:
            self._file_writer()
        else:
            from tensorboardX.proto.event_pb2 import Event, SessionLog  # noqa: PLC0415

            self._file_writer().add_event(
                Event(session_log=SessionLog(status=SessionLog.START)), step=int(purge_step))

    def _file_writer(self):
        """The open event file's writer; opens a new file after :meth:`flush`."""
        if self._writer is None:
            from tensorboardX import FileWriter  # noqa: PLC0415

            # The file is "<dir>/events.out.tfevents.<unix seconds>.<host><suffix>", and
            # TensorBoard reads a run's files in name order: the suffix orders files opened
            # within one second by creation (nanoseconds, also across processes: a resumed
            # run's purge must come after the run it purges) and keeps them apart.
            suffix = f".{time.time_ns():020d}.{os.getpid()}.{next(_writer_ids)}"
            self._writer = FileWriter(self.run_dir, flush_secs=self._flush_secs,
                                      filename_suffix=suffix)
        return self._writer

    def _add(self, summary, step: int | None) -> None:
        self._file_writer().add_summary(summary, global_step=step)

    # ---- scalars

    def _finite(self, step, tag: str, value) -> float | None:
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise TypeError(
                f"metric {tag!r} must be a number, got {type(value).__name__} {value!r}"
            ) from None
        if math.isfinite(value):
            return value
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            warnings.warn(
                f"skipping non-finite value {value} for {tag!r} at step {step} (TensorBoard "
                "draws NaN and inf badly); further non-finite values are skipped silently",
                RuntimeWarning, stacklevel=3,
            )
        return None

    def scalars(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Writes ``tag -> number`` at ``step``; non-finite values are skipped.

        All values of one call go into one event (what ``add_scalar`` would write tag by
        tag; TensorBoard reads them the same way, at a fraction of the cost).
        """
        if self._closed:
            return
        from tensorboardX.proto.summary_pb2 import Summary  # noqa: PLC0415
        from tensorboardX.summary import scalar  # noqa: PLC0415

        values = []
        for tag, value in metrics.items():
            value = self._finite(step, tag, value)
            if value is not None:
                entry = scalar(tag, value).value[0]  # the builder also cleans the tag
                values.append(entry)
                self._last[entry.tag] = value
        step = int(step)
        if self._last_step is None or step > self._last_step:
            self._last_step = step
        if values:
            self._add(Summary(value=values), step)

    # ---- text

    def config_text(self, config_yaml: str, step: int = 0) -> None:
        """Logs the resolved config as text (tag ``config``) and writes ``config.yaml``."""
        if self._closed:
            return
        from tensorboardX.summary import text  # noqa: PLC0415

        with open(os.path.join(self.run_dir, "config.yaml"), "w", encoding="utf-8") as f:
            f.write(config_yaml)
        longest = max((len(m) for m in _backtick_runs(config_yaml)), default=0)
        fence = "`" * max(3, longest + 1)
        self._add(text("config", f"{fence}yaml\n{config_yaml.rstrip()}\n{fence}"), step)

    # ---- figure

    def timeline_figure(self, step: int, timeline, floor_bytes: int | None = None) -> str | None:
        """Logs one step's memory timeline as image ``memory/timeline``; saves timeline.png.

        Args:
            step: Training step the timeline was recorded at.
            timeline: ``framework.memory.Timeline`` or a dict with ``events`` (tuples
                ``(seconds, allocated_bytes, delta_bytes, category, phase)``) and ``marks``
                (tuples ``(seconds, phase)``).
            floor_bytes: The step's memory floor, drawn as a horizontal line if given.

        Returns:
            The path of ``timeline.png``, or None when disabled.
        """
        if self._closed:
            return None
        import numpy as np  # noqa: PLC0415
        from tensorboardX.summary import image  # noqa: PLC0415

        fig = plot_timeline(timeline, floor_bytes=floor_bytes, title=f"memory timeline, step {step}")
        fig.canvas.draw()
        summary = image("memory/timeline", np.asarray(fig.canvas.buffer_rgba()), dataformats="HWC")
        path = os.path.join(self.run_dir, "timeline.png")
        with open(path, "wb") as f:  # the PNG the summary holds: one rendering for both
            f.write(summary.value[0].image.encoded_image_string)
        self._add(summary, step)
        return path

    # ---- hparams

    def hparams(self, hparams: Mapping[str, Any], metrics: Mapping[str, Any],
                step: int | None = None) -> None:
        """Logs the run's hyperparameters and headline metrics for the HPARAMS tab.

        ``SummaryWriter.add_hparams`` writes into a new run ``<run>/<name>`` (``name``
        defaults to ``time.time()``): an extra run in the dashboard, whose hparams row is
        not the run that holds the curves. The three summaries of
        ``tensorboardX.summary.hparams`` are written here into the run's own directory
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
        if self._closed:
            return
        from tensorboardX.summary import hparams as hparams_summaries  # noqa: PLC0415
        from tensorboardX.summary import scalar  # noqa: PLC0415

        hp = {str(k): _hparam_value(v) for k, v in hparams.items()}
        if step is None:
            step = self._last_step if self._last_step is not None else 0
        values = {}
        for tag, value in metrics.items():
            value = self._finite(step, tag, value)
            if value is not None:
                values[scalar(tag, 0.0).value[0].tag] = value
        for summary in hparams_summaries(hp, values):
            self._add(summary, None)
        new = {tag: v for tag, v in values.items() if tag not in self._last}
        for tag, value in values.items():
            if tag in self._last and self._last[tag] != value:
                warnings.warn(
                    f"hparams metric {tag!r}={value} differs from the last value "
                    f"{self._last[tag]} that scalars() wrote for that tag; TensorBoard "
                    "shows the latter. Use a separate tag such as 'hparam/...'.",
                    RuntimeWarning, stacklevel=2,
                )
        if new:
            self.scalars(step, new)

    # ---- lifetime

    def flush(self) -> None:
        """Writes every event logged so far to the file (see the module docstring)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def close(self) -> None:
        """Flushes and closes the event file; later calls are no-ops."""
        self.flush()
        self._closed = True

    def __enter__(self) -> "RunLogger":
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
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in sorted(acc.Tags()["scalars"])}
