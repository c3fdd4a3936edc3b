"""Per-op overhead of the framework on a tiny tensor: what autograd costs per op call.

A 10-element float32 tensor that requires grad goes through a chain of N small ops
(mul by a scalar, add a tensor, tanh, mul by a tensor, sub a scalar, repeated), then
``h.sum().backward()``. On 10 elements the kernels cost almost nothing, so the time per
op is the framework's own overhead: the Python of the apply path, the graph, the
engine, the memory counter. The same kernels on raw NumPy arrays, forward and
forward+backward written by hand, show what is NumPy's share.

Run from the repository root::

    python -m benchmarks.bench_op_overhead [--ops 200] [--repeats 50] [--json PATH] [--profile 25]

Target (the project's issue): at most 10 microseconds per op, forward + backward.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common
else:
    from . import common

import framework as fw

TARGET_US = 10.0
SIZE = 10
MIX = ("mul_scalar", "add", "tanh", "mul", "sub_scalar")

# name -> (framework op on tensors h, c), (NumPy forward on arrays h, c)
FW_OPS = {
    "mul_scalar": lambda h, c: h * 0.5,
    "add": lambda h, c: h + c,
    "tanh": lambda h, c: h.tanh(),
    "mul": lambda h, c: h * c,
    "sub_scalar": lambda h, c: h - 0.1,
}
NP_OPS = {
    "mul_scalar": lambda h, c: np.multiply(h, 0.5),
    "add": lambda h, c: np.add(h, c),
    "tanh": lambda h, c: np.tanh(h),
    "mul": lambda h, c: np.multiply(h, c),
    "sub_scalar": lambda h, c: np.subtract(h, 0.1),
}


def _np_backward(name, g, c, y):
    """The gradient kernels the framework's ops run (same formulas, raw arrays)."""
    if name == "mul_scalar":
        return g * 0.5
    if name == "add" or name == "sub_scalar":
        return g
    if name == "tanh":
        gx = y * y
        np.subtract(1, gx, out=gx)
        gx *= g
        return gx
    return g * c  # mul by a tensor that needs no gradient


def _schedule(kinds, n):
    return [kinds[i % len(kinds)] for i in range(n)]


def make_variants(kinds, n_ops, size=SIZE):
    """The timed callables for one op schedule: framework modes and NumPy references."""
    fw.manual_seed(0)
    x = fw.randn(size, requires_grad=True)
    c = fw.rand(size) * 0.2 + 0.9  # near 1: a long chain of products stays normal
    xa, ca = x.detach().numpy().copy(), c.numpy().copy()
    sched = _schedule(kinds, n_ops)
    fw_fns = [FW_OPS[k] for k in sched]
    np_fns = [NP_OPS[k] for k in sched]

    def fw_chain():
        h = x
        for f in fw_fns:
            h = f(h, c)
        return h

    def fw_forward_backward():
        x.grad = None
        fw_chain().sum().backward()

    def fw_no_grad():
        with fw.no_grad():
            return fw_chain()

    def np_forward():
        h = xa
        for f in np_fns:
            h = f(h, ca)
        return h

    def np_forward_backward():
        outs = []
        h = xa
        for f in np_fns:
            h = f(h, ca)
            outs.append(h)
        g = np.ones_like(h)
        for k, y in zip(reversed(sched), reversed(outs)):
            g = _np_backward(k, g, ca, y)
        return g

    return {
        "forward + backward": fw_forward_backward,
        "forward (grad on)": fw_chain,
        "forward (no_grad)": fw_no_grad,
        "NumPy forward kernels": np_forward,
        "NumPy forward + backward kernels": np_forward_backward,
    }


def measure(kinds, n_ops, repeats):
    """``{mode: {"min_us_per_op", "median_us_per_op"}}`` for one schedule, interleaved."""
    times = common.interleaved(make_variants(kinds, n_ops), repeats)
    out = {}
    for mode, secs in times.items():
        s = common.summarize(secs)
        out[mode] = {"min_us_per_op": s["min"] / n_ops * 1e6, "median_us_per_op": s["median"] / n_ops * 1e6}
    return out


def profile(n_ops, top):
    """cProfile of forward + backward of the mixed chain: the top functions by own time."""
    fwd_bwd = make_variants(MIX, n_ops)["forward + backward"]
    fwd_bwd()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        fwd_bwd()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).strip_dirs().sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main(argv=None) -> dict:
    p = common.parser(__doc__.splitlines()[0], default_repeats=50)
    p.add_argument("--ops", type=int, default=None, help="ops in the chain (default 200; 20 with --quick)")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="TOP",
        help="also print cProfile's TOP functions (by own time) of forward + backward",
    )
    args = p.parse_args(argv)
    repeats = common.repeats_of(args, 50)
    n_ops = args.ops or (20 if args.quick else 200)
    info = common.machine_info()

    mixed = measure(MIX, n_ops, repeats)
    per_kind = {k: measure((k,), n_ops, repeats) for k in MIX}

    np_fwd = mixed["NumPy forward kernels"]["min_us_per_op"]
    np_fb = mixed["NumPy forward + backward kernels"]["min_us_per_op"]
    reference = {"forward + backward": np_fb, "forward (grad on)": np_fwd, "forward (no_grad)": np_fwd}
    rows = []
    for mode, r in mixed.items():
        ref = reference.get(mode)
        share = "" if ref is None else f"{r['min_us_per_op'] - ref:.2f} ({(1 - ref / r['min_us_per_op']) * 100:.0f}%)"
        rows.append([mode, f"{r['min_us_per_op']:.2f}", f"{r['median_us_per_op']:.2f}", share])

    kind_rows = []
    for k, r in per_kind.items():
        kind_rows.append(
            [k]
            + [
                f"{r[m]['min_us_per_op']:.2f}"
                for m in (
                    "forward + backward",
                    "forward (grad on)",
                    "forward (no_grad)",
                    "NumPy forward kernels",
                    "NumPy forward + backward kernels",
                )
            ]
        )

    fb = mixed["forward + backward"]["min_us_per_op"]
    met = fb <= TARGET_US
    print(
        f"## Per-op overhead: {n_ops} ops on a {SIZE}-element float32 tensor "
        f"(mix: {', '.join(MIX)}), best of {repeats}\n"
    )
    print(f"Machine: {common.machine_line(info)}\n")
    legend = [
        ("µs/op (min), µs/op (median)", "per op of the chain, the fastest and the median of the rounds"),
        ("framework µs/op (share)", "min minus the NumPy kernels of the same mode (forward+backward or forward)"),
    ]
    print(common.markdown_table(["mode", "µs/op (min)", "µs/op (median)", "framework µs/op (share)"], rows, legend))
    print(f"\nTarget: forward + backward <= {TARGET_US:g} µs/op: {'MET' if met else 'MISSED'} ({fb:.2f} µs/op)\n")
    print(f"### By op kind (chains of {n_ops} of one op; µs/op, min of {repeats})\n")
    print(
        common.markdown_table(
            ["op", "fwd+bwd", "fwd (grad on)", "fwd (no_grad)", "NumPy fwd", "NumPy fwd+bwd"],
            kind_rows,
            [("NumPy fwd, NumPy fwd+bwd", "the same op's NumPy kernels alone, written by hand: the floor")],
        )
    )

    payload = {
        "benchmark": "op_overhead",
        "machine": info,
        "command": common.command_line(),
        "params": {"ops": n_ops, "size": SIZE, "mix": list(MIX), "repeats": repeats, "quick": args.quick},
        "results": mixed,
        "per_op_kind": per_kind,
        "target_us_per_op": TARGET_US,
        "target_met": met,
    }
    if args.profile:
        text = profile(n_ops, args.profile)
        print(f"\n### cProfile of forward + backward (top {args.profile} by own time)\n\n```\n{text.strip()}\n```")
        payload["profile"] = text
    if args.json:
        common.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
