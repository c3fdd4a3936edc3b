"""The stand-in's ufuncs: CuPy's elementwise routines, by their CuPy names."""

from __future__ import annotations

import numpy

from ._core import ufunc

# CuPy name -> NumPy ufunc computing it (both libraries name most of them alike).
_NUMPY_NAMES = {
    "add": "add",
    "subtract": "subtract",
    "multiply": "multiply",
    "divide": "divide",
    "true_divide": "true_divide",
    "floor_divide": "floor_divide",
    "remainder": "remainder",
    "fmod": "fmod",
    "power": "power",
    "float_power": "float_power",
    "negative": "negative",
    "positive": "positive",
    "absolute": "absolute",
    "sign": "sign",
    "sqrt": "sqrt",
    "square": "square",
    "cbrt": "cbrt",
    "reciprocal": "reciprocal",
    "exp": "exp",
    "exp2": "exp2",
    "expm1": "expm1",
    "log": "log",
    "log2": "log2",
    "log10": "log10",
    "log1p": "log1p",
    "sin": "sin",
    "cos": "cos",
    "tan": "tan",
    "arcsin": "arcsin",
    "arccos": "arccos",
    "arctan": "arctan",
    "arctan2": "arctan2",
    "sinh": "sinh",
    "cosh": "cosh",
    "tanh": "tanh",
    "arcsinh": "arcsinh",
    "arccosh": "arccosh",
    "arctanh": "arctanh",
    "maximum": "maximum",
    "minimum": "minimum",
    "fmax": "fmax",
    "fmin": "fmin",
    "greater": "greater",
    "greater_equal": "greater_equal",
    "less": "less",
    "less_equal": "less_equal",
    "equal": "equal",
    "not_equal": "not_equal",
    "logical_and": "logical_and",
    "logical_or": "logical_or",
    "logical_xor": "logical_xor",
    "logical_not": "logical_not",
    "isnan": "isnan",
    "isinf": "isinf",
    "isfinite": "isfinite",
    "signbit": "signbit",
    "copysign": "copysign",
    "floor": "floor",
    "ceil": "ceil",
    "trunc": "trunc",
    "rint": "rint",
    "hypot": "hypot",
    "matmul": "matmul",
    "bitwise_and": "bitwise_and",
    "bitwise_or": "bitwise_or",
    "bitwise_xor": "bitwise_xor",
    "invert": "invert",
    "left_shift": "left_shift",
    "right_shift": "right_shift",
    "conjugate": "conjugate",
    "deg2rad": "deg2rad",
    "rad2deg": "rad2deg",
    "heaviside": "heaviside",
}
# ``ufunc.at`` exists for these in CuPy (their scatter kernels); the others raise NotImplementedError.
_SCATTER = {"add", "subtract", "bitwise_and", "bitwise_or", "bitwise_xor"}

UFUNCS = {
    name: ufunc(name, getattr(numpy, np_name), scatter=name in _SCATTER) for name, np_name in _NUMPY_NAMES.items()
}
# CuPy's other names for some of them (NumPy's ufuncs report these as __name__ too).
UFUNCS.update(abs=UFUNCS["absolute"], mod=UFUNCS["remainder"], conj=UFUNCS["conjugate"], bitwise_not=UFUNCS["invert"])
