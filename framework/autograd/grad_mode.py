"""Grad mode, inference mode and anomaly mode: ``no_grad``, ``enable_grad``,
``set_grad_enabled``, ``inference_mode``, ``detect_anomaly``.

The state is process-global (PyTorch keeps it per thread). The framework runs its
training loop, backward hooks and communication callbacks on one thread, so a global
keeps the hot path to one attribute read.
"""

from __future__ import annotations

import functools


class _State:
    __slots__ = ("enabled", "anomaly", "inference", "recomputing")

    def __init__(self):
        self.enabled = True
        self.anomaly = False
        self.inference = False  # inside inference_mode(): new tensors are inference tensors
        # A checkpoint runs its function again in backward (framework.utils.checkpoint):
        # updates of model state that the forward made already are not made twice
        # (BatchNorm's running statistics and its batch count).
        self.recomputing = False


state = _State()


def is_grad_enabled() -> bool:
    """True when ops record history for backward."""
    return state.enabled


class _GradModeContext:
    """Base of the grad-mode context managers; each also works as a decorator."""

    _mode: bool

    def __enter__(self):
        self._prev = state.enabled
        state.enabled = self._mode
        return self

    def __exit__(self, *exc):
        state.enabled = self._prev
        return False

    def __call__(self, fn):
        """Used as a decorator: runs ``fn`` in this grad mode."""
        mode = self._mode

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            prev, state.enabled = state.enabled, mode
            try:
                return fn(*args, **kwargs)
            finally:
                state.enabled = prev

        return wrapper


class _NoParamGradModeContext(_GradModeContext):
    """Also usable as a bare decorator, ``@no_grad`` as well as ``@no_grad()`` (PyTorch 2)."""

    def __new__(cls, fn=None):
        if fn is None:
            return super().__new__(cls)
        return cls()(fn)


class no_grad(_NoParamGradModeContext):
    """Ops inside do not record history (inplace on leaves is allowed here)."""

    _mode = False


class enable_grad(_NoParamGradModeContext):
    """Turns recording back on inside a ``no_grad`` block."""

    _mode = True


class set_grad_enabled(_GradModeContext):
    """Sets grad mode now; as a context manager, restores the previous mode on exit."""

    def __init__(self, mode: bool):
        self._mode = bool(mode)
        self._prev = state.enabled
        state.enabled = self._mode

    def __enter__(self):
        return self

    def __call__(self, fn):
        # Used as a decorator, the mode applies to calls of fn only: undo __init__'s switch.
        state.enabled = self._prev
        return super().__call__(fn)


class InferenceVersionCounter:
    """The version counter of an inference tensor: there is none.

    Inference tensors do not count their writes (PyTorch's promise that makes inference
    mode cheap), so nothing that relies on versions can use them: saving one for
    backward raises here, reading ``_version`` raises in :class:`framework.Tensor`, and
    the inplace check refuses writes to one outside inference mode.
    """

    __slots__ = ()
    writes = None
    packed = 0  # (VersionCounter's: no saved tensor can watch an inference tensor)

    @property
    def value(self):
        raise RuntimeError(
            "Inference tensors cannot be saved for backward. To work around you can make a clone "
            "to get a normal tensor and use it in autograd."
        )

    def bump(self, op_name, site) -> None:
        """Writes to an inference tensor are not counted."""


def is_inference_mode_enabled() -> bool:
    """True inside ``inference_mode()``."""
    return state.inference


class inference_mode:
    """No history, as under ``no_grad``, and the tensors made inside are *inference tensors*.

    As in PyTorch, an inference tensor is one the framework promises never to need for
    backward: it has no version counter (reading ``_version`` raises), autograd refuses
    to save it for backward, and it may be written in place only inside inference mode.
    Tensors that existed before keep working as usual (views of them stay normal
    tensors). ``inference_mode(False)`` switches it off again, with grad mode on. Works as
    a context manager and as a decorator (``@inference_mode``, ``@inference_mode()``,
    ``@inference_mode(False)``).
    """

    def __new__(cls, mode=True):
        if callable(mode):  # @inference_mode (bare) or inference_mode(mode=fn)
            return cls()(mode)
        return super().__new__(cls)

    def __init__(self, mode: bool = True):
        if callable(mode):
            return  # __new__ returned a decorated function; never reached
        self.mode = bool(mode)

    def __enter__(self):
        self._prev = (state.enabled, state.inference)
        state.enabled, state.inference = not self.mode, self.mode
        return self

    def __exit__(self, *exc):
        state.enabled, state.inference = self._prev
        return False

    def __call__(self, fn):
        """Used as a decorator: runs ``fn`` in this mode."""
        mode = self.mode

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            prev = (state.enabled, state.inference)
            state.enabled, state.inference = not mode, mode
            try:
                return fn(*args, **kwargs)
            finally:
                state.enabled, state.inference = prev

        return wrapper


class detect_anomaly:
    """Records each op's forward stack and checks backward outputs for NaN.

    When a backward function returns NaN, or raises, the error names the op and shows
    the line of the forward call that created it.
    """

    def __init__(self, check_nan: bool = True):
        self.check_nan = check_nan

    def __enter__(self):
        self._prev = state.anomaly
        state.anomaly = "nan" if self.check_nan else "trace"
        return self

    def __exit__(self, *exc):
        state.anomaly = self._prev
        return False
