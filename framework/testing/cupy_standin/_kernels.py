"""User-defined kernels: ``ElementwiseKernel`` and ``ReductionKernel`` with CuPy's API.

The constructors take CuPy's arguments (the CUDA C source included) and the calls follow
CuPy's rules: parameter lists such as ``"T x, raw T w, float64 eps"``, one-letter type
placeholders bound by the arrays' dtypes (scalars take their placeholder's dtype, a
placeholder bound twice to different dtypes is a TypeError), broadcasting of the non-raw
arrays, outputs either all given or all allocated, ``size=`` for all-raw elementwise
kernels; reductions with ``axis``, ``keepdims`` and ``out``, an ``identity`` for empty
reductions (none: ValueError), ``reduce_type`` for the accumulator.

What the stand-in cannot do is compile CUDA C. Each kernel object therefore has one
attribute real CuPy's has not, ``reference``: a NumPy function the caller attaches that
computes what the CUDA source computes (the framework defines every kernel once as such
a pair, in ``framework/ops/kernels.py``). Calling a kernel without one raises
NotImplementedError. The reference gets the host arrays:

- ``ElementwiseKernel``: ``reference(*inputs, *outputs)``; the non-raw inputs broadcast to
  the loop shape, raw ones as given, scalars as NumPy scalars of their parameter's
  dtype; it writes the outputs (which may be the inputs' buffers: read before writing);
- ``ReductionKernel``: ``reference(*inputs, axis=reduce_axes)`` with the broadcast inputs
  returns the reduced values (reduced axes removed), accumulated in ``reduce_type``
  where the source says so, starting from ``identity`` (an empty reduction returns the
  post-mapped identity); the stand-in casts them into the output.

Every call counts one launch of kind ``"kernel"`` (none for an empty loop, as CuPy).

What real CuPy refuses at the call without compiling, the stand-in refuses too: a type
placeholder bound to two dtypes, a scalar its parameter's dtype cannot hold (CuPy packs
scalars by assignment: a Python int out of range, NaN for an integer), and the CUDA C that
CuPy's CUB path would make uncompilable. A one-input, one-output reduction takes that
path for a C- or F-contiguous input whose reduced axes are its last (C) or first (F) ones,
at least 128 values per output; CuPy then renames the input to ``in0`` and the output to
``out0`` with ``str.replace`` over the map and post-map expressions, so a name that occurs
inside another identifier (``x`` in ``complex``) breaks the source: NVRTC's
``CompileException`` on a GPU, the same exception here.
"""

from __future__ import annotations

import math
import re

import numpy

from ._core import _PY_SCALARS, _check_current, _from_host, _peer_error, ndarray
from .cuda import graph as _graph
from .cuda.compiler import CompileException

__all__ = ["ElementwiseKernel", "ReductionKernel"]


class _Param:
    """One entry of a parameter list: ``[raw] TYPE NAME`` (CuPy's ParameterInfo)."""

    def __init__(self, text: str, is_const: bool):
        words = text.split()
        if len(words) < 2:
            raise Exception(f"Syntax error: {text}")
        t, self.name = words[-2:]
        self.raw = False
        self.is_const = is_const
        for w in words[:-2]:
            if w == "raw":
                self.raw = True
            elif w == "_non_const":
                self.is_const = False
            else:
                raise Exception(f'Unknown keyword "{w}"')
        if len(t) == 1:
            self.ctype, self.dtype = t, None
        else:
            self.ctype, self.dtype = None, numpy.dtype(t)


def _params(s: str, is_const: bool) -> tuple:
    s = s.strip()
    return tuple(_Param(p, is_const) for p in s.split(",")) if s else ()


def _check_name(name: str) -> None:
    if not (name.replace("_", "a").isalnum() and not name[0].isdigit()):
        raise ValueError(f'Invalid kernel name: "{name}"')


def _decide_types(in_params, out_params, in_dtypes, out_dtypes):
    """CuPy's ``_decide_params_type``: the dtype of every parameter (placeholders bound)."""
    bound: dict = {}

    def bind(p, dt):
        if dt is None:
            return
        if p.dtype is not None:
            if numpy.dtype(dt) != p.dtype:
                raise TypeError(f"Type is mismatched. {p.name} {dt} {p.dtype}")
        elif p.ctype in bound:
            if numpy.dtype(bound[p.ctype]) != numpy.dtype(dt):
                raise TypeError(f"Type is mismatched. {p.name} {dt} {bound[p.ctype]} {p.ctype}")
        else:
            bound[p.ctype] = numpy.dtype(dt)

    for p, dt in zip(out_params, out_dtypes):
        bind(p, dt)
    for p, dt in zip(in_params, in_dtypes):
        bind(p, dt)

    def resolve(p):
        if p.dtype is not None:
            return p.dtype
        if p.ctype not in bound:
            raise TypeError(f"Type placeholder {p.ctype} of {p.name} is bound by no array argument")
        return bound[p.ctype]

    return [resolve(p) for p in in_params], [resolve(p) for p in out_params]


def _check_arg(a, device_id: int):
    if isinstance(a, ndarray):
        if a.data.device_id != device_id:
            raise _peer_error(a, device_id)
        return a
    if type(a) in _PY_SCALARS or isinstance(a, numpy.generic):
        return a
    raise TypeError(f"Unsupported type {type(a)}")


def _broadcast_shape(args, params, use_size: bool) -> tuple:
    arrays = [a._a for a, p in zip(args, params) if isinstance(a, ndarray) and not p.raw]
    if use_size:
        if arrays:
            raise ValueError("Specified 'size' can be used only if all of the ndarray are 'raw'.")
        return ()
    if not arrays:
        raise ValueError("Loop size is undecided.")
    return numpy.broadcast_shapes(*(a.shape for a in arrays))


def _pack(value, dtype):
    """A scalar argument in its parameter's dtype, by assignment as CuPy packs it
    (``PyArray_Pack``): OverflowError for a Python int out of range, ValueError for NaN
    into an integer."""
    out = numpy.empty((), dtype)
    out[()] = value
    return out[()]


def _host_inputs(args, params, dtypes, shape):
    """The reference's inputs: broadcast views, raw arrays, scalars in their dtype."""
    host = []
    for a, p, dt in zip(args, params, dtypes):
        if isinstance(a, ndarray):
            host.append(a._a if p.raw else numpy.broadcast_to(a._a, shape))
        else:
            host.append(_pack(a, dt))
    return host


_CUB_REDUCE_SIZE_THRESHOLD = 128  # CuPy's: a smaller reduction runs its generic kernel


def _takes_cub(ins, outs, reduce_axes) -> bool:
    """Whether CuPy's ReductionKernel takes its CUB path (``_can_use_cub_block_reduction``)."""
    if len(ins) != 1 or len(outs) != 1 or not isinstance(ins[0], ndarray) or not reduce_axes:
        return False
    a = ins[0]
    axes = tuple(range(a.ndim))
    out_axes = tuple(i for i in axes if i not in reduce_axes)
    if a.flags.f_contiguous:
        fits = reduce_axes + out_axes == axes
    elif a.flags.c_contiguous:
        fits = out_axes + reduce_axes == axes
    else:
        return False
    return fits and math.prod(a.shape[i] for i in reduce_axes) >= _CUB_REDUCE_SIZE_THRESHOLD


def _cub_rename_error(kernel):
    """The CompileException NVRTC gives for the source of CuPy's CUB path, or None."""
    old_in, old_out = kernel.in_params[0].name, kernel.out_params[0].name
    renames = ((kernel.map_expr, old_in, "in0"), (kernel.post_map_expr, old_out, "out0"))
    if old_in == "in0" and old_out == "out0":
        return None  # CuPy renames nothing
    for expr, old, new in renames:
        renamed = expr.replace(old, new)
        if renamed != re.sub(rf"\b{re.escape(old)}\b", new, expr):
            bad = sorted(set(re.findall(r"\w+", renamed)) - set(re.findall(r"\w+", expr)) - {new})
            return CompileException(
                f'identifier "{bad[0]}" is undefined: CuPy\'s CUB reduction renamed {old} to {new} '
                f"with str.replace, inside other identifiers too ({expr!r} became {renamed!r})",
                renamed,
                kernel.name,
                (),
            )
    return None


def _missing_reference(kind: str, name: str):
    return NotImplementedError(
        f"{kind} {name!r}: the CuPy stand-in cannot compile CUDA C; attach a NumPy reference "
        "(kernel.reference = fn) that computes what the source computes"
    )


class ElementwiseKernel:
    """``cupy.ElementwiseKernel``: the operation runs as the attached NumPy ``reference``."""

    def __init__(
        self,
        in_params,
        out_params,
        operation,
        name="kernel",
        reduce_dims=True,
        preamble="",
        no_return=False,
        return_tuple=False,
        **kwargs,
    ):
        _check_name(name)
        unknown = set(kwargs) - {"options", "loop_prep", "after_loop"}
        if unknown:
            raise TypeError(f"__init__() got an unexpected keyword argument {sorted(unknown)[0]!r}")
        self.in_params = _params(in_params, True)
        self.out_params = _params(out_params, False)
        self.nin, self.nout = len(self.in_params), len(self.out_params)
        self.nargs = self.nin + self.nout
        self.params = self.in_params + self.out_params
        if "i" in [p.name for p in self.params]:
            raise ValueError("Can not use 'i' as a parameter name")
        self.operation = operation
        self.name = self.__name__ = name
        self.reduce_dims = reduce_dims
        self.preamble = preamble
        self.no_return = no_return
        self.return_tuple = return_tuple
        self.kwargs = kwargs
        self.reference = None  # the stand-in's own: the NumPy function that runs the operation

    def __call__(self, *args, size=-1, stream=None, block_size=128):
        if block_size <= 0:
            raise ValueError("block_size must be greater than zero")
        if len(args) not in (self.nin, self.nargs):
            raise TypeError(
                f"Wrong number of arguments for {self.name!r}. It must be either {self.nin} or "
                f"{self.nargs} (with outputs), but given {len(args)}."
            )
        device_id = _check_current()
        args = [_check_arg(a, device_id) for a in args]
        ins, outs = args[: self.nin], args[self.nin :]
        for o in outs:
            if not isinstance(o, ndarray):
                raise TypeError("Output arguments type must be cupy.ndarray")
        # CuPy broadcasts the outputs with the inputs: an output alone can set the loop size
        shape = _broadcast_shape(args, list(self.in_params) + list(self.out_params), size != -1)
        in_types, out_types = _decide_types(
            self.in_params,
            self.out_params,
            [a.dtype if isinstance(a, ndarray) else None for a in ins],
            [o.dtype for o in outs],
        )
        if size != -1:
            shape = (size,)
        if outs:
            for o, p in zip(outs, self.out_params):
                if not p.raw and o.shape != shape:
                    raise ValueError("Out shape is mismatched")
        else:
            if any(p.raw for p in self.out_params) and size == -1:
                raise ValueError("Output array size is Undecided")
            outs = [_from_host(numpy.empty(shape, dt)) for dt in out_types]
        ret = None if self.no_return else outs[0] if (self.nout == 1 and not self.return_tuple) else tuple(outs)
        if 0 in shape:
            return ret
        if self.reference is None:
            raise _missing_reference("ElementwiseKernel", self.name)
        reference, host_in, host_out = self.reference, _host_inputs(ins, self.in_params, in_types, shape), outs
        arrays = [a for a in ins if isinstance(a, ndarray)] + list(outs)
        _graph.run("kernel", lambda: reference(*host_in, *(o._a for o in host_out)), arrays=arrays)
        return ret


class ReductionKernel:
    """``cupy.ReductionKernel``: map, reduce and post-map run as the attached NumPy ``reference``."""

    def __init__(
        self,
        in_params,
        out_params,
        map_expr,
        reduce_expr,
        post_map_expr,
        identity,
        name="reduce_kernel",
        reduce_type=None,
        reduce_dims=True,
        preamble="",
        options=(),
    ):
        _check_name(name)
        self.in_params = _params(in_params, True)
        self.out_params = _params(out_params, False)
        self.nin, self.nout = len(self.in_params), len(self.out_params)
        self.nargs = self.nin + self.nout
        self.params = self.in_params + self.out_params
        self.map_expr, self.reduce_expr, self.post_map_expr = map_expr, reduce_expr, post_map_expr
        self.identity = "" if identity is None else str(identity)
        self.name = self.__name__ = name
        self.reduce_type = self.out_params[0].ctype if reduce_type is None else reduce_type
        self.reduce_dims = reduce_dims
        self.preamble = preamble
        self.options = options
        self.reference = None  # the stand-in's own: the NumPy function that runs the reduction

    def __call__(self, *args, out=None, axis=None, keepdims=False, stream=None):
        if len(args) not in (self.nin, self.nargs):
            raise TypeError(f"Wrong number of arguments for {self.name}")
        out_args = list(args[self.nin :])
        if out is not None:
            if self.nout != 1:
                raise NotImplementedError("")
            if out_args:
                raise ValueError("cannot specify 'out' as both a positional and keyword argument")
            out_args = [out]
        device_id = _check_current()
        ins = [_check_arg(a, device_id) for a in args[: self.nin]]
        for o in out_args:
            if not isinstance(o, ndarray):
                raise TypeError("Output arguments type must be cupy.ndarray")
            _check_arg(o, device_id)
        shape = _broadcast_shape(ins, self.in_params, False)
        ndim = len(shape)
        axes = tuple(range(ndim)) if axis is None else (tuple(axis) if isinstance(axis, (tuple, list)) else (axis,))
        reduce_axes = []
        for ax in axes:
            if not -ndim <= ax < ndim:
                raise numpy.exceptions.AxisError(ax, ndim)
            reduce_axes.append(ax % ndim)
        reduce_axes = tuple(sorted(reduce_axes))
        if len(set(reduce_axes)) != len(reduce_axes):
            raise ValueError("duplicate value in 'axis'")
        out_shape = tuple(1 if i in reduce_axes else n for i, n in enumerate(shape) if keepdims or i not in reduce_axes)
        in_types, out_types = _decide_types(
            self.in_params,
            self.out_params,
            [a.dtype if isinstance(a, ndarray) else None for a in ins],
            [o.dtype for o in out_args],
        )
        if out_args:
            for o, p in zip(out_args, self.out_params):
                if not p.raw and o.shape != out_shape:
                    raise ValueError("Out shape is mismatched")
        else:
            out_args = [_from_host(numpy.empty(out_shape, dt)) for dt in out_types]
        ret = out_args[0]
        if ret.size == 0:
            return ret
        if self.identity == "" and 0 in shape:
            raise ValueError(f"zero-size array to reduction operation {self.name} which has no identity")
        if _takes_cub(ins, out_args, reduce_axes) and (error := _cub_rename_error(self)) is not None:
            raise error
        if self.reference is None:
            raise _missing_reference("ReductionKernel", self.name)
        reference, host_in, host_out = self.reference, _host_inputs(ins, self.in_params, in_types, shape), ret._a

        def kernel():
            host_out[...] = numpy.asarray(reference(*host_in, axis=reduce_axes)).reshape(out_shape)

        _graph.run("kernel", kernel, arrays=[a for a in ins if isinstance(a, ndarray)] + [ret])
        return ret
