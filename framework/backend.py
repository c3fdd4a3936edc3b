"""The one place that chooses the array module: NumPy on the CPU, CuPy on a GPU.

Every other module asks this one for ``xp`` (the array module of a device or an
array) instead of importing NumPy or CuPy for compute, so the same op code runs on
both. CuPy is imported lazily and only when a CUDA device is asked for, so the
framework imports and its tests run on machines without it.
"""

from __future__ import annotations

import contextlib
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


def cuda_unavailable_reason() -> str | None:
    """Why CuPy cannot run here (a clause for an error message), or None when it can."""
    if is_cuda_available():
        return None
    import importlib.util  # noqa: PLC0415

    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed: pip install -e '.[gpu]' on a machine with CUDA"
    return ("CuPy sees no usable GPU (no CUDA driver or device here: check nvidia-smi and "
            "CUDA_VISIBLE_DEVICES)")


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


def _cupy_if_array(obj):
    """CuPy, when ``obj`` is a CuPy array (imports CuPy only for objects that may be one)."""
    cp = _cupy
    if cp is None and hasattr(obj, "__cuda_array_interface__"):
        cp = cupy_module()  # a device array made before anything here asked for CuPy
    if cp and isinstance(obj, cp.ndarray):
        return cp
    return None


def get_array_module(array):
    """The array module of an array (NumPy for NumPy arrays and scalars)."""
    if isinstance(array, np.ndarray):
        return np
    return _cupy_if_array(array) or np


def is_array(obj) -> bool:
    """True for a NumPy or CuPy array (not for scalars, lists or tensors)."""
    return isinstance(obj, np.ndarray) or _cupy_if_array(obj) is not None


def device_of(array) -> Device:
    """The device an array lives on."""
    if isinstance(array, np.ndarray):
        return CPU
    if _cupy_if_array(array) is not None:
        return Device("cuda", array.device.id)
    return CPU


def device_context(dev: Device):
    """A context in which new arrays are allocated on ``dev`` (nothing to do on the CPU).

    CuPy allocates on its *current* device, so creating an array for ``cuda:1`` needs
    ``cupy.cuda.Device(1)`` around the call.
    """
    if dev.type == "cpu":
        return contextlib.nullcontext()
    return xp_for(dev).cuda.Device(dev.index)


def to_device(array, dev: Device):
    """Copies an array to a device (returns it unchanged if it is already there)."""
    if device_of(array) == dev:
        return array
    if dev.type == "cpu":
        return array.get()
    cp = xp_for(dev)
    with cp.cuda.Device(dev.index):
        if isinstance(array, cp.ndarray):
            # Another GPU: cupy.asarray would return the array itself (it does not move
            # arrays between devices); ndarray.copy() copies to the current device.
            return array.copy()
        return cp.asarray(array)


def to_numpy(array) -> np.ndarray:
    """A NumPy array with the same values (copies from the GPU when needed)."""
    return array if isinstance(array, np.ndarray) else array.get()


# --- calls that differ between NumPy and CuPy ------------------------------------------

def reshape_view(array, shape):
    """``array`` reshaped WITHOUT copying, or None when its strides do not allow it.

    NumPy: ``np.reshape(copy=False)`` raises instead of copying. CuPy's ``reshape``
    silently copies (its ``copy=False`` exists only in recent versions), but its ``shape``
    setter reshapes in place or raises, in every version.
    """
    if isinstance(array, np.ndarray):
        try:
            return np.reshape(array, shape, copy=False)
        except ValueError:
            return None
    shape = _known_shape(tuple(shape), array.size)
    if shape is None:
        return None
    out = array.view()
    try:
        out.shape = shape
    except (AttributeError, ValueError):
        return None
    return out


def _known_shape(shape: tuple, size: int):
    """``shape`` with a -1 resolved against ``size``; None when no such shape holds ``size``
    (the shape setter's documentation does not promise to resolve -1 itself)."""
    known = 1
    for n in shape:
        if n != -1:
            known *= n
    if shape.count(-1) > 1 or (-1 not in shape and known != size):
        return None
    if -1 in shape:
        if known == 0 or size % known:
            return None
        shape = tuple(size // known if n == -1 else n for n in shape)
    return shape


def scatter_add(array, index, values) -> None:
    """``array[index] += values`` where repeated indices ADD up (``np.add.at``), in place.

    CuPy's equivalent is ``cupyx.scatter_add`` (documented to behave identically to
    ``numpy.add.at``, with int/bool arrays, slices, ellipsis and newaxis in ``index``).
    """
    if isinstance(array, np.ndarray):
        np.add.at(array, index, values)
        return
    import cupyx  # noqa: PLC0415  (present wherever CuPy is)

    cupyx.scatter_add(array, index, values)


def index_like(item, array):
    """An index item (a list, or a NumPy or CuPy array of ints or bools) on ``array``'s device.

    NumPy takes lists and NumPy arrays as they are; a CuPy array is indexed with CuPy
    arrays on its own device (as PyTorch moves a CPU index tensor to the indexed tensor's
    device).
    """
    if isinstance(array, np.ndarray):
        return item
    return to_device(item if is_array(item) else np.asarray(item), device_of(array))


def index_bounds_checked(array) -> bool:
    """Whether indexing ``array`` with an out-of-bounds integer array raises by itself.

    NumPy raises IndexError; CuPy wraps the index around silently (see "Out-of-bounds
    indices" in CuPy's differences from NumPy), so callers check such indices themselves.
    """
    return isinstance(array, np.ndarray)


def rng_key(xp):
    """The key of ``xp``'s random generator: one per array module, and per GPU for CuPy
    (a CuPy generator keeps its state on the device that was current when it was made)."""
    if xp is np:
        return "numpy"
    return f"{xp.__name__}:{xp.cuda.runtime.getDevice()}"
