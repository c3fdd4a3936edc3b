"""``GradScaler``: loss scaling for float16 training, as ``torch.amp.GradScaler``.

float16's smallest normal value is 2**-14: small gradients underflow to zero unless the
loss is multiplied by a large factor first (Micikevicius et al., "Mixed Precision
Training", ICLR 2018). The scaler multiplies the loss by ``scale`` (2**16 at first),
divides the gradients by it before the update (``unscale_``), skips the update of a step
whose gradients hold an inf or NaN and halves the scale then (``backoff_factor``), and
doubles it after ``growth_interval`` steps in a row without one (``growth_factor``).

PyTorch's semantics, step by step: the scale is a float32 made at the first
:meth:`GradScaler.scale` on the loss's device, the unscale multiplies each gradient by
``float32(1 / float64(scale))`` in place, the found-inf flag is a float32 per device, and
the update is ``_amp_update_scale_``'s (the scale, the flag and the growth tracker are
one-element arrays, which the GPU kernels take as raw arrays). On the CPU the step reads the flag
(host memory: nothing to wait for) and calls ``optimizer.step()`` or not, as PyTorch's
does. On a GPU nothing is read back: the unscale and the update are device kernels
(:mod:`framework.amp.kernels`), and an optimizer that declares
``_step_supports_amp_scaling`` (this framework's SGD, Adam and AdamW) receives the flag
as ``optimizer.found_inf`` (PyTorch's contract with its fused optimizers) and its fused
kernels skip the update where it is set (:mod:`framework.optim.optimizer`); any other
optimizer is stepped after reading the flag, one host sync, as PyTorch's
``_maybe_opt_step`` does.
"""

from __future__ import annotations

import enum
import warnings
from collections import defaultdict

import numpy as np

from .. import backend
from ..autograd.grad_mode import no_grad
from ..callsite import call_site
from ..ops.kernels import on_gpu
from ..tensor import Tensor, _wrap
from . import kernels as K

__all__ = ["GradScaler", "OptState"]


class OptState(enum.Enum):
    """Where an optimizer is in the current iteration (PyTorch's)."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _refresh_per_optimizer_state() -> dict:
    return {"stage": OptState.READY, "found_inf_per_device": {}}


class GradScaler:
    """Scales the loss, unscales the gradients, skips steps with inf/NaN gradients and
    adapts the scale, as ``torch.amp.GradScaler``::

        scaler = fw.amp.GradScaler("cpu")
        with fw.autocast("cpu", dtype=fw.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)          # optional: to clip the true gradients
        fw.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)              # skipped when a gradient is inf or NaN
        scaler.update()

    Args:
        device: ``"cuda"`` (PyTorch's default) or ``"cpu"``: where the scaled losses live.
        init_scale: the first scale.
        growth_factor: the scale is multiplied by it after ``growth_interval`` steps in a
            row without inf/NaN gradients (> 1).
        backoff_factor: the scale is multiplied by it after a step with inf/NaN gradients (< 1).
        growth_interval: see ``growth_factor``.
        enabled: False makes every method a no-op (``step`` just steps the optimizer).
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ):
        self._device = str(device).split(":")[0]
        self._enabled = bool(enabled)
        if self._device == "cuda" and self._enabled and not backend.is_cuda_available():
            warnings.warn("GradScaler is enabled, but CUDA is not available.  Disabling.", stacklevel=2)
            self._enabled = False
        if self._enabled:
            if not growth_factor > 1.0:
                raise ValueError("The growth factor must be > 1.0.")
            if not backoff_factor < 1.0:
                raise ValueError("The backoff factor must be < 1.0.")
        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._init_growth_tracker = 0
        self._scale = None  # float32 (1,) array, made at the first scale() on the loss's device
        self._growth_tracker = None  # int32 (1,) array
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    # --- scaling ---------------------------------------------------------------------------
    def _lazy_init(self, like) -> None:
        xp = backend.get_array_module(like)
        # one element, not 0-d: the kernels take them as raw arrays (see framework.amp.kernels)
        self._scale = xp.full((1,), self._init_scale, dtype=np.float32)
        self._growth_tracker = xp.full((1,), self._init_growth_tracker, dtype=np.int32)

    def _check(self, funcname: str) -> None:
        if self._scale is None:
            raise RuntimeError(
                f"Attempted {funcname} but _scale is None.  This may indicate your script did not use "
                "scaler.scale(loss or outputs) earlier in the iteration."
            )

    def scale(self, outputs):
        """``outputs`` (a tensor, or a list/tuple of them) times the current scale; as they are when disabled."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, Tensor):
            if self._scale is None:
                self._lazy_init(outputs._data)
            return outputs * _wrap(backend.to_device(self._scale, outputs.device).reshape(()))
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise ValueError("outputs must be a Tensor or an iterable of Tensors")

    # --- unscaling -------------------------------------------------------------------------
    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16: bool) -> dict:
        """Multiplies every gradient of ``optimizer`` by ``inv_scale`` in place and sets each
        device's flag where one holds an inf or NaN; returns the flags by device."""
        flags: dict = {}
        site = call_site()
        with no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    g = p.grad
                    if g is None:
                        continue
                    if not allow_fp16 and g.dtype == np.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    device = g.device
                    if device not in flags:
                        flags[device] = (
                            backend.to_device(found_inf, device),
                            backend.to_device(inv_scale, device),
                        )
                    flag, inv = flags[device]
                    data = g._data
                    if on_gpu(data):
                        K.unscale(data, inv, data, flag)
                    else:
                        if not np.isfinite(data).all():
                            flag[...] = 1.0
                        np.multiply(data, inv[0], out=data)
                    g._vc.bump("unscale_ (GradScaler)", site)
        return {device: flag for device, (flag, _) in flags.items()}

    def unscale_(self, optimizer) -> None:
        """Divides ("unscales") ``optimizer``'s gradients by the scale, in place, and records
        whether any is inf or NaN; once per optimizer and iteration, before :meth:`step`
        (which otherwise does it). Reads nothing back from a GPU."""
        if not self._enabled:
            return
        self._check("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        xp = backend.get_array_module(self._scale)
        # the reciprocal in float64, as PyTorch takes it (float32's division may be imprecise)
        inv_scale = (1.0 / self._scale.astype(np.float64)).astype(np.float32)
        found_inf = xp.zeros((1,), dtype=np.float32)
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, inv_scale, found_inf, False)
        state["stage"] = OptState.UNSCALED

    # --- the step ----------------------------------------------------------------------------
    def step(self, optimizer, *args, **kwargs):
        """Unscales (unless :meth:`unscale_` did) and steps ``optimizer``, unless a gradient
        is inf or NaN; returns what ``optimizer.step`` returned (None when skipped)."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        flags = state["found_inf_per_device"]
        if not flags:
            raise RuntimeError("No inf checks were recorded for this optimizer.")
        retval = None
        on_device = [f for f in flags.values() if on_gpu(f)]
        if on_device and len(on_device) == len(flags) and getattr(optimizer, "_step_supports_amp_scaling", False):
            # the flag stays on the device: the optimizer's fused kernels skip where it is set
            found_inf = on_device[0]
            for f in on_device[1:]:
                found_inf = found_inf + backend.to_device(f, backend.device_of(found_inf))
            optimizer.found_inf = found_inf
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.found_inf
        elif not any(float(backend.to_numpy(f)[0]) for f in flags.values()):  # PyTorch's _maybe_opt_step
            retval = optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        return retval

    def update(self, new_scale=None) -> None:
        """Adapts the scale to this iteration's flags (or sets ``new_scale``); call once per
        iteration, after :meth:`step` for every optimizer. On a GPU: one kernel, no sync."""
        if not self._enabled:
            return
        self._check("update")
        if new_scale is not None:
            value = new_scale._data if isinstance(new_scale, Tensor) else new_scale
            self._scale[...] = backend.to_device(
                np.asarray(value, dtype=np.float32).reshape(1), backend.device_of(self._scale)
            )
        else:
            home = backend.device_of(self._scale)
            flags = [
                backend.to_device(f, home)
                for s in self._per_optimizer_states.values()
                for f in s["found_inf_per_device"].values()
            ]
            if not flags:
                raise RuntimeError("No inf checks were recorded prior to update.")
            found = flags[0]
            for f in flags[1:]:
                found = found + f
            if on_gpu(self._scale):
                K.update_scale(
                    found,
                    self._growth_factor,
                    self._backoff_factor,
                    self._growth_interval,
                    self._scale,
                    self._growth_tracker,
                    size=1,
                )
            else:
                K._update_scale(
                    found,
                    self._growth_factor,
                    self._backoff_factor,
                    self._growth_interval,
                    self._scale,
                    self._growth_tracker,
                )
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    # --- state -------------------------------------------------------------------------------
    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled); reads it back from a GPU."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(backend.to_numpy(self._scale)[0])

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        return (
            self._init_growth_tracker
            if self._growth_tracker is None
            else int(backend.to_numpy(self._growth_tracker)[0])
        )

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = int(new_interval)

    def is_enabled(self) -> bool:
        """Whether this scaler scales (False: every method is a no-op)."""
        return self._enabled

    def state_dict(self) -> dict:
        """``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval`` and
        ``_growth_tracker`` (Python numbers, as PyTorch's); empty when disabled. Take it
        after :meth:`update`."""
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores :meth:`state_dict`'s values (a no-op when disabled)."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."
            )
        self._init_scale = float(state_dict["scale"])
        if self._scale is not None:
            self._scale[...] = np.float32(self._init_scale)
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._init_growth_tracker = int(state_dict["_growth_tracker"])
        if self._growth_tracker is not None:
            self._growth_tracker[...] = np.int32(self._init_growth_tracker)
