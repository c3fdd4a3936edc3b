"""Where an MLP training step spends its time here and in PyTorch: the step split into its
parts, and its matrix products alone on each side's BLAS.

The model and step are bench_vs_pytorch's ``mlp`` (3072-1024-1024-10, ReLU, batch 64, SGD
momentum 0.9, cross entropy, one thread). Timed per step, in rounds that alternate the
two frameworks (the noise of a shared machine hits both alike), median over rounds:

- ``step``: the whole training step;
- ``forward``: forward and loss (recording the graph, as in training);
- ``backward``: ``loss.backward()`` of a recorded forward;
- ``optimizer``: ``opt.step()`` with gradients in place;
- ``gemm``: the step's eight matrix products (three forward; two input and three weight
  gradients), each as ``a @ w.T`` on float32, with NumPy's ``matmul`` (OpenBLAS, with the
  kernel it picked) and with ``torch.mm`` (PyTorch's BLAS, MKL in its CPU build);
- ``rest``: ``step - gemm``: what is not a matrix product (elementwise ops, the loss,
  the optimizer, and each framework's per-op overhead).

Run:  OMP_NUM_THREADS=1 python -m benchmarks.bench_mlp_breakdown [--rounds 15] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import framework as fw
from framework import nn, optim
from framework.nn import functional as F

BATCH, SIZES = 64, (3072, 1024, 1024, 10)
PARTS = ("step", "forward", "backward", "optimizer", "gemm")


def _gemm_shapes(batch, sizes):
    """``(what, m, k, n)`` of the step's matrix products: ``(m, k) @ (k, n)`` each."""
    shapes = []
    for i, o in zip(sizes[:-1], sizes[1:]):
        shapes.append(("forward", batch, i, o))
        shapes.append(("weight grad", o, batch, i))
    for i, o in zip(sizes[1:-1], sizes[2:]):
        shapes.append(("input grad", batch, o, i))
    return shapes


def _gemms(lib, batch, sizes):
    """The step's products as ``a @ w.T`` (w row-major, as a Linear layer's weight) on
    NumPy (``lib="numpy"``) or PyTorch."""
    rng = np.random.default_rng(0)
    operands = []
    for _, m, k, n in _gemm_shapes(batch, sizes):
        operands.append(
            (rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32))
        )
    if lib == "numpy":
        return lambda: [np.matmul(a, w.T) for a, w in operands]
    import torch  # noqa: PLC0415

    pairs = [(torch.from_numpy(a), torch.from_numpy(w)) for a, w in operands]
    return lambda: [a.mm(w.t()) for a, w in pairs]


def _parts(lib, batch, sizes):
    """``{part: callable}`` for one framework (``fw`` or ``torch``)."""
    if lib == "fw":
        fw.manual_seed(0)
        tnn, functional, make_opt = nn, F, optim.SGD
        x = fw.randn(batch, sizes[0])
        y = fw.tensor(np.random.default_rng(0).integers(0, sizes[-1], batch))
    else:
        import torch  # noqa: PLC0415

        torch.manual_seed(0)
        tnn, functional, make_opt = torch.nn, torch.nn.functional, torch.optim.SGD
        x = torch.randn(batch, sizes[0])
        y = torch.randint(0, sizes[-1], (batch,))
    layers = []
    for i, o in zip(sizes[:-1], sizes[1:]):
        layers += [tnn.Linear(i, o), tnn.ReLU()]
    model = tnn.Sequential(*layers[:-1])
    opt = make_opt(model.parameters(), lr=0.01, momentum=0.9)
    held = {}

    def step():
        opt.zero_grad()
        functional.cross_entropy(model(x), y).backward()
        opt.step()

    def forward():
        held["loss"] = functional.cross_entropy(model(x), y)

    def backward():
        held["loss"].backward()

    return {
        "step": step,
        "forward": forward,
        "backward": (forward, backward),  # set up by forward, timed: backward
        "optimizer": opt.step,
        "gemm": _gemms("numpy" if lib == "fw" else "torch", batch, sizes),
    }


def _time(part, reps):
    if isinstance(part, tuple):  # (untimed setup, timed call)
        total = 0.0
        for _ in range(reps):
            part[0]()
            t0 = time.perf_counter()
            part[1]()
            total += time.perf_counter() - t0
        return total / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        part()
    return (time.perf_counter() - t0) / reps


def measure(rounds: int, reps: int, batch: int = BATCH, sizes=SIZES) -> dict:
    import torch  # noqa: PLC0415

    torch.set_num_threads(1)
    parts = {"ours": _parts("fw", batch, sizes), "pytorch": _parts("torch", batch, sizes)}
    for side in parts.values():  # warm up
        for p in side.values():
            _time(p, 2)
    times = {side: {p: [] for p in PARTS} for side in parts}
    for r in range(rounds):
        for p in PARTS:
            order = ("ours", "pytorch") if (r + PARTS.index(p)) % 2 == 0 else ("pytorch", "ours")
            for side in order:
                times[side][p].append(_time(parts[side][p], reps))
    out = {}
    for side, by_part in times.items():
        out[side] = {p: statistics.median(v) * 1e3 for p, v in by_part.items()}
        out[side]["rest"] = out[side]["step"] - out[side]["gemm"]
    return out


def table(result) -> str:
    rows = ["| part | ours ms | PyTorch ms | ours / PyTorch (time) |", "|---|---:|---:|---:|"]
    for p in (*PARTS, "rest"):
        a, b = result["ours"][p], result["pytorch"][p]
        rows.append(f"| {p} | {a:.2f} | {b:.2f} | {a / b:.2f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--reps", type=int, default=5, help="calls per timing")
    parser.add_argument("--quick", action="store_true", help="a small model and 2 rounds (a smoke test)")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.reps < 1:
        parser.error("--rounds and --reps must be >= 1")
    if args.quick:
        result = measure(2, 1, 8, (32, 16, 16, 4))
    else:
        result = measure(args.rounds, args.reps)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
