#!/usr/bin/env python
"""Run one experiment under several inplace policies and compare memory and speed.

    python scripts/compare_inplace.py --config configs/resnet20_synthetic.yaml --policies off,on,on+abn

Each policy runs the same config (same seed, same data) into the same TensorBoard
experiment folder, so the runs overlay in one dashboard. ``on+abn`` is policy ``on``
with the model's BatchNorm+activation fused as InPlace-ABN (``model.args.norm``);
``auto`` (and ``auto+abn``) is policy auto, which runs an op in place only where it
proves the input dead (the table shows how many ops per step and the MB they saved).
``compiled`` runs the step compiled (``compile: true``, captured under policy ``off``):
the table adds the compiled step's planned peak and its number of inplace chains.
Prints a table (peak MB, floor MB, MB and % saved against the first policy, samples/s,
final loss, eval metric) and writes ``compare.png`` next to the runs: peak memory and
throughput per policy, and the memory timeline of one step per policy.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainers.cli import run_cli  # noqa: E402

VARIANTS = {"off": ("off", None), "on": ("on", None), "auto": ("auto", None), "on+abn": ("on", "inplace_abn"),
            "off+abn": ("off", "inplace_abn"), "auto+abn": ("auto", "inplace_abn"),
            # the training step compiled (fw.compile), captured under policy off: every inplace
            # decision is the compiler's (docs/COMPILE.md)
            "compiled": ("off", None)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="YAML config file")
    p.add_argument("--policies", default="off,on", help=f"comma-separated, from: {', '.join(VARIANTS)} (default off,on)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key for every run (repeatable)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_cli(lambda: compare(args))


def parse_policies(text: str):
    from trainers.config import ConfigError  # noqa: PLC0415

    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [n for n in names if n not in VARIANTS]
    if bad or not names:
        raise ConfigError(f"unknown policy {', '.join(bad) or '(none)'} in --policies; use a comma-separated list of: {', '.join(VARIANTS)}")
    return names


def compare(args) -> int:
    from trainers.config import load_config  # noqa: PLC0415
    from trainers.logging import default_run_name, format_summary  # noqa: PLC0415
    from trainers.trainer import Trainer  # noqa: PLC0415

    names = parse_policies(args.policies)
    results = []
    for name in names:
        policy, norm = VARIANTS[name]
        compiled = name == "compiled"
        overrides = list(args.overrides) + [f"inplace={policy}", f"compile={str(compiled).lower()}"]
        if norm:
            overrides.append(f"model.args.norm={norm}")
        cfg = load_config(args.config, overrides)
        gc.collect()
        trainer = Trainer(cfg, run_name=default_run_name(policy, 1, "compiled" if compiled else norm))
        results.append((name, trainer.fit()))
        del trainer
    base = results[0][1]
    rows = []
    for name, r in results:
        saved = base.peak_mb - r.peak_mb
        rows.append({
            "policy": name, "peak MB": r.peak_mb, "floor MB": r.floor_mb,
            "saved MB": saved, "saved %": 100.0 * saved / base.peak_mb if base.peak_mb else 0.0,
            "samples/s": r.samples_per_sec, "auto ops/step": r.auto_ops_per_step,
            "auto MB/step": r.auto_saved_mb_per_step,
            "planned MB": r.planned_peak_mb, "inplace chains": r.inplace_chains,
            "final loss": r.final_loss, f"eval {r.eval_name}": r.eval_metric,
        })
    print(format_summary(rows, [(k, k) for k in rows[0]]))
    out = os.path.join(os.path.dirname(base.run_dir), "compare.png")
    write_figure(results, out)
    print(f"figure: {out}\nTensorBoard: tensorboard --logdir {os.path.dirname(base.run_dir)}")
    return 0


def write_figure(results, path: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    names = [n for n, _ in results]
    fig = plt.figure(figsize=(12, 7), constrained_layout=True)
    grid = fig.add_gridspec(2, 2)
    ax = fig.add_subplot(grid[0, 0])
    ax.bar(names, [r.peak_mb for _, r in results], color="tab:blue", label="peak")
    ax.plot(names, [r.floor_mb for _, r in results], "k_", markersize=40, mew=2, label="floor")
    ax.set_ylabel("MB")
    ax.set_title("peak memory per training step")
    ax.legend()
    ax = fig.add_subplot(grid[0, 1])
    ax.bar(names, [r.samples_per_sec for _, r in results], color="tab:green")
    ax.set_ylabel("samples / s")
    ax.set_title("throughput")
    ax = fig.add_subplot(grid[1, :])
    for name, r in results:
        if r.timeline is not None and r.timeline.events:
            t = [e[0] * 1000 for e in r.timeline.events]
            mb = [e[1] / 2**20 for e in r.timeline.events]
            ax.step(t, mb, where="post", label=name)
    ax.set_xlabel("ms into the step")
    ax.set_ylabel("allocated MB")
    ax.set_title("memory timeline of one training step")
    ax.legend()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
