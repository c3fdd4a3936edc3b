"""The framework's random generators: one seeded stream per array module (per GPU for CuPy).

NumPy's stream is ``numpy.random.default_rng(seed)``; on a GPU, ``cupy.random.default_rng(seed)``
draws on the device itself (cuRAND), so dropout masks and initial weights of a CUDA tensor
never pass through host memory. The two streams differ: the same seed gives reproducible
values on each device, not the same values on both.
"""

from __future__ import annotations

import numpy as np

from . import backend, memory

_generators: dict = {}
_seed = None


def manual_seed(seed: int) -> None:
    """Seeds every generator (NumPy's now, CuPy's when first used)."""
    global _seed
    _seed = int(seed)
    _generators.clear()


# Called with ``(key, generator)`` each time :func:`generator` hands one out, while
# a checkpoint records or replays the draws of its region (framework.utils.checkpoint):
# every draw of the framework goes through :func:`generator`.
watchers: list = []


def generator(xp=np):
    """The seeded generator of an array module (``numpy.random.Generator`` or CuPy's, for
    the current GPU)."""
    key = "numpy" if xp is np else backend.rng_key(xp)
    gen = _generators.get(key)
    if gen is None:
        gen = xp.random.default_rng(_seed)
        _generators[key] = gen
    if watchers:
        for watch in watchers:
            watch(key, gen)
    return gen


def generator_state(gen):
    """A copy of ``gen``'s state, which :func:`set_generator_state` puts back to draw the
    same numbers again: NumPy's bit generator state, or for CuPy a device copy of its
    cuRAND states (the array behind ``bit_generator.state()``; no host transfer)."""
    if isinstance(gen, np.random.Generator):
        return gen.bit_generator.state
    states = gen.bit_generator._state
    with backend.device_context(backend.device_of(states)):
        return memory.track(states.copy(), "other")


def set_generator_state(gen, state) -> None:
    """Puts back a state :func:`generator_state` copied (into the same array on a GPU)."""
    if isinstance(gen, np.random.Generator):
        gen.bit_generator.state = state
        return
    states = gen.bit_generator._state
    with backend.device_context(backend.device_of(states)):
        states[...] = state


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
