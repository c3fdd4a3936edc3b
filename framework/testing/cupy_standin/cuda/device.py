"""``cupy.cuda.Device`` of the stand-in: a simulated GPU, made current per thread."""

from __future__ import annotations

import threading

from .. import counting
from . import graph, runtime

_stack = threading.local()  # .devices: the devices to restore when ``with Device(n)`` blocks end


def get_device_id() -> int:
    """The calling thread's current device."""
    return runtime.getDevice()


class Device:
    """A simulated GPU, as ``cupy.cuda.Device``: ``Device()`` is the current one.

    ``with Device(n):`` makes ``n`` current for the block and ``use()`` for good; new
    arrays are allocated on the current device and kernels refuse arrays of another one.
    ``synchronize()`` returns at once: the stand-in has already done all the work.
    """

    def __init__(self, device=None):
        self.id = runtime.getDevice() if device is None else int(device)

    def __int__(self) -> int:
        return self.id

    def __index__(self) -> int:
        return self.id

    def __eq__(self, other) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("standin-device", self.id))

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"

    def __enter__(self) -> Device:
        previous = runtime.getDevice()
        runtime.setDevice(self.id)  # raises for a device that does not exist
        stack = getattr(_stack, "devices", None)
        if stack is None:
            stack = _stack.devices = []
        stack.append(previous)
        return self

    def __exit__(self, *exc) -> None:
        runtime.setDevice(_stack.devices.pop())

    def use(self) -> None:
        """Makes this device current for the calling thread."""
        runtime.setDevice(self.id)

    def synchronize(self) -> None:
        """Returns at once: nothing is queued on a simulated device (a host synchronization on a GPU)."""
        runtime.getDeviceProperties(self.id)  # still refuses a device that does not exist
        capture = graph.any_capture(self.id)
        if capture is not None:  # a capture on the device: cudaErrorStreamCaptureUnsupported
            raise graph.fail(capture)
        counting.host_sync("synchronize")

    @property
    def compute_capability(self) -> str:
        props = runtime.getDeviceProperties(self.id)
        return f"{props['major']}{props['minor']}"

    @property
    def mem_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes: the nominal size less what the stand-in's pools hold."""
        return runtime._mem_info(self.id)
