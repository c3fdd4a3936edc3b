"""Adam and AdamW with bias correction (PyTorch's formulas)."""

from __future__ import annotations

import math

import numpy as np

from .. import creation, memory
from ..tensor import _wrap
from . import kernels as K
from .optimizer import Optimizer, _fused_out, _Updater


class Adam(Optimizer):
    """Adam (Kingma & Ba), exactly ``torch.optim.Adam``'s update (``amsgrad=False``)::

        t += 1
        g = grad + weight_decay * p                  (L2 penalty; AdamW decays p instead)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    ``m`` (``exp_avg``) and ``v`` (``exp_avg_sq``) start at zero, allocated as
    ``optimizer_state``; ``step`` is a Python int. Parameters and state are updated in
    place under the inplace policy ``on`` and rebound under ``off``. On a GPU the flat
    buffers' update is one fused kernel per dtype (:data:`framework.optim.kernels.adam`).
    """

    _decoupled = False

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0):
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    @staticmethod
    def _next_step(p, state) -> int:
        """The step count after this step; the first step makes the zero moments."""
        if not state:
            state["step"] = 0
            with memory.category("optimizer_state"):
                state["exp_avg"] = creation.zeros_like(p)
                state["exp_avg_sq"] = creation.zeros_like(p)
        state["step"] += 1
        return state["step"]

    def _update(self, p, grad, state, group, u: _Updater):
        lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        step = self._next_step(p, state)

        if self._decoupled:
            p = u.mul(p, 1 - lr * weight_decay)
        elif weight_decay != 0:
            grad = grad.add(p, alpha=weight_decay)

        exp_avg = u.add(u.mul(state["exp_avg"], beta1), grad, alpha=1 - beta1)
        exp_avg_sq = u.add(u.mul(state["exp_avg_sq"], beta2), grad * grad, alpha=1 - beta2)
        self._set_state(state, "exp_avg", exp_avg)
        self._set_state(state, "exp_avg_sq", exp_avg_sq)

        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        denom = u.add(u.div(exp_avg_sq.sqrt(), _sqrt(bias_correction2)), eps)
        return u.add(p, exp_avg / denom, alpha=-step_size)

    def _fused_takes_flag(self, group, fg) -> bool:
        return True  # the kernel skips, and the skipped steps are subtracted from the count

    def _update_fused(self, p, grad, state, group, inplace):
        lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        step = self._next_step(p, state)
        pa, m, v = p._data, state["exp_avg"], state["exp_avg_sq"]
        p_out = _fused_out(pa, inplace, "parameters")
        m_out = _fused_out(m._data, inplace, "optimizer_state")
        v_out = _fused_out(v._data, inplace, "optimizer_state")
        amp = self._amp  # GradScaler's flag on the device (see Optimizer._flat_step), or None
        self._amp_used = amp is not None
        rule = (1 - lr * weight_decay, weight_decay, beta1, 1 - beta1, beta2, 1 - beta2)
        if amp is None:
            sqrt_bc2, nstep = K.adam_corrections(lr, beta1, beta2, step)
            K.adam(
                pa, grad._data, m._data, v._data, *rule, sqrt_bc2, eps, nstep, int(self._decoupled), p_out, m_out, v_out
            )
        else:  # the corrections in the kernel, from the step count less the steps the flag skipped
            counts = (lr, beta1, beta2, float(step), amp[1], amp[0])
            K.adam_amp(pa, grad._data, m._data, v._data, *rule, eps, int(self._decoupled), *counts, p_out, m_out, v_out)
        self._set_state(state, "exp_avg", m if m_out is m._data else _wrap(m_out))
        self._set_state(state, "exp_avg_sq", v if v_out is v._data else _wrap(v_out))
        return p if p_out is pa else _wrap(p_out)


def _sqrt(x):
    """``math.sqrt(x)``; a traced number (framework.compile) keeps it symbolic, so that a
    compiled step recomputes it from the step counter at every call."""
    return math.sqrt(x) if isinstance(x, (int, float, np.generic)) else x.sqrt()


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter), ``torch.optim.AdamW``::

    p = p * (1 - lr * weight_decay), then the Adam update without the L2 term.
    """

    _decoupled = True

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
