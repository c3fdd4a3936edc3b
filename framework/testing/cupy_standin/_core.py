"""The stand-in's array type and the machinery every routine goes through.

:class:`ndarray` is its own type (not a NumPy subclass): a NumPy array over a block of
the stand-in's memory pool, kept in ``_a``, which NumPy code outside the stand-in never
receives. Like ``cupy.ndarray`` it refuses to become a NumPy array implicitly:
``numpy.asarray(a)`` raises TypeError, a NumPy ufunc or function on it runs the
stand-in's own version (as CuPy's ``__array_ufunc__``/``__array_function__`` do) or
raises TypeError when the stand-in has no such routine or a host array is mixed in, and
``float(a)`` works only for one element (CuPy copies it to the host). ``.get()`` and
``cupy.asnumpy`` are the ways to the host.

Every routine calls NumPy on the host arrays and puts a new result into new pool
memory (a view of an input stays a view of it), so the pool and its hooks see every
allocation a CuPy program would make. Kernels refuse arrays of another device than the
current one (CuPy does too where peer access is unavailable; the stand-in never enables it).
"""

from __future__ import annotations

import operator
import sys
import warnings

import numpy

from . import counting
from .cuda import graph as _graph
from .cuda import memory as _memory
from .cuda import runtime as _runtime
from .cuda.device import Device

_PY_SCALARS = (bool, int, float, complex)
_SUPPORTED_DTYPES = frozenset("?bBhHiIlLqQefdFD")  # bool, integers, float16/32/64, complex64/128
_BFLOAT16 = None
try:  # CuPy 14 supports bfloat16 where ml_dtypes imports (char "E"), and only there
    import ml_dtypes

    _SUPPORTED_DTYPES |= {"E"}
    _BFLOAT16 = numpy.dtype(ml_dtypes.bfloat16)
except ImportError:
    pass
_MISSING = object()


def _dtype(dtype) -> numpy.dtype:
    """``numpy.dtype(dtype)``, refused (ValueError, as CuPy) when CuPy has no such dtype."""
    dt = numpy.dtype(dtype)
    if dt.char not in _SUPPORTED_DTYPES:
        raise ValueError(f"Unsupported dtype {dt}")
    return dt


def _launch(kind: str, size: int = 1) -> None:
    """Counts one kernel launch of ``kind`` (:mod:`.counting`); CuPy launches none for an empty output."""
    if size:
        counting.launch(kind)


def _check_axis(axis, ndim: int) -> None:
    """CuPy's axis check of reductions and scans (``internal._normalize_axis_index``): stricter
    than NumPy, which lets ``axis=0`` and ``axis=-1`` through on a 0-d array."""
    for ax in () if axis is None else axis if type(axis) is tuple else (axis,):
        if not -ndim <= operator.index(ax) < ndim:
            raise numpy.exceptions.AxisError(ax, ndim)


def _peer_error(a: ndarray, device_id: int) -> ValueError:
    return ValueError(
        f"The device where the array resides ({a.data.device_id}) is different from the current "
        f"device ({device_id}). Peer access is unavailable between these devices."
    )


# --- between host arrays and pool memory -----------------------------------------------------


def _host_view(memptr, shape, dtype, strides=None) -> numpy.ndarray:
    """The NumPy array over device memory at ``memptr`` (NumPy checks it fits the block)."""
    return numpy.ndarray(shape, dtype, buffer=memptr.mem._buf, offset=memptr.ptr - memptr.mem.ptr, strides=strides)


def _new(a: numpy.ndarray, memptr, base) -> ndarray:
    x = object.__new__(ndarray)
    x._a = a
    x.data = memptr
    x.base = base
    return x


def _dense_strides(host: numpy.ndarray):
    """Strides of a dense array with ``host``'s axis order (NumPy's order 'K'); None for C."""
    if host.ndim < 2 or host.flags.c_contiguous:
        return None
    order = sorted(range(host.ndim), key=lambda ax: -abs(host.strides[ax]))
    strides, step = [0] * host.ndim, host.itemsize
    for ax in reversed(order):
        strides[ax] = step
        step *= host.shape[ax]
    return tuple(strides)


def _from_host(host: numpy.ndarray) -> ndarray:
    """A copy of a host array in new memory of the current device (its layout kept); the
    stand-in's way to store a result, so it counts nothing: callers count their launch."""
    dtype = _dtype(host.dtype)
    memptr = _memory.alloc(host.size * dtype.itemsize)
    a = _host_view(memptr, host.shape, dtype, _dense_strides(host))
    numpy.copyto(a, host)
    return _new(a, memptr, None)


def _h2d(host: numpy.ndarray) -> ndarray:
    """A host-to-device copy (``cupy.asarray`` of a NumPy array): one transfer, counted as
    a launch of kind ``"h2d"`` (CuPy queues it on the stream; the host does not wait).
    Refused with CuPy's RuntimeError while the current stream captures."""
    if _graph._captures and _graph.current_capture() is not None:
        raise RuntimeError(_graph.H2D_MESSAGE)
    res = _from_host(host)
    _launch("h2d", res.nbytes)
    return res


def _view(owner: ndarray, a: numpy.ndarray, indexed: bool = False) -> ndarray:
    """``a`` (a NumPy view into ``owner``'s memory) as a stand-in view of ``owner``, with
    CuPy's references: ``base`` the array that owns the memory; ``data`` the owner's own
    pointer object where the view starts where it does (CuPy's ``_view``: a transpose, a
    reshape, ``view()``), else a new pointer over the same memory (``owner.data + offset``:
    basic indexing, ``indexed``, always makes one for a non-empty view)."""
    ptr = a.__array_interface__["data"][0] if a.size else owner.data.ptr
    if ptr == owner.data.ptr and not (indexed and a.size):
        memptr = owner.data
    else:
        memptr = owner.data + (ptr - owner.data.ptr)
    return _new(a, memptr, owner if owner.base is None else owner.base)


def _adopt(res: numpy.ndarray, inputs) -> ndarray:
    """A NumPy result as a stand-in array: an input itself, a view of an input, or new memory."""
    for x in inputs:
        if res is x._a:
            return x
    if res.base is not None and res.size:
        ptr = res.__array_interface__["data"][0]
        for x in inputs:
            mem = x.data.mem
            if mem.ptr <= ptr < mem.ptr + mem.size:
                return _view(x, res)
    return _from_host(res)


def _wrap(res, inputs=()):
    """Stand-in arrays for the arrays (and NumPy scalars: 0-d arrays, as CuPy) in a result."""
    if type(res) is numpy.ndarray:
        return _adopt(res, inputs)
    if isinstance(res, numpy.generic) and res.dtype.char in _SUPPORTED_DTYPES:
        return _from_host(numpy.asarray(res))
    if type(res) is tuple or type(res) is list:
        return type(res)(_wrap(r, inputs) for r in res)
    return res


def _unwrap(x, device_id, inputs):
    """Host arrays for the stand-in arrays in an argument; NumPy arrays are refused."""
    if isinstance(x, ndarray):
        if device_id is not None and x.data.device_id != device_id:
            raise _peer_error(x, device_id)
        inputs.append(x)
        return x._a
    if type(x) is list or type(x) is tuple:  # sequences of arrays: stack, concatenate, einsum
        return type(x)([_unwrap(v, device_id, inputs) for v in x])
    if isinstance(x, numpy.ndarray):
        raise TypeError(f"Unsupported type {type(x)}")
    return x


def _call(kind, func, *args, **kwargs):
    """``func`` (NumPy) on the host arrays of stand-in arguments, all on the current device:
    one kernel launch of ``kind`` (None: the caller counts)."""
    if kind == "matmul":
        _graph.check_library(_graph.CUBLAS_MESSAGE)
    device_id = _runtime.getDevice()
    inputs: list = []
    out = kwargs.get("out")
    args = [_unwrap(a, device_id, inputs) for a in args]
    kwargs = {k: _unwrap(v, device_id, inputs) for k, v in kwargs.items()}
    if kind is not None and _graph.current_capture() is not None:
        if isinstance(out, ndarray):
            if out.size:  # a kernel into a given output: recorded into the capture, not run
                _graph.record(kind, lambda: func(*args, **kwargs), arrays=inputs)
            return out
        if out is None:
            return _captured(kind, lambda: func(*args, **kwargs), inputs)
    res = _wrap(func(*args, **kwargs), inputs)
    if kind is not None:
        _launch(kind, _size(res))
    return res


def _captured(kind, compute, inputs):
    """During stream capture: a kernel that allocates its result. Its output is allocated
    now (from the current allocator: refused when that is the pool, as CUDA refuses
    cudaMalloc during capture; served where an allocator hands out memory that already
    exists), and the kernel is recorded to compute into it at each launch, as CuPy does on
    a GPU. The shapes come from ``compute()`` on what the buffers hold now (not used)."""
    with numpy.errstate(all="ignore"):
        probe = compute()
    res = _wrap(probe, inputs)
    seq = res if type(res) in (tuple, list) else (res,)
    new = [
        (i, r._a)
        for i, r in enumerate(seq)
        if isinstance(r, ndarray) and r.base is None and not any(r is x for x in inputs)
    ]
    if not new:  # a view of an input (or an input): no kernel
        return res
    news = [seq[i] for i, _ in new]

    def kernel():
        with numpy.errstate(all="ignore"):
            out = compute()
        outs = out if type(out) in (tuple, list) else (out,)
        for i, host in new:
            numpy.copyto(host, outs[i], casting="unsafe")

    _graph.record(kind, kernel, arrays=(*inputs, *news))
    return res


def _size(res) -> int:
    """Elements of a result (of all of them, for a tuple or list of results)."""
    if isinstance(res, ndarray):
        return res.size
    if type(res) is tuple or type(res) is list:
        return sum(_size(r) for r in res)
    return 1


def _call_view(func, *args, **kwargs):
    """:func:`_call` for routines that make views (no kernel: any device will do). Where
    NumPy had to copy instead (``reshape`` of a non-contiguous array), CuPy copies too:
    one copy launch."""
    inputs: list = []
    args = [_unwrap(a, None, inputs) for a in args]
    kwargs = {k: _unwrap(v, None, inputs) for k, v in kwargs.items()}
    if _graph.current_capture() is not None:  # a copy NumPy had to make: recorded, as CuPy's kernel is
        return _captured("copy", lambda: func(*args, **kwargs), inputs)
    res = _wrap(func(*args, **kwargs), inputs)
    for r in res if type(res) is tuple or type(res) is list else (res,):
        if isinstance(r, ndarray) and r.base is None and not any(r is x for x in inputs):
            _launch("copy", r.size)
    return res


def _check_current(*arrays) -> int:
    device_id = _runtime.getDevice()
    for a in arrays:
        if isinstance(a, ndarray) and a.data.device_id != device_id:
            raise _peer_error(a, device_id)
    return device_id


# --- indexing ------------------------------------------------------------------------------------


def _index(key, a: ndarray):
    """``(host index, advanced)``: stand-in arrays as host arrays, lists and NumPy arrays as
    arrays, and integer arrays wrapped around the length of the axis they index (CuPy does
    not check their bounds: ``a[[1, 3]]`` of 3 elements is ``a[[1, 0]]``)."""
    items = key if type(key) is tuple else (key,)
    converted, advanced = [], False
    for it in items:
        if isinstance(it, ndarray):
            it, advanced = it._a, True
        elif isinstance(it, (list, numpy.ndarray)):
            empty_list = isinstance(it, list) and len(it) == 0
            it, advanced = numpy.asarray(it), True
            _launch("h2d")  # CuPy copies a host index to the device first
            if empty_list:
                it = it.astype(numpy.intp)  # an empty list is an empty index, not an empty mask
        converted.append(it)
    if not advanced:
        return key, False
    consumed = [
        x.ndim if isinstance(x, numpy.ndarray) and x.dtype == numpy.bool_ else 0 if x is None or x is Ellipsis else 1
        for x in converted
    ]
    axis = 0
    for i, x in enumerate(converted):
        if x is Ellipsis:
            axis = a.ndim - sum(consumed[i + 1 :])
            continue
        if isinstance(x, numpy.ndarray) and x.dtype.kind in "iu" and axis < a.ndim and a.shape[axis]:
            converted[i] = numpy.mod(x, a.shape[axis])
        axis += consumed[i]
    return (tuple(converted) if type(key) is tuple else converted[0]), True


# What CuPy 14.2's ``scatter_add`` with integer index arrays takes (its atomicAdd overloads;
# ``_scatter_op_single`` in ``cupy/_core/_routines_indexing.pyx``): no bfloat16, bool, 8- or
# 16-bit integers, nor complex.
_ADD_AT_DTYPES = frozenset(
    numpy.dtype(t) for t in ("int32", "int64", "float16", "float32", "float64", "uint32", "uint64")
)


def _scatter(a: ndarray, key, value, np_ufunc) -> None:
    """``np_ufunc.at(a, key, value)`` in place: repeated indices accumulate (cupyx.scatter_add)."""
    if not isinstance(a, ndarray):
        raise TypeError(f"Unsupported type {type(a)}")
    _check_current(a, value)
    parts = key if type(key) is tuple else (key,)
    integer_arrays = any(isinstance(k, ndarray) and k.dtype.kind in "iu" for k in parts)
    if np_ufunc is numpy.add and integer_arrays and a.dtype not in _ADD_AT_DTYPES:
        raise TypeError(
            "cupy.add.at only supports int32, int64, float16, float32, float64, uint32, uint64 as data type"
        )
    index, _ = _index(key, a)
    if a.size and _graph.current_capture() is not None:
        # recorded: the index arrays are read (and wrapped) when the kernel runs
        operand = _operand(value)
        arrays = [a] + [v for v in (key if type(key) is tuple else (key,)) if isinstance(v, ndarray)]
        arrays += [value] if isinstance(value, ndarray) else []
        _graph.record("scatter", lambda: np_ufunc.at(a._a, _index(key, a)[0], operand), arrays=arrays)
        return
    np_ufunc.at(a._a, index, _operand(value))
    _launch("scatter", a.size)


def _operand(value):
    """A kernel operand: a stand-in array's host array or a scalar (host arrays are refused)."""
    if isinstance(value, ndarray):
        return value._a
    if type(value) in _PY_SCALARS or isinstance(value, numpy.generic):
        return value
    raise TypeError(f"Unsupported type {type(value)}")


# --- ufuncs ----------------------------------------------------------------------------------------


class ufunc:
    """An elementwise routine, as CuPy's ufuncs: arrays of the current device and scalars in,
    a new array out (or ``out=``); keyword arguments ``out``, ``dtype`` and ``casting`` only."""

    def __init__(self, name: str, np_ufunc, scatter: bool = False):
        self.__name__ = name
        self.name = "cupy_" + name
        self._np = np_ufunc
        self.nin, self.nout, self.nargs = np_ufunc.nin, np_ufunc.nout, np_ufunc.nargs
        self._scatter = scatter
        self.__doc__ = f"The stand-in's ``cupy.{name}``: ``numpy.{np_ufunc.__name__}`` on the device."

    def __repr__(self) -> str:
        return f"<ufunc '{self.__name__}'>"

    def __call__(self, *args, out=None, dtype=None, casting="same_kind", **kwargs):
        if kwargs:
            raise TypeError(f"Wrong arguments {kwargs}")
        if len(args) != self.nin:
            raise TypeError(f"Wrong number of arguments for {self.name}")
        if self.__name__ == "matmul":
            _graph.check_library(_graph.CUBLAS_MESSAGE)
        device_id = _check_current(*args)
        host = [_operand(x) for x in args]
        if self.__name__ == "matmul":
            _check_bfloat16_matmul(host)
        if out is None:
            if self.__name__ != "matmul" and _graph.current_capture() is not None:
                np_ufunc = self._np
                return _captured(
                    "elementwise",
                    lambda: np_ufunc(*host, dtype=dtype, casting=casting),
                    [x for x in args if isinstance(x, ndarray)],
                )
            res = self._np(*host, dtype=dtype, casting=casting)
            if self.__name__ == "matmul" and dtype is None:  # NumPy gives bfloat16's product in float32
                res = res.astype(numpy.result_type(*host), copy=False)
            res = _wrap(res)
        else:
            if not isinstance(out, ndarray):
                raise TypeError("Output arguments must be cupy.ndarray")
            if out.data.device_id != device_id:
                raise _peer_error(out, device_id)
            np_ufunc, host_out = self._np, out._a
            if self.__name__ != "matmul" and out.size and _graph.current_capture() is not None:
                # CuPy checks the types and shapes when the kernel is launched (recorded): so
                # does the stand-in, on a host copy of the output (the buffer is not written)
                with numpy.errstate(all="ignore"):  # what the buffers hold now is not used
                    np_ufunc(*host, out=host_out.copy(), dtype=dtype, casting=casting)
                _graph.record(
                    "elementwise",
                    lambda: np_ufunc(*host, out=host_out, dtype=dtype, casting=casting),
                    arrays=(*args, out),
                )
                return out
            np_ufunc(*host, out=host_out, dtype=dtype, casting=casting)
            res = out
        if self.__name__ == "matmul":
            _count_matmul(args[0], args[1], out, res.size)
        else:
            _launch("elementwise", res.size)
        return res

    def at(self, a, indices, b=None):
        if not self._scatter:
            raise NotImplementedError(f"`{self.name}.at` is not supported yet")
        _scatter(a, indices, b, self._np)

    def reduce(self, array, axis=0, dtype=None, out=None, keepdims=False):
        if self.__name__ == "add":
            return array.sum(axis, dtype, out, keepdims)
        if self.__name__ == "multiply":
            return array.prod(axis, dtype, out, keepdims)
        raise NotImplementedError(f"`{self.name}.reduce` is not supported yet")

    def accumulate(self, array, axis=0, dtype=None, out=None):
        if self.__name__ == "add":
            return array.cumsum(axis, dtype, out)
        if self.__name__ == "multiply":
            return array.cumprod(axis, dtype, out)
        raise NotImplementedError(f"`{self.name}.accumulate` is not supported yet")

    def outer(self, A, B, **kwargs):  # noqa: N803 - NumPy's names
        A, B = (x if isinstance(x, ndarray) else _h2d(numpy.asarray(x)) for x in (A, B))
        return self(A.reshape(A.shape + (1,) * B.ndim), B.reshape((1,) * A.ndim + B.shape), **kwargs)


def _ufuncs() -> dict:
    return sys.modules[__package__]._UFUNCS


def _standin_module():
    return sys.modules[__package__]


def _should_use_rop(x, y) -> bool:
    """CuPy's rule (NEP 13, then ``__array_priority__``) for deferring to ``y``'s reflected op."""
    y_ufunc = getattr(y, "__array_ufunc__", _MISSING)
    if y_ufunc is not _MISSING:
        return y_ufunc is None
    return getattr(x, "__array_priority__", 0) < getattr(y, "__array_priority__", 0)


def _binary(name: str):
    def op(self, other):
        if isinstance(other, ndarray):
            return _ufuncs()[name](self, other)
        if _should_use_rop(self, other):
            return NotImplemented
        return getattr(numpy, name)(self, other)  # NumPy dispatches to __array_ufunc__

    def rop(self, other):
        return _ufuncs()[name](other, self)

    def iop(self, other):
        return _ufuncs()[name](self, other, out=self)

    return op, rop, iop


def _comparison(name: str, empty_eq=None):
    def op(self, other):
        if isinstance(other, ndarray):
            return _ufuncs()[name](self, other)
        if _should_use_rop(self, other):
            return NotImplemented
        if empty_eq is not None and (other is None or type(other).__eq__ is object.__eq__):
            # Not a number nor an array: never equal to an element (CuPy allows the comparison).
            return _standin_module().full(self.shape, empty_eq, dtype=numpy.bool_)
        return getattr(numpy, name)(self, other)

    return op


class _Flags:
    __slots__ = ("c_contiguous", "f_contiguous", "owndata")

    def __init__(self, c: bool, f: bool, owndata: bool):
        self.c_contiguous, self.f_contiguous, self.owndata = c, f, owndata

    def __getitem__(self, name: str) -> bool:
        return {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous, "OWNDATA": self.owndata}[name]

    def __repr__(self) -> str:
        return f"  C_CONTIGUOUS : {self.c_contiguous}\n  F_CONTIGUOUS : {self.f_contiguous}\n  OWNDATA : {self.owndata}"


# --- the array ----------------------------------------------------------------------------------


class ndarray:
    """A device array of the stand-in, as ``cupy.ndarray(shape, dtype, memptr, strides, order)``.

    Attributes:
        data: a ``MemoryPointer`` into the pool (``data.ptr`` is a real address).
        base: the array this one views (the array owning the memory), or None.
    """

    __slots__ = ("_a", "data", "base", "__weakref__")
    __array_priority__ = 100
    __hash__ = None  # unhashable, as cupy.ndarray

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        dtype = _dtype(dtype)
        shape = (int(shape),) if numpy.ndim(shape) == 0 else tuple(int(n) for n in shape)
        if memptr is None:
            memptr = _memory.alloc(int(numpy.prod(shape, dtype=numpy.int64)) * dtype.itemsize)
            if strides is None and order == "F":
                strides = _f_strides(shape, dtype.itemsize)
        self._a = _host_view(memptr, shape, dtype, strides)
        self.data = memptr
        self.base = None

    # -- attributes ---------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple:
        return self._a.shape

    @shape.setter
    def shape(self, newshape) -> None:
        try:
            self._a = numpy.reshape(self._a, newshape, copy=False)
        except ValueError:
            raise AttributeError("incompatible shape") from None

    @property
    def dtype(self) -> numpy.dtype:
        return self._a.dtype

    @property
    def size(self) -> int:
        return self._a.size

    @property
    def ndim(self) -> int:
        return self._a.ndim

    @property
    def nbytes(self) -> int:
        return self._a.nbytes

    @property
    def itemsize(self) -> int:
        return self._a.itemsize

    @property
    def strides(self) -> tuple:
        return self._a.strides

    @property
    def flags(self) -> _Flags:
        return _Flags(self._a.flags.c_contiguous, self._a.flags.f_contiguous, self.base is None)

    @property
    def device(self) -> Device:
        return Device(self.data.device_id)

    @property
    def T(self) -> ndarray:  # noqa: N802
        return _view(self, self._a.T)

    @property
    def mT(self) -> ndarray:  # noqa: N802
        return _view(self, numpy.swapaxes(self._a, -1, -2))

    @property
    def real(self) -> ndarray:
        return _view(self, self._a.real) if self.dtype.kind == "c" else self

    @property
    def imag(self) -> ndarray:
        if self.dtype.kind == "c":
            return _view(self, self._a.imag)
        return _standin_module().zeros_like(self)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "descr": self.dtype.descr,
            "data": (self.data.ptr, False),
            "version": 3,
            "strides": None if self._a.flags.c_contiguous else self.strides,
        }

    # -- to and from the host -------------------------------------------------------------------
    def get(self, stream=None, order="C", out=None, blocking=True) -> numpy.ndarray:
        """A host (NumPy) copy: the explicit device-to-host transfer (a host synchronization
        unless ``blocking=False``)."""
        return self._to_host("get" if blocking else None, order, out)

    def _to_host(self, sync, order="C", out=None) -> numpy.ndarray:
        """:meth:`get`, counted as CuPy runs it: nothing for an empty array; else a device
        copy first when the array is not contiguous in the order the host array gets (one
        copy launch), the transfer, and one host synchronization of kind ``sync`` (None: an
        asynchronous copy, no wait)."""
        if out is not None:
            if not isinstance(out, numpy.ndarray):
                raise TypeError("Only numpy.ndarray can be obtained from cupy.ndarray")
            if out.dtype != self.dtype:
                raise TypeError(f"{self.dtype} array cannot be obtained to {out.dtype} array")
            if out.shape != self.shape:
                raise ValueError("Shape mismatch")
            order = "C" if out.flags.c_contiguous else "F"
        elif order == "A":
            order = "F" if self._a.flags.f_contiguous and not self._a.flags.c_contiguous else "C"
        if self.size:
            if not (self._a.flags.c_contiguous if order == "C" else self._a.flags.f_contiguous):
                _launch("copy", self.size)
            if sync is not None:
                counting.host_sync(sync)
        if out is not None:
            numpy.copyto(out, self._a)
            return out
        return numpy.array(self._a, order=order, copy=True)

    def set(self, arr, stream=None) -> None:
        """Copies a host (NumPy) array of the same dtype and shape into this array."""
        if not isinstance(arr, numpy.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if self.dtype != arr.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if self.shape != arr.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if not (self._a.flags.c_contiguous or self._a.flags.f_contiguous):
            raise RuntimeError("Cannot set to non-contiguous array")
        if _graph.current_capture() is not None:  # CuPy checks the stream before CUDA: the capture goes on
            raise RuntimeError(_graph.H2D_MESSAGE)
        numpy.copyto(self._a, arr)
        _launch("h2d", self.nbytes)

    def __array__(self, dtype=None, copy=None):
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. "
            "Please use `.get()` to construct a NumPy array explicitly."
        )

    def __array_ufunc__(self, ufunc_, method, *inputs, **kwargs):
        inout = inputs
        if "out" in kwargs:
            out = kwargs["out"]
            if len(out) != 1:
                raise ValueError("The 'out' parameter must have exactly one array value")
            inout += out
            kwargs["out"] = out[0]
        if method not in ("__call__", "outer", "at", "reduce", "accumulate", "reduceat"):
            return NotImplemented
        func = _ufuncs().get(ufunc_.__name__)
        if func is None:
            return NotImplemented
        if method != "__call__":
            func = getattr(func, method, None)
            if func is None:
                return NotImplemented
        for x in inout:
            if not (type(x) in _PY_SCALARS or isinstance(x, (numpy.generic, ndarray, numpy.ndarray))):
                return NotImplemented
        return func(*inputs, **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        target = _standin_module()
        try:
            for part in func.__module__.split(".")[1:]:
                target = getattr(target, part)
            target = getattr(target, func.__name__)
        except AttributeError:
            return NotImplemented
        if target is func:
            return NotImplemented
        if not all(issubclass(t, (ndarray, numpy.ndarray)) for t in types):
            return NotImplemented
        return target(*args, **kwargs)

    def __int__(self) -> int:
        return int(self._to_host("int"))

    def __float__(self) -> float:
        return float(self._to_host("float"))

    def __complex__(self) -> complex:
        return complex(self._to_host("complex"))

    def __bool__(self) -> bool:
        if self.size == 0:
            warnings.warn(
                "The truth value of an empty array is ambiguous. Returning False, but in future "
                "this will result in an error. Use `array.size > 0` to check that an array is "
                "not empty.",
                DeprecationWarning,
                stacklevel=2,
            )
            return False
        if self.size == 1:
            return bool(self._to_host("bool"))
        raise ValueError("The truth value of an array with more than one element is ambiguous. Use a.any() or a.all()")

    def __repr__(self) -> str:
        return repr(self.get())

    def __str__(self) -> str:
        return str(self.get())

    def __format__(self, spec: str) -> str:
        return format(self.get(), spec)

    def __copy__(self) -> ndarray:
        return self.copy()

    def __deepcopy__(self, memo) -> ndarray:
        with self.device:
            return self.copy()

    def __reduce__(self):
        return _standin_module().array, (self.get(order="A"),)

    def item(self):
        return self._to_host("item").item()

    def tolist(self):
        return self._to_host("tolist").tolist()

    def tobytes(self, order="C") -> bytes:
        return self._to_host("tobytes").tobytes(order)

    # -- container ---------------------------------------------------------------------------
    def __len__(self) -> int:
        if self.ndim == 0:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self.shape[0]))

    def __getitem__(self, key) -> ndarray:
        index, advanced = _index(key, self)
        if advanced:  # a gather kernel: a new array on the current device
            _check_current(self, *(key if type(key) is tuple else (key,)))
            res = _wrap(self._a[index])
            if _has_mask(index):
                # CuPy scans the mask, then reads its count back to size the result.
                _launch("scan")
                counting.host_sync("mask")
            _launch("gather", res.size)
            return res
        res = self._a[index]
        if type(res) is not numpy.ndarray:  # every axis indexed by an int: CuPy gives a 0-d view
            res = self._a[(index if type(index) is tuple else (index,)) + (Ellipsis,)]
        return _view(self, res, indexed=True)

    def __setitem__(self, key, value) -> None:
        index, advanced = _index(key, self)
        _check_current(self, value, *(key if type(key) is tuple else (key,)))
        is_array = isinstance(value, ndarray)
        if is_array:
            value_array, value = value, value._a
        elif not (type(value) in _PY_SCALARS or isinstance(value, numpy.generic)):
            value = numpy.asarray(value)  # a host array or a list: refused unless it is one number
            if value.shape != ():
                raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
            value = value[()]
        if not advanced:  # a fill or a copy into a view: recorded while the stream captures
            host = self._a
            _graph.run(
                "copy" if is_array else "elementwise",
                lambda: host.__setitem__(index, value),
                host[index].size,
                (self, *((value_array,) if is_array else ())),
            )
            return
        self._a[index] = value
        if _has_mask(index):
            _launch("scan")
        _launch("scatter", self.size)

    # -- copies, views and shapes ---------------------------------------------------------------
    def copy(self, order="C") -> ndarray:
        """A copy on the CURRENT device (so it also copies between devices, as CuPy); during
        stream capture a copy kernel into a new array, recorded."""
        if _graph.current_capture() is not None:
            _check_current(self)
            return _captured("copy", lambda: numpy.array(self._a, order=order, copy=True), [self])
        _launch("copy", self.size)
        return _from_host(numpy.asarray(self._a, order=order))

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True) -> ndarray:
        dtype = _dtype(dtype)
        if not copy and dtype == self.dtype:
            return self
        _check_current(self)
        kind = "copy" if dtype == self.dtype else "elementwise"  # a copy, or a cast kernel
        if _graph.current_capture() is not None:
            return _captured(kind, lambda: self._a.astype(dtype, order=order, casting=casting or "unsafe"), [self])
        _launch(kind, self.size)
        return _from_host(self._a.astype(dtype, order=order, casting=casting or "unsafe"))

    def view(self, dtype=None, type=None) -> ndarray:  # noqa: A002 - CuPy's names
        return _view(self, self._a.view() if dtype is None else self._a.view(_dtype(dtype)))

    def reshape(self, *shape, order="C") -> ndarray:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = shape[0]
        return _call_view(numpy.reshape, self, tuple(shape), order=order)

    def transpose(self, *axes) -> ndarray:
        if len(axes) == 1 and (axes[0] is None or isinstance(axes[0], (tuple, list))):
            axes = axes[0]
        return _view(self, self._a.transpose(*(axes or ())) if axes else self._a.transpose())

    def swapaxes(self, axis1: int, axis2: int) -> ndarray:
        return _view(self, self._a.swapaxes(axis1, axis2))

    def ravel(self, order="C") -> ndarray:
        return _call_view(numpy.ravel, self, order=order)

    def flatten(self, order="C") -> ndarray:
        _check_current(self)
        _launch("copy", self.size)
        return _from_host(self._a.flatten(order))

    def squeeze(self, axis=None) -> ndarray:
        return _view(self, self._a.squeeze(axis))

    def diagonal(self, offset=0, axis1=0, axis2=1) -> ndarray:
        return _view(self, self._a.diagonal(offset, axis1, axis2), indexed=True)  # CuPy: by indexing

    def fill(self, value) -> None:
        _check_current(self, value)
        if isinstance(value, ndarray):
            if value.shape != ():
                raise ValueError("non-scalar cupy.ndarray cannot be used for fill")
            value = value._a[()]
        else:
            value = numpy.asarray(value, dtype=self.dtype)
            if value.shape != ():
                raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
        host = self._a
        _graph.run("elementwise", lambda: host.fill(value), self.size, (self,))

    # -- computations (CuPy's method signatures) -----------------------------------------------------
    # Each is one kernel launch on a GPU unless said otherwise; reductions check their axis
    # as CuPy does (_check_axis).
    def sum(self, axis=None, dtype=None, out=None, keepdims=False):
        return _reduce(numpy.sum, self, axis, dtype=dtype, out=out, keepdims=keepdims)

    def prod(self, axis=None, dtype=None, out=None, keepdims=False):
        return _reduce(numpy.prod, self, axis, dtype=dtype, out=out, keepdims=keepdims)

    def mean(self, axis=None, dtype=None, out=None, keepdims=False):
        return _reduce(numpy.mean, self, axis, dtype=dtype, out=out, keepdims=keepdims)

    def var(self, axis=None, dtype=None, out=None, ddof=0, keepdims=False):
        # CuPy: the mean (a reduction), then the sum of squared deviations (another one).
        return _reduce(numpy.var, self, axis, 2, dtype=dtype, out=out, ddof=ddof, keepdims=keepdims)

    def std(self, axis=None, dtype=None, out=None, ddof=0, keepdims=False):
        res = _reduce(numpy.std, self, axis, 2, dtype=dtype, out=out, ddof=ddof, keepdims=keepdims)
        _launch("elementwise", res.size)  # CuPy: sqrt of the variance
        return res

    def max(self, axis=None, out=None, keepdims=False):
        return _reduce(numpy.max, self, axis, out=out, keepdims=keepdims)

    def min(self, axis=None, out=None, keepdims=False):
        return _reduce(numpy.min, self, axis, out=out, keepdims=keepdims)

    def ptp(self, axis=None, out=None, keepdims=False):
        res = _reduce(numpy.ptp, self, axis, 2, out=out, keepdims=keepdims)  # CuPy: max and min ...
        _launch("elementwise", res.size)  # ... and their difference
        return res

    def argmax(self, axis=None, out=None, dtype=None, keepdims=False):
        return _arg_reduce(numpy.argmax, self, axis, out, dtype, keepdims)

    def argmin(self, axis=None, out=None, dtype=None, keepdims=False):
        return _arg_reduce(numpy.argmin, self, axis, out, dtype, keepdims)

    def all(self, axis=None, out=None, keepdims=False):
        return _reduce(numpy.all, self, axis, out=out, keepdims=keepdims)

    def any(self, axis=None, out=None, keepdims=False):
        return _reduce(numpy.any, self, axis, out=out, keepdims=keepdims)

    def cumsum(self, axis=None, dtype=None, out=None):
        _check_axis(axis, self.ndim)
        return _call("scan", numpy.cumsum, self, axis=axis, dtype=dtype, out=out)

    def cumprod(self, axis=None, dtype=None, out=None):
        _check_axis(axis, self.ndim)
        return _call("scan", numpy.cumprod, self, axis=axis, dtype=dtype, out=out)

    def clip(self, min=None, max=None, out=None):  # noqa: A002 - CuPy's names
        return _call("elementwise", numpy.clip, self, min, max, out=out)

    def round(self, decimals=0, out=None):
        return _call("elementwise", numpy.round, self, decimals=decimals, out=out)

    def conj(self):
        return _call("elementwise", numpy.conj, self) if self.dtype.kind == "c" else self

    conjugate = conj

    def dot(self, b, out=None):
        _graph.check_library(_graph.CUBLAS_MESSAGE)
        res = _call(None, numpy.dot, self, b, out=out)
        _count_matmul(self, b, out, _size(res), dot=True)
        return res

    def trace(self, offset=0, axis1=0, axis2=1, dtype=None, out=None):
        return _call("reduction", numpy.trace, self, offset, axis1, axis2, dtype, out)

    def nonzero(self) -> tuple:
        if self.ndim == 0:
            raise ValueError(
                "Calling nonzero on 0d arrays is not allowed. Use cp.atleast_1d(scalar).nonzero() instead."
            )
        # CuPy: a scan of the mask, its count read back to size the result, one kernel to fill it.
        res = _call("scan", numpy.nonzero, self)
        counting.host_sync("nonzero")
        _launch("elementwise", _size(res))
        return res

    def take(self, indices, axis=None, out=None):
        """Gathers along ``axis``; indices wrap around (CuPy does not check their bounds). One
        gather kernel: recorded while a stream captures (the indices are read when it runs)."""
        _check_current(self, indices, out)
        if not isinstance(indices, ndarray):
            indices = _wrap(_host_indices(indices))
        n = self.size if axis is None else self.shape[axis]

        def gather(a, i, out=None):
            # wrapped as one vectorized modulo (NumPy's mode="wrap" steps by n in a loop: forever
            # on the uninitialized indices a buffer holds while a capture only records)
            return numpy.take(a, numpy.mod(i, n) if n else i, axis=axis, out=out)

        return _call("gather", gather, self, indices, out=out)

    def put(self, indices, values, mode="wrap") -> None:
        _check_current(self, indices, values)
        numpy.put(self._a, _host_indices(indices), _operand(values), mode=mode)
        _launch("scatter", self.size)

    def repeat(self, repeats, axis=None):
        return _call("copy", numpy.repeat, self, repeats, axis=axis)

    def sort(self, axis=-1, kind=None) -> None:
        _check_current(self)
        self._a.sort(axis=axis, kind=kind)
        _launch("sort", self.size)

    def argsort(self, axis=-1, kind=None):
        return _call("sort", numpy.argsort, self, axis=axis, kind=kind)

    def partition(self, kth, axis=-1) -> None:
        _check_current(self)
        self._a.partition(kth, axis=axis)
        _launch("sort", self.size)

    def argpartition(self, kth, axis=-1):
        return _call("sort", numpy.argpartition, self, kth, axis=axis)

    def compress(self, condition, axis=None, out=None):
        # CuPy: take(nonzero(condition)[0]): a scan, a read-back of the count, two kernels.
        res = _call("gather", numpy.compress, condition, self, axis=axis, out=out)
        _launch("scan")
        counting.host_sync("nonzero")
        _launch("elementwise")
        return res

    # -- operators -----------------------------------------------------------------------------------
    __add__, __radd__, __iadd__ = _binary("add")
    __sub__, __rsub__, __isub__ = _binary("subtract")
    __mul__, __rmul__, __imul__ = _binary("multiply")
    __truediv__, __rtruediv__, __itruediv__ = _binary("true_divide")
    __floordiv__, __rfloordiv__, __ifloordiv__ = _binary("floor_divide")
    __mod__, __rmod__, __imod__ = _binary("remainder")
    __pow__, __rpow__, __ipow__ = _binary("power")
    __matmul__, __rmatmul__, _ = _binary("matmul")
    __and__, __rand__, __iand__ = _binary("bitwise_and")
    __or__, __ror__, __ior__ = _binary("bitwise_or")
    __xor__, __rxor__, __ixor__ = _binary("bitwise_xor")
    __lshift__, __rlshift__, __ilshift__ = _binary("left_shift")
    __rshift__, __rrshift__, __irshift__ = _binary("right_shift")
    del _

    __lt__ = _comparison("less")
    __le__ = _comparison("less_equal")
    __gt__ = _comparison("greater")
    __ge__ = _comparison("greater_equal")
    __eq__ = _comparison("equal", empty_eq=False)
    __ne__ = _comparison("not_equal", empty_eq=True)

    def __neg__(self):
        return _ufuncs()["negative"](self)

    def __pos__(self):
        return _ufuncs()["positive"](self)

    def __abs__(self):
        return _ufuncs()["absolute"](self)

    def __invert__(self):
        return _ufuncs()["invert"](self)


def _f_strides(shape, itemsize: int) -> tuple:
    strides, step = [], itemsize
    for n in shape:
        strides.append(step)
        step *= max(n, 1)
    return tuple(strides)


def _check_bfloat16_matmul(host) -> None:
    """CuPy 14.2's ``matmul`` of bfloat16 matrices: those of 2-d operands are cuBLAS's
    (float32 compute, a bfloat16 result, which the caller makes of NumPy's float32 one);
    above 2-d it takes its integer GEMM kernel, which has no bfloat16 instance, and fails
    (on a GPU a CUDA error from the kernel's lookup; read from CuPy's source, not yet run)."""
    bfloat16 = _BFLOAT16 is not None and any(getattr(x, "dtype", None) == _BFLOAT16 for x in host)
    if bfloat16 and max(numpy.ndim(x) for x in host) > 2:
        raise TypeError(
            "CuPy 14.2 has no batched bfloat16 matmul (operands above 2-d take its integer GEMM kernel, "
            "which has no bfloat16 instance)"
        )


def _count_matmul(a, b, out, size: int, dot: bool = False) -> None:
    """The launches of CuPy's ``matmul`` (and of ``dot`` of up to 2-d arrays): one GEMM, and
    before it a copy of each operand cuBLAS cannot read as it is (a 2-d one neither C- nor
    F-contiguous; above 2-d, one not C-contiguous, as ``ascontiguousarray`` makes it), three
    pointer-array kernels for a broadcast batch, and a copy into an ``out`` that is not
    C-contiguous (``cupy/_core/_routines_linalg.pyx``)."""
    if not size:
        return
    a_nd, b_nd = (x.ndim if isinstance(x, ndarray) else 0 for x in (a, b))
    nd = max(a_nd, b_nd)
    if dot and nd > 2:  # tensordot_core: one GEMM over the reshaped operands
        _launch("matmul")
        return
    for x in (a, b):
        if not isinstance(x, ndarray):
            continue
        flags = x._a.flags
        if (x.ndim == 2 and nd <= 2 and not (flags.c_contiguous or flags.f_contiguous)) or (
            nd > 2 and not flags.c_contiguous
        ):
            _launch("copy", x.size)
    if nd > 2:
        a_batch = (1,) * (nd - 2 - max(a_nd - 2, 0)) + (a.shape[:-2] if a_nd > 2 else ())
        b_batch = (1,) * (nd - 2 - max(b_nd - 2, 0)) + (b.shape[:-2] if b_nd > 2 else ())
        if a_batch != b_batch:
            for _ in range(3):
                _launch("elementwise")  # the pointer arrays of a batched GEMM over a broadcast
    _launch("matmul")
    if out is not None and not out._a.flags.c_contiguous:
        _launch("copy", out.size)


def _reduce(func, a, axis, launches=1, **kwargs):
    """A reduction: CuPy's axis check, then ``launches`` reduction kernels."""
    _check_axis(axis, a.ndim)
    res = _call("reduction", func, a, axis=axis, **kwargs)
    if _graph.current_capture() is not None:  # CuPy's further passes, recorded (the first computed all)
        for _ in range(launches - 1 if res.size else 0):
            _graph.record("reduction", lambda: None, arrays=(a, res))
        return res
    _launch("reduction", (launches - 1) * res.size)
    return res


def _arg_reduce(func, a, axis, out, dtype, keepdims):
    """argmax/argmin: one reduction kernel, writing ``dtype`` (and into ``out``) itself."""
    _check_axis(axis, a.ndim)
    _check_current(a, out)
    if _graph.current_capture() is not None:
        host = a._a

        def compute():
            r = func(host, axis=axis, keepdims=keepdims)
            return numpy.asarray(r).astype(dtype, copy=False) if dtype is not None else r

        if out is None:
            return _captured("reduction", compute, [a])
        dst = out._a
        if out.size:
            _graph.record("reduction", lambda: dst.__setitem__(Ellipsis, compute()), arrays=(a, out))
        return out
    res = func(a._a, axis=axis, keepdims=keepdims)
    if dtype is not None:
        res = numpy.asarray(res).astype(dtype, copy=False)
    if out is not None:
        out._a[...] = res
    else:
        out = _wrap(res)
    _launch("reduction", out.size)
    return out


def _host_indices(indices):
    """Indices of take/put as a host array (CuPy copies lists and NumPy indices to the device)."""
    if isinstance(indices, ndarray):
        return indices._a
    _launch("h2d")
    return numpy.asarray(indices)


def _has_mask(index) -> bool:
    """Whether a (converted) index holds a boolean array (CuPy's mask indexing)."""
    items = index if type(index) is tuple else (index,)
    return any(isinstance(x, numpy.ndarray) and x.dtype == numpy.bool_ for x in items)
