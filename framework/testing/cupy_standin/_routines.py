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

from . import _core, counting
from ._core import _call, _call_view, _check_current, _dtype, _from_host, _h2d, _launch, _operand, _wrap, ndarray
from .cuda import graph as _graph
from .cuda import runtime

# --- creation ----------------------------------------------------------------------------------------


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    """A new device array: a copy of a host array, a list, a scalar or a device array."""
    if isinstance(obj, ndarray):
        if dtype is None and not copy and obj.device.id == _runtime_device() and ndmin <= obj.ndim:
            return obj
        host = numpy.array(obj._a, dtype=dtype, order=order, ndmin=ndmin)
        _launch("copy" if host.dtype == obj.dtype else "elementwise", host.size)  # a copy or a cast
        return _from_host(host)
    if isinstance(obj, (list, tuple)) and _holds_device_arrays(obj):
        return stack([asarray(x) for x in obj]).astype(dtype or _result_dtype(obj), copy=False)
    if order in (None, "K", "k", "A", "a"):  # CuPy's ``_array_default``: a host array arrives C or F
        order = "F" if isinstance(obj, numpy.ndarray) and obj.flags.fnc else "C"
    return _h2d(numpy.array(obj, dtype=dtype, order=order, ndmin=ndmin))


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
    _launch("copy" if dtype is None or _dtype(dtype) == a.dtype else "elementwise", a.size)
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
    """CuPy clears the new memory with one ``cudaMemsetAsync`` (kind ``"memset"``)."""
    a = ndarray(shape, dtype, order=order)
    host = a._a
    _graph.run("memset", lambda: host.fill(0), a.nbytes, (a,))  # recorded while capturing
    return a


def ones(shape, dtype=float, order="C"):
    a = ndarray(shape, dtype, order=order)
    a.fill(1)
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
    host = out._a
    _graph.run("memset", lambda: host.fill(0), out.nbytes, (out,))  # recorded while capturing
    return out


def ones_like(a, dtype=None, order="K", subok=None, shape=None):
    out = empty_like(a, dtype, order, subok, shape)
    out.fill(1)
    return out


def full_like(a, fill_value, dtype=None, order="K", subok=None, shape=None):
    out = empty_like(a, dtype, order, subok, shape)
    out.fill(fill_value)
    return out


def arange(start, stop=None, step=1, dtype=None):
    return _generated(numpy.arange(start, stop, step, dtype=dtype))


def linspace(start, stop, num=50, endpoint=True, retstep=False, dtype=None, axis=0):
    res = numpy.linspace(start, stop, num, endpoint, retstep, dtype, axis)
    return (_generated(res[0]), res[1]) if retstep else _generated(res)


def eye(N, M=None, k=0, dtype=float, order="C"):  # noqa: N803 - CuPy's names
    res = _from_host(numpy.eye(N, M, k, dtype=dtype, order=order))
    _launch("memset", res.nbytes)  # CuPy: zeros, then the diagonal filled
    _launch("elementwise", builtins.min(res.shape))
    return res


def identity(n, dtype=float):
    return eye(n, dtype=dtype)


def copy(a, order="K"):
    return _call("copy", numpy.copy, a, order=order)


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
    return _call("copy", numpy.concatenate, tuple(tup), axis=axis, out=out, dtype=dtype, casting=casting)


def stack(tup, axis=0, out=None, *, dtype=None, casting="same_kind"):
    return _call("copy", numpy.stack, tuple(tup), axis=axis, out=out, dtype=dtype, casting=casting)


def vstack(tup, *, dtype=None, casting="same_kind"):
    return _call("copy", numpy.vstack, tuple(tup), dtype=dtype, casting=casting)


def hstack(tup, *, dtype=None, casting="same_kind"):
    return _call("copy", numpy.hstack, tuple(tup), dtype=dtype, casting=casting)


def split(ary, indices_or_sections, axis=0):
    return _call_view(numpy.split, ary, indices_or_sections, axis)


def tile(A, reps):  # noqa: N803
    return _call("copy", numpy.tile, A, reps)


def repeat(a, repeats, axis=None):
    return _call("copy", numpy.repeat, a, repeats, axis)


def flip(a, axis=None):
    return _call_view(numpy.flip, a, axis)


def roll(a, shift, axis=None):
    return _call("copy", numpy.roll, a, shift, axis)


def pad(array, pad_width, mode="constant", **kwargs):  # noqa: A002
    res = _call("copy", numpy.pad, array, pad_width, mode, **kwargs)
    _launch("elementwise", res.size)  # CuPy: the border filled, then the array copied in
    return res


# --- indexing ----------------------------------------------------------------------------------------


def where(condition, x=None, y=None):
    if (x is None) != (y is None):
        raise ValueError("Must provide both 'x' and 'y' or neither.")
    if x is None:
        return nonzero(condition)
    return _call("elementwise", numpy.where, condition, x, y)


def nonzero(a):
    if not isinstance(a, ndarray):
        raise TypeError(f"Unsupported type {type(a)}")
    return a.nonzero()


def flatnonzero(a):
    return a.ravel().nonzero()[0]


def take(a, indices, axis=None, out=None):
    return a.take(indices, axis, out)


def take_along_axis(a, indices, axis):
    _check_current(a, indices)
    res = _wrap(
        numpy.take_along_axis(
            a._a,
            numpy.mod(_core._host_indices(indices), a.shape[axis]) if a.shape[axis] else _core._host_indices(indices),
            axis,
        )
    )
    _launch("gather", res.size)
    return res


def put_along_axis(arr, indices, values, axis):
    _check_current(arr, indices, values)
    idx = _core._host_indices(indices)
    if arr.shape[axis]:
        idx = numpy.mod(idx, arr.shape[axis])
    numpy.put_along_axis(arr._a, idx, _operand(values), axis)
    _launch("scatter", arr.size)


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
        _launch("copy", dst.size)  # a peer-to-peer copy
        return
    _check_current(dst, src, where)
    host_dst, host_src = dst._a, _operand(src)
    host_where = True if where is None else where._a if isinstance(where, ndarray) else _operand(where)
    if _graph.current_capture() is not None:  # checked at the (recorded) launch, as CuPy: on a host copy
        numpy.copyto(host_dst.copy(), host_src, casting=casting, where=host_where)
    _graph.run(
        "copy",
        lambda: numpy.copyto(host_dst, host_src, casting=casting, where=host_where),
        dst.size,
        [a for a in (dst, src, where) if isinstance(a, ndarray)],
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
    return _call("reduction", numpy.count_nonzero, a, axis)


def clip(a, a_min, a_max, out=None):
    return _method(a, "clip", a_min, a_max, out)


def around(a, decimals=0, out=None):
    return _method(a, "round", decimals, out)


round = around  # noqa: A001


def sort(a, axis=-1, kind=None):
    return _call("sort", numpy.sort, a, axis=axis, kind=kind)


def argsort(a, axis=-1, kind=None):
    return _method(a, "argsort", axis, kind)


def trace(a, offset=0, axis1=0, axis2=1, dtype=None, out=None):
    return _method(a, "trace", offset, axis1, axis2, dtype, out)


def dot(a, b, out=None):
    return _method(a, "dot", b, out=out)


def vdot(a, b):
    return _call("matmul", numpy.vdot, a, b)


def inner(a, b):
    return _call("matmul", numpy.inner, a, b)


def outer(a, b, out=None):
    return _call("matmul", numpy.outer, a, b, out=out)


def tensordot(a, b, axes=2):
    return _call("matmul", numpy.tensordot, a, b, axes)


def einsum(*operands, **kwargs):
    """CuPy's einsum takes ``dtype`` and ``optimize`` only (no ``out``, no ``casting``)."""
    unknown = [k for k in kwargs if k not in ("dtype", "optimize")]
    if unknown:
        raise TypeError(f"Did not understand the following kwargs: {unknown}")
    return _call("matmul", numpy.einsum, *operands, **kwargs)


# --- comparisons and queries ---------------------------------------------------------------------


def isclose(a, b, rtol=1.0e-5, atol=1.0e-8, equal_nan=False):
    return _call("elementwise", numpy.isclose, a, b, rtol, atol, equal_nan)


def allclose(a, b, rtol=1.0e-5, atol=1.0e-8, equal_nan=False):
    """A 0-d boolean device array (CuPy does not return a Python bool here)."""
    return isclose(a, b, rtol, atol, equal_nan).all()


def array_equal(a1, a2, equal_nan=False):
    """A 0-d boolean device array: CuPy compares (one kernel) and reduces (another)."""
    res = _call("elementwise", numpy.array_equal, a1, a2, equal_nan)
    _launch("reduction")
    return _from_host(numpy.asarray(res))


def may_share_memory(a, b, max_work=None):
    """CuPy's bounds check (``_memory_range.may_share_bounds``): both in one allocation of
    one device, neither empty, and their byte ranges overlap. No kernel, no host sync."""
    if max_work is not None:
        raise NotImplementedError("Only supported for `max_work` is `None`")
    return _may_share_bounds(a, b)


def shares_memory(a, b, max_work=None):
    """CuPy's exact check, as CuPy computes it: the address of every element of ``a`` and of
    ``b`` (an elementwise kernel writing ``&x``), then whether any address is in both.

    The quirk this keeps: the kernel reads a 0-d array's element into a local variable
    (CuPy's ``CArray<T, 0>`` returns it by value), so ``&x`` is that local's address, the
    same for every 0-d array and no element's: two distinct 0-d arrays "share memory",
    and a 0-d view never shares memory with the array it views.
    """
    for x in (a, b):
        if not isinstance(x, ndarray):
            raise TypeError(f"Unsupported type {type(x)}")
    if a is b and a.size != 0:
        return True
    if max_work == "MAY_SHARE_BOUNDS":
        return _may_share_bounds(a, b)
    if max_work not in (None, "MAY_SHARE_EXACT"):
        raise NotImplementedError("Not supported for integer `max_work`.")
    a_ptrs, b_ptrs = _element_addresses(a), _element_addresses(b)
    # CuPy: two pointer kernels, a sort, two searchsorted, a comparison, any() and bool().
    _launch("elementwise", a.size)
    _launch("elementwise", b.size)
    for kind in ("sort", "elementwise", "elementwise", "elementwise", "reduction"):
        _launch(kind)
    counting.host_sync("bool")
    return builtins.bool(numpy.isin(b_ptrs, a_ptrs).any())


# The address ``&x`` of a 0-d array's element inside an elementwise kernel: a local
# variable's (see shares_memory), the same for every 0-d array; never a pool address.
_KERNEL_LOCAL_ADDRESS = 0xFFFF_FFFF_FFFF_F000


def _element_addresses(x) -> numpy.ndarray:
    """The address of every element of ``x`` (real and imaginary parts apart, as CuPy)."""
    if x.ndim == 0:
        ptrs = numpy.array([_KERNEL_LOCAL_ADDRESS], dtype=numpy.uint64)
    else:
        offsets = numpy.zeros(x.shape, dtype=numpy.int64)
        for axis, (n, stride) in enumerate(zip(x.shape, x.strides)):
            offsets += (numpy.arange(n, dtype=numpy.int64) * stride).reshape((-1,) + (1,) * (x.ndim - axis - 1))
        ptrs = (numpy.int64(x.data.ptr) + offsets).astype(numpy.uint64).ravel()
    if x.dtype.kind == "c":  # CuPy concatenates the addresses of x.real and x.imag
        half = numpy.uint64(x.itemsize // 2) if x.ndim else numpy.uint64(0)
        ptrs = numpy.concatenate([ptrs, ptrs + half])
    return ptrs


def _may_share_bounds(a, b) -> builtins.bool:
    for x in (a, b):
        if not isinstance(x, ndarray):
            raise TypeError(f"Unsupported type {type(x)}")
    if a.data.device_id != b.data.device_id or a.data.mem.ptr != b.data.mem.ptr or a.size == 0 or b.size == 0:
        return False
    (a_lo, a_hi), (b_lo, b_hi) = _bounds(a), _bounds(b)
    return a_lo < b_hi and b_lo < a_hi


def _bounds(x) -> tuple:
    """``[first byte, last byte + 1)`` that ``x`` touches (CuPy's ``_memory_range.get_bound``)."""
    lo = hi = x.data.ptr
    for n, stride in zip(x.shape, x.strides):
        step = (n - 1) * stride
        if step > 0:
            hi += step
        else:
            lo += step
    return lo, hi + x.itemsize


def result_type(*arrays_and_dtypes):
    return numpy.result_type(*[x.dtype if isinstance(x, ndarray) else x for x in arrays_and_dtypes])


def _generated(host: numpy.ndarray) -> ndarray:
    """A result a CuPy kernel computes on the device from its arguments alone (``arange``)."""
    res = _from_host(host)
    _launch("elementwise", res.size)
    return res


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
