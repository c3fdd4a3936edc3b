"""Memory and speed of the registered models under inplace off, on, auto, and with InPlace-ABN.

For each model (MLP on 64-dim inputs, batch 256, with BatchNorm and without any norm;
ConvNet on 8x8 images, batch 256; ResNet-20, width 16, on 32x32 images, batch 128) and
each variant (policy off, on, auto; on and auto with InPlace-ABN where the model has a
norm), one training step (SGD, momentum 0.9) is measured:

- peak: ``memory.max_allocated_bytes()`` over a steady-state step (after warmup, so
  gradients and momentum buffers exist), from ``reset_peak()`` with only that variant
  alive;
- floor: parameters + gradients + optimizer state + ``memory.saved_bytes()`` at the
  forward/backward boundary (docs/DESIGN.md), the saved parameters (weights that linear, conv
  and BN nodes hold) counted once; peak / floor says how much the step allocates beyond
  what it must hold;
- activation memory: peak minus parameters, gradients and optimizer state;
- samples/s: median over several timed steps after warmup, the variants (and PyTorch)
  interleaved round by round so machine noise hits them alike;
- auto ops / auto MB: per step, the ops policy auto ran in place and the bytes they did
  not allocate (``memory.stats()``).

If PyTorch is importable, the same ResNet-20 step (option-A shortcuts, SGD momentum,
batch 128) runs in PyTorch in the same rounds, and the ratio of our samples/s to
PyTorch's is reported.

Run:  python benchmarks/bench_models.py [--quick] [--json PATH] [--models resnet20 ...]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import framework as fw  # noqa: E402
from benchmarks import common  # noqa: E402
from framework import memory, nn, optim  # noqa: E402
from models import build_model  # noqa: E402

MB = 2**20

# name -> (registry name, kwargs for off/on, kwargs for on + InPlace-ABN, input shape per sample, batch)
MODELS = {
    "mlp": (
        "mlp",
        dict(in_features=64, hidden=(128, 128), norm="bn"),
        dict(in_features=64, hidden=(128, 128), norm="inplace_abn"),
        (64,),
        256,
    ),
    "convnet": (
        "convnet",
        dict(channels=(32, 64), image_size=8, norm="bn"),
        dict(channels=(32, 64), image_size=8, norm="inplace_abn"),
        (1, 8, 8),
        256,
    ),
    "mlp_plain": ("mlp", dict(in_features=64, hidden=(128, 128)), None, (64,), 256),
    "resnet20": ("resnet20", dict(width=16, norm="bn"), dict(width=16, norm="inplace_abn"), (3, 32, 32), 128),
}
VARIANTS = (
    ("off", "off", False),
    ("on", "on", False),
    ("auto", "auto", False),
    ("on+InPlaceABN", "on", True),
    ("auto+InPlaceABN", "auto", True),
)


def variants_of(model_name: str):
    """The variants that apply to a model (no InPlace-ABN rows for a model without a norm)."""
    return [v for v in VARIANTS if not v[2] or MODELS[model_name][2] is not None]


TARGETS = {
    "act_ratio": 0.50,  # ResNet-20: activation memory on+InPlaceABN <= 50% of off
    "peak_over_floor": 1.15,  # ResNet-20: peak <= 1.15 x floor
    "torch_ratio": 0.5,  # ResNet-20 samples/s under on >= 0.5 x PyTorch's
}


class Runner:
    """One model variant: model, optimizer, a fixed batch, and one training step.

    ``device`` puts the model and the batch on a GPU (``"cuda"``; benchmarks/bench_gpu.py),
    ``batch`` overrides the model's batch from :data:`MODELS`.
    """

    def __init__(
        self,
        model_name: str,
        variant: str,
        policy: str,
        abn: bool,
        seed: int = 0,
        device="cpu",
        batch: int | None = None,
    ):
        reg, kw_bn, kw_abn, shape, default_batch = MODELS[model_name]
        batch = batch or default_batch
        self.model_name, self.variant, self.policy, self.batch = model_name, variant, policy, batch
        self.device = fw.device(device)
        with fw.inplace.policy(policy):
            fw.manual_seed(seed)
            self.model = build_model(reg, **(kw_abn if abn else kw_bn))
            if self.device.type != "cpu":
                self.model.to(self.device)
            self.opt = optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        rng = np.random.default_rng(seed)
        self.x = fw.tensor(rng.standard_normal((batch,) + shape).astype(np.float32), device=self.device)
        self.y = fw.tensor(rng.integers(0, 10, size=batch).astype(np.int64), device=self.device)
        self.loss_fn = nn.CrossEntropyLoss()
        self.saved_at_boundary = 0
        self.saved_state_at_boundary = 0
        self.auto_stats = (0, 0)

    def step(self, read_loss: bool = True) -> float | None:
        """One training step; ``read_loss=False`` leaves the loss on the device (no sync)."""
        before = memory.stats()
        with fw.inplace.policy(self.policy):
            self.opt.zero_grad()
            loss = self.loss_fn(self.model(self.x), self.y)
            self.saved_at_boundary = memory.saved_bytes()
            # Nodes also hold weights (linear, conv, BN): those are already parameters.
            self.saved_activations_at_boundary = memory.saved_bytes(parameters=False)
            loss.backward()
            self.opt.step()
            after = memory.stats()
            self.auto_stats = tuple(
                after.get(k, 0) - before.get(k, 0) for k in ("auto_inplace_ops", "auto_inplace_bytes")
            )
            return loss.item() if read_loss else None

    def state_bytes(self) -> dict:
        """Parameters (and BN buffers), gradients and optimizer state, by category."""
        b = memory.breakdown(self.device)
        return {k: b[k] for k in ("parameters", "gradients", "optimizer_state")}

    def measure_memory(self, warmup: int = 2, steps: int = 1) -> dict:
        """Peak over ``steps`` steady-state steps (after ``warmup``, from ``reset_peak()``).

        On a GPU the peak is the pool hook's (rounded pool blocks, every allocation); the
        per-category numbers are tracked arrays at their nbytes.
        """
        for _ in range(warmup):
            self.step()
        gc.collect()
        memory.reset_peak()
        for _ in range(steps):
            self.step()
        peak = memory.max_allocated_bytes(self.device)
        state = self.state_bytes()
        fixed = sum(state.values())
        saved_activations = self.saved_activations_at_boundary
        floor = fixed + saved_activations
        return {
            "peak_mb": peak / MB,
            "floor_mb": floor / MB,
            "peak_over_floor": peak / floor,
            "activation_mb": (peak - fixed) / MB,
            "saved_mb": saved_activations / MB,
            "params_mb": state["parameters"] / MB,
            "grads_mb": state["gradients"] / MB,
            "optimizer_mb": state["optimizer_state"] / MB,
            "peak_breakdown_mb": {k: v / MB for k, v in memory.peak_breakdown(self.device).items() if v},
            "auto_ops": self.auto_stats[0],
            "auto_mb": self.auto_stats[1] / MB,
        }


def torch_model(model_name: str, width: int | None = None):
    """The same architecture as ``MODELS[model_name]`` with ``norm="bn"``, in PyTorch.

    Activations are ``ReLU(inplace=True)`` and the residual add is ``out += identity``,
    as in torchvision's ResNets. ``mlp``: Flatten, [Linear (no bias), BatchNorm1d, ReLU]
    per hidden layer, Linear. ``convnet``: [Conv3x3 (no bias), BatchNorm2d, ReLU,
    MaxPool2d(2)] per block, Flatten, Linear. ``resnet20``: CIFAR ResNet-20 with option-A
    shortcuts (strided subsampling, zero-padded channels), of ``width`` (default the entry's).
    """
    import torch.nn as tnn  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    reg, kw, _, shape, _ = MODELS[model_name]
    if reg == "mlp":
        if kw.get("norm") != "bn":
            raise ValueError(f"no PyTorch twin for {model_name!r} (norm={kw.get('norm')!r})")
        layers, prev = [tnn.Flatten()], kw["in_features"]
        for width in kw["hidden"]:
            layers += [tnn.Linear(prev, width, bias=False), tnn.BatchNorm1d(width), tnn.ReLU(inplace=True)]
            prev = width
        return tnn.Sequential(*layers, tnn.Linear(prev, 10))
    if reg == "convnet":
        layers, prev = [], shape[0]
        for c in kw["channels"]:
            layers += [
                tnn.Conv2d(prev, c, 3, padding=1, bias=False),
                tnn.BatchNorm2d(c),
                tnn.ReLU(inplace=True),
                tnn.MaxPool2d(2),
            ]
            prev = c
        side = kw["image_size"] >> len(kw["channels"])
        return tnn.Sequential(*layers, tnn.Flatten(), tnn.Linear(prev * side * side, 10))

    class Block(tnn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = tnn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = tnn.BatchNorm2d(cout)
            self.conv2 = tnn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = tnn.BatchNorm2d(cout)
            self.stride, self.pad = stride, cout - cin

        def forward(self, x):
            out = F.relu(self.bn1(self.conv1(x)), inplace=True)
            out = self.bn2(self.conv2(out))
            idt = x
            if self.stride != 1 or self.pad:
                idt = F.pad(x[:, :, :: self.stride, :: self.stride], (0, 0, 0, 0, 0, self.pad))
            out += idt
            return F.relu(out, inplace=True)

    width = width or kw.get("width", 16)
    layers = [tnn.Conv2d(3, width, 3, 1, 1, bias=False), tnn.BatchNorm2d(width), tnn.ReLU(inplace=True)]
    cin = width
    for stage, c in enumerate((width, 2 * width, 4 * width)):
        for i in range(3):
            layers.append(Block(cin, c, 2 if stage and i == 0 else 1))
            cin = c
    layers += [tnn.AdaptiveAvgPool2d(1), tnn.Flatten(), tnn.Linear(cin, 10)]
    return tnn.Sequential(*layers)


class TorchRunner:
    """A PyTorch training step of :func:`torch_model` (SGD momentum 0.9, a fixed batch)."""

    def __init__(self, model_name: str, batch: int | None = None, seed: int = 0, device: str = "cpu"):
        import torch  # noqa: PLC0415

        torch.manual_seed(seed)
        self.torch = torch
        self.model_name = model_name
        self.batch = batch or MODELS[model_name][4]
        self.device = torch.device(device)
        self.model = torch_model(model_name).to(self.device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        shape = MODELS[model_name][3]
        self.x = torch.randn(self.batch, *shape, device=self.device)
        self.y = torch.randint(0, 10, (self.batch,), device=self.device)

    def step(self, read_loss: bool = True) -> float | None:
        self.opt.zero_grad()
        loss = self.torch.nn.functional.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        return loss.item() if read_loss else None


def timed(step) -> float:
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def run(models, rounds: int, warmup: int, with_torch: bool = True) -> dict:
    results = {"rows": [], "env": _env()}
    # 1) memory: one variant alive at a time, so peaks are not polluted by the others
    for m in models:
        for variant, policy, abn in variants_of(m):
            r = Runner(m, variant, policy, abn)
            row = {"model": m, "variant": variant, "batch": r.batch, **r.measure_memory()}
            results["rows"].append(row)
            del r
            gc.collect()
    # 2) speed: all variants alive, interleaved round by round
    runners = [Runner(m, v, p, a) for m in models for v, p, a in variants_of(m)]
    torch_runner = None
    if with_torch and "resnet20" in models:
        try:
            torch_runner = TorchRunner("resnet20")
            results["env"]["torch"] = torch_runner.torch.__version__
            results["env"]["torch_threads"] = torch_runner.torch.get_num_threads()
        except ImportError:
            results["env"]["torch"] = None
    everyone = runners + ([torch_runner] if torch_runner else [])
    for _ in range(warmup):
        for r in everyone:
            r.step()
    times = {id(r): [] for r in everyone}
    for i in range(rounds):
        order = everyone if i % 2 == 0 else everyone[::-1]  # alternate order: no position bias
        for r in order:
            times[id(r)].append(timed(r.step))
    for r, row in zip(runners, results["rows"]):
        assert (r.model_name, r.variant) == (row["model"], row["variant"])
        med = statistics.median(times[id(r)])
        row["step_ms"] = med * 1e3
        row["samples_per_s"] = r.batch / med
    if torch_runner is not None:
        med = statistics.median(times[id(torch_runner)])
        results["torch_resnet20"] = {"step_ms": med * 1e3, "samples_per_s": torch_runner.batch / med}
    results["targets"] = _targets(results)
    return results


def _row(results, model, variant):
    for row in results["rows"]:
        if row["model"] == model and row["variant"] == variant:
            return row
    return None


def _targets(results) -> list[dict]:
    off, on, auto, abn = (_row(results, "resnet20", v) for v in ("off", "on", "auto", "on+InPlaceABN"))
    out = []
    mlp_off, mlp_auto = _row(results, "mlp_plain", "off"), _row(results, "mlp_plain", "auto")
    if mlp_off is not None:
        # one activation per hidden layer: batch x width float32
        _, kw, _, _, batch = MODELS["mlp_plain"]
        one_per_layer = sum(batch * w * 4 for w in kw["hidden"]) / MB
        gain = mlp_off["peak_mb"] - mlp_auto["peak_mb"]
        out.append(
            {
                "target": f"MLP (no norm) peak, off - auto >= one activation per hidden layer ({one_per_layer:.2f} MB)",
                "value": gain,
                "met": gain >= one_per_layer,
            }
        )
    if off is None:
        return out
    ratio = abn["activation_mb"] / off["activation_mb"]
    out.append(
        {
            "target": "ResNet-20 activation memory, on+InPlaceABN / off <= 0.50",
            "value": ratio,
            "met": ratio <= TARGETS["act_ratio"],
        }
    )
    for row in (off, on, abn):
        out.append(
            {
                "target": f"ResNet-20 peak / floor <= 1.15 ({row['variant']})",
                "value": row["peak_over_floor"],
                "met": row["peak_over_floor"] <= TARGETS["peak_over_floor"],
            }
        )
    sp = on["samples_per_s"] / off["samples_per_s"]
    out.append({"target": "ResNet-20 samples/s, on / off >= 1", "value": sp, "met": sp >= 1.0})
    d = auto["peak_mb"] - on["peak_mb"]
    out.append({"target": "ResNet-20 peak MB, auto - on <= 0", "value": d, "met": d <= 0})
    sp = auto["samples_per_s"] / on["samples_per_s"]
    out.append({"target": "ResNet-20 samples/s, auto / on >= 0.97", "value": sp, "met": sp >= 0.97})
    t = results.get("torch_resnet20")
    if t:
        tr = on["samples_per_s"] / t["samples_per_s"]
        out.append(
            {
                "target": "ResNet-20 samples/s, ours (on) / PyTorch >= 0.5",
                "value": tr,
                "met": tr >= TARGETS["torch_ratio"],
            }
        )
    return out


def _env() -> dict:
    return {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "device": str(fw.device("cpu")),
    }


LEGEND = [
    ("peak MB", "the highest live array memory of a steady-state step; MB = 2^20 bytes"),
    ("floor MB", "parameters + gradients + optimizer state + saved MB: what the step cannot do without"),
    ("peak/floor", "peak over floor (1.00: nothing above what the step must hold)"),
    ("activation MB", "peak minus parameters, gradients and optimizer state; act. vs off: that over off's"),
    ("saved MB", "what autograd holds for backward at the forward/backward boundary (not a saving)"),
    (
        "auto ops",
        "ops of the last step whose input policy auto proved dead and overwrote (its writes over "
        "gradients and optimizer state not counted); auto MB: what they did not allocate, summed",
    ),
    ("samples/s", "median of the timed rounds"),
]


def markdown(results) -> str:
    lines = [
        "| model | batch | variant | peak MB | floor MB | peak/floor | activation MB | act. vs off | saved MB "
        "| auto ops | auto MB | samples/s |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["rows"]:
        off = _row(results, row["model"], "off")
        lines.append(
            f"| {row['model']} | {row['batch']} | {row['variant']} | {row['peak_mb']:.2f} | {row['floor_mb']:.2f} | "
            f"{row['peak_over_floor']:.2f} | {row['activation_mb']:.2f} | "
            f"{row['activation_mb'] / off['activation_mb']:.0%} | {row['saved_mb']:.2f} | "
            f"{row['auto_ops']} | {row['auto_mb']:.2f} | {row['samples_per_s']:.0f} |"
        )
    t = results.get("torch_resnet20")
    if t:
        lines.append(
            f"| resnet20 (PyTorch {results['env']['torch']}) | 128 | inplace ReLU/add | | | | | | | | | "
            f"{t['samples_per_s']:.0f} |"
        )
    if results.get("targets"):
        lines += ["", "| target | value | met |", "|---|---:|---|"]
        for t in results["targets"]:
            lines.append(f"| {t['target']} | {t['value']:.2f} | {'yes' if t['met'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and warmup steps (a smoke run)")
    ap.add_argument("--rounds", type=int, default=None, help="timed steps per variant (default 7, quick 2)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 7)
    warmup = 1 if args.quick else 2
    results = run(args.models, rounds, warmup, with_torch=not args.no_torch)
    results["command"] = " ".join(
        ["python", "benchmarks/bench_models.py"] + (argv if argv is not None else sys.argv[1:])
    )
    results["rounds"] = rounds
    print(markdown(results))
    print(common.legend(LEGEND))
    env = results["env"]
    print(
        f"\n{rounds} timed rounds, medians; python {env['python']}, numpy {env['numpy']}, "
        f"{env['cpus']} CPUs"
        + (f", torch {env['torch']} ({env.get('torch_threads')} threads)" if env.get("torch") else "")
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
