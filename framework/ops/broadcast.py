"""Broadcasting, undone in one place: every op's backward calls :func:`sum_to`; and the
sums over leading or trailing axes that it and the ops' row statistics take
(:func:`sum_axes`)."""

from __future__ import annotations

import math

import numpy as np

from ..backend import get_array_module

_SUMMED = (np.dtype(np.float32), np.dtype(np.float64))
#: The longest rows :func:`sum_axes` sums as one BLAS product: its vector loop keeps a few
#: partial sums, each growing sequentially, where NumPy sums a row pairwise; up to here
#: the two round alike in size (a softmax over a large vocabulary keeps NumPy's sum).
BLAS_ROW_MAX = 4096
_ONES: dict = {}  # (n, dtype) -> a read-only vector of n ones


def _ones(n: int, dtype) -> np.ndarray:
    v = _ONES.get((n, dtype))
    if v is None:
        if len(_ONES) > 256:  # sizes come from shapes: a bounded cache
            _ONES.clear()
        v = _ONES[n, dtype] = np.ones(n, dtype)
        v.flags.writeable = False
    return v


def sum_axes(a, axis, keepdims: bool = False, out=None):
    """``a.sum(axis, keepdims)`` for an array (or, under ``create_graph``, a tensor), into
    ``out`` when given.

    A float32/float64 NumPy array summed over its leading axes (the columns of a ``(rows,
    n)`` view) or its trailing ones (rows of at most :data:`BLAS_ROW_MAX`) is one BLAS
    matrix-vector product with a vector of ones: 4-9x faster than NumPy's reduction on the
    rows of tens to hundreds of elements a Transformer's statistics and bias gradients sum.
    The sums run in another order than NumPy's, so their float rounding differs (as
    PyTorch's kernels' order differs from both). Which way an array is summed depends on its
    dtype, shape and axes only (an array of other strides is made contiguous first), so
    the same values give the same sums under every inplace policy and in a compiled step,
    which replays this function (``framework/compile/kernels.py``).
    """
    sums = _blas_sums(a, axis, keepdims) if a.__class__ is np.ndarray and axis is not None else None
    if sums is None:
        xp = get_array_module(a)
        return (
            xp.sum(a, axis=axis, keepdims=keepdims) if out is None else xp.sum(a, axis=axis, keepdims=keepdims, out=out)
        )
    if out is None:
        return sums
    out[...] = sums
    return out


def _blas_sums(a, axis, keepdims):
    """:func:`sum_axes` of a NumPy array as one matrix-vector product, or None where it is not one."""
    nd = a.ndim
    if not nd or a.dtype not in _SUMMED or not a.size:
        return None
    axes = tuple(sorted(d % nd for d in ((axis,) if isinstance(axis, int) else axis)))
    k = len(axes)
    if not 0 < k < nd or len(set(axes)) != k:
        return None
    if axes == tuple(range(nd - k, nd)) and math.prod(a.shape[nd - k :]) <= BLAS_ROW_MAX:
        n = math.prod(a.shape[nd - k :])
        sums = np.ascontiguousarray(a).reshape(-1, n) @ _ones(n, a.dtype)
        kept = a.shape[: nd - k] + (1,) * k
    elif axes == tuple(range(k)):
        m = math.prod(a.shape[:k])
        sums = _ones(m, a.dtype) @ np.ascontiguousarray(a).reshape(m, -1)
        kept = (1,) * k + a.shape[k:]
    else:
        return None
    return sums.reshape(kept if keepdims else tuple(n for d, n in enumerate(a.shape) if d not in axes))


def shape_of(a) -> tuple:
    """The shape of an array, or ``()`` for a Python or NumPy scalar."""
    return getattr(a, "shape", ())


def sum_to(grad, shape: tuple, dtype=None):
    """Sums ``grad`` down to ``shape`` (the inverse of broadcasting ``shape`` up to grad's).

    Returns ``grad`` itself when nothing needs summing; casts to ``dtype`` if given, so
    a float32 input never receives a float64 gradient.
    """
    if grad.shape != shape:
        lead = grad.ndim - len(shape)
        axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape) if n == 1 and grad.shape[lead + i] != 1)
        grad = sum_axes(grad, axes, keepdims=True).reshape(shape)
    if dtype is not None and grad.dtype != dtype:
        grad = astype(grad, dtype)
    return grad


def astype(a, dtype):
    """``a`` in ``dtype`` (itself when it has it): an array's ``astype``, or, for a tensor
    (a backward under ``create_graph``), its differentiable ``to``."""
    if a.dtype == dtype:
        return a
    return a.astype(dtype) if hasattr(a, "astype") else a.to(dtype=dtype)


def copy(a):
    """A writable copy: an array's ``copy()``, a tensor's (differentiable) ``clone()``."""
    return a.copy() if hasattr(a, "copy") else a.clone()


def broadcast_shapes(*shapes) -> tuple:
    """The broadcast of several shapes, with PyTorch's error message when they clash."""
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for s in shapes:
        for i, n in enumerate(s, ndim - len(s)):
            if n != 1:
                if out[i] not in (1, n):
                    raise RuntimeError(
                        f"The size of tensor a ({out[i]}) must match the size of tensor b ({n}) "
                        f"at non-singleton dimension {i - ndim}: shapes {', '.join(str(tuple(x)) for x in shapes)}"
                    )
                out[i] = n
    return tuple(out)
