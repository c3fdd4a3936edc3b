"""Testing helpers: finite-difference gradient checks and closeness asserts.

``gradcheck`` compares the gradients autograd computes with central differences in
float64, the check every op in this project passes (see tests/framework/ops).

:mod:`framework.testing.cupy_standin` is a strict CuPy stand-in on the CPU: with
``INPLACE_LAB_CUPY=standin`` the backend loads it in place of CuPy, so GPU code paths
(yours too) run and are checked without a GPU.
"""

from __future__ import annotations

import numpy as np

from .. import backend
from ..autograd.engine import grad as autograd_grad
from ..autograd.grad_mode import no_grad
from ..tensor import Tensor, _wrap


def to_numpy(x) -> np.ndarray:
    """NumPy values of a tensor, an array or a scalar."""
    if isinstance(x, Tensor):
        return backend.to_numpy(x._data)
    return np.asarray(backend.to_numpy(x) if hasattr(x, "get") else x)


def assert_close(actual, expected, rtol: float = 1e-5, atol: float = 1e-6, msg: str = "") -> None:
    """Asserts two tensors/arrays have the same shape and close values (NaNs must match)."""
    a, e = to_numpy(actual), to_numpy(expected)
    if a.shape != e.shape:
        raise AssertionError(f"{msg} shape mismatch: {a.shape} vs {e.shape}")
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, equal_nan=True, err_msg=msg)


def numerical_grads(fn, inputs, weights, eps: float = 1e-6):
    """Central differences of ``sum(fn(*inputs) * weights)`` w.r.t. each float input."""

    def loss():
        with no_grad():
            out = fn(*[x.clone() if isinstance(x, Tensor) else x for x in inputs])
        return float((to_numpy(out).astype(np.float64) * weights).sum())

    grads = []
    for x in inputs:
        if not (isinstance(x, Tensor) and x.requires_grad):
            grads.append(None)
            continue
        data = x._data
        g = np.zeros(data.shape, dtype=np.float64)
        flat = g.reshape(-1)
        for i, idx in enumerate(np.ndindex(*data.shape)):
            old = data[idx].item()
            data[idx] = old + eps
            up = loss()
            data[idx] = old - eps
            down = loss()
            data[idx] = old
            flat[i] = (up - down) / (2 * eps)
        grads.append(g)
    return grads


def gradcheck(
    fn,
    inputs,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    seed: int = 0,
    fast_mode: bool = False,
    directions: int = 4,
) -> bool:
    """Checks autograd's gradients of ``fn`` against central differences.

    Args:
        fn: maps the inputs to one tensor. It may mutate intermediate tensors, but not
            its inputs (pass ``lambda x: x.clone().exp_()`` to check an inplace op).
        inputs: tensors (float64 ones with ``requires_grad`` are checked) and other args.
        fast_mode: instead of one difference per element, compare the derivative along
            ``directions`` random directions per input with ``<gradient, direction>``
            (PyTorch's fast mode): two evaluations of ``fn`` per direction, so large
            inputs (a conv's weights) stay cheap, and any wrong gradient component shows
            with probability 1.

    Raises:
        AssertionError naming the input and the worst element when they disagree.
    """
    for x in inputs:
        if isinstance(x, Tensor) and x.requires_grad and x.dtype != np.float64:
            raise ValueError(f"gradcheck needs float64 inputs for accurate differences, got {x.dtype}")
    out = fn(*inputs)
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal(out.shape)
    w = _wrap(backend.to_device(weights.astype(out.dtype), out.device))
    loss = (out * w).sum()
    wanted = [x for x in inputs if isinstance(x, Tensor) and x.requires_grad]
    analytic = autograd_grad(loss, wanted, allow_unused=True)
    if fast_mode:
        for k, (x, a) in enumerate(zip(wanted, analytic)):
            a = np.zeros(x.shape) if a is None else to_numpy(a)
            for _ in range(directions):
                v = rng.standard_normal(x.shape)
                num = _directional(fn, inputs, weights, x, v, eps)
                ana = float((a * v).sum())
                if not np.isclose(ana, num, atol=atol * np.abs(v).sum() ** 0.5, rtol=rtol):
                    raise AssertionError(
                        f"gradient of input {k} (shape {x.shape}) differs from finite differences along "
                        f"a random direction: autograd gives {ana!r}, numerical {num!r}"
                    )
        return True
    numeric = [g for g in numerical_grads(fn, inputs, weights, eps) if g is not None]
    for k, (a, n) in enumerate(zip(analytic, numeric)):
        a = np.zeros_like(n) if a is None else to_numpy(a)
        if not np.allclose(a, n, atol=atol, rtol=rtol):
            worst = np.unravel_index(np.argmax(np.abs(a - n)), n.shape) if n.size else ()
            raise AssertionError(
                f"gradient of input {k} (shape {n.shape}) differs from finite differences: "
                f"at {worst} autograd gives {a[worst]!r}, numerical {n[worst]!r}\n"
                f"autograd:\n{a}\nnumerical:\n{n}"
            )
    return True


def _directional(fn, inputs, weights, x, v, eps) -> float:
    """Central difference of ``sum(fn(*inputs) * weights)`` along ``v`` for input ``x``."""

    def loss():
        with no_grad():
            out = fn(*[t.clone() if isinstance(t, Tensor) else t for t in inputs])
        return float((to_numpy(out).astype(np.float64) * weights).sum())

    data = x._data
    old = data.copy()
    step = backend.to_device(v * eps, x.device) if x.device.type != "cpu" else v * eps
    data += step
    up = loss()
    data[...] = old
    data -= step
    down = loss()
    data[...] = old
    return (up - down) / (2 * eps)
