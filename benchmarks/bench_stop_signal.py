"""What stopping on a signal costs a data-parallel run: agreeing on it after every step.

Every step ends with the ranks sharing whether any of them got SIGINT, SIGTERM or
SIGUSR1, so that all of them stop after the same step. This measures, on 2 ranks:

1. a blocking MAX-allreduce of one float64 alone: µs per call, a loop of calls after a
   barrier, the slowest rank;
2. a training step of the quickstart MLP (configs/quickstart.yaml: 64-256-256-10 on the
   digits, batch 32 per rank, data parallel) without an agreement, with a blocking one
   after each step, and with the trainer's (``trainers.interrupt.StopAgreement``: a
   non-blocking allreduce started after a step and completed after the next), the
   variants interleaved round by round (``common.interleaved``), ms per step, slowest rank.

Started without MPI it re-launches itself under ``mpiexec -n 2`` (one BLAS thread per
rank), as ``bench_distributed.py`` does. Rank 0 prints the tables.

Run:  python benchmarks/bench_stop_signal.py [--quick] [--repeats N] [--json PATH]
"""

from __future__ import annotations

import os
import sys

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import statistics  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench_distributed, common  # noqa: E402

STEPS_PER_ROUND = 20


def run(args) -> dict:
    from trainers.config import load_config  # noqa: PLC0415
    from trainers.trainer import Trainer, learning_rate  # noqa: PLC0415

    repeats = common.repeats_of(args, 30)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(
        os.path.join(root, "configs", "quickstart.yaml"),
        ["logging.progress=false", "logging.timeline=false", "logging.logdir=/nonexistent"],
    )
    trainer = Trainer(cfg, resume=False)
    comm = trainer.comm
    lr = learning_rate(cfg, 100, trainer.total_steps)
    batches = [trainer._to_tensors(*b) for _, b in zip(range(STEPS_PER_ROUND), trainer.loader)]

    calls = 200 if not args.quick else 20
    agree = []
    for _ in range(repeats):
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            comm.allreduce_scalar(0.0, "max")
        agree.append((time.perf_counter() - t0) / calls)

    from trainers.interrupt import StopAgreement  # noqa: PLC0415

    agreement = StopAgreement(trainer.control_comm)
    agreements = {
        "without": None,
        "blocking": lambda: comm.allreduce_scalar(0.0, "max"),
        "nonblocking": lambda: agreement.after_step(0),
    }

    def steps(name: str):
        agree = agreements[name]

        def go():
            for x, y in batches:
                trainer._train_step([x], [y], lr)  # one micro-batch a step
                if agree is not None:
                    agree()

        return go

    def setup(_name):
        agreement.close()
        comm.barrier()

    times = common.interleaved({name: steps(name) for name in agreements}, repeats=repeats, warmup=1, setup=setup)
    setup(None)
    agree_max = bench_distributed.gather_max(comm, {"agree": agree})["agree"]
    slowest = bench_distributed.gather_max(comm, times)
    per_step = {k: [t / STEPS_PER_ROUND for t in v] for k, v in slowest.items()}
    return {"ranks": comm.size, "agree_s": agree_max, "step_s": per_step, "is_main": comm.is_main}


def report(result: dict, args) -> dict:
    agree = common.summarize(result["agree_s"])
    steps = {k: common.summarize(v) for k, v in result["step_s"].items()}
    base = result["step_s"]["without"]
    extra = {
        k: statistics.median(w - o for o, w in zip(base, v)) for k, v in result["step_s"].items() if k != "without"
    }
    print(f"Stopping on a signal: its agreement across {result['ranks']} ranks\n")
    print(f"Machine: {common.machine_line()}\n")
    rows = [["agreement alone, µs per call", f"{agree['min'] * 1e6:.1f}", f"{agree['median'] * 1e6:.1f}", "-"]]
    for name, s in steps.items():
        more = "-" if name == "without" else f"{extra[name] * 1e6:+.0f} ({100 * extra[name] / s['median']:+.1f}%)"
        rows.append([f"step, {name}, ms", f"{s['min'] * 1e3:.3f}", f"{s['median'] * 1e3:.3f}", more])
    print(
        common.markdown_table(
            ["what", "min", "median", "µs more per step"],
            rows,
            [
                (
                    "agreement alone",
                    "a MAX-allreduce of one float64 after a barrier, mean of a loop of calls, the slowest rank",
                ),
                (
                    "step",
                    f"the quickstart MLP's data-parallel training step, rounds of {STEPS_PER_ROUND} steps, the "
                    f"variants interleaved, {agree['repeats']} rounds, the slowest rank; blocking: a MAX-allreduce "
                    "after each step; nonblocking: the trainer's StopAgreement, an Iallreduce started after each "
                    "step and completed after the next",
                ),
                ("µs more per step", "median over the rounds of (this variant - without), paired round by round"),
            ],
        )
    )
    payload = {
        "machine": common.machine_info(),
        "params": {"quick": args.quick, "ranks": result["ranks"], "steps_per_round": STEPS_PER_ROUND},
        "results": {
            "agree_us": agree["median"] * 1e6,
            "step_ms": {k: v["median"] * 1e3 for k, v in steps.items()},
            "extra_us_per_step": {k: v * 1e6 for k, v in extra.items()},
        },
    }
    if args.json:
        common.write_json(args.json, payload)
    return payload


def _launch(argv: list[str]) -> int:
    """Re-runs this file under ``mpiexec -n 2`` with one BLAS thread per rank."""
    import subprocess  # noqa: PLC0415

    from framework.distributed.comm import find_mpiexec  # noqa: PLC0415

    mpiexec = find_mpiexec()
    if mpiexec is None or not bench_distributed.have_mpi4py():
        print("bench_stop_signal: needs mpi4py and mpiexec (pip install -e '.[mpi]')", file=sys.stderr)
        return 2
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.call([mpiexec, "-n", "2", sys.executable, os.path.abspath(__file__), *argv], env=env)


def main(argv=None):
    args = common.parser(__doc__.split("\n\n")[0], 30).parse_args(argv)
    if not bench_distributed.under_mpiexec():
        return _launch(sys.argv[1:] if argv is None else list(argv))
    result = run(args)
    if result["is_main"]:
        report(result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
