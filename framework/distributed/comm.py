"""Process-group communication for data-parallel training: MPI (mpi4py), NCCL on GPUs.

This module picks and wires the communicators; each part lives in a file of its own:

- :mod:`.mpi`: ``"mpi"`` (:class:`Communicator`): host NumPy arrays go straight to MPI
  (in place with ``MPI.IN_PLACE``), and :class:`SingleProcessCommunicator` (``"none"``):
  one process without MPI, identities; :func:`get_world` returns the one that applies.
- :mod:`.staging`: GPU (CuPy) arrays under MPI are STAGED: copied to host memory, reduced
  there and copied back (the MPI wheels are not CUDA-aware; the fallback, not the fast path).
- :mod:`.nccl`: ``"nccl"`` (:class:`NcclCommunicator`): CuPy arrays are reduced by NCCL on
  the GPU, bootstrapped by broadcasting rank 0's unique id over MPI.
- :mod:`.collective`: the argument checks and the :class:`Handle` of a non-blocking
  collective that every communicator shares.
- :mod:`.abort`: an uncaught exception on any rank ends the whole job.
- :mod:`.launch`: :func:`find_mpiexec`.

Every communicator has a ``backend`` attribute and the same methods; :func:`for_device`
picks the one a training run on a device should use.
"""

from __future__ import annotations

import warnings

from .. import backend as _backend
from . import abort as _abort
from .collective import Handle
from .launch import find_mpiexec
from .mpi import Communicator, SingleProcessCommunicator, get_world
from .nccl import NcclCommunicator, import_nccl, nccl_bootstrap

__all__ = [
    "Communicator",
    "NcclCommunicator",
    "SingleProcessCommunicator",
    "Handle",
    "BACKENDS",
    "find_mpiexec",
    "for_device",
    "get_world",
    "install_abort_on_exception",
    "nccl_bootstrap",
]

#: Values of ``distributed.backend`` (see :func:`for_device`).
BACKENDS = ("auto", "nccl", "mpi")


def for_device(world: Communicator, device, backend: str = "auto") -> Communicator:
    """The communicator a run on ``device`` uses for its gradients.

    ``backend`` is ``"auto"`` (NCCL for a multi-rank GPU run when CuPy can load NCCL, else
    MPI with host staging, said once in a warning), ``"nccl"`` (NCCL or a clear error) or
    ``"mpi"`` (always MPI; GPU buffers staged through host memory). On the CPU, and with
    one process, the answer is ``world`` itself.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown distributed backend {backend!r}; use one of: {', '.join(BACKENDS)}")
    dev = _backend.parse_device(device)  # a bare "cuda": the local rank's GPU
    if dev.type == "cpu":
        if backend == "nccl":
            raise ValueError("distributed backend 'nccl' needs device 'cuda'; on the CPU use 'mpi' or 'auto'")
        return world
    if world.size == 1 or backend == "mpi" or isinstance(world, NcclCommunicator):
        return world
    if backend == "auto":
        try:
            import_nccl()
        except RuntimeError as e:
            warnings.warn(f"{e}; falling back to MPI with host staging", RuntimeWarning, stacklevel=2)
            return world
    return NcclCommunicator(world.mpi_comm, device=dev.index)


def install_abort_on_exception(comm: Communicator | None = None) -> None:
    """Make an uncaught exception on any rank end the whole job instead of hanging it.

    With more than one rank, installs ``sys.excepthook`` and ``threading.excepthook``
    handlers that print the traceback, each line prefixed ``[rank R]``, to stderr, flush,
    and call ``MPI.COMM_WORLD.Abort(1)``; otherwise the other ranks would wait forever in
    their next collective. With one rank nothing is installed: the default behaviour
    (print the traceback, exit non-zero) is already right. Calling it again is a no-op.

    Args:
        comm: the communicator to report the rank of; defaults to :func:`get_world`.
    """
    _abort.install(get_world() if comm is None else comm)
