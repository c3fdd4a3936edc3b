"""The optimizers' scaled add ``y += alpha * x``: BLAS ``axpy`` against ``backend.add_scaled_``.

``add_scaled_`` rounds ``alpha * x`` and then the sum (two roundings per element, in
cache-sized blocks through one scratch buffer), because BLAS ``axpy`` fuses the
multiply-add in its vector loop and not in its tail: the same element gets other bits
inside a flat buffer than in its parameter alone (``test_add_scaled_gives_an_element_the_
same_bits_wherever_it_lies``). This measures what that costs, interleaved round by round,
at the sizes of the MLP 3072-1024-1024-10's and ResNet-20's parameters (float32), and
counts the elements whose bits change when the parameter sits inside a flat buffer.

Run:  python -m benchmarks.bench_add_scaled [--repeats 50] [--quick] [--json PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from scipy.linalg import blas

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common
else:
    from . import common

from framework.backend import add_scaled_

SIZES = [("MLP 3072-1024-1024-10", 3072 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10), ("ResNet-20", 272_474)]
QUICK_SIZES = [("small", 70_001)]
ALPHA = -0.1


def _variants(n, rng):
    x = rng.standard_normal(n, dtype=np.float32)
    y = rng.standard_normal(n, dtype=np.float32)
    return {
        "axpy": lambda: blas.saxpy(x, y, a=ALPHA),
        "add_scaled_": lambda: add_scaled_(y, x, ALPHA),
    }


def _moved_bits(n, rng, follow=1024) -> tuple[int, int]:
    """Elements of a parameter of ``n`` elements whose bits differ between its update alone
    and its update inside a flat buffer where ``follow`` more elements come after it
    (``axpy``, ``add_scaled_``)."""
    x = rng.standard_normal(n + follow, dtype=np.float32)
    y = rng.standard_normal(n + follow, dtype=np.float32)
    moved = []
    for update in (lambda a, b: blas.saxpy(b, a, a=ALPHA), lambda a, b: add_scaled_(a, b, ALPHA) or a):
        flat = update(y.copy(), x)
        alone = update(y[:n].copy(), x[:n].copy())
        moved.append(int((flat[:n] != alone).sum()))
    return moved[0], moved[1]


def main(argv=None) -> dict:
    p = common.parser(__doc__.splitlines()[0], default_repeats=50)
    args = p.parse_args(argv)
    repeats = common.repeats_of(args, 50)
    rng = np.random.default_rng(0)
    sizes = QUICK_SIZES if args.quick else SIZES
    info = common.machine_info()
    print(common.machine_line(info) + f", {repeats} interleaved rounds, float32")
    rows, results = [], []
    for what, n in sizes:
        times = common.interleaved(_variants(n, rng), repeats)
        axpy, ours = min(times["axpy"]), min(times["add_scaled_"])
        moved, ours_moved = _moved_bits(n, rng)
        rows.append([what, f"{n:,}", f"{axpy * 1e3:.3f}", f"{ours * 1e3:.3f}", f"{ours / axpy:.2f}", moved, ours_moved])
        results.append(
            {
                "what": what,
                "elements": n,
                "axpy_s": axpy,
                "add_scaled_s": ours,
                "axpy_bits_moved": moved,
                "add_scaled_bits_moved": ours_moved,
            }
        )
    legend = [
        ("ms (min)", "the fastest round of one call on the whole array"),
        ("ratio", "add_scaled_ / axpy"),
        ("bits moved", "elements of the parameter updated alone whose bits differ inside a flat buffer"),
    ]
    headers = [
        "parameters",
        "elements",
        "axpy ms (min)",
        "add_scaled_ ms (min)",
        "ratio",
        "bits moved: axpy",
        "add_scaled_",
    ]
    print(common.markdown_table(headers, rows, legend))
    payload = {"machine": info, "command": common.command_line(), "params": {"repeats": repeats}, "results": results}
    if args.json:
        common.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
