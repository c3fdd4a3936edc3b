#!/usr/bin/env python
"""Train one config: ``python scripts/train.py --config configs/quickstart.yaml [--set k=v ...] [--resume [PATH]]``.

Runs the same way under ``mpiexec -n N``. A mistake in the input (missing file, bad
YAML, unknown key, wrong type, bad value, unknown model or model argument, a checkpoint
that cannot be read or trusted) prints one line saying what is wrong and how to fix it,
without a traceback, and exits with status 2; a non-finite loss stops training with
status 3. Resuming a run that has already finished says so and changes nothing.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainers.cli import run_cli  # noqa: E402
from trainers.config import load_config  # noqa: E402
from trainers.trainer import DASHBOARD_URL, Trainer, summary_table  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", required=True, help="YAML config file (see configs/ and docs/CONFIG.md)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set optim.lr=0.05 --set inplace=off (repeatable)",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        default=None,
        metavar="PATH",
        help="resume from a checkpoint: a path, or no value for the run's latest checkpoint",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_cli(lambda: _train(args))


def _train(args):

    cfg = load_config(args.config, args.overrides)
    trainer = Trainer(cfg, resume=args.resume)
    if trainer.comm.is_main and trainer.describe_data():
        print(trainer.describe_data())
    result = trainer.fit()
    if not trainer.comm.is_main:
        return 0
    if result is None:
        print(
            f"{trainer.run_name} has already finished: checkpoint {trainer.last_checkpoint} is at step "
            f"{trainer.step} of {trainer.total_steps}; nothing was trained, logged or saved. To train "
            "longer, raise train.max_steps or train.epochs."
        )
        return 0
    print(summary_table([result]))
    sample = trainer.sample_text()
    if sample is not None:
        baseline = trainer.train_set.unigram_loss
        print(
            f"validation loss {result.eval_metric:.3f} nats/token; the unigram baseline (training token "
            f"frequencies) {baseline:.3f}\nsample:\n{sample}"
        )
    experiment = os.path.dirname(result.run_dir)
    print(f"TensorBoard logs: {result.run_dir}  (tensorboard --logdir {experiment}, then open {DASHBOARD_URL})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
