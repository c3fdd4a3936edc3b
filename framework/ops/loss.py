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
"""

from __future__ import annotations

from .. import backend, memory
from ..autograd.function import Function
from ..backend import get_array_module
from ..tensor import Tensor
from . import kernels as K
from .kernels import on_gpu

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
        flags = [bad for _, _, bad, _ in pending if backend.device_of(bad) == dev]
        with backend.device_context(dev):
            values = backend.to_numpy(get_array_module(flags[0]).stack(flags))
        found.update(zip(map(id, flags), values))
    for fn, c, bad, what in pending:
        if found[id(bad)] != 0:
            raise IndexError(
                f"{fn}: {what} {int(found[id(bad)])} is out of bounds: {what.lower()} values must be in [0, {c - 1}]"
                if what != "Target"
                else f"{fn}: Target {int(found[id(bad)])} is out of bounds: class indices must be in [0, {c - 1}]"
            )


def _defer_target_check(fn, t, c, what="Target") -> None:
    """The GPU's target check: one reduction kernel, read back later by :func:`check_targets`
    (``what``: what the message calls a value, e.g. ``"Index"`` for embedding's indices)."""
    if c == 0:  # every target is out of range (and 0 could not mark one): no device read needed
        raise IndexError(f"{fn}: every {what.lower()} is out of bounds: the input has 0 classes")
    _pending.append((fn, c, K.bad_target(t, c), what))
    if len(_pending) >= CHECK_EVERY:
        check_targets()


def _check_reduction(reduction):
    if reduction not in REDUCTIONS:
        raise ValueError(f"{reduction!r} is not a valid value for reduction; use 'mean', 'sum' or 'none'")


def _reduce(loss, reduction, xp):
    if reduction == "mean":
        return xp.asarray(loss.mean())
    if reduction == "sum":
        return xp.asarray(loss.sum())
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
    if x.dtype.kind != "f":
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
    if target.shape[0] and on_gpu(target._data):
        # Needed on a GPU too (CuPy wraps an out-of-range index around), but not read back
        # inside the step: deferred to check_targets().
        _defer_target_check(fn, target._data, x.shape[1])
    elif target.shape[0]:
        xp, t = target.xp, target._data
        lo, hi = (int(v) for v in backend.to_numpy(xp.stack((xp.min(t), xp.max(t)))))
        c = x.shape[1]
        if lo < 0 or hi >= c:
            bad = lo if lo < 0 else hi
            raise IndexError(f"{fn}: Target {bad} is out of bounds: class indices must be in [0, {c - 1}]")


class CrossEntropy(Function):
    """Fused log-softmax + NLL over (N, C) logits with int targets; optional label smoothing."""

    saves = ("x", "target")

    def forward(ctx, x, target, reduction="mean", label_smoothing=0.0):
        xp = get_array_module(x)
        n, c = x.shape
        ctx.reduction, ctx.eps = reduction, label_smoothing
        if on_gpu(x):
            loss, lse = memory.empty((n,), x.dtype, xp), memory.empty((n,), x.dtype, xp)
            K.cross_entropy(x, target, c, label_smoothing, loss, lse)
            ctx.keep(lse=lse)
            return _reduce(loss, reduction, xp)
        shifted = memory.empty((n, c), x.dtype, xp, "workspace")
        xp.subtract(x, x.max(axis=1, keepdims=True), out=shifted)
        rows = xp.arange(n)
        loss = -shifted[rows, target]  # -(x[target] - max); the logsumexp is added below
        if label_smoothing:
            smooth = shifted.mean(axis=1)
            loss *= 1.0 - label_smoothing
            loss -= label_smoothing * smooth
        xp.exp(shifted, out=shifted)  # the same workspace, now exp(x - max)
        loss += xp.log(shifted.sum(axis=1))
        return _reduce(loss, reduction, xp)

    def backward(ctx, g):
        if not ctx.needs_input_grad[0]:
            return None, None
        x, target = ctx.x, ctx.target
        xp = get_array_module(g)
        n, c = x.shape
        p = memory.empty((n, c), x.dtype, xp, "gradients")
        if on_gpu(g):
            gs, inv_n = (
                (g.reshape(-1, 1), 1.0) if ctx.reduction == "none" else (g, 1.0 / n if ctx.reduction == "mean" else 1.0)
            )
            lse, t = ctx.lse.reshape(-1, 1), target.reshape(-1, 1)
            K.cross_entropy_backward(x, t, lse, gs, inv_n, ctx.eps, c, p)
            return p, None
        # Written through out= and the values returned: in place on arrays; under
        # create_graph (tensors) each step is a new tensor, as the ones before are saved.
        p = xp.subtract(x, xp.amax(x, axis=1, keepdims=True), out=p)
        p = xp.exp(p, out=p)
        p = xp.true_divide(p, p.sum(axis=1, keepdims=True), out=p)
        eps = ctx.eps
        if hasattr(p, "_grad_fn"):
            hot = xp.zeros((n, c), p.dtype)
            hot[xp.arange(n), target] = 1.0 - eps
            p = p - hot
        else:
            p[xp.arange(n), target] -= 1.0 - eps
        if eps:
            p = xp.subtract(p, eps / c, out=p)
        return xp.multiply(p, _grad_scale(g, ctx.reduction, n), out=p), None


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
    if input.dtype.kind != "f" or input.dtype != target.dtype:
        raise TypeError(
            f"mse_loss: input ({input.dtype}) and target ({target.dtype}) must have the same floating dtype"
        )
    return MseLoss.apply(input, target, reduction=reduction)
