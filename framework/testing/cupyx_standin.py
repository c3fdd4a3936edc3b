"""``cupyx`` of the CuPy stand-in (:mod:`framework.testing.cupy_standin`): the scatter
routine this project uses. A module of its own, as CuPy's ``cupyx`` is a package beside
``cupy`` and no attribute of it."""

from __future__ import annotations

import numpy

from .cupy_standin._core import _scatter


def scatter_add(a, slices, value) -> None:
    """``a[slices] += value`` where repeated indices add up (as ``numpy.add.at``), in place.

    Integer index arrays wrap around, as every CuPy index does.
    """
    _scatter(a, slices, value, numpy.add)
