"""``cupy.random`` of the stand-in: ``default_rng`` and the Generator methods CuPy has.

CuPy's ``Generator`` draws with cuRAND (XORWOW) on the device that was current when its
bit generator was made, and keeps the state there: the stand-in allocates a state of
the same size in the pool of that device (so it shows in the memory figures as on a
GPU), refuses to draw while another device is current, and draws the values with
NumPy's PCG64 from the same seed (reproducible, but not CuPy's numbers). As on a GPU,
that state array is the stream's whole state: each draw reads the PCG64 state from its
first 48 bytes and writes it back, so copying the array and writing it back later
replays the same numbers (what a checkpoint does to reproduce its dropout masks). CuPy's
Generator has no ``normal``, ``choice``, ``permutation`` or ``shuffle``, nor has this one.
"""

from __future__ import annotations

import numpy

from . import _core
from .cuda import graph as _graph
from .cuda import runtime

_XORWOW_STATE_BYTES = 48  # sizeof(curandStateXORWOW)


class BitGenerator:
    """The state of a stream of random numbers, on the device current when it was made."""

    def __init__(self, seed=None):
        if isinstance(seed, _core.ndarray):
            seed = seed.get()
        self._seed_seq = seed if isinstance(seed, numpy.random.SeedSequence) else numpy.random.SeedSequence(seed)
        self._current_device_id = runtime.getDevice()
        self._numpy = numpy.random.Generator(numpy.random.PCG64(self._seed_seq))


class XORWOW(BitGenerator):
    """CuPy's default bit generator: one cuRAND state per thread of a full launch."""

    def __init__(self, seed=None, *, size=-1):
        super().__init__(seed)
        if size < 0:
            sms = runtime.getDeviceProperties(self._current_device_id)["multiProcessorCount"]
            size = 8 * 256 * sms
        self._state = _core.ndarray((_XORWOW_STATE_BYTES * size,), numpy.int8)
        self._state._a.fill(0)
        self._store()
        _core._launch("random")  # CuPy initializes the states with one kernel

    def _load(self) -> numpy.random.Generator:
        """The NumPy generator, at the state the device array holds."""
        words = self._state._a[:_XORWOW_STATE_BYTES].view(numpy.uint64)
        state, inc = (int(words[0]) << 64) | int(words[1]), (int(words[2]) << 64) | int(words[3])
        self._numpy.bit_generator.state = {
            "bit_generator": "PCG64",
            "state": {"state": state, "inc": inc},
            "has_uint32": int(words[4]),
            "uinteger": int(words[5]),
        }
        return self._numpy

    def _store(self) -> None:
        """Writes the NumPy generator's state into the device array (after a draw)."""
        st = self._numpy.bit_generator.state
        mask = (1 << 64) - 1
        s, inc = st["state"]["state"], st["state"]["inc"]
        words = [s >> 64, s & mask, inc >> 64, inc & mask, st["has_uint32"], st["uinteger"]]
        self._state._a[:_XORWOW_STATE_BYTES] = numpy.array(words, dtype=numpy.uint64).view(numpy.int8)


class Generator:
    """Random numbers on the device, as ``cupy.random.Generator`` (the methods this project uses)."""

    def __init__(self, bit_generator: BitGenerator):
        self.bit_generator = bit_generator

    def _rng(self, draw):
        """``draw(numpy_generator)``, from and back into the state on the device."""
        bg = self.bit_generator
        device = runtime.getDevice()
        if device != bg._current_device_id:
            raise ValueError(
                f"The generator's state resides on device {bg._current_device_id}, "
                f"the current device is {device}. Peer access is unavailable between these devices."
            )
        values = draw(bg._load())
        bg._store()
        return values

    def random(self, size=None, dtype=numpy.float64, out=None):
        """Uniform floats in [0, 1)."""
        dtype = numpy.dtype(dtype)
        if dtype.char not in "fd":
            raise TypeError(f"Unsupported dtype {dtype.name} for random")
        return self._draw(lambda shape: self._rng(lambda g: g.random(shape, dtype=dtype)), size, dtype, out)

    def uniform(self, low=0.0, high=1.0, size=None, dtype=numpy.float64):
        dtype = numpy.dtype(dtype)
        return _drawn(numpy.asarray(self._rng(lambda g: g.uniform(low, high, size))).astype(dtype))

    def integers(self, low, high=None, size=None, dtype=numpy.int64, endpoint=False):
        return _drawn(numpy.asarray(self._rng(lambda g: g.integers(low, high, size, dtype=dtype, endpoint=endpoint))))

    def standard_normal(self, size=None, dtype=numpy.float64, out=None):
        dtype = numpy.dtype(dtype)
        if dtype.char not in "fd":
            raise TypeError(f"Unsupported dtype {dtype.name} for standard_normal")
        return self._draw(lambda shape: self._rng(lambda g: g.standard_normal(shape, dtype=dtype)), size, dtype, out)

    def standard_exponential(self, size=None, dtype=numpy.float64, method="inv", out=None):
        dtype = numpy.dtype(dtype)
        return self._draw(
            lambda shape: self._rng(lambda g: g.standard_exponential(shape, dtype=dtype)), size, dtype, out
        )

    def exponential(self, scale=1.0, size=None):
        return _drawn(numpy.asarray(self._rng(lambda g: g.exponential(scale, size))))

    def _draw(self, draw, size, dtype, out):
        if out is None and _graph.current_capture() is not None:
            # CuPy draws with its own kernels (not the host cuRAND API): capturable, into a
            # new array from the current allocator (the pool refuses it during capture)
            out = _core.ndarray(() if size is None else tuple(numpy.atleast_1d(size)), dtype)
        if out is not None:
            if not isinstance(out, _core.ndarray):
                raise TypeError("out must be a cupy.ndarray")
            if out.dtype != dtype:
                raise TypeError(
                    f"Supplied output array has the wrong type. Expected {dtype.name}, got {out.dtype.name}"
                )
            if size is not None and tuple(numpy.atleast_1d(size)) != out.shape:
                raise ValueError("size must match out.shape when used together")
            _core._check_current(out)
            host, shape = out._a, out.shape

            def kernel():  # the generator's state advances at every run, captured or not
                host[...] = draw(shape)

            _graph.run("random", kernel, out.size, (out,))
            return out
        shape = () if size is None else size
        return _drawn(numpy.asarray(draw(shape)))


def _drawn(host: numpy.ndarray):
    """Values drawn on the device: one cuRAND kernel (CuPy's ``_launch_dist``)."""
    res = _core._from_host(host)
    _core._launch("random", res.size)
    return res


def default_rng(seed=None) -> Generator:
    """A Generator on the current device (XORWOW state), or ``seed`` itself if it is one."""
    if isinstance(seed, Generator):
        return seed
    if isinstance(seed, BitGenerator):
        return Generator(seed)
    return Generator(XORWOW(seed))
