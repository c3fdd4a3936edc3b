"""Time and memory of BatchNorm + activation, out of place, with an inplace activation, and
fused as InPlace-ABN, forward + backward on one (128, 64, 16, 16) float32 batch.

Variants (each on ``h = x * 1``, a stand-in for a conv output that saves nothing itself):

- ``BN + ReLU``: ``relu(batch_norm(h))``
- ``BN + ReLU_``: ``batch_norm(h).relu_()`` (inplace activation)
- ``BN + LeakyReLU``: ``leaky_relu(batch_norm(h))``
- ``BN + LeakyReLU_``: ``batch_norm(h).leaky_relu_()`` (inplace activation)
- ``InPlace-ABN``: ``inplace_abn(h)`` (BN + leaky ReLU written over h)

Measured with the framework's counter (:mod:`framework.memory`), per variant:

- saved: ``memory.saved_bytes()`` at the forward/backward boundary, minus before forward;
- peak: ``max_allocated_bytes()`` over forward + backward above the bytes allocated before
  the forward (x, the upstream gradient, parameters and running statistics), with
  ``x.grad`` / parameter grads reset each run so every run allocates them alike;
- forward and backward time: median over the timed runs (after one warmup), the
  variants interleaved round by round so machine noise hits them alike.

Run:  python benchmarks/bench_norm.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import framework as fw  # noqa: E402
from benchmarks import common  # noqa: E402
from framework import memory  # noqa: E402
from framework.ops.norm import batch_norm, inplace_abn  # noqa: E402

MB = 2**20
SHAPE = (128, 64, 16, 16)
QUICK_SHAPE = (32, 64, 16, 16)


def _variants(rm, rv, w, b):
    def bn(h):
        return batch_norm(h, rm, rv, w, b, training=True)

    return {
        "BN + ReLU": lambda h: fw.relu(bn(h)),
        "BN + ReLU_": lambda h: bn(h).relu_(),
        "BN + LeakyReLU": lambda h: fw.leaky_relu(bn(h), 0.01),
        "BN + LeakyReLU_": lambda h: bn(h).leaky_relu_(0.01),
        "InPlace-ABN": lambda h: inplace_abn(h, rm, rv, w, b, training=True, negative_slope=0.01),
    }


def run_once(fn, x, g, params):
    """One forward + backward; returns (forward s, backward s, saved bytes, peak bytes)."""
    x.grad = None
    for p in params:
        p.grad = None
    gc.collect()
    base_saved = memory.saved_bytes()
    base = memory.allocated_bytes()
    memory.reset_peak()
    t0 = time.perf_counter()
    out = fn(x * 1)
    t1 = time.perf_counter()
    saved = memory.saved_bytes() - base_saved
    out.backward(g)
    t2 = time.perf_counter()
    peak = memory.max_allocated_bytes() - base
    del out
    return t1 - t0, t2 - t1, saved, peak


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 32 instead of 128, 3 timed runs (CI smoke)")
    ap.add_argument("--reps", type=int, default=None, help="timed runs per variant (default 10, --quick 3)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    shape = QUICK_SHAPE if args.quick else SHAPE
    reps = args.reps or (3 if args.quick else 10)

    fw.manual_seed(0)
    c = shape[1]
    x = fw.randn(*shape, requires_grad=True)
    g = fw.randn(*shape)
    w, b = fw.ones(c, requires_grad=True), fw.zeros(c, requires_grad=True)
    rm, rv = fw.zeros(c), fw.ones(c)
    variants = _variants(rm, rv, w, b)
    act = x.nbytes

    samples = {name: [] for name in variants}
    for fn in variants.values():  # warmup
        run_once(fn, x, g, (w, b))
    for _ in range(reps):
        for name, fn in variants.items():
            samples[name].append(run_once(fn, x, g, (w, b)))

    rows = []
    for name, runs in samples.items():
        fwd = statistics.median(r[0] for r in runs) * 1e3
        bwd = statistics.median(r[1] for r in runs) * 1e3
        saved = max(r[2] for r in runs)
        peak = max(r[3] for r in runs)
        rows.append(
            dict(
                variant=name,
                forward_ms=fwd,
                backward_ms=bwd,
                total_ms=fwd + bwd,
                saved_bytes=saved,
                saved_activations=saved / act,
                peak_bytes=peak,
                peak_activations=peak / act,
            )
        )

    ref = rows[0]
    print(
        f"BatchNorm + activation, input {shape} float32 (one activation = {act / MB:.2f} MiB), "
        f"forward + backward, CPU/NumPy {np.__version__}, median of {reps} runs\n"
    )
    print("| variant | saved for backward | peak above inputs | forward ms | backward ms | total ms | vs BN + ReLU |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['saved_bytes'] / MB:.2f} MiB ({r['saved_activations']:.2f} act) "
            f"| {r['peak_bytes'] / MB:.2f} MiB ({r['peak_activations']:.2f} act) "
            f"| {r['forward_ms']:.1f} | {r['backward_ms']:.1f} | {r['total_ms']:.1f} "
            f"| {r['total_ms'] / ref['total_ms']:.2f}x |"
        )
    print(
        common.legend(
            [
                ("saved for backward", "MiB autograd keeps for backward; act: in activations of the input's size"),
                ("peak above inputs", "highest live MiB in forward + backward above what was live before it"),
                ("forward ms, backward ms, total ms", "medians of the runs"),
                ("vs BN + ReLU", "total ms over the first row's (BatchNorm then ReLU, out of place)"),
            ]
        )
    )
    if args.json:
        meta = dict(
            shape=list(shape),
            dtype="float32",
            reps=reps,
            activation_bytes=act,
            numpy=np.__version__,
            python=platform.python_version(),
            machine=platform.machine(),
            processor=platform.processor(),
            cpu_count=os.cpu_count(),
        )
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=rows), f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
