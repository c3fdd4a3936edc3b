"""The functional API (``fw.exp(x)``, ``fw.cat([...])``) and the Tensor methods built on it.

Every function here turns Python-level arguments into one ``Op.apply`` or
``Op.apply_`` call; the ops themselves live in one file per family.
"""

from __future__ import annotations

import builtins
from collections import namedtuple

import numpy as np

from .. import backend as _backend
from .. import inplace as _inplace
from .. import random as _random
from ..tensor import Tensor, _wrap
from . import elementwise as E
from . import linalg as L
from . import reduce as R
from . import view as V
from .broadcast import broadcast_shapes, sum_to  # noqa: F401  (re-exported)

_DEFAULT_FLOAT = np.dtype(np.float32)


def _operand(x, other):
    """Prepares a binary op's second operand: tensors pass, Python scalars stay scalars.

    A Python float with an integer or bool tensor promotes to the default float dtype
    (float32), as in PyTorch; NumPy alone would give float64. So does an integer tensor
    with a float tensor: the result keeps the float tensor's dtype (NumPy: float64).
    """
    if isinstance(other, Tensor):
        if isinstance(x, Tensor) and x.dtype.kind in "biu" and other.dtype.kind == "f":
            x = cast(x, other.dtype)
        elif isinstance(x, Tensor) and other.dtype.kind in "biu" and x.dtype.kind == "f":
            other = cast(other, x.dtype)
        return x, other
    if _backend.is_array(other):
        raise TypeError("mix tensors with tensors or Python scalars, not NumPy arrays: wrap it with fw.tensor()")
    if isinstance(other, float) and isinstance(x, Tensor) and x.dtype.kind in "biu":
        x = cast(x, _DEFAULT_FLOAT)
    return x, other


def _reflected(other, x):
    if isinstance(other, float) and x.dtype.kind in "biu":
        x = cast(x, _DEFAULT_FLOAT)
    return other, x


# --- elementwise ---------------------------------------------------------------------

def add(x, other, alpha=1):
    x, other = _operand(x, other)
    return E.Add.apply(x, other, alpha=alpha)


def sub(x, other, alpha=1):
    x, other = _operand(x, other)
    return E.Sub.apply(x, other, alpha=alpha)


def mul(x, other):
    x, other = _operand(x, other)
    return E.Mul.apply(x, other)


def div(x, other):
    if x.dtype.kind in "biu" and (not isinstance(other, Tensor) or other.dtype.kind in "biu"):
        x = cast(x, _DEFAULT_FLOAT)  # true division of integers gives floats
    x, other = _operand(x, other)  # then an integer tensor divisor follows x to float32
    return E.Div.apply(x, other)


def pow(x, exponent):  # noqa: A001  (PyTorch's name)
    x, exponent = _operand(x, exponent)
    return E.Pow.apply(x, exponent)


def maximum(x, other):
    return E.Maximum.apply(x, other)


def where(condition, x, y):
    """Elementwise ``x if condition else y`` (x and y may be tensors or scalars)."""
    return E.Where.apply(condition, x, y)


def neg(x):
    return E.Neg.apply(x)


def abs(x):  # noqa: A001
    return E.Abs.apply(x)


def exp(x):
    return E.Exp.apply(x)


def log(x):
    return E.Log.apply(x)


def sqrt(x):
    return E.Sqrt.apply(x)


def sin(x):
    return E.Sin.apply(x)


def cos(x):
    return E.Cos.apply(x)


def tanh(x):
    return E.Tanh.apply(x)


def sigmoid(x):
    return E.Sigmoid.apply(x)


def relu(x):
    return E.Relu.apply(x)


def leaky_relu(x, negative_slope=0.01):
    if negative_slope < 0:
        return _leaky_relu_negative(x, negative_slope)
    return E.LeakyRelu.apply(x, negative_slope=negative_slope)


def _leaky_relu_negative(x, negative_slope):
    # The result cannot tell the input's sign: compose from ops that save the input.
    return where(x > 0, x, x * negative_slope)


def clamp(x, min=None, max=None):  # noqa: A002
    return E.Clamp.apply(x, min=min, max=max)


def cast(x, dtype):
    return E.Cast.apply(x, dtype=np.dtype(dtype))


def to_device(x, device):
    return V.ToDevice.apply(x, device=device)


# --- inplace --------------------------------------------------------------------------

def add_(x, other, alpha=1):
    return E.Add.apply_(x, other, alpha=alpha)


def sub_(x, other, alpha=1):
    return E.Sub.apply_(x, other, alpha=alpha)


def mul_(x, other):
    return E.Mul.apply_(x, other)


def div_(x, other):
    return E.Div.apply_(x, other)


def pow_(x, exponent):
    return E.Pow.apply_(x, exponent)


def neg_(x):
    return E.Neg.apply_(x)


def abs_(x):
    return E.Abs.apply_(x)


def exp_(x):
    return E.Exp.apply_(x)


def log_(x):
    return E.Log.apply_(x)


def sqrt_(x):
    return E.Sqrt.apply_(x)


def sin_(x):
    return E.Sin.apply_(x)


def cos_(x):
    return E.Cos.apply_(x)


def tanh_(x):
    return E.Tanh.apply_(x)


def sigmoid_(x):
    return E.Sigmoid.apply_(x)


def relu_(x):
    return E.Relu.apply_(x)


def leaky_relu_(x, negative_slope=0.01):
    return E.LeakyRelu.apply_(x, negative_slope=negative_slope)


def clamp_(x, min=None, max=None):  # noqa: A002
    return E.Clamp.apply_(x, min=min, max=max)


def zero_(x):
    return E.Zero.apply_(x)


def fill_(x, value):
    return E.Fill.apply_(x, value)


def copy_(x, src):
    if not isinstance(src, Tensor):
        raise TypeError(f"copy_ expects a Tensor source, got {type(src).__name__}")
    if src.device != x.device:
        src = to_device(src, x.device)
    return E.Copy.apply_(x, src)


def normal_(x, mean=0.0, std=1.0):
    return E.Normal.apply_(x, sample=lambda shape, dtype: _random.normal(shape, dtype, mean, std, x.xp))


def uniform_(x, a=0.0, b=1.0):
    return E.Uniform.apply_(x, sample=lambda shape, dtype: _random.uniform(shape, dtype, a, b, x.xp))


# --- reductions ------------------------------------------------------------------------

def sum(x, dim=None, keepdim=False):  # noqa: A001
    return R.Sum.apply(x, dim=dim, keepdim=keepdim)


def mean(x, dim=None, keepdim=False):
    if x.dtype.kind in "biu":
        raise RuntimeError(f"mean(): could not infer output dtype. Input dtype must be floating point, got {x.dtype}")
    return R.Mean.apply(x, dim=dim, keepdim=keepdim)


def var(x, dim=None, unbiased=True, keepdim=False, correction=None):
    if correction is None:
        correction = 1 if unbiased else 0
    return R.Var.apply(x, dim=dim, correction=correction, keepdim=keepdim)


def amax(x, dim=None, keepdim=False):
    return R.Amax.apply(x, dim=dim, keepdim=keepdim)


MaxResult = namedtuple("MaxResult", ["values", "indices"])


def max(x, dim=None, keepdim=False):  # noqa: A001
    """``max(x)``: the largest value; ``max(x, dim)``: (values, indices) along ``dim``."""
    if isinstance(dim, Tensor):  # max(x, other) is maximum, as in PyTorch
        return maximum(x, dim)
    if dim is None:
        return R.Amax.apply(x, dim=None, keepdim=False)
    values = R.MaxDim.apply(x, dim=dim, keepdim=keepdim)
    indices = _wrap(values.grad_fn.indices if values.grad_fn is not None else _last_indices(x, dim, keepdim))
    if not keepdim:
        indices = _wrap(indices._data.squeeze(R._axes(dim, x.ndim)[0]))
    return MaxResult(values, indices)


def _last_indices(x, dim, keepdim):
    xp = x.xp
    return xp.expand_dims(xp.argmax(x._data, axis=dim), R._axes(dim, x.ndim)[0])


def argmax(x, dim=None, keepdim=False):
    xp = x.xp
    if dim is None:
        return _wrap(xp.asarray(xp.argmax(x._data)))
    return _wrap(xp.argmax(x._data, axis=dim, keepdims=keepdim))


def softmax(x, dim=-1):
    return R.Softmax.apply(x, dim=dim)


def log_softmax(x, dim=-1):
    return R.LogSoftmax.apply(x, dim=dim)


def matmul(x, y):
    return L.Matmul.apply(x, y)


# --- views and shape ---------------------------------------------------------------------

def _shape_arg(shape):
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        return tuple(shape[0])
    return tuple(int(s) for s in shape)


def view(x, *shape):
    return V.View.apply(x, shape=_shape_arg(shape))


def reshape(x, *shape):
    """A view when the strides allow one, a copy otherwise (as in PyTorch)."""
    shape = _shape_arg(shape)
    if V.reshape_view(x._data, shape) is not None:
        return V.View.apply(x, shape=shape)
    return V.ReshapeCopy.apply(x, shape=shape)


def _dim(d, ndim):
    if not -ndim <= d < builtins.max(ndim, 1):
        raise IndexError(f"Dimension out of range (expected to be in range of [{-ndim}, {ndim - 1}], but got {d})")
    return d % ndim if ndim else 0


def permute(x, *dims):
    dims = _shape_arg(dims)
    if sorted(_dim(d, x.ndim) for d in dims) != list(range(x.ndim)):
        raise RuntimeError(f"permute(): dims {dims} are not a permutation of the {x.ndim} dimensions")
    return V.Permute.apply(x, dims=tuple(_dim(d, x.ndim) for d in dims))


def transpose(x, dim0, dim1):
    dims = list(range(x.ndim))
    a, b = _dim(dim0, x.ndim), _dim(dim1, x.ndim)
    dims[a], dims[b] = dims[b], dims[a]
    return V.Permute.apply(x, dims=tuple(dims))


def t(x):
    if x.ndim > 2:
        raise RuntimeError(f"t() expects a tensor with <= 2 dimensions, but self is {x.ndim}D")
    if x.ndim < 2:  # a view that changes nothing, as in PyTorch (not x itself)
        return V.Permute.apply(x, dims=tuple(range(x.ndim)))
    return transpose(x, 0, 1)


def unsqueeze(x, dim):
    d = dim + x.ndim + 1 if dim < 0 else dim
    if not 0 <= d <= x.ndim:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-x.ndim - 1}, {x.ndim}], but got {dim})")
    return view(x, x.shape[:d] + (1,) + x.shape[d:])


def squeeze(x, dim=None):
    if dim is None:
        shape = tuple(n for n in x.shape if n != 1)
    else:
        dims = {_dim(d, x.ndim) for d in ((dim,) if isinstance(dim, int) else dim)}
        shape = tuple(n for i, n in enumerate(x.shape) if not (i in dims and n == 1))
    return view(x, shape)


def flatten(x, start_dim=0, end_dim=-1):
    if x.ndim == 0:
        return reshape(x, (1,))
    s, e = _dim(start_dim, x.ndim), _dim(end_dim, x.ndim)
    n = 1
    for k in x.shape[s : e + 1]:
        n *= k
    return reshape(x, x.shape[:s] + (n,) + x.shape[e + 1 :])


def expand(x, *sizes):
    sizes = _shape_arg(sizes)
    lead = len(sizes) - x.ndim
    if lead < 0:
        raise RuntimeError(f"expand: the number of sizes ({len(sizes)}) must be >= the number of dimensions ({x.ndim})")
    shape = tuple(x.shape[i - lead] if (n == -1 and i >= lead) else n for i, n in enumerate(sizes))
    for i, n in enumerate(x.shape):
        if n != 1 and shape[i + lead] != n:
            raise RuntimeError(
                f"The expanded size of the tensor ({shape[i + lead]}) must match the existing size ({n}) "
                f"at non-singleton dimension {i + lead}. Target sizes: {list(sizes)}. Tensor sizes: {list(x.shape)}"
            )
    return V.Expand.apply(x, shape=shape)


def expand_as(x, other):
    return expand(x, other.shape)


def narrow(x, dim, start, length):
    d = _dim(dim, x.ndim)
    if not (0 <= start and start + length <= x.shape[d]):
        raise IndexError(f"narrow(): start ({start}) + length ({length}) exceeds dimension size ({x.shape[d]})")
    index = (slice(None),) * d + (slice(start, start + length), Ellipsis)
    return V.GetItem.apply(x, index=index)


def _normalize_index(index, x):
    """Index with tensors replaced by arrays; tells basic (view) from advanced (copy) indexing.

    Index arrays (from tensors, lists or NumPy arrays) go to ``x``'s device, as PyTorch
    moves a CPU index tensor to a CUDA tensor's device.
    """
    items = index if isinstance(index, tuple) else (index,)
    out, advanced = [], False
    data = x._data
    for it in items:
        if isinstance(it, Tensor):
            it = it._data
            if it.ndim == 0 and it.dtype.kind in "iu":
                it = int(it)
        if isinstance(it, (list, np.ndarray)) or (hasattr(it, "dtype") and hasattr(it, "shape")):
            advanced = True
            it = _backend.index_like(it, data)
        elif isinstance(it, bool):
            advanced = True
        elif not (isinstance(it, (int, np.integer, slice)) or it is None or it is Ellipsis):
            raise IndexError(f"unsupported index {it!r}: use ints, slices, None, ..., or integer/bool tensors")
        out.append(it)
    if advanced and not _backend.index_bounds_checked(data):
        _check_index_bounds(data, out)
    if not advanced and Ellipsis not in out:
        out.append(Ellipsis)  # keeps a full integer index a 0-d VIEW instead of a NumPy scalar
    return tuple(out), advanced


def _index_dims(shape, items):
    """``(item, size of the dim it indexes)`` for each integer index array in ``items``."""
    def consumed(it):
        if it is None or it is Ellipsis:
            return 0
        if hasattr(it, "dtype") and it.dtype.kind == "b":
            return it.ndim
        return 1

    found = []
    cut = next((k for k, it in enumerate(items) if it is Ellipsis), None)  # not `in`: == on arrays
    head, tail = (items, []) if cut is None else (items[:cut], items[cut + 1:])
    d = 0
    for it in head:
        if hasattr(it, "dtype") and it.dtype.kind in "iu" and d < len(shape):
            found.append((it, shape[d]))
        d += consumed(it)
    d = len(shape)
    for it in reversed(tail):
        d -= consumed(it)
        if hasattr(it, "dtype") and it.dtype.kind in "iu" and 0 <= d < len(shape):
            found.append((it, shape[d]))
    return found


def _check_index_bounds(data, items):
    """Raises IndexError for an out-of-bounds integer index array, as NumPy does.

    For array modules that do not check by themselves (CuPy wraps such indices around
    silently): one host sync for all the index arrays of an indexing call.
    """
    found = [(it, n) for it, n in _index_dims(data.shape, items) if it.size]
    if not found:
        return
    outside = [((it < -n) | (it >= n)).any() for it, n in found]
    bad = outside[0]
    for b in outside[1:]:
        bad = bad | b
    if bool(bad):
        n = next(n for (_, n), b in zip(found, outside) if bool(b))
        raise IndexError(
            f"index out of bounds: an index array holds a value outside [{-n}, {n - 1}] for a "
            f"dimension of size {n} (tensor of shape {tuple(data.shape)})"
        )


def getitem(x, index):
    idx, advanced = _normalize_index(index, x)
    if advanced:
        return V.IndexGet.apply(x, index=idx)
    return V.GetItem.apply(x, index=idx)


def setitem(x, index, value):
    """``x[index] = value``: in place; gradients flow to the kept part of x and to value."""
    idx, advanced = _normalize_index(index, x)
    if isinstance(value, Tensor) and value.device != x.device:
        value = to_device(value, x.device)
    if advanced:
        V.IndexPut.apply_(x, value, index=idx)
    elif isinstance(value, Tensor):
        E.Copy.apply_(V.GetItem.apply(x, index=idx), value)
    else:
        E.Fill.apply_(V.GetItem.apply(x, index=idx), value)


def clone(x):
    return V.Clone.apply(x)


def contiguous(x):
    return x if x.is_contiguous() else V.Clone.apply(x)


def cat(tensors, dim=0):
    tensors = list(tensors)
    if not tensors:
        raise RuntimeError("cat expects a non-empty list of tensors")
    return V.Cat.apply(*tensors, dim=_dim(dim, tensors[0].ndim))


def stack(tensors, dim=0):
    tensors = list(tensors)
    if not tensors:
        raise RuntimeError("stack expects a non-empty list of tensors")
    shapes = {t.shape for t in tensors}
    if len(shapes) > 1:
        raise RuntimeError(f"stack expects each tensor to be equal size, but got {sorted(shapes)}")
    return V.Stack.apply(*tensors, dim=_dim(dim, tensors[0].ndim + 1))


# --- comparisons -------------------------------------------------------------------------

def eq(x, y):
    return E.Eq.apply(x, y)


def ne(x, y):
    return E.Ne.apply(x, y)


def lt(x, y):
    return E.Lt.apply(x, y)


def le(x, y):
    return E.Le.apply(x, y)


def gt(x, y):
    return E.Gt.apply(x, y)


def ge(x, y):
    return E.Ge.apply(x, y)


# --- Tensor methods ------------------------------------------------------------------------

def _install_methods():
    T = Tensor
    same_name = (
        "add sub mul div pow neg abs exp log sqrt sin cos tanh sigmoid relu leaky_relu clamp maximum "
        "matmul sum mean var amax max argmax softmax log_softmax view reshape permute transpose t "
        "unsqueeze squeeze flatten expand expand_as narrow clone contiguous eq ne lt le gt ge "
        "add_ sub_ mul_ div_ pow_ neg_ abs_ exp_ log_ sqrt_ sin_ cos_ tanh_ sigmoid_ relu_ "
        "leaky_relu_ clamp_ zero_ fill_ copy_ normal_ uniform_"
    ).split()
    g = globals()
    for name in same_name:
        setattr(T, name, g[name])
    T.where = lambda self, condition, other: where(condition, self, other)
    T.T = property(lambda self: permute(self, tuple(reversed(range(self.ndim)))))
    T.__getitem__ = getitem
    T.__setitem__ = setitem
    T.__neg__ = neg
    T.__abs__ = abs
    # The functions themselves, not wrappers: policy auto sees through these frames.
    T.__add__ = T.__radd__ = add
    T.__sub__ = sub
    T.__rsub__ = lambda self, o: sub(*_reflected(o, self))
    T.__mul__ = T.__rmul__ = mul
    T.__truediv__ = div
    T.__rtruediv__ = lambda self, o: div(*_reflected(o, self)) if isinstance(o, Tensor) else E.Div.apply(*_reflected(o, self if self.dtype.kind == "f" else cast(self, _DEFAULT_FLOAT)))
    T.__pow__ = lambda self, o: pow(self, o)
    T.__rpow__ = lambda self, o: E.Pow.apply(*_reflected(o, self))
    T.__matmul__ = matmul
    T.__rmatmul__ = lambda self, o: matmul(o, self)
    T.__iadd__ = lambda self, o: add_(self, o)
    T.__isub__ = lambda self, o: sub_(self, o)
    T.__imul__ = lambda self, o: mul_(self, o)
    T.__itruediv__ = lambda self, o: div_(self, o)
    T.__ipow__ = lambda self, o: pow_(self, o)
    T.__eq__ = eq
    T.__ne__ = ne
    T.__lt__ = lt
    T.__le__ = le
    T.__gt__ = gt
    T.__ge__ = ge


_install_methods()

# The entries policy auto sees through: each hands its first argument straight to its op.
for _entry in (add, sub, mul, div, pow, neg, abs, exp, log, sqrt, sin, cos, tanh, sigmoid, relu,
               leaky_relu, clamp):
    _inplace.passes_ownership(_entry)
del _entry
