"""Peak GPU memory and samples/s under inplace off, on and on+InPlace-ABN, beside PyTorch.

For the MLP and the ConvNet (batch 256) and ResNet-20 (batch 256), built exactly as
benchmarks/bench_models.py builds them (its ``MODELS`` table, ``VARIANTS`` and ``Runner``),
on one GPU, one variant alive at a time:

- peak MB: the CuPy pool hook's peak (``framework.memory.enable_gpu_hook``: every
  ``malloc``/``free`` of CuPy's memory pool, at the pool's block sizes) over
  ``--mem-steps`` steady-state training steps (SGD, momentum 0.9), after warmup, from
  ``memory.reset_peak()``. Parameters, gradients, momentum and the batch are included;
  device memory allocated around CuPy's pool (the CUDA context, whatever a CUDA
  library allocates for itself) is not;
- samples/s: ``--rounds`` rounds of ``--steps`` steps; the device is synchronized before
  the clock is read at both ends of a round, and no value is read back inside a round;
  the median round is reported;
- PyTorch, beside each model: the same architecture (``bench_models.torch_model``: BN and
  ``ReLU(inplace=True)``, ``out += identity`` in ResNet blocks, as PyTorch's own
  ResNets), same batch and optimizer, ``torch.backends.cudnn.benchmark = True``; peak is
  ``torch.cuda.max_memory_allocated`` over the same steps after
  ``torch.cuda.reset_peak_memory_stats``, samples/s timed the same way.

Targets (printed with yes/NO): ResNet-20 at batch 256, peak under on+InPlace-ABN <=
PyTorch's; samples/s >= 0.5x PyTorch's.

Without CuPy and a GPU it prints one line and exits with status 2. Under
``INPLACE_LAB_CUPY=standin`` (the test suite's CuPy stand-in) it runs its whole path on the
CPU and says so: the pool figures are the stand-in's, the speeds are NumPy's.

Run:  python benchmarks/bench_gpu.py [--quick] [--json PATH] [--models resnet20 ...] [--no-torch]
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import framework as fw  # noqa: E402
from benchmarks import bench_models, common  # noqa: E402
from framework import backend, memory  # noqa: E402

MB = 2**20
GPU_MODELS = ("mlp", "convnet", "resnet20")
BATCH = {"mlp": 256, "convnet": 256, "resnet20": 256}
VARIANT_NAMES = ("off", "on", "on+InPlaceABN")
TARGET_MODEL, TARGET_BATCH = "resnet20", 256
TORCH_SPEED_RATIO = 0.5
# warmup steps, steps in the memory window, timed rounds, steps per round
FULL = {"warmup": 3, "mem_steps": 3, "rounds": 7, "steps": 20}
QUICK = {"warmup": 2, "mem_steps": 2, "rounds": 3, "steps": 5}


def variants():
    """``(name, policy, abn)`` of the compared variants, taken from bench_models.VARIANTS."""
    by_name = {v[0]: v for v in bench_models.VARIANTS}
    return [by_name[name] for name in VARIANT_NAMES]


def no_gpu_line() -> str | None:
    """The one error line when no GPU can be used here, else None."""
    why = backend.cuda_unavailable_reason()
    if why is None:
        return None
    return f"error: bench_gpu.py needs CuPy and a CUDA GPU, and {why}; nothing was measured"


# --- measurements -------------------------------------------------------------------------------


def _timed_rounds(step, sync, rounds: int, steps: int) -> list[float]:
    """Seconds per round of ``steps`` calls of ``step``, the device synchronized at both ends."""
    out = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def measure_ours(model: str, variant, device, batch: int, p: dict, sync) -> dict:
    """One variant of ``model`` with this framework on ``device`` (the pool hook must be on)."""
    name, policy, abn = variant
    runner = bench_models.Runner(model, name, policy, abn, device=device, batch=batch)
    mem = runner.measure_memory(warmup=p["warmup"], steps=p["mem_steps"])
    times = _timed_rounds(functools.partial(runner.step, read_loss=False), sync, p["rounds"], p["steps"])
    med = statistics.median(times)
    del runner
    gc.collect()
    return {
        "model": model,
        "batch": batch,
        "variant": name,
        "framework": "ours",
        "peak_mb": mem["peak_mb"],
        "floor_mb": mem["floor_mb"],
        "activation_mb": mem["activation_mb"],
        "params_mb": mem["params_mb"],
        "peak_breakdown_mb": mem["peak_breakdown_mb"],
        "step_ms": 1e3 * med / p["steps"],
        "samples_per_s": batch * p["steps"] / med,
        "round_seconds": times,
    }


def measure_torch(model: str, torch, device_index: int, batch: int, p: dict) -> dict:
    """The PyTorch twin of ``model`` (bench_models.torch_model) on GPU ``device_index``."""
    dev = torch.device("cuda", device_index)
    runner = bench_models.TorchRunner(model, batch, device=dev)
    for _ in range(p["warmup"]):
        runner.step()
    torch.cuda.synchronize(dev)
    gc.collect()
    torch.cuda.reset_peak_memory_stats(dev)
    for _ in range(p["mem_steps"]):
        runner.step()
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    times = _timed_rounds(
        functools.partial(runner.step, read_loss=False), lambda: torch.cuda.synchronize(dev), p["rounds"], p["steps"]
    )
    med = statistics.median(times)
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "model": model,
        "batch": batch,
        "variant": "PyTorch (BN + ReLU(inplace=True))",
        "framework": "torch",
        "peak_mb": peak / MB,
        "step_ms": 1e3 * med / p["steps"],
        "samples_per_s": batch * p["steps"] / med,
        "round_seconds": times,
    }


def _import_torch_cuda():
    """``(torch, None)`` with CUDA, or ``(None, why)``."""
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return None, "PyTorch is not installed"
    if not torch.cuda.is_available():
        return None, f"PyTorch {torch.__version__} sees no CUDA device"
    return torch, None


def _env(device, torch) -> dict:
    props = backend.device_properties(device)
    env = {
        "gpu": props["name"],
        "device": str(device),
        "cupy": props["cupy"],
        "cupy_choice": backend.cupy_choice(),  # "standin": NumPy on the CPU, not a GPU
        "cuda_runtime": props["cuda_runtime"],
        "cuda_driver": props["cuda_driver"],
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cpu": common.cpu_model(),
    }
    if torch is not None:
        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
    return env


# --- report -------------------------------------------------------------------------------------


def _find(rows, model, variant=None, framework="ours"):
    for row in rows:
        if row["model"] == model and row["framework"] == framework and (variant is None or row["variant"] == variant):
            return row
    return None


def targets(rows) -> list[dict]:
    """The issue's targets, on ResNet-20; ``met`` is None when a row is missing (no PyTorch)."""
    ours_abn, ours_on = _find(rows, TARGET_MODEL, "on+InPlaceABN"), _find(rows, TARGET_MODEL, "on")
    ref = _find(rows, TARGET_MODEL, framework="torch")
    if ours_on is None:
        return []
    batch = ours_on["batch"]
    at = f"ResNet-20 batch {batch}" + ("" if batch == TARGET_BATCH else f" (the target is set at {TARGET_BATCH})")
    out = []

    def add(text, value, met):
        out.append({"target": text, "value": value, "met": met})

    if ours_abn is not None:
        ratio = ours_abn["peak_mb"] / ref["peak_mb"] if ref else None
        add(f"{at}: peak GPU MB, on+InPlaceABN / PyTorch <= 1", ratio, None if ratio is None else ratio <= 1.0)
    for row in (ours_on, ours_abn):
        if row is None:
            continue
        ratio = row["samples_per_s"] / ref["samples_per_s"] if ref else None
        add(
            f"{at}: samples/s, {row['variant']} / PyTorch >= {TORCH_SPEED_RATIO}",
            ratio,
            None if ratio is None else ratio >= TORCH_SPEED_RATIO,
        )
    return out


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown(results: dict) -> str:
    rows = results["rows"]
    lines = [
        "| model | batch | variant | peak MB | peak vs PyTorch | samples/s | samples/s vs PyTorch | step ms "
        "| floor MB | activation MB |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        ref = _find(rows, row["model"], framework="torch")
        ours = row["framework"] == "ours"
        peak_ratio = row["peak_mb"] / ref["peak_mb"] if ours and ref else None
        speed_ratio = row["samples_per_s"] / ref["samples_per_s"] if ours and ref else None
        lines.append(
            f"| {row['model']} | {row['batch']} | {row['variant']} | {row['peak_mb']:.1f} | "
            f"{_num(peak_ratio, '.2f')} | {row['samples_per_s']:.0f} | {_num(speed_ratio, '.2f')} | "
            f"{row['step_ms']:.2f} | {_num(row.get('floor_mb'), '.1f')} | {_num(row.get('activation_mb'), '.1f')} |"
        )
    if results.get("targets"):
        lines += ["", "| target | value | met |", "|---|---:|---|"]
        for t in results["targets"]:
            met = "not checked" if t["met"] is None else ("yes" if t["met"] else "NO")
            lines.append(f"| {t['target']} | {_num(t['value'], '.2f')} | {met} |")
    return "\n".join(lines)


def parse_batches(items) -> dict:
    batches = dict(BATCH)
    for item in items or []:
        name, _, value = item.partition("=")
        if name not in BATCH or not value.isdigit() or int(value) < 1:
            raise SystemExit(f"--batch takes MODEL=N with MODEL one of {', '.join(BATCH)} and N >= 1, got {item!r}")
        batches[name] = int(value)
    return batches


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"fewer steps ({QUICK['rounds']} rounds of {QUICK['steps']}): a smoke run of a few minutes",
    )
    ap.add_argument("--models", nargs="+", default=list(GPU_MODELS), choices=list(GPU_MODELS))
    ap.add_argument(
        "--batch",
        action="append",
        metavar="MODEL=N",
        help=f"batch of a model (default {', '.join(f'{k}={v}' for k, v in BATCH.items())})",
    )
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (median reported)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per timed round")
    ap.add_argument("--device", default="cuda", help="cuda or cuda:N")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch columns")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    batches = parse_batches(args.batch)
    params = dict(QUICK if args.quick else FULL)
    for key in ("rounds", "steps"):
        value = getattr(args, key)
        if value is not None:
            if value < 1:
                raise SystemExit(f"--{key} must be at least 1")
            params[key] = value
    device = fw.device(args.device)
    if device.type != "cuda":
        raise SystemExit(f"--device must be cuda or cuda:N, got {args.device!r}")

    line = no_gpu_line()
    if line is not None:
        print(line, file=sys.stderr)
        return 2

    backend.use_device(device)  # before anything is allocated
    torch, why_no_torch = (None, "--no-torch") if args.no_torch else _import_torch_cuda()
    if torch is not None:
        torch.backends.cudnn.benchmark = True

    def sync():
        backend.synchronize(device)

    rows = []
    with memory.gpu_hook():
        for model in args.models:
            for variant in variants():
                rows.append(measure_ours(model, variant, device, batches[model], params, sync))
            if torch is not None:
                rows.append(measure_torch(model, torch, device.index, batches[model], params))
    results = {
        "benchmark": "bench_gpu",
        "command": common.command_line(),
        "env": _env(device, torch),
        "params": {**params, "quick": args.quick, "batches": {m: batches[m] for m in args.models}},
        "torch_missing": why_no_torch,
        "rows": rows,
    }
    results["targets"] = targets(rows)
    print(markdown(results))
    env = results["env"]
    print(
        f"\n{env['gpu']} ({env['device']}), CuPy {env['cupy']}, CUDA runtime {env['cuda_runtime']}, "
        f"driver {env['cuda_driver']}"
        + (
            f", PyTorch {env['torch']} (cuDNN {env['cudnn']}, benchmark on)"
            if torch is not None
            else f"; no PyTorch column: {why_no_torch}"
        )
    )
    print(
        f"peak: pool hook over {params['mem_steps']} steps after {params['warmup']} warmup steps; "
        f"samples/s: median of {params['rounds']} rounds x {params['steps']} steps, synchronized"
    )
    if env["cupy_choice"] == "standin":
        print(
            "CuPy stand-in (framework.testing.cupy_standin): NumPy on the CPU. The code path and the "
            "pool accounting ran; no GPU did, so these are not GPU numbers"
        )
    if args.json:
        common.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
