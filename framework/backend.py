"""The one place that chooses the array module and makes every device decision.

NumPy on the CPU, CuPy on a GPU. Every other module asks this one for ``xp`` (the array
module of a device or an array) instead of importing NumPy or CuPy for compute, so the
same op code runs on both. Device specs (``"cpu"``, ``"cuda"``, ``"cuda:N"``) are parsed
here only (:func:`parse_device`), and CuPy's device API (devices, streams, events) is
called here only: the trainer, memory accounting and the communicators use the small
functions below.

CuPy is imported lazily and only when a CUDA device is asked for, so the framework
imports and its tests run on machines without it. The environment variable
``INPLACE_LAB_CUPY`` (:data:`CUPY_ENV`) says what to load as CuPy: ``cupy`` (the
default: the real one), ``standin`` (:mod:`framework.testing.cupy_standin`, CuPy's
behaviour on the CPU, so GPU code paths run in tests without a GPU) or ``none`` (behave
as if CuPy were not installed).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
import threading
from dataclasses import dataclass

import numpy as np

_DEVICE_RE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")

#: The environment variable that chooses what :func:`cupy_module` loads.
CUPY_ENV = "INPLACE_LAB_CUPY"
# What each choice loads: (the module used as ``cupy``, the one used as ``cupyx``).
_CUPY_MODULES = {
    "cupy": ("cupy", "cupyx"),
    "standin": ("framework.testing.cupy_standin", "framework.testing.cupyx_standin"),
    "none": None,
}
_cupy = None  # the module once imported; False when the import failed
_cupyx = None
_cupy_error = None  # why the last load failed ("ImportError: ..."), for cuda_unavailable_reason


@dataclass(frozen=True)
class Device:
    """A device: ``Device("cpu")``, ``Device("cuda", 0)``. Printed as PyTorch prints it.

    ``index`` is None only for a bare ``"cuda"`` as :func:`parse_device` returns it (a GPU
    still to be chosen); :func:`device` resolves it.
    """

    type: str
    index: int | None = None

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"

    def __repr__(self) -> str:
        return f"device(type='{self.type}'" + ("" if self.index is None else f", index={self.index}") + ")"


CPU = Device("cpu")


def parse_device(spec: str | Device | None) -> Device:
    """Parses ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (or a :class:`Device`): the one parser.

    A bare ``"cuda"`` keeps ``index`` None (which GPU is decided later: the trainer gives
    each process its local rank's); ``None`` means the CPU.

    Raises:
        ValueError: not a device spec (the message says what is allowed).
    """
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
    return Device("cuda", int(index) if index is not None else None)


def device(spec: str | Device | None) -> Device:
    """Parses a device spec like :func:`parse_device`; a bare ``"cuda"`` is ``cuda:0``."""
    dev = parse_device(spec)
    return Device("cuda", 0) if dev.type == "cuda" and dev.index is None else dev


def cupy_choice() -> str:
    """What :func:`cupy_module` loads: ``"cupy"``, ``"standin"`` or ``"none"`` (from :data:`CUPY_ENV`).

    Raises:
        ValueError: the environment variable holds something else.
    """
    choice = os.environ.get(CUPY_ENV, "").strip() or "cupy"
    if choice not in _CUPY_MODULES:
        raise ValueError(f"{CUPY_ENV}={choice!r}: use one of {', '.join(_CUPY_MODULES)}")
    return choice


def cupy_module():
    """Returns the CuPy module (or its stand-in), or None when it is missing or sees no GPU."""
    global _cupy, _cupyx, _cupy_error
    if _cupy is None:
        names = _CUPY_MODULES[cupy_choice()]
        try:
            if names is None:
                raise ImportError(f"{CUPY_ENV}=none")
            cupy = importlib.import_module(names[0])
            if cupy.cuda.runtime.getDeviceCount() < 1:
                raise RuntimeError("CUDA reports no device")
            _cupyx = importlib.import_module(names[1])
            _cupy, _cupy_error = cupy, None
        except Exception as e:  # noqa: BLE001 - ImportError, a CUDA error, a broken install: all mean "no GPU"
            _cupy = False
            # Kept for cuda_unavailable_reason: a broken CuPy must say why, not pass for a missing one.
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
            _cupy_error = f"{type(e).__name__}: {first_line}" if first_line else type(e).__name__
    return _cupy or None


def forget_cupy() -> None:
    """Makes the next :func:`cupy_module` call load again (after :data:`CUPY_ENV` changed).

    Only for a process that has no device arrays yet (the test suite's start).
    """
    global _cupy, _cupyx, _cupy_error
    _cupy = _cupyx = _cupy_error = None


# --- NVIDIA's cuDNN frontend: the GPU convolutions (CuPy 14 has no cuDNN of its own) ----------

#: The environment variable that chooses what :func:`cudnn_module` loads: ``cudnn`` (the
#: real frontend, ``import cudnn``), ``standin`` (:mod:`framework.testing.cudnn_standin`)
#: or ``none`` (as if it were not installed). Unset: the one that goes with the loaded
#: CuPy (the real frontend with real CuPy, the stand-in with CuPy's stand-in).
CUDNN_ENV = "INPLACE_LAB_CUDNN"
_CUDNN_MODULES = {"cudnn": "cudnn", "standin": "framework.testing.cudnn_standin", "none": None}
_cudnn = None  # the module once imported; False when it cannot be used


def cudnn_choice() -> str:
    """What :func:`cudnn_module` loads: ``"cudnn"``, ``"standin"`` or ``"none"`` (from :data:`CUDNN_ENV`).

    Raises:
        ValueError: the variable holds something else, or pairs a frontend with the other
            CuPy (the real frontend reads real device pointers; the stand-in, stand-in arrays).
    """
    paired = "standin" if cupy_choice() == "standin" else "cudnn"
    choice = os.environ.get(CUDNN_ENV, "").strip() or paired
    if choice not in _CUDNN_MODULES:
        raise ValueError(f"{CUDNN_ENV}={choice!r}: use one of {', '.join(_CUDNN_MODULES)}")
    if choice != "none" and choice != paired:
        raise ValueError(
            f"{CUDNN_ENV}={choice!r} does not go with {CUPY_ENV}={cupy_choice()!r}: use {paired!r} or 'none'"
        )
    return choice


def cudnn_module():
    """NVIDIA's cuDNN frontend (or its stand-in) for the loaded CuPy, or None when it is not
    installed, its cuDNN library does not load, or there is no CuPy."""
    global _cudnn
    if _cudnn is None:
        name = _CUDNN_MODULES[cudnn_choice()]
        try:
            if name is None or cupy_module() is None:
                raise ImportError(name)
            module = importlib.import_module(name)
            module.backend_version()  # the frontend imports without cuDNN; this call needs it
            _cudnn = module
        except Exception:  # ImportError, or the cuDNN library missing
            _cudnn = False
    return _cudnn or None


def forget_cudnn() -> None:
    """Makes the next :func:`cudnn_module` call load again (after :data:`CUDNN_ENV` changed)."""
    global _cudnn
    _cudnn = None


def is_cuda_available() -> bool:
    """True when CuPy (or its stand-in) is loaded and sees at least one GPU."""
    return cupy_module() is not None


def cuda_unavailable_reason() -> str | None:
    """Why CuPy cannot run here (a clause for an error message), or None when it can."""
    if is_cuda_available():
        return None
    choice = cupy_choice()
    if choice == "none":
        return f"CuPy is switched off ({CUPY_ENV}=none)"
    if choice == "cupy" and importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed: pip install -e '.[gpu]' on a machine with CUDA"
    if _cupy_error is None:
        return "CuPy sees no usable GPU (no CUDA driver or device here: check nvidia-smi and CUDA_VISIBLE_DEVICES)"
    return (
        f"CuPy is installed but cannot be used ({_cupy_error}): check nvidia-smi, CUDA_VISIBLE_DEVICES "
        "and that the cupy-cuda wheel matches the driver's CUDA version"
    )


# CUDA's own words for "no GPU": no device, or (on a machine without NVIDIA's driver) no driver.
_NO_GPU_ERRORS = ("cudaErrorNoDevice", "cudaErrorInsufficientDriver", "CUDA reports no device")


def _driver_loads() -> bool:
    """Whether NVIDIA's driver library loads here (``libcuda.so.1``; ``nvcuda.dll`` on Windows)."""
    import ctypes  # noqa: PLC0415 - only where CuPy failed

    try:
        ctypes.CDLL("nvcuda.dll" if os.name == "nt" else "libcuda.so.1")
    except OSError:
        return False
    return True


def cupy_broken() -> bool:
    """Whether CuPy is installed but broken: it failed to load for a reason other than this
    machine having no GPU (a wheel for another CUDA, a driver too old for it, a damaged
    install). CUDA's "no device" or "insufficient driver" where NVIDIA's driver library does
    not load at all only means no GPU here, which a run that asks for none need not hear of
    (the test run says it in its header; :func:`cuda_unavailable_reason` gives the error to
    whoever asks for a GPU)."""
    if is_cuda_available() or _cupy_error is None or cupy_choice() == "none":
        return False
    return not (any(e in _cupy_error for e in _NO_GPU_ERRORS) and not _driver_loads())


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
    """The array module of an array (NumPy for NumPy arrays and scalars).

    For a tensor (a backward run under ``create_graph``), the namespace of NumPy's names
    over differentiable ops that ``framework.ops.tensor_xp`` registers as
    :data:`tensor_namespace`: the same backward formula then records history.
    """
    if isinstance(array, np.ndarray):
        return np
    cp = _cupy_if_array(array)
    if cp is not None:
        return cp
    if tensor_namespace is not None and hasattr(array, "_grad_fn"):
        return tensor_namespace(array)
    return np


# Set by framework.ops.tensor_xp (a layer above): tensor -> its array namespace.
tensor_namespace = None


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
        return _upload_keeping_layout(cp, array)


def _upload_keeping_layout(cp, array):
    """A host array on the current GPU with its strides, where it is dense (a transposed or
    permuted array), as PyTorch's ``.to()`` keeps them (``preserve_format``): CuPy's own
    upload makes every array but an F-contiguous one C-contiguous. Uploaded in the order of
    its strides (one contiguous copy), then viewed back."""
    if array.ndim > 1 and not array.flags.c_contiguous and not array.flags.f_contiguous:
        order = sorted(range(array.ndim), key=lambda d: -array.strides[d])
        contiguous = array.transpose(order)
        if contiguous.flags.c_contiguous:
            return cp.asarray(contiguous).transpose(np.argsort(order))
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
    Half types (float16, bfloat16) add up in float32 and are rounded once, on every device,
    as PyTorch's embedding backward accumulates (a float16 sum of repeated indices would
    round at every add; CuPy 14.2's ``scatter_add`` takes no bfloat16 at all).
    """
    if array.dtype.name in ("float16", "bfloat16"):
        wide = array.astype(np.float32)
        scatter_add(wide, index, values)
        array[...] = wide
        return
    if isinstance(array, np.ndarray):
        np.add.at(array, index, values)
        return
    _cupyx.scatter_add(array, index, values)


#: Elements per pass of :func:`add_scaled_` on the CPU: ``alpha * x`` of one block stays in
#: the cache (256 KiB of float32) between its multiply and its add. The CPU's blocked
#: elementwise kernels (GELU's) walk their arrays in blocks of this size too.
ADD_SCALED_BLOCK = 1 << 16
_SCRATCH = threading.local()  # per thread: (slot, dtype) -> a block buffer


def scratch(dtype, n, slot: str = "add_scaled"):
    """A reusable buffer of ``n <= ADD_SCALED_BLOCK`` elements of ``dtype`` for this thread,
    one per ``slot`` (a kernel that needs several blocks at once names them). Not counted by
    :mod:`framework.memory`: a few fixed blocks per thread, whatever the arrays' sizes."""
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    buf = buffers.get((slot, dtype))
    if buf is None:
        buf = buffers[slot, dtype] = np.empty(ADD_SCALED_BLOCK, dtype)
    return buf[:n]


def add_scaled_(y, x, alpha) -> None:
    """``y += alpha * x`` in place, rounding twice per element: ``alpha * x`` in ``y``'s
    dtype, then the sum. It never rounds once (an FMA), so the result of an element does
    not depend on where it lies in the array: BLAS ``?axpy`` fuses the multiply-add in its
    vector loop and not in its tail, so a parameter updated alone and the same parameter
    inside a flat buffer would differ in the last bit. The GPU's fused optimizer kernels
    round the same way (compiled with ``--fmad=false``), and so does every policy.

    On C-contiguous NumPy arrays it walks ``y`` in cache-sized blocks
    (:data:`ADD_SCALED_BLOCK`) through one per-thread scratch buffer: no temporary of
    ``x``'s size. Elsewhere (CuPy, other layouts) the same two operations through ``xp``.
    """
    if hasattr(alpha, "in_dtype"):  # a traced scalar of a captured step: read on the device
        alpha = alpha.in_dtype(y.dtype)
    if isinstance(alpha, (int, float, np.generic)) and y.dtype.kind == "f":
        alpha = y.dtype.type(alpha)  # the hyperparameter in the parameter's dtype, as the kernels take it
    if (
        y.__class__ is np.ndarray
        and x.__class__ is np.ndarray
        and y.dtype == x.dtype
        and y.shape == x.shape
        and y.flags.c_contiguous
        and x.flags.c_contiguous
        and y.size
    ):
        yf, xf, n = y.reshape(-1), x.reshape(-1), y.size
        block = scratch(y.dtype, min(n, ADD_SCALED_BLOCK))
        for start in range(0, n, ADD_SCALED_BLOCK):
            stop = min(start + ADD_SCALED_BLOCK, n)
            t = block[: stop - start]
            np.multiply(xf[start:stop], alpha, out=t)
            np.add(yf[start:stop], t, out=yf[start:stop])
        return
    xp = get_array_module(y)
    xp.add(y, xp.multiply(x, alpha), out=y)


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
    return f"cupy:{xp.cuda.runtime.getDevice()}"


# --- CuPy's device API: the GPU calls the rest of the framework makes -------------------------
#
# Streams and events are CuPy's objects, passed around opaquely; a stream's ``ptr`` is the
# handle NCCL calls take.


def _cupy_or_raise():
    cp = cupy_module()
    if cp is None:
        raise RuntimeError(f"a GPU was asked for, but {cuda_unavailable_reason()}")
    return cp


def device_count() -> int:
    """How many GPUs CuPy sees (0 without CuPy or a GPU)."""
    cp = cupy_module()
    return 0 if cp is None else cp.cuda.runtime.getDeviceCount()


def current_device() -> Device:
    """CuPy's current device of the calling thread (where new GPU arrays go)."""
    return Device("cuda", _cupy_or_raise().cuda.runtime.getDevice())


def use_device(dev: Device) -> None:
    """Makes GPU ``dev`` CuPy's current device for the calling thread (until changed)."""
    _cupy_or_raise().cuda.Device(dev.index).use()


def synchronize(dev: Device) -> None:
    """Waits until ``dev`` has finished its queued work (a no-op on the CPU)."""
    if dev.type == "cuda":
        _cupy_or_raise().cuda.Device(dev.index).synchronize()


def device_properties(dev: Device) -> dict:
    """Name, compute capability ``(major, minor)``, memory and versions of GPU ``dev``."""
    cp = _cupy_or_raise()
    props = cp.cuda.runtime.getDeviceProperties(dev.index)
    name = props["name"]
    return {
        "name": name.decode() if isinstance(name, bytes) else str(name),
        "compute_capability": (int(props["major"]), int(props["minor"])),
        "total_memory": int(props["totalGlobalMem"]),
        "cupy": cp.__version__,
        "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
        "cuda_driver": cp.cuda.runtime.driverGetVersion(),
    }


def cuda_major() -> int:
    """The major version of the CUDA runtime CuPy runs on (12 for 12.8): the one its
    companion wheels (``nvidia-nccl-cu12``, ...) must be built for."""
    return _cupy_or_raise().cuda.runtime.runtimeGetVersion() // 1000


def current_stream():
    """CuPy's current stream of the current device (where kernels are queued now)."""
    return _cupy_or_raise().cuda.get_current_stream()


def new_stream():
    """A new non-blocking CUDA stream on the current device (e.g. for communication)."""
    return _cupy_or_raise().cuda.Stream(non_blocking=True)


def record_event(stream=None):
    """An event recorded on ``stream`` (default: the current stream): marks the work queued so far."""
    return (current_stream() if stream is None else stream).record()


def wait_event(event, stream=None) -> None:
    """Makes ``stream`` (default: the current stream) wait on the GPU for ``event``; the host goes on."""
    (current_stream() if stream is None else stream).wait_event(event)


def event_done(event) -> bool:
    """Whether the GPU has passed ``event``."""
    return bool(event.done)


def nccl_module():
    """CuPy's NCCL module (``cupy.cuda.nccl``, or the stand-in's), or None when it cannot be used."""
    cp = cupy_module()
    if cp is None:
        return None
    try:
        nccl = importlib.import_module(cp.__name__ + ".cuda.nccl")
    except ImportError:
        return None
    return nccl if getattr(nccl, "available", False) else None
