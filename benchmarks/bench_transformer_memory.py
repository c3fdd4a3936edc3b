"""What one GPT block keeps for backward, counted tensor by tensor, against Korthikanti et
al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4.1).

The paper counts one Transformer layer's activations at ``sbh(34 + 5as/h)`` bytes with
16-bit values and 1-byte dropout masks (``s`` sequence, ``b`` batch, ``h`` width, ``a``
heads): attention ``11sbh + 5as^2b``, the MLP ``19sbh``, the two LayerNorms ``4sbh``. In
float32 (4-byte values, 1-byte masks) the same tensors are ``66sbh + 9as^2b``.

For one block of ``models/gpt.py`` (nanoGPT's, dropout on) this builds the graph of
``block(x)`` and lists every tensor backward keeps (:func:`framework.autograd.saved.saved_tensors`),
with its bytes and the paper's term it is (or why it is none), then measures per variant:

- ``off``, ``auto``, ``on``: the inplace policies (the same tensors are kept: inplace
  sites remove short-lived buffers, which shows in the peak, not in what is kept);
  ``auto`` must give ``off``'s output and gradients bit for bit;
- ``+meln``: memory-efficient LayerNorms (they keep their output, which the next linear
  keeps anyway): ``58sbh + 9as^2b``;
- ``+fused``: attention as one ``scaled_dot_product_attention``: no ``as^2`` term, ``66sbh``;
- ``+meln+fused``: ``58sbh``;
- ``+selective``: Korthikanti et al.'s selective recomputation (the attention core, from q,
  k, v to ``@ v``, checkpointed: it keeps q, k and v and runs again in backward): the
  ``as^2`` terms gone, ``66sbh``; during the block's backward the core's ``9as^2b`` come
  back for a while (``66sbh + 9as^2b`` with what is kept);
- ``+full``: the whole block checkpointed: it keeps its input alone, ``4sbh`` (the paper's
  ``2sbh`` per layer in 16 bits); during its backward, the block's activations again.

Assumptions of the formulas, beside the paper's: float32 values (4 bytes) and bool
dropout masks (1 byte), dropout on; the LayerNorms' row statistics (mean, 1/std: ``16sb``
a block, or ``8sb`` memory-efficient) and the causal mask (``s^2`` bytes, one for every
head and sample) are not in the paper's count, so ``held / formula`` is ``1 + (16sb +
s^2) / formula`` for the written-out block; the parameters are not counted (held by
nodes, but counted once, as parameters).

Columns: bytes held for backward (measured: each buffer once, and equal to the growth of
``memory.saved_bytes()``), the paper's formula for the variant, their ratio; for the
recomputing variants, what the recomputation held during the backward
(``memory.stats()["recomputed_bytes"]``) and held + recomputed against the whole block's
formula; and the peak of the block's forward and backward above what existed before it,
twice: by the framework's counter (the buffers it tracks) and by tracemalloc's NumPy
domain (every array, the temporaries inside ops' NumPy expressions included). Float32,
on the CPU. Every variant of the written-out block (the policies, the recomputations)
gives ``off``'s output and gradients bit for bit.

Run from the repository root::

    python benchmarks/bench_transformer_memory.py [--quick] [--figure docs/img/transformer_memory.png] [--json PATH]
"""

from __future__ import annotations

import gc
import sys
import tracemalloc
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common
else:
    from . import common

import framework as fw
from framework import memory
from framework.autograd.saved import held_bytes, saved_tensors
from models.gpt import Block, GPTConfig

MB = 1024 * 1024

# (s, b, h, a): nanoGPT's Shakespeare-char layer (batch 8 instead of 64, to keep the CPU run
# short: every term scales with b), and a long sequence where the as^2 terms dominate.
POINTS = [(256, 8, 384, 6), (1024, 2, 256, 4)]
QUICK_POINTS = [(64, 4, 64, 4), (128, 2, 96, 6)]

# variant -> (policy, model settings)
VARIANTS = {
    "off": ("off", {}),
    "auto": ("auto", {}),
    "on": ("on", {}),
    "on+meln": ("on", {"layer_norm": "memory_efficient"}),
    "on+fused": ("on", {"attention": "fused"}),
    "on+meln+fused": ("on", {"layer_norm": "memory_efficient", "attention": "fused"}),
    "on+selective": ("on", {"recompute": "selective"}),
    "on+full": ("on", {"recompute": "full"}),
}
# the variants that compute the written-out block as off does: bit for bit its output and gradients
BITWISE = ("auto", "on", "on+selective", "on+full")

# What each tensor of the written-out block under off is in the paper's count (float32:
# 4 bytes a value, masks 1 byte), in the order the listing gives them (forward order).
PAPER_TERMS = [
    ("NativeLayerNormBackward0", "x", "LayerNorm 1's input: 4sbh (paper: 2sbh)"),
    ("NativeLayerNormBackward0", "weight", "a parameter"),
    ("NativeLayerNormBackward0", "bias", "a parameter"),
    ("NativeLayerNormBackward0", "mean", "not in the paper: LayerNorm's row means, 4sb"),
    ("NativeLayerNormBackward0", "rstd", "not in the paper: LayerNorm's row 1/std, 4sb"),
    ("ViewBackward0", "x", "the QKV projection's input: 4sbh (2sbh)"),
    ("ViewBackward0", "weight", "a parameter"),
    ("UnsafeViewBackward0", "x", "Q and K (and V: one buffer of 3 x 4sbh): 12sbh (4sbh + 2sbh)"),
    ("UnsafeViewBackward0", "y", "K: the same buffer"),
    ("MaskedFillBackward0", "mask", "not in the paper: the causal mask, s^2 bytes (shared by every head and sample)"),
    ("SoftmaxBackward0", "result", "softmax output: 4as^2b (2as^2b)"),
    ("MulBackward0", "mask", "attention dropout mask: as^2b (as^2b)"),
    ("UnsafeViewBackward0", "x", "attention dropout output, for @ V: 4as^2b (2as^2b)"),
    ("UnsafeViewBackward0", "y", "V: the QKV buffer again"),
    ("ViewBackward0", "x", "the output projection's input: 4sbh (2sbh)"),
    ("ViewBackward0", "weight", "a parameter"),
    ("MulBackward0", "mask", "attention's residual dropout mask: sbh (sbh)"),
    ("NativeLayerNormBackward0", "x", "LayerNorm 2's input: 4sbh (2sbh)"),
    ("NativeLayerNormBackward0", "weight", "a parameter"),
    ("NativeLayerNormBackward0", "bias", "a parameter"),
    ("NativeLayerNormBackward0", "mean", "not in the paper: LayerNorm's row means, 4sb"),
    ("NativeLayerNormBackward0", "rstd", "not in the paper: LayerNorm's row 1/std, 4sb"),
    ("ViewBackward0", "x", "the MLP's first linear's input: 4sbh (2sbh)"),
    ("ViewBackward0", "weight", "a parameter"),
    ("GeluBackward0", "x", "GELU's input: 16sbh (8sbh)"),
    ("ViewBackward0", "x", "the MLP's second linear's input (GELU's output): 16sbh (8sbh)"),
    ("ViewBackward0", "weight", "a parameter"),
    ("MulBackward0", "mask", "the MLP's dropout mask: sbh (sbh)"),
]


def formula(variant: str, s: int, b: int, h: int, a: int) -> int:
    """The paper's count in float32 for the variant (LayerNorm inputs gone with +meln, the
    as^2 terms with +fused or +selective; the block's input alone with +full)."""
    sbh = s * b * h
    if "full" in variant:
        return 4 * sbh
    per_token = 58 if "meln" in variant else 66
    return per_token * sbh + (0 if "fused" in variant or "selective" in variant else 9 * a * s * s * b)


def exact(variant: str, s: int, b: int, h: int, a: int) -> int:
    """What the framework keeps, exactly: the formula plus what the paper leaves out (the
    LayerNorms' row statistics: 2 x 8sb, or 2 x 4sb memory-efficient; the causal mask, s^2
    bytes; fused attention's log-sum-exp, 4asb, and its dropout draw, 8 bytes). Selective
    recomputation recomputes the causal mask with the core; full keeps nothing else."""
    if "full" in variant:
        return formula(variant, s, b, h, a)
    extra = (8 if "meln" in variant else 16) * s * b
    if "fused" in variant:
        extra += 4 * a * s * b + 8
    elif "selective" not in variant:
        extra += s * s
    return formula(variant, s, b, h, a) + extra


def _block(point, settings, seed=0):
    s, b, h, a = point
    settings = dict(settings)
    recompute = settings.pop("recompute", "none")
    cfg = dict(vocab_size=16, block_size=s, n_layer=1, n_head=a, n_embd=h, dropout=0.1, bias=True)
    cfg.update({"attention": "math", "layer_norm": "standard", **settings})
    fw.manual_seed(seed)
    block = Block(GPTConfig(**cfg))
    block.recompute = "full" if recompute == "full" else "none"  # as GPT.set_recompute sets them
    block.attn.recompute_core = recompute == "selective"
    return block


def measure(point, variant: str, want_listing: bool = False) -> dict:
    """One block's forward and backward under ``variant``: bytes held for backward (from the
    listing, checked against ``memory.saved_bytes()``), the peak above the start, the
    output and gradients (for the bitwise check), and the listing itself."""
    policy, settings = VARIANTS[variant]
    s, b, h, a = point
    block = _block(point, settings)
    gc.collect()
    with fw.inplace.policy(policy):
        fw.manual_seed(1)
        leaf = fw.randn(b, s, h, requires_grad=True)
        x = leaf * 1.0  # the block's input: a previous layer's output
        stats_before = memory.stats()
        gc.collect()
        traced = not tracemalloc.is_tracing()
        if traced:
            tracemalloc.start()
        traced0 = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        start, saved0 = memory.allocated_bytes(), memory.saved_bytes(parameters=False)
        memory.reset_peak()
        fw.manual_seed(2)
        y = block(x)
        grown = memory.saved_bytes(parameters=False) - saved0
        entries = saved_tensors(y)
        held = held_bytes(entries)
        if held != grown:
            raise AssertionError(f"{variant}: the listing holds {held} bytes, memory.saved_bytes() grew by {grown}")
        fw.manual_seed(3)
        g = fw.randn(b, s, h)
        del x
        recomputed_before = memory.stats().get("recomputed_bytes", 0)
        y.backward(g)
        recomputed = memory.stats().get("recomputed_bytes", 0) - recomputed_before
        peak = memory.max_allocated_bytes() - start
        numpy_peak = tracemalloc.get_traced_memory()[1] - traced0
        if traced:
            tracemalloc.stop()
        stats = {k: v - stats_before.get(k, 0) for k, v in memory.stats().items() if v != stats_before.get(k, 0)}
    return {
        "variant": variant,
        "held": held,
        "formula": formula(variant, *point),
        "exact": exact(variant, *point),
        "recomputed": recomputed,
        "peak": peak,
        "numpy_peak": numpy_peak,
        "output": y.detach().numpy().copy(),
        "grads": [leaf.grad.numpy().copy()] + [p.grad.numpy().copy() for p in block.parameters()],
        "listing": entries if want_listing else None,
        "stats": stats,
    }


def run(points) -> dict:
    results = {}
    for point in points:
        rows = {v: measure(point, v, want_listing=v == "off") for v in VARIANTS}
        off = rows["off"]
        for v in BITWISE:
            got = rows[v]
            if not (
                np.array_equal(got["output"], off["output"]) and all(map(np.array_equal, got["grads"], off["grads"]))
            ):
                raise AssertionError(f"{point}: {v}'s output or gradients differ from off's")
        results[point] = rows
    return results


def listing_table(entries, point) -> str:
    s, b, h, a = point
    if [(e.node, e.name) for e in entries] != [(n, k) for n, k, _ in PAPER_TERMS]:
        raise AssertionError("the block's listing changed: update PAPER_TERMS")
    rows = [
        [e.node, e.name, "x".join(map(str, e.shape)), e.dtype, f"{e.buffer_bytes if e.first else 0:,}", term]
        for e, (_, _, term) in zip(entries, PAPER_TERMS)
    ]
    return common.markdown_table(
        ["node", "saved as", "shape", "dtype", "bytes", "the paper's term (float32; in brackets its 16-bit count)"],
        rows,
        [("bytes", "of the buffer, counted once: 0 where an earlier entry holds the same buffer")],
    )


def summary_table(results) -> str:
    rows = []
    for point, by_variant in results.items():
        s, b, h, a = point
        whole = formula("off", *point)
        for v, r in by_variant.items():
            recomputing = "selective" in v or "full" in v
            rows.append(
                [
                    f"s={s} b={b} h={h} a={a}",
                    v,
                    f"{r['held'] / MB:.2f}",
                    f"{r['formula'] / MB:.2f}",
                    f"{r['held'] / r['formula']:.3f}",
                    f"{r['recomputed'] / MB:.2f}" if recomputing else "-",
                    f"{(r['held'] + r['recomputed']) / whole:.3f}" if recomputing else "-",
                    f"{r['peak'] / MB:.2f}",
                    f"{r['numpy_peak'] / MB:.2f}",
                ]
            )
    return common.markdown_table(
        [
            "point",
            "variant",
            "held MB",
            "formula MB",
            "held / formula",
            "recomputed MB",
            "(held + recomputed) / 66sbh + 9as^2b",
            "peak MB",
            "NumPy peak MB",
        ],
        rows,
        [
            ("held MB", "what backward keeps of one block, measured (each buffer once), MB = 2^20 bytes"),
            (
                "formula MB",
                "Korthikanti et al.'s count in float32: 66sbh + 9as^2b, 58sbh with +meln, no as^2 with +fused or "
                "+selective, 4sbh (the input) with +full",
            ),
            (
                "recomputed MB",
                "what the recomputation held during the block's backward, beyond what was kept (measured: "
                "memory.stats()['recomputed_bytes'])",
            ),
            ("peak MB", "the highest live memory of the block's forward and backward above its start (the counter)"),
            ("NumPy peak MB", "the same by tracemalloc: every NumPy array, the temporaries inside ops included"),
        ],
    )


def figure(results, path: str) -> None:
    import matplotlib  # noqa: PLC0415  (only the figure needs it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.2))
    axes = np.atleast_1d(axes)
    for ax, ((s, b, h, a), rows) in zip(axes, results.items()):
        names = list(rows)
        xs = np.arange(len(names))
        ax.bar(xs - 0.27, [rows[n]["held"] / MB for n in names], 0.27, label="held for backward (measured)")
        ax.bar(xs, [rows[n]["formula"] / MB for n in names], 0.27, label="paper's formula (float32)", alpha=0.6)
        ax.bar(
            xs + 0.27,
            [rows[n]["numpy_peak"] / MB for n in names],
            0.27,
            label="peak of forward + backward (tracemalloc)",
        )
        ax.set_xticks(xs, names, rotation=20)
        ax.set_ylabel("MB (2^20 bytes)")
        ax.set_title(f"one GPT block: s={s}, b={b}, h={h}, a={a}")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    p = common.parser(__doc__.split("\n\n")[0], default_repeats=1)
    p.add_argument(
        "--figure", metavar="PNG", default=None, help="write the figure (e.g. docs/img/transformer_memory.png)"
    )
    args = p.parse_args(argv)
    points = QUICK_POINTS if args.quick else POINTS
    print(f"# {common.command_line()}\n# {common.machine_line()}\n")
    results = run(points)
    first = points[0]
    print(f"What one block keeps under off at s={first[0]} b={first[1]} h={first[2]} a={first[3]}:\n")
    print(listing_table(results[first]["off"]["listing"], first))
    print()
    print(summary_table(results))
    for point, rows in results.items():
        for v, r in rows.items():
            if r["held"] != r["exact"]:
                raise AssertionError(f"{point} {v}: held {r['held']}, expected {r['exact']}")
    if args.figure:
        figure(results, args.figure)
        print(f"\nfigure: {args.figure}")
    payload = {
        "machine": common.machine_info(),
        "points": [
            {
                "point": list(point),
                "variants": {
                    v: {k: r[k] for k in ("held", "formula", "exact", "recomputed", "peak", "numpy_peak")}
                    for v, r in rows.items()
                },
            }
            for point, rows in results.items()
        ],
    }
    if args.json:
        common.write_json(args.json, payload)
    return {"results": results, "payload": payload}


if __name__ == "__main__":
    main()
