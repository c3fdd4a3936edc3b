"""Stopping a run at a step boundary on a signal, so that an interruption loses nothing.

SIGINT (Ctrl-C), SIGTERM (what ``kill``, Slurm at the time limit and a preemption send)
and SIGUSR1 (what Slurm sends ahead of the time limit with ``--signal=USR1@120``) only
*ask* the training loop to stop: the step in flight finishes, every rank agrees on the
step to stop after (:class:`StopAgreement`, so one signalled rank is enough), the loop
writes its checkpoint and raises :class:`~trainers.trainer.Interrupted`, and the script
prints the command that resumes it.

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

import numpy as np

__all__ = ["STOP_SIGNALS", "StopAgreement", "StopSignals", "signal_name"]

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
        doing: A callable naming what the run finishes before it stops (``"step 7"``,
            ``"the final evaluation and summary"``), named in that line.

    Installing handlers needs the main thread; elsewhere (a trainer driven from another
    thread) the context manager installs nothing and :attr:`received` stays 0.
    """

    def __init__(self, announce: bool = True, doing=None) -> None:
        self.received = 0
        self._announce = announce
        self._doing = doing
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
            doing = self._doing() if self._doing is not None else "the step in flight"
            again = "; Ctrl-C again stops at once, without it" if signum == signal.SIGINT else ""
            line = f"\n{signal_name(signum)}: finishing {doing}, then writing a checkpoint{again}\n"
            try:
                os.write(sys.stderr.fileno(), line.encode())
            except (OSError, ValueError, AttributeError):  # no usable stderr: stop quietly
                pass


class StopAgreement:
    """Whether any rank got a stop signal, agreed by every rank, without a wait in the step.

    After each step every rank starts a MAX-allreduce of the signal it got (0: none)
    without waiting for it (``iallreduce_``), and reads the one it started after the
    step before. Every rank reads the same result at the same step, so they all stop
    after the same step; a signal stops the run one step after it would in one process.
    A blocking allreduce would decide a step sooner, but it is one more point where the
    ranks wait for the slowest: on the quickstart MLP on 2 busy cores it cost 2-11% of a
    step, the non-blocking one nothing measurable (docs/BENCHMARKS.md, "What does stopping
    on a signal cost?").

    Args:
        comm: An MPI communicator (host buffers): the world, not a NCCL one.
    """

    def __init__(self, comm) -> None:
        self._comm = comm
        self._flag = np.zeros(1)
        self._pending = None

    def after_step(self, received: int) -> int:
        """Starts sharing ``received``; returns the signal agreed after the step before (0: go on)."""
        if self._comm.size == 1:
            return received
        agreed = self.close()
        self._flag[0] = received
        self._pending = self._comm.iallreduce_(self._flag, "max")
        return agreed

    def now(self, received: int) -> int:
        """The signal any rank got, agreed at once (a blocking collective every rank must
        call): for the run's end, where no later step would carry the agreement."""
        agreed = self.close()
        if self._comm.size == 1:
            return received or agreed
        self._flag[0] = max(received, agreed)
        self._comm.iallreduce_(self._flag, "max").wait()
        return int(self._flag[0])

    def close(self) -> int:
        """Completes the agreement in flight (every rank must: it is a collective); returns its signal."""
        if self._pending is None:
            return 0
        self._pending.wait()
        self._pending = None
        return int(self._flag[0])
