#!/usr/bin/env python
"""Train one config: ``python scripts/train.py --config configs/quickstart.yaml [--set k=v ...] [--resume [PATH]]``.

Runs the same way under ``mpiexec -n N``. A mistake in the input (missing file, bad
YAML, unknown key, wrong type, bad value, unknown model or model argument, data that
cannot be read, a checkpoint that cannot be read or trusted) prints one line saying what
is wrong and how to fix it, without a traceback, and exits with status 2; a non-finite
loss stops training with status 3.

Ctrl-C, SIGTERM or SIGUSR1 stop the run after the step in flight, write a checkpoint and
print the command that resumes it (exit status 128 + the signal). ``--resume`` says
where it resumed from; with no checkpoint of this config's run to resume it says so (and
names the other run it found) and exits with status 2 (``checkpoint.resume: auto``
instead starts from step 0 when there is none, for job scripts that run the same command
again). Resuming a run that has already finished changes nothing and prints what the run
printed at its end: its summary and, for a language model, its sample. A new run never
writes into folders another run has written: it writes the next version of its name
(``inplace-auto_np1_v2``) and says so (trainers/runs.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainers.cli import run_cli  # noqa: E402
from trainers.config import ConfigError, load_config  # noqa: E402
from trainers.trainer import DASHBOARD_URL, Interrupted, Trainer, summary_table  # noqa: E402


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
    return run_cli(lambda: _train(args), resume_args=lambda: resume_args(args))


def resume_args(args) -> list[str]:
    """This command's arguments, with ``--resume`` (the latest checkpoint) instead of any other."""
    return ["--config", args.config, *(arg for kv in args.overrides for arg in ("--set", kv)), "--resume"]


def _train(args):

    cfg = load_config(args.config, args.overrides)
    trainer = Trainer(cfg, resume=args.resume)
    if trainer.nothing_to_resume and args.resume:
        if trainer.other_runs:  # one line naming both runs
            raise ConfigError(
                f"--resume: no checkpoint of this config's run in {trainer.ckpt_root}: {trainer.other_runs[0]}; "
                "resume with that run's config, or leave out --resume to start this run at step 0"
            )
        raise ConfigError(
            f"--resume: no checkpoint of run {trainer.run_name} in {trainer.nothing_to_resume}, so nothing to "
            "resume; leave out --resume to start the run at step 0"
        )
    if trainer.comm.is_main:
        if trainer.describe_data():
            print(trainer.describe_data())
        if trainer.nothing_to_resume:
            print(f"checkpoint.resume: no checkpoint in {trainer.nothing_to_resume} yet; training from step 0")
        if trainer.new_version_note():
            print(trainer.new_version_note())
        elif trainer.resumed and not trainer.finished:
            print(f"resumed from step {trainer.step} ({trainer.last_checkpoint})", flush=True)
    result = trainer.fit()
    if not trainer.comm.is_main:
        return 0
    if result is None:
        print(
            f"{trainer.run_name} has already finished: checkpoint {trainer.last_checkpoint} is at step "
            f"{trainer.step} of {trainer.total_steps}; nothing was trained, logged or saved. To train "
            "longer, raise train.max_steps or train.epochs."
        )
        if not trainer.totals_restored:  # an earlier version's checkpoint holds no summary to show
            return 0
        result = trainer.result()  # what the run printed at its end, in case that was lost
    print(summary_table([result]))
    try:
        sample = trainer.sample_text()
    except KeyboardInterrupt:  # the run is complete, and its checkpoint written: --resume writes the sample
        raise Interrupted(
            signal.SIGINT, trainer.step, trainer.total_steps, trainer.last_checkpoint, trainer.run_name
        ) from None
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
