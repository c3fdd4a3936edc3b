"""TensorBoard logging, progress bar and summary tables for training runs.

Layout (DESIGN.md, "TensorBoard layout")::

    <logdir>/<experiment>/<run>      run = default_run_name("on", 2) -> "inplace-on_np2"

Every run of an experiment writes the same tags (``train/loss``, ``memory/peak_mb``, ...)
into its own directory, so ``tensorboard --logdir <logdir>/<experiment>`` overlays the
inplace-on and inplace-off runs. Only rank 0 logs: other ranks build
``RunLogger(path, enabled=False)`` and ``Progress(disable=True)``, whose methods are
no-ops that create no files.

This module receives plain numbers and data, never tensors: it imports nothing from
``framework``, and tensorboardX / matplotlib / tqdm / tensorboard are imported lazily so
that a disabled logger costs nothing.

Why events are written synchronously instead of through ``SummaryWriter``: tensorboardX
hands every event to a background thread through a ``multiprocessing.Queue`` (pickle,
pipe, unpickle) and checksums it in pure Python, all under the GIL of the training
loop. Measured with eight tags per step, ``add_scalar`` cost 0.35 to 1 ms per step
against a 2 ms step; one ``Summary`` per step written synchronously costs about 45 us.
``SummaryWriter.flush()`` also returns before queued events reach the file, so a run
could not be read back reliably while it is written. The summaries themselves are built
with tensorboardX's own builders (``tensorboardX.summary``), the ones that ``add_scalar``,
``add_text`` and ``add_hparams`` use, so TensorBoard sees exactly what they would write.
"""

from __future__ import annotations

import io
import itertools
import math
import numbers
import os
import sys
import time
import warnings
from typing import Any, Iterable, Mapping, Sequence

__all__ = [
    "MB",
    "Progress",
    "RunLogger",
    "default_run_name",
    "format_summary",
    "format_value",
    "plot_timeline",
    "read_scalars",
    "run_dir",
]

MB = 2**20
"""Bytes per "MB" in every ``*_mb`` tag and table (MiB, as CUDA and PyTorch report)."""

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


def default_run_name(policy: str, world_size: int, extra: str | None = None) -> str:
    """Names a run after its inplace policy and world size.

    Args:
        policy: The inplace policy, ``"on"``, ``"off"`` or ``"auto"``.
        world_size: Number of MPI ranks (>= 1).
        extra: Optional suffix that tells apart runs with the same policy.

    Returns:
        ``inplace-<policy>_np<world_size>[_<extra>]``, e.g. ``inplace-on_np1_inplace_abn``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or (
        world_size < 1
    ):
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    name = f"inplace-{policy}_np{int(world_size)}"
    if extra:
        name = f"{name}_{extra}"
    return _path_component(name, "run name")


def run_dir(logdir: str | os.PathLike, experiment: str, run_name: str) -> str:
    """Returns ``<logdir>/<experiment>/<run_name>`` (not created; RunLogger does that)."""
    return os.path.join(
        os.fspath(logdir),
        _path_component(experiment, "experiment"),
        _path_component(run_name, "run name"),
    )


# --------------------------------------------------------------------------- RunLogger


def _import_tensorboardx() -> None:
    """Imports tensorboardX without letting it import PyTorch.

    ``tensorboardX.writer`` runs ``import torch`` when PyTorch is installed, only to
    widen a type alias; that costs about 2 s of CPU at the start of every run in an
    environment that happens to have torch. This project never hands it torch tensors,
    so the import is refused for that one moment (a ``None`` entry in ``sys.modules``
    makes ``import torch`` raise ImportError, which tensorboardX handles) and the entry
    is removed again, so a later ``import torch`` elsewhere works as usual.
    """
    if "tensorboardX.writer" in sys.modules or "torch" in sys.modules:
        import tensorboardX  # noqa: F401, PLC0415
        return
    sys.modules["torch"] = None
    try:
        import tensorboardX  # noqa: F401, PLC0415
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]


class _EventWriter:
    """Appends TensorBoard events to one event file, synchronously (see module doc)."""

    def __init__(self, directory: str, flush_secs: float):
        from tensorboardX.event_file_writer import EventsWriter  # noqa: PLC0415
        from tensorboardX.proto.event_pb2 import Event  # noqa: PLC0415

        self._event_cls = Event
        # The file name is "<dir>/events.out.tfevents.<unix seconds>.<host><suffix>".
        # TensorBoard reads a run's files in name order, so the suffix orders writers
        # opened within one second by creation (nanoseconds: also across processes; a
        # resumed run's purge must come after the run it purges), and keeps them apart
        # (tensorboardX opens with "wb", so a clash would truncate the other file).
        suffix = f".{time.time_ns():020d}.{os.getpid()}.{next(_writer_ids)}"
        self._writer = EventsWriter(os.path.join(directory, "events"), suffix)
        self._flush_secs = flush_secs
        self._next_flush = time.monotonic() + flush_secs

    def write(self, step: int | None, summary=None, **fields) -> None:
        event = self._event_cls(wall_time=time.time(), summary=summary, **fields)
        if step is not None:
            event.step = int(step)
        self._writer.write_event(event)
        if time.monotonic() >= self._next_flush:
            self.flush()

    def flush(self) -> None:
        self._writer.flush()
        self._next_flush = time.monotonic() + self._flush_secs

    def close(self) -> None:
        self._writer.close()


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
        purge_step: When resuming a run at this step in the same directory, events of
            the earlier attempt at steps >= ``purge_step`` are hidden by TensorBoard
            (a ``SessionLog.START`` event, as tensorboardX's ``purge_step``).
    """

    def __init__(self, run_dir: str | os.PathLike, enabled: bool = True, *,
                 flush_secs: float = 10.0, purge_step: int | None = None):
        self.run_dir = os.fspath(run_dir)
        self.enabled = bool(enabled)
        self._events: _EventWriter | None = None
        self._warned_nonfinite = False
        self._last: dict[str, float] = {}  # tag -> last value written by scalars()
        self._last_step: int | None = None
        self._tags: dict[str, str] = {}  # tag as given -> tag as tensorboardX cleans it
        if not self.enabled:
            return
        _import_tensorboardx()
        from tensorboardX.proto.summary_pb2 import Summary  # noqa: PLC0415

        self._summary_cls = Summary
        self._value_cls = Summary.Value
        os.makedirs(self.run_dir, exist_ok=True)
        earlier = [f for f in os.listdir(self.run_dir) if _EVENT_FILE_MARKER in f]
        if earlier and purge_step is None:
            warnings.warn(
                f"{self.run_dir} already holds event files of an earlier run; TensorBoard "
                "will mix their points with this run's. Use another run name, delete the "
                "directory, or pass purge_step= when resuming.",
                RuntimeWarning, stacklevel=2,
            )
        self._events = _EventWriter(self.run_dir, flush_secs)
        if purge_step is not None:
            from tensorboardX.proto.event_pb2 import SessionLog  # noqa: PLC0415

            self._events.write(purge_step, session_log=SessionLog(status=SessionLog.START))

    # ---- scalars

    def _tag(self, tag: str) -> str:
        clean = self._tags.get(tag)
        if clean is None:
            from tensorboardX.summary import scalar  # noqa: PLC0415

            clean = self._tags[tag] = scalar(tag, 0.0).value[0].tag
        return clean

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
        if self._events is None:
            return
        values = []
        for tag, value in metrics.items():
            value = self._finite(step, tag, value)
            if value is not None:
                clean = self._tag(tag)
                values.append(self._value_cls(tag=clean, simple_value=value))
                self._last[clean] = value
        step = int(step)
        if self._last_step is None or step > self._last_step:
            self._last_step = step
        if values:
            self._events.write(step, self._summary_cls(value=values))

    # ---- text

    def config_text(self, config_yaml: str) -> None:
        """Logs the resolved config as text (tag ``config``) and writes ``config.yaml``."""
        if self._events is None:
            return
        from tensorboardX.summary import text  # noqa: PLC0415

        with open(os.path.join(self.run_dir, "config.yaml"), "w", encoding="utf-8") as f:
            f.write(config_yaml)
        longest = max((len(m) for m in _backtick_runs(config_yaml)), default=0)
        fence = "`" * max(3, longest + 1)
        body = f"{fence}yaml\n{config_yaml.rstrip()}\n{fence}"
        self._events.write(0, text("config", body))

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
        if self._events is None:
            return None
        fig = plot_timeline(timeline, floor_bytes=floor_bytes, title=f"memory timeline, step {step}")
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        png = buf.getvalue()
        path = os.path.join(self.run_dir, "timeline.png")
        with open(path, "wb") as f:
            f.write(png)
        # The image summary add_figure writes, from the PNG we already have (no second
        # render, no pyplot).
        width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
        image = self._summary_cls.Image(height=height, width=width, colorspace=4,
                                        encoded_image_string=png)
        self._events.write(step, self._summary_cls(
            value=[self._value_cls(tag=self._tag("memory/timeline"), image=image)]))
        return path

    # ---- hparams

    def hparams(self, hparams: Mapping[str, Any], metrics: Mapping[str, Any],
                step: int | None = None) -> None:
        """Logs the run's hyperparameters and headline metrics for the HPARAMS tab.

        tensorboardX's ``add_hparams`` writes through a second ``SummaryWriter`` in
        ``<run>/<name>``, ``name`` defaulting to ``time.time()``: an extra run per call
        in the dashboard, whose hparams row is not the run that holds the curves.
        ``name="."`` lands in the run directory but opens a second event file named by
        the same second and host, opened with "wb": called within the run's first
        second it truncates the run's own event file (seen: all scalars lost). So the
        three hparams summaries are written here, by the run's own writer, into the run
        directory; TensorBoard then shows this run as the hparams session and reads
        each metric from this run's scalar series of that tag.

        Args:
            hparams: Name -> value; values other than bool/int/float/str are stringified.
                Use the same keys in every run of an experiment: TensorBoard takes the
                column list from one run.
            metrics: Tag -> number. A tag not yet written by :meth:`scalars` is written
                now as a scalar at ``step`` (prefer ``hparam/...`` tags); a tag that
                :meth:`scalars` already wrote is shown with that series' latest value.
            step: Step of the metric scalars; defaults to the last step logged.
        """
        if self._events is None:
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
        experiment, start, end = hparams_summaries(hp, values)
        for summary in (experiment, start, end):
            self._events.write(None, summary)
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
        """Writes buffered events to the file, so that readers see them."""
        if self._events is not None:
            self._events.flush()

    def close(self) -> None:
        """Flushes and closes the event file; later calls are no-ops."""
        if self._events is not None:
            self._events.close()
            self._events = None

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


# --------------------------------------------------------------------------- timeline plot

_PHASE_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868"}
_OTHER_COLORS = ("#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974", "#64b5cd")


def _field(obj, name: str):
    if isinstance(obj, Mapping):
        return obj.get(name, [])
    return getattr(obj, name, [])


def plot_timeline(timeline, floor_bytes: int | None = None, title: str | None = None):
    """Draws allocated MB over one step, with phases shaded, the peak and the floor.

    Returns a ``matplotlib.figure.Figure`` not registered with pyplot, rendered with
    the Agg canvas: no global backend is chosen or changed, and nothing needs closing.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415

    events = list(_field(timeline, "events"))
    marks = sorted(_field(timeline, "marks"), key=lambda m: m[0])
    fig = Figure(figsize=(8, 4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_xlabel("time in step (ms)")
    ax.set_ylabel("allocated (MB)")
    ax.set_title(title or "memory timeline")
    if not events:
        ax.text(0.5, 0.5, "no allocations recorded", ha="center", va="center",
                transform=ax.transAxes)
        return fig

    t_ms = [e[0] * 1e3 for e in events]
    mb = [e[1] / MB for e in events]
    end = max(t_ms[-1], max((m[0] * 1e3 for m in marks), default=0.0))
    ax.step(t_ms + [end], mb + [mb[-1]], where="post", color="black", lw=1.2,
            label="allocated")

    colors = dict(_PHASE_COLORS)
    spare = itertools.cycle(_OTHER_COLORS)
    label_tf = ax.get_xaxis_transform()  # x in data, y in axes fraction
    for i, (start, phase) in enumerate(marks):
        stop = marks[i + 1][0] * 1e3 if i + 1 < len(marks) else end
        start *= 1e3
        if stop <= start or not phase:
            continue
        color = colors.setdefault(phase, next(spare))
        ax.axvspan(start, stop, color=color, alpha=0.15, lw=0)
        ax.text((start + stop) / 2, 0.98, phase, transform=label_tf, ha="center",
                va="top", fontsize=8, color=color, clip_on=True)

    peak = max(range(len(mb)), key=mb.__getitem__)
    phase = events[peak][4] if len(events[peak]) > 4 else ""
    ax.plot([t_ms[peak]], [mb[peak]], "o", color="crimson", ms=5)
    right_half = t_ms[peak] > 0.6 * end
    ax.annotate(f"peak {mb[peak]:.1f} MB" + (f" ({phase})" if phase else ""),
                (t_ms[peak], mb[peak]), xytext=(-6 if right_half else 6, 5),
                textcoords="offset points", ha="right" if right_half else "left",
                fontsize=8, color="crimson",
                bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.8})
    if floor_bytes is not None:
        ax.axhline(floor_bytes / MB, color="gray", ls="--", lw=1,
                   label=f"floor {floor_bytes / MB:.1f} MB")
    ax.set_xlim(0, end if end > 0 else 1.0)
    top = max(mb + ([floor_bytes / MB] if floor_bytes is not None else []))
    ax.set_ylim(0, top * 1.15 if top > 0 else 1.0)
    ax.legend(loc="lower right", fontsize=8)
    return fig


# --------------------------------------------------------------------------- progress


class Progress:
    """A tqdm bar on stderr with loss, samples/s and peak MB; a no-op when disabled.

    Pass ``disable=rank != 0`` (or when the user turned the bar off). :meth:`update`
    takes the number of steps done so far, so calling it every step or only on logging
    steps both work; the bar is redrawn at most every ``log_every`` steps (and at the
    last step), so the other calls cost a comparison. When the stream is not a terminal
    (CI, files) tqdm also redraws at most every ``non_tty_interval`` seconds instead of
    filling the log.

    Args:
        total: Number of steps, or None if unknown.
        disable: True for a no-op (no tqdm import, no output).
        log_every: Steps between redraws.
        desc: Text before the bar.
        initial: Steps already done (when resuming).
        file: Stream to write to; defaults to ``sys.stderr`` at construction time.
        non_tty_interval: Seconds between redraws on a non-terminal stream.
    """

    def __init__(self, total: int | None = None, *, disable: bool = False, log_every: int = 10,
                 desc: str | None = "train", initial: int = 0, file=None,
                 non_tty_interval: float = 30.0):
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {log_every}")
        self.log_every = int(log_every)
        self.total = total
        self._bar = None
        self._step = self._shown = int(initial)
        self._last: dict[str, Any] = {}
        if disable:
            return
        from tqdm import tqdm  # noqa: PLC0415

        file = sys.stderr if file is None else file
        try:
            tty = file.isatty()
        except (AttributeError, ValueError, OSError):
            tty = False
        self._bar = tqdm(total=total, desc=desc, initial=initial, file=file,
                         dynamic_ncols=True, unit="step", leave=True,
                         mininterval=0.1 if tty else non_tty_interval)

    @property
    def disabled(self) -> bool:
        return self._bar is None

    def update(self, step: int, *, loss=None, samples_per_sec=None, peak_mb=None,
               **extra) -> None:
        """Sets the number of steps done to ``step`` and the values shown.

        A value passed as None keeps the one shown before; extra keyword values are
        shown too, formatted by :func:`format_value`.
        """
        if self._bar is None:
            return
        self._step = step
        last = self._last
        if loss is not None:
            last["loss"] = loss
        if samples_per_sec is not None:
            last["samples/s"] = samples_per_sec
        if peak_mb is not None:
            last["peak_mb"] = peak_mb
        if extra:
            last.update(extra)
        if step - self._shown >= self.log_every or (self.total is not None and step >= self.total):
            self._show()

    def _show(self) -> None:
        if self._last:
            self._bar.set_postfix(
                {k: format_value(k, v) for k, v in self._last.items() if v is not None},
                refresh=False)
        self._bar.update(self._step - self._bar.n)
        self._shown = self._step

    def close(self) -> None:
        """Shows the last values and closes the bar; later calls are no-ops."""
        if self._bar is None:
            return
        if self._step != self._shown:
            self._show()
        self._bar.close()
        self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- tables


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


def format_summary(rows: Sequence[Mapping[str, Any]],
                   columns: Sequence[tuple[str, str]]) -> str:
    """Renders rows as a plain-text table with aligned columns.

    Args:
        rows: One mapping per row; a missing key shows ``-``.
        columns: ``(key, header)`` pairs, in order. Values are formatted by
            :func:`format_value` from the key; a column whose values are all numbers
            is right-aligned, any other column left-aligned.

    Returns:
        Header, a rule of dashes, then one line per row, without trailing spaces.
    """
    cells = [[format_value(key, row.get(key)) for key, _ in columns] for row in rows]
    widths, right = [], []
    for j, (key, header) in enumerate(columns):
        widths.append(max([len(header)] + [len(r[j]) for r in cells]))
        present = [row.get(key) for row in rows if row.get(key) is not None]
        right.append(bool(present) and all(
            isinstance(v, numbers.Real) and not isinstance(v, bool) for v in present))

    def line(texts):
        parts = [t.rjust(w) if r else t.ljust(w) for t, w, r in zip(texts, widths, right)]
        return "  ".join(parts).rstrip()

    out = [line([h for _, h in columns]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    return "\n".join(out)


# --------------------------------------------------------------------------- reading back


def read_scalars(run_dir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """Reads every scalar series of a run's event files with TensorBoard's reader.

    Needs the ``tensorboard`` package (the ``test`` extra). Values come back as
    TensorBoard stores them: float32.

    Returns:
        Tag -> ``[(step, value), ...]`` in the order written, tags sorted.
    """
    path = os.fspath(run_dir)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no run directory {path!r}")
    try:
        from tensorboard.backend.event_processing.event_accumulator import (  # noqa: PLC0415
            EventAccumulator,
        )
    except ImportError as e:
        raise ImportError(
            "read_scalars needs the tensorboard package: pip install -e '.[test]'"
        ) from e
    acc = EventAccumulator(path, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in sorted(acc.Tags()["scalars"])}
