"""SGD with momentum, dampening, Nesterov momentum and L2 weight decay (PyTorch's rule)."""

from __future__ import annotations

from .. import memory
from ..backend import get_array_module
from ..tensor import _wrap
from . import kernels as K
from .optimizer import Optimizer, _fused_out, _Updater, required


class SGD(Optimizer):
    """Stochastic gradient descent, exactly ``torch.optim.SGD``'s update::

        g = grad + weight_decay * p
        buf = g                                   (first step)
        buf = momentum * buf + (1 - dampening) * g  (later steps)
        g = g + momentum * buf  if nesterov  else  buf       (when momentum != 0)
        p = p - lr * g

    Parameters and the momentum buffer are updated in place under the inplace policy
    ``on`` and rebound to new storage under ``off`` (see :mod:`framework.optim.optimizer`).
    On a GPU the flat buffers' update is one fused kernel per dtype
    (:data:`framework.optim.kernels.sgd` / ``sgd_momentum``).

    Raises:
        ValueError: for a negative lr, momentum or weight decay, and for ``nesterov``
            without momentum or with dampening.
    """

    def __init__(
        self,
        params,
        lr=required,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
    ):
        if lr is not required and lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults)

    def _check_group(self, group: dict) -> None:
        if group["lr"] < 0.0:
            raise ValueError(f"Invalid learning rate: {group['lr']}")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def _update(self, p, grad, state, group, u: _Updater):
        lr, momentum, dampening = group["lr"], group["momentum"], group["dampening"]
        weight_decay, nesterov = group["weight_decay"], group["nesterov"]
        d_p = grad if weight_decay == 0 else grad.add(p, alpha=weight_decay)
        if momentum != 0:
            buf = state.get("momentum_buffer")
            if buf is None:
                with memory.category("optimizer_state"):
                    buf = d_p.clone()
            else:
                buf = u.add(u.mul(buf, momentum), d_p, alpha=1 - dampening)
            self._set_state(state, "momentum_buffer", buf)
            d_p = d_p.add(buf, alpha=momentum) if nesterov else buf
        return u.add(p, d_p, alpha=-lr)

    def _fused_takes_flag(self, group, fg) -> bool:
        # A skipped first momentum step leaves a zero buffer: exact for the next step only
        # without dampening (b * momentum + d * 1 = d), so with dampening the flag is read
        # on the host until every buffer exists.
        if group["momentum"] == 0 or group["dampening"] == 0:
            return True
        return all((self.state.get(p) or {}).get("momentum_buffer") is not None for p in fg.params)

    def _update_fused(self, p, grad, state, group, inplace):
        lr, momentum, dampening = group["lr"], group["momentum"], group["dampening"]
        weight_decay, nesterov = group["weight_decay"], group["nesterov"]
        pa = p._data
        p_out = _fused_out(pa, inplace, "parameters")
        amp = self._amp  # GradScaler's flag on the device (see Optimizer._flat_step), or None
        self._amp_used = amp is not None
        if momentum == 0:
            if amp is None:
                K.sgd(pa, grad._data, weight_decay, -lr, p_out)
            else:
                K.sgd_amp(pa, grad._data, weight_decay, -lr, amp[0], p_out)
        else:
            buf = state.get("momentum_buffer")
            first = buf is None  # the kernel makes the buffer (b = d): b_in's values go unused
            b_in = memory.empty(pa.shape, pa.dtype, get_array_module(pa), "optimizer_state") if first else buf._data
            b_out = b_in if first else _fused_out(b_in, inplace, "optimizer_state")
            damp, flags = 1 - dampening, (int(first), int(nesterov))
            if amp is None:
                K.sgd_momentum(pa, grad._data, b_in, weight_decay, momentum, damp, -lr, *flags, p_out, b_out)
            else:
                K.sgd_momentum_amp(
                    pa, grad._data, b_in, weight_decay, momentum, damp, -lr, *flags, amp[0], p_out, b_out
                )
            self._set_state(state, "momentum_buffer", buf if buf is not None and b_out is buf._data else _wrap(b_out))
        return p if p_out is pa else _wrap(p_out)
