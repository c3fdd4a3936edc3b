"""What policy ``auto``'s proof costs per op, against ``on``, when it rewrites and when it refuses.

A chain of 200 ``add`` ops on a small tensor (64 floats, so the kernel is negligible and
the framework's per-op work is what is timed), forward + backward, min over repeats:

- ``temporary``: each op's input is the previous op's output, handed over as a
  temporary, so auto proves it dead and runs every op in place;
- ``rebound``: ``y = y + 1.0``, the input named by a local that the statement rebinds:
  auto proves it dead too, after reading the caller's locals;
- ``named``: ``z = y + 1.0; y = z``, the input held by a name the statement does not
  rebind, so auto refuses every op (the cost of a refusal: the cheap checks pass, the
  count fails).

The same chains under ``on`` (no proof is attempted: ordinary ops stay out of place)
are the reference; the policies are interleaved round by round.

Run:  python benchmarks/bench_auto.py [--repeats N] [--quick] [--json PATH]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import framework as fw  # noqa: E402
from benchmarks import common  # noqa: E402
from framework import memory  # noqa: E402

N = 200


def temporary_chain(x):
    box = [x * 1.0]
    for _ in range(N):
        box.append(box.pop() + 1.0)
    return box.pop()


def rebound_chain(x):
    y = x * 1.0
    for _ in range(N):
        y = y + 1.0  # y is named while the add runs, and rebound by the statement
    return y


def named_chain(x):
    y = x * 1.0
    for _ in range(N):
        z = y + 1.0  # y is named while the add runs, and stays bound
        y = z
    return y


def main(argv=None):
    args = common.parser(__doc__.splitlines()[0], default_repeats=50).parse_args(argv)
    repeats = common.repeats_of(args, 50)
    # The point is the proof's own cost: prove every tensor, however small (by default
    # auto skips tensors below fw.inplace.auto_min_bytes(), where it does not pay).
    prev = fw.inplace.set_auto_min_bytes(0)
    try:
        return _measure(args, repeats)
    finally:
        fw.inplace.set_auto_min_bytes(prev)


SWEEP_FLOATS = (10, 1024, 4096, 16384, 32768, 49152, 65536)


def size_sweep(repeats: int, sizes=SWEEP_FLOATS) -> list[dict]:
    """Where the proof pays: a no_grad chain of 200 tiny-kernel ops (the op mix of the
    temporary chain) per tensor size, under on and auto (proving every tensor), alternating.
    From a few hundred KiB on, running in place also saves the new buffer's page faults."""
    rows = []
    for n in sizes:
        x, c = fw.randn(n), fw.rand(n) * 0.2 + 0.9

        def chain(x=x, c=c):
            h = x
            for _ in range(N // 5):
                h = ((h * 0.5 + c).tanh() * c) - 0.1
            return h

        best = {"on": float("inf"), "auto": float("inf")}
        for r in range(repeats):
            for policy in ("on", "auto") if r % 2 else ("auto", "on"):
                with fw.inplace.policy(policy), fw.no_grad():
                    t0 = time.perf_counter()
                    chain()
                    best[policy] = min(best[policy], time.perf_counter() - t0)
        rows.append(
            {"floats": n, "kib": n * 4 / 1024, "on_us": best["on"] / N * 1e6, "auto_us": best["auto"] / N * 1e6}
        )
    return rows


def _measure(args, repeats):
    x = fw.randn(64, requires_grad=True)
    best = {}
    rewritten = {}
    for _ in range(repeats):
        for chain in (temporary_chain, rebound_chain, named_chain):
            for policy in ("on", "auto"):
                with fw.inplace.policy(policy):
                    before = memory.stats().get("auto_inplace_ops", 0)
                    t0 = time.perf_counter()
                    chain(x).sum().backward()
                    dt = time.perf_counter() - t0
                    rewritten[(chain.__name__, policy)] = memory.stats().get("auto_inplace_ops", 0) - before
                key = (chain.__name__, policy)
                best[key] = min(best.get(key, float("inf")), dt)
                x.grad = None
    print("| chain | policy | µs/op fwd+bwd | auto - on | ops rewritten |")
    print("|---|---|---:|---:|---:|")
    for chain in ("temporary_chain", "rebound_chain", "named_chain"):
        on = best[(chain, "on")] / N * 1e6
        for policy in ("on", "auto"):
            us = best[(chain, policy)] / N * 1e6
            print(
                f"| {chain.replace('_chain', '')} | {policy} | {us:.2f} | "
                f"{'' if policy == 'on' else f'{us - on:+.2f}'} | {rewritten[(chain, policy)]} |"
            )
    print(
        common.legend(
            [
                ("µs/op fwd+bwd", "per add op of the chain, forward + backward, the minimum over rounds"),
                ("auto - on", "what auto's proof adds per op, µs (negative: faster than on)"),
                ("ops rewritten", "how many of the chain's ops auto ran in place"),
            ]
        )
    )
    sweep = size_sweep(max(3, repeats // 5), SWEEP_FLOATS[:2] if args.quick else SWEEP_FLOATS)
    print("\n| tensor | on µs/op | auto µs/op (every tensor proved) | auto / on |")
    print("|---:|---:|---:|---:|")
    for r in sweep:
        print(f"| {r['kib']:.1f} KiB | {r['on_us']:.2f} | {r['auto_us']:.2f} | {r['auto_us'] / r['on_us']:.2f} |")
    print(common.legend([("auto / on", "auto's µs/op over on's, minimum times: what the proof costs at that size")]))
    info = common.machine_info()
    print(f"\n{repeats} repeats, min. Machine: {common.machine_line(info)}")
    payload = {
        "machine": info,
        "command": common.command_line(),
        "ops_per_chain": N,
        "repeats": repeats,
        "us_per_op": {f"{c}/{p}": best[(c, p)] / N * 1e6 for c, p in best},
        "rewritten": {f"{c}/{p}": n for (c, p), n in rewritten.items()},
        "size_sweep": sweep,
    }
    if args.json:
        common.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
