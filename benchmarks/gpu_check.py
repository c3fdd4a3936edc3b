"""One command for anyone with a CUDA GPU: the suite's gpu leg, bench_gpu.py and compare_inplace.

Checks that real CuPy can use a GPU here (never the stand-in), prints the device and the
versions (GPU, CUDA runtime and driver, CuPy, NumPy, NCCL, cuDNN frontend and PyTorch
where importable), then runs, one after the other, each with its output shown as it comes:

1. the gpu leg of the test suite on real CuPy:
   ``INPLACE_LAB_CUPY=cupy python -m pytest -m gpu`` (``-n auto`` where pytest-xdist is
   installed);
2. ``benchmarks/bench_gpu.py --count`` (its default, small run: every model and variant,
   beside PyTorch when PyTorch sees the GPU; launches and host syncs per step counted on
   the CuPy stand-in in a subprocess);
3. ``benchmarks/bench_gpu.py --models resnet20 --batch resnet20=64``: ResNet-20 at batch
   64, where the compiled step's speed target is set (the default run is at 256);
4. ``scripts/compare_inplace.py --config configs/resnet20_synthetic.yaml --policies
   off,auto,on,on+abn --set device=cuda``;

and ends with one summary table (exit status, seconds and the last line of each). Exit
status: 0 when every step passed, 1 when one failed, 2 (one line on stderr, nothing run)
when no CUDA GPU is usable or the test suite's tools are missing (the GPU extras do not
install pytest: the line gives the install command). ``--list`` prints the steps it would
run and exits.

Install and run (CUDA 13 driver; ``gpu-cuda12`` for a CUDA 12 one):
    pip install -e ".[test,gpu-cuda13]" && python benchmarks/gpu_check.py [--list] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import platform
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import common  # noqa: E402
from framework import backend  # noqa: E402

POLICIES = "off,auto,on,on+abn"
COMPARE_CONFIG = os.path.join("configs", "resnet20_synthetic.yaml")
# seconds each step may take before it is stopped (the gpu leg took 65 s with -n 12 on an H200)
TIMEOUTS = {"gpu leg": 1800, "bench_gpu": 900, "bench_gpu b64": 600, "compare_inplace": 1200}


def steps(out_dir: str) -> list[tuple[str, list[str]]]:
    """``(name, argv)`` of each step, run from the repository root."""
    pytest_argv = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider"]
    if importlib.util.find_spec("xdist") is not None:
        pytest_argv += ["-n", "auto"]
    return [
        ("gpu leg", pytest_argv),
        (
            "bench_gpu",
            [sys.executable, "benchmarks/bench_gpu.py", "--count", "--json", os.path.join(out_dir, "bench_gpu.json")],
        ),
        (
            "bench_gpu b64",
            [
                sys.executable,
                "benchmarks/bench_gpu.py",
                "--models",
                "resnet20",
                "--batch",
                "resnet20=64",
                "--json",
                os.path.join(out_dir, "bench_gpu_b64.json"),
            ],
        ),
        (
            "compare_inplace",
            [
                sys.executable,
                "scripts/compare_inplace.py",
                "--config",
                COMPARE_CONFIG,
                "--policies",
                POLICIES,
                "--set",
                "device=cuda",
            ],
        ),
    ]


# What the first step (the test suite) imports beyond the GPU extras: the test extra's.
TEST_TOOLS = ("pytest", "hypothesis")
INSTALL = 'pip install -e ".[test,gpu-cuda13]"  (gpu-cuda12 for a CUDA 12 driver)'


def missing_test_tools() -> list[str]:
    """The test extra's modules the first step needs that are not installed here."""
    return [m for m in TEST_TOOLS if importlib.util.find_spec(m) is None]


def versions() -> dict:
    """The device and the libraries this check runs with (call only where CuPy sees a GPU)."""
    cp = backend.cupy_module()
    props = backend.device_properties(backend.Device("cuda", 0))
    out = {
        "gpu": f"{props['name']} ({props['total_memory'] / 2**30:.0f} GiB), {backend.device_count()} device(s)",
        "cuda runtime / driver": f"{props['cuda_runtime']} / {props['cuda_driver']}",
        "cupy": cp.__version__,
        "numpy": importlib.import_module("numpy").__version__,
        "python": platform.python_version(),
    }
    nccl = backend.nccl_module()
    out["nccl"] = _nccl_version(nccl.get_version()) if nccl is not None else "not available"
    out["cudnn frontend"] = _optional_version("cudnn", lambda m: f"{m.__version__} (cuDNN {m.backend_version()})")
    out["torch"] = _optional_version("torch", lambda m: f"{m.__version__} (CUDA {m.version.cuda})")
    return out


def _nccl_version(code: int) -> str:
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def _optional_version(module: str, describe) -> str:
    if importlib.util.find_spec(module) is None:
        return "not installed"
    try:
        return describe(importlib.import_module(module))
    except Exception as e:  # noqa: BLE001 - a broken optional library is reported, not fatal
        return f"installed, but {type(e).__name__}: {e}"


def run_step(name: str, argv: list[str], timeout: int) -> dict:
    """Runs one step with its output shown live; returns its exit status, seconds and last line."""
    print(f"\n=== {name}: {' '.join(argv)}", flush=True)
    t0 = time.perf_counter()
    last = ""
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(timeout, proc.kill)  # also when the step hangs without printing
    watchdog.start()
    try:
        for line in proc.stdout:
            print(line, end="", flush=True)
            if line.strip():
                last = line.strip()
        rc = proc.wait()
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
    seconds = time.perf_counter() - t0
    if seconds >= timeout:
        last = f"stopped after {timeout} s; last line: {last}"
    return {"step": name, "exit": rc, "seconds": seconds, "last line": last}


def summary(results: list[dict]) -> str:
    lines = ["| step | exit | seconds | last line |", "|---|---:|---:|---|"]
    for r in results:
        lines.append(f"| {r['step']} | {r['exit']} | {r['seconds']:.0f} | {r['last line'][:160]} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="print the steps it would run, and exit")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "gpu_check"), help="folder for bench_gpu.json")
    args = ap.parse_args(argv)
    missing = missing_test_tools()
    if missing and not args.list:
        print(
            f"error: gpu_check.py's first step runs the test suite, which needs {' and '.join(missing)} "
            f"(the test extra); install with: {INSTALL}; nothing was run",
            file=sys.stderr,
        )
        return 2
    # Real CuPy only, here and in every step: a missing GPU must not run the stand-in.
    os.environ[backend.CUPY_ENV] = "cupy"
    backend.forget_cupy()
    plan = steps(args.out)
    if args.list:
        for name, step_argv in plan:
            print(f"{name}: INPLACE_LAB_CUPY=cupy {' '.join(step_argv)}")
        return 0
    why = backend.cuda_unavailable_reason()
    if why is not None:
        print(f"error: gpu_check.py needs a CUDA GPU that CuPy can use, and {why}; nothing was run", file=sys.stderr)
        return 2
    for key, value in versions().items():
        print(f"{key}: {value}")
    os.makedirs(args.out, exist_ok=True)
    results = [run_step(name, step_argv, TIMEOUTS[name]) for name, step_argv in plan]
    print("\n" + summary(results))
    print(
        common.legend(
            [
                ("exit", "the step's exit status (0: it passed)"),
                ("seconds", "the step's wall-clock time; last line: the last line it printed"),
            ]
        )
    )
    return 0 if all(r["exit"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
