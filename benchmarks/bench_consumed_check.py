"""What the consumed-tensor check costs per op: the apply path with it and without it.

Every tensor input of every op is checked once for having been consumed by an inplace
site (``framework.autograd.function._read_inputs``). This benchmark times a chain of
tiny ops (10 floats, so the kernels cost nothing and the framework's own work is what
is timed; the op mix of ``bench_op_overhead``), forward and forward + backward, with
the real ``_read_inputs`` and with the same function minus the check, interleaved round
by round, and reports the difference per op. The budget is 0.3 microseconds per op.

Run:  python -m benchmarks.bench_consumed_check [--ops 200] [--repeats 200] [--quick] [--json PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common
    from benchmarks.bench_op_overhead import FW_OPS, MIX, SIZE, _schedule
else:
    from . import common
    from .bench_op_overhead import FW_OPS, MIX, SIZE, _schedule

import framework as fw
from framework.autograd import function
from framework.tensor import Tensor

BUDGET_US = 0.3
_checked = function._read_inputs


def _unchecked(cls, inputs, grad_on):
    """``_read_inputs`` without the consumed check (the reference of this benchmark)."""
    arrays = []
    if not (grad_on and cls.differentiable):
        for a in inputs:
            if isinstance(a, Tensor):
                a = a._data
            arrays.append(a)
        n = len(inputs)
        return arrays, (function._NO_NEEDS[n] if n < 8 else (False,) * n), False
    needs = []
    any_needs = False
    for a in inputs:
        if isinstance(a, Tensor):
            d = a._data
            arrays.append(d)
            r = a._grad_fn is not None or a._requires_grad or (a._base is not None and a.requires_grad)
            any_needs = any_needs or r
            needs.append(r)
        else:
            arrays.append(a)
            needs.append(False)
    return arrays, tuple(needs), any_needs


def main(argv=None):
    p = common.parser(__doc__.splitlines()[0], default_repeats=200)
    p.add_argument("--ops", type=int, default=200, help="ops in the chain (default 200)")
    args = p.parse_args(argv)
    repeats = common.repeats_of(args, 200)
    n_ops = 20 if args.quick else args.ops
    fw.manual_seed(0)
    x = fw.randn(SIZE, requires_grad=True)
    c = fw.rand(SIZE) * 0.2 + 0.9
    sched = _schedule(MIX, n_ops)

    def forward():
        h = x
        for name in sched:
            h = FW_OPS[name](h, c)
        return h

    def forward_backward():
        forward().sum().backward()
        x.grad = None

    def with_check(fn):
        def run():
            function._read_inputs = _checked
            return fn()

        return run

    def without_check(fn):
        def run():
            function._read_inputs = _unchecked
            return fn()

        return run

    variants = {
        "forward, checked": with_check(forward),
        "forward, unchecked": without_check(forward),
        "fwd+bwd, checked": with_check(forward_backward),
        "fwd+bwd, unchecked": without_check(forward_backward),
    }
    try:
        times = common.interleaved(variants, repeats, warmup=3)
    finally:
        function._read_inputs = _checked
    us = {k: common.summarize(v) for k, v in times.items()}
    rows = []
    result = {"machine": common.machine_info(), "command": common.command_line(), "ops": n_ops, "budget_us": BUDGET_US}
    for what in ("forward", "fwd+bwd"):
        a, b = us[f"{what}, checked"], us[f"{what}, unchecked"]
        per_op = {k: (a[k] - b[k]) / n_ops * 1e6 for k in ("min", "median")}
        rows.append(
            [
                what,
                f"{a['min'] / n_ops * 1e6:.2f}",
                f"{b['min'] / n_ops * 1e6:.2f}",
                f"{per_op['min']:+.3f}",
                f"{per_op['median']:+.3f}",
            ]
        )
        result[what] = {
            "checked_us_per_op": a["min"] / n_ops * 1e6,
            "unchecked_us_per_op": b["min"] / n_ops * 1e6,
            "check_us_per_op_min": per_op["min"],
            "check_us_per_op_median": per_op["median"],
        }
    print(common.machine_line(result["machine"]))
    print(f"{n_ops} ops on {SIZE} floats, {repeats} interleaved rounds; us per op (min over rounds)")
    legend = [
        ("checked, unchecked", "µs per op with and without the consumed-input check, the minimum over rounds"),
        ("check (min), check (median)", "checked minus unchecked, µs per op, of the minima and of the medians"),
    ]
    print(common.markdown_table(["chain", "checked", "unchecked", "check (min)", "check (median)"], rows, legend))
    worst = max(result[w]["check_us_per_op_median"] for w in ("forward", "fwd+bwd"))
    print(f"budget {BUDGET_US} us per op: {'met' if worst <= BUDGET_US else 'NOT met'} (worst median {worst:+.3f} us)")
    if args.json:
        common.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
