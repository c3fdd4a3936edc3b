"""The optimizers' fused GPU kernels: one launch per step and dtype over the flat buffers.

On a GPU an update written as whole-buffer ops costs one launch per op (SGD with momentum
and weight decay: six; Adam: about a dozen), each 7-10 µs from Python. Over the flat
buffers (:mod:`framework.optim.flat`) the whole rule is elementwise, so it runs as ONE
``cupy.ElementwiseKernel`` per step and dtype, in place (policies ``auto`` and ``on``:
the outputs are the flat buffers) or into new buffers (``off``), the same kernel and the
same numbers either way.

Each kernel is defined once, as its CUDA source and a NumPy reference that the CuPy
stand-in runs in its place (:func:`framework.ops.kernels.elementwise`). Both do the
per-parameter rule's operations in its order and dtype (``Optimizer._update``: the
hyperparameters cast to the parameters' dtype, one rounding per operation), and the
source is compiled with ``--fmad=false`` so that CUDA contracts no multiply and add into
one FMA: on a GPU the kernel gives the rule run op by op (CuPy's ufuncs) bit for bit.
Not NumPy's, in one case: CuPy compiles every kernel, its ufuncs included, with
``-ftz=true``, so a float32 value below 2**-126 (subnormal) is flushed to zero on the GPU
where NumPy (the CPU, and this reference on the stand-in) keeps it; float64 is not
flushed.
"""

from __future__ import annotations

import math

import numpy as np

from ..ops.kernels import Takes, each, elementwise

__all__ = ["sgd", "sgd_momentum", "adam", "sgd_amp", "sgd_momentum_amp", "adam_amp", "FUSED_DTYPES"]

# The dtypes the kernels take (CUDA's float and double); others run the rule op by op.
FUSED_DTYPES = frozenset(np.dtype(t) for t in ("float32", "float64"))

# One rounding per operation, as the reference: no FMA contraction.
_OPTIONS = ("--fmad=false",)


def _takes(*scalars):
    """The call sites: a slice of the flat buffers (1-D, contiguous), the hyperparameters
    as Python numbers."""
    return Takes(each(T=sorted(t.name for t in FUSED_DTYPES)), layouts=("contiguous",), scalars=scalars)


def _reads(*arrays):
    """Copies of the inputs a reference reads after writing an output that may be their
    buffer (the kernel reads each element before it writes it)."""
    return [np.array(a, copy=True) for a in arrays]


# --- SGD ---------------------------------------------------------------------------------------
# d = g (+ p * wd); with momentum: b = d on the first step, else b * momentum + d * damp
# (damp = 1 - dampening); d = d + b * momentum (nesterov) or b; p = p + d * nlr (nlr = -lr).


def _sgd(p, g, wd, nlr, p_out):
    p, g = _reads(p, g)
    d = g + p * wd if wd != 0 else g
    p_out[...] = p + d * nlr


sgd = elementwise(
    "T p, T g, T wd, T nlr",
    "T p_out",
    "T d = g; if (wd != (T)0) d = g + p * wd; p_out = p + d * nlr;",
    "fused_sgd",
    _sgd,
    _takes("wd", "nlr"),
    options=_OPTIONS,
)


def _sgd_momentum(p, g, b, wd, momentum, damp, nlr, first, nesterov, p_out, b_out):
    p, g, b = _reads(p, g, b)
    d = g + p * wd if wd != 0 else g
    b = d if first else b * momentum + d * damp
    d = d + b * momentum if nesterov else b
    b_out[...] = b
    p_out[...] = p + d * nlr


sgd_momentum = elementwise(
    "T p, T g, T b, T wd, T momentum, T damp, T nlr, int32 first, int32 nesterov",
    "T p_out, T b_out",
    "T d = g; if (wd != (T)0) d = g + p * wd;"
    " T bv = first ? d : b * momentum + d * damp;"
    " d = nesterov ? d + bv * momentum : bv;"
    " b_out = bv; p_out = p + d * nlr;",
    "fused_sgd_momentum",
    _sgd_momentum,
    _takes("wd", "momentum", "damp", "nlr", "first", "nesterov"),
    options=_OPTIONS,
)


# --- Adam and AdamW ------------------------------------------------------------------------------
# p = p * decay (AdamW; decay = 1 - lr * wd), or g = g + p * wd (Adam's L2 term, wd != 0);
# m = m * beta1 + g * (1 - beta1); v = v * beta2 + (g * g) * (1 - beta2);
# p = p + (m / (sqrt(v) / sqrt_bc2 + eps)) * nstep (nstep = -lr / (1 - beta1**t)).


def _adam(p, g, m, v, decay, wd, beta1, c1, beta2, c2, sqrt_bc2, eps, nstep, decoupled, p_out, m_out, v_out):
    p, g, m, v = _reads(p, g, m, v)
    if decoupled:
        p = p * decay
    elif wd != 0:
        g = g + p * wd
    m = m * beta1 + g * c1
    v = v * beta2 + (g * g) * c2
    m_out[...] = m
    v_out[...] = v
    p_out[...] = p + (m / (np.sqrt(v) / sqrt_bc2 + eps)) * nstep


adam = elementwise(
    "T p, T g, T m, T v, T decay, T wd, T beta1, T c1, T beta2, T c2, T sqrt_bc2, T eps, T nstep, int32 decoupled",
    "T p_out, T m_out, T v_out",
    "T pv = p, gv = g;"
    " if (decoupled) pv = pv * decay; else if (wd != (T)0) gv = gv + pv * wd;"
    " T mv = m * beta1 + gv * c1;"
    " T vv = v * beta2 + (gv * gv) * c2;"
    " m_out = mv; v_out = vv;"
    " p_out = pv + (mv / (sqrt(vv) / sqrt_bc2 + eps)) * nstep;",
    "fused_adam",
    _adam,
    _takes("decay", "wd", "beta1", "c1", "beta2", "c2", "sqrt_bc2", "eps", "nstep", "decoupled"),
    options=_OPTIONS,
)


# --- the same rules under GradScaler's device flag ------------------------------------------------
# ``found_inf`` (a one-element float32 array, :mod:`framework.amp`) set: nothing is updated (a skipped
# first momentum step leaves a zero buffer, which the next step's ``b * momentum + d`` turns
# into d exactly when dampening is 0; SGD asks for a host read otherwise). Adam's bias
# corrections come from its step count less the steps the flag skipped (``skipped``, a
# one-element float64 array), computed as the host computes them, in double.

_SKIP = "if (found_inf[0] != 0.0f) { %s } else { %s }"


def _amp_takes(*scalars, raw=("found_inf",)):
    return Takes(
        each(T=sorted(t.name for t in FUSED_DTYPES)),
        layouts=("contiguous",),
        scalars=scalars,
        raw={name: 1 for name in raw},
    )


def _sgd_amp(p, g, wd, nlr, found_inf, p_out):
    if found_inf[0]:
        p_out[...] = p
    else:
        _sgd(p, g, wd, nlr, p_out)


sgd_amp = elementwise(
    "T p, T g, T wd, T nlr, raw float32 found_inf",
    "T p_out",
    _SKIP % ("p_out = p;", "T d = g; if (wd != (T)0) d = g + p * wd; p_out = p + d * nlr;"),
    "fused_sgd_amp",
    _sgd_amp,
    _amp_takes("wd", "nlr"),
    options=_OPTIONS,
)


def _sgd_momentum_amp(p, g, b, wd, momentum, damp, nlr, first, nesterov, found_inf, p_out, b_out):
    if found_inf[0]:
        p_out[...] = p
        b_out[...] = 0 if first else b
    else:
        _sgd_momentum(p, g, b, wd, momentum, damp, nlr, first, nesterov, p_out, b_out)


sgd_momentum_amp = elementwise(
    "T p, T g, T b, T wd, T momentum, T damp, T nlr, int32 first, int32 nesterov, raw float32 found_inf",
    "T p_out, T b_out",
    _SKIP
    % (
        "p_out = p; b_out = first ? (T)0 : b;",
        "T d = g; if (wd != (T)0) d = g + p * wd;"
        " T bv = first ? d : b * momentum + d * damp;"
        " d = nesterov ? d + bv * momentum : bv;"
        " b_out = bv; p_out = p + d * nlr;",
    ),
    "fused_sgd_momentum_amp",
    _sgd_momentum_amp,
    _amp_takes("wd", "momentum", "damp", "nlr", "first", "nesterov"),
    options=_OPTIONS,
)


def adam_corrections(lr, beta1, beta2, step):
    """``(sqrt(1 - beta2**t), -lr / (1 - beta1**t))``: Adam's bias corrections at step ``t``, in double."""
    return math.sqrt(1 - beta2**step), -(lr / (1 - beta1**step))


def _adam_amp(p, g, m, v, decay, wd, beta1, c1, beta2, c2, eps, decoupled, lr, b1, b2, t, skipped, found_inf, *outs):
    p_out, m_out, v_out = outs
    if found_inf[0]:
        p_out[...], m_out[...], v_out[...] = p, m, v
        return
    sqrt_bc2, nstep = adam_corrections(lr, b1, b2, t - float(skipped[0]))
    t_ = p.dtype.type
    _adam(p, g, m, v, decay, wd, beta1, c1, beta2, c2, t_(sqrt_bc2), eps, t_(nstep), decoupled, *outs)


adam_amp = elementwise(
    "T p, T g, T m, T v, T decay, T wd, T beta1, T c1, T beta2, T c2, T eps, int32 decoupled,"
    " float64 lr, float64 b1, float64 b2, float64 t, raw float64 skipped, raw float32 found_inf",
    "T p_out, T m_out, T v_out",
    _SKIP
    % (
        "p_out = p; m_out = m; v_out = v;",
        "double te = t - skipped[0];"
        " T sqrt_bc2 = (T)sqrt(1.0 - pow(b2, te)); T nstep = (T)(-(lr / (1.0 - pow(b1, te))));"
        " T pv = p, gv = g;"
        " if (decoupled) pv = pv * decay; else if (wd != (T)0) gv = gv + pv * wd;"
        " T mv = m * beta1 + gv * c1;"
        " T vv = v * beta2 + (gv * gv) * c2;"
        " m_out = mv; v_out = vv;"
        " p_out = pv + (mv / (sqrt(vv) / sqrt_bc2 + eps)) * nstep;",
    ),
    "fused_adam_amp",
    _adam_amp,
    _amp_takes(
        "decay",
        "wd",
        "beta1",
        "c1",
        "beta2",
        "c2",
        "eps",
        "decoupled",
        "lr",
        "b1",
        "b2",
        "t",
        raw=("skipped", "found_inf"),
    ),
    options=_OPTIONS,
)
