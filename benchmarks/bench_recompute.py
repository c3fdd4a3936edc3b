"""What recomputation costs in step time, and what it saves, beside PyTorch's checkpoint.

A training step (forward, backward, AdamW) of the GPT under the config's ``recompute``
modes: ``none``, ``selective`` (each block's attention core checkpointed: Korthikanti et
al.'s) and ``full`` (each block checkpointed), here (``framework.utils.checkpoint``) and in
PyTorch 2.13 (``torch.utils.checkpoint``, the same model: ``benchmarks/gpt_torch.py``, the
same weights), one thread each; and ResNet-20's step (SGD) under the same modes here
(``selective``: each basic block's convolution outputs kept, its BatchNorms and
activations recomputed).

Steps of every (framework, mode) take turns round by round, in a rotating order, so that
a loaded machine slows them alike; the cost of a mode is the median over rounds of its
step time over the same framework's ``none`` step time in that round. Memory (ours): what
autograd holds at the forward/backward boundary (the activation part of the floor,
parameters left out) and the step's peak above its start, by the framework's counter.

Shapes: ``tiny`` is configs/gpt_tiny.yaml's model and batch (2 blocks of 64, context 64,
batch 16); ``char`` is configs/gpt_char.yaml's model (6 blocks of 384, context 256) at
batch 4, attention written out (selective recomputation removes what it keeps), dropout
0.2. Policy ``auto``.

Run:  OMP_NUM_THREADS=1 python benchmarks/bench_recompute.py [--repeats 9] [--quick] [--only tiny char resnet20]
          [--json PATH]
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common
else:
    from . import common

import framework as fw
from framework import memory
from models import GPT, ResNet
from trainers.config import config_from_dict
from trainers.trainer import build_optimizer

MODES = ("none", "selective", "full")
GPT_SHAPES = {
    "tiny": (dict(vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.1, attention="math"), 16),
    "char": (dict(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384, dropout=0.2, bias=False), 4),
}
MB = 1024 * 1024
ADAMW = {"optim": {"name": "adamw", "lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.1, "decay": "matrices"}}


class _Step:
    """One training step of a model, and what the last one measured (ours)."""

    def __init__(self, model, opt, loss_fn, ours: bool):
        self.model, self.opt, self.loss_fn, self.ours = model, opt, loss_fn, ours
        self.held = self.peak = None

    def __call__(self):
        self.opt.zero_grad()
        if self.ours:
            start = memory.allocated_bytes()
            memory.reset_peak()
            saved0 = memory.saved_bytes(parameters=False)
        loss = self.loss_fn(self.model)
        if self.ours:
            self.held = memory.saved_bytes(parameters=False) - saved0
        loss.backward()
        self.opt.step()
        if self.ours:
            self.peak = memory.max_allocated_bytes() - start


def gpt_steps(name: str, quick: bool):
    """``{"ours": step, "pytorch": step}`` of the GPT shape ``name`` (PyTorch's if installed)."""
    shape, batch = GPT_SHAPES[name]
    if quick:
        shape, batch = {**shape, "block_size": 16, "n_layer": 1, "n_embd": 32, "n_head": 2}, 2
    fw.manual_seed(0)
    model = GPT(**shape)
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, shape["vocab_size"], (batch, shape["block_size"])) for _ in range(2))
    opt = build_optimizer(config_from_dict(ADAMW), list(model.parameters()))
    fx, fy = fw.tensor(x), fw.tensor(y)
    steps = {"ours": _Step(model, opt, lambda m: m(fx, fy)[1], True)}
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return steps, batch
    from benchmarks.gpt_torch import from_ours  # noqa: PLC0415  (it imports torch)

    torch.set_num_threads(1)
    twin = from_ours(model, dtype=torch.float32)
    params = list(twin.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    topt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.99))
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    steps["pytorch"] = _Step(twin, topt, lambda m: m(tx, ty)[1], False)
    return steps, batch


def resnet_steps(quick: bool):
    """ResNet-20 (width 16, 32x32 images, batch 64) with SGD: ``{"ours": step}``."""
    fw.manual_seed(0)
    n, size, depth = (4, 8, 8) if quick else (64, 32, 20)
    model = ResNet(depth=depth, width=16 if not quick else 4)
    opt = fw.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = fw.randn(n, 3, size, size)
    y = fw.tensor(np.random.default_rng(0).integers(0, 10, n))
    return {"ours": _Step(model, opt, lambda m: fw.nn.functional.cross_entropy(m(x), y), True)}, n


def measure(steps: dict, rounds: int) -> dict:
    """Step times of every (framework, mode), taking turns; per framework and mode the
    median ratio to ``none`` and the spread; ours: held and peak per mode."""
    combos = [(who, mode) for mode in MODES for who in steps]
    for who, mode in combos:  # warm up (and measure ours' memory, which does not depend on the load)
        steps[who].model.set_recompute(mode)
        steps[who]()
    held, peak = {}, {}
    for mode in MODES:
        steps["ours"].model.set_recompute(mode)
        steps["ours"]()
        held[mode], peak[mode] = steps["ours"].held, steps["ours"].peak
    times = {c: [] for c in combos}
    for r in range(rounds):
        k = r % len(combos)
        for who, mode in combos[k:] + combos[:k]:
            step = steps[who]
            step.model.set_recompute(mode)
            gc.collect()
            gc.disable()
            try:
                t0 = time.perf_counter()
                step()
                times[(who, mode)].append(time.perf_counter() - t0)
            finally:
                gc.enable()
    out = {}
    for who in steps:
        base = times[(who, "none")]
        for mode in MODES:
            ratios = [t / b for t, b in zip(times[(who, mode)], base)]
            out[(who, mode)] = {
                "median_s": statistics.median(times[(who, mode)]),
                "vs_none_median": statistics.median(ratios),
                "vs_none_min": min(ratios),
                "vs_none_max": max(ratios),
            }
    for mode in MODES:
        out[("ours", mode)].update(held_mb=held[mode] / MB, peak_mb=peak[mode] / MB)
    return out


def table(results: dict) -> str:
    rows = []
    for name, (r, batch) in results.items():
        for (who, mode), m in r.items():
            rows.append(
                [
                    name,
                    who,
                    mode,
                    f"{batch / m['median_s']:.1f}",
                    "-" if mode == "none" else f"{100 * (m['vs_none_median'] - 1):+.1f}%",
                    "-"
                    if mode == "none"
                    else f"{100 * (m['vs_none_min'] - 1):+.0f}..{100 * (m['vs_none_max'] - 1):+.0f}%",
                    f"{m['held_mb']:.2f}" if "held_mb" in m else "-",
                    f"{m['peak_mb']:.2f}" if "peak_mb" in m else "-",
                ]
            )
    return common.markdown_table(
        ["model", "framework", "recompute", "samples/s", "step time vs none", "rounds' range", "held MB", "peak MB"],
        rows,
        [
            ("samples/s", "median over the rounds, one thread"),
            ("step time vs none", "median over rounds of the step's time over the same framework's none step"),
            ("held MB", "ours: what autograd holds at the forward/backward boundary, parameters left out"),
            ("peak MB", "ours: the step's highest live array memory above its start (the framework's counter)"),
        ],
    )


def main(argv=None) -> dict:
    p = common.parser(__doc__.splitlines()[0], default_repeats=9)
    p.add_argument("--only", nargs="+", choices=[*GPT_SHAPES, "resnet20"], default=[*GPT_SHAPES, "resnet20"])
    args = p.parse_args(argv)
    if os.environ.get("OMP_NUM_THREADS") != "1":
        print("note: set OMP_NUM_THREADS=1 so NumPy's BLAS runs one thread, as PyTorch does here")
    rounds = common.repeats_of(args, 9)
    print(f"# {common.command_line()}\n# {common.machine_line()}\n")
    results = {}
    with fw.inplace.policy("auto"):
        for name in args.only:
            steps, batch = resnet_steps(args.quick) if name == "resnet20" else gpt_steps(name, args.quick)
            results[name] = (measure(steps, rounds), batch)
    print(table(results))
    payload = {
        "machine": common.machine_info(),
        "command": common.command_line(),
        "results": {name: {f"{who}/{mode}": m for (who, mode), m in r.items()} for name, (r, _) in results.items()},
    }
    if args.json:
        common.write_json(args.json, payload)
    return {"results": results, "payload": payload}


if __name__ == "__main__":
    main()
