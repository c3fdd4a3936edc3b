#!/usr/bin/env python
"""Run one experiment under several inplace policies and compare memory and speed.

    python scripts/compare_inplace.py --config configs/resnet20_synthetic.yaml --policies off,on,on+abn

Each policy trains the same config (same seed, same data) into the same TensorBoard
experiment folder, so the runs overlay in one dashboard; its progress display is
labelled with the policy. A comparison takes an experiment folder no run has written:
``runs/<experiment>``, or where that holds runs already, its next version
``runs/<experiment>_v2`` (and so on; checkpoints alike), so that one folder holds one
comparison's runs and its figure (trainers/runs.py). A policy (``off``, ``on``, ``auto``) may carry model variants
after ``+``, which change what backward keeps without changing the function:
``+abn`` fuses the model's BatchNorm + activation as InPlace-ABN (``model.args.norm``);
for the GPT, ``+meln`` makes its LayerNorms memory-efficient (``model.args.layer_norm``)
and ``+fused`` runs attention as one ``scaled_dot_product_attention``
(``model.args.attention``); they combine (``on+meln+fused``). ``+full`` and
``+selective`` recompute in backward what the model would keep (``recompute``,
docs/RECOMPUTE.md: whole blocks, or a GPT's attention core / a ResNet block's
BatchNorms and activations), at a step-time cost the samples/s column shows. ``+bf16`` or
``+fp16`` runs the forward and loss in mixed precision (``precision``: autocast, and with
fp16 a GradScaler; docs/PRECISION.md): activations in 16 bits, other roundings. ``auto`` is policy auto,
which runs an op in place only where it proves the input dead (the table then shows how
many ops per step and the MB they saved). ``compiled`` runs the step compiled
(``compile: true``, captured under policy ``off``): the table then adds the compiled
step's planned peak and its number of inplace chains. Step variants change how a step runs
(docs/ZERO.md): ``+zero1`` and ``+zero2`` shard the optimizer state (and the gradients)
across processes, so the comparison runs under ``mpiexec -n N`` (every variant then runs
on N ranks; rank 0 reports), and ``+acc<k>`` makes each step k micro-batches of
``data.batch_size`` (``auto+acc4``); they combine with the others (``auto+zero2+acc2``).

Memory (peak, floor) comes from the training runs. Throughput is measured apart, as a
distribution: ``--rounds`` rounds of ``--round-steps`` training steps per policy, the
policies taking turns in a rotating order so that a busy machine slows them alike. The
table shows the median samples/s, the spread of the rounds and the speed against the
first policy, marked ``(noise)`` when the rounds do not agree on its sign.

Writes ``compare.png`` next to the runs: peak and floor memory, samples/s per round,
and each policy's memory timeline of one step against the position in the step. Each
run's ``memory/timeline`` image is logged once every policy has run, all on one MB scale.

Ctrl-C, SIGTERM or SIGUSR1 stop the policy in training after the step in flight, write
its checkpoint and print the command that resumes the comparison: ``--resume`` goes on in
the newest version of the experiment folder that holds a checkpoint of one of its runs,
skips the policies whose runs finished, resumes the one that was stopped, then trains the rest.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from framework.distributed.comm import get_world  # noqa: E402
from trainers import runs  # noqa: E402
from trainers.cli import run_cli  # noqa: E402
from trainers.config import ConfigError, load_config  # noqa: E402
from trainers.logging import (  # noqa: E402
    RunLogger,
    format_summary,
    plot_comparison,
    timeline_png,
    timeline_positions,
)
from trainers.logging.tables import MB  # noqa: E402
from trainers.trainer import DASHBOARD_URL, SUMMARY_LEGEND, Trainer  # noqa: E402

POLICIES = ("off", "on", "auto")
# What a ``+variant`` after a policy changes in the model: what backward keeps, never the function.
MODEL_VARIANTS = {
    "abn": "model.args.norm=inplace_abn",  # BatchNorm + activation as InPlace-ABN (MLP, ConvNet, ResNet)
    "meln": "model.args.layer_norm=memory_efficient",  # GPT: LayerNorms keep their output, not their input
    "fused": "model.args.attention=fused",  # GPT: attention as one scaled_dot_product_attention
    "full": "recompute=full",  # ResNet, GPT: each block keeps its input and runs again in backward
    "selective": "recompute=selective",  # GPT: the attention core recomputed; ResNet: BN and activations
}
# What a ``+variant`` changes in how the step computes: its precision (docs/PRECISION.md),
# at most one per entry. These change the numbers (rounding), unlike the model variants.
PRECISION_VARIANTS = {
    "bf16": "precision=bf16",  # forward and loss under autocast in bfloat16
    "fp16": "precision=fp16",  # ... in float16, the loss scaled (GradScaler)
}
# the step compiled (fw.compile) and captured under off: every inplace decision is the
# compiler's (docs/COMPILE.md)
COMPILED = "compiled"


# What a ``+variant`` changes in how a step runs (docs/ZERO.md); the run's name shows it
# (``_zero2``, ``_acc4``). ZeRO needs the comparison run under mpiexec; ``acc<k>``: k micro-batches.
STEP_VARIANTS = {"zero1": "distributed.zero=1", "zero2": "distributed.zero=2"}


def _override(extra: str) -> str | None:
    """The config override of one ``+variant``, or None."""
    if extra in MODEL_VARIANTS:
        return MODEL_VARIANTS[extra]
    if extra in PRECISION_VARIANTS:
        return PRECISION_VARIANTS[extra]
    if extra in STEP_VARIANTS:
        return STEP_VARIANTS[extra]
    m = re.fullmatch(r"acc([1-9][0-9]*)", extra)
    return f"train.accumulate={m.group(1)}" if m else None


def variant(name: str):
    """``(policy, config overrides)`` of a --policies entry such as ``on+meln+fused``, or None."""
    if name == COMPILED:
        return "off", []
    policy, *extras = name.split("+")
    overrides = [_override(e) for e in extras]
    keys = [o.split("=")[0] for o in overrides if o is not None]
    if policy not in POLICIES or None in overrides or len(set(keys)) != len(keys):
        return None  # unknown, or two variants of one key (+zero1+zero2, +acc2+acc4, +full+selective, +bf16+fp16)
    return policy, overrides


VARIANTS_HELP = (
    f"{', '.join(POLICIES)} or {COMPILED}; a policy may add "
    f"+{', +'.join([*MODEL_VARIANTS, *PRECISION_VARIANTS, *STEP_VARIANTS])}, "
    "+acc<k> (e.g. on+abn, auto+meln+fused, auto+bf16, auto+acc4; +zero under mpiexec)"
)


WARMUP_STEPS = 5  # untimed training steps before the runs (see compare)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="YAML config file")
    p.add_argument("--policies", default="off,on", help=f"comma-separated: {VARIANTS_HELP} (default off,on)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key for every run (repeatable)",
    )
    p.add_argument("--rounds", type=int, default=5, help="throughput rounds per policy (default 5)")
    p.add_argument("--round-steps", type=int, default=5, help="training steps per throughput round (default 5)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="go on where a stopped comparison stopped: finished runs are kept, the stopped one resumed",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_cli(lambda: compare(args), resume_args=lambda: resume_args(args))


def resume_args(args) -> list[str]:
    """This command's arguments, with ``--resume``."""
    sets = [arg for kv in args.overrides for arg in ("--set", kv)]
    rounds = ["--rounds", str(args.rounds), "--round-steps", str(args.round_steps)]
    return ["--config", args.config, "--policies", args.policies, *sets, *rounds, "--resume"]


def parse_policies(text: str):

    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [n for n in names if variant(n) is None]
    if bad or not names:
        raise ConfigError(
            f"unknown policy {', '.join(bad) or '(none)'} in --policies; use a comma-separated list of: {VARIANTS_HELP}"
        )
    if len(set(names)) != len(names):
        raise ConfigError(f"--policies names a policy twice ({text}); name each once")
    return names


def policy_config(args, name: str, experiment: str | None = None):
    """The config of one policy's run (in ``experiment`` where given: the comparison's folder)."""
    policy, variants = variant(name)
    # Each policy gets its own run folder, named after it (logging.run_name would put them in one;
    # a model variant that the run name does not show, +meln or +fused, gets it spelled out).
    unnamed = any(v.startswith("model.args.") and "inplace_abn" not in v for v in variants)
    overrides = list(args.overrides) + [
        f"inplace={policy}",
        f"logging.run_name={'inplace-' + name.replace('+', '_') if unnamed else 'null'}",
        f"compile={str(name == COMPILED).lower()}",
    ]
    if experiment is not None:
        overrides.append(f"experiment={experiment}")
    return load_config(args.config, overrides + variants)


def comparison_experiment(args, names, configs) -> str:
    """The experiment folder of this comparison (trainers/runs.py): a new comparison takes one
    no run has written (the configured one, or its next version); ``--resume`` the newest one
    that holds a checkpoint of one of its runs. Rank 0 decides, every rank follows."""
    first = configs[names[0]]
    logdir, ckpt_dir, experiment = first.logging.logdir, first.checkpoint.dir, first.experiment
    comm = get_world()
    chosen = None
    if comm.is_main:
        if args.resume:
            chosen = runs.find_experiment(experiment, logdir, ckpt_dir, [c.to_dict() for c in configs.values()])
        else:
            chosen = runs.next_free_experiment(experiment, logdir, ckpt_dir)
    if comm.size > 1:
        chosen = comm.broadcast_object(chosen, root=0)
    if chosen is None:
        raise ConfigError(
            f"--resume: no checkpoint of this comparison's runs in {os.path.join(ckpt_dir, experiment)} (nor in a "
            "later version of it), so nothing to resume; leave out --resume to start the comparison"
        )
    if chosen != experiment and comm.is_main:
        if args.resume:
            print(f"resuming the comparison in {os.path.join(logdir, chosen)}", flush=True)
        else:
            print(
                f"{os.path.join(logdir, experiment)} already holds runs: this comparison writes "
                f"{os.path.join(logdir, chosen)}",
                flush=True,
            )
    return chosen


def compare(args) -> int:

    names = parse_policies(args.policies)
    if args.rounds < 1 or args.round_steps < 1:
        raise ConfigError(f"--rounds and --round-steps must be >= 1, got {args.rounds} and {args.round_steps}")
    configs = {name: policy_config(args, name) for name in names}
    experiment = comparison_experiment(args, names, configs)
    if experiment != configs[names[0]].experiment:
        configs = {name: policy_config(args, name, experiment) for name in names}

    # The first training steps of a process run slower for a while: on the quickstart
    # config, the first of three identical runs logged about half the samples/s of the
    # other two, and after 5 untimed steps of a throwaway trainer all three agreed. Warm
    # up once, so that no policy's logged throughput carries that cost.
    warm = Trainer(configs[names[0]], resume=False)
    warm.time_steps(WARMUP_STEPS)
    del warm

    # Memory, losses and TensorBoard runs: one training run per policy. Only one trainer
    # is alive at a time, so no run's peak holds another run's model.
    results = {}
    for name in names:
        gc.collect()
        trainer = Trainer(configs[name], resume="auto" if args.resume else False, label=name, timeline_image=False)
        main = trainer.comm.is_main
        if args.resume and main:
            print(resume_line(name, trainer), flush=True)
        results[name] = trainer.result() if trainer.finished else trainer.fit()
        del trainer
    if main:
        log_timelines(results)

    rates = measure_throughput(Trainer, configs, args.rounds, args.round_steps)
    if not main:  # under mpiexec rank 0 reports
        return 0
    print(format_summary(*table(names, results, rates), legend(names[0], args.rounds, args.round_steps)))
    best = min(names, key=lambda n: results[n].peak_mb)
    base = results[names[0]].peak_mb
    if best != names[0] and base > 0:
        saved = base - results[best].peak_mb
        print(
            f"lowest peak: {best}, {results[best].peak_mb:.1f} MB, {saved:.1f} MB ({100 * saved / base:.1f}%) "
            f"below {names[0]}'s {base:.1f} MB"
        )
    experiment = os.path.dirname(results[names[0]].run_dir)
    out = os.path.join(experiment, "compare.png")
    runs = [
        {
            "name": n,
            "peak_mb": results[n].peak_mb,
            "floor_mb": results[n].floor_mb,
            "samples_per_sec": rates[n],
            "timeline": results[n].timeline,
        }
        for n in names
    ]
    plot_comparison(runs, title=f"{configs[names[0]].experiment}: inplace policies").savefig(out)
    print(f"figure: {out}\nTensorBoard: tensorboard --logdir {experiment}  (then open {DASHBOARD_URL})")
    return 0


def resume_line(name: str, trainer) -> str:
    """What ``--resume`` does with one policy's run, in one line."""
    if trainer.finished:
        return f"{name}: finished at step {trainer.step} ({trainer.last_checkpoint}); kept as it is"
    if trainer.resumed:
        return f"{name}: resumed from step {trainer.step} ({trainer.last_checkpoint})"
    line = f"{name}: no checkpoint in {trainer.nothing_to_resume} yet; training from step 0"
    return line + (f" ({trainer.new_version_note()})" if trainer.new_version_note() else "")


def log_timelines(results: dict) -> None:
    """Logs each run's ``memory/timeline`` image, all on one MB scale (the highest of them).

    A run's image is logged once: a run that already has its ``timeline.png`` (an earlier
    ``--resume`` of this comparison logged it) is left alone.
    """
    drawn = {n: r for n, r in results.items() if r.timeline is not None}
    tops = [max(timeline_positions(r.timeline)[1], default=0.0) for r in drawn.values()]
    tops += [r.timeline_floor_mb for r in drawn.values() if r.timeline_floor_mb is not None]
    for r in drawn.values():
        if os.path.exists(timeline_png(r.run_dir)):
            continue
        with RunLogger(r.run_dir, append=True) as logger:
            floor = r.timeline_floor_mb * MB if r.timeline_floor_mb is not None else None
            logger.timeline_figure(r.timeline_step, r.timeline, floor_bytes=floor, top_mb=max(tops))


def measure_throughput(trainer_cls, configs: dict, rounds: int, steps: int) -> dict[str, list[float]]:
    """Samples/s of ``rounds`` rounds of ``steps`` steps per policy, the order rotating each round.

    Each policy gets a fresh trainer (nothing logged or saved), warmed up by one
    untimed step; all stay alive so that the rounds can alternate.
    """
    trainers = {name: trainer_cls(cfg, resume=False) for name, cfg in configs.items()}
    for trainer in trainers.values():
        trainer.time_steps(1 if trainer.compiled is None else 2)  # a compiled step captures twice
    names = list(trainers)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            gc.collect()
            gc.disable()  # a collection inside one round would land on one policy only
            try:
                rates[name].append(trainers[name].time_steps(steps))
            finally:
                gc.enable()
    return rates


def table(names, results, rates):
    """Rows and columns of the summary; the auto columns only when an auto policy ran."""
    base, base_rates = results[names[0]], rates[names[0]]
    rows = []
    for name in names:
        r, rate = results[name], rates[name]
        saved = base.peak_mb - r.peak_mb
        median = statistics.median(rate)
        row = {
            "policy": name,
            "peak MB": r.peak_mb,
            "floor MB": r.floor_mb,
            "saved MB": saved,
            "saved %": 100.0 * saved / base.peak_mb if base.peak_mb else 0.0,
            "samples/s": median,
            "spread %": 100.0 * (max(rate) - min(rate)) / median,
            f"vs {names[0]}": "-" if name == names[0] else speed_vs(rate, base_rates),
            "auto ops/step": r.auto_ops_per_step,
            "auto MB/step": r.auto_saved_mb_per_step,
            "planned MB": r.planned_peak_mb,
            "inplace chains": r.inplace_chains,
            "final loss": r.final_loss,
            f"eval {r.eval_name}": r.eval_metric,
        }
        rows.append(row)
    keys = list(rows[0])
    if not any(variant(n)[0] == "auto" for n in names):
        keys = [k for k in keys if not k.startswith("auto ")]
    if COMPILED not in names:
        keys = [k for k in keys if k not in ("planned MB", "inplace chains")]
    return rows, [(k, k) for k in keys]


def legend(base: str, rounds: int, steps: int) -> list[tuple[str, str]]:
    """What the table's columns mean; format_summary prints the lines of the columns shown."""
    meaning = dict(SUMMARY_LEGEND)
    return [
        ("peak MB", meaning["peak MB"]),
        ("floor MB", meaning["floor MB"]),
        ("saved MB, saved %", f"peak MB below {base}'s peak MB (the first policy)"),
        (
            "samples/s",
            f"median of {rounds} rounds of {steps} training steps per policy, measured after the runs "
            "with the policies taking turns; spread %: (max - min) / median",
        ),
        (f"vs {base}", "median of the per-round speed ratios; (noise) when the rounds disagree on its sign"),
        (
            "auto ops/step, auto MB/step",
            "per step, the writes policy auto ran in place (ops it proved dead; its writes over gradients, "
            "optimizer state, linear's output) and the MB they did not allocate: a sum over the step, "
            "larger than the drop of the peak",
        ),
        ("planned MB", "the compiled step's planned peak; inplace chains: its chains of ops run in place"),
        ("final loss", meaning["final loss"]),
        ("eval accuracy", meaning["eval accuracy"]),
        ("eval mse", meaning["eval mse"]),
        ("eval loss", meaning["eval loss"]),
    ]


def speed_vs(rates: list[float], base: list[float]) -> str:
    """Median speed-up over ``base`` from paired rounds, e.g. ``+3.1%`` or ``-0.4% (noise)``."""
    ratios = [a / b for a, b in zip(rates, base)]
    text = f"{100.0 * (statistics.median(ratios) - 1.0):+.1f}%"
    return text + " (noise)" if min(ratios) <= 1.0 <= max(ratios) else text


if __name__ == "__main__":
    sys.exit(main())
