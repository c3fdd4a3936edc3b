"""Tensor creation functions with PyTorch's names and argument order."""

from __future__ import annotations

import numpy as np

from . import backend, memory, random
from .autograd import node as _node
from .ops.promotion import bfloat16  # noqa: F401  (fw.bfloat16, beside the other dtypes)
from .tensor import Tensor, _wrap

float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
float64 = np.dtype(np.float64)
uint8 = np.dtype(np.uint8)
int8 = np.dtype(np.int8)
int16 = np.dtype(np.int16)
int32 = np.dtype(np.int32)
int64 = np.dtype(np.int64)
bool_ = np.dtype(np.bool_)
DEFAULT_DTYPE = float32


def _new(array, requires_grad: bool) -> Tensor:
    memory.track(array)
    t = _wrap(array)
    if requires_grad:
        t.requires_grad_(True)
    if _node.op_mode is not None:  # a checkpointed function made it: it is its own
        _node.op_mode.created(t)
    return t


def _infer_dtype(data):
    """PyTorch's inference: Python floats -> float32, ints -> int64, bools -> bool.

    NumPy arrays and NumPy scalars (``np.float64(1.0)``) keep their dtype, as in PyTorch.
    """
    if isinstance(data, np.generic) or backend.is_array(data):
        return data.dtype  # (np.asarray would refuse a CuPy array: no implicit copies)
    arr = np.asarray(data)
    if arr.dtype.kind == "f":
        return float32
    if arr.dtype.kind in "iu":
        return int64
    return arr.dtype


def tensor(data, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """A new tensor holding a COPY of ``data`` (nested lists, scalars, arrays, tensors)."""
    if isinstance(data, Tensor):
        data = data._data
    dev = backend.device(device)
    xp = backend.xp_for(dev)
    dtype = np.dtype(dtype) if dtype is not None else _infer_dtype(data)
    if dev.type == "cpu":
        if not isinstance(data, np.ndarray) and backend.is_array(data):
            data = backend.to_numpy(data)  # from a GPU: the copy is the transfer
        array = np.array(data, dtype=dtype, copy=True)
    else:
        if not isinstance(data, np.ndarray) and backend.is_array(data):
            data = backend.to_device(data, dev)  # from another GPU (host data: xp.array below)
        with backend.device_context(dev):
            array = xp.array(data, dtype=dtype)  # a copy (cupy.array copies by default)
    return _new(array, requires_grad)


def from_numpy(array: np.ndarray) -> Tensor:
    """A tensor that SHARES memory with a NumPy array (changes show through both).

    It allocates nothing, so :mod:`framework.memory` does not count the array: it is the
    caller's (a view of a large array would otherwise count the whole of it, for as long
    as the caller keeps that array).
    """
    if not isinstance(array, np.ndarray):
        raise TypeError(f"expected np.ndarray (got {type(array).__name__})")
    return _wrap(array)


def _size(size):
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        return tuple(size[0])
    return tuple(int(s) for s in size)


def _filled(fill, size, dtype, device, requires_grad, like=None):
    dev = backend.device(device)
    xp = backend.xp_for(dev)
    shape, dtype = _size(size), np.dtype(dtype) if dtype is not None else DEFAULT_DTYPE
    with backend.device_context(dev):
        array = fill(xp, shape, dtype)
        if like is not None and memory.layout_order(like) == "K":
            # PyTorch's preserve_format: the strides of a dense (e.g. transposed) input
            laid_out = xp.empty_like(like, dtype=dtype, order="K")
            xp.copyto(laid_out, array)
            array = laid_out
    t = _new(array, requires_grad)
    if _node.capture is not None:  # a compiled step replays the recipe (framework/compile)
        _node.capture.created(t, fill, shape, dtype, dev)
    return t


def zeros(*size, dtype=None, device=None, requires_grad=False) -> Tensor:
    return _filled(lambda xp, s, d: xp.zeros(s, dtype=d), size, dtype, device, requires_grad)


def ones(*size, dtype=None, device=None, requires_grad=False) -> Tensor:
    return _filled(lambda xp, s, d: xp.ones(s, dtype=d), size, dtype, device, requires_grad)


def empty(*size, dtype=None, device=None, requires_grad=False) -> Tensor:
    return _filled(lambda xp, s, d: xp.empty(s, dtype=d), size, dtype, device, requires_grad)


def full(size, fill_value, dtype=None, device=None, requires_grad=False) -> Tensor:
    if dtype is None:
        dtype = _infer_dtype(fill_value)
    return _filled(lambda xp, s, d: xp.full(s, fill_value, dtype=d), (size,), dtype, device, requires_grad)


def randn(*size, dtype=None, device=None, requires_grad=False) -> Tensor:
    return _filled(lambda xp, s, d: random.normal(s, d, xp=xp), size, dtype, device, requires_grad)


def rand(*size, dtype=None, device=None, requires_grad=False) -> Tensor:
    return _filled(lambda xp, s, d: random.uniform(s, d, xp=xp), size, dtype, device, requires_grad)


def arange(start, end=None, step=1, dtype=None, device=None, requires_grad=False) -> Tensor:
    if end is None:
        start, end = 0, start
    if dtype is None:
        dtype = int64 if all(isinstance(v, (int, np.integer)) for v in (start, end, step)) else float32
    dev = backend.device(device)
    xp = backend.xp_for(dev)
    with backend.device_context(dev):
        return _new(xp.arange(start, end, step, dtype=np.dtype(dtype)), requires_grad)


def eye(n, m=None, dtype=None, device=None, requires_grad=False) -> Tensor:
    dev = backend.device(device)
    xp = backend.xp_for(dev)
    with backend.device_context(dev):
        return _new(xp.eye(n, m, dtype=np.dtype(dtype) if dtype is not None else DEFAULT_DTYPE), requires_grad)


def _like(fill, t: Tensor, dtype, requires_grad):
    """A new tensor of ``t``'s shape and device, laid out as PyTorch's ``preserve_format``:
    with ``t``'s strides where ``t`` is dense (a transposed tensor gives a transposed
    one), else contiguous."""
    dtype = dtype if dtype is not None else t.dtype
    return _filled(fill, (t.shape,), dtype, t.device, requires_grad, like=t._data)


def zeros_like(t: Tensor, dtype=None, requires_grad=False) -> Tensor:
    return _like(lambda xp, s, d: xp.zeros(s, dtype=d), t, dtype, requires_grad)


def ones_like(t: Tensor, dtype=None, requires_grad=False) -> Tensor:
    return _like(lambda xp, s, d: xp.ones(s, dtype=d), t, dtype, requires_grad)


def empty_like(t: Tensor, dtype=None, requires_grad=False) -> Tensor:
    return _like(lambda xp, s, d: xp.empty(s, dtype=d), t, dtype, requires_grad)


def full_like(t: Tensor, fill_value, dtype=None, requires_grad=False) -> Tensor:
    return _like(lambda xp, s, d: xp.full(s, fill_value, dtype=d), t, dtype, requires_grad)


def randn_like(t: Tensor, dtype=None, requires_grad=False) -> Tensor:
    return _like(lambda xp, s, d: random.normal(s, d, xp=xp), t, dtype, requires_grad)


def rand_like(t: Tensor, dtype=None, requires_grad=False) -> Tensor:
    return _like(lambda xp, s, d: random.uniform(s, d, xp=xp), t, dtype, requires_grad)


manual_seed = random.manual_seed
