"""What logging and the progress bar cost per training step (target: under 3%).

Runs the quickstart config through the trainer twice per round, interleaved: with
TensorBoard logging every ``train.log_every`` steps and the progress bar on, and with
both effectively off (one log point at the end, no bar). The difference of the two
wall times is the logging cost, reported against the step time. Also times the
logging calls themselves (``RunLogger.scalars`` with the trainer's metrics, and
``Progress.update``) in microseconds.

    python benchmarks/bench_logging.py [--quick] [--repeats N] [--json PATH]
"""

from __future__ import annotations

import io
import os
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

    base = [f"logging.logdir={logdir}", f"checkpoint.dir={logdir}/ckpt", "logging.timeline=false",
            "train.eval_every=100000", "checkpoint.every=0"]
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", base + overrides)
    trainer = Trainer(cfg)
    stderr, sys.stderr = sys.stderr, io.StringIO()  # the bar draws to stderr: keep the table clean
    try:
        t0 = time.perf_counter()
        result = trainer.fit()
        return time.perf_counter() - t0, result.steps
    finally:
        sys.stderr = stderr


def call_costs(repeats: int) -> dict:
    """Microseconds per call of the logging pieces the trainer uses every log point."""
    from trainers.logging import Progress, RunLogger  # noqa: PLC0415

    metrics = {t: 1.0 for t in ("train/loss", "train/accuracy", "perf/samples_per_sec", "perf/step_ms",
                                "memory/peak_mb", "memory/allocated_mb", "memory/floor_mb")}
    metrics.update({f"memory/{c}_mb": 0.5 for c in ("parameters", "gradients", "optimizer_state", "activations",
                                                    "workspace", "inplace_copies", "other")})
    out = {}
    with tempfile.TemporaryDirectory() as d:
        logger = RunLogger(os.path.join(d, "run"))
        n = 200
        t = common.time_repeats(lambda: [logger.scalars(i, metrics) for i in range(n)], repeats)
        out["scalars_us"] = min(t) / n * 1e6
        logger.close()
    bar = Progress(total=10**6, log_every=10, file=io.StringIO())
    n = 2000
    t = common.time_repeats(lambda: [bar.update(i, loss=1.0, samples_per_sec=1.0, peak_mb=1.0) for i in range(n)], repeats)
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
            "logging off": lambda: _fit([f"train.max_steps={steps}", f"train.log_every={steps}",
                                         "logging.progress=false"], d),
        }
        times = {k: [] for k in variants}
        for r in range(repeats):
            for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                times[name].append(variants[name]()[0])
    on, off = min(times["logging on"]), min(times["logging off"])
    overhead = (on - off) / off
    calls = call_costs(3 if args.quick else 20)
    print(f"# Logging overhead ({common.machine_line()})\n")
    print(common.markdown_table(
        ["variant", "steps", "wall s (min)", "ms/step"],
        [[k, steps, f"{min(v):.3f}", f"{1000 * min(v) / steps:.3f}"] for k, v in times.items()],
    ))
    print(f"\nOverhead of logging every 10 steps + progress bar: {100 * overhead:+.2f}% of step time "
          f"(target < {100 * TARGET:.0f}%: {'met' if overhead < TARGET else 'MISSED'})")
    print(f"RunLogger.scalars with the trainer's 14 tags: {calls['scalars_us']:.1f} us per call; "
          f"Progress.update: {calls['progress_update_us']:.2f} us per call")
    if args.json:
        common.write_json(args.json, {"machine": common.machine_info(), "command": common.command_line(),
                                      "steps": steps, "times": times, "overhead": overhead, "calls": calls})
    return 0


if __name__ == "__main__":
    sys.exit(main())
