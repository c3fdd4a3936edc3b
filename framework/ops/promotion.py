"""PyTorch's type promotion: the ONE place that decides the dtype of an op on several operands.

``result_type(a, b)`` is ``torch.result_type``: operands fall into three categories,
dimensioned tensors > zero-dim tensors > scalars (Python or NumPy numbers), and a lower
category decides the dtype only when it is of a higher kind (bool < integer < floating
< complex). So ``ones(2) + tensor(1., dtype=float64)`` and ``ones(2) + np.float64(1.5)``
stay float32, while ``int32 tensor + 1.5`` is float32 (the default float) and
``int32 tensor + tensor(1.5, dtype=float64)`` is float64. NumPy 2 (NEP 50) agrees for
Python scalars only: it lets a float64 0-d array or NumPy scalar promote a float32 array.

Binary ops cast their tensor operands to the result type (a ``Cast`` node, so gradients
come back in each input's own dtype) and turn NumPy scalars into Python ones, so the
kernels of every array module (NumPy, CuPy) see operands that need no promotion of theirs.
"""

from __future__ import annotations

import numpy as np

from .. import memory
from ..tensor import Tensor

DEFAULT_FLOAT = np.dtype(np.float32)


def _bfloat16():
    """bfloat16 from the ``ml_dtypes`` package (NumPy has none; CuPy 14 takes it from there
    too), or a stand-in that says what to install wherever it is used as a dtype."""
    try:
        import ml_dtypes  # noqa: PLC0415
    except ImportError:
        return _MissingDtype("bfloat16", "ml_dtypes")
    return np.dtype(ml_dtypes.bfloat16)


class _MissingDtype:
    def __init__(self, name, package):
        self.name, self.package = name, package

    @property
    def dtype(self):  # np.dtype(x) reads this: the error comes where the dtype is used
        raise TypeError(f"{self.name} needs the {self.package} package: pip install {self.package}")

    def __repr__(self):
        return f"{self.name} (unavailable: pip install {self.package})"


bfloat16 = _bfloat16()

_BOOL, _INT, _FLOAT, _COMPLEX = 0, 1, 2, 3
_RANKS = {"b": _BOOL, "i": _INT, "u": _INT, "f": _FLOAT, "c": _COMPLEX}
_SCALAR_DTYPES = {
    _BOOL: np.dtype(np.bool_),
    _INT: np.dtype(np.int64),
    _FLOAT: DEFAULT_FLOAT,
    _COMPLEX: np.dtype(np.complex64),
}
# PyTorch's names for dtypes, in its messages ("result type Float can't be cast ...")
_TORCH_NAMES = {
    "bool": "Bool",
    "uint8": "Byte",
    "int8": "Char",
    "int16": "Short",
    "int32": "Int",
    "int64": "Long",
    "float16": "Half",
    "bfloat16": "BFloat16",
    "float32": "Float",
    "float64": "Double",
    "complex64": "ComplexFloat",
    "complex128": "ComplexDouble",
}


# The C++ type names PyTorch's messages print for a dtype (``attn_mask.dtype: long int``)
_CPP_NAMES = {
    "bool": "bool",
    "uint8": "unsigned char",
    "int8": "signed char",
    "int16": "short int",
    "int32": "int",
    "int64": "long int",
    "uint16": "short unsigned int",
    "uint32": "unsigned int",
    "uint64": "long unsigned int",
    "float16": "c10::Half",
    "bfloat16": "c10::BFloat16",
    "float32": "float",
    "float64": "double",
    "complex64": "c10::complex<float>",
    "complex128": "c10::complex<double>",
}
# The dtypes whose tensors PyTorch names by their legacy class (``torch.ByteTensor``)
_LEGACY_NAMES = ("uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64")


def cpp_name(dtype) -> str:
    """PyTorch's C++ name of ``dtype`` in its messages (``long int``, ``c10::Half``)."""
    name = np.dtype(dtype).name
    return _CPP_NAMES.get(name, name)


def tensor_type_name(dtype, device_type: str = "cpu") -> str:
    """PyTorch's name of a tensor's type in its argument checks: ``torch.ByteTensor``
    (``torch.cuda.ByteTensor`` on a GPU) for the legacy types, else ``CPUBoolType``."""
    name = np.dtype(dtype).name
    short = _TORCH_NAMES.get(name) or name.capitalize().replace("Uint", "UInt")
    if name in _LEGACY_NAMES:
        return f"torch.{'cuda.' if device_type == 'cuda' else ''}{short}Tensor"
    return f"{'CUDA' if device_type == 'cuda' else 'CPU'}{short}Type"


def kind_rank(dtype) -> int:
    """0 bool, 1 integer, 2 floating (bfloat16 included: NumPy calls its kind 'V'), 3 complex."""
    rank = _RANKS.get(dtype.kind)
    if rank is None:
        if dtype.name == "bfloat16":
            return _FLOAT
        raise TypeError(f"unsupported dtype {dtype} in an arithmetic op")
    return rank


def is_floating(dtype) -> bool:
    """Whether ``dtype`` is a floating-point dtype (float16/32/64 or bfloat16)."""
    return kind_rank(np.dtype(dtype)) == _FLOAT


def promote_types(a, b):
    """``torch.promote_types``: the smallest dtype both ``a`` and ``b`` convert to within
    PyTorch's rules (an integer meets a float in the float: int64 + float32 is float32,
    where NumPy says float64; float16 and bfloat16 meet in float32)."""
    if a == b:
        return a
    ra, rb = kind_rank(a), kind_rank(b)
    if ra != rb and min(ra, rb) <= _INT:
        return a if ra > rb else b
    if ra == rb == _FLOAT and {a.name, b.name} == {"float16", "bfloat16"}:
        return np.dtype(np.float32)
    return np.promote_types(a, b)


def _combine(higher, lower):
    # c10's combine_categories: a lower category counts only when of a higher kind
    if higher is None:
        return lower
    if lower is None:
        return higher
    rh, rl = kind_rank(higher), kind_rank(lower)
    if rh == _COMPLEX:
        return higher
    if rl == _COMPLEX:
        return np.promote_types(higher, np.complex64) if rh == _FLOAT else lower
    if rh == _FLOAT:
        return higher
    if rh == _BOOL or rl == _FLOAT:
        return promote_types(higher, lower)
    return higher


def _scalar_dtype(value):
    if isinstance(value, (bool, np.bool_)):
        return _SCALAR_DTYPES[_BOOL]
    if isinstance(value, np.generic):
        return _SCALAR_DTYPES[kind_rank(value.dtype)]
    if isinstance(value, int):
        return _SCALAR_DTYPES[_INT]
    if isinstance(value, float):
        return _SCALAR_DTYPES[_FLOAT]
    if isinstance(value, complex):
        return _SCALAR_DTYPES[_COMPLEX]
    return None


def result_type(*operands):
    """``torch.result_type`` of tensors and numbers (see the module docstring).

    None when an operand is neither: a number traced by a compiled step's capture
    (``framework.compile.scalars.Sym``) takes its part in the kernel as it is.
    """
    dims = zero = scalars = None
    for a in operands:
        if isinstance(a, Tensor):
            d = a._data.dtype
            if a._data.ndim:
                dims = d if dims is None else promote_types(dims, d)
            else:
                zero = d if zero is None else promote_types(zero, d)
        else:
            d = _scalar_dtype(a)
            if d is None:
                return None
            scalars = d if scalars is None else promote_types(scalars, d)
    return _combine(dims, _combine(zero, scalars))


def half_on_cpu(dtype, xp):
    """``dtype`` where an op computes a half type (float16, bfloat16) in float32 and rounds
    once, else None: on the CPU (NumPy), for the ops whose kernels would otherwise add long
    sums in the half type or run NumPy's half-precision loops, which have no BLAS (its
    float16 product is ~100x slower than float32's). PyTorch's CPU kernels (oneDNN, and
    its ``opmath`` type) accumulate half types in float32 too. A GPU's kernels take half
    types as they are (docs/GPU.md, "Precision")."""
    return dtype if xp is np and dtype.name in ("float16", "bfloat16") else None


def widen(a):
    """A half-type array as float32, counted as workspace (None stays None)."""
    return None if a is None else memory.track(a.astype(np.float32), "workspace")


def narrow(a, dtype, category="gradients", out=None):
    """A float32 result rounded once to ``dtype`` (into ``out`` when given); the float32
    buffer becomes workspace."""
    memory.retag(a, "workspace")
    if out is not None:
        out[...] = a
        return out
    return memory.track(a.astype(dtype), category)


def can_cast(source, target) -> bool:
    """``torch.can_cast``: no complex to real, no floating to integer, nothing to bool but bool."""
    return kind_rank(source) <= kind_rank(target)


def check_cast(result, target) -> None:
    """Raises PyTorch's error when an inplace op's result type cannot be written into
    a tensor of dtype ``target``."""
    if not can_cast(result, target):
        raise RuntimeError(
            f"result type {_TORCH_NAMES.get(result.name, result.name)} can't be cast to the desired "
            f"output type {_TORCH_NAMES.get(target.name, target.name)}"
        )
