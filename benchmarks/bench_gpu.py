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

- launches and host synchronizations per step (``launches_per_step``,
  ``host_syncs_per_step`` and both by kind): counted over one training step after the
  memory window, on the CuPy stand-in (its ``counting``). Real CuPy counts nothing, so on
  a GPU they are counted only with ``--count``, which runs one step of each variant on
  the stand-in in a subprocess (same model, batch and code path; NumPy does the math);
  without it the columns say "not counted".

Targets (printed with yes/NO): ResNet-20 at batch 256, peak under on+InPlace-ABN <=
PyTorch's; samples/s >= 0.5x PyTorch's.

The default run is small (2 warmup + 2 memory steps, 3 rounds of 5 timed steps per
variant: about a minute on a GPU at today's step times); ``--full`` times 7 rounds of 20.
``--count-only`` builds each variant and counts one step, nothing else (under
``INPLACE_LAB_CUPY=standin``; model ``quickstart`` is the MLP of configs/quickstart.yaml).

Without CuPy and a GPU it prints one line and exits with status 2. Under
``INPLACE_LAB_CUPY=standin`` (the test suite's CuPy stand-in) it runs its whole path on the
CPU and says so: the pool figures are the stand-in's, the speeds are NumPy's.

Run:  python benchmarks/bench_gpu.py [--quick | --full] [--count] [--json PATH] [--models resnet20 ...] [--no-torch]
      INPLACE_LAB_CUPY=standin python benchmarks/bench_gpu.py --count-only --models resnet20 quickstart
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import framework as fw  # noqa: E402
from benchmarks import bench_models, common  # noqa: E402
from framework import backend, memory, optim  # noqa: E402
from framework.testing import cupy_standin  # noqa: E402
from framework.testing.cupy_standin import counting  # noqa: E402
from models import build_model  # noqa: E402

MB = 2**20
GPU_MODELS = ("mlp", "convnet", "resnet20")
BATCH = {"mlp": 256, "convnet": 256, "resnet20": 256}
VARIANT_NAMES = ("off", "on", "auto", "on+InPlaceABN")
# the step compiled with fw.compile (captured under ``off``), replayed as one CUDA graph
COMPILED = ("compiled", "off", False)
TARGET_MODEL, TARGET_BATCH = "resnet20", 256
TORCH_SPEED_RATIO = 0.5
# compiled ResNet-20 samples/s over PyTorch eager's, by batch: (bar, goal)
COMPILED_SPEED = {64: (1.5, 2.5), 256: (1.0, 1.3)}
COMPILED_PEAK_RATIO = 1.0  # the compiled step's peak / eager auto's, same device
COMPILED_WARMUP = 5  # calls before a compiled step replays its graph
# warmup steps, steps in the memory window, timed rounds, steps per round
FULL = {"warmup": 3, "mem_steps": 3, "rounds": 7, "steps": 20}
DEFAULT = {"warmup": 2, "mem_steps": 2, "rounds": 3, "steps": 5}
QUICK = {"warmup": 1, "mem_steps": 1, "rounds": 2, "steps": 2}
QUICKSTART = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "quickstart.yaml")
# Launches one training step may make (SGD with momentum; counted on the CuPy stand-in,
# with no host synchronization), whatever the batch: tests/benchmarks/test_gpu_step_budget.py.
# The MLP's float32 products take three launches more each than one cuDNN call: made in float64
# (framework/ops/matmul_gpu.py).
STEP_LAUNCH_BUDGET = {"resnet20": 400, "quickstart": 55}
NOT_COUNTED = "not counted: real CuPy counts nothing (--count counts one step on the CuPy stand-in)"


def variants():
    """``(name, policy, abn)`` of the compared variants: bench_models.VARIANTS' eager ones,
    then the compiled step (:data:`COMPILED`)."""
    by_name = {v[0]: v for v in bench_models.VARIANTS}
    return [by_name[name] for name in VARIANT_NAMES] + [COMPILED]


class CompiledRunner(bench_models.Runner):
    """bench_models.Runner's model, optimizer and batch, its training step compiled with
    ``fw.compile`` (captured under ``off``; on a GPU it replays as one CUDA graph)."""

    def __init__(self, model_name: str, device="cuda", batch: int | None = None, seed: int = 0):
        super().__init__(model_name, *COMPILED, seed=seed, device=device, batch=batch)
        self.saved_activations_at_boundary = 0  # not observable inside a compiled step

        def train_step(x, y):
            self.opt.zero_grad()
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
            self.opt.step()
            return loss

        self.compiled = fw.compile(train_step, modules=[self.model], optimizers=[self.opt])
        # the batch lives on the host and is uploaded by the compiled step (upload): once a
        # graph is captured, into its static input slots, so it is on the device once
        self.batch_host = (self.x.numpy(), self.y.numpy())
        self.x = self.y = None

    def _batch(self):
        """The batch, uploaded again until it is the graph's own input slots (then kept:
        the graph never writes them, and eager runs reuse their device batch too)."""
        graph = self.compiled.last.executor.cuda_graph if self.compiled.last and self.compiled.last.executor else None
        if self.x is None or graph is None or graph.slot_for(0) is not self.x._data:
            self.x, self.y = self.compiled.upload(*self.batch_host, device=self.device)
        return self.x, self.y

    def step(self, read_loss: bool = True) -> float | None:
        with fw.inplace.policy(self.policy):
            loss = self.compiled(*self._batch())
        return loss.item() if read_loss else None

    def measure_memory(self, warmup: int = 2, steps: int = 1) -> dict:
        out = super().measure_memory(max(warmup, COMPILED_WARMUP), steps)  # the graph's replays
        plan = self.compiled.plan
        out["floor_mb"] = plan.floor_bytes / MB  # the program's: what backward reads from forward
        out["planned_peak_mb"] = plan.planned_peak_bytes / MB
        # one arena holds activations, gradients and temporaries: the categories do not split it
        out["activation_mb"], out["peak_breakdown_mb"] = None, {"arena": plan.arena_bytes / MB}
        return out


def make_runner(model: str, variant, device, batch: int):
    name, policy, abn = variant
    if variant == COMPILED:
        return CompiledRunner(model, device=device, batch=batch)
    return bench_models.Runner(model, name, policy, abn, device=device, batch=batch)


def no_gpu_line() -> str | None:
    """The one error line when no GPU can be used here, else None."""
    why = backend.cuda_unavailable_reason()
    if why is None:
        return None
    return f"error: bench_gpu.py needs CuPy and a CUDA GPU, and {why}; nothing was measured"


# --- launches and host synchronizations --------------------------------------------------------


def counts_here() -> bool:
    """Whether this process's GPU is the CuPy stand-in, the one that counts."""
    return backend.cupy_module() is cupy_standin


def quickstart_config() -> dict:
    with open(QUICKSTART) as f:
        return yaml.safe_load(f)


def quickstart_runner(device="cuda") -> bench_models.Runner:
    """The README's quickstart (configs/quickstart.yaml): its MLP, batch, optimizer and policy."""
    cfg = quickstart_config()
    policy, o = cfg["inplace"], cfg["optim"]
    runner = bench_models.Runner("mlp", "quickstart", policy, False, device=device, batch=cfg["data"]["batch_size"])
    with fw.inplace.policy(policy):
        fw.manual_seed(cfg["seed"])
        runner.model = build_model(cfg["model"]["name"], **cfg["model"]["args"])
        if runner.device.type != "cpu":
            runner.model.to(runner.device)
        runner.opt = optim.SGD(
            runner.model.parameters(), lr=o["lr"], momentum=o["momentum"], weight_decay=o["weight_decay"]
        )
    return runner


def count_training_step(model: str, variant: str = "on", batch: int | None = None, device="cuda", warmup: int = 1):
    """Launches and host syncs of one training step (forward, backward, SGD with momentum;
    the loss left on the device) after ``warmup`` steps, on the CuPy stand-in:
    ``counting.Counts``. ``model`` is one of bench_models.MODELS or ``"quickstart"``
    (whose variant is its config's).

    Raises:
        RuntimeError: the GPU here is not the stand-in (real CuPy counts nothing).
    """
    if not counts_here():
        raise RuntimeError(f"counting needs the CuPy stand-in ({backend.CUPY_ENV}=standin)")
    if model == "quickstart":
        runner = quickstart_runner(device)
    else:
        runner = make_runner(model, {v[0]: v for v in (*bench_models.VARIANTS, COMPILED)}[variant], device, batch)
        if variant == COMPILED[0]:  # captured twice (momentum buffers), recorded, the graph captured
            warmup = max(warmup, COMPILED_WARMUP)
    return counting.count_after(functools.partial(runner.step, read_loss=False), warmup=warmup)


def _count_fields(c) -> dict:
    if c is None:
        return {"launches_per_step": None, "host_syncs_per_step": None}
    return {
        "launches_per_step": c.launches,
        "host_syncs_per_step": c.host_syncs,
        "launches_by_kind": c.by_kind(),
        "host_syncs_by_kind": c.by_kind(syncs=True),
    }


def counts_on_standin(models, batches: dict) -> dict:
    """``{(model, variant): count fields}`` of one step of each, counted in a subprocess on
    the CuPy stand-in (for a run on real CuPy, which counts nothing)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "counts.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--count-only", "--json", out, "--models", *models]
        cmd += [arg for m in models for arg in ("--batch", f"{m}={batches[m]}")]
        env = {**os.environ, backend.CUPY_ENV: "standin"}
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"counting on the stand-in failed: {r.stderr.strip().splitlines()[-1:]}")
        with open(out) as f:
            rows = json.load(f)["rows"]
    return {
        (row["model"], row["variant"]): {k: v for k, v in row.items() if k not in ("model", "variant", "batch")}
        for row in rows
    }


def count_only(models, batches: dict, device) -> list[dict]:
    """One counted step of every variant of every model (and of the quickstart)."""
    rows = []
    for model in models:
        names = ["quickstart"] if model == "quickstart" else [v[0] for v in variants()]
        for name in names:
            batch = quickstart_config()["data"]["batch_size"] if model == "quickstart" else batches[model]
            c = count_training_step(model, name, batch, device)
            rows.append({"model": model, "variant": name, "batch": batch, **_count_fields(c)})
            gc.collect()
    return rows


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
    name = variant[0]
    runner = make_runner(model, variant, device, batch)
    mem = runner.measure_memory(warmup=p["warmup"], steps=p["mem_steps"])
    on_standin = counts_here() and runner.device.type == "cuda"
    counted = counting.count_after(functools.partial(runner.step, read_loss=False), 0) if on_standin else None
    times = _timed_rounds(functools.partial(runner.step, read_loss=False), sync, p["rounds"], p["steps"])
    med = statistics.median(times)
    compiled = {}
    if variant == COMPILED:
        report = runner.compiled.report()
        compiled = {
            "planned_peak_mb": mem["planned_peak_mb"],
            "replay_mode": report["replay_mode"],
            "replay_launches": report["replay_launches"],
        }
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
        **_count_fields(counted),
        "step_ms": 1e3 * med / p["steps"],
        "samples_per_s": batch * p["steps"] / med,
        "round_seconds": times,
        **compiled,
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
    return out + compiled_targets(rows)


def compiled_targets(rows) -> list[dict]:
    """The compiled step's targets on ResNet-20 (``met`` None where a row is missing): its
    samples/s over PyTorch eager's (the bar depends on the batch), its peak over eager
    ``auto``'s, and how it replays."""
    comp = _find(rows, TARGET_MODEL, COMPILED[0])
    if comp is None:
        return []
    batch = comp["batch"]
    ref, auto = _find(rows, TARGET_MODEL, framework="torch"), _find(rows, TARGET_MODEL, "auto")
    out = []
    bar, goal = COMPILED_SPEED.get(batch, (None, None))
    ratio = comp["samples_per_s"] / ref["samples_per_s"] if ref else None
    if bar is None:
        text = f"ResNet-20 batch {batch}: samples/s, compiled / PyTorch eager (bars set at batch 64 and 256)"
        out.append({"target": text, "value": ratio, "met": None})
    else:
        text = f"ResNet-20 batch {batch}: samples/s, compiled / PyTorch eager >= {bar} (goal {goal})"
        out.append({"target": text, "value": ratio, "met": None if ratio is None else ratio >= bar})
    ratio = comp["peak_mb"] / auto["peak_mb"] if auto else None
    out.append(
        {
            "target": f"ResNet-20 batch {batch}: peak GPU MB, compiled / eager auto <= {COMPILED_PEAK_RATIO}",
            "value": ratio,
            "met": None if ratio is None else ratio <= COMPILED_PEAK_RATIO,
        }
    )
    launches = comp.get("replay_launches")
    out.append(
        {
            "target": f"ResNet-20 batch {batch}: a replayed step is one graph launch + copies ({comp['replay_mode']})",
            "value": launches,
            "met": comp["replay_mode"] == "cuda graph",
        }
    )
    return out


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


LEGEND = [
    ("peak MB", "the peak of the GPU memory pool over the measured steps (PyTorch rows: its own); MB = 2^20 bytes"),
    ("peak vs PyTorch, samples/s vs PyTorch", "ours over PyTorch's, same model and batch (peak: lower is better)"),
    ("samples/s", "median of the synchronized rounds; step ms: the same, per step"),
    ("floor MB", "parameters + gradients + optimizer state + what autograd holds for backward"),
    ("activation MB", "peak minus parameters, gradients and optimizer state (compiled: one arena holds all, -)"),
    ("compiled", "the step compiled with fw.compile (captured under off), replayed as one CUDA graph"),
    ("launches/step", "kernel launches of one step (where they were counted: the line below)"),
    ("host syncs/step", "times one step waits for the GPU (a device-to-host copy or synchronize)"),
]


def markdown(results: dict) -> str:
    rows = results["rows"]
    lines = [
        "| model | batch | variant | peak MB | peak vs PyTorch | samples/s | samples/s vs PyTorch | step ms "
        "| floor MB | activation MB | launches/step | host syncs/step |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        ref = _find(rows, row["model"], framework="torch")
        ours = row["framework"] == "ours"
        peak_ratio = row["peak_mb"] / ref["peak_mb"] if ours and ref else None
        speed_ratio = row["samples_per_s"] / ref["samples_per_s"] if ours and ref else None
        lines.append(
            f"| {row['model']} | {row['batch']} | {row['variant']} | {row['peak_mb']:.1f} | "
            f"{_num(peak_ratio, '.2f')} | {row['samples_per_s']:.0f} | {_num(speed_ratio, '.2f')} | "
            f"{row['step_ms']:.2f} | {_num(row.get('floor_mb'), '.1f')} | {_num(row.get('activation_mb'), '.1f')} | "
            f"{_num(row.get('launches_per_step'), 'd')} | {_num(row.get('host_syncs_per_step'), 'd')} |"
        )
    if results.get("targets"):
        lines += ["", "| target | value | met |", "|---|---:|---|"]
        for t in results["targets"]:
            met = "not checked" if t["met"] is None else ("yes" if t["met"] else "NO")
            # 4 decimals: a peak ratio of 1.0003 must not read as 1.00 beside "NO"
            fmt = "d" if isinstance(t["value"], int) else ".4f"
            lines.append(f"| {t['target']} | {_num(t['value'], fmt)} | {met} |")
    return "\n".join(lines)


def parse_batches(items) -> dict:
    batches = dict(BATCH)
    for item in items or []:
        name, _, value = item.partition("=")
        if name not in BATCH or not value.isdigit() or int(value) < 1:
            raise SystemExit(f"--batch takes MODEL=N with MODEL one of {', '.join(BATCH)} and N >= 1, got {item!r}")
        batches[name] = int(value)
    return batches


def count_markdown(rows) -> str:
    lines = [
        "| model | batch | variant | launches/step | host syncs/step | launches by kind |",
        "|---|---:|---|---:|---:|---|",
    ]
    for row in rows:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(row["launches_by_kind"].items(), key=lambda kv: -kv[1]))
        lines.append(
            f"| {row['model']} | {_num(row['batch'], 'd')} | {row['variant']} | {row['launches_per_step']} | "
            f"{row['host_syncs_per_step']} | {kinds} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        action="store_true",
        help=f"fewest steps ({QUICK['rounds']} rounds of {QUICK['steps']}): a smoke run",
    )
    size.add_argument(
        "--full",
        action="store_true",
        help=f"more steps ({FULL['rounds']} rounds of {FULL['steps']}): minutes per model",
    )
    ap.add_argument(
        "--count", action="store_true", help="on real CuPy: count launches and syncs of one step on the CuPy stand-in"
    )
    ap.add_argument(
        "--count-only", action="store_true", help="only count one step of each variant (needs INPLACE_LAB_CUPY=standin)"
    )
    ap.add_argument(
        "--models", nargs="+", default=list(GPU_MODELS), choices=list(GPU_MODELS) + ["quickstart"], metavar="MODEL"
    )
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
    params = dict(QUICK if args.quick else FULL if args.full else DEFAULT)
    for key in ("rounds", "steps"):
        value = getattr(args, key)
        if value is not None:
            if value < 1:
                raise SystemExit(f"--{key} must be at least 1")
            params[key] = value
    device = fw.device(args.device)
    if device.type != "cuda":
        raise SystemExit(f"--device must be cuda or cuda:N, got {args.device!r}")

    if "quickstart" in args.models and not args.count_only:
        raise SystemExit("model quickstart is for --count-only (it has no PyTorch twin nor variants)")

    line = no_gpu_line()
    if line is not None:
        print(line, file=sys.stderr)
        return 2
    if args.count_only:
        if not counts_here():
            raise SystemExit(f"--count-only counts on the CuPy stand-in: run it with {backend.CUPY_ENV}=standin")
        backend.use_device(device)
        rows = count_only(args.models, batches, device)
        print(count_markdown(rows))
        print(common.legend(LEGEND[-2:]))
        if args.json:
            common.write_json(
                args.json, {"benchmark": "bench_gpu --count-only", "command": common.command_line(), "rows": rows}
            )
        return 0

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
    counts_note = None
    if not counts_here():
        if args.count:
            counted = counts_on_standin(args.models, batches)
            for row in rows:
                row.update(counted.get((row["model"], row["variant"]), {}))
            counts_note = "launches and host syncs counted on the CuPy stand-in, one step of each variant"
        else:
            counts_note = NOT_COUNTED
    results = {
        "benchmark": "bench_gpu",
        "command": common.command_line(),
        "env": _env(device, torch),
        "params": {**params, "quick": args.quick, "batches": {m: batches[m] for m in args.models}},
        "torch_missing": why_no_torch,
        "counts": counts_note
        or "launches and host syncs counted on the CuPy stand-in, one step after the memory window",
        "rows": rows,
    }
    results["targets"] = targets(rows)
    print(markdown(results))
    print(common.legend(LEGEND))
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
        f"samples/s: median of {params['rounds']} rounds x {params['steps']} steps, synchronized; "
        f"launches/step: {results['counts']}"
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
