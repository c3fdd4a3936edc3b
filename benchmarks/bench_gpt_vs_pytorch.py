"""The GPT against PyTorch on the CPU: the same model (``benchmarks/gpt_torch.py``, the
same weights), the same AdamW step (nanoGPT's decay groups), one thread each.

Two shapes: ``tiny`` is configs/gpt_tiny.yaml's model and batch (2 blocks of 64, context
64, batch 16, written-out attention, no dropout); ``char`` is configs/gpt_char.yaml's
model (6 blocks of 384, context 256, dropout 0.2, fused attention: PyTorch's
``F.scaled_dot_product_attention``) at batch 4 instead of 64 (a CPU can time it). Steps
alternate between the frameworks, the ratio is taken round by round (median and
spread). Our side runs policy ``auto`` unless ``--policy`` says otherwise.

Peak: each framework's training process in processes of its own, its resident memory's
high-water mark over 5 steps above what it was once the model and the batch existed (as
``bench_vs_pytorch.py --rss`` measures ResNet-20's), and our framework's own counter of
array memory (``memory.max_allocated_bytes``) beside it.

``--ops``: the step's ops one by one instead (forward + backward of each on the ``tiny``
model's shapes, through each framework's autograd, alternating), to say where a step's
time goes and what a change to one op bought.

Run:  OMP_NUM_THREADS=1 python benchmarks/bench_gpt_vs_pytorch.py [--repeats 9] [--quick] [--only tiny char]
          [--json PATH] [--ops]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common
    from benchmarks.bench_vs_pytorch import _status_kb
else:
    from . import common
    from .bench_vs_pytorch import _status_kb

import framework as fw
import framework.nn.functional as F
from framework import memory
from models import GPT
from trainers.config import config_from_dict
from trainers.trainer import build_optimizer

SHAPES = {
    "tiny": (dict(vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.0, attention="math"), 16),
    "char": (
        dict(
            vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384, dropout=0.2, bias=False, attention="fused"
        ),
        4,
    ),
}
MB = 1024 * 1024
OPTIM = {"optim": {"name": "adamw", "lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.1, "decay": "matrices"}}


def _batch(shape, batch):
    rng = np.random.default_rng(0)
    t, v = shape["block_size"], shape["vocab_size"]
    return rng.integers(0, v, (batch, t)), rng.integers(0, v, (batch, t))


def ours(name: str, batch: int | None = None):
    """One training step of our GPT of shape ``name`` (a callable), and the model."""
    shape, default_batch = SHAPES[name]
    fw.manual_seed(0)
    model = GPT(**shape)
    opt = build_optimizer(config_from_dict(OPTIM), list(model.parameters()))
    x, y = (fw.tensor(a) for a in _batch(shape, batch or default_batch))
    return _training_step(model, opt, x, y), model


def theirs(name: str, model, batch: int | None = None):
    """The same step in PyTorch, from our model's weights."""
    import torch  # noqa: PLC0415

    from benchmarks.gpt_torch import from_ours  # noqa: PLC0415  (it imports torch)

    shape, default_batch = SHAPES[name]
    twin = from_ours(model, dtype=torch.float32)
    params = list(twin.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.99))
    x, y = (torch.from_numpy(a) for a in _batch(shape, batch or default_batch))
    return _training_step(twin, opt, x, y)


def _training_step(model, opt, x, y):
    """One training step of either framework's GPT (the same names in both), as a callable."""

    def step():
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()

    return step


# The ops of the tiny model's step on its shapes (batch 16, context 64, width 64, 4 heads):
# name -> (input shapes, our call, PyTorch's call); each is timed as forward + backward.
def _op_table():
    import torch  # noqa: PLC0415

    tf = torch.nn.functional
    b, t, c, h = 16, 64, 64, 4
    causal = np.tril(np.ones((t, t), bool))
    ours_mask, torch_mask = fw.tensor(~causal), torch.from_numpy(~causal)
    return {
        "gelu": ([(b, t, 4 * c)], F.gelu, tf.gelu),
        "layer_norm": (
            [(b, t, c), (c,), (c,)],
            lambda x, w, bias: F.layer_norm(x, (c,), w, bias),
            lambda x, w, bias: tf.layer_norm(x, (c,), w, bias),
        ),
        "masked_fill + softmax": (
            [(b, h, t, t)],
            lambda x: F.softmax(x.masked_fill(ours_mask, float("-inf")), dim=-1),
            lambda x: tf.softmax(x.masked_fill(torch_mask, float("-inf")), dim=-1),
        ),
        "linear (c_fc)": ([(b, t, c), (4 * c, c), (4 * c,)], F.linear, tf.linear),
        "attention products": (
            [(b, h, t, c // h), (b, h, t, c // h)],
            lambda q, k: (q @ k.transpose(-2, -1)) @ k,
            lambda q, k: (q @ k.transpose(-2, -1)) @ k,
        ),
        "cross_entropy": (
            [(b * t, 65)],
            lambda x: F.cross_entropy(x, fw.tensor(np.arange(b * t) % 65)),
            lambda x: tf.cross_entropy(x, torch.from_numpy(np.arange(b * t) % 65)),
        ),
    }


def measure_ops(rounds: int) -> dict:
    """Forward + backward of each op of :func:`_op_table`, ours against PyTorch's,
    alternating: ``{op: {"ours_ms", "pytorch_ms", "ratio"}}`` (medians, ratio = time over
    PyTorch's time)."""
    import torch  # noqa: PLC0415

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    results = {}
    for name, (shapes, our_op, their_op) in _op_table().items():
        arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        ours_in = [fw.tensor(a, requires_grad=True) for a in arrays]
        theirs_in = [torch.from_numpy(a.copy()).requires_grad_() for a in arrays]

        def run(op, inputs):
            def step():
                y = op(*inputs)
                y.backward(y.detach() * 0 + 1)
                for x in inputs:
                    x.grad = None

            return step

        times = common.interleaved({"ours": run(our_op, ours_in), "pytorch": run(their_op, theirs_in)}, rounds)
        ours_ms, theirs_ms = (1e3 * statistics.median(times[k]) for k in ("ours", "pytorch"))
        results[name] = {"ours_ms": ours_ms, "pytorch_ms": theirs_ms, "ratio": ours_ms / theirs_ms}
    return results


def measure(name: str, rounds: int, policy: str, batch: int | None = None) -> dict:
    import torch  # noqa: PLC0415

    torch.set_num_threads(1)
    with fw.inplace.policy(policy):
        a, model = ours(name, batch)
        b = theirs(name, model, batch)
        for fn in (a, b, a, b):  # warm up
            fn()
        times = {"ours": [], "pytorch": []}
        for r in range(rounds):
            order = (("ours", a), ("pytorch", b)) if r % 2 == 0 else (("pytorch", b), ("ours", a))
            for who, fn in order:
                t0 = time.perf_counter()
                fn()
                times[who].append(time.perf_counter() - t0)
    n = batch or SHAPES[name][1]
    ratios = [p / o for o, p in zip(times["ours"], times["pytorch"])]
    return {
        "batch": n,
        "ours_samples_per_s": n / statistics.median(times["ours"]),
        "pytorch_samples_per_s": n / statistics.median(times["pytorch"]),
        "speed_ratio_median": statistics.median(ratios),
        "speed_ratio_min": min(ratios),
        "speed_ratio_max": max(ratios),
    }


def rss_child(which: str, name: str, policy: str, batch: int | None = None, steps: int = 5) -> dict:
    """In this process: the model, its optimizer and a batch, then ``steps`` training steps:
    the peak resident memory above where it started (and, for ours, the array counter's peak)."""
    fw.inplace.set_policy(policy)
    step, model = ours(name, batch)
    if which == "pytorch":
        import torch  # noqa: PLC0415

        torch.set_num_threads(1)
        step = theirs(name, model, batch)
        del model
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before, counted = _status_kb("VmRSS"), memory.allocated_bytes()
    memory.reset_peak()
    for _ in range(steps):
        step()
    out = {"growth_mb": (_status_kb("VmHWM") - before) / 1024}
    if which == "ours":
        out["counter_mb"] = (memory.max_allocated_bytes() - counted) / MB
    return out


def measure_rss(name: str, rounds: int, policy: str, batch: int | None = None) -> dict:
    growth = {"ours": [], "pytorch": []}
    counter = []
    for r in range(rounds):
        for which in ("ours", "pytorch") if r % 2 == 0 else ("pytorch", "ours"):
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.bench_gpt_vs_pytorch", "--rss-child", which, "--only", name,
                 "--policy", policy] + (["--batch", str(batch)] if batch else []),
                capture_output=True,
                text=True,
                check=True,
                cwd=str(Path(__file__).resolve().parents[1]),
            )  # fmt: skip
            result = json.loads(out.stdout.strip().splitlines()[-1])
            growth[which].append(result["growth_mb"])
            if which == "ours":
                counter.append(result["counter_mb"])
    med = {k: statistics.median(v) for k, v in growth.items()}
    return {"median_mb": med, "counter_mb": statistics.median(counter), "ratio": med["ours"] / med["pytorch"]}


def main(argv=None):
    p = common.parser(__doc__.splitlines()[0], default_repeats=9)
    p.add_argument("--only", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--policy", choices=fw.inplace.POLICIES, default=fw.inplace.DEFAULT_POLICY)
    p.add_argument("--batch", type=int, default=None, help="samples per step (default: the shape's)")
    p.add_argument("--ops", action="store_true", help="time the step's ops one by one (the tiny model's shapes)")
    p.add_argument("--rss-child", choices=("ours", "pytorch"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rss_child:
        print(json.dumps(rss_child(args.rss_child, args.only[0], args.policy, args.batch)))
        return None
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        raise SystemExit("this benchmark needs PyTorch: pip install torch==2.13.0") from None
    if os.environ.get("OMP_NUM_THREADS") != "1":
        print("note: set OMP_NUM_THREADS=1 so NumPy's BLAS runs one thread, as PyTorch does here")
    rounds = common.repeats_of(args, 9)
    results = {"machine": common.machine_info(), "command": common.command_line(), "torch": torch.__version__}
    if args.ops:
        return _print_ops(results, measure_ops(rounds), args)
    rows = []
    for name in args.only:
        batch = 2 if args.quick else args.batch
        r = measure(name, rounds, args.policy, batch)
        rss = measure_rss(name, 1 if args.quick else 3, args.policy, batch)
        results[name] = {"speed": r, "peak": rss}
        rows.append(
            [
                f"{name} (batch {r['batch']})",
                f"{r['ours_samples_per_s']:.1f} vs {r['pytorch_samples_per_s']:.1f}",
                f"{r['speed_ratio_median']:.2f} ({r['speed_ratio_min']:.2f}-{r['speed_ratio_max']:.2f})",
                f"{rss['median_mb']['ours']:.1f} vs {rss['median_mb']['pytorch']:.1f}",
                f"{rss['counter_mb']:.1f}",
            ]
        )
    print(common.machine_line(results["machine"]) + f", PyTorch {torch.__version__}, policy {args.policy}")
    print(
        common.markdown_table(
            [
                "model",
                "samples/s, ours vs PyTorch",
                "speed ratio (spread)",
                "peak RSS growth MB",
                "our counter's peak MB",
            ],
            rows,
            [
                ("speed ratio", "our speed over PyTorch's, median of the per-round ratios (lowest-highest)"),
                (
                    "peak RSS growth MB",
                    "a 5-step training process's resident high-water mark above its start, ours vs PyTorch (median)",
                ),
                ("our counter's peak MB", "the framework's own count of array memory, peak over the same steps"),
            ],
        )
    )
    if args.json:
        common.write_json(args.json, results)
    return results


def _print_ops(results, ops, args):
    results["ops"] = ops
    print(common.machine_line(results["machine"]) + f", PyTorch {results['torch']}")
    rows = [[name, f"{r['ours_ms']:.3f}", f"{r['pytorch_ms']:.3f}", f"{r['ratio']:.2f}"] for name, r in ops.items()]
    print(
        common.markdown_table(
            ["op (tiny model's shapes)", "ours ms", "PyTorch ms", "time ratio"],
            rows,
            [
                ("ms", "forward + backward, median of the rounds"),
                ("time ratio", "our time over PyTorch's"),
            ],
        )
    )
    if args.json:
        common.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
