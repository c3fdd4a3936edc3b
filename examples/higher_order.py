"""Higher-order gradients: three programs that differentiate a gradient.

- :func:`gradient_penalty`: WGAN-GP's penalty ``lam * (||d critic(x_hat) / d x_hat|| - 1)^2``
  on a small conv critic; its gradient w.r.t. the critic's weights goes through the
  backward of conv2d, leaky_relu, avg_pool2d and linear.
- :func:`hessian_vector_product`: ``H v`` of a loss without forming ``H`` (Pearlmutter):
  the gradient of ``<grad(loss), v>``.
- :func:`bn_gradient_norm_step`: ``create_graph=True`` through a model with BatchNorm in
  training mode, then the gradient of the gradient's squared norm (a double-backprop
  regularizer); the batch statistics' dependence on the input is differentiated too.

Each takes its weights as a dict of leaf tensors, so the same numbers can be checked
against PyTorch (tests/examples/test_higher_order.py). Run ``python -m
examples.higher_order`` to print them.
"""

from __future__ import annotations

import numpy as np

import framework as fw
import framework.nn.functional as F


def critic_weights(seed: int = 0, dtype=np.float64) -> dict:
    """A small conv critic: conv 3x3 (2 -> 4 channels), leaky ReLU, 2x2 average pool, linear."""
    rng = np.random.default_rng(seed)
    shapes = {"conv_w": (4, 2, 3, 3), "conv_b": (4,), "lin_w": (1, 4 * 3 * 3), "lin_b": (1,)}
    return {k: fw.tensor(rng.standard_normal(s) * 0.3, dtype=dtype, requires_grad=True) for k, s in shapes.items()}


def critic(w: dict, x):
    h = F.conv2d(x, w["conv_w"], w["conv_b"], padding=1)
    h = F.leaky_relu(h, 0.2)
    h = F.avg_pool2d(h, 2)
    return F.linear(h.flatten(1), w["lin_w"], w["lin_b"])


def gradient_penalty(w: dict, real, fake, eps, lam: float = 10.0):
    """WGAN-GP's penalty at ``x_hat = eps * real + (1 - eps) * fake``; returns the penalty
    (a scalar with history: ``.backward()`` reaches the critic's weights)."""
    x_hat = (eps * real + (1 - eps) * fake).detach().requires_grad_()
    score = critic(w, x_hat)
    (g,) = fw.autograd.grad(score.sum(), x_hat, create_graph=True)
    norm = (g * g).sum((1, 2, 3)).sqrt()
    return lam * ((norm - 1) ** 2).mean()


def mlp_loss(w: dict, x, target):
    h = F.linear(x, w["w1"], w["b1"]).tanh()
    return F.cross_entropy(F.linear(h, w["w2"], w["b2"]), target)


def hessian_vector_product(loss_fn, params: list, vectors: list) -> tuple:
    """``H v`` for the Hessian ``H`` of ``loss_fn()`` w.r.t. ``params``: the gradient of
    ``<grad(loss), v>``, two backward passes, no ``H`` formed."""
    grads = fw.autograd.grad(loss_fn(), params, create_graph=True)
    dot = sum((g * v).sum() for g, v in zip(grads, vectors))
    return fw.autograd.grad(dot, params)


def bn_weights(seed: int = 1, dtype=np.float64) -> dict:
    rng = np.random.default_rng(seed)
    shapes = {"conv_w": (3, 2, 3, 3), "bn_w": (3,), "bn_b": (3,), "lin_w": (2, 3 * 4 * 4), "lin_b": (2,)}
    return {k: fw.tensor(rng.standard_normal(s) * 0.5, dtype=dtype, requires_grad=True) for k, s in shapes.items()}


def bn_model(w: dict, x, running_mean=None, running_var=None, training=True):
    h = F.conv2d(x, w["conv_w"], None, padding=1)
    h = F.batch_norm(h, running_mean, running_var, w["bn_w"], w["bn_b"], training=training)
    h = F.relu(h)
    return F.linear(h.flatten(1), w["lin_w"], w["lin_b"])


def bn_gradient_norm_step(w: dict, x, target, beta: float = 0.1, training: bool = True):
    """``loss + beta * ||d loss / d weights||^2`` with the gradient taken with
    ``create_graph=True`` through BatchNorm; backward accumulates the weights' ``.grad``."""
    c = w["bn_w"].shape[0]
    mean, var = fw.zeros(c, dtype=x.dtype), fw.ones(c, dtype=x.dtype)
    loss = F.cross_entropy(bn_model(w, x, mean, var, training), target)
    params = list(w.values())
    grads = fw.autograd.grad(loss, params, create_graph=True)
    total = loss + beta * sum((g * g).sum() for g in grads)
    total.backward()
    return total


def main() -> None:
    rng = np.random.default_rng(0)
    w = critic_weights()
    real, fake = (fw.tensor(rng.standard_normal((3, 2, 6, 6))) for _ in range(2))
    eps = fw.tensor(rng.uniform(size=(3, 1, 1, 1)))
    gp = gradient_penalty(w, real, fake, eps)
    gp.backward()
    print(f"gradient penalty {gp.item():.6f}; |d/d conv_w| = {float((w['conv_w'].grad ** 2).sum().sqrt()):.6f}")

    m = {
        k: fw.tensor(rng.standard_normal(s), requires_grad=True)
        for k, s in {"w1": (5, 4), "b1": (5,), "w2": (3, 5), "b2": (3,)}.items()
    }
    x, t = fw.tensor(rng.standard_normal((6, 4))), fw.tensor(rng.integers(0, 3, 6))
    vs = [fw.tensor(rng.standard_normal(p.shape)) for p in m.values()]
    hv = hessian_vector_product(lambda: mlp_loss(m, x, t), list(m.values()), vs)
    print("Hessian-vector product, first entries:", [round(float(h.detach().numpy().ravel()[0]), 6) for h in hv])

    b = bn_weights()
    xb, tb = fw.tensor(rng.standard_normal((4, 2, 4, 4))), fw.tensor(rng.integers(0, 2, 4))
    total = bn_gradient_norm_step(b, xb, tb)
    print(f"loss + 0.1 |grad|^2 through BatchNorm: {total.item():.6f}")


if __name__ == "__main__":
    main()
