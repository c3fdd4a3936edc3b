"""GradScaler's GPU kernels: the found-inf check with the unscale, and the scale's update,
each on the device, so that a step reads nothing back to the host.

PyTorch's ``_amp_foreach_non_finite_check_and_unscale_`` and ``_amp_update_scale_``, as
fused kernels (:mod:`framework.ops.kernels`: the CUDA source, and the NumPy reference the
CuPy stand-in runs). The scale and the flag are one-element device arrays (CuPy compiles no
0-d raw array for 64-bit indexing); the unscale multiplies
in the gradient's ``opmath`` type (float32 for bfloat16 and float32, float64 for
float64), as PyTorch's kernel does.
"""

from __future__ import annotations

import numpy as np

from ..ops.kernels import _OPMATH, Takes, each, elementwise

__all__ = ["unscale", "update_scale"]

#: The gradients' dtypes the unscale takes (float16 gradients are refused before, as PyTorch refuses them).
UNSCALE_DTYPES = ("bfloat16", "float32", "float64")


def _unscale(g, inv_scale, g_out, found_inf):
    v = g.astype(np.float64 if g.dtype == np.float64 else np.float32)
    if not np.isfinite(v).all():
        found_inf[...] = 1.0
    g_out[...] = v * v.dtype.type(inv_scale[0])


# One thread per element, called with g as its own output: a non-finite value sets the flag
# (every writer writes 1), each value is multiplied by 1/scale (the flag does not stop it:
# PyTorch unscales regardless).
unscale = elementwise(
    "T g, raw float32 inv_scale",
    "T g_out, raw float32 found_inf",
    "typedef opmath<T>::type A; A v = (A)g; if (!isfinite(v)) found_inf[0] = 1.0f; g_out = (T)(v * (A)inv_scale[0]);",
    "fused_amp_unscale",
    _unscale,
    Takes(each(T=UNSCALE_DTYPES), layouts=("contiguous", "strided"), raw={"inv_scale": 1, "found_inf": 1}),
    preamble=_OPMATH,
)


def _update_scale(found_inf, growth_factor, backoff_factor, growth_interval, scale, tracker):
    if found_inf[0]:
        scale[...] = np.float32(np.float64(scale[0]) * backoff_factor)
        tracker[...] = 0
        return
    successful = int(tracker[0]) + 1
    if successful == growth_interval:
        grown = np.float32(np.float64(scale[0]) * growth_factor)
        if np.isfinite(grown):
            scale[...] = grown
        tracker[...] = 0
    else:
        tracker[...] = successful


# One thread (size=1): PyTorch's _amp_update_scale_ (the products in double, rounded to float).
update_scale = elementwise(
    "raw float32 found_inf, float64 growth_factor, float64 backoff_factor, int32 growth_interval",
    "raw float32 scale, raw int32 tracker",
    "if (found_inf[0] != 0.0f) { scale[0] = (float)((double)scale[0] * backoff_factor); tracker[0] = 0; }"
    " else { int successful = tracker[0] + 1;"
    " if (successful == growth_interval) {"
    " float grown = (float)((double)scale[0] * growth_factor);"
    " if (isfinite(grown)) scale[0] = grown; tracker[0] = 0; }"
    " else tracker[0] = successful; }",
    "fused_amp_update_scale",
    _update_scale,
    Takes(
        ({},),
        scalars=("growth_factor", "backoff_factor", "growth_interval"),
        raw={"found_inf": 1, "scale": 1, "tracker": 1},
    ),
)
