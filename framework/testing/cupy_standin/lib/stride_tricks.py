"""``cupy.lib.stride_tricks`` of the stand-in."""

from __future__ import annotations

from .._core import _host_view, _new


def as_strided(x, shape=None, strides=None):
    """A view of ``x``'s memory with the given shape and strides, as CuPy's: ``base`` is None.

    CuPy reads past the allocation without a word; the stand-in refuses a view that does
    not fit in ``x``'s memory block (ValueError), since on a GPU it reads garbage.
    """
    shape = x.shape if shape is None else tuple(shape)
    strides = x.strides if strides is None else tuple(strides)
    try:
        a = _host_view(x.data, shape, x.dtype, strides)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"as_strided: shape {shape} with strides {strides} reaches outside the array's memory block ({e})"
        ) from None
    return _new(a, x.data, None)
