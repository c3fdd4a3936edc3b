"""Where a ResNet-20 training step spends its time, layer by layer, here and in PyTorch.

``bench_conv.py`` times each convolution alone; inside a training step PyTorch's
kernels run faster than alone (its 16-channel forward took 2.4-3.6 ms in the step against
6.3 ms alone on the machine of docs/BENCHMARKS.md), so the isolated tables say little
about the gap between the two steps. This benchmark times both steps as they run
(``bench_vs_pytorch``'s ResNet-20 step, batch 64, SGD momentum, one thread each) and
splits them:

- ours: the conv2d algorithms' three passes (forward, weight gradient, input
  gradient), keyed by layer shape, and BatchNorm's forward and backward, timed by
  wrapping those functions for the run (a few microseconds per call of a
  millisecond);
- PyTorch: ``torch.profiler``'s self CPU time of ``aten::mkldnn_convolution`` and
  ``aten::convolution_backward`` (both gradients in one call) by input shapes, and of
  ``aten::native_batch_norm(_backward)``;
- "everything else": the split step minus those (ReLU, residual adds, pooling, the
  loss, the optimizer, the autograd engine, Python).

The profiler slows PyTorch's step by 10-35% (its kernels' self times included), the
wrapping ours by well under 1%, so the split favours us; the last row is each step
timed as it runs, without either, in the same rounds, and its ratio is the one to
quote (``bench_vs_pytorch`` measures it with more rounds).

Rounds alternate between the two frameworks; each row is the median over rounds of
the milliseconds per step (the layer's count included).

Run:  OMP_NUM_THREADS=1 python -m benchmarks.bench_resnet_breakdown [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common
    from benchmarks.bench_vs_pytorch import ours, theirs
else:
    from . import common
    from .bench_vs_pytorch import ours, theirs

from framework.ops import norm
from framework.ops.conv_algorithms import ALGORITHMS

BATCH = 64
PASSES = ("forward", "grad_weight", "grad_input")


def layer_name(x_shape, w_shape, out_hw) -> str:
    """``"16->32 32x32 s2"``: channels, input size, and the stride when it is not 1."""
    stride = x_shape[2] // out_hw[0]
    return f"{w_shape[1]}->{w_shape[0]} {x_shape[2]}x{x_shape[3]}" + (f" s{stride}" if stride != 1 else "")


@contextlib.contextmanager
def timed_ours(acc: dict):
    """Adds to ``acc[(what, pass)]`` the seconds our conv passes and BatchNorm take."""

    def wrap(owner, name, key_of):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = original(*args, **kwargs)
            acc[key_of(args)] += time.perf_counter() - t0
            return out

        setattr(owner, name, timed)
        return owner, name, original

    patched = []
    for algorithm in ALGORITHMS.values():
        for p in PASSES:  # (x|g, w|g, geom, ...): the geometry is the third argument
            patched.append(wrap(algorithm, p, lambda a, p=p: (layer_name(*_shapes(a[2])), p)))
    patched.append(wrap(norm.BatchNorm, "forward", lambda a: ("batch norm", "forward")))
    patched.append(wrap(norm.BatchNorm, "backward", lambda a: ("batch norm", "backward")))
    try:
        yield
    finally:
        for owner, name, original in reversed(patched):
            if isinstance(owner, type):
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # the instance attribute hid the class's method


def _shapes(geom):
    return geom.x_shape, geom.w_shape, geom.out_hw


def torch_split(prof) -> dict:
    """``{(what, pass): seconds}`` from a ``torch.profiler`` run, by input shapes.

    The profiler records input shapes only; a forward's output size (its stride) is
    read from the backward of the same input and weight shapes, whose first input is
    the output's gradient.
    """
    acc = collections.defaultdict(float)
    events = prof.key_averages(group_by_input_shape=True)
    out_hw = {}
    for e in events:
        if e.key == "aten::convolution_backward":
            g, x, w = (tuple(s) for s in e.input_shapes[:3])
            out_hw[(x, w)] = g[2:]
            acc[(layer_name(x, w, g[2:]), "backward")] += e.self_cpu_time_total / 1e6
        elif e.key == "aten::native_batch_norm":
            acc[("batch norm", "forward")] += e.self_cpu_time_total / 1e6
        elif e.key == "aten::native_batch_norm_backward":
            acc[("batch norm", "backward")] += e.self_cpu_time_total / 1e6
    for e in events:
        if e.key == "aten::mkldnn_convolution":
            x, w = (tuple(s) for s in e.input_shapes[:2])
            acc[(layer_name(x, w, out_hw[(x, w)]), "forward")] += e.self_cpu_time_total / 1e6
    return acc


def measure(rounds: int, batch: int) -> dict:
    import torch  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    torch.set_num_threads(1)
    a, b = ours("resnet20", batch), theirs("resnet20", batch)
    for fn in (a, b, a, b):
        fn()
    per_round = {"ours": [], "pytorch": []}
    steps = {"ours": [], "pytorch": []}  # as they run
    split_steps = {"ours": [], "pytorch": []}  # profiled (PyTorch) or wrapped (ours)
    for r in range(rounds):
        for name in ("ours", "pytorch") if r % 2 == 0 else ("pytorch", "ours"):
            fn = a if name == "ours" else b
            t0 = time.perf_counter()
            fn()
            steps[name].append(time.perf_counter() - t0)
            if name == "ours":
                acc = collections.defaultdict(float)
                with timed_ours(acc):
                    t0 = time.perf_counter()
                    a()
                    split_steps[name].append(time.perf_counter() - t0)
            else:
                with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                    t0 = time.perf_counter()
                    b()
                    split_steps[name].append(time.perf_counter() - t0)
                acc = torch_split(prof)
            per_round[name].append(acc)
    return {"steps": steps, "split_steps": split_steps, "split": per_round}


def _median_ms(rounds: list[dict], keys) -> float:
    return statistics.median(sum(r.get(k, 0.0) for k in keys) for r in rounds) * 1e3


def report(result: dict) -> tuple[list[str], list[list]]:
    ours_r, torch_r = result["split"]["ours"], result["split"]["pytorch"]
    # in the order the forward pass first reaches them (the split dicts fill in call order)
    layers = list(dict.fromkeys(k[0] for r in ours_r for k in r if k[0] != "batch norm"))
    rows = []

    def row(name, torch_ms, ours_ms, torch_split=None, ours_split=None):
        """A table row: the forward and backward columns only for rows split that way."""
        split = [f"{v:.1f}" for v in torch_split] if torch_split else ["", ""]
        split_ours = [f"{v:.1f}" for v in ours_split] if ours_split else ["", ""]
        return [name, *split, f"{torch_ms:.1f}", *split_ours, f"{ours_ms:.1f}", _ratio(ours_ms, torch_ms)]

    conv_ours, conv_torch = [], []
    for layer in layers:
        ours_keys = [(layer, p) for p in PASSES]
        o_f = _median_ms(ours_r, ours_keys[:1])
        o_b = _median_ms(ours_r, ours_keys[1:])
        t_f = _median_ms(torch_r, [(layer, "forward")])
        t_b = _median_ms(torch_r, [(layer, "backward")])
        conv_ours += ours_keys
        conv_torch += [(layer, "forward"), (layer, "backward")]
        rows.append(row(layer, t_f + t_b, o_f + o_b, (t_f, t_b), (o_f, o_b)))
    bn = [("batch norm", "forward"), ("batch norm", "backward")]
    o_conv, t_conv = _median_ms(ours_r, conv_ours), _median_ms(torch_r, conv_torch)
    rows.append(row("**all convolutions**", t_conv, o_conv))
    o_bn, t_bn = _median_ms(ours_r, bn), _median_ms(torch_r, bn)
    bn_split = [[_median_ms(r, [k]) for k in bn] for r in (torch_r, ours_r)]
    rows.append(row("batch norm (19 layers)", t_bn, o_bn, *bn_split))
    o_split = statistics.median(result["split_steps"]["ours"]) * 1e3
    t_split = statistics.median(result["split_steps"]["pytorch"]) * 1e3
    rows.append(row("everything else", t_split - t_conv - t_bn, o_split - o_conv - o_bn))
    rows.append(row("whole step, split as above", t_split, o_split))
    o_step = statistics.median(result["steps"]["ours"]) * 1e3
    t_step = statistics.median(result["steps"]["pytorch"]) * 1e3
    rows.append(row("**whole step as it runs**", t_step, o_step))
    headers = ["layer", "PyTorch fwd", "PyTorch bwd", "PyTorch ms", "ours fwd", "ours bwd", "ours ms", "ours / PyTorch"]
    return headers, rows


def _ratio(ours_ms, torch_ms):
    return f"{ours_ms / torch_ms:.2f}" if torch_ms > 0 else "-"


def main(argv=None):
    p = common.parser(__doc__.splitlines()[0], default_repeats=5)
    p.add_argument("--batch", type=int, default=BATCH)
    args = p.parse_args(argv)
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        raise SystemExit("this benchmark needs PyTorch: pip install torch==2.13.0") from None
    rounds = common.repeats_of(args, 5)
    result = measure(2 if args.quick else rounds, 8 if args.quick else args.batch)
    info = common.machine_info()
    print(common.machine_line(info) + f", PyTorch {torch.__version__}, {rounds} alternating rounds, ms per step")
    headers, rows = report(result)
    legend = [
        ("PyTorch fwd", "ms per step, medians of the rounds: forward, backward and their sum, for each framework"),
        ("ours / PyTorch", "our ms over PyTorch's (below 1: faster)"),
    ]
    print(common.markdown_table(headers, rows, legend))
    if args.json:
        payload = {"machine": info, "command": common.command_line(), "headers": headers, "rows": rows}
        common.write_json(args.json, payload)
    return rows


if __name__ == "__main__":
    main()
