"""What every command-line entry point shares: user errors as one line, no traceback.

Errors a user can cause print ``error: ...`` and exit non-zero: bad input (the config,
the model's name and arguments, a checkpoint that cannot be read or trusted) with
status 2, a loss that stopped being finite with status 3. Anything else is a bug and
keeps its traceback; under MPI the abort hook ends every rank instead of leaving them
hanging.
"""

from __future__ import annotations

import sys

import numpy as np

from framework.distributed.comm import get_world, install_abort_on_exception

from .checkpoint import CheckpointError
from .config import ConfigError
from .trainer import TrainingError

EXIT_BAD_INPUT = 2
EXIT_TRAINING_STOPPED = 3


def run_cli(fn) -> int:
    """Runs ``fn()`` and turns the errors a user can cause into one line and an exit code."""
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
    except KeyboardInterrupt:
        if comm.is_main:
            print("interrupted", file=sys.stderr)
        return 130


def _fail(comm, error, code: int) -> int:
    if comm.size == 1:
        print(f"error: {error}", file=sys.stderr)
        return code
    # A config error fails every rank alike; a non-finite loss may fail one rank only,
    # and the others would wait for it forever in a collective: end the whole job.
    print(f"[rank {comm.rank}] error: {error}", file=sys.stderr, flush=True)
    comm.abort(code)
    return code
