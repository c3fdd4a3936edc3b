"""NumPy's names over differentiable ops: the array module of a tensor.

Under ``create_graph`` an op's backward receives tensors (see
:mod:`framework.autograd.higher`); ``get_array_module(tensor)`` returns the
:class:`TensorNamespace` of the tensor's device, so that a backward formula written
once with ``xp.multiply``, ``xp.where``, ``xp.sum`` ... records the ops of its own
derivative. Arguments may be tensors, raw arrays or numbers: raw arrays become
constants. ``out=`` is accepted and ignored (a new tensor is returned): writing into a
gradient other nodes may have saved would change their numbers. Functions of the data
alone (``sign``, comparisons) return constants, as their derivative is zero.
"""

from __future__ import annotations

from .. import backend
from .. import tensor as _tensor  # _tensor._ops: the ops package, looked up at call time
from ..tensor import Tensor, _wrap


class TensorNamespace:
    """The array namespace of the tensors on one device (``xp``: that device's module)."""

    def __init__(self, xp):
        self.xp = xp

    # --- conversions ------------------------------------------------------------------
    def _t(self, a):
        if isinstance(a, Tensor):
            return a
        if backend.is_array(a):
            return _wrap(a)
        return a  # a number

    def asarray(self, a, dtype=None):
        a = self._t(a)
        if not isinstance(a, Tensor):
            a = _wrap(self.xp.asarray(a, dtype=dtype))
        return a if dtype is None or a.dtype == dtype else a.to(dtype=dtype)

    def zeros(self, shape, dtype=None):
        return _wrap(self.xp.zeros(shape, dtype=dtype))

    def ones(self, shape, dtype=None):
        return _wrap(self.xp.ones(shape, dtype=dtype))

    def empty(self, shape, dtype=None):
        return _wrap(self.xp.zeros(shape, dtype=dtype))

    def empty_like(self, a, dtype=None):
        return _wrap(self.xp.zeros(a.shape, dtype=dtype or a.dtype))

    def zeros_like(self, a, dtype=None):
        return self.empty_like(a, dtype)

    def arange(self, *args, **kwargs):
        return _wrap(self.xp.arange(*args, **kwargs))  # an index: a constant

    # --- arithmetic (differentiable) ----------------------------------------------------
    def add(self, a, b, out=None):
        return self._t(a) + self._t(b)

    def subtract(self, a, b, out=None):
        return self._t(a) - self._t(b)

    def multiply(self, a, b, out=None):
        return self._t(a) * self._t(b)

    def true_divide(self, a, b, out=None):
        return self._t(a) / self._t(b)

    divide = true_divide

    def negative(self, a, out=None):
        return -self._t(a)

    def power(self, a, b, out=None):
        return self._t(a) ** self._t(b)

    def maximum(self, a, b, out=None):
        a, b = self._t(a), self._t(b)
        return a.maximum(b) if isinstance(a, Tensor) else b.maximum(a)

    def where(self, c, a, b):
        c = c._data if isinstance(c, Tensor) else c
        return _tensor._ops.where(_wrap(c) if backend.is_array(c) else c, self._t(a), self._t(b))

    def exp(self, a, out=None):
        return self._t(a).exp()

    def log(self, a, out=None):
        return self._t(a).log()

    def sqrt(self, a, out=None):
        return self._t(a).sqrt()

    def sin(self, a, out=None):
        return self._t(a).sin()

    def cos(self, a, out=None):
        return self._t(a).cos()

    def tanh(self, a, out=None):
        return self._t(a).tanh()

    def abs(self, a, out=None):
        return self._t(a).abs()

    def reciprocal(self, a, out=None):
        return 1 / self._t(a)

    def matmul(self, a, b, out=None):
        return self._t(a).matmul(self._t(b))

    # --- of the data alone: constants ---------------------------------------------------
    def sign(self, a, out=None):
        return _wrap(self.xp.sign(_data(a)))

    def greater(self, a, b, out=None):
        r = self.xp.greater(_data(a), _data(b))
        return _wrap(r if out is None else r.astype(out.dtype))  # out=: the dtype wanted

    def logical_and(self, a, b, out=None):
        return _wrap(self.xp.logical_and(_data(a), _data(b)))

    def isnan(self, a):
        return _wrap(self.xp.isnan(_data(a)))

    # --- reductions and shapes ------------------------------------------------------------
    def sum(self, a, axis=None, keepdims=False, dtype=None):
        return self._t(a).sum(dim=axis, keepdim=keepdims)

    def mean(self, a, axis=None, keepdims=False):
        return self._t(a).mean(dim=axis, keepdim=keepdims)

    def amax(self, a, axis=None, keepdims=False):
        return self._t(a).amax(dim=axis, keepdim=keepdims)

    def broadcast_to(self, a, shape):
        return self._t(a).expand(*shape)

    def expand_dims(self, a, axis):
        return self._t(a).unsqueeze(axis)

    def swapaxes(self, a, i, j):
        return self._t(a).transpose(i, j)

    def transpose(self, a, axes=None):
        a = self._t(a)
        return a.permute(*(axes if axes is not None else reversed(range(a.ndim))))

    def reshape(self, a, shape):
        return self._t(a).reshape(shape)

    def ascontiguousarray(self, a):
        return self._t(a).contiguous()

    def take(self, a, i, axis=None):
        return self._t(a).select(axis, i)

    def concatenate(self, arrays, axis=0):
        return _tensor._ops.cat([self._t(a) for a in arrays], dim=axis)

    def stack(self, arrays, axis=0):
        return _tensor._ops.stack([self._t(a) for a in arrays], dim=axis)


def _data(a):
    return a._data if isinstance(a, Tensor) else a


_namespaces: dict = {}


def namespace_of(t) -> TensorNamespace:
    xp = backend.get_array_module(t._data)
    ns = _namespaces.get(xp)
    if ns is None:
        ns = _namespaces[xp] = TensorNamespace(xp)
    return ns


backend.tensor_namespace = namespace_of
