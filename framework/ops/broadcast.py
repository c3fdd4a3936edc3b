"""Broadcasting, undone in one place: every op's backward calls :func:`sum_to`."""

from __future__ import annotations


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
        grad = grad.sum(axis=axes, keepdims=True).reshape(shape)
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
