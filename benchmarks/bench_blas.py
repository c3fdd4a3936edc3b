"""NumPy's float32 matrix products in the shapes conv2d gives them on ResNet-20, in both
orientations, under whatever BLAS kernels this process loaded.

The conv2d algorithms (``framework/ops/conv_algorithms``) spend most of their time in
``numpy.matmul``, and which kernels OpenBLAS runs decides how fast that is: it picks them
from the CPU when it loads, unless the environment variable ``OPENBLAS_CORETYPE`` names
them. The kernels cannot change inside a process, so compare two runs::

    OPENBLAS_CORETYPE=Haswell python -m benchmarks.bench_blas
    OPENBLAS_CORETYPE=SkylakeX python -m benchmarks.bench_blas   # needs AVX-512

(the first line of the output says which kernels ran and who chose them). Each product
is timed in the orientation conv2d uses and in its transpose, interleaved, because the
same arithmetic runs at different speeds: a weight gradient ``(Co, K) = g @ cols.T`` with
a long inner dimension and few rows is what made ``grid`` and ``gemm`` compute
``cols @ g.T`` instead.
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

# (what, batch, M, K, N): C (batch, M, N) = A (batch, M, K) @ B (batch, K, N), as conv2d
# makes them at batch 64 under the default workspace limit (per chunk)
SHAPES = [
    ("grid forward, 16 ch 32x32", 1, 16, 144, 2172),
    ("grid weight grad, 16 ch 32x32: g @ cols.T", 1, 16, 2172, 144),
    ("grid weight grad, 16 ch 32x32: cols @ g.T", 1, 144, 2172, 16),
    ("Winograd F(2x2) GEMMs, 32 ch 16x16", 16, 192, 32, 32),
    ("Winograd F(2x2) GEMMs, 64 ch 8x8", 16, 48, 64, 64),
    ("im2col, 64 ch 8x8, one large GEMM", 1, 64, 576, 4096),
]
QUICK_SHAPES = [("small", 1, 8, 16, 32), ("small, transposed", 1, 32, 16, 8)]


def _operands(batch, m, k, n, rng):
    a = rng.standard_normal((batch, m, k), dtype=np.float32)
    b = rng.standard_normal((batch, k, n), dtype=np.float32)
    return a, b, np.empty((batch, m, n), np.float32)


def main(argv=None) -> dict:
    p = common.parser(__doc__.splitlines()[0], default_repeats=50)
    args = p.parse_args(argv)
    repeats = common.repeats_of(args, 50)
    rng = np.random.default_rng(0)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    variants, flops = {}, {}
    for what, batch, m, k, n in shapes:
        a, b, c = _operands(batch, m, k, n, rng)
        variants[what] = lambda a=a, b=b, c=c: np.matmul(a, b, out=c)
        flops[what] = 2 * batch * m * k * n
    times = common.interleaved(variants, repeats)
    info = common.machine_info()
    print(common.machine_line(info))
    rows, results = [], []
    for what, batch, m, k, n in shapes:
        best = min(times[what])
        gflops = flops[what] / best / 1e9
        shape = f"{batch} x ({m} x {k}) @ ({k} x {n})" if batch > 1 else f"({m} x {k}) @ ({k} x {n})"
        rows.append([what, shape, f"{best * 1e3:.3f}", f"{gflops:.0f}"])
        results.append({"what": what, "shape": [batch, m, k, n], "min_seconds": best, "gflops": gflops})
    print(common.markdown_table(["product", "shape", "ms (min)", "GFLOP/s"], rows))
    payload = {"machine": info, "command": common.command_line(), "repeats": repeats, "results": results}
    if args.json:
        common.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
