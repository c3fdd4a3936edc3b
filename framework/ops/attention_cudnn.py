"""Attention on the GPU through NVIDIA's cuDNN frontend's SDPA (``pygraph.sdpa`` and
``pygraph.sdpa_backward``): one ``execute`` each way, FlashAttention-2's algorithm.

Where cuDNN offers it: float16 or bfloat16 ``(B, H, L, E)`` inputs (cuDNN's SDPA takes no
float32), a head dim that is a multiple of 8 and at most 128 (256 forward), no explicit
mask (``is_causal`` is the frontend's top-left diagonal band) and no dropout (cuDNN draws
its own Philox mask, which the framework's kernels could not regenerate). Everything else,
and machines without the frontend, take :mod:`.attention`'s matmul + fused-kernel path;
:func:`forward` / :func:`backward` return None then.

Plans are built once per device, shapes, strides, dtype, scale and mask, as
:mod:`.matmul_gpu` builds its matmuls. Forward asks for the softmax statistics
(``generate_stats=True``): each row's ``max + log(sum exp)`` of the scaled scores, float32,
which is exactly the log-sum-exp the fallback kernels keep, so either backward can follow
either forward.
"""

from __future__ import annotations

import numpy as np

from .. import memory
from ..backend import cudnn_module, cupy_module, current_device, current_stream
from .conv_algorithms.gpu import handle_for

_IO_TYPES = {"float16": "HALF", "bfloat16": "BFLOAT16"}
_plans: dict = {}  # (pass, device, shapes, strides, dtype, scale, causal) -> _Plan or _UNSUPPORTED
_UNSUPPORTED = object()


class _Plan:
    def __init__(self, graph, tensors, workspace_bytes):
        self.graph, self.tensors, self.workspace_bytes = graph, tensors, workspace_bytes


def _elements(a):
    return [s // a.itemsize for s in a.strides]


def _frontend(q):
    """The cuDNN frontend module when the inputs can go through its SDPA, else None."""
    cp = cupy_module()
    if cp is None or q.__class__ is not cp.ndarray or q.ndim != 4 or q.dtype.name not in _IO_TYPES:
        return None
    return cudnn_module()


def _tensor(graph, cudnn, name, a, io):
    return graph.tensor(name=name, dim=list(a.shape), stride=_elements(a), data_type=io)


def _mask_args(cudnn, causal):
    return {"diagonal_band_right_bound": 0, "diagonal_alignment": cudnn.diagonal_alignment.TOP_LEFT} if causal else {}


def _build_forward(cudnn, q, k, v, out, scale, causal, handle):
    io = getattr(cudnn.data_type, _IO_TYPES[q.dtype.name])
    f32 = cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    tq, tk, tv = (_tensor(graph, cudnn, n, a, io) for n, a in (("Q", q), ("K", k), ("V", v)))
    to, ts = graph.sdpa(
        q=tq, k=tk, v=tv, attn_scale=scale, generate_stats=True, name="sdpa", **_mask_args(cudnn, causal)
    )
    to.set_output(True).set_dim(list(out.shape)).set_stride(_elements(out)).set_data_type(io)
    b, h, l_, _ = q.shape
    ts.set_output(True).set_dim([b, h, l_, 1]).set_stride([h * l_, l_, 1, 1]).set_data_type(f32)
    return _finish(cudnn, graph, (tq, tk, tv, to, ts))


def _build_backward(cudnn, q, k, v, o, g, dq, dk, dv, scale, causal, handle):
    io = getattr(cudnn.data_type, _IO_TYPES[q.dtype.name])
    f32 = cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    tq, tk, tv, to, tg = (
        _tensor(graph, cudnn, n, a, io) for n, a in (("Q", q), ("K", k), ("V", v), ("O", o), ("dO", g))
    )
    b, h, l_, _ = q.shape
    ts = graph.tensor(name="Stats", dim=[b, h, l_, 1], stride=[h * l_, l_, 1, 1], data_type=f32)
    tdq, tdk, tdv = graph.sdpa_backward(
        q=tq, k=tk, v=tv, o=to, dO=tg, stats=ts, attn_scale=scale, name="sdpa_backward", **_mask_args(cudnn, causal)
    )
    for t, a in ((tdq, dq), (tdk, dk), (tdv, dv)):
        t.set_output(True).set_dim(list(a.shape)).set_stride(_elements(a)).set_data_type(io)
    return _finish(cudnn, graph, (tq, tk, tv, to, tg, ts, tdq, tdk, tdv))


def _finish(cudnn, graph, tensors):
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return _Plan(graph, tensors, graph.get_workspace_size())


def _plan(key, build):
    cudnn = cudnn_module()
    plan = _plans.get(key)
    if plan is None:
        try:
            plan = build()
        except cudnn.cudnnGraphNotSupportedError:
            plan = _UNSUPPORTED
        _plans[key] = plan
    return None if plan is _UNSUPPORTED else plan


def _execute(plan, arrays, handle, xp):
    cudnn = cudnn_module()
    cudnn.set_stream(handle, current_stream().ptr)
    workspace = memory.empty((plan.workspace_bytes,), np.uint8, xp, "workspace") if plan.workspace_bytes else None
    plan.graph.execute(dict(zip(plan.tensors, arrays)), workspace, handle=handle)


def _key(kind, arrays, scale, causal):
    return (kind, current_device().index, tuple((a.shape, tuple(_elements(a))) for a in arrays), arrays[0].dtype.name,
            scale, causal)  # fmt: skip


def forward(q, k, v, out, scale, causal):
    """``out`` written by cuDNN's SDPA; returns the (B, H, L) float32 log-sum-exp, or None
    where cuDNN does not run it (nothing is written then)."""
    cudnn = _frontend(q)
    if cudnn is None:
        return None
    handle = handle_for(cudnn, current_device().index)
    plan = _plan(
        _key("fwd", (q, k, v, out), scale, causal),
        lambda: _build_forward(cudnn, q, k, v, out, scale, causal, handle),
    )
    if plan is None:
        return None
    xp = cupy_module()
    b, h, l_, _ = q.shape
    stats = memory.empty((b, h, l_, 1), np.float32, xp)  # kept for backward: not a workspace
    _execute(plan, (q, k, v, out, stats), handle, xp)
    return stats.reshape(b, h, l_)


def backward(q, k, v, o, g, lse, scale, causal):
    """(dQ, dK, dV) from cuDNN's SDPA backward, or None where cuDNN does not run it."""
    cudnn = _frontend(q)
    if cudnn is None or lse.dtype != np.float32:
        return None
    xp = cupy_module()
    dq, dk, dv = (memory.empty(a.shape, a.dtype, xp) for a in (q, k, v))
    handle = handle_for(cudnn, current_device().index)
    plan = _plan(
        _key("bwd", (q, k, v, o, g, dq, dk, dv), scale, causal),
        lambda: _build_backward(cudnn, q, k, v, o, g, dq, dk, dv, scale, causal, handle),
    )
    if plan is None:
        return None
    b, h, l_, _ = q.shape
    _execute(plan, (q, k, v, o, g, lse.reshape(b, h, l_, 1), dq, dk, dv), handle, xp)
    return dq, dk, dv
