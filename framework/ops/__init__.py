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
from ..autograd.grad_mode import state as _grad_state
from ..autograd.view_meta import ForbiddenReplay as _ForbiddenReplay
from ..tensor import Tensor, _wrap
from . import elementwise as E
from . import linalg as L
from . import promotion as _promotion
from . import reduce as R
from . import view as V
from .broadcast import broadcast_shapes, sum_to  # noqa: F401  (re-exported)
from .masking import masked_fill, masked_fill_, tril, tril_, triu, triu_  # noqa: F401  (re-exported)

_DEFAULT_FLOAT = _promotion.DEFAULT_FLOAT
# The Python scalars that leave a tensor of these kinds its dtype (the fast path of _operand)
_KEEPS_KIND = {float: "fc", int: "iufc", bool: "biufc"}


def _operand(x, other, opmath=False):
    """A binary op's operands, promoted as PyTorch promotes them (:mod:`.promotion`).

    Tensors are cast to the result type (``int64 tensor + float32 tensor`` is float32;
    ``float32 tensor + float64 0-d tensor`` stays float32); a NumPy scalar becomes a
    Python number, so the kernel sees nothing left to promote. Either operand may be a
    number (the reflected operators). ``opmath``: see :func:`_as_type`. Runs for every
    binary op: the common cases first.
    """
    if isinstance(other, Tensor):
        if isinstance(x, Tensor) and x._data.dtype == other._data.dtype:
            return x, other
    elif isinstance(x, Tensor) and x._data.dtype.kind in _KEEPS_KIND.get(other.__class__, ""):
        return x, other
    elif _backend.is_array(other) or _backend.is_array(x):
        raise TypeError("mix tensors with tensors or Python scalars, not NumPy arrays: wrap it with fw.tensor()")
    r = _promotion.result_type(x, other)
    return _as_type(x, r, opmath), _as_type(other, r, opmath)


def _as_type(v, dtype, opmath=False):
    """``v`` ready for a kernel computing in ``dtype``: a tensor cast, a number as is.

    A number meeting bfloat16 (ml_dtypes) is rounded to bfloat16, as PyTorch's kernels
    take it, except for mul and div (``opmath``), whose kernels keep it in float32 and
    round the result once: it becomes a float32 scalar, which :func:`_opmath` sees.
    """
    if dtype is None or v is None:  # a traced number (see promotion.result_type), no bound
        return v.as_python() if hasattr(v, "as_python") else v
    if isinstance(v, Tensor):
        return v if v._data.dtype == dtype else cast(v, dtype)
    if dtype.kind == "V":  # NumPy would take a Python float with bfloat16 as float32
        return _OPMATH(v) if opmath else dtype.type(v)
    return v.item() if isinstance(v, np.generic) else v


_OPMATH = np.float32  # the class of a scalar that _as_type keeps in float32 for bfloat16


def _opmath(op, a, b, *rest, **params):
    """``op`` on a bfloat16 tensor and a float32 scalar: computed in float32, as PyTorch
    does, and rounded to bfloat16 once."""
    out = op.apply(a, b, *rest, **params)
    t = next(v for v in (a, b, *rest) if isinstance(v, Tensor) and v._data.dtype.kind == "V")
    return out if out._data.dtype == t._data.dtype else cast(out, t._data.dtype)


def _true_division(x, other):
    """Operands of ``x / other``: an integer (or bool) result type divides as the default float."""
    if isinstance(x, Tensor) and x._data.dtype.kind in "fc":  # the common cases first
        if isinstance(other, Tensor):
            if x._data.dtype == other._data.dtype:
                return x, other
        elif other.__class__ is float or other.__class__ is int:
            return x, other
    r = _promotion.result_type(x, other)
    if r is None:  # a traced number: an integer tensor still divides as the default float
        r = next(t.dtype for t in (x, other) if isinstance(t, Tensor))
    if not _promotion.is_floating(r) and r.kind != "c":
        r = _DEFAULT_FLOAT
    return _as_type(x, r, True), _as_type(other, r, True)


def _inplace_operand(x, other, floating=False, opmath=False):
    """The second operand of an inplace op on ``x``: PyTorch computes in the result type
    and writes it into ``x``, refusing (before anything changes) a result of a higher kind
    than ``x``'s dtype ("result type Float can't be cast to the desired output type Long")."""
    if isinstance(other, Tensor):
        if other._data.dtype == x._data.dtype and not floating:
            return other
    elif x._data.dtype.kind in _KEEPS_KIND.get(other.__class__, "") and not floating:
        return other
    r = _promotion.result_type(x, other)
    if r is None:  # a traced number: as a Python number, as a NumPy scalar becomes one below
        return other.as_python() if hasattr(other, "as_python") else other
    if floating and _promotion.kind_rank(r) < 2:
        r = _DEFAULT_FLOAT
    _promotion.check_cast(r, x._data.dtype)
    return _as_type(other, r, opmath)


# --- elementwise ---------------------------------------------------------------------


def _alpha(alpha):
    """``add``/``sub``'s multiplier as a number that promotes nothing: a NumPy scalar becomes
    a Python number, as PyTorch takes it (``alpha=np.float64(0.1)`` keeps a float32 tensor
    float32); a traced number (a compiled step's) is converted the same way, kept symbolic."""
    if isinstance(alpha, np.generic):
        return alpha.item()
    return alpha.as_python() if hasattr(alpha, "as_python") else alpha


def add(x, other, alpha=1):
    x, other = _operand(x, other)
    return E.Add.apply(x, other, alpha=_alpha(alpha))


def sub(x, other, alpha=1):
    x, other = _operand(x, other)
    return E.Sub.apply(x, other, alpha=_alpha(alpha))


def mul(x, other):
    x, other = _operand(x, other, opmath=True)
    if x.__class__ is _OPMATH or other.__class__ is _OPMATH:
        return _opmath(E.Mul, x, other)
    return E.Mul.apply(x, other)


def div(x, other):
    x, other = _true_division(x, other)
    if x.__class__ is _OPMATH or other.__class__ is _OPMATH:
        return _opmath(E.Div, x, other)
    return E.Div.apply(x, other)


def pow(x, exponent):  # noqa: A001  (PyTorch's name)
    x, exponent = _operand(x, exponent)
    return E.Pow.apply(x, exponent)


def maximum(x, other):
    return E.Maximum.apply(*_operand(x, other))


def where(condition, x, y):
    """Elementwise ``x if condition else y`` (x and y may be tensors or scalars)."""
    if not (isinstance(x, Tensor) or isinstance(y, Tensor)):
        # two numbers: their result type (a Python float: the default float32)
        r = _promotion.result_type(x, y)
        if r is not None:
            return E.Where.apply(condition, r.type(x), r.type(y))
    return E.Where.apply(condition, *_operand(x, y))


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
    return E.LeakyRelu.apply(x, negative_slope=negative_slope)


def clamp(x, min=None, max=None):  # noqa: A002
    if x._data.dtype.kind not in "fc" or not (_plain(min) and _plain(max)):
        r = _promotion.result_type(x, *(b for b in (min, max) if b is not None))
        x, min, max = _as_type(x, r), _as_type(min, r), _as_type(max, r)
    return E.Clamp.apply(x, min=min, max=max)


def _plain(bound):
    return bound is None or bound.__class__ is float or bound.__class__ is int


def cast(x, dtype):
    return E.Cast.apply(x, dtype=np.dtype(dtype))


def to_device(x, device):
    return V.ToDevice.apply(x, device=device)


# --- inplace --------------------------------------------------------------------------


def add_(x, other, alpha=1):
    return E.Add.apply_(x, _inplace_operand(x, other), alpha=_alpha(alpha))


def sub_(x, other, alpha=1):
    return E.Sub.apply_(x, _inplace_operand(x, other), alpha=_alpha(alpha))


def mul_(x, other):
    return E.Mul.apply_(x, _inplace_operand(x, other, opmath=True))


def div_(x, other):
    return E.Div.apply_(x, _inplace_operand(x, other, floating=True, opmath=True))


def pow_(x, exponent):
    return E.Pow.apply_(x, _inplace_operand(x, exponent))


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
    return E.LeakyReluInplace.apply_(x, negative_slope=negative_slope)


def clamp_(x, min=None, max=None):  # noqa: A002
    if x._data.dtype.kind not in "fc" or not (_plain(min) and _plain(max)):
        r = _promotion.result_type(x, *(b for b in (min, max) if b is not None))
        _promotion.check_cast(r, x._data.dtype)
        min, max = _as_type(min, r), _as_type(max, r)
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
    if dim is None:  # PyTorch's max(): MaxBackward1, which saves self and result only
        return _as_torch_node(R.Amax.apply(x, dim=None, keepdim=False), "MaxBackward1")
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


def multinomial(input, num_samples, replacement=False):
    """Indices drawn from the rows of ``input`` (non-negative weights, 1-D or 2-D), as
    ``torch.multinomial``: by inverse CDF with one uniform per draw from the framework's
    seeded generator (``fw.manual_seed``). ``num_samples > 1`` needs ``replacement=True``.
    Weights that are negative, inf or NaN, or a row of zeros, raise PyTorch's RuntimeError.
    Not differentiable: an int64 tensor on ``input``'s device."""
    if input.ndim not in (1, 2):
        raise RuntimeError(f"prob_dist must be 1 or 2 dim, got {input.ndim}")
    if num_samples < 1:
        raise RuntimeError("cannot sample n_sample <= 0 samples")
    if num_samples > 1 and not replacement:
        raise NotImplementedError("multinomial: num_samples > 1 without replacement is not supported")
    xp = input.xp
    _check_distribution(input._data.reshape(-1, input.shape[-1]), replacement and num_samples > 1, xp)
    w = input._data.astype(np.float64).reshape(-1, input.shape[-1])
    cdf = xp.cumsum(w, axis=-1)
    u = _random.generator(xp).random((w.shape[0], num_samples)) * cdf[:, -1:]
    out = (cdf[:, None, :] <= u[:, :, None]).sum(axis=-1)
    out = xp.minimum(out, input.shape[-1] - 1).astype(np.int64)
    return _wrap(out if input.ndim == 2 else out[0])


_MULTINOMIAL_ERRORS = {
    1: "probability tensor contains either `inf`, `nan` or element < 0",
    2: "invalid multinomial distribution (encountering probability entry < 0)",
    3: "invalid multinomial distribution (encountering probability entry = infinity or NaN)",
    4: "invalid multinomial distribution (sum of probabilities <= 0)",
}


def _check_distribution(w, row_by_row: bool, xp) -> None:
    """PyTorch's checks of ``multinomial``'s weights ``w`` (rows), with its messages: for one
    draw or without replacement, any inf, NaN or negative weight anywhere, then a row
    summing to 0; for several draws with replacement, row by row, each weight in order (NaN
    fails its ``>= 0`` test first) and then the row's sum. One value is read back (on a GPU
    a synchronization, as PyTorch's CUDA multinomial makes for its checks)."""
    with np.errstate(invalid="ignore"):
        zero_rows = ~(w.sum(axis=-1, keepdims=True) > 0)  # the weights are >= 0 where it is read
        if row_by_row:  # each row's codes in the order PyTorch meets them: its weights, then its sum
            codes = xp.where(~(w >= 0), 2, xp.where(w == np.inf, 3, 0))
            codes = xp.concatenate([codes, xp.where(zero_rows, 4, 0)], axis=-1).reshape(-1)
        else:
            codes = xp.stack([~((w < np.inf) & (w >= 0)).all(), zero_rows.any()]) * xp.asarray([1, 4])
    first = int(codes[xp.argmax(codes != 0)])
    if first:
        raise RuntimeError(_MULTINOMIAL_ERRORS[first])


# --- views and shape ---------------------------------------------------------------------


def _shape_arg(shape):
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        return tuple(shape[0])
    return tuple(int(s) for s in shape)


def _infer_size(shape, numel, op):
    """``shape`` with its -1 resolved, or PyTorch's error (``infer_size``)."""
    known, infer = 1, None
    for d, n in enumerate(shape):
        if n == -1:
            if infer is not None:
                raise RuntimeError("only one dimension can be inferred")
            infer = d
        elif n < 0:
            raise RuntimeError(f"invalid shape dimension {n}")
        else:
            known *= n
    if numel == known or (infer is not None and known > 0 and numel % known == 0):
        if infer is None:
            return shape
        if known == 0:
            raise RuntimeError(
                f"cannot reshape tensor of 0 elements into shape {list(shape)} because the unspecified "
                "dimension size -1 can be any value and is ambiguous"
            )
        return shape[:infer] + (numel // known,) + shape[infer + 1 :]
    hint = ": the view size does not match the input's size" if op == "view" else ""
    raise RuntimeError(f"shape '{list(shape)}' is invalid for input of size {numel}{hint}")


def view(x, *shape):
    return V.View.apply(x, shape=_infer_size(_shape_arg(shape), x.numel(), "view"))


def view_as(x, other):
    """``x.view(other.shape)``."""
    return view(x, other.shape)


def reshape_as(x, other):
    """``x.reshape(other.shape)``."""
    return reshape(x, other.shape)


def reshape(x, *shape):
    """A view when the strides allow one, a copy otherwise (as in PyTorch)."""
    shape = _infer_size(_shape_arg(shape), x.numel(), "reshape")
    if V.reshape_view(x._data, shape) is not None:
        return V.View.apply(x, shape=shape)
    return V.ReshapeCopy.apply(x, shape=shape)


def _dim(d, ndim):
    n = builtins.max(ndim, 1)  # a 0-d tensor takes dim 0 or -1, as PyTorch's
    if not -n <= d < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {d})")
    return d % ndim if ndim else 0


def permute(x, *dims):
    dims = _shape_arg(dims)
    if sorted(_dim(d, x.ndim) for d in dims) != list(range(x.ndim)):
        raise RuntimeError(f"permute(): dims {dims} are not a permutation of the {x.ndim} dimensions")
    return V.Permute.apply(x, dims=tuple(_dim(d, x.ndim) for d in dims))


def transpose(x, dim0, dim1):
    return _as_torch_node(_swap(x, dim0, dim1), "TransposeBackward0", dim0=int(dim0), dim1=int(dim1))


def _swap(x, dim0, dim1):
    dims = list(range(x.ndim))
    a, b = _dim(dim0, x.ndim), _dim(dim1, x.ndim)
    if dims:
        dims[a], dims[b] = dims[b], dims[a]
    return V.Permute.apply(x, dims=tuple(dims))


def _as_torch_node(t, name: str, **attrs):
    """``t``, its node named as PyTorch names the call that made it (see
    ``Function.as_torch_node``); a view's node keeps the name when it is made again from
    the base (after an inplace op on the base)."""
    node = t.grad_fn
    if node is not None and hasattr(node, "as_torch_node"):
        node.as_torch_node(name, **attrs)
        replay = t._view_fn
        if callable(replay) and getattr(replay, "creation", None) is None:
            t._view_fn = lambda base: _as_torch_node(replay(base), name, **attrs)
    return t


def swapdims(x, dim0, dim1):
    """NumPy's name for :func:`transpose` (also ``swapaxes``)."""
    return transpose(x, dim0, dim1)


swapaxes = swapdims


def _matrix_transpose(x, name):
    # PyTorch: a 0-d tensor is its own (matrix) transpose; a 1-d one has none.
    if x.ndim == 0:
        return x
    if x.ndim < 2:
        raise RuntimeError(
            f"tensor.{name} is only supported on matrices or batches of matrices. Got {x.ndim}-D tensor."
        )
    return transpose(x, -2, -1)


def _hermitian(x):
    # Real dtypes only: the conjugate transpose is the transpose.
    if x.ndim not in (0, 2):
        hint = " For batches of matrices, consider using tensor.mH" if x.ndim > 2 else ""
        raise RuntimeError(f"tensor.H is only supported on matrices (2-D tensors). Got {x.ndim}-D tensor.{hint}")
    return x if x.ndim == 0 else transpose(x, 0, 1)


def t(x):
    if x.ndim > 2:
        raise RuntimeError(f"t() expects a tensor with <= 2 dimensions, but self is {x.ndim}D")
    if x.ndim < 2:  # a view that changes nothing, as in PyTorch (not x itself)
        return _as_torch_node(V.Permute.apply(x, dims=tuple(range(x.ndim))), "TBackward0")
    return _as_torch_node(_swap(x, 0, 1), "TBackward0")


def unsqueeze(x, dim):
    d = dim + x.ndim + 1 if dim < 0 else dim
    if not 0 <= d <= x.ndim:
        raise IndexError(
            f"Dimension out of range (expected to be in range of [{-x.ndim - 1}, {x.ndim}], but got {dim})"
        )
    return view(x, x.shape[:d] + (1,) + x.shape[d:])


def squeeze(x, dim=None):
    if dim is None:
        shape = tuple(n for n in x.shape if n != 1)
    else:
        dims = {_dim(d, x.ndim) for d in ((dim,) if isinstance(dim, int) else dim)}
        shape = tuple(n for i, n in enumerate(x.shape) if not (i in dims and n == 1))
    return view(x, shape)


def flatten(x, start_dim=0, end_dim=-1):
    """Dims ``start_dim..end_dim`` merged into one; ``x`` itself when that is one dim (PyTorch)."""
    if x.ndim == 0:
        return reshape(x, (1,))
    s, e = _dim(start_dim, x.ndim), _dim(end_dim, x.ndim)
    if s > e:
        raise RuntimeError("flatten() has invalid args: start_dim cannot come after end_dim")
    if s == e:
        return x
    n = 1
    for k in x.shape[s : e + 1]:
        n *= k
    return reshape(x, x.shape[:s] + (n,) + x.shape[e + 1 :])


def expand(x, *sizes):
    sizes = _shape_arg(sizes)
    lead = len(sizes) - x.ndim
    if lead < 0:
        raise RuntimeError(f"expand: the number of sizes ({len(sizes)}) must be >= the number of dimensions ({x.ndim})")
    for i, n in enumerate(sizes[:lead]):
        if n < 0:
            raise RuntimeError(
                f"The expanded size of the tensor ({n}) isn't allowed in a leading, non-existing dimension {i}"
            )
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
    """Elements ``start .. start + length - 1`` of dim ``dim``, as a view.

    As in PyTorch, ``start`` may be negative (counted from the end) or a 0-d integer tensor.
    """
    if isinstance(start, Tensor):
        if start.ndim != 0 or start.dtype.kind not in "iu":
            raise RuntimeError("start must be an 0-dim integral Tensor.")
        start = int(start.item())
    if x.ndim == 0:
        raise RuntimeError("narrow() cannot be applied to a 0-dim tensor.")
    d = _dim(dim, x.ndim)
    size = x.shape[d]
    if not -size <= start <= size:
        raise IndexError(f"start out of range (expected to be in range of [{-size}, {size}], but got {start})")
    if start < 0:
        start += size
    if length < 0 or start + length > size:
        raise IndexError(f"narrow(): start ({start}) + length ({length}) exceeds dimension size ({size})")
    index = (slice(None),) * d + (slice(start, start + length), Ellipsis)
    return V.GetItem.apply(x, index=index)


def select(x, dim, index):
    """The slice at ``index`` of dim ``dim`` (one dim fewer), as a view."""
    if x.ndim == 0:
        raise IndexError("select() cannot be applied to a 0-dim tensor.")
    d = _dim(dim, x.ndim)
    size = x.shape[d]
    if not -size <= index < size:
        raise IndexError(f"select(): index {index} out of range for tensor of size {list(x.shape)} at dimension {dim}")
    return V.Select.apply(x, index=(slice(None),) * d + (index % size, Ellipsis))


def _multi_output(x, op, dim, pieces):
    """The views ``op`` returns together, one per index in ``pieces`` along ``dim``.

    As in PyTorch, while autograd records, none of them may be modified in place: each
    has its own history, and rewriting one would leave the others' wrong. Under no_grad
    they are views made under no_grad (writable until grad mode is on again).
    """
    lead = (slice(None),) * dim
    outs = tuple(op.apply(x, index=lead + (p, Ellipsis)) for p in pieces)
    if _grad_state.enabled:
        for i, out in enumerate(outs):
            out._view_fn = _ForbiddenReplay("multi_output", op.node_name, i)
    return outs


def _dim_of_at_least_1d(x, dim, name):
    if x.ndim == 0:
        raise RuntimeError(f"{name} expects at least a 1-dimensional tensor")
    return _dim(dim, x.ndim)


def unbind(x, dim=0):
    """The slices along ``dim``, as a tuple of views (they refuse inplace ops, see :func:`_multi_output`)."""
    if x.ndim == 0:
        raise IndexError("Dimension specified as 0 but tensor has no dimensions")
    d = _dim(dim, x.ndim)
    return _multi_output(x, V.Unbind, d, range(x.shape[d]))


def split_with_sizes(x, split_sizes, dim=0):
    """Consecutive pieces of dim ``dim`` with the given sizes (which must add up to it)."""
    d = _dim_of_at_least_1d(x, dim, "split_with_sizes")
    sizes = [int(n) for n in split_sizes]
    if any(n < 0 for n in sizes):
        raise RuntimeError(
            f"split_with_sizes expects split_sizes have only non-negative entries, but got split_sizes={sizes}"
        )
    if builtins.sum(sizes) != x.shape[d]:
        raise RuntimeError(
            f"split_with_sizes expects split_sizes to sum exactly to {x.shape[d]} (input tensor's size at "
            f"dimension {d}), but got split_sizes={sizes}"
        )
    return _multi_output(x, V.SplitWithSizes, d, _slices(sizes))


def _slices(sizes):
    start = 0
    for n in sizes:
        yield slice(start, start + n)
        start += n


def split(x, split_size_or_sections, dim=0):
    """Pieces of ``split_size`` along ``dim`` (the last may be smaller), or of the listed sizes."""
    if isinstance(split_size_or_sections, (list, tuple)):
        return split_with_sizes(x, split_size_or_sections, dim)
    d = _dim_of_at_least_1d(x, dim, "split")
    size, total = int(split_size_or_sections), x.shape[d]
    if size < 0:
        raise RuntimeError(f"split expects split_size be non-negative, but got split_size={size}")
    if size == 0 and total != 0:
        raise RuntimeError(f"split_size can only be 0 if dimension size is 0, but got dimension size of {total}")
    sizes = [size] * (total // size) + ([total % size] if total % size else []) if size else [0]
    return _multi_output(x, V.Split, d, _slices(sizes or [0]))


def chunk(x, chunks, dim=0):
    """At most ``chunks`` pieces of equal size along ``dim`` (the last may be smaller)."""
    if chunks <= 0:
        raise RuntimeError(f"chunk expects `chunks` to be greater than 0, got: {chunks}")
    d = _dim_of_at_least_1d(x, dim, "chunk")
    total = x.shape[d]
    size = (total + chunks - 1) // chunks
    if size == 0 and total == 0:  # keep the number of chunks: all empty
        return split_with_sizes(x, [0] * chunks, d)
    return split(x, size, d)


def as_strided(x, size, stride, storage_offset=None):
    """A view of any geometry over the storage of ``x``'s base, as PyTorch's ``as_strided``.

    ``size``, ``stride`` and ``storage_offset`` count elements from the first element of
    the base tensor (the tensor that is not a view), which must be contiguous: that is
    the storage PyTorch counts from. ``storage_offset`` defaults to where ``x`` starts.
    """
    size, stride = tuple(int(n) for n in size), tuple(int(s) for s in stride)
    if len(size) != len(stride):
        raise RuntimeError(f"mismatch in length of strides and shape (size {list(size)}, stride {list(stride)})")
    if any(s < 0 for s in stride):
        raise RuntimeError(f"as_strided: Negative strides are not supported at the moment, got strides: {list(stride)}")
    if any(n < 0 for n in size):
        raise RuntimeError(f"as_strided: negative size in {list(size)}")
    base = x._base if x._base is not None else x
    data = base._data
    if not data.flags.c_contiguous:
        raise RuntimeError(
            "as_strided needs the storage of a contiguous base tensor; this tensor's base is not "
            "contiguous: call .contiguous() on it first"
        )
    source = _element_offset(x._data, data)
    offset = source if storage_offset is None else int(storage_offset)
    if offset < 0:
        raise RuntimeError(f"as_strided: negative storage offset {offset}")
    if all(size):
        needed = offset + builtins.sum((n - 1) * s for n, s in zip(size, stride)) + 1
        if needed > data.size:
            raise RuntimeError(
                f"setStorage: sizes {list(size)}, strides {list(stride)}, storage offset {offset}, and itemsize "
                f"{data.itemsize} requiring a storage size of {needed * data.itemsize} are out of bounds for "
                f"storage of size {data.size * data.itemsize}"
            )
    return V.AsStrided.apply(x, size=size, stride=stride, offset=offset, source_offset=source)


def _element_offset(view, base):
    """How many elements after ``base``'s first element ``view`` starts."""
    if isinstance(view, np.ndarray):
        delta = view.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    else:
        delta = view.data.ptr - base.data.ptr
    return delta // view.itemsize


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
    head, tail = (items, []) if cut is None else (items[:cut], items[cut + 1 :])
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


def allclose(x, other, rtol=1e-05, atol=1e-08, equal_nan=False) -> bool:
    """Whether ``|x - other| <= atol + rtol * |other|`` everywhere (broadcasting), as a bool."""
    if x.dtype != other.dtype:
        raise RuntimeError(f"allclose(): {x.dtype} did not match {other.dtype}")
    if x.device != other.device:
        raise RuntimeError(f"allclose(): expected both tensors on one device, got {x.device} and {other.device}")
    return builtins.bool(x.xp.allclose(x._data, other._data, rtol=rtol, atol=atol, equal_nan=equal_nan))


def contiguous(x):
    return x if x.is_contiguous() else V.Clone.apply(x, contiguous=True)


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


def _compared(x, y):
    """A comparison's operands: promoted as arithmetic's; a NumPy or CuPy array (which
    arithmetic refuses) is compared as it is, as before."""
    if isinstance(y, Tensor) or y.__class__ in _KEEPS_KIND or not _backend.is_array(y):
        return _operand(x, y)
    return x, y


def eq(x, y):
    return E.Eq.apply(*_compared(x, y))


def ne(x, y):
    return E.Ne.apply(*_compared(x, y))


def lt(x, y):
    return E.Lt.apply(*_compared(x, y))


def le(x, y):
    return E.Le.apply(*_compared(x, y))


def gt(x, y):
    return E.Gt.apply(*_compared(x, y))


def ge(x, y):
    return E.Ge.apply(*_compared(x, y))


# --- reflected operators (Tensor.__rsub__, ...): the scalar comes first -------------------


def rsub(x, other):
    """``other - x`` for ``x`` a tensor and ``other`` a tensor or a Python scalar."""
    name = "RsubBackward0" if isinstance(other, Tensor) else "RsubBackward1"  # rsub(Tensor, Tensor | Scalar)
    return _as_torch_node(sub(other, x), name, alpha=1)


def rdiv(x, other):
    """``other / x``: true division, so integer tensors divide as the default float."""
    return div(other, x)


def rpow(x, other):
    """``other ** x``."""
    return E.Pow.apply(*_operand(other, x))


# The entries policy auto sees through: each hands its first argument straight to its op.
_ENTRIES = (add, sub, mul, div, pow, neg, abs, exp, log, sqrt, sin, cos, tanh, sigmoid, relu, leaky_relu, clamp)
for _entry in _ENTRIES + (softmax, log_softmax, masked_fill, tril, triu):
    _inplace.passes_ownership(_entry)
del _entry


# The array namespace of tensors for backward formulas run under create_graph (last:
# it builds on the ops above).
from ..autograd import higher as _higher  # noqa: E402, F401
from . import tensor_xp as _tensor_xp  # noqa: E402, F401
