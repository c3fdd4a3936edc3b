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

        def loss() -> float:
            with no_grad():
                out = fn(*[t.clone() if isinstance(t, Tensor) else t for t in inputs])
            return float((to_numpy(out).astype(np.float64) * weights).sum())

        _check_directions(loss, wanted, analytic, rng, directions, eps, atol, rtol, "gradient", "finite differences")
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


def gradgradcheck(
    fn, inputs, eps: float = 1e-6, atol: float = 1e-5, rtol: float = 1e-4, seed: int = 0, directions: int = 2
) -> bool:
    """Checks second derivatives: the derivative of autograd's gradients (taken with
    ``create_graph=True``) against finite differences of the first-order gradients.

    PyTorch's ``gradgradcheck`` in fast mode: with random weights ``w`` of the output and
    random vectors ``u`` of the inputs' gradients, ``phi(x) = <grad(<fn(x), w>, x), u>``
    is differentiated by autograd (a second backward through the recorded first one) and
    compared, along ``directions`` random directions per input, with central differences
    of ``phi`` computed with first-order backwards only. Also checks that the gradients
    taken with ``create_graph`` equal the first-order ones.

    Raises:
        AssertionError naming the input when they disagree.
    """
    for x in inputs:
        if isinstance(x, Tensor) and x.requires_grad and x.dtype != np.float64:
            raise ValueError(f"gradgradcheck needs float64 inputs for accurate differences, got {x.dtype}")
    wanted = [x for x in inputs if isinstance(x, Tensor) and x.requires_grad]
    rng = np.random.default_rng(seed)
    out = fn(*inputs)
    weights = rng.standard_normal(out.shape)
    w = _wrap(backend.to_device(weights.astype(out.dtype), out.device))
    us = [rng.standard_normal(x.shape) for x in wanted]

    def first_order():
        return autograd_grad((fn(*inputs) * w).sum(), wanted, allow_unused=True)

    def phi_value() -> float:
        return float(sum((to_numpy(g) * u).sum() for g, u in zip(first_order(), us) if g is not None))

    grads = autograd_grad((out * w).sum(), wanted, create_graph=True, allow_unused=True)
    for k, (g, f) in enumerate(zip(grads, first_order())):
        if (g is None) != (f is None):
            raise AssertionError(f"input {k}: a gradient with create_graph=True and without it differ in presence")
        if g is not None and not np.allclose(to_numpy(g), to_numpy(f), rtol=1e-12, atol=1e-14):
            raise AssertionError(f"input {k}: the gradient with create_graph=True differs from the first-order one")
    phi = None
    for g, u in zip(grads, us):
        if g is not None and g.requires_grad:
            term = (g * _wrap(backend.to_device(u, g.device))).sum()
            phi = term if phi is None else phi + term
    second = [None] * len(wanted)
    if phi is not None:
        second = autograd_grad(phi, wanted, allow_unused=True)
    _check_directions(
        phi_value,
        wanted,
        second,
        rng,
        directions,
        eps,
        atol,
        rtol,
        "second derivative",
        "finite differences of the gradient",
    )
    return True


def _check_directions(value, wanted, analytic, rng, directions, eps, atol, rtol, what, against) -> None:
    """Fast mode's comparison: for each input ``x`` and ``directions`` random vectors
    ``v``, ``<analytic, v>`` against the central difference of ``value()`` along ``v``
    (an input without a gradient counts as zeros). Raises AssertionError naming the input."""
    for k, (x, a) in enumerate(zip(wanted, analytic)):
        a = np.zeros(x.shape) if a is None else to_numpy(a)
        for _ in range(directions):
            v = rng.standard_normal(x.shape)
            num = _directional_value(value, x, v, eps)
            ana = float((a * v).sum())
            if not np.isclose(ana, num, atol=atol * np.abs(v).sum() ** 0.5, rtol=rtol):
                raise AssertionError(
                    f"{what} of input {k} (shape {x.shape}) differs from {against} along a random direction: "
                    f"autograd gives {ana!r}, numerical {num!r}"
                )


def _directional_value(value, x, v, eps) -> float:
    """Central difference of ``value()`` along ``v`` for input ``x`` (changed in its buffer)."""
    data = x._data
    old = data.copy()
    step = backend.to_device(v * eps, x.device) if x.device.type != "cpu" else v * eps
    data += step
    up = value()
    data[...] = old
    data -= step
    down = value()
    data[...] = old
    return (up - down) / (2 * eps)
