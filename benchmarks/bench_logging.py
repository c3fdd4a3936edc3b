"""What logging and the progress display cost per training step (target: under 3%).

1. The quickstart config through the trainer twice per round, interleaved: with
   TensorBoard logging every 10 steps and the progress display on, and with both
   effectively off (one log point at the end, no display). The difference of the two
   wall times is the logging cost, reported against the step time.

2. Event writers in a loop of small NumPy steps (about 0.5 ms, like the quickstart's),
   a log point of the trainer's 14 tags every 10 steps, interleaved rounds, each
   against the same loop without logging: ``RunLogger`` (tensorboardX's
   ``RecordWriter``, synchronous, one event per log point), ``FileWriter.add_summary``
   (one event per log point, written by tensorboardX's writer thread) and
   ``SummaryWriter.add_scalar`` for each tag. The writer threads cost the loop more
   than the calls themselves take, so only a loop can show it.

3. The calls alone: ``RunLogger.scalars``, ``RunLogger.flush`` (write and fsync; the
   trainer calls it before each checkpoint) and ``Progress.update``.

    python benchmarks/bench_logging.py [--quick] [--repeats N] [--json PATH]
"""

from __future__ import annotations

import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common
else:
    from . import common

TARGET = 0.03
ROOT = Path(__file__).resolve().parents[1]


def _fit(overrides, logdir):
    from trainers.config import load_config  # noqa: PLC0415
    from trainers.trainer import Trainer  # noqa: PLC0415

    base = [
        f"logging.logdir={logdir}",
        f"checkpoint.dir={logdir}/ckpt",
        "logging.timeline=false",
        "train.eval_every=100000",
        "checkpoint.every=0",
    ]
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", base + overrides)
    trainer = Trainer(cfg)
    stderr, sys.stderr = sys.stderr, io.StringIO()  # the bar draws to stderr: keep the table clean
    try:
        t0 = time.perf_counter()
        result = trainer.fit()
        return time.perf_counter() - t0, result.steps
    finally:
        sys.stderr = stderr


TAGS = [
    "train/loss",
    "train/accuracy",
    "perf/samples_per_sec",
    "perf/step_ms",
    "memory/peak_mb",
    "memory/allocated_mb",
    "memory/floor_mb",
] + [
    f"memory/{c}_mb"
    for c in ("parameters", "gradients", "optimizer_state", "activations", "workspace", "inplace_copies", "other")
]
LOG_EVERY = 10


def writer_costs(repeats: int, steps: int) -> dict:
    """Wall time of a loop of small NumPy steps with each event writer, against none.

    Returns ``{"step_ms": ..., "variants": {name: {"ratio": median over rounds of time /
    time without logging, "us_per_log_point": median extra microseconds per log point,
    "seconds": [...]}}}``.
    """
    import numpy as np  # noqa: PLC0415
    from tensorboardX import FileWriter, SummaryWriter  # noqa: PLC0415
    from tensorboardX.proto.summary_pb2 import Summary  # noqa: PLC0415

    from trainers.logging import RunLogger  # noqa: PLC0415

    a = np.random.default_rng(0).random((32, 64), dtype=np.float32)
    b = np.random.default_rng(1).random((64, 256), dtype=np.float32)
    metrics = dict.fromkeys(TAGS, 1.0)
    writers: dict = {}

    def step():  # about what one quickstart step does in NumPy calls
        for _ in range(20):
            c = a @ b
            c += 1.0

    def loop(log):
        def run():
            for i in range(steps):
                step()
                if (i + 1) % LOG_EVERY == 0:
                    log(i)

        return run

    def summary():
        return Summary(value=[Summary.Value(tag=t, simple_value=v) for t, v in metrics.items()])

    def add_scalars(i):
        for tag, value in metrics.items():
            writers["add_scalar"].add_scalar(tag, value, i)

    variants = {
        "no logging": loop(lambda i: None),
        "RunLogger (RecordWriter)": loop(lambda i: writers["RunLogger"].scalars(i, metrics)),
        "FileWriter.add_summary": loop(lambda i: writers["FileWriter"].add_summary(summary(), i)),
        "SummaryWriter.add_scalar x 14": loop(add_scalars),
    }
    with tempfile.TemporaryDirectory() as d:
        runs = iter(range(10**9))

        def setup(name):  # untimed: close the last writer, open a fresh one
            for w in writers.values():
                w.close()
            writers.clear()
            path = os.path.join(d, str(next(runs)))
            if name.startswith("RunLogger"):
                writers["RunLogger"] = RunLogger(path)
            elif name.startswith("FileWriter"):
                writers["FileWriter"] = FileWriter(path, flush_secs=10)
            elif name.startswith("SummaryWriter"):
                writers["add_scalar"] = SummaryWriter(path, flush_secs=10)

        times = common.interleaved(variants, repeats, setup=setup)
        setup("")
    base = times["no logging"]
    log_points = steps // LOG_EVERY
    out = {}
    for name, seconds in times.items():
        ratios = [t / b for t, b in zip(seconds, base)]
        extra = [(t - b) / log_points * 1e6 for t, b in zip(seconds, base)]
        out[name] = {
            "ratio": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "us_per_log_point": statistics.median(extra),
            "seconds": seconds,
        }
    return {"step_ms": statistics.median(base) / steps * 1e3, "variants": out}


def call_costs(repeats: int, calls: int = 200) -> dict:
    """Microseconds per call of the logging pieces the trainer uses at every log point."""
    from trainers.logging import Progress, RunLogger  # noqa: PLC0415

    metrics = dict.fromkeys(TAGS, 1.0)
    out = {}
    with tempfile.TemporaryDirectory() as d:
        logger = RunLogger(os.path.join(d, "run"), flush_secs=120)
        step = iter(range(10**9))
        t = common.time_repeats(lambda: [logger.scalars(next(step), metrics) for _ in range(calls)], repeats)
        out["scalars_us"] = min(t) / calls * 1e6

        def flush():
            logger.scalars(next(step), metrics)
            logger.flush()

        out["flush_ms"] = min(common.time_repeats(flush, repeats)) * 1e3
        logger.close()
    bar = Progress(total=10**6, log_every=10, file=io.StringIO())
    n = 2000
    t = common.time_repeats(
        lambda: [bar.update(i, loss=1.0, samples_per_sec=1.0, peak_mb=1.0) for i in range(n)], repeats
    )
    out["progress_update_us"] = min(t) / n * 1e6
    bar.close()
    return out


def main(argv=None) -> int:
    p = common.parser(__doc__.split("\n\n")[0], default_repeats=5)
    args = p.parse_args(argv)
    repeats = common.repeats_of(args, 5)
    steps = 60 if args.quick else 400
    with tempfile.TemporaryDirectory() as d:
        variants = {
            "logging on": lambda: _fit([f"train.max_steps={steps}", "train.log_every=10", "logging.progress=true"], d),
            "logging off": lambda: _fit(
                [f"train.max_steps={steps}", f"train.log_every={steps}", "logging.progress=false"], d
            ),
        }
        times = {k: [] for k in variants}
        for r in range(repeats):
            for name in list(variants) if r % 2 == 0 else list(variants)[::-1]:
                times[name].append(variants[name]()[0])
    on, off = min(times["logging on"]), min(times["logging off"])
    overhead = (on - off) / off
    paired = statistics.median(a / b - 1 for a, b in zip(times["logging on"], times["logging off"]))
    writers = writer_costs(repeats=3 if args.quick else 4 * repeats, steps=100 if args.quick else 300)
    calls = call_costs(3 if args.quick else 20)
    print(f"# Logging overhead ({common.machine_line()})\n")
    print(
        common.markdown_table(
            ["variant", "steps", "wall s (min)", "ms/step"],
            [[k, steps, f"{min(v):.3f}", f"{1000 * min(v) / steps:.3f}"] for k, v in times.items()],
            [("wall s (min)", "the fastest round's seconds for all steps; ms/step: that over the steps")],
        )
    )
    print(
        f"\nOverhead of logging every 10 steps + progress bar: {100 * overhead:+.2f}% of step time "
        f"(target < {100 * TARGET:.0f}%: {'met' if overhead < TARGET else 'MISSED'}); median of the "
        f"per-round ratios: {100 * paired:+.2f}%"
    )
    variants = writers["variants"]
    print(
        f"\nEvent writers in a loop of {writers['step_ms']:.2f} ms steps, 14 tags every {LOG_EVERY} steps "
        f"(median of {len(variants['no logging']['seconds'])} interleaved rounds):\n"
    )
    print(
        common.markdown_table(
            ["writer", "time / no logging (median)", "min-max", "extra us per log point (median)"],
            [
                [
                    name,
                    f"{w['ratio']:.3f}",
                    f"{w['ratio_min']:.3f}-{w['ratio_max']:.3f}",
                    f"{w['us_per_log_point']:.0f}",
                ]
                for name, w in variants.items()
                if name != "no logging"
            ],
            [
                ("time / no logging (median)", "the loop's time with this writer over without, median of the rounds"),
                ("min-max", "the lowest and highest of those per-round ratios: the spread"),
            ],
        )
    )
    print(
        f"\nRunLogger.scalars with the trainer's 14 tags: {calls['scalars_us']:.1f} us per call; "
        f"RunLogger.flush (write + fsync): {calls['flush_ms']:.2f} ms; "
        f"Progress.update: {calls['progress_update_us']:.2f} us per call"
    )
    if args.json:
        common.write_json(
            args.json,
            {
                "machine": common.machine_info(),
                "command": common.command_line(),
                "steps": steps,
                "times": times,
                "overhead": overhead,
                "overhead_paired_median": paired,
                "calls": calls,
                "writers": writers,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
