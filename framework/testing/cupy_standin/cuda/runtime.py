"""``cupy.cuda.runtime`` of the stand-in: a machine with ``_DEVICE_COUNT`` simulated GPUs.

The current device is per host thread, as CUDA's is. Nothing here waits for anything:
every stand-in operation has finished when its call returns.
"""

from __future__ import annotations

import threading
import weakref

from .. import counting

#: How many GPUs the stand-in simulates. Two, so that code choosing a GPU per rank,
#: moving arrays between GPUs and NCCL with one GPU per rank all run.
_DEVICE_COUNT = 2

#: The stand-in reports CUDA 12.8 (runtime and driver), as ``runtimeGetVersion`` encodes it.
_CUDA_VERSION = 12080

is_hip = False

_local = threading.local()

#: Every single-device memory pool (``cuda.memory`` registers them): what a device's
#: memory holds, for ``memGetInfo``.
_pools: weakref.WeakSet = weakref.WeakSet()

#: Set by :mod:`.graph` (which imports this module): a capture on a device, and how a
#: refused call fails it.
_any_capture = None
_fail = None


class CUDARuntimeError(RuntimeError):
    """What CuPy raises for a failed CUDA runtime call (``status`` is the CUDA error code)."""

    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(message)


# cudaStreamCaptureMode (CuPy's runtime has these names)
streamCaptureModeGlobal = 0  # noqa: N816 - CUDA's names
streamCaptureModeThreadLocal = 1  # noqa: N816
streamCaptureModeRelaxed = 2  # noqa: N816


def getDeviceCount() -> int:  # noqa: N802 - CuPy's names
    return _DEVICE_COUNT


def getDevice() -> int:  # noqa: N802
    """The calling thread's current device (0 until ``setDevice``)."""
    return getattr(_local, "device", 0)


def setDevice(device: int) -> None:  # noqa: N802
    device = int(device)
    if not 0 <= device < _DEVICE_COUNT:
        raise CUDARuntimeError(101, "cudaErrorInvalidDevice: invalid device ordinal")
    _local.device = device


def deviceSynchronize() -> None:  # noqa: N802
    """Nothing to wait for: the stand-in runs every operation when it is called (a host
    synchronization on a GPU). Refused while a stream of the device captures
    (``cudaErrorStreamCaptureUnsupported``, which invalidates the capture)."""
    capture = _any_capture(getDevice()) if _any_capture is not None else None
    if capture is not None:
        raise _fail(capture)
    counting.host_sync("synchronize")


def runtimeGetVersion() -> int:  # noqa: N802
    return _CUDA_VERSION


def driverGetVersion() -> int:  # noqa: N802
    return _CUDA_VERSION


def getDeviceProperties(device: int) -> dict:  # noqa: N802
    """A subset of ``cudaDeviceProp`` (CuPy returns it as a dict; ``name`` is bytes)."""
    if not 0 <= int(device) < _DEVICE_COUNT:
        raise CUDARuntimeError(101, "cudaErrorInvalidDevice: invalid device ordinal")
    return {
        "name": b"CuPy stand-in (NumPy on the CPU)",
        "totalGlobalMem": 16 * 2**30,
        "multiProcessorCount": 2,
        "major": 8,
        "minor": 0,
        "pciBusID": int(device),
    }


def memGetInfo() -> tuple[int, int]:  # noqa: N802
    """``(free, total)`` bytes of the current device: its nominal size less what the
    stand-in's pools hold on it (in use and cached)."""
    return _mem_info(getDevice())


def _mem_info(device: int) -> tuple[int, int]:
    total = getDeviceProperties(device)["totalGlobalMem"]
    held = sum(p.total_bytes() for p in list(_pools) if p._device_id == device)
    return total - held, total
