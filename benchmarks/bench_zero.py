"""Per-rank memory of ZeRO stages 0, 1 and 2 against Rajbhandari et al.'s accounting.

Started without MPI (``python benchmarks/bench_zero.py``) it runs itself under
``mpiexec -n N`` for each N of ``--ranks`` (default 2 and 4; the mpiexec beside
``sys.executable``, else the one on PATH), one BLAS thread per rank, and prints one table.
Started under ``mpiexec`` it measures that world and writes its rows to ``--rows``.

Each rank trains an MLP (float32, no buffers: every byte of category ``parameters`` is a
parameter) under DataParallel for two steps per stage and optimizer, the stages one after
the other in one job, and reads :mod:`framework.memory`'s categories ``parameters +
gradients + optimizer_state`` right after the second step's update, when the three are all
held: what a rank keeps between steps. The formula, for Ψ parameters of 4 bytes and K
bytes of optimizer state per parameter (Adam: K = 8; SGD with momentum: 4), is stage 0
``(4 + 4 + K) Ψ``, stage 1 ``8 Ψ + K Ψ / N``, stage 2 ``4 Ψ + (4 + K) Ψ / N``
(:func:`framework.distributed.zero.model_state_bytes`). The step's peak (every live
array: activations and the step's temporaries too) is the highest of the two steps.

The paper's mixed-precision split (fp16 parameters and gradients, 2 + 2 bytes, and 12
bytes of fp32 master weights and Adam moments: stage 0 ``16 Ψ``, stage 1 ``4 Ψ + 12 Ψ / N``,
stage 2 ``2 Ψ + 14 Ψ / N``) is printed as the formula only, until ``precision:`` lands.

Run:  python benchmarks/bench_zero.py [--ranks 2,4] [--quick] [--json PATH]
"""

from __future__ import annotations

import os
import sys

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import framework as fw  # noqa: E402
from benchmarks import common  # noqa: E402
from framework import memory, nn  # noqa: E402
from framework.distributed.comm import find_mpiexec  # noqa: E402
from framework.distributed.data_parallel import DataParallel  # noqa: E402
from framework.distributed.zero import ZeroRedundancyOptimizer, model_state_bytes  # noqa: E402

MB = 2**20
HEADERS = ["ranks", "optimizer", "stage", "bytes/Ψ", "held MB", "formula MB", "held / formula", "spread B", "peak MB"]
_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")
_LOAD_ENV = "INPLACE_BENCH_LOAD_BEFORE"
OPTIMIZERS = {  # name -> (class, hyperparameters, bytes of state per float32 parameter)
    "adam": (fw.optim.Adam, {"lr": 1e-3}, 8),
    "sgd momentum": (fw.optim.SGD, {"lr": 0.01, "momentum": 0.9}, 4),
}


def under_mpiexec() -> bool:
    return any(v in os.environ for v in _MPI_ENV)


def mlp(width: int) -> nn.Module:
    fw.manual_seed(0)
    return nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def measure(comm, stage: int, optimizer: str, width: int, batch: int, bucket_mb: float) -> dict:
    """Two steps; this rank's parameters + gradients + optimizer state after the second, and the peak."""
    gc.collect()
    model = mlp(width)
    dp = DataParallel(model, comm=comm, bucket_mb=bucket_mb)
    cls, kwargs, _ = OPTIMIZERS[optimizer]
    if stage:
        opt = ZeroRedundancyOptimizer(dp.parameters(), cls, data_parallel=dp, stage=stage, **kwargs)
    else:
        opt = cls(dp.parameters(), **kwargs)
    rng = np.random.default_rng(comm.rank)
    peak = 0
    for _ in range(2):
        x = fw.tensor(rng.standard_normal((batch, 256)).astype(np.float32))
        y = fw.tensor(rng.integers(0, 10, batch))
        memory.reset_peak()
        opt.zero_grad()
        nn.CrossEntropyLoss()(dp(x), y).backward()
        dp.finish()
        opt.step()
        peak = max(peak, memory.max_allocated_bytes("cpu"))
    held = memory.breakdown("cpu")
    parts = {k: held[k] for k in ("parameters", "gradients", "optimizer_state")}
    return {"held": sum(parts.values()), "parts": parts, "peak": peak}


def run_world(argv: list[str], args) -> int:
    from framework.distributed.comm import get_world, install_abort_on_exception  # noqa: PLC0415

    comm = get_world()
    install_abort_on_exception(comm)
    width = 256 if args.quick else 1024
    batch = 8
    numel = sum(p.numel() for p in mlp(width).parameters())
    rows = []
    for optimizer, (_, _, state) in OPTIMIZERS.items():
        for stage in (0, 1, 2):
            mine = measure(comm, stage, optimizer, width, batch, args.bucket_mb)
            every = comm.allgather_object(mine)
            want = model_state_bytes(numel, 4, state, stage, comm.size)
            rows.append(
                {
                    "ranks": comm.size,
                    "optimizer": optimizer,
                    "stage": stage,
                    "params": numel,
                    "held_min": min(r["held"] for r in every),
                    "held_max": max(r["held"] for r in every),
                    "parts_rank0": every[0]["parts"],
                    "formula": want,
                    "peak_max": max(r["peak"] for r in every),
                    "bucket_mb": args.bucket_mb,
                }
            )
    if comm.rank == 0:
        with open(args.rows, "w") as f:
            json.dump(rows, f)
    return 0


def launch(argv: list[str], args) -> list[dict]:
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise SystemExit("bench_zero: needs mpi4py and mpiexec (pip install -e '.[mpi]')")
    env = dict(os.environ, **{v: "1" for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.ranks:
            out = os.path.join(tmp, f"rows{n}.json")
            cmd = [mpiexec, "-n", str(n), sys.executable, os.path.abspath(__file__), *argv, "--rows", out]
            code = subprocess.call(cmd, env=env)
            if code:
                raise SystemExit(f"bench_zero: the {n}-rank job failed (exit {code})")
            with open(out) as f:
                rows += json.load(f)
    return rows


def report(rows: list[dict], load_before: str) -> str:
    table = []
    for r in rows:
        table.append(
            [
                r["ranks"],
                r["optimizer"],
                r["stage"],
                f"{r['held_max'] / r['params']:.3f}",
                f"{r['held_max'] / MB:.3f}",
                f"{r['formula'] / MB:.3f}",
                f"{r['held_max'] / r['formula']:.5f}",
                r["held_max"] - r["held_min"],
                f"{r['peak_max'] / MB:.2f}",
            ]
        )
    psi = rows[0]["params"]
    worlds = sorted({r["ranks"] for r in rows})
    lines = [
        f"ZeRO per rank: an MLP of {psi:,} float32 parameters (Ψ), batch 8 per rank, buckets of "
        f"{rows[0]['bucket_mb']:g} MiB, after the update of step 2",
        common.machine_line(),
        f"load average (1 / 5 / 15 min) before: {load_before}, after: {_load()}",
        "",
        common.markdown_table(
            HEADERS,
            table,
            [
                ("held MB", "framework.memory's parameters + gradients + optimizer_state on a rank (the most of any)"),
                ("bytes/Ψ", "held MB in bytes per parameter"),
                ("spread B", "bytes the rank holding most holds more than the one holding least (the padding)"),
                ("formula MB", "Rajbhandari et al.: (4 + 4 + K)Ψ, 8Ψ + KΨ/N, 4Ψ + (4 + K)Ψ/N; K = 8 (Adam), 4"),
                ("peak MB", "every live array during a step (activations, temporaries), the most of any rank"),
            ],
        ),
        "",
        "mixed precision (the paper's 2Ψ + 2Ψ + 12Ψ, Adam), formula only until precision: is measured:",
        common.markdown_table(
            ["ranks", "stage 0 MB", "stage 1 MB", "stage 2 MB"],
            [[n, *(f"{model_state_bytes(psi, 2, 12, s, n) / MB:.2f}" for s in (0, 1, 2))] for n in worlds],
        ),
    ]
    return "\n".join(lines)


def _load() -> str:
    try:
        return " / ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    p = common.parser(__doc__.splitlines()[0], default_repeats=1)
    p.add_argument("--ranks", default="2,4", help="the world sizes to measure (default 2,4)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DataParallel's bucket size (default 25, its own)")
    p.add_argument("--rows", default=None, help=argparse.SUPPRESS)  # where a job writes its rows
    args = p.parse_args(argv)
    args.ranks = [int(n) for n in args.ranks.split(",")]
    if under_mpiexec():
        return run_world(argv, args)
    load_before = _load()
    rows = launch(argv, args)
    print(report(rows, load_before))
    worst = max(abs(r["held_max"] / r["formula"] - 1) for r in rows)
    print(f"largest difference from the formula: {100 * worst:.3f}% (target: within 2%)")
    if args.json:
        common.write_json(args.json, {"machine": common.machine_info(), "rows": rows, "command": common.command_line()})
    return rows


if __name__ == "__main__":
    out = main()
    sys.exit(out if isinstance(out, int) else 0)
