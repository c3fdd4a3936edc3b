"""This framework against PyTorch on the CPU, same model code, one thread each.

The three workloads of the speed targets, each a training step timed in rounds that
alternate between the two frameworks (so noise on this shared machine hits both alike);
the ratio is taken round by round and its median reported with the spread:

- ``mlp``: MLP 3072-1024-1024-10 with ReLU, SGD momentum 0.9, batch 64, cross entropy;
- ``resnet20``: CIFAR ResNet-20 (width 16, option-A shortcuts), SGD momentum 0.9,
  batch 64 (the PyTorch twin is ``bench_models.torch_model``);
- ``resnet20_eval``: the same model's evaluation: a forward in eval mode under
  ``no_grad``, batch ``--eval-batch`` (500, configs/resnet20_cifar10.yaml's);
- ``tiny``: a chain of 200 tiny ops on 10 floats (mul by a scalar, add, tanh, mul,
  sub a scalar) then ``sum().backward()``: the per-op cost of each framework.

Our side runs under the default inplace policy (``auto``) unless ``--policy`` says
otherwise, and with conv2d's default choice of algorithms (``auto``) unless ``--conv fast``
(Winograd F(4x4, 3x3), faster, with 3-6x the float32 rounding; see
``framework/ops/conv_algorithms/choice.py``). Needs ``pip install torch==2.13.0``.

``--rss`` also measures the peak resident memory a ResNet-20 training process adds once
its model and batch exist (the kernel's high-water mark over 5 steps minus the resident
memory before the first; Linux), each framework in processes of its own, alternating.

Run:  OMP_NUM_THREADS=1 python -m benchmarks.bench_vs_pytorch [--repeats 9] [--quick] [--json PATH]
          [--only mlp resnet20 resnet20_eval tiny] [--eval-batch 500] [--rss]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common
else:
    from . import common

import framework as fw
from framework import nn, optim
from framework.nn import functional as F
from framework.ops import conv as conv_ops
from models import build_model

WORKLOADS = ("mlp", "resnet20", "resnet20_eval", "tiny")
# ours / PyTorch, samples/s (tiny: its time ratio inverted: at most 1.5x PyTorch's time)
TARGETS = {"mlp": 1.0, "resnet20": 0.8, "resnet20_eval": 0.8, "tiny": 1 / 1.5}
BATCH, EVAL_BATCH = 64, 500
TINY_OPS, TINY_SIZE = 200, 10


def _ours_step(model, x, y, opt):
    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def ours(workload: str, batch: int):
    """A callable that runs one step of ``workload`` in this framework."""
    fw.manual_seed(0)
    rng = np.random.default_rng(0)
    if workload == "tiny":
        x = fw.randn(TINY_SIZE, requires_grad=True)
        c = fw.rand(TINY_SIZE) * 0.2 + 0.9

        def step():
            h = x
            for _ in range(TINY_OPS // 5):
                h = ((h * 0.5 + c).tanh() * c) - 0.1
            h.sum().backward()
            x.grad = None

        return step
    if workload == "mlp":
        model = nn.Sequential(nn.Linear(3072, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
        x = fw.tensor(rng.standard_normal((batch, 3072)).astype(np.float32))
    else:
        model = build_model("resnet20", width=16, norm="bn")
        x = fw.tensor(rng.standard_normal((batch, 3, 32, 32)).astype(np.float32))
    if workload == "resnet20_eval":
        model.eval()

        def evaluate():
            with fw.no_grad():
                return model(x)

        return evaluate
    y = fw.tensor(rng.integers(0, 10, batch))
    return _ours_step(model, x, y, optim.SGD(model.parameters(), lr=0.01, momentum=0.9))


def theirs(workload: str, batch: int):
    """The same step in PyTorch."""
    import torch  # noqa: PLC0415
    import torch.nn as tnn  # noqa: PLC0415

    torch.manual_seed(0)
    if workload == "tiny":
        x = torch.randn(TINY_SIZE, requires_grad=True)
        c = torch.rand(TINY_SIZE) * 0.2 + 0.9

        def step():
            h = x
            for _ in range(TINY_OPS // 5):
                h = ((h * 0.5 + c).tanh() * c) - 0.1
            h.sum().backward()
            x.grad = None

        return step
    if workload == "mlp":
        model = tnn.Sequential(
            tnn.Linear(3072, 1024), tnn.ReLU(), tnn.Linear(1024, 1024), tnn.ReLU(), tnn.Linear(1024, 10)
        )
        x = torch.randn(batch, 3072)
    else:
        from benchmarks.bench_models import torch_model  # noqa: PLC0415

        model = torch_model("resnet20")
        x = torch.randn(batch, 3, 32, 32)
    if workload == "resnet20_eval":
        model.eval()

        def evaluate():
            with torch.no_grad():
                return model(x)

        return evaluate
    y = torch.randint(0, 10, (batch,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def measure(workload: str, rounds: int, batch: int, policy: str, steps_per_round: int, conv: str = "auto") -> dict:
    import torch  # noqa: PLC0415

    torch.set_num_threads(1)
    with fw.inplace.policy(policy), conv_ops.contraction(conv):
        a, b = ours(workload, batch), theirs(workload, batch)
        for fn in (a, b, a, b):  # warm up (caches, allocators, first-touch pages)
            fn()
        times = {"ours": [], "pytorch": []}
        for r in range(rounds):
            order = (("ours", a), ("pytorch", b)) if r % 2 == 0 else (("pytorch", b), ("ours", a))
            for name, fn in order:
                t0 = time.perf_counter()
                for _ in range(steps_per_round):
                    fn()
                times[name].append((time.perf_counter() - t0) / steps_per_round)
    ratios = [p / o for o, p in zip(times["ours"], times["pytorch"])]  # ours/PyTorch in speed
    per = TINY_OPS if workload == "tiny" else batch
    out = {
        "ours_ms": statistics.median(times["ours"]) * 1e3,
        "pytorch_ms": statistics.median(times["pytorch"]) * 1e3,
        "speed_ratio_median": statistics.median(ratios),
        "speed_ratio_min": min(ratios),
        "speed_ratio_max": max(ratios),
        "rounds": rounds,
    }
    if workload == "tiny":
        out["ours_us_per_op"] = out["ours_ms"] * 1e3 / per
        out["pytorch_us_per_op"] = out["pytorch_ms"] * 1e3 / per
    else:
        out["ours_samples_per_s"] = per / statistics.median(times["ours"])
        out["pytorch_samples_per_s"] = per / statistics.median(times["pytorch"])
    return out


def _status_kb(field: str) -> int:
    """A ``VmRSS``/``VmHWM`` line of /proc/self/status, in kB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss_child(which: str, batch: int, steps: int = 5) -> dict:
    """In this process: ResNet-20 set up, then ``steps`` training steps; peak RSS growth.

    The peak is the kernel's high-water mark of this process's resident memory, reset
    once the model and the batch exist (``/proc/self/clear_refs``); ``ru_maxrss`` would not
    do, a process started by a larger one inherits its parent's.
    """
    if which == "pytorch":
        import torch  # noqa: PLC0415  (only the PyTorch child loads it)

        torch.set_num_threads(1)
        step = theirs("resnet20", batch)
    else:
        step = ours("resnet20", batch)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status_kb("VmRSS")
    for _ in range(steps):
        step()
    after = _status_kb("VmHWM")
    return {"before_kb": before, "after_kb": after, "growth_mb": (after - before) / 1024}


def measure_rss(rounds: int, batch: int) -> dict:
    """Peak RSS growth of a ResNet-20 training process, each framework in its own processes."""
    growth = {"ours": [], "pytorch": []}
    for r in range(rounds):
        for which in ("ours", "pytorch") if r % 2 == 0 else ("pytorch", "ours"):
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.bench_vs_pytorch", "--rss-child", which, "--batch", str(batch)],
                capture_output=True,
                text=True,
                check=True,
                cwd=str(Path(__file__).resolve().parents[1]),
            )
            growth[which].append(json.loads(out.stdout.strip().splitlines()[-1])["growth_mb"])
    med = {k: statistics.median(v) for k, v in growth.items()}
    return {"growth_mb": growth, "median_mb": med, "ratio": med["ours"] / med["pytorch"]}


def main(argv=None):
    p = common.parser(__doc__.splitlines()[0], default_repeats=9)
    p.add_argument("--only", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--policy", choices=fw.inplace.POLICIES, default=fw.inplace.DEFAULT_POLICY)
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--eval-batch", type=int, default=EVAL_BATCH, help="resnet20_eval's batch")
    p.add_argument("--conv", choices=conv_ops.CHOOSING, default=conv_ops.AUTO, help="conv2d's choosing mode")
    p.add_argument("--rss", action="store_true", help="also measure ResNet-20's peak RSS growth (subprocesses)")
    p.add_argument("--rss-child", choices=("ours", "pytorch"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rss_child:
        print(json.dumps(rss_child(args.rss_child, args.batch)))
        return None
    rounds = common.repeats_of(args, 9)
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        raise SystemExit("this benchmark needs PyTorch: pip install torch==2.13.0") from None
    if os.environ.get("OMP_NUM_THREADS") != "1":
        print("note: set OMP_NUM_THREADS=1 so NumPy's BLAS runs one thread, as PyTorch does here")
    results = {
        "machine": common.machine_info(),
        "command": common.command_line(),
        "torch": torch.__version__,
        "policy": args.policy,
        "conv": args.conv,
        "batch": args.batch,
        "eval_batch": args.eval_batch,
        "workloads": {},
    }
    rows = []
    for w in args.only:
        steps = 1 if w != "tiny" else 5
        if args.quick:
            steps = 1
        batch = args.eval_batch if w == "resnet20_eval" else args.batch
        r = measure(w, rounds, batch if not args.quick else 8, args.policy, steps, args.conv)
        results["workloads"][w] = r
        target = TARGETS[w]
        if w == "tiny":
            what = f"{r['ours_us_per_op']:.2f} vs {r['pytorch_us_per_op']:.2f} us/op"
        else:
            what = f"{r['ours_samples_per_s']:.0f} vs {r['pytorch_samples_per_s']:.0f} samples/s"
        met = r["speed_ratio_median"] >= target
        rows.append(
            [
                w,
                what,
                f"{r['speed_ratio_median']:.2f}",
                f"{r['speed_ratio_min']:.2f}-{r['speed_ratio_max']:.2f}",
                f">= {target:.2f}",
                "yes" if met else "no",
            ]
        )
    print(
        common.machine_line(results["machine"])
        + f", PyTorch {torch.__version__}, policy {args.policy}, conv2d {args.conv}"
    )
    print(
        common.markdown_table(
            ["workload", "ours vs PyTorch (median)", "speed ratio", "spread", "target", "met"],
            rows,
            [
                ("speed ratio", "our speed over PyTorch's (its time over ours), median of the rounds; above 1: faster"),
                ("spread", "the lowest and highest per-round speed ratio"),
            ],
        )
    )
    if args.rss:
        rss = results["rss"] = measure_rss(3 if args.quick else 5, args.batch)
        print(
            f"ResNet-20 peak RSS growth over 5 steps (batch {args.batch}), median of {len(rss['growth_mb']['ours'])}: "
            f"ours {rss['median_mb']['ours']:.1f} MB, PyTorch {rss['median_mb']['pytorch']:.1f} MB, "
            f"ratio {rss['ratio']:.2f} (target <= 1)"
        )
    if args.json:
        common.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
