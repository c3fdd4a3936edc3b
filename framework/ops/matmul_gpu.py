"""Matrix products on the GPU through NVIDIA's cuDNN frontend (``pygraph.matmul``).

CuPy's ``matmul`` calls cuBLAS, which CuPy refuses while a stream captures a CUDA graph
("calling cuBLAS API during stream capture is currently unsupported"), so a step with a
``Linear`` could never replay as a graph. The cuDNN frontend's matmul is capturable (its
``execute`` is a kernel on the handle's stream, like the convolutions'), so every matrix
product of :class:`~framework.ops.linalg.Matmul` and :class:`~framework.ops.linalg.Linear`
on a GPU goes through it where the frontend is installed: eagerly and compiled alike, so a
compiled step runs exactly eager's kernels (bitwise equal) and launches as many (one
``execute`` where CuPy made one cuBLAS call). See docs/COMPILE.md, "Matrix products on a
GPU".

A built graph (a plan) is cached per device, operand shapes and strides (in elements; a
transposed view is declared by its strides, no copy) and dtype. Engines that down-convert
their inputs are never taken. Math: cuDNN's float32 matrix products are TF32 (inputs rounded
to 10 mantissa bits) on Ampere and later GPUs whatever numerical notes a plan deselects:
measured on an H200 (cuDNN 9.19, frontend 1.32), every engine cuDNN offered for a float32
product, its cuBLASLt one included, was 3-6e-4 off in relative terms, and its float64
products exact. So a float32 product runs as a float64 one, its operands and result copied
(category ``workspace``: three launches and twice the operands' and result's bytes, for a
moment) and the result rounded once to float32: as exact as a float32 GEMM, and better.
Operands and results not aligned to 16 bytes (a view into a flat buffer) go through an
aligned copy (:data:`.conv_algorithms.gpu.ALIGNMENT`). Where the frontend is missing, the
operands are not float32/float64 matrices (2-D, or with the same batch dims: attention's
``(batch, heads, rows, columns)``), or cuDNN has no engine for the geometry, the product is
CuPy's (cuBLAS): it still runs eagerly, and a CUDA-graph capture of it fails with CuPy's
one-line reason. A batched product with a bfloat16 operand, which CuPy 14.2 cannot make,
runs in float32 and is rounded once (:func:`_bfloat16_batched`).
"""

from __future__ import annotations

import numpy as np

from .. import memory
from ..backend import cudnn_module, cupy_module, current_device, current_stream
from .conv_algorithms.gpu import ALIGNMENT, aligned, handle_for  # one cuDNN handle per device, shared with convs
from .promotion import widen

_plans: dict = {}  # (device, a shape, a strides, b shape, b strides, dtype) -> _Plan or _UNSUPPORTED
_UNSUPPORTED = object()


class _Plan:
    def __init__(self, graph, tensors, workspace_bytes):
        self.graph, self.tensors, self.workspace_bytes = graph, tensors, workspace_bytes


def _as3(a):
    """``a`` with batch dims ``[*batch, rows, columns]`` (a 2-D matrix gets a batch of one)."""
    return a.reshape((1,) + a.shape) if a.ndim == 2 else a


def _elements(a):
    return tuple(s // a.itemsize for s in a.strides)


def _matrix_layout(a) -> bool:
    """Whether each matrix of ``a`` is row- or column-major (a transposed view is the other):
    the layouts matmul engines take; other strides are given to CuPy."""
    (r, c), (sr, sc) = a.shape[-2:], tuple(s // a.itemsize for s in a.strides[-2:])
    return (sc == 1 and sr >= c) or (sr == 1 and sc >= r)


def _usable(a, b):
    if a.dtype != b.dtype or a.dtype.name not in ("float32", "float64") or a.ndim != b.ndim:
        return False
    # batch dims (cuDNN's matmul takes any number: attention's (batch, heads, rows, columns))
    if a.ndim < 2 or a.ndim > 8 or a.shape[:-2] != b.shape[:-2] or not a.size or not b.size:
        return False
    return _matrix_layout(a) and _matrix_layout(b)


def _build(cudnn, a3, b3, c3, handle):
    io = cudnn.data_type.FLOAT if a3.dtype.name == "float32" else cudnn.data_type.DOUBLE
    graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=io, compute_data_type=io, handle=handle)
    ta = graph.tensor(name="A", dim=list(a3.shape), stride=list(_elements(a3)), data_type=io)
    tb = graph.tensor(name="B", dim=list(b3.shape), stride=list(_elements(b3)), data_type=io)
    tc = graph.matmul(ta, tb, compute_data_type=io, name="mm")
    tc.set_output(True).set_dim(list(c3.shape)).set_stride(list(_elements(c3))).set_data_type(io)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    # float64 only (float32 products are made in it): its tensor cores are full float64
    graph.deselect_numeric_notes([cudnn.numerical_note.DOWN_CONVERT_INPUTS, cudnn.numerical_note.NONDETERMINISTIC])
    graph.check_support()
    graph.build_plans()
    return _Plan(graph, (ta, tb, tc), graph.get_workspace_size())


def matmul(a, b, xp, out=None):
    """``a @ b`` for device arrays: one cuDNN frontend execution where it can run it, else
    ``xp.matmul`` (cuBLAS). A new array, like ``xp.matmul``, or ``out`` (of any strides the
    product's matrices can be written with, e.g. a transposed view) when given."""
    on_cupy = xp is cupy_module()  # not NumPy, nor a double backward's tensors
    if on_cupy and max(a.ndim, b.ndim) > 2 and "bfloat16" in (a.dtype.name, b.dtype.name):
        return _bfloat16_batched(a, b, xp, out)
    if xp is np and a.dtype == b.dtype == np.float16:
        # NumPy's float16 product has no BLAS (~100x slower than float32's): made in float32
        # and rounded once, as its bfloat16 product (ml_dtypes) and PyTorch's CPU kernels are
        product = memory.track(np.matmul(widen(a), widen(b)), "workspace")
        if out is None:
            return product.astype(np.float16)
        out[...] = product
        return out
    cudnn = cudnn_module() if on_cupy else None
    if cudnn is None or not _usable(a, b) or (out is not None and not _matrix_layout(out)):
        if out is not None:
            return xp.matmul(a, b, out=out)
        product = xp.matmul(a, b)
        if xp is np and product.dtype != np.promote_types(a.dtype, b.dtype):
            # NumPy returns bfloat16's product in float32: rounded once, as on a GPU (and PyTorch)
            product = product.astype(np.promote_types(a.dtype, b.dtype))
        return product
    if out is None:
        # a new array that owns its memory (the inplace policy writes only over such), counted
        # by the caller as xp.matmul's result is
        out = xp.empty(a.shape[:-1] + b.shape[-1:], a.dtype)
    if a.dtype.name == "float32":  # cuDNN's float32 products are TF32: made in float64 (module doc)
        wide = memory.empty(out.shape, np.float64, xp, "workspace")
        _execute(cudnn, xp, _widened(a, xp), _widened(b, xp), _one_batch_dim(wide))
        out[...] = wide  # rounded once
        return out
    return _execute(cudnn, xp, a, b, out)


def _widened(a, xp):
    """``a`` as a row-major float64 copy (counted workspace), its batch dims as one
    (:func:`_one_batch_dim`)."""
    return _one_batch_dim(memory.track(a.astype(np.float64, order="C"), "workspace"))


def _one_batch_dim(a):
    """A C-contiguous ``[*batch, rows, columns]`` array as ``[batch, rows, columns]`` (a view).

    cuDNN's float64 products run on its cuBLASLt engine alone, whose batches are one count
    and one stride: on an H200 it offered no plan for attention's 4-d float64 products (they
    fell back to cuBLAS, which a CUDA graph cannot capture)."""
    return a.reshape((-1,) + a.shape[-2:]) if a.ndim > 3 else a


def _execute(cudnn, xp, a, b, out):
    """``out = a @ b`` by one cuDNN frontend execution (its plan built once per geometry), or
    CuPy's matmul where cuDNN has no engine for it."""
    if out.data.ptr % ALIGNMENT:  # made in an aligned buffer of out's layout, then copied over
        out[...] = _execute(cudnn, xp, a, b, memory.track(xp.empty_like(out, order="K"), "workspace"))
        return out
    a, b = aligned(a, xp), aligned(b, xp)
    device = current_device().index
    a3, b3, c3 = _as3(a), _as3(b), _as3(out)
    key = (device, a3.shape, _elements(a3), b3.shape, _elements(b3), _elements(c3), a.dtype.name)
    handle = handle_for(cudnn, device)
    plan = _plans.get(key)
    if plan is None:
        try:
            plan = _build(cudnn, a3, b3, c3, handle)
        except cudnn.cudnnGraphNotSupportedError:
            plan = _UNSUPPORTED
        _plans[key] = plan
    if plan is _UNSUPPORTED:
        return xp.matmul(a, b, out=out)
    cudnn.set_stream(handle, current_stream().ptr)
    workspace = memory.empty((plan.workspace_bytes,), xp.uint8, xp, "workspace") if plan.workspace_bytes else None
    ta, tb, tc = plan.tensors
    plan.graph.execute({ta: a3, tb: b3, tc: c3}, workspace, handle=handle)
    return out


def _bfloat16_batched(a, b, xp, out):
    """A batched product with a bfloat16 operand, which CuPy 14.2's ``matmul`` cannot make
    (above 2-d it takes its integer GEMM kernel, which has no bfloat16 instance): made in
    float32 and rounded once, as its 2-d bfloat16 products are (cuBLAS, float32 compute)."""
    product = xp.matmul(a.astype(xp.float32), b.astype(xp.float32))
    if out is None:
        return product.astype(np.promote_types(a.dtype, b.dtype), copy=False)
    out[...] = product
    return out
