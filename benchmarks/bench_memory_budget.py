"""A memory budget in the compiled step, beside PyTorch's, on the CPU: activations kept and
step time at budgets 1, 0.75, 0.5, 0.25 and 0.

Ours: ``fw.compile(step, memory_budget=b)`` (the step captured under policy ``off``);
PyTorch 2.13: ``torch.compile(forward_and_loss, backend="aot_eager_decomp_partition")``
under ``torch._functorch.config.activation_memory_budget = b`` (its min-cut partitioner
with the knapsack over recomputation), the optimizer step eager. Two workloads, the same
model code in both frameworks (one thread each):

- ``gpt-block``: one pre-LN Transformer block (``models/gpt.py`` Block; PyTorch's twin
  ``benchmarks/gpt_torch.py``), width 256 (``--width``), 4 heads, context 64, batch 8,
  written-out attention, no dropout; loss: mean squared error against a random target;
  SGD with momentum;
- ``resnet20``: CIFAR ResNet-20 (width 16, BatchNorm, option-A shortcuts; PyTorch's twin
  ``bench_models.torch_model``), batch 32 of 32x32 images, cross entropy, SGD with momentum.

Activations kept: what backward reads from forward, once per buffer, parameters and
module buffers left out (the batch counts where backward reads it). Ours: the compiled
plan's ``report()["saved_bytes"]`` (saved buffers and what forward kernels keep for
backward: BatchNorm's and LayerNorm's statistics). PyTorch: the distinct storages autograd
saves during one step (``torch.autograd.graph.saved_tensors_hooks``). Step time: the ten
compiled steps of a workload timed in rounds that alternate (the machine is shared: noise
falls on all alike), the median per step. Each of our compiled steps is also checked
bitwise against the eager step under policy ``off`` (losses of the first steps).

With PyTorch the run also checks its budget 0 on a step with dropout (two Linear layers,
dropout 0.5 between): the loss at budget 0 and at budget 1, same weights and seed, and how
far apart the two gradients are (0 when backward reuses forward's mask).

Run:  OMP_NUM_THREADS=1 python benchmarks/bench_memory_budget.py [--repeats 7] [--quick] [--only gpt-block resnet20]
          [--width 256] [--figure docs/img/memory_budget.png] [--json PATH] [--no-torch]
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common
else:
    from . import common

import framework as fw
from framework.nn import functional as F
from models import build_model
from models.gpt import Block, GPTConfig

BUDGETS = (1.0, 0.75, 0.5, 0.25, 0.0)
WORKLOADS = ("gpt-block", "resnet20")
MB = 1024 * 1024
CHECK_STEPS = 3  # steps of each compiled step compared bitwise with eager off (then replayed)


def _shape(workload, width, quick):
    if workload == "gpt-block":
        return dict(width=32 if quick else width, heads=4, context=16 if quick else 64, batch=2 if quick else 8)
    return dict(width=4 if quick else 16, image=8 if quick else 32, batch=4 if quick else 32)


def _data(workload, shape):
    rng = np.random.default_rng(0)
    if workload == "gpt-block":
        size = (shape["batch"], shape["context"], shape["width"])
        return rng.standard_normal(size).astype(np.float32), rng.standard_normal(size).astype(np.float32)
    x = rng.standard_normal((shape["batch"], 3, shape["image"], shape["image"])).astype(np.float32)
    return x, rng.integers(0, 10, shape["batch"])


def _gpt_config(shape):
    return GPTConfig(block_size=shape["context"], n_embd=shape["width"], n_head=shape["heads"], dropout=0.0)


# --- ours --------------------------------------------------------------------------------------


def ours(workload, shape, budget):
    """A compiled training step at ``budget`` (and the same step eager, for the bitwise check)."""
    fw.manual_seed(0)
    if workload == "gpt-block":
        model = Block(_gpt_config(shape))
        loss_fn = F.mse_loss
    else:
        model = build_model("resnet20", width=shape["width"], norm="bn")
        loss_fn = F.cross_entropy
    opt = fw.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    xa, ya = _data(workload, shape)
    x, y = fw.tensor(xa), fw.tensor(ya)

    def step(x, y):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step, (x, y)


def measure_ours(workload, shape, budget):
    """Runs under policy off (see run())."""
    eager, args = ours(workload, shape, budget)
    reference = [eager(*args).detach().numpy().copy() for _ in range(CHECK_STEPS)]
    step, args = ours(workload, shape, budget)
    compiled = fw.compile(step, memory_budget=budget)
    losses = [compiled(*args).detach().numpy().copy() for _ in range(CHECK_STEPS)]
    r = compiled.report()
    return (
        compiled,
        args,
        {
            "kept": r["saved_bytes"],
            "planned_peak": r["planned_peak_bytes"],
            "floor": r["floor_bytes"],
            "recomputed_ops": len(r["recomputed"]),
            "recompute_flops": r["recompute_flops"],
            "recompute_bytes": r["recompute_bytes"],
            "bitwise": [a.tobytes() for a in losses] == [a.tobytes() for a in reference],
            "replays": r["replays"],
        },
    )


# --- PyTorch -------------------------------------------------------------------------------------


def theirs(workload, shape, budget):
    """PyTorch's step with its forward and loss compiled at ``budget``; returns (step, model)."""
    import torch  # noqa: PLC0415
    import torch._functorch.config as functorch_config  # noqa: PLC0415

    torch.manual_seed(0)
    if workload == "gpt-block":
        from benchmarks.gpt_torch import Block as TorchBlock  # noqa: PLC0415

        model = TorchBlock(_gpt_config(shape))
        loss_fn = torch.nn.functional.mse_loss
    else:
        from benchmarks.bench_models import torch_model  # noqa: PLC0415

        model = torch_model("resnet20", width=shape["width"])
        loss_fn = torch.nn.functional.cross_entropy
    xa, ya = _data(workload, shape)
    x, y = torch.from_numpy(xa), torch.from_numpy(np.asarray(ya))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def forward(x, y):
        return loss_fn(model(x), y)

    # Dynamo caches compiled graphs per code object and, with modules inlined, would reuse
    # the first budget's graph for another instance of the same model: each budget's
    # forward gets a code object of its own, so each is compiled (and partitioned) afresh.
    code = forward.__code__.replace(co_name=f"forward_budget_{round(budget * 100)}")
    forward = types.FunctionType(code, forward.__globals__, code.co_name, None, forward.__closure__)
    compiled = torch.compile(forward, backend="aot_eager_decomp_partition")

    def step():
        opt.zero_grad(set_to_none=True)
        loss = compiled(x, y)
        loss.backward()
        opt.step()
        return loss

    functorch_config.activation_memory_budget = budget
    try:
        step()  # compiles: the partitioner reads the budget now
    finally:
        functorch_config.activation_memory_budget = 1.0
    return step, model


def torch_kept(step, model) -> int:
    """Bytes of the distinct storages autograd saves for backward in one step, parameters
    and buffers left out."""
    import torch  # noqa: PLC0415

    own = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(saved.values())


def torch_dropout_check() -> dict:
    """PyTorch's budget 0 on a step with dropout: two Linear layers with ReLU and dropout
    (p=0.5) between, the same weights and generator seed at budget 1 and at budget 0. The
    forward (the loss) is the same; if backward recomputes the dropout with a new draw, the
    gradient is another mask's. Returns the loss of each and the largest difference of the
    first layer's weight gradient."""
    import torch  # noqa: PLC0415
    import torch._functorch.config as functorch_config  # noqa: PLC0415

    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(  # noqa: E731
        torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(32, 32)
    )
    base, x = make(), torch.randn(64, 32)
    out = {}
    for budget in (1.0, 0.0):
        model = make()
        model.load_state_dict(base.state_dict())

        def forward(x, model=model):
            return model(x).square().mean()

        code = forward.__code__.replace(co_name=f"dropout_budget_{round(budget * 100)}")
        forward = types.FunctionType(code, forward.__globals__, code.co_name, forward.__defaults__)
        compiled = torch.compile(forward, backend="aot_eager_decomp_partition")
        functorch_config.activation_memory_budget = budget
        try:
            torch.manual_seed(123)
            loss = compiled(x)
            loss.backward()
        finally:
            functorch_config.activation_memory_budget = 1.0
        out[budget] = (loss.item(), model[0].weight.grad.clone())
    return {
        "loss_budget_1": out[1.0][0],
        "loss_budget_0": out[0.0][0],
        "max_grad_difference": float((out[1.0][1] - out[0.0][1]).abs().max()),
    }


# --- the run ---------------------------------------------------------------------------------------


def run(workload, shape, repeats, with_torch):
    steps, rows = {}, {}
    for b in BUDGETS:
        compiled, args, row = measure_ours(workload, shape, b)
        steps[f"ours {b}"] = (lambda f, a: lambda: f(*a))(compiled, args)
        rows[b] = {"ours": row}
    if with_torch:
        import torch  # noqa: PLC0415

        torch.set_num_threads(1)
        for b in BUDGETS:
            step, model = theirs(workload, shape, b)
            rows[b]["torch"] = {"kept": torch_kept(step, model), "model": model, "step": step}
            steps[f"torch {b}"] = step
    times = common.interleaved(steps, repeats, warmup=1)
    for b in BUDGETS:
        rows[b]["ours"]["step_ms"] = 1e3 * float(np.median(times[f"ours {b}"]))
        if with_torch:
            t = rows[b]["torch"]
            kept_again = torch_kept(t.pop("step"), t.pop("model"))  # the same graph after the timing
            if kept_again != t["kept"]:
                raise RuntimeError(f"PyTorch's step at budget {b} kept {kept_again} bytes, then {t['kept']}")
            t["step_ms"] = 1e3 * float(np.median(times[f"torch {b}"]))
    return rows


def table(results, with_torch) -> str:
    headers = ["workload", "budget", "ours kept MB", "ours step ms", "recomputed ops", "ours planned peak MB"]
    if with_torch:
        headers += ["PyTorch kept MB", "PyTorch step ms", "kept ours/PyTorch"]
    headers.append("bitwise")
    out = []
    for workload, rows in results.items():
        for b, row in rows.items():
            o = row["ours"]
            cells = [
                workload,
                f"{b:g}",
                f"{o['kept'] / MB:.3f}",
                f"{o['step_ms']:.2f}",
                o["recomputed_ops"],
                f"{o['planned_peak'] / MB:.2f}",
            ]
            if with_torch:
                t = row["torch"]
                cells += [f"{t['kept'] / MB:.3f}", f"{t['step_ms']:.2f}", f"{o['kept'] / t['kept']:.2f}"]
            cells.append("yes" if o["bitwise"] else "NO")
            out.append(cells)
    legend = [
        ("kept MB", "what backward reads from forward, once per buffer, parameters and module buffers left out"),
        ("step ms", "median of the alternating rounds, one thread"),
        ("recomputed ops", "forward nodes our step runs again in backward (report()['recomputed'])"),
        ("bitwise", "our compiled step's losses equal eager off's, bit for bit"),
    ]
    return common.markdown_table(headers, out, legend)


def figure(results, path, with_torch) -> str:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.2), squeeze=False)
    for ax, (workload, rows) in zip(axes[0], results.items()):
        sides = [("ours", "fw.compile(memory_budget=b)", "o", "tab:blue")]
        if with_torch:
            sides.append(("torch", "torch.compile, activation_memory_budget=b", "s", "tab:orange"))
        for side, label, marker, color in sides:
            xs = [rows[b][side]["step_ms"] for b in BUDGETS]
            ys = [rows[b][side]["kept"] / MB for b in BUDGETS]
            ax.plot(xs, ys, marker=marker, color=color, label=label)
            for b, x, y in zip(BUDGETS, xs, ys):
                ax.annotate(f"{b:g}", (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8, color=color)
        ax.set_title(workload)
        ax.set_xlabel("step time (ms, median, one thread)")
        ax.set_ylabel("activations kept for backward (MB)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("memory budget: activations kept against step time (labels: b)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    p = common.parser(__doc__.split("\n\n")[0], default_repeats=7)
    p.add_argument("--only", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--width", type=int, default=256, help="the GPT block's width (4 heads; default 256)")
    p.add_argument("--figure", metavar="PATH", default=None, help="save the figure (activations against step time)")
    p.add_argument("--no-torch", action="store_true", help="our side only (no PyTorch needed)")
    args = p.parse_args(argv)
    repeats = common.repeats_of(args, 7)
    with_torch = not args.no_torch
    info = common.machine_info()
    results = {}
    with fw.inplace.policy("off"):  # our steps are captured (and replayed) under off
        for workload in args.only:
            shape = _shape(workload, args.width, args.quick)
            results[workload] = run(workload, shape, repeats, with_torch)
    print(f"## Memory budget: {common.command_line()}\n")
    print(common.machine_line(info) + "\n")
    print(table(results, with_torch))
    payload = {
        "command": common.command_line(),
        "machine": info,
        "params": {"repeats": repeats, "quick": args.quick, "width": args.width, "torch": with_torch},
        "shapes": {w: _shape(w, args.width, args.quick) for w in args.only},
        "results": {w: {str(b): row for b, row in rows.items()} for w, rows in results.items()},
    }
    if with_torch:
        import torch  # noqa: PLC0415

        payload["torch"] = torch.__version__
        check = payload["torch_dropout_check"] = torch_dropout_check()
        print(
            "\nPyTorch, dropout at budget 0 against budget 1 (same weights, same seed): loss "
            f"{check['loss_budget_0']:.8g} against {check['loss_budget_1']:.8g}, first layer's weight gradient "
            f"differs by up to {check['max_grad_difference']:.3g} (0 when backward reuses forward's mask)"
        )
    if args.figure:
        print(f"\nfigure: {figure(results, args.figure, with_torch)}")
    if args.json:
        common.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
