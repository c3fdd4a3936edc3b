"""examples/higher_order.py against PyTorch: the same weights and data, float64, the same
numbers (the gradient penalty and its weight gradients, a Hessian-vector product, the
double-backprop step through BatchNorm in training and eval mode), with the ``torch``
fixture (tests/conftest.py: under CI=true a missing PyTorch fails). One test needs no
PyTorch: the Hessian-vector product against central differences of the gradient."""

from __future__ import annotations

import numpy as np
import pytest

import framework as fw
from examples import higher_order as ex

RTOL, ATOL = 1e-9, 1e-11


def _np(t):
    return t.detach().numpy()


def _torch_weights(torch, w):
    return {k: torch.tensor(_np(v), requires_grad=True) for k, v in w.items()}


def _data(seed=0):
    rng = np.random.default_rng(seed)
    real, fake = rng.standard_normal((3, 2, 6, 6)), rng.standard_normal((3, 2, 6, 6))
    return real, fake, rng.uniform(size=(3, 1, 1, 1))


def test_gradient_penalty_matches_pytorch(torch):
    tf = torch.nn.functional
    real, fake, eps = _data()
    w = ex.critic_weights()
    gp = ex.gradient_penalty(w, fw.tensor(real), fw.tensor(fake), fw.tensor(eps))
    gp.backward()

    tw = _torch_weights(torch, w)
    x_hat = (torch.tensor(eps) * torch.tensor(real) + (1 - torch.tensor(eps)) * torch.tensor(fake)).requires_grad_()
    h = tf.avg_pool2d(tf.leaky_relu(tf.conv2d(x_hat, tw["conv_w"], tw["conv_b"], padding=1), 0.2), 2)
    score = tf.linear(h.flatten(1), tw["lin_w"], tw["lin_b"])
    (g,) = torch.autograd.grad(score.sum(), x_hat, create_graph=True)
    want = 10.0 * ((g.pow(2).sum((1, 2, 3)).sqrt() - 1) ** 2).mean()
    want.backward()
    np.testing.assert_allclose(gp.item(), want.item(), rtol=RTOL)
    for k in ("conv_w", "lin_w"):
        np.testing.assert_allclose(_np(w[k].grad), tw[k].grad.numpy(), rtol=RTOL, atol=ATOL, err_msg=k)
    # The penalty depends on conv_b only through leaky_relu's mask: its double backward
    # sends an explicit zero there, as PyTorch's does (docs/AUTOGRAD.md); lin_b is unused
    np.testing.assert_array_equal(_np(w["conv_b"].grad), tw["conv_b"].grad.numpy())
    assert not tw["conv_b"].grad.any() and w["conv_b"].grad.dtype == np.float64
    assert w["lin_b"].grad is None and tw["lin_b"].grad is None


def _mlp(seed=2):
    rng = np.random.default_rng(seed)
    shapes = {"w1": (5, 4), "b1": (5,), "w2": (3, 5), "b2": (3,)}
    w = {k: fw.tensor(rng.standard_normal(s), requires_grad=True) for k, s in shapes.items()}
    x, t = rng.standard_normal((6, 4)), rng.integers(0, 3, 6)
    vs = [rng.standard_normal(s) for s in shapes.values()]
    return w, x, t, vs


def test_hessian_vector_product_matches_pytorch(torch):
    tf = torch.nn.functional
    w, x, t, vs = _mlp()
    hv = ex.hessian_vector_product(
        lambda: ex.mlp_loss(w, fw.tensor(x), fw.tensor(t)), list(w.values()), [fw.tensor(v) for v in vs]
    )
    tw = _torch_weights(torch, w)

    def loss(*p):
        h = tf.linear(torch.tensor(x), p[0], p[1]).tanh()
        return tf.cross_entropy(tf.linear(h, p[2], p[3]), torch.tensor(t))

    _, want = torch.autograd.functional.hvp(loss, tuple(tw.values()), tuple(torch.tensor(v) for v in vs))
    for got, exp in zip(hv, want):
        np.testing.assert_allclose(_np(got), exp.numpy(), rtol=RTOL, atol=ATOL)


def test_hessian_vector_product_is_the_derivative_of_the_gradient():
    """Without PyTorch: H v against central differences of the first-order gradient."""
    w, x, t, vs = _mlp()
    params = list(w.values())
    hv = ex.hessian_vector_product(
        lambda: ex.mlp_loss(w, fw.tensor(x), fw.tensor(t)), params, [fw.tensor(v) for v in vs]
    )
    h = 1e-6

    def grads_at(sign):
        for p, v in zip(params, vs):
            p._data += sign * h * v
        g = fw.autograd.grad(ex.mlp_loss(w, fw.tensor(x), fw.tensor(t)), params)
        for p, v in zip(params, vs):
            p._data -= sign * h * v
        return [_np(gi) for gi in g]

    up, down = grads_at(1), grads_at(-1)
    for got, a, b in zip(hv, up, down):
        np.testing.assert_allclose(_np(got), (a - b) / (2 * h), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("training", [True, False])
def test_create_graph_through_batch_norm_matches_pytorch(training, torch):
    tf = torch.nn.functional
    rng = np.random.default_rng(3)
    x, t = rng.standard_normal((4, 2, 4, 4)), rng.integers(0, 2, 4)
    w = ex.bn_weights()
    tw = _torch_weights(torch, w)
    total = ex.bn_gradient_norm_step(w, fw.tensor(x), fw.tensor(t), training=training)

    h = tf.conv2d(torch.tensor(x), tw["conv_w"], None, padding=1)
    mean, var = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    h = tf.relu(tf.batch_norm(h, mean, var, tw["bn_w"], tw["bn_b"], training=training))
    loss = tf.cross_entropy(tf.linear(h.flatten(1), tw["lin_w"], tw["lin_b"]), torch.tensor(t))
    grads = torch.autograd.grad(loss, list(tw.values()), create_graph=True)
    want = loss + 0.1 * sum((g * g).sum() for g in grads)
    want.backward()
    np.testing.assert_allclose(total.item(), want.item(), rtol=RTOL)
    for k in w:
        np.testing.assert_allclose(_np(w[k].grad), tw[k].grad.numpy(), rtol=1e-8, atol=1e-10, err_msg=k)


def test_the_example_runs(capsys):
    ex.main()
    out = capsys.readouterr().out
    assert "gradient penalty" in out and "Hessian-vector product" in out and "BatchNorm" in out
