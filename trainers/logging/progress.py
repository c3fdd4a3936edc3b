"""The progress display of a training run: a bar on a terminal, lines anywhere else.

On a terminal, a tqdm bar redrawn in place. Anywhere else (a pipe, a file, CI, and
rank 0 under ``mpiexec``, whose output the launcher forwards through a pipe) a redrawn
bar shows nothing until the run ends, so the display prints one line every
``interval`` seconds instead, and one at the end::

    train  120/1320  loss=0.3123  samples/s=20123.4  peak_mb=1.2
"""

from __future__ import annotations

import sys
import time
from typing import Any

from .tables import format_value

__all__ = ["Progress"]


class Progress:
    """Steps done, loss, samples/s and peak MB of a run; a no-op when disabled.

    Pass ``disable=rank != 0`` (or when the user turned the display off).
    :meth:`update` takes the number of steps done so far, so calling it every step or
    only on logging steps both work.

    Args:
        total: Number of steps, or None if unknown.
        disable: True for a no-op (no tqdm import, no output).
        log_every: Steps between redraws of the terminal bar.
        desc: Label in front of the bar or line (the trainer passes the policy when
            several runs share one output).
        initial: Steps already done (when resuming).
        file: Stream to write to; defaults to ``sys.stderr`` at construction time.
        interval: Seconds between lines when ``file`` is not a terminal.
        clock: Monotonic clock in seconds (tests pass a fake one).
    """

    def __init__(
        self,
        total: int | None = None,
        *,
        disable: bool = False,
        log_every: int = 10,
        desc: str | None = "train",
        initial: int = 0,
        file=None,
        interval: float = 5.0,
        clock=time.monotonic,
    ):
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {log_every}")
        self.log_every = int(log_every)
        self.total = total
        self.desc = desc
        self.n = self._shown = int(initial)
        self._last: dict[str, Any] = {}
        self._bar = None
        self._file = None
        if disable:
            return
        self._file = sys.stderr if file is None else file
        try:
            tty = self._file.isatty()
        except (AttributeError, ValueError, OSError):
            tty = False
        if tty:
            from tqdm import tqdm  # noqa: PLC0415

            self._bar = tqdm(
                total=total,
                desc=desc,
                initial=initial,
                file=self._file,
                dynamic_ncols=True,
                unit="step",
                leave=True,
                mininterval=0.1,
            )
        else:
            self._interval, self._clock = float(interval), clock
            self._next_line = clock() + self._interval

    @property
    def disabled(self) -> bool:
        return self._file is None

    def update(self, step: int, *, loss=None, samples_per_sec=None, peak_mb=None, **extra) -> None:
        """Sets the number of steps done to ``step`` and the values shown.

        A value passed as None keeps the one shown before; extra keyword values are
        shown too, formatted by :func:`~trainers.logging.tables.format_value`.
        """
        if self._file is None:
            return
        self.n = step
        last = self._last
        if loss is not None:
            last["loss"] = loss
        if samples_per_sec is not None:
            last["samples/s"] = samples_per_sec
        if peak_mb is not None:
            last["peak_mb"] = peak_mb
        if extra:
            last.update((k, v) for k, v in extra.items() if v is not None)
        done = self.total is not None and step >= self.total
        if self._bar is not None:
            if step - self._shown >= self.log_every or done:
                self._show()
        elif done or self._clock() >= self._next_line:
            self._show()

    def _values(self) -> dict[str, str]:
        return {k: format_value(k, v) for k, v in self._last.items()}

    def _show(self) -> None:
        if self._bar is not None:
            if self._last:
                self._bar.set_postfix(self._values(), refresh=False)
            self._bar.update(self.n - self._bar.n)
        else:
            count = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
            parts = [self.desc, count] if self.desc else [count]
            parts += [f"{k}={v}" for k, v in self._values().items()]
            print("  ".join(parts), file=self._file, flush=True)
            self._next_line = self._clock() + self._interval
        self._shown = self.n

    def close(self) -> None:
        """Shows the last values (unless shown already) and ends; later calls are no-ops."""
        if self._file is None:
            return
        if self.n != self._shown:
            self._show()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._file = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
