"""Stopping a run at a step boundary on a signal, so that an interruption loses nothing.

SIGINT (Ctrl-C), SIGTERM (what ``kill``, Slurm at the time limit and a preemption send)
and SIGUSR1 (what Slurm sends ahead of the time limit with ``--signal=USR1@120``) only
*ask* the training loop to stop: the step in flight finishes, every rank agrees on the
step to stop after (:meth:`Trainer._stop_agreed`: one scalar MAX-allreduce per step, so
one signalled rank is enough), the loop writes its checkpoint and raises
:class:`~trainers.trainer.Interrupted`, and the script prints the command that resumes it.

A second Ctrl-C stops at once (``KeyboardInterrupt``), as users expect from a program
that is taking its time. The handlers live only while the loop runs (:class:`StopSignals`
is a context manager): between runs, a signal does what it did before.

Nothing here prints from inside a handler with ``print``: a handler runs between two
bytecodes of the main thread, possibly inside a ``print`` to the same stream, and
Python's buffered streams refuse to be re-entered. The one notice goes out with a
single ``os.write`` to the stream's file descriptor.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

__all__ = ["STOP_SIGNALS", "StopSignals", "signal_name"]

#: The signals that stop a run at the next step boundary (names: SIGUSR1 is absent on Windows).
STOP_SIGNALS = tuple(s for s in ("SIGINT", "SIGTERM", "SIGUSR1") if hasattr(signal, s))


def signal_name(signum: int) -> str:
    """``"SIGTERM"`` for 15; ``"signal 99"`` for a number with no name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopSignals:
    """While active, turns :data:`STOP_SIGNALS` into a request: :attr:`received` holds the signal.

    Args:
        announce: Write one line to stderr when the first signal arrives (rank 0 only, so
            that a job of N ranks that all get the signal says it once).
        step: A callable giving the step in flight, named in that line.

    Installing handlers needs the main thread; elsewhere (a trainer driven from another
    thread) the context manager installs nothing and :attr:`received` stays 0.
    """

    def __init__(self, announce: bool = True, step=None) -> None:
        self.received = 0
        self._announce = announce
        self._step = step
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for name in STOP_SIGNALS:
                signum = getattr(signal, name)
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.received:
            if signum == signal.SIGINT:  # a second Ctrl-C: now, without the checkpoint
                raise KeyboardInterrupt
            return  # already stopping
        self.received = signum
        if self._announce:
            step = f" {self._step() + 1}" if self._step is not None else ""
            again = "; Ctrl-C again stops at once, without it" if signum == signal.SIGINT else ""
            line = f"\n{signal_name(signum)}: finishing step{step}, then writing a checkpoint{again}\n"
            try:
                os.write(sys.stderr.fileno(), line.encode())
            except (OSError, ValueError, AttributeError):  # no usable stderr: stop quietly
                pass
