"""conv2d on ResNet-20's layers: every algorithm, per pass, beside PyTorch; and the whole step.

ResNet-20 on CIFAR (batch 64 by default, float32) has six distinct convolutions, all 3x3
with padding 1: the stem (3 -> 16 channels, 32x32), 16 -> 16 at 32x32 (6 of them), the
two downsampling ones (16 -> 32 and 32 -> 64, stride 2) and 32 -> 32 at 16x16 and 64 -> 64
at 8x8 (5 each). For each layer and each pass (forward, weight gradient, input
gradient), every algorithm of :mod:`framework.ops.conv_algorithms` that can run it is
timed on raw arrays, beside PyTorch's kernels for the same pass
(``torch.nn.functional.conv2d`` and ``aten.convolution_backward`` with one gradient
asked for), under the default workspace limit:

* ``batched``, ``gemm``, ``tensordot``, ``einsum``: im2col with each contraction;
* ``grid``: im2col over the padded grid (strided: over the input's phases), one GEMM per
  chunk; its strided input gradient is ``gemm``'s;
* ``winograd2`` / ``winograd4``: 3x3 stride 1, Winograd F(2x2, 3x3) / F(4x4, 3x3).

The ``chosen`` column says which row conv2d's choosing modes take (``auto``, the default,
and ``fast``; :mod:`framework.ops.conv_algorithms.choice`). Variants are called in
alternating rounds (the order rotates every round; the garbage collector is off), so
machine noise falls on all alike. Each row shows the median time with its spread (min to
max over the rounds), GFLOP/s, the workspace peak of one call (``framework.memory``), and
``vs torch``: the median over rounds of (our time / PyTorch's time in the same round),
with its spread. ``--threads 1`` runs BLAS and PyTorch on one thread (threadpoolctl and
``torch.set_num_threads``); ``--clock cpu`` then times the CPU time of this process, which
other jobs on a shared machine disturb much less than the wall clock.

A second table sums each choosing mode's passes over the network (each layer times its
count; the stem has no input gradient) against PyTorch's. ``--model`` also times whole
ResNet-20 training steps (``benchmarks/bench_models.py``'s model, SGD momentum 0.9, policy
``on``) under ``auto``, ``fast`` and ``gemm`` everywhere (the algorithm before per-layer
choice), interleaved with PyTorch's step on the same batch, and prints samples/s and the
ratio per round.

Run from the repository root::

    OMP_NUM_THREADS=1 python -m benchmarks.bench_conv --threads 1 --clock cpu [--batch 64]
        [--repeats 9] [--layers 0,1] [--variants grid,winograd4] [--limits 1M,none]
        [--model] [--model-rounds 9] [--device cpu|cuda] [--quick] [--json PATH]
"""

from __future__ import annotations

import contextlib
import gc
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common
else:
    from . import common

from framework import backend, memory
from framework.ops import conv as C
from framework.ops.conv_algorithms import ALGORITHMS, ConvGeometry
from framework.ops.conv_algorithms.workspace import AUTO_WORKSPACE_CAP

try:  # optional: the reference the ratio is taken against
    import torch
    import torch.nn.functional as torch_F
except Exception:  # ImportError, or a broken install
    torch = None

# (name, C_in, C_out, size, stride, how many in ResNet-20, input gradient needed)
LAYERS = [
    ("stem 3->16 32x32", 3, 16, 32, 1, 1, False),
    ("16->16 32x32", 16, 16, 32, 1, 6, True),
    ("16->32 32x32 s2", 16, 32, 32, 2, 1, True),
    ("32->32 16x16", 32, 32, 16, 1, 5, True),
    ("32->64 16x16 s2", 32, 64, 16, 2, 1, True),
    ("64->64 8x8", 64, 64, 8, 1, 5, True),
]
PASSES = ("forward", "grad_weight", "grad_input")
KERNEL, PADDING = 3, 1


def parse_limit(text: str):
    """``"none"`` -> None; ``"auto"``; ``"4M"``, ``"512K"``, ``"1048576"`` -> bytes (K, M, G: powers of 1024)."""
    t = text.strip().lower()
    if t in ("none", "inf", "unlimited"):
        return None
    if t == "auto":
        return "auto"
    m = re.fullmatch(r"(\d+)\s*([kmg]?)i?b?", t)
    if not m:
        raise ValueError(f"bad workspace limit {text!r}: use bytes, 512K, 4M, 1G, auto or none")
    return int(m.group(1)) * 1024 ** " kmg".index(m.group(2) or " ")


def format_limit(limit) -> str:
    if limit is None or limit == "auto":
        return str(limit).lower()
    for unit, size in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if limit and limit % size == 0:
            return f"{limit // size}{unit}"
    return str(limit)


def _resolved(limit, x_nbytes):
    """A limit as conv2d resolves it for an input of ``x_nbytes`` (``"auto"``: half, <= 4 MiB)."""
    return min(AUTO_WORKSPACE_CAP, x_nbytes // 2) if limit == "auto" else limit


def _threads(n):
    """BLAS (and PyTorch) limited to ``n`` threads inside the block; no limit for None."""
    if n is None:
        return contextlib.nullcontext()
    from threadpoolctl import threadpool_limits  # noqa: PLC0415  (a scikit-learn dependency)

    if torch is not None:
        torch.set_num_threads(n)
    return threadpool_limits(limits=n)


def _sync(device):
    if device.type != "cuda":
        return lambda: None
    cp = backend.cupy_module()

    def sync():
        cp.cuda.get_current_stream().synchronize()
        if torch is not None and torch.cuda.is_available():
            torch.cuda.synchronize()

    return sync


def rounds(variants: dict, repeats: int, clock: str, sync=lambda: None, warmup: int = 1) -> dict:
    """Seconds of each variant per round, ``repeats`` rounds, the order rotating each round."""
    timer = time.process_time if clock == "cpu" else time.perf_counter
    names = list(variants)
    out = {n: [] for n in names}
    gc.collect()
    gc.disable()
    try:
        for r in range(-warmup, repeats):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                t0 = timer()
                result = variants[name]()
                sync()
                t1 = timer()
                del result
                if r >= 0:
                    out[name].append(t1 - t0)
    finally:
        gc.enable()
    return out


def spread(values) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def paired_ratios(ours, theirs) -> dict:
    """Median (and spread) over rounds of ours / theirs from the same round."""
    return spread([a / b for a, b in zip(ours, theirs, strict=True)])


def _flops(n, c, co, out_hw):
    return 2 * n * c * co * KERNEL * KERNEL * out_hw[0] * out_hw[1]


def _workspace_peak(fn) -> int:
    base = memory.breakdown()["workspace"]
    memory.reset_peak()
    fn()
    return memory.peak_breakdown()["workspace"] - base


def _ours(name, pass_, x, w, g, geom, limit, xp):
    alg = ALGORITHMS[name]
    if pass_ == "forward":
        return lambda: alg.forward(x, w, geom, limit, xp)
    if pass_ == "grad_weight":
        return lambda: alg.grad_weight(x, g, geom, limit, xp)
    return lambda: alg.grad_input(g, w, geom, limit, xp, False)


def _torch(pass_, xa, wa, ga, stride, device):
    dev = "cuda" if device.type == "cuda" else "cpu"
    x = torch.tensor(backend.to_numpy(xa), device=dev)
    w = torch.tensor(backend.to_numpy(wa), device=dev)
    g = torch.tensor(backend.to_numpy(ga), device=dev)
    s = [stride, stride]
    if pass_ == "forward":
        return lambda: torch_F.conv2d(x, w, stride=stride, padding=PADDING)
    mask = [pass_ == "grad_input", pass_ == "grad_weight", False]
    return lambda: torch.ops.aten.convolution_backward(
        g, x, w, None, s, [PADDING, PADDING], [1, 1], False, [0, 0], 1, mask
    )


def layer_rows(args, layer, batch, device, variants, limits, repeats):
    """Times every applicable variant of every pass of one layer; returns result dicts."""
    name, c, co, hw, stride, count, needs_gx = layer
    rng = np.random.default_rng(0)
    ho = (hw + 2 * PADDING - KERNEL) // stride + 1
    xa = rng.standard_normal((batch, c, hw, hw), dtype=np.float32)
    wa = (rng.standard_normal((co, c, KERNEL, KERNEL)) * 0.1).astype(np.float32)
    ga = rng.standard_normal((batch, co, ho, ho), dtype=np.float32)
    x, w, g = (backend.to_device(a, device) for a in (xa, wa, ga))
    xp = backend.xp_for(device)
    geom = ConvGeometry(x.shape, w.shape, (stride, stride), (PADDING, PADDING), (ho, ho))
    chosen = {mode: C.explain(x.shape, w.shape, stride, PADDING, name=mode) for mode in C.CHOOSING}
    flops = _flops(batch, c, co, (ho, ho))
    results = []
    for pass_ in PASSES:
        fns, meta = {}, {}
        for v in variants:
            if ALGORITHMS[v].unsupported(geom) is not None:
                continue
            for limit in limits:
                label = v if len(limits) == 1 else f"{v} ws<={format_limit(limit)}"
                lim = _resolved(limit, xa.nbytes)
                fns[label] = _ours(v, pass_, x, w, g, geom, lim, xp)
                meta[label] = (v, lim)
        if torch is not None:
            fns["torch"] = _torch(pass_, xa, wa, ga, stride, device)
        times = rounds(fns, repeats, args.clock, _sync(device))
        for label, t in times.items():
            v, lim = meta.get(label, ("torch", None))
            ws = _workspace_peak(fns[label]) if v != "torch" and device.type == "cpu" else None
            results.append(
                {
                    "layer": name,
                    "pass": pass_,
                    "variant": label,
                    "algorithm": v,
                    "count": count,
                    "needs_grad_input": needs_gx,
                    "batch": batch,
                    "workspace_limit": lim,
                    "seconds": spread(t),
                    "gflops": flops / statistics.median(t) / 1e9,
                    "workspace_peak_bytes": ws,
                    "vs_torch": paired_ratios(t, times["torch"]) if "torch" in times and v != "torch" else None,
                    "chosen_by": [m for m, plan in chosen.items() if getattr(plan, pass_) == v and len(limits) == 1],
                }
            )
    return results


def _ms(s):
    return f"{s['median'] * 1e3:.2f} ({s['min'] * 1e3:.2f}-{s['max'] * 1e3:.2f})"


def _ratio(r):
    return "-" if r is None else f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"


def layer_table(results) -> str:
    rows = []
    for r in results:
        rows.append(
            [
                r["layer"],
                r["pass"].replace("_", " "),
                r["variant"],
                ", ".join(r["chosen_by"]),
                _ms(r["seconds"]),
                f"{r['gflops']:.0f}",
                "-" if r["workspace_peak_bytes"] is None else f"{r['workspace_peak_bytes'] / 2**20:.2f}",
                _ratio(r["vs_torch"]),
            ]
        )
    return common.markdown_table(
        ["layer", "pass", "variant", "chosen", "ms median (min-max)", "GFLOP/s", "ws MiB", "time ours / torch"],
        rows,
        [
            ("chosen", "the choosing modes that pick this variant for the layer and pass"),
            ("GFLOP/s", "at the median time; ws MiB: the peak of the variant's workspace"),
            ("time ours / torch", "median of the per-round ratios (min-max); below 1x: faster than PyTorch"),
        ],
    )


def chosen_table(results) -> str:
    """One row per layer and pass: PyTorch, ``gemm`` (the algorithm before per-layer choice)
    and what each choosing mode takes, with its time ratio to PyTorch."""
    rows, by_key = [], {}
    for r in results:
        by_key.setdefault((r["layer"], r["pass"]), {})[r["variant"]] = r
    for (layer, pass_), variants in by_key.items():
        torch_r = variants.get("torch")
        row = [layer, pass_.replace("_", " "), "-" if torch_r is None else f"{torch_r['seconds']['median'] * 1e3:.2f}"]
        gemm = variants.get("gemm")
        row.append("-" if gemm is None else f"{gemm['seconds']['median'] * 1e3:.2f}")
        for mode in C.CHOOSING:
            pick = next((r for r in variants.values() if mode in r["chosen_by"]), None)
            if pick is None:
                row += ["-", "-"]
                continue
            ratio = "" if pick["vs_torch"] is None else f" ({pick['vs_torch']['median']:.2f}x)"
            row += [pick["variant"], f"{pick['seconds']['median'] * 1e3:.2f}{ratio}"]
        rows.append(row)
    headers = ["layer", "pass", "torch ms", "gemm ms"]
    for mode in C.CHOOSING:
        headers += [f"{mode}: algorithm", f"{mode}: ms (time vs torch)"]
    legend = [
        ("torch ms", "medians; gemm: the algorithm used before the per-layer choice"),
        ("ms (time vs torch)", "the chosen algorithm's median ms, and its time over PyTorch's"),
    ]
    return common.markdown_table(headers, rows, legend)


def network_totals(results) -> dict:
    """Per choosing mode: the chosen passes summed over ResNet-20 (layer counts), vs PyTorch."""
    totals = {}
    for mode in list(C.CHOOSING) + ["torch"]:
        total = 0.0
        for r in results:
            if r["pass"] == "grad_input" and not r["needs_grad_input"]:
                continue
            if (mode == "torch" and r["variant"] == "torch") or mode in r["chosen_by"]:
                total += r["count"] * r["seconds"]["median"]
        totals[mode] = total
    return totals


def model_rounds(batch, rounds_, clock, with_torch=True):
    """Whole ResNet-20 training steps under each choosing mode (and ``gemm`` everywhere),
    interleaved with PyTorch's step; samples/s and per-round ratios to PyTorch."""
    from benchmarks.bench_models import Runner, TorchRunner  # noqa: PLC0415  (pulls in models)

    runners = {}
    for mode in list(C.CHOOSING) + ["gemm"]:
        runners[mode] = (Runner("resnet20", "on", "on", False, batch=batch), mode)
    steps = {}
    for label, (runner, mode) in runners.items():

        def step(runner=runner, mode=mode):
            with C.contraction(mode):
                return runner.step()

        steps[label] = step
    if with_torch and torch is not None:
        steps["torch"] = TorchRunner("resnet20", batch=batch).step
    for _ in range(2):  # warm-up: gradients and momentum buffers exist from here on
        for s in steps.values():
            s()
    times = rounds(steps, rounds_, clock)
    out = {}
    for label, t in times.items():
        out[label] = {
            "step_seconds": spread(t),
            "samples_per_s": batch / statistics.median(t),
            "vs_torch_samples_per_s": None
            if label == "torch" or "torch" not in times
            else spread([b / a for a, b in zip(t, times["torch"], strict=True)]),
        }
    return out


def main(argv=None) -> int:
    p = common.parser("conv2d per ResNet-20 layer and pass, every algorithm beside PyTorch", default_repeats=9)
    p.add_argument("--batch", type=int, default=None, help="batch size (default 64; 4 with --quick)")
    p.add_argument("--layers", default=None, help="comma-separated indices into LAYERS (default: all)")
    p.add_argument("--variants", default=",".join(ALGORITHMS), help="comma-separated algorithms to time")
    p.add_argument(
        "--limits",
        default=None,
        help="comma-separated workspace limits to time each algorithm under (auto, 4M, 512K, 0, "
        "none); default: the current one",
    )
    p.add_argument("--model", action="store_true", help="also time whole ResNet-20 steps against PyTorch")
    p.add_argument("--model-rounds", type=int, default=None, help="timed model steps per variant (default 9)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (CuPy; PyTorch on the same device)")
    p.add_argument("--threads", type=int, default=None, help="limit BLAS and PyTorch to N threads (default: no limit)")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall clock, or this process's CPU time (steadier on a busy machine with --threads 1)",
    )
    args = p.parse_args(argv)
    repeats = common.repeats_of(args, 9)
    batch = args.batch or (4 if args.quick else 64)
    device = backend.device(args.device)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in ALGORITHMS:
            p.error(f"unknown variant {v!r}; use some of {', '.join(ALGORITHMS)}")
    layers = LAYERS
    if args.layers:
        try:
            layers = [LAYERS[int(i)] for i in args.layers.split(",")]
        except (ValueError, IndexError):
            p.error(f"--layers: comma-separated indices 0..{len(LAYERS) - 1}, got {args.layers!r}")
    try:
        limits = [C.get_workspace_limit()] if args.limits is None else [parse_limit(t) for t in args.limits.split(",")]
    except ValueError as e:
        p.error(str(e))
    if device.type == "cuda":
        memory.enable_gpu_hook()

    results, model = [], None
    with _threads(args.threads):
        for layer in layers:
            results += layer_rows(args, layer, batch, device, variants, limits, repeats)
        if args.model:
            model = model_rounds(batch, args.model_rounds or (1 if args.quick else 9), args.clock)
    info = common.machine_info()
    threads = "default threads" if args.threads is None else f"{args.threads} thread(s)"
    print(
        f"conv2d 3x3 pad 1, float32, batch {batch}, device {device}, {threads}, {args.clock} clock, "
        f"{repeats} alternating rounds, workspace limit {', '.join(format_limit(v) for v in limits)}"
    )
    print(common.machine_line(info) + ("" if torch is None else f", PyTorch {torch.__version__}"))
    print()
    print(layer_table(results))
    if len(limits) == 1:
        print("\nWhat the choosing modes take, per layer and pass (medians; time ours / torch per round):\n")
        print(chosen_table(results))
    totals = network_totals(results) if len(layers) == len(LAYERS) and len(limits) == 1 else None
    if totals:
        print(
            "\nConvolutions of one ResNet-20 step, summed from the medians above (each layer x its count, "
            "the chosen algorithm per pass, no input gradient for the stem):\n"
        )
        rows = [
            [mode, f"{t * 1e3:.1f}", f"{t / totals['torch']:.2f}x" if totals.get("torch") else "-"]
            for mode, t in totals.items()
        ]
        print(common.markdown_table(["mode", "ms", "time vs torch"], rows, [("time vs torch", "ms over PyTorch's ms")]))
    if model:
        print(f"\nResNet-20 training step, batch {batch}, SGD momentum, policy on, {args.clock} clock:\n")
        rows = [
            [label, _ms(m["step_seconds"]), f"{m['samples_per_s']:.0f}", _ratio(m["vs_torch_samples_per_s"])]
            for label, m in model.items()
        ]
        print(
            common.markdown_table(
                ["conv2d mode", "step ms median (min-max)", "samples/s", "samples/s ours / torch"],
                rows,
                [("samples/s ours / torch", "our throughput over PyTorch's, median (min-max); above 1x: faster")],
            )
        )
    if args.json:
        common.write_json(
            args.json,
            {
                "benchmark": "bench_conv",
                "command": common.command_line(),
                "machine": info,
                "torch": None if torch is None else torch.__version__,
                "device": str(device),
                "threads": args.threads,
                "clock": args.clock,
                "batch": batch,
                "repeats": repeats,
                "results": results,
                "network_totals_s": totals,
                "model": model,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
