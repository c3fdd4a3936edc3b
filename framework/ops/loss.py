"""Losses: ``cross_entropy`` (fused log-softmax + NLL), ``nll_loss``, ``mse_loss``.

``cross_entropy`` is ONE Function: forward computes ``logsumexp(x) - x[target]`` with
one ``(N, C)`` workspace, backward returns ``(softmax(x) - onehot) * grad / N``. It saves
the logits and the targets, both inputs that exist anyway, and recomputes the softmax in
backward (N*C exps) instead of keeping a new ``(N, C)`` probability buffer alive from
forward to backward: the same bytes at the boundary, but no new allocation, and an
inplace change of the logits after the loss is caught by the version check.

On a GPU ``cross_entropy`` is one fused kernel each way (:mod:`.kernels`; forward also
keeps the per-row logsumexp, N values, so backward is one elementwise pass) plus the
batch mean, and nothing in a step reads a value back to the host. The target check
(CuPy does not check indices) then runs on the device and is DEFERRED: the loss of an
out-of-range target is NaN at once, and :func:`check_targets` raises the IndexError,
reading every pending check in one transfer. The trainer calls it at each log point
and before it reports a non-finite loss; it also runs by itself every
:data:`CHECK_EVERY` loss calls. On the CPU the check raises in the call, as before.
A compiled step runs the check again at every call, replayed or launched as a CUDA graph
(:class:`TargetRangeCheck`).
"""

from __future__ import annotations

from .. import backend, memory
from ..autograd import node as _node
from ..autograd.function import Function
from ..backend import get_array_module
from ..tensor import Tensor
from . import kernels as K
from .broadcast import astype, sum_axes
from .kernels import on_gpu, opmath_dtype
from .promotion import is_floating

REDUCTIONS = ("mean", "sum", "none")

#: The deferred target checks of the GPU path are read back at least this often (loss calls).
CHECK_EVERY = 256
_pending: list = []  # (op name, number of classes, device array: a bad target or 0, "Target" or "Index")


def check_targets() -> None:
    """Raises the IndexError of the first pending GPU loss call whose targets were out of range.

    One host transfer for all pending checks (none when nothing is pending); forgets them
    either way. A no-op on the CPU, where the losses check their targets in the call.
    """
    if not _pending:
        return
    pending = list(_pending)
    _pending.clear()
    found = {}
    for dev in dict.fromkeys(backend.device_of(bad) for _, _, bad, _ in pending):  # one transfer per device
        flags = list({id(bad): bad for _, _, bad, _ in pending if backend.device_of(bad) == dev}.values())
        with backend.device_context(dev):
            values = backend.to_numpy(get_array_module(flags[0]).stack(flags))
            for flag, value in zip(flags, values):
                if value != 0:  # a compiled step's flag is read again after its next calls: cleared
                    flag.fill(0)
        found.update(zip(map(id, flags), values))
    for fn, c, bad, what in pending:
        if found[id(bad)] != 0:
            raise IndexError(_out_of_range(fn, what, int(found[id(bad)]), c))


def _out_of_range(fn, what, value, c) -> str:
    """The message of a value outside ``[0, c)``: a loss's ``"Target"`` (a class index) or an
    embedding's ``"Index"`` (a row), as PyTorch words them."""
    if what == "Target":
        return f"{fn}: Target {value} is out of bounds: class indices must be in [0, {c - 1}]"
    return f"{fn}: index {value} out of range in self: indices must be in [0, {c - 1}]"


def _defer(fn, c, bad, what) -> None:
    """Registers a device flag (a bad value, or 0) for :func:`check_targets`."""
    _pending.append((fn, c, bad, what))
    if len(_pending) >= CHECK_EVERY:
        check_targets()


class TargetRangeCheck:
    """The range check of integer indices, ``[0, C)``: a loss's class-index targets
    (``what="Target"``) and an embedding's row indices (``"Index"``). One place for an
    eager call and for a compiled step, which records it (it is not an op) and runs it
    again at every call (a ``check`` node of framework/compile).

    On the CPU it raises the IndexError in the call (one host read). On a GPU nothing is
    read back inside the step: one reduction kernel finds a bad value (or 0), and the
    check is deferred to :func:`check_targets`. A compiled step on a GPU keeps a device
    flag of its own per check (:meth:`new_flag`, passed as ``flag``): each call keeps the
    first bad value it has seen in it, inside the step's kernels (its CUDA graph), and
    the step registers the flag after each call (:meth:`defer`); check_targets clears a
    flag it read as bad.
    """

    label = "target_check"

    def __call__(self, t, fn, c, what="Target", flag=None) -> None:
        """Checks the values of ``t`` (an array) that op ``fn`` takes against ``c`` classes or rows."""
        if not t.size:
            return
        if on_gpu(t):
            if c == 0:  # every value is out of range (and 0 could not mark one): no device read needed
                raise IndexError(f"{fn}: every {what.lower()} is out of bounds: there are 0 classes or rows")
            bad = K.bad_target(t.reshape(-1), c)
            if flag is None:
                _defer(fn, c, bad, what)
            else:  # kept while the flag holds none (0): the first bad value since it was read
                get_array_module(t).copyto(flag, bad, where=flag == 0)
            return
        xp = get_array_module(t)
        lo, hi = (int(v) for v in backend.to_numpy(xp.stack((xp.min(t), xp.max(t)))))
        if lo < 0 or hi >= c:
            raise IndexError(_out_of_range(fn, what, lo if lo < 0 else hi, c))

    @staticmethod
    def new_flag(device):
        """A compiled step's flag for one check on ``device``: a 0-d int64 device array, 0."""
        with backend.device_context(device):
            return memory.track(backend.xp_for(device).zeros((), dtype="int64"), "workspace")

    @staticmethod
    def defer(flag, fn, c, what="Target") -> None:
        """After a compiled step's call: its flag, registered for :func:`check_targets`."""
        _defer(fn, c, flag, what)


target_range_check = TargetRangeCheck()


def _check_reduction(reduction):
    if reduction not in REDUCTIONS:
        raise ValueError(f"{reduction!r} is not a valid value for reduction; use 'mean', 'sum' or 'none'")


def _reduce(loss, reduction, xp):
    """The per-sample losses reduced, summed in opmath (float32 for half types) and rounded
    once to their dtype."""
    acc = opmath_dtype(loss.dtype)
    if reduction == "mean":
        return xp.asarray(loss.mean(dtype=acc)).astype(loss.dtype, copy=False)
    if reduction == "sum":
        return xp.asarray(loss.sum(dtype=acc)).astype(loss.dtype, copy=False)
    return loss


def _grad_scale(g, reduction, n):
    """What multiplies each sample's gradient: a 0-d array, or an (N, 1) column for 'none'."""
    if reduction == "mean":
        return g / n
    if reduction == "sum":
        return g
    return g.reshape(-1, 1)


def _check_class_inputs(fn, x, target, log_probs_name):
    if not isinstance(x, Tensor) or not isinstance(target, Tensor):
        raise TypeError(f"{fn}: input and target must be tensors, got {type(x).__name__} and {type(target).__name__}")
    if x.ndim != 2:
        raise ValueError(f"{fn}: expected {log_probs_name} of shape (N, C), got shape {tuple(x.shape)}")
    if not is_floating(x.dtype):
        raise TypeError(f"{fn}: expected floating {log_probs_name}, got {x.dtype}")
    if target.dtype.kind not in "iu":
        raise TypeError(
            f"{fn}: expected class indices as an integer (int64) target of shape ({x.shape[0]},), got "
            f"{target.dtype}; class probabilities as targets are not supported: convert with target.long()"
        )
    if target.shape != (x.shape[0],):
        raise ValueError(
            f"{fn}: expected target of shape ({x.shape[0]},) for input of shape {tuple(x.shape)}, "
            f"got {tuple(target.shape)}"
        )
    if target.shape[0] and target.device != x.device:
        raise RuntimeError(f"{fn}: input is on {x.device} but target is on {target.device}")
    check_range(target, fn, x.shape[1])


def check_range(t, fn, c, what="Target") -> None:
    """Checks that the integer tensor ``t`` holds values in ``[0, c)`` (:class:`TargetRangeCheck`).

    Needed on a GPU too (CuPy wraps an out-of-range index around); a step being compiled
    records it, to run it again at every call.
    """
    capture = _node.capture
    if capture is not None:
        capture.check(target_range_check, t, fn, c, what)
    else:
        target_range_check(t._data, fn, c, what)


class CrossEntropy(Function):
    """Fused log-softmax + NLL over (N, C) logits with int targets; optional label smoothing.

    Half-precision logits (float16, bfloat16) are computed with in float32, as PyTorch
    does, on every device: a row's max, sum of exponentials and log-sum-exp (kept for
    backward in float32), the losses rounded once to the logits' dtype; a float16 sum of
    the exponentials would pass 65504 (inf) past 65504 classes and lose digits long before.
    """

    node_name = "NllLossBackward0"  # PyTorch's cross_entropy ends in nll_loss

    saves = ("x", "target")

    def forward(ctx, x, target, reduction="mean", label_smoothing=0.0):
        xp = get_array_module(x)
        n, c = x.shape
        ctx.reduction, ctx.eps = reduction, label_smoothing
        acc = opmath_dtype(x.dtype)
        if on_gpu(x):
            loss, lse = memory.empty((n,), x.dtype, xp), memory.empty((n,), acc, xp)
            K.cross_entropy(x, target, c, label_smoothing, loss, lse)
            ctx.keep(lse=lse)
            return _reduce(loss, reduction, xp)
        shifted = memory.empty((n, c), acc, xp, "workspace")
        xp.subtract(x, x.max(axis=1, keepdims=True), out=shifted, dtype=acc)
        rows = xp.arange(n)
        loss = -shifted[rows, target]  # -(x[target] - max); the logsumexp is added below
        if label_smoothing:
            smooth = shifted.mean(axis=1)
            loss *= 1.0 - label_smoothing
            loss -= label_smoothing * smooth
        xp.exp(shifted, out=shifted)  # the same workspace, now exp(x - max)
        loss += xp.log(sum_axes(shifted, 1))
        return _reduce(loss.astype(x.dtype, copy=False), reduction, xp)

    def backward(ctx, g):
        if not ctx.needs_input_grad[0]:
            return None, None
        x, target = ctx.x, ctx.target
        xp = get_array_module(g)
        n, c = x.shape
        if on_gpu(g):
            p = memory.empty((n, c), x.dtype, xp, "gradients")
            gs, inv_n = (
                (g.reshape(-1, 1), 1.0) if ctx.reduction == "none" else (g, 1.0 / n if ctx.reduction == "mean" else 1.0)
            )
            lse, t = ctx.lse.reshape(-1, 1), target.reshape(-1, 1)
            K.cross_entropy_backward(x, t, lse, gs, inv_n, ctx.eps, c, p)
            return p, None
        # Written through out= and the values returned: in place on arrays; under
        # create_graph (tensors) each step is a new tensor, as the ones before are saved.
        # Half types: computed in float32 (a workspace), rounded once into the gradient.
        dtype = x.dtype
        acc = opmath_dtype(dtype)
        p = memory.empty((n, c), acc, xp, "gradients" if acc == dtype else "workspace")
        x, g = astype(x, acc), astype(g, acc)
        p = xp.subtract(x, xp.amax(x, axis=1, keepdims=True), out=p)
        p = xp.exp(p, out=p)
        p = xp.true_divide(p, sum_axes(p, 1, keepdims=True), out=p)
        eps = ctx.eps
        if hasattr(p, "_grad_fn"):
            hot = xp.zeros((n, c), p.dtype)
            hot[xp.arange(n), target] = 1.0 - eps
            p = p - hot
        else:
            p[xp.arange(n), target] -= 1.0 - eps
        if eps:
            p = xp.subtract(p, eps / c, out=p)
        gx = xp.multiply(p, _grad_scale(g, ctx.reduction, n), out=p)
        if acc != dtype:
            gx = astype(gx, dtype)
            if not hasattr(gx, "_grad_fn"):
                memory.track(gx, "gradients")
        return gx, None


class NllLoss(Function):
    """``-input[i, target[i]]`` reduced; backward needs only the targets."""

    saves = ("target",)

    def forward(ctx, x, target, reduction="mean"):
        xp = get_array_module(x)
        ctx.shape, ctx.reduction = x.shape, reduction
        loss = -x[xp.arange(x.shape[0]), target]
        return _reduce(loss, reduction, xp)

    def backward(ctx, g):
        if not ctx.needs_input_grad[0]:
            return None, None
        xp = get_array_module(g)
        n = ctx.shape[0]
        gx = memory.zeros(ctx.shape, g.dtype, xp, "gradients")
        gx[xp.arange(n), ctx.target] = -_grad_scale(g, ctx.reduction, n).reshape(-1)
        return gx, None


class MseLoss(Function):
    """``(input - target) ** 2`` reduced; gradients flow to both."""

    saves = ("x", "y")  # inputs that exist anyway; the difference is recomputed

    def forward(ctx, x, y, reduction="mean"):
        # checked here, on the arrays the op computes with: autocast casts both first
        if not is_floating(x.dtype) or x.dtype != y.dtype:
            raise TypeError(f"mse_loss: input ({x.dtype}) and target ({y.dtype}) must have the same floating dtype")
        xp = get_array_module(x)
        ctx.reduction, ctx.n = reduction, max(x.size, 1)
        d = memory.empty(x.shape, x.dtype, xp, "workspace")
        xp.subtract(x, y, out=d)
        d *= d
        return _reduce(d, reduction, xp)

    def backward(ctx, g):
        xp = get_array_module(g)
        x, y = ctx.x, ctx.y
        d = memory.empty(x.shape, x.dtype, xp, "gradients")
        d = xp.subtract(x, y, out=d)
        red = ctx.reduction
        d *= 2.0 * (g / ctx.n if red == "mean" else g)
        gx = d if ctx.needs_input_grad[0] else None
        gy = (-d if gx is not None else xp.negative(d, out=d)) if ctx.needs_input_grad[1] else None
        return gx, gy


def cross_entropy(input, target, reduction="mean", label_smoothing=0.0):  # noqa: A002
    """Cross entropy of (N, C) logits against int class indices (PyTorch's ``cross_entropy``).

    Args:
        input: ``(N, C)`` float logits (unnormalized).
        target: ``(N,)`` integer tensor (int64), values in ``[0, C)``.
        reduction: ``"mean"`` (over N), ``"sum"`` or ``"none"`` (per sample, shape (N,)).
        label_smoothing: ``eps`` in [0, 1]: the target is ``(1 - eps) onehot + eps / C``.

    Raises:
        IndexError: a target is outside ``[0, C)``.
        TypeError: float targets, or integer logits.
        ValueError: shapes that do not match, an unknown reduction or smoothing.
    """
    _check_reduction(reduction)
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    _check_class_inputs("cross_entropy", input, target, "logits")
    return CrossEntropy.apply(input, target, reduction=reduction, label_smoothing=float(label_smoothing))


def nll_loss(input, target, reduction="mean"):  # noqa: A002
    """Negative log likelihood of (N, C) log-probabilities (e.g. ``log_softmax``) at int targets.

    Args:
        input: ``(N, C)`` float log-probabilities.
        target: ``(N,)`` integer tensor, values in ``[0, C)``.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
    """
    _check_reduction(reduction)
    _check_class_inputs("nll_loss", input, target, "log-probabilities")
    return NllLoss.apply(input, target, reduction=reduction)


def mse_loss(input, target, reduction="mean"):  # noqa: A002
    """Mean squared error between two tensors of the same shape and floating dtype.

    Args:
        input, target: tensors of equal shape (no broadcasting: a mismatch is usually a bug,
            e.g. (N, 1) against (N,)) and equal floating dtype.
        reduction: ``"mean"`` (over all elements), ``"sum"`` or ``"none"``.
    """
    _check_reduction(reduction)
    if not isinstance(input, Tensor) or not isinstance(target, Tensor):
        raise TypeError(
            f"mse_loss: input and target must be tensors, got {type(input).__name__} and {type(target).__name__}"
        )
    if input.shape != target.shape:
        raise ValueError(
            f"mse_loss: input shape {tuple(input.shape)} and target shape {tuple(target.shape)} differ; "
            "reshape one so they match (broadcasting is not done, it usually hides a bug)"
        )
    return MseLoss.apply(input, target, reduction=reduction)  # (it checks the dtypes)
