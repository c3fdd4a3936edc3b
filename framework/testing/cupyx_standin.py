"""``cupyx`` of the stand-in: the scatter routine this project uses."""

from __future__ import annotations

import numpy

from ._core import _scatter


def scatter_add(a, slices, value) -> None:
    """``a[slices] += value`` where repeated indices add up (as ``numpy.add.at``), in place.

    Integer index arrays wrap around, as every CuPy index does.
    """
    _scatter(a, slices, value, numpy.add)
