"""Ending the whole job when one rank fails, instead of leaving the others waiting.

mpi4py finalizes MPI at exit, so an uncaught exception on one rank would leave the
others blocked in their next collective. :func:`install` makes such an exception print
its traceback (each line prefixed ``[rank R]``) and abort every rank.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback

# MPI_Abort does not wait for the launcher to forward what this rank wrote to stderr
# (MPICH's hydra lost the report about once in 25 aborts from a thread): give it a moment.
_FORWARD_SECONDS = 0.25


def flush_std_streams() -> None:
    """Flushes stdout and stderr (before an abort, which does not flush them)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not stop the abort
            pass


def _report(rank: int, exc_type, exc_value, exc_tb, thread_name: str | None = None) -> None:
    text = "".join(traceback.format_exception(exc_type, exc_value, exc_tb))
    where = f" in thread {thread_name!r}" if thread_name else ""
    lines = [f"[rank {rank}] uncaught exception{where}, aborting the job"]
    lines += [f"[rank {rank}] {line}" for line in text.rstrip("\n").splitlines()]
    try:
        sys.stderr.write("\n".join(lines) + "\n")
    except Exception:  # noqa: BLE001
        pass
    flush_std_streams()
    time.sleep(_FORWARD_SECONDS)


def install(comm) -> None:
    """Installs the abort hooks for ``comm`` (a communicator: ``rank``, ``size``, ``abort``).

    With more than one rank, installs ``sys.excepthook`` and ``threading.excepthook``
    handlers that report the exception and call ``comm.abort(1)``; with one rank nothing
    is installed (the default behaviour, print and exit non-zero, is already right).
    Calling it again is a no-op.
    """
    if comm.size <= 1:
        return

    if not getattr(sys.excepthook, "_inplace_lab_abort", False):

        def excepthook(exc_type, exc_value, exc_tb):
            _report(comm.rank, exc_type, exc_value, exc_tb)
            comm.abort(1)

        excepthook._inplace_lab_abort = True  # type: ignore[attr-defined]
        sys.excepthook = excepthook

    if not getattr(threading.excepthook, "_inplace_lab_abort", False):

        def thread_excepthook(args):
            if args.exc_type is SystemExit:  # like the default hook: a thread may exit
                return
            name = args.thread.name if args.thread is not None else None
            _report(comm.rank, args.exc_type, args.exc_value, args.exc_traceback, name)
            comm.abort(1)

        thread_excepthook._inplace_lab_abort = True  # type: ignore[attr-defined]
        threading.excepthook = thread_excepthook
