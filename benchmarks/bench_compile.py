"""Compiled training steps (``fw.compile``) against eager ones: numbers, memory, speed.

Four measurements, one per target of the issue:

1. **Bitwise.** Each model trains ``--steps`` steps eagerly under policy ``off`` and
   compiled (captured under ``off``, then replayed), from the same seed on the same
   batches. After every step the loss, the parameters, the running statistics and the
   optimizer state must be equal bit for bit.
2. **Memory.** One step's peak: eager under ``off`` and ``auto`` (measured), and for the
   step compiled under the same policy its planned peak, its measured replay peak, the
   lower bound and the floor (the policy decides Python-level sites, such as InPlace-ABN
   fused or not, before the compiler sees the ops). A step's
   peak counts its own inputs (parameters, optimizer state, the batch) and everything it
   allocates; gradients of the previous step are dropped before each measured step (the
   step's ``zero_grad`` would free them first).
3. **Speed.** The quickstart MLP's step, eager and compiled, under the same policy
   (interleaved, min of ``--repeats``); and the per-op overhead chain of
   ``bench_op_overhead`` (200 tiny ops and their backward) replayed.
4. **Capture cost.** The first call of a compiled step (captured while it runs, then
   planned) against an eager step; the first optimizer step creates the momentum buffers,
   so the step is captured once more at its second call: both are shown.

Run from the repository root::

    python -m benchmarks.bench_compile [--steps 100] [--repeats 20] [--quick] [--json PATH]
"""

from __future__ import annotations

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
import framework.nn.functional as F
from framework import memory
from models.convnet import ConvNet
from models.mlp import MLP
from models.resnet import ResNet

MB = 1024 * 1024

# name -> (model factory, input shape per sample, batch for the bitwise run, batch for memory)
MODELS = {
    "mlp (quickstart)": (lambda: MLP(in_features=64, num_classes=10, hidden=(256, 256)), (64,), 32, 32),
    "convnet": (
        lambda: ConvNet(in_channels=1, num_classes=10, channels=(32, 64), image_size=8, norm="bn"),
        (1, 8, 8),
        32,
        32,
    ),
    "resnet20": (lambda: ResNet(depth=20, width=16, norm="bn"), (3, 32, 32), 16, 64),
    "resnet20 + InPlace-ABN": (lambda: ResNet(depth=20, width=16, norm="inplace_abn"), (3, 32, 32), 16, 64),
}
QUICK = {
    "mlp (quickstart)": (lambda: MLP(in_features=64, num_classes=10, hidden=(32, 32)), (64,), 8, 8),
    "resnet8": (lambda: ResNet(depth=8, width=4, norm="bn"), (3, 8, 8), 2, 4),
}


def setup(factory, policy, seed=0):
    fw.inplace.set_policy(policy)
    fw.manual_seed(seed)
    model = factory()
    opt = fw.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)

    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return model, opt, step


def make_batches(shape, batch, n, seed=1):
    rng = np.random.default_rng(seed)
    return [
        (
            fw.from_numpy(rng.standard_normal((batch,) + shape).astype(np.float32)),
            fw.from_numpy(rng.integers(0, 10, batch)),
        )
        for _ in range(n)
    ]


def state_of(model, opt):
    out = [p.detach().numpy().copy() for p in model.parameters()]
    out += [b.numpy().copy() for b in model.buffers()]
    for st in opt.state.values():
        out += [st[k].numpy().copy() for k in sorted(st) if isinstance(st[k], fw.Tensor)]
    return out


# --- 1. bitwise -----------------------------------------------------------------------------


def bitwise(factory, shape, batch, steps, policy="off"):
    """The first step where compiled and eager differ (None: equal at every step)."""
    batches = make_batches(shape, batch, steps)
    runs = []
    for compiled in (False, True):
        model, opt, step = setup(factory, policy)
        f = fw.compile(step) if compiled else step
        losses, states = [], []
        for x, y in batches:
            losses.append(f(x, y).detach().numpy().tobytes())
            states.append(b"".join(a.tobytes() for a in state_of(model, opt)))
        runs.append((losses, states))
    (le, se), (lc, sc) = runs
    for k in range(steps):
        if le[k] != lc[k] or se[k] != sc[k]:
            return k
    return None


# --- 2. memory --------------------------------------------------------------------------------


def eager_peak(factory, shape, batch, policy, persistent):
    model, opt, step = setup(factory, policy)
    (x, y), (x2, y2) = make_batches(shape, batch, 2)
    step(x, y)  # creates the momentum buffers
    opt.zero_grad()
    memory.reset_peak()
    base = memory.allocated_bytes()
    step(x2, y2)
    return memory.max_allocated_bytes() - base + persistent


def compiled_report(factory, shape, batch, policy):
    model, opt, step = setup(factory, policy)
    f = fw.compile(step)
    for x, y in make_batches(shape, batch, 3):
        f(x, y)
    return f.report()


def memory_row(name, factory, shape, batch):
    r_off = compiled_report(factory, shape, batch, "off")
    r_auto = compiled_report(factory, shape, batch, "auto")
    pers = r_off["persistent_bytes"]
    row = {
        "model": name,
        "batch": batch,
        "eager_off_peak": eager_peak(factory, shape, batch, "off", pers),
        "eager_auto_peak": eager_peak(factory, shape, batch, "auto", pers),
    }
    for tag, r in (("off", r_off), ("auto", r_auto)):
        row[tag] = {
            "planned_peak": r["planned_peak_bytes"],
            "replay_peak": r["replay_peak_bytes"],
            "lower_bound": r["lower_bound_bytes"],
            "floor": r["floor_bytes"],
            "arena": r["arena_bytes"],
            "reinplaced": len(r["reinplaced_ops"]),
            "unbound": len(r["unbound_writebacks"]),
            "nodes": r["nodes"],
        }
    return row


# --- 3. speed ---------------------------------------------------------------------------------


def mlp_speed(repeats, policy, quick):
    factory, shape, batch, _ = (QUICK if quick else MODELS)["mlp (quickstart)"]
    _, _, eager = setup(factory, policy)
    _, _, step = setup(factory, policy)
    compiled = fw.compile(step)
    x, y = make_batches(shape, batch, 1)[0]
    for _ in range(3):
        compiled(x, y)
    times = common.interleaved({"eager": lambda: eager(x, y), "compiled": lambda: compiled(x, y)}, repeats)
    return {k: common.summarize(v) for k, v in times.items()}


def tiny_ops(repeats, n_ops):
    from benchmarks.bench_op_overhead import FW_OPS, MIX, _schedule, make_variants

    fw.inplace.set_policy("auto")
    fw.manual_seed(0)
    x = fw.randn(10, requires_grad=True)
    c = fw.rand(10) * 0.2 + 0.9
    fns = [FW_OPS[k] for k in _schedule(MIX, n_ops)]

    def step(x):
        x.grad = None
        h = x
        for fn in fns:
            h = fn(h, c)
        h.sum().backward()

    compiled = fw.compile(step, modules=[], optimizers=[])
    for _ in range(3):
        compiled(x)
    ref = make_variants(MIX, n_ops)["NumPy forward + backward kernels"]
    times = common.interleaved({"eager": lambda: step(x), "compiled": lambda: compiled(x), "numpy": ref}, repeats)
    return {k: common.summarize(v)["min"] / n_ops * 1e6 for k, v in times.items()}


# --- 4. capture cost ----------------------------------------------------------------------------


def capture_cost(factory, shape, batch, repeats):
    _, _, eager = setup(factory, "auto")
    batches = make_batches(shape, batch, 3)
    eager(*batches[0])
    eager_s = min(common.time_repeats(lambda: eager(*batches[1]), repeats, warmup=0))
    _, _, step = setup(factory, "auto")
    f = fw.compile(step)
    t0 = time.perf_counter()
    f(*batches[0])
    t1 = time.perf_counter()
    f(*batches[1])
    t2 = time.perf_counter()
    return {
        "eager_s": eager_s,
        "first_call_s": t1 - t0,
        "second_call_s": t2 - t1,
        "build_s": f._current().build_seconds,
    }


def main(argv=None) -> dict:
    p = common.parser(__doc__.splitlines()[0], default_repeats=20)
    p.add_argument("--steps", type=int, default=None, help="steps of the bitwise runs (default 100; 5 with --quick)")
    args = p.parse_args(argv)
    repeats = common.repeats_of(args, 20)
    steps = args.steps or (5 if args.quick else 100)
    models = QUICK if args.quick else MODELS
    info = common.machine_info()
    print(f"## Compiled steps (`fw.compile`) against eager\n\nMachine: {common.machine_line(info)}\n")

    bit_rows, bits = [], {}
    for name, (factory, shape, batch, _) in models.items():
        t0 = time.perf_counter()
        first_diff = bitwise(factory, shape, batch, steps)
        bits[name] = first_diff
        bit_rows.append(
            [
                name,
                batch,
                steps,
                "yes" if first_diff is None else f"no (step {first_diff})",
                f"{time.perf_counter() - t0:.0f} s",
            ]
        )
    print(f"### Bitwise: compiled (captured under `off`) vs eager `off`, {steps} steps\n")
    print(
        common.markdown_table(
            ["model", "batch", "steps", "losses, params, running stats, optimizer state equal", "time"],
            bit_rows,
            [("time", "wall-clock seconds of both trainings, eager and compiled")],
        )
    )

    mem = []
    for name, (factory, shape, _, batch) in models.items():
        mem.append(memory_row(name, factory, shape, batch))
    print("\n### Memory of one step (MB)\n")
    rows = []
    for m in mem:
        for tag in ("off", "auto"):
            c = m[tag]
            rows.append(
                [
                    m["model"],
                    m["batch"],
                    tag,
                    f"{m['eager_' + tag + '_peak'] / MB:.3f}",
                    f"{c['planned_peak'] / MB:.3f}",
                    f"{c['replay_peak'] / MB:.3f}",
                    f"{c['lower_bound'] / MB:.3f}",
                    f"{c['floor'] / MB:.3f}",
                    f"{c['planned_peak'] / c['floor']:.3f}",
                    f"{c['arena'] / MB:.2f}",
                    c["reinplaced"],
                    c["unbound"],
                ]
            )
    print(
        common.markdown_table(
            [
                "model",
                "batch",
                "policy",
                "eager peak",
                "compiled: planned",
                "replay (measured)",
                "lower bound",
                "floor",
                "planned/floor",
                "arena",
                "re-inplaced ops",
                "unbound chains",
            ],
            rows,
            [
                ("eager peak", "MB (2^20 bytes) of one eager step, measured; the next four: the compiled step's"),
                ("compiled: planned", "the memory plan's peak; replay (measured): the last replay's measured peak"),
                ("lower bound", "the arena packed perfectly: each buffer allocated when made, freed after last use"),
                ("floor", "parameters + gradients + optimizer state + what backward reads from forward"),
                ("planned/floor", "planned peak over the floor (1.000: nothing above what the step must hold)"),
                ("arena", "MB of the one buffer the planned values live in"),
                (
                    "re-inplaced ops",
                    "ops the compiler turned in place; unbound chains: inputs whose chain "
                    "does not end in their own buffer",
                ),
            ],
        )
    )

    speed = {pol: mlp_speed(repeats, pol, args.quick) for pol in ("auto", "off")}
    n_ops = 20 if args.quick else 200
    tiny = tiny_ops(repeats, n_ops)
    print(f"\n### Speed (min of {repeats}, interleaved)\n")
    srows = [
        [
            f"quickstart MLP step, policy {pol}",
            f"{s['eager']['min'] * 1e3:.3f} ms",
            f"{s['compiled']['min'] * 1e3:.3f} ms",
            f"{s['eager']['min'] / s['compiled']['min']:.2f}x",
        ]
        for pol, s in speed.items()
    ]
    srows.append(
        [
            f"tiny op + its backward ({n_ops}-op chain), per op",
            f"{tiny['eager']:.2f} µs",
            f"{tiny['compiled']:.2f} µs",
            f"{tiny['eager'] / tiny['compiled']:.1f}x",
        ]
    )
    print(
        common.markdown_table(
            ["what", "eager", "compiled", "speedup"],
            srows,
            [("speedup", "eager over compiled, minimum times (above 1x: compiled is faster)")],
        )
    )
    print(f"\n(NumPy forward + backward kernels of the same chain, written by hand: {tiny['numpy']:.2f} µs/op)")

    cap_name = "resnet20" if "resnet20" in models else "resnet8"
    caps = {}
    for name in ("mlp (quickstart)", cap_name):
        factory, shape, _, batch = models[name]
        caps[name] = capture_cost(factory, shape, batch, max(3, repeats // 4))
    print("\n### Capture cost (policy auto)\n")
    print(
        common.markdown_table(
            ["model", "eager step", "first call (capture)", "ratio", "second call (capture + plan)", "ratio", "plan"],
            [
                [
                    n,
                    f"{c['eager_s'] * 1e3:.1f} ms",
                    f"{c['first_call_s'] * 1e3:.1f} ms",
                    f"{c['first_call_s'] / c['eager_s']:.2f}x",
                    f"{c['second_call_s'] * 1e3:.1f} ms",
                    f"{c['second_call_s'] / c['eager_s']:.2f}x",
                    f"{c['build_s'] * 1e3:.1f} ms",
                ]
                for n, c in caps.items()
            ],
            [
                ("ratio", "the call before it over the eager step's time"),
                ("plan", "the time spent planning (passes, memory plan, verifier), part of the call"),
            ],
        )
    )

    resnet = next((m for m in mem if m["model"] == "resnet20"), mem[-1])["auto"]
    mlp_auto = speed["auto"]["eager"]["min"] / speed["auto"]["compiled"]["min"]
    targets = [
        (
            "compiled bitwise equal to eager off over the steps, every model",
            all(v is None for v in bits.values()),
            ", ".join(f"{k}: {'yes' if v is None else 'no'}" for k, v in bits.items()),
        ),
        (
            "planned peak (compiled under auto) <= eager auto peak, every model",
            all(m["auto"]["planned_peak"] <= m["eager_auto_peak"] for m in mem),
            ", ".join(f"{m['model']}: {m['auto']['planned_peak'] / m['eager_auto_peak']:.4f}" for m in mem),
        ),
        (
            "planned peak <= 1.05x floor on ResNet-20 (under auto)",
            resnet["planned_peak"] <= 1.05 * resnet["floor"],
            f"{resnet['planned_peak'] / resnet['floor']:.3f}",
        ),
        ("quickstart MLP compiled / eager >= 1.5x (policy auto)", mlp_auto >= 1.5, f"{mlp_auto:.2f}x"),
        ("replayed tiny op <= 2 µs (with its backward)", tiny["compiled"] <= 2.0, f"{tiny['compiled']:.2f} µs"),
        (
            "first call (capture) <= 3x an eager step",
            all(c["first_call_s"] <= 3 * c["eager_s"] for c in caps.values()),
            ", ".join(f"{n}: {c['first_call_s'] / c['eager_s']:.2f}x" for n, c in caps.items()),
        ),
        (
            "second call (capture again + plan + code) <= 3x an eager step",
            all(c["second_call_s"] <= 3 * c["eager_s"] for c in caps.values()),
            ", ".join(f"{n}: {c['second_call_s'] / c['eager_s']:.2f}x" for n, c in caps.items()),
        ),
        (
            "(not a target) compiled under off: planned peak <= eager auto peak",
            all(m["off"]["planned_peak"] <= m["eager_auto_peak"] for m in mem),
            ", ".join(
                f"{m['model']}: {m['off']['planned_peak'] / m['eager_auto_peak']:.4f} "
                f"(measured {m['off']['replay_peak'] / m['eager_auto_peak']:.4f})"
                for m in mem
            ),
        ),
    ]
    print("\n### Targets\n")
    print(
        common.markdown_table(
            ["target (issue 13)", "met", "value"], [[t, "yes" if ok else "no", v] for t, ok, v in targets]
        )
    )
    payload = {
        "benchmark": "compile",
        "machine": info,
        "command": common.command_line(),
        "params": {"steps": steps, "repeats": repeats, "quick": args.quick},
        "bitwise_first_difference": bits,
        "memory": mem,
        "speed_mlp": speed,
        "tiny_op_us": tiny,
        "capture": caps,
        "targets": {t: ok for t, ok, _ in targets},
    }
    if args.json:
        common.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
