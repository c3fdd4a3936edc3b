"""Shared helpers of the compile tests: tiny models, batches, and bitwise state comparison."""

from __future__ import annotations

import numpy as np

import framework as fw
import framework.nn.functional as F
from models.convnet import ConvNet
from models.mlp import MLP
from models.resnet import ResNet

SHAPES = {"mlp": (8, 64), "convnet": (6, 1, 8, 8), "resnet": (3, 3, 8, 8)}


def make_model(kind: str, norm=None, seed: int = 0):
    fw.manual_seed(seed)
    if kind == "mlp":
        return MLP(in_features=64, num_classes=10, hidden=(16, 16), dropout=0.1, norm=norm)
    if kind == "convnet":
        return ConvNet(in_channels=1, num_classes=10, channels=(4, 6), image_size=8, norm=norm or "bn")
    return ResNet(depth=20, width=4, in_channels=3, norm=norm or "bn")  # ResNet-20, tiny width


def batches(kind: str, n: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    shape = SHAPES[kind]
    return [
        (fw.from_numpy(rng.standard_normal(shape).astype(np.float32)), fw.from_numpy(rng.integers(0, 10, shape[0])))
        for _ in range(n)
    ]


def train_step(model, opt):
    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def snapshot(model, opt) -> list[np.ndarray]:
    """Parameters, gradients, buffers (running statistics) and optimizer state, as copies."""
    out = [p.detach().cpu().numpy().copy() for p in model.parameters()]
    out += [p.grad.cpu().numpy().copy() for p in model.parameters() if p.grad is not None]
    out += [b.cpu().numpy().copy() for b in model.buffers()]
    for st in opt.state.values():
        for k in sorted(st):
            v = st[k]
            out.append(v.cpu().numpy().copy() if isinstance(v, fw.Tensor) else np.asarray(v))
    return out


def run(kind, policy, compiled, steps, norm=None, optimizer="sgd", device="cpu", **compile_kw):
    """Trains ``steps`` steps on ``device``; returns (losses, snapshots after each step, the
    step callable)."""
    fw.inplace.set_policy(policy)
    model = make_model(kind, norm).to(device)
    if optimizer == "sgd":
        opt = fw.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    else:
        opt = fw.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-4)
    step = train_step(model, opt)
    f = fw.compile(step, **compile_kw) if compiled else step
    losses, states = [], []
    for x, y in batches(kind, steps):
        losses.append(f(x.to(device), y.to(device)).detach().cpu().numpy().copy())
        states.append(snapshot(model, opt))
    return losses, states, f


def bitwise_equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in zip(a, b)
    )
