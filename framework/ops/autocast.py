"""Automatic mixed precision: ``fw.autocast``, as ``torch.autocast``.

Inside ``with fw.autocast("cpu"):`` (or ``"cuda"``) the ops on PyTorch's lists run in the
lower precision (``bfloat16`` on the CPU by default, ``float16`` on a GPU), the ops
PyTorch keeps in float32 run in float32, a few "promote" to the widest floating type of
their inputs, and every other op runs in the dtypes of its inputs. Parameters stay
float32: an op on the lower-precision list casts its float32 inputs (a ``Cast`` node, so
gradients come back float32), and the casts of leaves that require grad are cached for
the region, as PyTorch caches them.

One place decides: :func:`cast_inputs` runs in the op apply path
(``framework.autograd.function._apply``) while a region is enabled, and looks the op up by
its class in :data:`OPS` (the op's PyTorch names) and the device's list in
:data:`POLICIES` (transcribed from PyTorch's ``aten/src/ATen/autocast_mode.cpp`` and
``autocast_mode.h``; ``tests/framework/test_autocast.py`` holds every name to torch's
dispatcher, which has an ``AutocastCPU`` or ``AutocastCUDA`` kernel for exactly those).
Only out-of-place calls are cast (PyTorch registers autocast for out-of-place ops only);
a call whose inputs it cast never runs in place under policy ``auto`` (its input is the
fresh cast), so no inplace policy changes a number under autocast.

The state is process-global, as grad mode's is (:mod:`framework.autograd.grad_mode`).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref

import numpy as np

from ..autograd import function as _function
from ..autograd.grad_mode import state as _grad_state
from ..tensor import Tensor
from . import elementwise
from .attention import ScaledDotProductAttention
from .conv import Conv2d
from .layer_norm import LayerNorm
from .linalg import Linear, Matmul
from .loss import CrossEntropy, MseLoss, NllLoss
from .promotion import bfloat16
from .reduce import LogSoftmax, Softmax, Sum
from .view import Cat, IndexPut, Stack

__all__ = [
    "autocast",
    "is_autocast_enabled",
    "get_autocast_dtype",
    "is_autocast_cache_enabled",
    "clear_autocast_cache",
    "POLICIES",
    "OPS",
]

# PyTorch's cast policies (c10's CastPolicy)
LOWER = "lower_precision_fp"  # every floating input in the region's dtype
FP32 = "fp32"  # every floating input in float32
FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"  # the op computes and returns float32 when its first input is eligible
PROMOTE = "promote"  # the widest floating dtype of the inputs

_FLOAT32 = np.dtype(np.float32)
_FLOAT16 = np.dtype(np.float16)
_FLOAT64 = np.dtype(np.float64)

#: PyTorch's lists, by PyTorch's op name, for the ops this framework has (the rest of each
#: list is ops it does not have). CPU: the ``AutocastCPU`` registrations of
#: autocast_mode.cpp; CUDA: ``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``,
#: ``AT_FORALL_FP32_SET_OPT_DTYPE`` and ``AT_FORALL_PROMOTE`` of autocast_mode.h (PyTorch
#: 2.13). An op in neither runs in its inputs' dtypes ("fallthrough").
POLICIES = {
    "cpu": {
        "conv2d": LOWER,
        "linear": LOWER,
        "matmul": LOWER,
        "scaled_dot_product_attention": LOWER,
        "cross_entropy_loss": FP32,
        "nll_loss": FP32,
        "mse_loss": FP32,
        "cat": PROMOTE,
        "stack": PROMOTE,
    },
    "cuda": {
        "conv2d": LOWER,
        "linear": LOWER,
        "matmul": LOWER,
        "scaled_dot_product_attention": LOWER,
        "exp": FP32,
        "log": FP32,
        "pow": FP32,
        "layer_norm": FP32,
        "nll_loss": FP32,
        "mse_loss": FP32,
        "softmax": FP32_SET_OPT_DTYPE,
        "log_softmax": FP32_SET_OPT_DTYPE,
        "sum": FP32_SET_OPT_DTYPE,
        "index_put": PROMOTE,
    },
}

#: Each op class of this framework and the PyTorch op(s) it is: the first name a device
#: lists decides. ``cross_entropy`` is one op here; PyTorch's CPU list has it
#: (``cross_entropy_loss``), its CUDA list has the ops it is made of (``log_softmax``,
#: float32, then ``nll_loss``, float32): float32 either way.
OPS = {
    Linear: ("linear",),
    Matmul: ("matmul",),
    Conv2d: ("conv2d",),
    ScaledDotProductAttention: ("scaled_dot_product_attention",),
    LayerNorm: ("layer_norm",),
    Softmax: ("softmax",),
    LogSoftmax: ("log_softmax",),
    Sum: ("sum",),
    CrossEntropy: ("cross_entropy_loss", "log_softmax"),
    NllLoss: ("nll_loss",),
    MseLoss: ("mse_loss",),
    elementwise.Exp: ("exp",),
    elementwise.Log: ("log",),
    elementwise.Pow: ("pow",),
    Cat: ("cat",),
    Stack: ("stack",),
    IndexPut: ("index_put",),
}


def _policy_table(device_type: str) -> dict:
    """Op class -> cast policy on ``device_type``."""
    lists = POLICIES[device_type]
    table = {}
    for cls, names in OPS.items():
        for name in names:
            if name in lists:
                table[cls] = lists[name]
                break
    return table


_TABLES = {d: _policy_table(d) for d in POLICIES}

# What each device type's autocast accepts (others disable the region with PyTorch's warning)
_SUPPORTED = {"cpu": ("bfloat16", "float16"), "cuda": ("float16", "bfloat16")}


class _DeviceState:
    __slots__ = ("enabled", "dtype")

    def __init__(self, dtype):
        self.enabled = False
        self.dtype = np.dtype(dtype)


class _State:
    __slots__ = ("devices", "cache_enabled", "nesting", "cache")

    def __init__(self):
        # PyTorch's defaults: bfloat16 on the CPU, float16 on CUDA
        self.devices = {"cpu": _DeviceState(bfloat16), "cuda": _DeviceState(np.float16)}
        self.cache_enabled = True
        self.nesting = 0  # autocast regions entered and not left (enabled or not)
        self.cache: dict = {}  # id(leaf) -> (weak reference to it, its cast)


state = _State()


def _device_type(name) -> str:
    name = str(name).split(":")[0]
    if name not in state.devices:
        raise RuntimeError(f"User specified an unsupported autocast device_type '{name}' (this framework's: cpu, cuda)")
    return name


def is_autocast_enabled(device_type: str = "cuda") -> bool:
    """Whether autocast is on for ``device_type`` (``torch.is_autocast_enabled``; without an
    argument, CUDA's, as PyTorch)."""
    return state.devices[_device_type(device_type)].enabled


def get_autocast_dtype(device_type: str):
    """The lower-precision dtype autocast uses on ``device_type`` now (bfloat16 on the CPU and
    float16 on CUDA outside any region)."""
    return state.devices[_device_type(device_type)].dtype


def is_autocast_cache_enabled() -> bool:
    """Whether casts of leaves are cached within a region (the default of ``cache_enabled``)."""
    return state.cache_enabled


def clear_autocast_cache() -> None:
    """Drops the cached casts (the outermost region does this when it exits)."""
    state.cache.clear()


class autocast:  # noqa: N801  (PyTorch's name)
    """A region in which ops run in mixed precision, as ``torch.autocast``.

    Also a decorator (``@fw.autocast("cpu")``). Regions nest: an inner one (``enabled=False``
    to run a part in float32) sets the state until it exits; the outermost one to exit
    drops the cached casts.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``: the ops on tensors of that device are cast.
        dtype: the lower precision (``fw.bfloat16`` or ``fw.float16``); default: the
            device's current one (bfloat16 on the CPU, float16 on CUDA).
        enabled: False makes the region run every op in its inputs' dtypes.
        cache_enabled: cache the casts of leaves that require grad (parameters) within
            the region; default :func:`is_autocast_cache_enabled`.
    """

    def __init__(self, device_type: str, dtype=None, enabled: bool = True, cache_enabled: bool | None = None):
        self.device = _device_type(device_type)
        self.fast_dtype = state.devices[self.device].dtype if dtype is None else np.dtype(dtype)
        self._enabled = bool(enabled)
        self._cache_enabled = state.cache_enabled if cache_enabled is None else bool(cache_enabled)
        if self._enabled and self.fast_dtype.name not in _SUPPORTED[self.device]:
            kinds = ", ".join(_SUPPORTED[self.device])
            warnings.warn(
                f"In {self.device.upper()} autocast, but the target dtype is not supported ({self.fast_dtype}). "
                f"Disabling autocast. {self.device.upper()} autocast supports {kinds}.",
                stacklevel=2,
            )
            self._enabled = False

    def __enter__(self):
        dev = state.devices[self.device]
        self._prev = (dev.enabled, dev.dtype, state.cache_enabled)
        dev.enabled, state.cache_enabled = self._enabled, self._cache_enabled
        if self._enabled:
            dev.dtype = self.fast_dtype
        state.nesting += 1
        _sync_hook()
        return self

    def __exit__(self, *exc):
        state.nesting -= 1
        if state.nesting == 0:
            state.cache.clear()
        dev = state.devices[self.device]
        dev.enabled, dev.dtype, state.cache_enabled = self._prev
        _sync_hook()
        return False

    def __call__(self, fn):
        """Used as a decorator: ``fn`` runs in this region (a new one at each call)."""
        device, dtype, enabled, cache = self.device, self.fast_dtype, self._enabled, self._cache_enabled

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache):
                return fn(*args, **kwargs)

        return wrapper


def settings() -> tuple:
    """The autocast settings in force (each device's on/off and dtype, the cache setting):
    what :func:`framework.utils.checkpoint.checkpoint` records at forward, as
    ``torch.utils.checkpoint`` does, to recompute under them."""
    return tuple((name, d.enabled, d.dtype) for name, d in state.devices.items()), state.cache_enabled


@contextlib.contextmanager
def restored(recorded: tuple):
    """A region with the autocast ``settings()`` recorded earlier (regions for every device)."""
    devices, cache = recorded
    with contextlib.ExitStack() as stack:
        for name, enabled, dtype in devices:
            stack.enter_context(autocast(name, dtype=dtype, enabled=enabled, cache_enabled=cache))
        yield


def _sync_hook() -> None:
    """Hands :func:`cast_inputs` to the apply path while some device's autocast is on,
    None otherwise (then an op pays one comparison)."""
    on = any(d.enabled for d in state.devices.values())
    _function.autocast = cast_inputs if on else None


def _on(t, device: str) -> bool:
    """Whether ``t`` is a floating tensor (any float dtype) on ``device`` (PyTorch's
    ``is_autocast_eligible``)."""
    if t.__class__ is not Tensor and not isinstance(t, Tensor):
        return False
    d = t._data
    if (d.__class__ is np.ndarray) != (device == "cpu"):
        return False
    dt = d.dtype
    return dt.kind == "f" or dt == bfloat16


def _eligible(t, device: str) -> bool:
    """A floating tensor on ``device`` that autocast may cast: not float64 (PyTorch's ``is_eligible``)."""
    return _on(t, device) and t._data.dtype != _FLOAT64


def _cached_cast(t, dtype, device: str):
    """``t`` in ``dtype`` where autocast casts it; a float32 leaf that requires grad, cast
    to the region's dtype with grad mode on, is cast once per region (PyTorch's cache)."""
    if not _eligible(t, device) or t._data.dtype == dtype:
        return t
    low = state.devices[device].dtype
    if (
        dtype == low
        and state.cache_enabled
        and _grad_state.enabled
        and t._data.dtype == _FLOAT32
        and t._requires_grad
        and t._grad_fn is None
        and t._base is None
    ):
        hit = state.cache.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        cast = elementwise.Cast.apply(t, dtype=dtype)
        state.cache[id(t)] = (weakref.ref(t), cast)
        return cast
    return elementwise.Cast.apply(t, dtype=dtype)


def _promote_type(inputs, device: str, low):
    """PyTorch's ``promote_type``: float32 if any eligible input is float32, else ``low``;
    float64 inputs are ignored (and left as they are)."""
    current = low
    for a in inputs:
        if not _on(a, device):
            continue
        dt = a._data.dtype
        if dt == _FLOAT64:
            continue
        if current == _FLOAT32 or dt == _FLOAT32:
            current = _FLOAT32
        elif not (current == low and dt == low):
            raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


def cast_inputs(cls, inputs: tuple) -> tuple:
    """The inputs of an out-of-place call of ``cls`` as autocast casts them: ``inputs``
    itself when nothing changes (the apply path's hook; see the module docstring)."""
    first = next((a for a in inputs if isinstance(a, Tensor)), None)
    if first is None:
        return inputs
    device = "cpu" if first._data.__class__ is np.ndarray else "cuda"
    dev = state.devices[device]
    if not dev.enabled:
        return inputs
    policy = _TABLES[device].get(cls)
    if policy is None:
        return inputs
    if policy == FP32_SET_OPT_DTYPE:
        x = inputs[0]
        if not _eligible(x, device) or x._data.dtype == _FLOAT32:
            return inputs
        return (elementwise.Cast.apply(x, dtype=_FLOAT32),) + tuple(inputs[1:])
    if policy == LOWER:
        to = dev.dtype
    elif policy == FP32:
        to = _FLOAT32
    else:
        to = _promote_type(inputs, device, dev.dtype)
    cast = tuple(_cached_cast(a, to, device) for a in inputs)
    return inputs if all(c is a for c, a in zip(cast, inputs)) else cast
