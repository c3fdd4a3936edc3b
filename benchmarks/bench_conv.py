"""conv2d forward + backward throughput on ResNet-20's layers, per contraction variant.

ResNet-20 on CIFAR has three kinds of 3x3 convolution (padding 1, stride 1): 16 channels
at 32x32, 32 at 16x16 and 64 at 8x8. For each, with batch 128 in float32, every
contraction of :mod:`framework.ops.conv` is timed (see its docstring):

* ``batched``   im2col ``(N, C*kh*kw, Ho*Wo)`` + ``matmul`` batched over N (NCHW out directly);
* ``gemm``      im2col ``(C*kh*kw, N*Ho*Wo)`` + one large GEMM + a transpose to NCHW;
* ``tensordot`` ``tensordot`` on the strided window view (copies made inside NumPy);
* ``einsum``    ``einsum(..., optimize=True)`` on the window view;

and, when PyTorch can be imported, ``torch.nn.functional.conv2d`` on the same arrays.

conv2d processes the batch in chunks that keep its workspace within a limit
(``framework.ops.conv.set_workspace_limit``, default 4 MiB). ``--limits 4M,1M,none``
times every contraction under each limit (``none``: the whole batch in one chunk; ``0``:
one image per chunk); the variant's name then says which (``gemm ws<=1M``).
``--baseline REV`` also times the conv module as it was at git revision ``REV`` (read
with ``git show``, loaded beside the current one; variants named ``gemm @REV``), so a
change is measured before and after in one interleaved run.
One step is ``y = conv2d(x, w)`` then the gradients of x and w for a fixed output
gradient (``autograd.grad``, no bias: ResNet's convolutions have none). The variants are
interleaved round by round so that machine noise falls on all alike; the table shows the
minimum (the median is in the JSON).

GFLOP/s counts 3 x 2*N*C_out*C_in*kh*kw*Ho*Wo per step (forward, grad input, grad
weight). Every call is timed twice: wall clock, and the CPU time of this process
(``time.process_time``, all threads). On a shared machine whose other jobs take cores,
wall time measures the neighbours as much as the code; with ``--threads 1`` (BLAS and
PyTorch on one thread, through threadpoolctl) the CPU time is what the code costs and
stays steady, so ``--clock cpu`` reports that instead. ``ws MB`` is the peak of ``framework.memory``'s workspace category over one
step (padding, im2col and backward temporaries; copies made inside NumPy by tensordot
and einsum are not seen there).

Run from the repository root::

    python -m benchmarks.bench_conv [--quick] [--repeats 5] [--batch 128] [--threads N]
                                    [--clock wall|cpu] [--variants batched,gemm]
                                    [--limits 4M,none] [--baseline HEAD] [--json PATH]
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import re
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
from framework import backend, memory
from framework.ops import conv as C

try:  # optional: the reference the ratio is taken against
    import torch
    import torch.nn.functional as torch_F
except Exception:  # ImportError, or a broken install
    torch = None

LAYERS = [(16, 32), (32, 16), (64, 8)]  # (channels, spatial size) of ResNet-20's stages
KERNEL = 3


def _flops(n, c, hw):
    return 3 * 2 * n * c * c * KERNEL * KERNEL * hw * hw


def _ours(name, x, w, g, module=C, limit="default"):
    """conv2d of ``module`` with contraction ``name``; under workspace ``limit`` unless
    "default" (the module's own setting; a baseline module may have no limit at all)."""

    def settings():
        stack = contextlib.ExitStack()
        stack.enter_context(module.contraction(name))
        if limit != "default":
            stack.enter_context(module.workspace_limit(limit))
        return stack

    def fwd():
        with settings():
            return module.conv2d(x, w, padding=1)

    def step():
        with settings():
            y = module.conv2d(x, w, padding=1)
            return fw.autograd.grad(y, [x, w], g)

    return fwd, step


def parse_limit(text: str):
    """``"none"`` -> None; ``"4M"``, ``"512K"``, ``"1048576"`` -> bytes (K, M, G: powers of 1024)."""
    t = text.strip().lower()
    if t in ("none", "inf", "unlimited"):
        return None
    m = re.fullmatch(r"(\d+)\s*([kmg]?)i?b?", t)
    if not m:
        raise SystemExit(f"bad workspace limit {text!r}: use bytes, 512K, 4M, 1G or none")
    return int(m.group(1)) * 1024 ** " kmg".index(m.group(2) or " ")


def format_limit(limit) -> str:
    if limit is None:
        return "none"
    for unit, size in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if limit and limit % size == 0:
            return f"{limit // size}{unit}"
    return str(limit)


def load_baseline(rev: str):
    """``framework/ops/conv.py`` as it was at git revision ``rev``, imported as a separate
    module (its relative imports resolve to the current framework: same memory counter)."""
    root = Path(__file__).resolve().parents[1]
    try:
        src = subprocess.run(["git", "show", f"{rev}:framework/ops/conv.py"], cwd=root,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"--baseline {rev}: cannot read framework/ops/conv.py there: {e}") from None
    name = "framework.ops._conv_baseline_" + re.sub(r"\W", "_", rev)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    module.__package__ = "framework.ops"
    sys.modules[name] = module
    exec(compile(src, f"{rev}:framework/ops/conv.py", "exec"), module.__dict__)  # noqa: S102
    return module


def _torch(xa, wa, ga, device):
    dev = "cuda" if device.type == "cuda" else "cpu"
    x = torch.tensor(backend.to_numpy(xa), device=dev, requires_grad=True)
    w = torch.tensor(backend.to_numpy(wa), device=dev, requires_grad=True)
    g = torch.tensor(backend.to_numpy(ga), device=dev)

    def fwd():
        return torch_F.conv2d(x, w, padding=1)

    def step():
        y = torch_F.conv2d(x, w, padding=1)
        return torch.autograd.grad(y, [x, w], g)

    return fwd, step


def _synced(fn, device):
    if device.type != "cuda":
        return fn

    def run():
        out = fn()
        from framework.backend import cupy_module  # noqa: PLC0415

        cupy_module().cuda.get_current_stream().synchronize()
        if torch is not None and torch.cuda.is_available():
            torch.cuda.synchronize()
        return out

    return run


def _interleaved(variants, repeats, warmup=1):
    """Like ``common.interleaved``, but each call is timed on the wall and the CPU clock."""
    names = list(variants)
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    gc.collect()
    gc.disable()
    try:
        for r in range(-warmup, repeats):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                c0, t0 = time.process_time(), time.perf_counter()
                result = variants[name]()
                t1, c1 = time.perf_counter(), time.process_time()
                del result
                if r >= 0:
                    wall[name].append(t1 - t0)
                    cpu[name].append(c1 - c0)
    finally:
        gc.enable()
    return wall, cpu


def _threads(n):
    """BLAS (and PyTorch) limited to ``n`` threads inside the block; no limit for None."""
    if n is None:
        return contextlib.nullcontext()
    from threadpoolctl import threadpool_limits  # noqa: PLC0415  (a scikit-learn dependency)

    if torch is not None:
        torch.set_num_threads(n)
    return threadpool_limits(limits=n)


def _workspace_peak(step) -> int:
    base = memory.breakdown()["workspace"]
    memory.reset_peak()
    step()
    return memory.peak_breakdown()["workspace"] - base


def main(argv=None) -> int:
    p = common.parser("conv2d forward+backward throughput on ResNet-20 layers", default_repeats=5)
    p.add_argument("--batch", type=int, default=None, help="batch size (default 128; 16 with --quick)")
    p.add_argument("--variants", default=",".join(C.CONTRACTIONS), help="comma-separated contractions to time")
    p.add_argument("--limits", default=None,
                   help="comma-separated workspace limits to time each contraction under (4M, 512K, 0, none); "
                        "default: the current one only")
    p.add_argument("--baseline", metavar="REV", default=None,
                   help="also time framework/ops/conv.py as it was at this git revision (e.g. HEAD)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (CuPy; PyTorch on the same device)")
    p.add_argument("--threads", type=int, default=None, help="limit BLAS and PyTorch to N threads (default: no limit)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="which clock the table reports (the JSON has both); cpu with --threads 1 on a busy machine")
    args = p.parse_args(argv)
    repeats = common.repeats_of(args, 5)
    batch = args.batch or (16 if args.quick else 128)
    device = backend.device(args.device)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in C.CONTRACTIONS:
            raise SystemExit(f"unknown variant {v!r}; use some of {', '.join(C.CONTRACTIONS)}")
    limits = ["default"] if args.limits is None else [parse_limit(t) for t in args.limits.split(",") if t.strip()]
    baseline = load_baseline(args.baseline) if args.baseline else None
    if device.type == "cuda":
        memory.enable_gpu_hook()

    with _threads(args.threads):
        rows, results = _run(args, repeats, batch, device, variants, limits, baseline)
    info = common.machine_info()
    threads = "default threads" if args.threads is None else f"{args.threads} thread(s)"
    print(f"conv2d 3x3 pad 1, float32, batch {batch}, device {device}, {threads}, "
          f"min of {repeats} interleaved repeats, {args.clock} clock")
    print(common.machine_line(info) + ("" if torch is not None else "; PyTorch not installed (no ratio)"))
    print(f"default contraction: {C.get_contraction()}, workspace limit {format_limit(C.get_workspace_limit())}"
          + (f"; baseline: framework/ops/conv.py at {args.baseline}" if baseline else "") + "\n")
    print(common.markdown_table(
        ["layer", "variant", "fwd ms", "fwd+bwd ms", "GFLOP/s (fwd+bwd)", "ws MB", "time vs torch"], rows))
    if args.json:
        common.write_json(args.json, {
            "benchmark": "bench_conv", "command": common.command_line(), "machine": info,
            "torch": None if torch is None else torch.__version__, "device": str(device),
            "threads": args.threads, "clock": args.clock, "baseline": args.baseline,
            "default_contraction": C.get_contraction(), "workspace_limit": C.get_workspace_limit(),
            "results": results,
        })
    return 0


def _run(args, repeats, batch, device, variants, limits, baseline):
    rng = np.random.default_rng(0)
    rows, results = [], []
    for c, hw in LAYERS:
        shape_x, shape_w = (batch, c, hw, hw), (c, c, KERNEL, KERNEL)
        xa = backend.to_device(rng.standard_normal(shape_x, dtype=np.float32), device)
        wa = backend.to_device((rng.standard_normal(shape_w, dtype=np.float32) * 0.1), device)
        ga = backend.to_device(rng.standard_normal(shape_x, dtype=np.float32), device)
        x, w, g = (fw.tensor(a, dtype=fw.float32, device=device) for a in (xa, wa, ga))
        x.requires_grad_(True)
        w.requires_grad_(True)
        fwds, steps, limit_of = {}, {}, {}
        for v in variants:
            for limit in limits:
                label = v if len(limits) == 1 else f"{v} ws<={format_limit(limit)}"
                f, s = _ours(v, x, w, g, C, limit)
                fwds[label], steps[label] = _synced(f, device), _synced(s, device)
                limit_of[label] = C.get_workspace_limit() if limit == "default" else limit
            if baseline is not None and v in baseline.CONTRACTIONS:
                label = f"{v} @{args.baseline}"
                f, s = _ours(v, x, w, g, baseline)
                fwds[label], steps[label] = _synced(f, device), _synced(s, device)
                limit_of[label] = getattr(baseline, "get_workspace_limit", lambda: None)()
        if torch is not None:
            f, s = _torch(xa, wa, ga, device)
            fwds["torch"], steps["torch"] = _synced(f, device), _synced(s, device)
        fwd_wall, fwd_cpu = _interleaved(fwds, repeats)
        step_wall, step_cpu = _interleaved(steps, repeats)
        fwd_t, step_t = (fwd_cpu, step_cpu) if args.clock == "cpu" else (fwd_wall, step_wall)
        flops = _flops(batch, c, hw)
        torch_min = min(step_t["torch"]) if "torch" in step_t else None
        for v in steps:
            ws = _workspace_peak(steps[v]) if v != "torch" and device.type == "cpu" else None
            f, s = min(fwd_t[v]), min(step_t[v])
            ratio = s / torch_min if torch_min else None
            layer = f"{c}ch {hw}x{hw}"
            results.append({
                "layer": layer, "batch": batch, "channels": c, "size": hw, "variant": v,
                "workspace_limit": limit_of.get(v),
                "forward_wall_s": common.summarize(fwd_wall[v]), "forward_cpu_s": common.summarize(fwd_cpu[v]),
                "step_wall_s": common.summarize(step_wall[v]), "step_cpu_s": common.summarize(step_cpu[v]),
                "gflop_per_step": flops / 1e9, "gflops": flops / s / 1e9, "clock": args.clock,
                "workspace_peak_bytes": ws, "vs_torch": ratio,
            })
            rows.append([
                layer, v, f"{f * 1e3:.1f}", f"{s * 1e3:.1f}", f"{flops / s / 1e9:.1f}",
                "-" if ws is None else f"{ws / 2**20:.1f}",
                "-" if ratio is None else f"{ratio:.2f}x",
            ])
    return rows, results


if __name__ == "__main__":
    sys.exit(main())
