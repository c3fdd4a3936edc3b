"""LayerNorm's gradients in float16 and bfloat16 on the CPU against PyTorch 2.13's (CPU).

Not a timing: counts the elements of x's gradient that differ from PyTorch's, by how many
units in the last place (of PyTorch's value, in the half type), and which of the two is
closer to the float64 gradient there; and the largest error of each gradient (x, weight,
bias) against float64, in units of the largest value's last place, for both. Random
inputs ``x ~ N(0, 1)`` (and ``3 N(0, 1) + 1``), weight and bias ``N(0, 1)``, five seeds a
shape. docs/TRANSFORMERS.md ("Limits") quotes it::

    OMP_NUM_THREADS=1 python benchmarks/accuracy_layer_norm_half.py
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

import framework as fw
import framework.nn.functional as F

SHAPES = [(64, 64), (16, 256), (16, 768), (8, 2048), (64, 768)]
SEEDS = 5


def _ulp(values, dtype) -> np.ndarray:
    """One unit in the last place of each value in ``dtype`` (subnormals' spacing below)."""
    info = ml_dtypes.finfo(dtype)
    mant = int(round(-math.log2(float(info.eps))))
    emin = int(round(math.log2(float(info.smallest_normal))))
    e = np.floor(np.log2(np.maximum(np.abs(values), float(info.smallest_normal))))
    return np.exp2(np.maximum(e, emin) - mant)


def _grads_ours(arrays, g, dtype):
    ts = [fw.tensor(a.astype(dtype), requires_grad=True) for a in arrays]
    F.layer_norm(ts[0], ts[0].shape[-1:], ts[1], ts[2]).backward(fw.tensor(g.astype(dtype)))
    return [t.grad.numpy().astype(np.float64) for t in ts]


def _grads_torch(torch, arrays, g, dtype):
    tdt = torch.float16 if dtype == np.float16 else torch.bfloat16
    ts = [torch.tensor(a.astype(np.float32)).to(tdt).requires_grad_() for a in arrays]
    y = torch.nn.functional.layer_norm(ts[0], ts[0].shape[-1:], ts[1], ts[2])
    y.backward(torch.tensor(g.astype(np.float32)).to(tdt))
    return [t.grad.float().double().numpy() for t in ts]


def main() -> None:
    import torch

    torch.set_num_threads(1)
    print(f"torch {torch.__version__}")
    for dtype in (np.float16, ml_dtypes.bfloat16):
        name = np.dtype(dtype).name
        for spread in ("N(0,1)", "3N(0,1)+1"):
            for rows, n in SHAPES:
                differ = closer = ulps = 0
                worst = {"ours": [0.0] * 3, "torch": [0.0] * 3}
                for seed in range(SEEDS):
                    rng = np.random.default_rng(seed)
                    x = rng.standard_normal((rows, n))
                    if spread != "N(0,1)":
                        x = 3 * x + 1
                    arrays = [x, rng.standard_normal(n), rng.standard_normal(n)]
                    # the reference from the inputs as the half type holds them
                    arrays = [a.astype(dtype).astype(np.float64) for a in arrays]
                    g = rng.standard_normal((rows, n)).astype(dtype).astype(np.float64)
                    ours, theirs = _grads_ours(arrays, g, dtype), _grads_torch(torch, arrays, g, dtype)
                    ref = _grads_ours(arrays, g, np.float64)
                    d = ours[0] != theirs[0]
                    differ += int(d.sum())
                    closer += int((np.abs(ours[0] - ref[0]) < np.abs(theirs[0] - ref[0]))[d].sum())
                    if d.any():
                        ulps = max(ulps, float(np.max(np.abs(ours[0] - theirs[0])[d] / _ulp(theirs[0][d], dtype))))
                    for who, got in (("ours", ours), ("torch", theirs)):
                        for i in range(3):
                            scale = float(_ulp(np.max(np.abs(ref[i])), dtype))
                            worst[who][i] = max(worst[who][i], float(np.max(np.abs(got[i] - ref[i]))) / scale)
                total = SEEDS * rows * n
                print(
                    f"{name:8s} x~{spread:9s} {rows:3d}x{n:<5d} x's gradient: {differ:4d} of {total} elements differ "
                    f"from torch's (at most {ulps:.0f} ulp; ours closer to float64 at {closer}); error vs float64 "
                    f"in ulps of the largest value (x, w, b): ours "
                    + "/".join(f"{v:.2f}" for v in worst["ours"])
                    + ", torch "
                    + "/".join(f"{v:.2f}" for v in worst["torch"])
                )


if __name__ == "__main__":
    main()
