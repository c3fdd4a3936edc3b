"""The stand-in's ``ElementwiseKernel`` and ``ReductionKernel``: CuPy's call rules.

Each kernel gets its CUDA source (as real CuPy would) and, the stand-in's own addition, a
NumPy ``reference`` that computes the same. These tests use the stand-in directly.
"""

from __future__ import annotations

import numpy as np
import pytest

import framework.testing.cupy_standin as cp
from framework.testing.cupy_standin import counting


def _axpy():
    k = cp.ElementwiseKernel("T x, T y, T a", "T z", "z = a * x + y;", "axpy")

    def ref(x, y, a, z):
        z[...] = a * x + y

    k.reference = ref
    return k


def _sum_sq():
    k = cp.ReductionKernel("T x", "T y", "x * x", "a + b", "y = a", "0", "sum_sq")
    k.reference = lambda x, axis: np.add.reduce(x * x, axis=axis)
    return k


def test_elementwise_broadcasts_binds_placeholders_and_allocates_the_output():
    x = cp.arange(6, dtype=cp.float32).reshape(2, 3)
    y = cp.asarray(np.array([1.0, 2.0, 3.0], np.float32))
    with counting.count() as c:
        z = _axpy()(x, y, 2.0)  # the scalar takes T's dtype
    assert isinstance(z, cp.ndarray) and z.shape == (2, 3) and z.dtype == np.float32
    np.testing.assert_array_equal(z.get(), 2 * np.arange(6, dtype=np.float32).reshape(2, 3) + [1, 2, 3])
    assert c.by_kind() == {"kernel": 1} and c.host_syncs == 0


def test_elementwise_writes_a_given_output_in_place_and_checks_it():
    x = cp.ones((2, 3), dtype=cp.float64)
    k = _axpy()
    assert k(x, x, 3.0, x) is x  # the output may be an input (elementwise)
    np.testing.assert_array_equal(x.get(), np.full((2, 3), 4.0))
    with pytest.raises(ValueError, match="Out shape is mismatched"):
        k(x, x, 1.0, cp.empty((3,), dtype=cp.float64))
    with pytest.raises(TypeError, match="Unsupported type <class 'numpy.ndarray'>"):
        k(x, x, 1.0, np.empty((2, 3)))  # a host array, as every CuPy argument check


def test_elementwise_refuses_a_placeholder_bound_to_two_dtypes_and_wrong_arity():
    k = _axpy()
    with pytest.raises(TypeError, match="Type is mismatched"):
        k(cp.ones(3, dtype=cp.float32), cp.ones(3, dtype=cp.float64), 1.0)
    with pytest.raises(TypeError, match="Wrong number of arguments for 'axpy'"):
        k(cp.ones(3))
    with pytest.raises(ValueError, match="Loop size is undecided"):
        k(1.0, 2.0, 3.0)
    with pytest.raises(ValueError, match="Can not use 'i' as a parameter name"):
        cp.ElementwiseKernel("T i", "T y", "y = i;", "bad")
    with pytest.raises(ValueError, match="Invalid kernel name"):
        cp.ElementwiseKernel("T x", "T y", "y = x;", "not a name")


def test_elementwise_raw_params_are_not_broadcast_and_fixed_types_are_checked():
    k = cp.ElementwiseKernel("T x, raw T table, int64 n", "T y", "y = x + table[n];", "lookup")
    seen = {}

    def ref(x, table, n, y):
        seen["table"], seen["n"] = table.shape, type(n)
        y[...] = x + table[n]

    k.reference = ref
    y = k(cp.zeros((2, 2), dtype=cp.float32), cp.asarray(np.array([5.0, 7.0], np.float32)), 1)
    np.testing.assert_array_equal(y.get(), np.full((2, 2), 7.0, np.float32))
    assert seen == {"table": (2,), "n": np.int64}
    with pytest.raises(TypeError, match="Type is mismatched"):
        k(cp.zeros(2, dtype=cp.float32), cp.zeros(2, dtype=cp.float32), cp.zeros(2, dtype=cp.int32))


def test_elementwise_tuple_results_no_return_and_empty_loops():
    k = cp.ElementwiseKernel("T x", "T lo, T hi", "lo = x - 1; hi = x + 1;", "spread", return_tuple=False)

    def ref(x, lo, hi):
        lo[...], hi[...] = x - 1, x + 1

    k.reference = ref
    lo, hi = k(cp.zeros(3, dtype=cp.float32))
    assert lo.get().tolist() == [-1, -1, -1] and hi.get().tolist() == [1, 1, 1]
    with counting.count() as c:
        lo, hi = k(cp.zeros((0, 3), dtype=cp.float32))
    assert lo.shape == (0, 3) and c.launches == 0  # nothing to launch, as CuPy
    quiet = cp.ElementwiseKernel("T x", "T y", "y = x;", "copy_quiet", no_return=True)
    quiet.reference = lambda x, y: y.__setitem__(..., x)
    assert quiet(cp.ones(2), cp.empty(2)) is None


def test_a_kernel_without_a_reference_says_the_stand_in_cannot_compile_cuda():
    k = cp.ElementwiseKernel("T x", "T y", "y = x;", "nocode")
    with pytest.raises(NotImplementedError, match="cannot compile CUDA"):
        k(cp.ones(2))
    r = cp.ReductionKernel("T x", "T y", "x", "a + b", "y = a", "0", "nocode_sum")
    with pytest.raises(NotImplementedError, match="cannot compile CUDA"):
        r(cp.ones(2))


def test_reduction_axis_keepdims_and_out():
    x = cp.asarray(np.arange(24, dtype=np.float64).reshape(2, 3, 4))
    host = np.arange(24, dtype=np.float64).reshape(2, 3, 4)
    k = _sum_sq()
    with counting.count() as c:
        full = k(x)
    assert full.shape == () and float(full) == (host**2).sum()
    assert c.by_kind() == {"kernel": 1}
    np.testing.assert_array_equal(k(x, axis=(0, 2)).get(), (host**2).sum(axis=(0, 2)))
    np.testing.assert_array_equal(k(x, axis=-1, keepdims=True).get(), (host**2).sum(axis=-1, keepdims=True))
    out = cp.empty((3,), dtype=cp.float64)
    assert k(x, axis=(0, 2), out=out) is out
    np.testing.assert_array_equal(out.get(), (host**2).sum(axis=(0, 2)))
    assert k(x, out, axis=(0, 2)) is out  # the output as a positional argument
    with pytest.raises(ValueError, match="Out shape is mismatched"):
        k(x, axis=0, out=out)
    with pytest.raises(ValueError, match="cannot specify 'out' as both"):
        k(x, out, axis=(0, 2), out=out)
    with pytest.raises(np.exceptions.AxisError):
        k(x, axis=3)
    with pytest.raises(ValueError, match="duplicate value in 'axis'"):
        k(x, axis=(1, -2))


def test_reduction_broadcasts_its_inputs():
    k = cp.ReductionKernel("T x, T w", "T y", "x * w", "a + b", "y = a", "0", "weighted")
    k.reference = lambda x, w, axis: np.add.reduce(x * w, axis=axis)
    x = cp.ones((2, 3), dtype=cp.float32)
    w = cp.asarray(np.array([1.0, 2.0, 3.0], np.float32))
    np.testing.assert_array_equal(k(x, w, axis=0).get(), [2.0, 4.0, 6.0])
    np.testing.assert_array_equal(k(x, w, axis=1).get(), [6.0, 6.0])


def test_reduction_identity_for_empty_inputs():
    x = cp.zeros((0, 3), dtype=cp.float32)
    with counting.count() as c:
        y = _sum_sq()(x, axis=0)  # the identity: 0 for every output
    np.testing.assert_array_equal(y.get(), np.zeros(3, np.float32))
    assert c.launches == 1
    assert _sum_sq()(x, axis=1).shape == (0,)  # an empty output launches nothing
    k = cp.ReductionKernel("T x", "T y", "x", "max(a, b)", "y = a", None, "no_identity")
    k.reference = lambda x, axis: np.max(x, axis=axis)
    with pytest.raises(ValueError, match="zero-size array to reduction operation no_identity which has no identity"):
        k(x, axis=0)


def test_reduction_reduce_type_and_fixed_output_dtype():
    k = cp.ReductionKernel(
        "T x", "float64 y", "(double)x", "a + b", "y = a", "0", "sum_in_double", reduce_type="double"
    )
    k.reference = lambda x, axis: x.astype(np.float64).sum(axis=axis)
    x = cp.asarray(np.full(4, 0.1, np.float32))
    y = k(x)
    assert y.dtype == np.float64 and float(y) == np.full(4, 0.1, np.float32).astype(np.float64).sum()
    assert k.reduce_type == "double" and _sum_sq().reduce_type == "T"


def test_scalars_are_packed_into_their_parameter_as_cupy_packs_them():
    k = cp.ElementwiseKernel("T x, int8 k", "T y", "y = x + k;", "add_int8")
    k.reference = lambda x, k_, y: y.__setitem__(..., x + k_)
    x = cp.zeros(3, dtype=cp.float32)
    assert k(x, 5).get().tolist() == [5.0, 5.0, 5.0]
    with pytest.raises(OverflowError, match="300 out of bounds for int8"):
        k(x, 300)  # CuPy packs by assignment (PyArray_Pack), NumPy 2's rule for a Python int
    with pytest.raises(ValueError, match="NaN"):
        k(x, float("nan"))


_MOMENT = "__device__ complex<double> moment(double v) { return complex<double>(v, v * v); }"


def _moments(map_expr, preamble=""):
    k = cp.ReductionKernel(
        "T x",
        "complex128 s",
        map_expr,
        "a + b",
        "s = a",
        "0",
        "moments",
        reduce_type="complex<double>",
        preamble=preamble,
    )
    k.reference = lambda x, axis: x.astype(np.float64).sum(axis) + 1j * (x.astype(np.float64) ** 2).sum(axis)
    return k


def test_a_reduction_cupys_cub_path_would_break_raises_its_compile_exception():
    """CuPy's CUB path renames the input (x) to in0 with str.replace, inside ``complex``
    too; it takes that path for a C- or F-contiguous input reduced over its last (C) or
    first (F) axes, 128 values or more per output."""
    broken = _moments("complex<double>(x, (double)x * x)")
    f_order = cp.ones((256, 2), dtype=cp.float32, order="F")
    with pytest.raises(cp.cuda.compiler.CompileException, match='identifier "complein0" is undefined'):
        broken(f_order, axis=0)
    with pytest.raises(cp.cuda.compiler.CompileException):
        broken(cp.ones((2, 256), dtype=cp.float32), axis=1)  # C order, the last axis
    assert complex(broken(cp.ones((256, 2), dtype=cp.float32), axis=0)[0].get()) == 256 + 256j  # C order, axis 0
    assert complex(broken(cp.ones((127, 2), dtype=cp.float32, order="F"), axis=0)[0].get()) == 127 + 127j  # < 128
    assert complex(broken(f_order[::2], axis=0)[0].get()) == 128 + 128j  # not contiguous
    fixed = _moments("moment((double)x)", _MOMENT)
    assert complex(fixed(f_order, axis=0)[0].get()) == 256 + 256j
