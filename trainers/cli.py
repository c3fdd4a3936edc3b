"""What every command-line entry point shares: user errors as one line, no traceback.

Errors a user can cause print ``error: ...`` and exit non-zero: bad input (the config,
the model's name and arguments, the data, a checkpoint that cannot be read or trusted)
with status 2, a loss that stopped being finite with status 3. A run stopped by a signal
(:class:`~trainers.trainer.Interrupted`) says where its checkpoint is and the command that
resumes it, and exits with 128 + the signal (130 for Ctrl-C, 143 for SIGTERM), as a shell
reports a process the signal ended. Anything else is a bug and keeps its traceback;
under MPI the abort hook ends every rank instead of leaving them hanging.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Callable, Sequence

import numpy as np

from framework.distributed.comm import get_world, install_abort_on_exception

from .checkpoint import CheckpointError
from .config import ConfigError
from .trainer import Interrupted, TrainingError

EXIT_BAD_INPUT = 2
EXIT_TRAINING_STOPPED = 3


def run_cli(fn, resume_args: Callable[[], Sequence[str]] | None = None) -> int:
    """Runs ``fn()`` and turns the errors a user can cause into one line and an exit code.

    Args:
        fn: The command's work; returns the exit status.
        resume_args: The script's arguments that resume it (``--resume`` included), for
            the line a run stopped by a signal ends with.
    """
    comm = get_world()
    install_abort_on_exception(comm)
    # A diverging run is reported once, by the trainer's non-finite loss check, not by a
    # stream of NumPy overflow warnings before it.
    np.seterr(over="ignore", invalid="ignore", divide="ignore")
    try:
        return fn()
    except (ConfigError, CheckpointError) as e:
        return _fail(comm, e, EXIT_BAD_INPUT)
    except TrainingError as e:
        return _fail(comm, e, EXIT_TRAINING_STOPPED)
    except Interrupted as e:  # every rank stopped after the same step: no abort needed
        if comm.is_main:
            print(str(e), file=sys.stderr)
            if resume_args is not None:
                print(f"resume with: {command_line(resume_args(), comm.size)}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        if comm.is_main:
            print("interrupted", file=sys.stderr)
        return 130


def command_line(args: Sequence[str], processes: int = 1) -> str:
    """The shell command that runs this script with ``args``: as typed, quoted where needed.

    ``python`` when that is the interpreter running now (else its full path), the script
    as it was named, and ``mpiexec -n N`` in front under several processes (``srun -n N``
    works the same under Slurm).
    """
    python = sys.executable
    found = shutil.which("python")
    if found and os.path.realpath(found) == os.path.realpath(sys.executable):
        python = "python"
    words = [python, sys.argv[0], *args]
    if processes > 1:
        words = ["mpiexec", "-n", str(processes), *words]
    return shlex.join(words)


def _fail(comm, error, code: int) -> int:
    if comm.size == 1:
        print(f"error: {error}", file=sys.stderr)
        return code
    # A config error fails every rank alike; a non-finite loss may fail one rank only,
    # and the others would wait for it forever in a collective: end the whole job.
    print(f"[rank {comm.rank}] error: {error}", file=sys.stderr, flush=True)
    comm.abort(code)
    return code
