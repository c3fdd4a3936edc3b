"""The framework's random generators: one seeded stream per array module (per GPU for CuPy).

NumPy's stream is ``numpy.random.default_rng(seed)``; on a GPU, ``cupy.random.default_rng(seed)``
draws on the device itself (cuRAND), so dropout masks and initial weights of a CUDA tensor
never pass through host memory. The two streams differ: the same seed gives reproducible
values on each device, not the same values on both.
"""

from __future__ import annotations

import numpy as np

from . import backend

_generators: dict = {}
_seed = None


def manual_seed(seed: int) -> None:
    """Seeds every generator (NumPy's now, CuPy's when first used)."""
    global _seed
    _seed = int(seed)
    _generators.clear()


def generator(xp=np):
    """The seeded generator of an array module (``numpy.random.Generator`` or CuPy's, for
    the current GPU)."""
    key = "numpy" if xp is np else backend.rng_key(xp)
    gen = _generators.get(key)
    if gen is None:
        gen = xp.random.default_rng(_seed)
        _generators[key] = gen
    return gen


def get_state() -> dict:
    """Generator states, for checkpoints (NumPy only; CuPy streams are re-seeded)."""
    return {"seed": _seed, "numpy": generator(np).bit_generator.state}


def set_state(state: dict) -> None:
    global _seed
    _seed = state["seed"]
    generator(np).bit_generator.state = state["numpy"]


def normal(shape, dtype, mean=0.0, std=1.0, xp=np):
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        raise RuntimeError(f"normal_ expects a floating point tensor, got {dtype}")
    out = generator(xp).standard_normal(shape, dtype=dtype if dtype in (np.float32, np.float64) else np.float64)
    if std != 1.0:
        out *= std
    if mean != 0.0:
        out += mean
    return out.astype(dtype, copy=False)


def uniform(shape, dtype, low=0.0, high=1.0, xp=np):
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        raise RuntimeError(f"uniform_ expects a floating point tensor, got {dtype}")
    out = generator(xp).random(shape, dtype=dtype if dtype in (np.float32, np.float64) else np.float64)
    if high - low != 1.0:
        out *= high - low
    if low != 0.0:
        out += low
    return out.astype(dtype, copy=False)
