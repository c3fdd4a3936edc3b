"""The stand-in's routines: each a function real CuPy has, with CuPy's signature.

Each runs NumPy on the host arrays of its stand-in arguments (see ``_core``). Where
CuPy's signature differs from NumPy's (no ``where=`` or ``initial=`` in reductions, a
``dtype`` in ``argmax``, ``clip(a, a_min, a_max, out)`` ...) the stand-in has CuPy's,
so code that only works on NumPy fails here too. Host arrays are accepted only where
CuPy accepts them: ``array``/``asarray`` (the host-to-device copy) and ``asnumpy``.
"""

from __future__ import annotations

import builtins

import numpy

from . import _core
from ._core import _call, _call_view, _check_current, _dtype, _from_host, _operand, _wrap, ndarray
from .cuda import runtime

# --- creation ----------------------------------------------------------------------------------------


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    """A new device array: a copy of a host array, a list, a scalar or a device array."""
    if isinstance(obj, ndarray):
        if dtype is None and not copy and obj.device.id == _runtime_device() and ndmin <= obj.ndim:
            return obj
        host = numpy.array(obj._a, dtype=dtype, order=order, ndmin=ndmin)
    elif isinstance(obj, (list, tuple)) and _holds_device_arrays(obj):
        return stack([asarray(x) for x in obj]).astype(dtype or _result_dtype(obj), copy=False)
    else:
        host = numpy.array(obj, dtype=dtype, order=order, ndmin=ndmin)
    return _from_host(host)


def asarray(a, dtype=None, order=None, *, copy=None, blocking=False):
    """``a`` itself when it is a device array of that dtype (on whatever device), else a copy."""
    if isinstance(a, ndarray) and copy is not True:
        return a if dtype is None or _dtype(dtype) == a.dtype else a.astype(dtype)
    return array(a, dtype=dtype, copy=True, order=order or "K")


def asanyarray(a, dtype=None, order=None, *, copy=None, blocking=False):
    return asarray(a, dtype, order, copy=copy, blocking=blocking)


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        raise TypeError(f"Unsupported type {type(a)}")
    if a._a.flags.c_contiguous and (dtype is None or _dtype(dtype) == a.dtype):
        return a if a.ndim else a.ravel()  # CuPy: a 0-d array becomes a 1-element view
    _check_current(a)
    return _from_host(numpy.ascontiguousarray(a._a, dtype=dtype))


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    """A host (NumPy) array of ``a``: the explicit device-to-host copy."""
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    if out is not None:
        out[...] = a
        return out
    return numpy.array(a, order=order, copy=False) if isinstance(a, numpy.ndarray) else numpy.asarray(a, order=order)


def empty(shape, dtype=float, order="C"):
    return ndarray(shape, dtype, order=order)


def zeros(shape, dtype=float, order="C"):
    a = ndarray(shape, dtype, order=order)
    a._a.fill(0)
    return a


def ones(shape, dtype=float, order="C"):
    a = ndarray(shape, dtype, order=order)
    a._a.fill(1)
    return a


def full(shape, fill_value, dtype=None, order="C"):
    if dtype is None:
        dtype = fill_value.dtype if isinstance(fill_value, ndarray) else numpy.array(fill_value).dtype
    a = ndarray(shape, dtype, order=order)
    a.fill(fill_value)
    return a


def empty_like(prototype, dtype=None, order="K", subok=None, shape=None):
    if not isinstance(prototype, ndarray):
        raise TypeError(f"Unsupported type {type(prototype)}")
    return _from_host(numpy.empty_like(prototype._a, dtype=_dtype(dtype or prototype.dtype), order=order, shape=shape))


def zeros_like(a, dtype=None, order="K", subok=None, shape=None):
    out = empty_like(a, dtype, order, subok, shape)
    out._a.fill(0)
    return out


def ones_like(a, dtype=None, order="K", subok=None, shape=None):
    out = empty_like(a, dtype, order, subok, shape)
    out._a.fill(1)
    return out


def full_like(a, fill_value, dtype=None, order="K", subok=None, shape=None):
    out = empty_like(a, dtype, order, subok, shape)
    out.fill(fill_value)
    return out


def arange(start, stop=None, step=1, dtype=None):
    return _from_host(numpy.arange(start, stop, step, dtype=dtype))


def linspace(start, stop, num=50, endpoint=True, retstep=False, dtype=None, axis=0):
    res = numpy.linspace(start, stop, num, endpoint, retstep, dtype, axis)
    return (_from_host(res[0]), res[1]) if retstep else _from_host(res)


def eye(N, M=None, k=0, dtype=float, order="C"):  # noqa: N803 - CuPy's names
    return _from_host(numpy.eye(N, M, k, dtype=dtype, order=order))


def identity(n, dtype=float):
    return eye(n, dtype=dtype)


def copy(a, order="K"):
    return _call(numpy.copy, a, order=order)


# --- shapes and views ------------------------------------------------------------------------------


def reshape(a, newshape, order="C", *, copy=None):
    return _call_view(numpy.reshape, a, newshape, order=order)


def ravel(a, order="C"):
    return _call_view(numpy.ravel, a, order=order)


def transpose(a, axes=None):
    return _call_view(numpy.transpose, a, axes)


def swapaxes(a, axis1, axis2):
    return _call_view(numpy.swapaxes, a, axis1, axis2)


def moveaxis(a, source, destination):
    return _call_view(numpy.moveaxis, a, source, destination)


def expand_dims(a, axis):
    return _call_view(numpy.expand_dims, a, axis)


def squeeze(a, axis=None):
    return _call_view(numpy.squeeze, a, axis)


def broadcast_to(array, shape):  # noqa: A002 - CuPy's name
    return _call_view(numpy.broadcast_to, array, shape)


def broadcast_arrays(*args):
    return list(_call_view(numpy.broadcast_arrays, *args))


def atleast_1d(*arys):
    return _call_view(numpy.atleast_1d, *arys)


def atleast_2d(*arys):
    return _call_view(numpy.atleast_2d, *arys)


def diagonal(a, offset=0, axis1=0, axis2=1):
    return _call_view(numpy.diagonal, a, offset, axis1, axis2)


def concatenate(tup, axis=0, out=None, *, dtype=None, casting="same_kind"):
    return _call(numpy.concatenate, tuple(tup), axis=axis, out=out, dtype=dtype, casting=casting)


def stack(tup, axis=0, out=None, *, dtype=None, casting="same_kind"):
    return _call(numpy.stack, tuple(tup), axis=axis, out=out, dtype=dtype, casting=casting)


def vstack(tup, *, dtype=None, casting="same_kind"):
    return _call(numpy.vstack, tuple(tup), dtype=dtype, casting=casting)


def hstack(tup, *, dtype=None, casting="same_kind"):
    return _call(numpy.hstack, tuple(tup), dtype=dtype, casting=casting)


def split(ary, indices_or_sections, axis=0):
    return _call_view(numpy.split, ary, indices_or_sections, axis)


def tile(A, reps):  # noqa: N803
    return _call(numpy.tile, A, reps)


def repeat(a, repeats, axis=None):
    return _call(numpy.repeat, a, repeats, axis)


def flip(a, axis=None):
    return _call_view(numpy.flip, a, axis)


def roll(a, shift, axis=None):
    return _call(numpy.roll, a, shift, axis)


def pad(array, pad_width, mode="constant", **kwargs):  # noqa: A002
    return _call(numpy.pad, array, pad_width, mode, **kwargs)


# --- indexing ----------------------------------------------------------------------------------------


def where(condition, x=None, y=None):
    if (x is None) != (y is None):
        raise ValueError("Must provide both 'x' and 'y' or neither.")
    if x is None:
        return nonzero(condition)
    return _call(numpy.where, condition, x, y)


def nonzero(a):
    if not isinstance(a, ndarray):
        raise TypeError(f"Unsupported type {type(a)}")
    return a.nonzero()


def flatnonzero(a):
    return _call(numpy.flatnonzero, a)


def take(a, indices, axis=None, out=None):
    return a.take(indices, axis, out)


def take_along_axis(a, indices, axis):
    _check_current(a, indices)
    return _wrap(
        numpy.take_along_axis(
            a._a,
            numpy.mod(_core._host_indices(indices), a.shape[axis]) if a.shape[axis] else _core._host_indices(indices),
            axis,
        )
    )


def put_along_axis(arr, indices, values, axis):
    _check_current(arr, indices, values)
    idx = _core._host_indices(indices)
    if arr.shape[axis]:
        idx = numpy.mod(idx, arr.shape[axis])
    numpy.put_along_axis(arr._a, idx, _operand(values), axis)


def copyto(dst, src, casting="same_kind", where=None):
    """Copies ``src`` (a device array or a scalar) into ``dst`` with broadcasting.

    Between devices only a plain copy (same shape and dtype, no ``where``) is allowed, as in CuPy.
    """
    if not isinstance(dst, ndarray):
        raise TypeError(f"Unsupported type {type(dst)}")
    if isinstance(src, numpy.ndarray):
        if src.size != 1:
            raise ValueError("non-scalar numpy.ndarray cannot be used for copyto")
        src = src.squeeze()[()]
    if isinstance(src, ndarray) and src.data.device_id != dst.data.device_id:
        if src.shape != dst.shape or src.dtype != dst.dtype or where is not None:
            raise ValueError("copyto between devices needs the same shape and dtype and no where=")
        numpy.copyto(dst._a, src._a)
        return
    _check_current(dst, src, where)
    numpy.copyto(
        dst._a,
        _operand(src),
        casting=casting,
        where=True if where is None else where._a if isinstance(where, ndarray) else _operand(where),
    )


# --- reductions and linear algebra ---------------------------------------------------------------


def sum(a, axis=None, dtype=None, out=None, keepdims=False):  # noqa: A001 - CuPy's names
    return _method(a, "sum", axis, dtype, out, keepdims)


def prod(a, axis=None, dtype=None, out=None, keepdims=False):
    return _method(a, "prod", axis, dtype, out, keepdims)


def mean(a, axis=None, dtype=None, out=None, keepdims=False):
    return _method(a, "mean", axis, dtype, out, keepdims)


def var(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False):
    return _method(a, "var", axis=axis, dtype=dtype, out=out, ddof=ddof, keepdims=keepdims)


def std(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False):
    return _method(a, "std", axis=axis, dtype=dtype, out=out, ddof=ddof, keepdims=keepdims)


def amax(a, axis=None, out=None, keepdims=False):
    return _method(a, "max", axis, out, keepdims)


def amin(a, axis=None, out=None, keepdims=False):
    return _method(a, "min", axis, out, keepdims)


max = amax  # noqa: A001
min = amin  # noqa: A001


def ptp(a, axis=None, out=None, keepdims=False):
    return _method(a, "ptp", axis, out, keepdims)


def argmax(a, axis=None, dtype=None, out=None, keepdims=False):
    return _method(a, "argmax", axis=axis, dtype=dtype, out=out, keepdims=keepdims)


def argmin(a, axis=None, dtype=None, out=None, keepdims=False):
    return _method(a, "argmin", axis=axis, dtype=dtype, out=out, keepdims=keepdims)


def all(a, axis=None, out=None, keepdims=False):  # noqa: A001
    return _method(a, "all", axis, out, keepdims)


def any(a, axis=None, out=None, keepdims=False):  # noqa: A001
    return _method(a, "any", axis, out, keepdims)


def cumsum(a, axis=None, dtype=None, out=None):
    return _method(a, "cumsum", axis, dtype, out)


def cumprod(a, axis=None, dtype=None, out=None):
    return _method(a, "cumprod", axis, dtype, out)


def count_nonzero(a, axis=None):
    return _call(numpy.count_nonzero, a, axis)


def clip(a, a_min, a_max, out=None):
    return _method(a, "clip", a_min, a_max, out)


def around(a, decimals=0, out=None):
    return _method(a, "round", decimals, out)


round = around  # noqa: A001


def sort(a, axis=-1, kind=None):
    return _call(numpy.sort, a, axis=axis, kind=kind)


def argsort(a, axis=-1, kind=None):
    return _method(a, "argsort", axis, kind)


def trace(a, offset=0, axis1=0, axis2=1, dtype=None, out=None):
    return _method(a, "trace", offset, axis1, axis2, dtype, out)


def dot(a, b, out=None):
    return _call(numpy.dot, a, b, out=out)


def vdot(a, b):
    return _call(numpy.vdot, a, b)


def inner(a, b):
    return _call(numpy.inner, a, b)


def outer(a, b, out=None):
    return _call(numpy.outer, a, b, out=out)


def tensordot(a, b, axes=2):
    return _call(numpy.tensordot, a, b, axes)


def einsum(*operands, **kwargs):
    """CuPy's einsum takes ``dtype`` and ``optimize`` only (no ``out``, no ``casting``)."""
    unknown = [k for k in kwargs if k not in ("dtype", "optimize")]
    if unknown:
        raise TypeError(f"Did not understand the following kwargs: {unknown}")
    return _call(numpy.einsum, *operands, **kwargs)


# --- comparisons and queries ---------------------------------------------------------------------


def isclose(a, b, rtol=1.0e-5, atol=1.0e-8, equal_nan=False):
    return _call(numpy.isclose, a, b, rtol, atol, equal_nan)


def allclose(a, b, rtol=1.0e-5, atol=1.0e-8, equal_nan=False):
    """A 0-d boolean device array (CuPy does not return a Python bool here)."""
    return _from_host(numpy.asarray(isclose(a, b, rtol, atol, equal_nan)._a.all()))


def array_equal(a1, a2, equal_nan=False):
    return _from_host(numpy.asarray(_call(numpy.array_equal, a1, a2, equal_nan)))


def shares_memory(a, b, max_work=None):
    return builtins.bool(_call_view(numpy.shares_memory, a, b, max_work))


def may_share_memory(a, b, max_work=None):
    return builtins.bool(_call_view(numpy.may_share_memory, a, b, max_work))


def result_type(*arrays_and_dtypes):
    return numpy.result_type(*[x.dtype if isinstance(x, ndarray) else x for x in arrays_and_dtypes])


def get_array_module(*args):
    """The stand-in for arguments that hold a stand-in array, else NumPy."""
    import sys  # noqa: PLC0415

    for a in args:
        if isinstance(a, ndarray):
            return sys.modules[__package__]
    return numpy


# --- helpers -----------------------------------------------------------------------------------------


def _method(a, name, *args, **kwargs):
    if not isinstance(a, ndarray):
        raise TypeError(f"Unsupported type {type(a)}: the stand-in's routines take its arrays")
    return getattr(a, name)(*args, **kwargs)


def _runtime_device() -> int:
    return runtime.getDevice()


def _holds_device_arrays(seq) -> bool:
    return builtins.any(
        isinstance(x, ndarray) or (isinstance(x, (list, tuple)) and _holds_device_arrays(x)) for x in seq
    )


def _result_dtype(seq):
    return numpy.result_type(*[x.dtype if isinstance(x, ndarray) else numpy.asarray(x).dtype for x in seq])


__all__ = [
    name
    for name, value in list(globals().items())
    if not name.startswith("_") and callable(value) and getattr(value, "__module__", None) == __name__
]
