"""The one place that chooses the array module: NumPy on the CPU, CuPy on a GPU.

Every other module asks this one for ``xp`` (the array module of a device or an
array) instead of importing NumPy or CuPy for compute, so the same op code runs on
both. CuPy is imported lazily and only when a CUDA device is asked for, so the
framework imports and its tests run on machines without it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

_DEVICE_RE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")
_cupy = None  # the module once imported; False when the import failed


@dataclass(frozen=True)
class Device:
    """A device: ``Device("cpu")``, ``Device("cuda", 0)``. Printed as PyTorch prints it."""

    type: str
    index: int | None = None

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"

    def __repr__(self) -> str:
        return f"device(type='{self.type}'" + ("" if self.index is None else f", index={self.index}") + ")"


CPU = Device("cpu")


def device(spec: str | Device | None) -> Device:
    """Parses ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` into a :class:`Device`."""
    if spec is None:
        return CPU
    if isinstance(spec, Device):
        return spec
    m = _DEVICE_RE.match(str(spec).strip())
    if not m:
        raise ValueError(f"unknown device {spec!r}: use 'cpu', 'cuda' or 'cuda:N'")
    kind, index = m.group(1), m.group(2)
    if kind == "cpu":
        if index not in (None, "0"):
            raise ValueError(f"unknown device {spec!r}: there is one cpu device, write 'cpu'")
        return CPU
    return Device("cuda", int(index) if index is not None else 0)


def cupy_module():
    """Returns the CuPy module, or None when CuPy is missing or sees no GPU."""
    global _cupy
    if _cupy is None:
        try:
            import cupy  # noqa: PLC0415  (optional dependency)

            cupy.cuda.runtime.getDeviceCount()
            _cupy = cupy
        except Exception:  # ImportError, or CUDA present but no usable device
            _cupy = False
    return _cupy or None


def is_cuda_available() -> bool:
    """True when CuPy is installed and sees at least one GPU."""
    return cupy_module() is not None


def xp_for(dev: Device):
    """The array module for a device: NumPy for ``cpu``, CuPy for ``cuda``."""
    if dev.type == "cpu":
        return np
    cp = cupy_module()
    if cp is None:
        raise RuntimeError(
            f"device {dev} was asked for, but CuPy is not installed or sees no GPU: "
            "install the GPU extra (pip install -e '.[gpu]') on a machine with CUDA, or use device 'cpu'"
        )
    return cp


def get_array_module(array):
    """The array module of an array (NumPy for NumPy arrays and scalars)."""
    if isinstance(array, np.ndarray) or _cupy is None or _cupy is False:
        return np
    return _cupy.get_array_module(array)


def device_of(array) -> Device:
    """The device an array lives on."""
    if isinstance(array, np.ndarray):
        return CPU
    cp = cupy_module()
    if cp is not None and isinstance(array, cp.ndarray):
        return Device("cuda", array.device.id)
    return CPU


def to_device(array, dev: Device):
    """Copies an array to a device (returns it unchanged if it is already there)."""
    if device_of(array) == dev:
        return array
    if dev.type == "cpu":
        return array.get()
    cp = xp_for(dev)
    with cp.cuda.Device(dev.index):
        return cp.asarray(array)


def to_numpy(array) -> np.ndarray:
    """A NumPy array with the same values (copies from the GPU when needed)."""
    return array if isinstance(array, np.ndarray) else array.get()
