"""Finding the ``mpiexec`` that launches jobs of this environment."""

from __future__ import annotations

import os
import shutil
import sys


def find_mpiexec() -> str | None:
    """The mpiexec to launch jobs with: the one beside this interpreter (where the mpich
    wheel installs it), else the first on PATH; None when there is none."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpiexec")
