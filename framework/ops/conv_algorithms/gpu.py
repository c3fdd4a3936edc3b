"""The GPU's convolutions: each pass one cuDNN call, or, without cuDNN, one im2col + one matmul.

On a GPU every call from Python costs 7-10 µs whatever it does, so the CPU's algorithms
(chunks of the batch, loops over kernel offsets, Winograd's many small steps) would cost
thousands of launches a training step. Here nothing is chunked and nothing loops over
kernel offsets: a pass makes a small constant number of calls whatever the batch or the
image size. The workspace limit (:mod:`.workspace`) does not apply: a GPU pays for a
workspace in memory, not in calls, so it takes the whole batch at once.

``cudnn`` / ``cudnn_tf32``: NVIDIA's cuDNN frontend (``import cudnn``, ``pip install
nvidia-cudnn-frontend``; CuPy 14 has no cuDNN of its own): forward (``conv_fprop``), weight
gradient (``conv_wgrad``) and input gradient (``conv_dgrad``), one ``execute`` each. A
built graph (a plan) is cached per device, pass, shapes, stride, padding, dtype and math
mode, so only the first call of a geometry builds one. The plan's workspace is allocated
per call through :mod:`framework.memory` (category ``workspace``) from CuPy's pool. A pass
cuDNN has no engine for (its build raises ``cudnnGraphNotSupportedError``) is computed by
``im2col_gpu`` instead, with a warning naming it, once per geometry.
Math: ``cudnn`` deselects the engines with ``numerical_note.TENSOR_CORE`` for float32 only, so
float32 convolutions run in full float32 (cuDNN would otherwise take TF32 tensor-core
engines on Ampere and later GPUs: inputs rounded to 10 mantissa bits, errors of ~1e-3);
``cudnn_tf32`` keeps them (chosen with ``conv.set_math_mode("tf32")``). float16 keeps its
tensor-core engines, its fastest (they take float16 as it is and accumulate in float32),
and so does float64 (its tensor cores, where a GPU has them, are full float64). Engines that
down-convert their inputs (``DOWN_CONVERT_INPUTS``, e.g. float32 to float16) are never
taken, nor are nondeterministic ones (``NONDETERMINISTIC``: atomics, whose sums round
differently from call to call; PyTorch's ``cudnn.deterministic``). The environment
variable ``NVIDIA_TF32_OVERRIDE=1`` of NVIDIA's libraries would force TF32 whatever is
chosen here.

``im2col_gpu``, where the frontend is not installed (one warning per process says how to
install it): forward as a zero-padded copy, ONE strided copy of every window into
``cols`` ``(N, C*kh*kw, Ho*Wo)`` and ONE batched matmul with the weight; weight gradient
as one strided copy of the windows in the layout ``(C*kh*kw, N*Ho*Wo)``, one transposed
copy of the output gradient and ONE matmul; input gradient as a stride-1 convolution of
the output gradient spread out by the stride (zeros between its elements, one copy) with
the flipped, transposed weight: one strided copy and one matmul again (no col2im, no
scatter). Its workspace (``cols``) is batch-sized: ``C*kh*kw*Ho*Wo`` elements per image
(the input gradient's: ``Co*kh*kw*H*W``).
"""

from __future__ import annotations

import warnings

from ... import memory
from ...backend import cudnn_module, current_device, current_stream
from .workspace import contiguous, reach_1d, windows

INSTALL_HINT = "pip install nvidia-cudnn-frontend"
_warned = [False]


def frontend():
    """The cuDNN frontend when it can be used; else None, after ONE warning per process."""
    cudnn = cudnn_module()
    if cudnn is None and not _warned[0]:
        _warned[0] = True
        warnings.warn(
            "conv2d on the GPU: NVIDIA's cuDNN frontend is not installed (or its cuDNN library "
            f"does not load), so convolutions run as im2col + matmul, several times slower: "
            f"{INSTALL_HINT}",
            RuntimeWarning,
            stacklevel=3,
        )
    return cudnn


# --- cuDNN ----------------------------------------------------------------------------------

_plans: dict = {}  # (device, pass, x shape, w shape, stride, padding, dtype, tf32) -> _Plan
_handles: dict = {}  # device -> cudnn handle


def handle_for(cudnn, device: int):
    """The cuDNN handle of GPU ``device``: one per device for every cuDNN call (convolutions
    and matrix products), made on first use."""
    handle = _handles.get(device)
    if handle is None:
        handle = _handles[device] = cudnn.create_handle()
    return handle


# The byte alignment cuDNN's tensor descriptors declare (the frontend's default) and so
# promise of every buffer an execution binds. A view into a flat buffer (a parameter or a
# gradient after a 10-element bias) can start 8 bytes off it; cuDNN does not check, its
# kernels fail or read wrong (an H200 run failed in cuBLASLt with
# CUDNN_STATUS_EXECUTION_FAILED_CUBLAS where such views were bound).
ALIGNMENT = 16


def aligned(a, xp):
    """``a`` itself when its data is 16-byte aligned, else a counted copy in its own layout."""
    if a.data.ptr % ALIGNMENT == 0:
        return a
    return memory.track(a.copy(order="K"), "workspace")


class _Plan:
    """A built cuDNN graph of one pass and its tensors (operands in call order, then output)."""

    def __init__(self, graph, tensors, workspace_bytes):
        self.graph, self.tensors, self.workspace_bytes = graph, tensors, workspace_bytes


def _row_major(shape):
    stride, out = 1, []
    for d in reversed(shape):
        out.append(stride)
        stride *= d
    return out[::-1]


def deselected_notes(cudnn, dtype, tf32) -> list:
    """The numerical notes of the engines a plan must not take: inputs down-converted,
    nondeterministic (atomics: two calls could round differently, which no inplace policy and
    no compiled step may do; on an H200 a float64 input gradient differed in the last bit
    between two calls), and for float32 (unless ``tf32``) tensor cores, whose float32 math is
    TF32 (see the module docstring); float16's tensor cores keep its precision, float64's are
    full float64."""
    notes = [cudnn.numerical_note.DOWN_CONVERT_INPUTS, cudnn.numerical_note.NONDETERMINISTIC]
    if dtype.name == "float32" and not tf32:
        notes.append(cudnn.numerical_note.TENSOR_CORE)
    return notes


def _build(cudnn, op, geom, dtype, tf32, handle) -> _Plan:
    types = {
        "float32": cudnn.data_type.FLOAT,
        "float64": cudnn.data_type.DOUBLE,
        "float16": cudnn.data_type.HALF,
        "bfloat16": cudnn.data_type.BFLOAT16,
    }
    io = types[dtype.name]
    compute = cudnn.data_type.DOUBLE if dtype.name == "float64" else cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=compute, compute_data_type=compute, handle=handle)
    x_shape, w_shape = list(geom.x_shape), list(geom.w_shape)
    y_shape = [geom.x_shape[0], geom.w_shape[0], *geom.out_hw]

    def tensor(name, shape):
        return graph.tensor(name=name, dim=shape, stride=_row_major(shape), data_type=io)

    conv = dict(padding=list(geom.padding), stride=list(geom.stride), dilation=[1, 1])
    if op == "fprop":
        operands = (tensor("x", x_shape), tensor("w", w_shape))
        out, out_shape = graph.conv_fprop(image=operands[0], weight=operands[1], **conv), y_shape
    elif op == "wgrad":
        operands = (tensor("x", x_shape), tensor("dy", y_shape))
        out, out_shape = graph.conv_wgrad(image=operands[0], loss=operands[1], **conv), w_shape
    else:
        operands = (tensor("dy", y_shape), tensor("w", w_shape))
        out, out_shape = graph.conv_dgrad(loss=operands[0], filter=operands[1], **conv), x_shape
    out.set_output(True).set_dim(out_shape).set_stride(_row_major(out_shape)).set_data_type(io)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.deselect_numeric_notes(deselected_notes(cudnn, dtype, tf32))
    graph.check_support()
    graph.build_plans()
    return _Plan(graph, operands + (out,), graph.get_workspace_size())


_UNSUPPORTED = object()  # a cached "cuDNN has no engine for this": the fallback computes it


def _run(op, geom, a, b, out_shape, tf32, xp, category):
    """One cuDNN pass: ``out = op(a, b)``, a new array of ``out_shape``; None where cuDNN
    has no engine for it (the caller computes it otherwise)."""
    if a.size == 0 or b.size == 0:  # an empty batch: nothing to sum (cuDNN refuses empty tensors)
        return memory.zeros(out_shape, a.dtype, xp, category)
    cudnn = cudnn_module()
    device = current_device().index
    key = (device, op, geom.x_shape, geom.w_shape, geom.stride, geom.padding, a.dtype.name, tf32)
    handle = handle_for(cudnn, device)
    plan = _plans.get(key)
    if plan is None:
        try:
            plan = _build(cudnn, op, geom, a.dtype, tf32, handle)
        except cudnn.cudnnGraphNotSupportedError as e:
            plan = _UNSUPPORTED
            warnings.warn(
                f"conv2d on the GPU: cuDNN has no engine for {op} of {geom.x_shape} * {geom.w_shape} "
                f"stride {geom.stride} padding {geom.padding} {a.dtype} ({e}); im2col + matmul computes it",
                RuntimeWarning,
                stacklevel=4,
            )
        _plans[key] = plan
    if plan is _UNSUPPORTED:
        return None
    a, b = aligned(contiguous(a, xp), xp), aligned(contiguous(b, xp), xp)  # row-major as declared
    cudnn.set_stream(handle, current_stream().ptr)  # the frontend remembers it: free when unchanged
    out = memory.empty(out_shape, a.dtype, xp, category)
    workspace = memory.empty((plan.workspace_bytes,), xp.uint8, xp, "workspace") if plan.workspace_bytes else None
    ta, tb, tout = plan.tensors
    plan.graph.execute({ta: a, tb: b, tout: out}, workspace, handle=handle)
    return out


class Cudnn:
    """The three passes through the cuDNN frontend, one library call each."""

    def __init__(self, name, tf32):
        self.name, self.tf32 = name, tf32

    def __repr__(self):
        return f"<conv2d algorithm {self.name!r}>"

    def unsupported(self, geom):
        return None

    def forward(self, x, w, geom, limit, xp):
        n, co = geom.x_shape[0], geom.w_shape[0]
        out = _run("fprop", geom, x, w, (n, co) + tuple(geom.out_hw), self.tf32, xp, "activations")
        return IM2COL_GPU.forward(x, w, geom, limit, xp) if out is None else out

    def grad_weight(self, x, g, geom, limit, xp):
        gw = _run("wgrad", geom, x, g, geom.w_shape, self.tf32, xp, "gradients")
        return IM2COL_GPU.grad_weight(x, g, geom, limit, xp) if gw is None else gw

    def grad_input(self, g, w, geom, limit, xp, overwrite):
        # cuDNN's dgrad cannot write over its own input: ``overwrite`` is declined
        gx = _run("dgrad", geom, g, w, geom.x_shape, self.tf32, xp, "gradients")
        return IM2COL_GPU.grad_input(g, w, geom, limit, xp, overwrite) if gx is None else gx


CUDNN = Cudnn("cudnn", tf32=False)
CUDNN_TF32 = Cudnn("cudnn_tf32", tf32=True)


# --- im2col + matmul, unchunked -------------------------------------------------------------


class Im2colGpu:
    """Every pass one strided copy into ``cols`` and one matmul, on the whole batch."""

    name = "im2col_gpu"

    def __repr__(self):
        return f"<conv2d algorithm {self.name!r}>"

    def unsupported(self, geom):
        return None

    def forward(self, x, w, geom, limit, xp):
        n, c = geom.x_shape[:2]
        co, (kh, kw), (ho, wo) = geom.w_shape[0], geom.kernel, geom.out_hw
        cols = _windows_copied(x, geom, xp)  # (N, C, kh, kw, Ho, Wo)
        out = memory.empty((n, co, ho, wo), x.dtype, xp, "activations")
        w2 = contiguous(w, xp).reshape(co, c * kh * kw)
        xp.matmul(w2, cols.reshape(n, c * kh * kw, ho * wo), out=out.reshape(n, co, ho * wo))
        return out

    def grad_weight(self, x, g, geom, limit, xp):
        n, c = geom.x_shape[:2]
        co, (kh, kw), (ho, wo) = geom.w_shape[0], geom.kernel, geom.out_hw
        cols = _windows_copied(x, geom, xp, (1, 2, 3, 0, 4, 5))  # (C, kh, kw, N, Ho, Wo)
        gt = memory.empty((co, n, ho, wo), g.dtype, xp, "workspace")
        xp.copyto(gt, g.transpose(1, 0, 2, 3))
        gw = memory.empty(geom.w_shape, g.dtype, xp, "gradients")
        k, p = c * kh * kw, n * ho * wo
        xp.matmul(gt.reshape(co, p), cols.reshape(k, p).T, out=gw.reshape(co, k))
        return gw

    def grad_input(self, g, w, geom, limit, xp, overwrite):
        # grad_x[h] = sum_i spread[h + i] * w[kh-1-i]: a stride-1 correlation, without
        # padding, of ``spread`` (H+kh-1 rows: g's row r at s*r + kh-1-ph, zeros between)
        n, c, h, wd = geom.x_shape
        co, (kh, kw), (sh, sw), (ph, pw) = geom.w_shape[0], geom.kernel, geom.stride, geom.padding
        spread = memory.zeros((n, co, h + kh - 1, wd + kw - 1), g.dtype, xp, "workspace")
        rows = reach_1d(kh - 1 - ph, 0, sh, geom.out_hw[0], h + kh - 1)
        cols_ = reach_1d(kw - 1 - pw, 0, sw, geom.out_hw[1], wd + kw - 1)
        if rows is not None and cols_ is not None:
            spread[:, :, rows[1], cols_[1]] = g[:, :, rows[0], cols_[0]]
        wt = memory.empty((c, co, kh, kw), w.dtype, xp, "workspace")
        xp.copyto(wt, w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3))
        view = windows(spread, geom.kernel, (1, 1), (h, wd))
        cols = memory.empty(view.shape, g.dtype, xp, "workspace")
        xp.copyto(cols, view)
        gx = memory.empty(geom.x_shape, g.dtype, xp, "gradients")
        k = co * kh * kw
        xp.matmul(wt.reshape(c, k), cols.reshape(n, k, h * wd), out=gx.reshape(n, c, h * wd))
        return gx


def _windows_copied(x, geom, xp, axes=None):
    """The windows of ``x`` (padded) as one workspace array: (N, C, kh, kw, Ho, Wo), or
    that transposed by ``axes``; one copy."""
    xpad = _padded(x, geom.padding, xp)  # named: the window view alone may not keep it counted
    view = windows(xpad, geom.kernel, geom.stride, geom.out_hw)
    if axes is not None:
        view = view.transpose(axes)
    cols = memory.empty(view.shape, x.dtype, xp, "workspace")
    xp.copyto(cols, view)
    return cols


def _padded(x, padding, xp):
    """``x`` zero-padded: one fill and one copy (``workspace.pad`` fills only the borders,
    fewer bytes but up to four more calls, which is what costs on a GPU)."""
    (ph, pw), (n, c, h, w) = padding, x.shape
    if ph == 0 and pw == 0:
        return x
    buf = memory.zeros((n, c, h + 2 * ph, w + 2 * pw), x.dtype, xp, "workspace")
    buf[:, :, ph : ph + h, pw : pw + w] = x
    return buf


IM2COL_GPU = Im2colGpu()
