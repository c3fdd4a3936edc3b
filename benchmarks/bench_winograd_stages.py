"""Where a Winograd conv2d forward spends its time: each step of F(2x2, 3x3) and F(4x4, 3x3)
on ResNet-20's layers, beside PyTorch's whole forward on the same shape.

A forward (``framework/ops/conv_algorithms/winograd.py``) runs six steps per chunk of
images: copy the chunk into the zero-padded channels-last buffer (``pad``), gather the
overlapping tiles (``gather``), the input transform (``B^T d B``), the batched products
``M = V @ U`` (``products``), the output transform (``A^T M A``) and the copy back to NCHW
(``scatter``). The products are the arithmetic; every other step is a pass over memory.
Putting the products' time beside PyTorch's whole forward shows what is left for the
other steps before a layer is slower than PyTorch, under the BLAS kernels this process
loaded (the first line names them; see ``benchmarks/bench_blas.py``).

The steps are timed one by one inside each forward, ``--repeats`` forwards per layer and
algorithm, alternating; the table shows the median of each step's per-forward total.
The steps timed are the forward's own calls, in its order: the benchmark checks that
their result is bit for bit what ``conv2d``'s Winograd forward returns.
"""

from __future__ import annotations

import statistics
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
from framework.ops.conv_algorithms import ConvGeometry, winograd
from framework.ops.conv_algorithms.workspace import chunks, get_workspace_limit, resolve_limit

try:
    import torch
    import torch.nn.functional as torch_F
except ImportError:  # PyTorch is optional: its column is then empty
    torch = None

# (name, channels, height and width): ResNet-20's 3x3 stride-1 layers at batch 64;
# ``auto`` takes F(2x2) from 32 channels, the 16-channel row shows why not below
LAYERS = [("16->16 32x32", 16, 32), ("32->32 16x16", 32, 16), ("64->64 8x8", 64, 8)]
QUICK_LAYERS = [("8->8 6x6", 8, 6)]
STEPS = ("pad", "gather", "input transform", "products", "output transform", "scatter")


class _Forward:
    """One layer's Winograd forward, split into its steps (the calls of
    ``winograd._forward_into`` and ``winograd._input_transform``, in their order)."""

    def __init__(self, x, w, m):
        n, c, h, wd = x.shape
        self.x, self.m = x, m
        self.geom = ConvGeometry(x.shape, w.shape, (1, 1), (1, 1), (h, wd))
        self.limit = resolve_limit(get_workspace_limit(), fw.from_numpy(x))  # conv2d's, for this input
        self.u = winograd._weight_transform(w, m, np)
        self.tiles = winograd._Tiles(self.geom, m)
        per_image = winograd._Workspace.per_image_bytes(self.tiles, c, w.shape[0], x.itemsize)
        self.parts = chunks(n, per_image, self.limit)
        self.ws = winograd._Workspace(
            self.tiles, self.parts[0].stop, c, w.shape[0], x.dtype, np, winograd._transforms(m, x)
        )
        self.out = np.empty((n, w.shape[0], h, wd), x.dtype)

    def run(self) -> dict[str, float]:
        """One forward into ``self.out``; seconds per step."""
        x, ws, tiles, clock = self.x, self.ws, self.tiles, time.perf_counter
        h, wd = x.shape[2:]
        spent = dict.fromkeys(STEPS, 0.0)
        for sl in self.parts:
            v = ws.views(sl.stop - sl.start)
            t0 = clock()
            ws.xh[: sl.stop - sl.start, 1 : 1 + h, 1 : 1 + wd, :] = x[sl].transpose(0, 2, 3, 1)
            t1 = clock()
            np.copyto(v.d, v.windows)
            t2 = clock()
            winograd._run(v.b_calls)
            t3 = clock()
            np.matmul(v.v, self.u, out=v.m)
            t4 = clock()
            winograd._run(v.a_calls)
            t5 = clock()
            tiles.scatter(v.y, v.out_stage, self.out[sl], np)
            t6 = clock()
            for step, (a, b) in zip(STEPS, ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5), (t5, t6))):
                spent[step] += b - a
        return spent

    def product_flops(self) -> int:
        a2, c, co = self.u.shape
        return 2 * a2 * self.x.shape[0] * self.tiles.per_image * c * co


def _torch_forward(x, w):
    if torch is None:
        return None
    xt, wt = torch.from_numpy(x), torch.from_numpy(w)
    return lambda: torch_F.conv2d(xt, wt, padding=1)


def main(argv=None) -> dict:
    p = common.parser(__doc__.splitlines()[0], default_repeats=15)
    p.add_argument("--batch", type=int, default=None, help="batch size (default 64; 2 with --quick)")
    args = p.parse_args(argv)
    repeats = common.repeats_of(args, 15)
    batch = args.batch or (2 if args.quick else 64)
    if torch is not None:
        torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    info = common.machine_info()
    print(common.machine_line(info) + f", batch {batch}, {repeats} forwards per layer and algorithm, alternating")

    rows, results = [], []
    for name, c, hw in QUICK_LAYERS if args.quick else LAYERS:
        x = rng.standard_normal((batch, c, hw, hw), dtype=np.float32)
        w = rng.standard_normal((c, c, 3, 3), dtype=np.float32)
        forwards = {f"winograd{m}": _Forward(x, w, m) for m in (2, 4)}
        for label, fwd in forwards.items():
            expected = winograd.Winograd(fwd.m).forward(x, w, fwd.geom, fwd.limit, np)
            fwd.run()
            if not np.array_equal(fwd.out, expected):
                raise AssertionError(f"{name} {label}: the timed steps do not compute conv2d's Winograd forward")
        steps = {label: [] for label in forwards}
        torch_fn = _torch_forward(x, w)
        torch_times = []
        for r in range(repeats):
            for label in list(forwards)[r % 2 :] + list(forwards)[: r % 2]:
                steps[label].append(forwards[label].run())
            if torch_fn is not None:
                t0 = time.perf_counter()
                torch_fn()
                torch_times.append(time.perf_counter() - t0)
        torch_ms = statistics.median(torch_times) * 1e3 if torch_times else None
        for label, fwd in forwards.items():
            ms = {s: statistics.median(run[s] for run in steps[label]) * 1e3 for s in STEPS}
            total = sum(ms.values())
            gflops = fwd.product_flops() / (ms["products"] * 1e-3) / 1e9
            rows.append(
                [name, label, *(f"{ms[s]:.2f}" for s in STEPS), f"{total:.2f}", f"{gflops:.0f}"]
                + [f"{torch_ms:.2f}" if torch_ms is not None else "-"]
            )
            results.append(
                {"layer": name, "algorithm": label, "ms": ms, "total_ms": total, "products_gflops": gflops}
                | {"torch_ms": torch_ms, "chunks": len(fwd.parts)}
            )
    headers = ["layer", "algorithm", *(f"{s} ms" for s in STEPS), "total ms", "products GFLOP/s", "PyTorch ms"]
    legend = [
        ("pad ms", "each stage's median ms over the rounds; total ms: their sum"),
        ("products GFLOP/s", "the batched products' floating-point operations per second"),
        ("PyTorch ms", "the median of torch's conv2d forward on the same input (- without torch)"),
    ]
    print(common.markdown_table(headers, rows, legend))
    payload = {"machine": info, "command": common.command_line(), "repeats": repeats, "batch": batch}
    payload["results"] = results
    if args.json:
        common.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
