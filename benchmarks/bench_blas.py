"""NumPy's float32 matrix products in the shapes conv2d gives them on ResNet-20, in both
orientations, under whatever BLAS kernels this process loaded.

The conv2d algorithms (``framework/ops/conv_algorithms``) spend most of their time in
``numpy.matmul``, and which kernels OpenBLAS runs decides how fast that is: it picks them
from the CPU when it loads, unless the environment variable ``OPENBLAS_CORETYPE`` names
them. The kernels cannot change inside a process, so compare two runs::

    OPENBLAS_CORETYPE=Haswell python -m benchmarks.bench_blas
    OPENBLAS_CORETYPE=SkylakeX python -m benchmarks.bench_blas   # needs AVX-512

(the first line of the output says which kernels ran and who chose them). The weight
gradient is timed in both orientations, interleaved, because the same arithmetic runs at
different speeds: ``(Co, K) = g @ cols.T``, with a long inner dimension and few rows, is
what made ``grid`` and ``gemm`` compute ``cols @ g.T`` instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common
else:
    from . import common

# (what, batch, M, K, N, b_transposed): C (batch, M, N) = A (batch, M, K) @ B (batch, K, N)
# as conv2d makes them at batch 64 under the default workspace limit (one chunk's
# product); b_transposed: B is the transposed view of a C-contiguous (N, K) array, as
# ``cols.T`` and ``g.T`` are in the weight gradients
SHAPES = [
    ("grid forward, 16 ch 32x32: w @ cols", 1, 16, 144, 2172, False),
    ("grid weight grad, 16 ch 32x32: g @ cols.T", 1, 16, 2172, 144, True),
    ("grid weight grad, 16 ch 32x32: cols @ g.T", 1, 144, 2172, 16, True),
    ("Winograd F(2x2), 32 ch 16x16: V @ U", 16, 192, 32, 32, False),
    ("Winograd F(2x2), 64 ch 8x8: V @ U", 16, 48, 64, 64, False),
    ("im2col gemm, 32->64 16x16 s2: w @ cols", 1, 64, 288, 384, False),
]
QUICK_SHAPES = [("small", 1, 8, 16, 32, False), ("small, b transposed", 1, 32, 16, 8, True)]
CALLS_PER_ROUND = 20  # a product is timed as a block of calls, warm, as conv2d calls it chunk after chunk


def _product(batch, m, k, n, b_transposed, rng):
    a = rng.standard_normal((batch, m, k), dtype=np.float32)
    if b_transposed:
        b = rng.standard_normal((batch, n, k), dtype=np.float32).transpose(0, 2, 1)
    else:
        b = rng.standard_normal((batch, k, n), dtype=np.float32)
    c = np.empty((batch, m, n), np.float32)

    def run():
        for _ in range(CALLS_PER_ROUND):
            np.matmul(a, b, out=c)

    return run


def main(argv=None) -> dict:
    p = common.parser(__doc__.splitlines()[0], default_repeats=15)
    args = p.parse_args(argv)
    repeats = common.repeats_of(args, 15)
    rng = np.random.default_rng(0)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    variants = {what: _product(*dims, rng) for what, *dims in shapes}
    times = common.interleaved(variants, repeats)
    info = common.machine_info()
    print(common.machine_line(info) + f", {repeats} rounds of {CALLS_PER_ROUND} calls per product")
    rows, results = [], []
    for what, batch, m, k, n, b_transposed in shapes:
        best = min(times[what]) / CALLS_PER_ROUND
        gflops = 2 * batch * m * k * n / best / 1e9
        shape = f"({m} x {k}) @ ({k} x {n}{', transposed' if b_transposed else ''})"
        rows.append([what, (f"{batch} x " if batch > 1 else "") + shape, f"{best * 1e3:.3f}", f"{gflops:.0f}"])
        results.append({"what": what, "shape": [batch, m, k, n], "min_seconds": best, "gflops": gflops})
    legend = [
        ("ms per call (min)", "the fastest round's time divided by its calls (the minimum estimates the cost)"),
        ("GFLOP/s", "2 x batch x m x k x n floating-point operations per second at that minimum"),
    ]
    print(common.markdown_table(["product", "shape", "ms per call (min)", "GFLOP/s"], rows, legend))
    payload = {"machine": info, "command": common.command_line(), "repeats": repeats, "results": results}
    if args.json:
        common.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
