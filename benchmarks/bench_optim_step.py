"""An optimizer step over ResNet-20's parameters: flat buffers against one parameter at a time.

The optimizers update the parameters of one group, device and dtype over flat buffers
(``framework.optim.flat``). The per-parameter variant is the same optimizer with that path
switched off (every parameter updated by its own ops, as before the flat buffers). Both
get the same gradients; their results are checked bit for bit. Timed, interleaved round
by round: ``step()`` (gradients already views of the flat buffer, as after
``zero_grad(set_to_none=False)`` and backward), the same after ``zero_grad()`` with new
per-parameter gradients (the step gathers them first), and ``zero_grad(set_to_none=False)``.
Also counted: the ops (``Function.apply``) one step runs.

Run:  python -m benchmarks.bench_optim_step [--repeats 200] [--quick] [--json PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common
else:
    from . import common

import numpy as np

import framework as fw
from framework.autograd import function
from models.resnet import ResNet

OPTIMIZERS = {
    "SGD (momentum 0.9, wd 5e-4)": (fw.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=5e-4)),
    "Adam (wd 1e-4)": (fw.optim.Adam, dict(lr=1e-3, weight_decay=1e-4)),
}


def per_parameter(cls):
    class PerParameter(cls):
        def _flat_step(self, gi, group, u, site):
            return group["params"]

    return PerParameter


def build(cls, kwargs, grads):
    fw.manual_seed(0)
    model = ResNet(depth=20)
    params = list(model.parameters())
    opt = cls(params, **kwargs)
    for p, g in zip(params, grads):
        p.grad = fw.tensor(g)
    opt.step()  # creates the state (and the flat buffers)
    opt.step()
    return params, opt


def count_ops(fn) -> int:
    calls = [0]
    real = function._apply

    def counting(cls, inputs, params, inplace):
        calls[0] += 1
        return real(cls, inputs, params, inplace)

    function._apply = counting
    try:
        fn()
    finally:
        function._apply = real
    return calls[0]


def main(argv=None):
    p = common.parser(__doc__.splitlines()[0], default_repeats=200)
    args = p.parse_args(argv)
    repeats = common.repeats_of(args, 200)
    fw.inplace.set_policy("auto")
    rng = np.random.default_rng(0)
    shapes = [tuple(q.shape) for q in ResNet(depth=20).parameters()]
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    result = {
        "machine": common.machine_info(),
        "command": common.command_line(),
        "parameters": len(shapes),
        "numel": int(sum(np.prod(s) for s in shapes)),
        "policy": "auto",
        "ms": {},
        "ops_per_step": {},
    }
    rows = []
    for name, (cls, kwargs) in OPTIMIZERS.items():
        runs = {"per-parameter": build(per_parameter(cls), kwargs, grads), "flat": build(cls, kwargs, grads)}
        for (pa, _), (pb, _) in [(runs["per-parameter"], runs["flat"])]:
            for a, b in zip(pa, pb):
                assert a.detach().numpy().tobytes() == b.detach().numpy().tobytes(), "flat != per-parameter"

        def fresh_grads(params):
            for q, g in zip(params, grads):
                q.grad = fw.tensor(g)

        variants, setups = {}, {}
        for v, (params_v, opt) in runs.items():
            variants[f"{v}: step"] = opt.step
            variants[f"{v}: step after zero_grad()"] = opt.step
            setups[f"{v}: step after zero_grad()"] = lambda ps=params_v: fresh_grads(ps)
            variants[f"{v}: zero_grad(set_to_none=False)"] = lambda opt=opt: opt.zero_grad(set_to_none=False)
        times = common.interleaved(variants, repeats, warmup=3, setup=lambda n, s=setups: s.get(n, lambda: None)())
        ms = {k: {s: t * 1e3 for s, t in common.summarize(v).items() if s != "repeats"} for k, v in times.items()}
        result["ms"][name] = ms
        result["ops_per_step"][name] = {v: count_ops(opt.step) for v, (_p, opt) in runs.items()}
        for what in ("step", "step after zero_grad()", "zero_grad(set_to_none=False)"):
            a, b = ms[f"per-parameter: {what}"], ms[f"flat: {what}"]
            rows.append(
                [name, what, f"{a['min']:.3f}", f"{b['min']:.3f}", f"{a['min'] / b['min']:.1f}x", f"{b['median']:.3f}"]
            )
    print(common.machine_line(result["machine"]))
    print(f"ResNet-20: {result['parameters']} parameters, {result['numel']} floats; policy auto; ms (min of {repeats})")
    legend = [
        ("per-parameter, flat", "ms per call, minimum: one update per parameter, or one over the flat buffer"),
        ("speed-up", "per-parameter over flat, minimum times"),
        ("flat (median)", "the flat call's median, how noisy the rounds were"),
    ]
    headers = ["optimizer", "call", "per-parameter", "flat", "speed-up", "flat (median)"]
    print(common.markdown_table(headers, rows, legend))
    for name, ops in result["ops_per_step"].items():
        print(f"ops per step, {name}: per-parameter {ops['per-parameter']}, flat {ops['flat']}")
    if args.json:
        common.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
