"""A stand-in for NVIDIA's cuDNN frontend (``import cudnn``, ``pip install
nvidia-cudnn-frontend``) on top of the CuPy stand-in, for testing the GPU convolutions
without a GPU.

``framework.backend.cudnn_module`` loads it where it loads the CuPy stand-in
(:mod:`framework.testing.cupy_standin`). It holds exactly the part of the frontend the
framework calls, with the real package's names and signatures (a test holds them against
the real module where it imports): handles and streams (:func:`create_handle`,
:func:`set_stream`), the enums (:class:`data_type`, :class:`heur_mode`,
:class:`numerical_note`), :class:`cudnnGraphNotSupportedError` and the graph class
:class:`pygraph` with its tensors, ``conv_fprop`` / ``conv_dgrad`` / ``conv_wgrad``,
``matmul`` (batched, operands of 3 or more dims, strides as declared), ``sdpa`` and
``sdpa_backward`` (scaled dot product attention in float16/bfloat16, the softmax statistics,
a top-left causal band; enum :class:`diagonal_alignment`), the build steps,
``get_workspace_size`` and ``execute``. What it does beyond that subset raises
(NotImplementedError or the frontend's own error), never silently differs.

How it behaves like the real one, and what it checks that the real one would get wrong
silently or crash on:

- a graph computes nothing until it is built; ``execute`` builds it when it was not (as
  the real one does), binds buffers by :class:`Tensor`, name or uid, and refuses a buffer
  whose shape, strides (the backend reads the declared ones) or dtype differ from its
  tensor's, a buffer not aligned to 16 bytes (the descriptors' alignment), a buffer on
  another device than the handle's, a missing operand and a workspace smaller than
  ``get_workspace_size()``;
- the plans: for float32 input and output, heuristics rank a tensor-core engine first
  (TF32 math: inputs rounded to 10 mantissa bits, as cuDNN does on Ampere and later GPUs
  unless the graph deselects ``numerical_note.TENSOR_CORE``), then a full-precision one;
  a float32 matmul has TF32 engines only, none noted TENSOR_CORE (as measured on an H200);
  for float16 a tensor-core engine first too (float16 inputs as they are, accumulated in
  float32: the same values as the full-precision one here), then a full-precision one;
  other types get a full-precision engine only;
- each ``execute`` counts ONE kernel launch of kind ``"cudnn"``
  (:func:`framework.testing.cupy_standin.counting.launch`) and no host synchronization;
  it runs on the handle's stream (``set_stream``), and while that stream captures a CUDA
  graph it is recorded into the graph instead of run (``cupy.cuda.graph``).

The values are computed in float64 on the host arrays behind the stand-in's device arrays
and rounded once to the output's type: float64-accurate, which is what the tests compare
against. What it cannot show: cuDNN's own rounding, timings, and which engines a real GPU
offers.
"""

from __future__ import annotations

import enum

import ml_dtypes
import numpy

from ..cupy_standin import ndarray as _device_array
from ..cupy_standin.cuda import graph as _graph
from ..cupy_standin.cuda import runtime as _runtime

__version__ = "1.32.0+standin"

_BACKEND_VERSION = 91900  # the cuDNN the real frontend was measured with (9.19)


def backend_version() -> int:
    """The cuDNN library version, as an int (9.19.0 is 91900)."""
    return _BACKEND_VERSION


class data_type(enum.Enum):  # noqa: N801  (the real package's name)
    FLOAT = enum.auto()
    DOUBLE = enum.auto()
    HALF = enum.auto()
    BFLOAT16 = enum.auto()
    NOT_SET = enum.auto()


class diagonal_alignment(enum.Enum):  # noqa: N801
    TOP_LEFT = enum.auto()
    BOTTOM_RIGHT = enum.auto()


class heur_mode(enum.Enum):  # noqa: N801
    A = enum.auto()
    B = enum.auto()
    FALLBACK = enum.auto()


class numerical_note(enum.Enum):  # noqa: N801
    TENSOR_CORE = enum.auto()
    DOWN_CONVERT_INPUTS = enum.auto()
    REDUCED_PRECISION_REDUCTION = enum.auto()
    NONDETERMINISTIC = enum.auto()


class cudnnGraphNotSupportedError(Exception):  # noqa: N801, N818
    """The graph (or one of its settings) has no engine that can run it."""


_NUMPY_TYPES = {
    data_type.FLOAT: numpy.dtype(numpy.float32),
    data_type.DOUBLE: numpy.dtype(numpy.float64),
    data_type.HALF: numpy.dtype(numpy.float16),
    data_type.BFLOAT16: numpy.dtype(ml_dtypes.bfloat16),
}


# --- handles and streams --------------------------------------------------------------------


class Handle:
    """A cuDNN handle: bound to the device current when it was made, runs on one stream."""

    def __init__(self, device: int):
        self.device = device
        self.stream = 0  # a fresh handle runs on the default stream
        self.backend_handle = object()


def create_handle():
    """A handle on the current device (its stream: the default stream)."""
    return Handle(_runtime.getDevice())


def set_stream(handle, stream):
    """Makes ``handle`` run on ``stream`` (a stream pointer, an int)."""
    if not isinstance(handle, Handle):
        raise TypeError(
            f"cudnn.set_stream expects a cudnn.Handle (from cudnn.create_handle()), got {type(handle).__name__}"
        )
    if not isinstance(stream, int):
        raise TypeError(f"cudnn.set_stream expects a stream pointer (an int), got {type(stream).__name__}")
    handle.stream = stream


def get_stream(handle):
    """The stream pointer ``handle`` runs on."""
    if not isinstance(handle, Handle):
        raise TypeError(
            f"cudnn.get_stream expects a cudnn.Handle (from cudnn.create_handle()), got {type(handle).__name__}"
        )
    return handle.stream


# --- graphs ---------------------------------------------------------------------------------


class Tensor:
    """A tensor of a graph: dims, strides (in elements), type; virtual until set as an output."""

    def __init__(self, name, dim, stride, data_type, uid, is_virtual):
        self.name, self.uid, self.data_type, self.is_virtual = name, uid, data_type, is_virtual
        self.dim = list(dim) if dim is not None else None
        self.stride = list(stride) if stride is not None else None

    def set_output(self, value: bool) -> Tensor:
        self.is_virtual = not value
        return self

    def set_dim(self, dim) -> Tensor:
        self.dim = [int(d) for d in dim]
        return self

    def set_stride(self, stride) -> Tensor:
        self.stride = [int(s) for s in stride]
        return self

    def set_data_type(self, dtype) -> Tensor:
        self.data_type = dtype
        return self

    def get_dim(self):
        return list(self.dim or [])

    def get_stride(self):
        return list(self.stride or [])

    def get_uid(self):
        return self.uid

    def get_data_type(self):
        return self.data_type

    def get_name(self):
        return self.name


# The byte alignment every tensor descriptor declares (the frontend's default) and its buffers
# must have at execution: on an H200 a float32 matrix product whose weight was a view 40 bytes
# into a flat gradient bucket failed in cuBLASLt (CUDNN_STATUS_EXECUTION_FAILED_CUBLAS).
BYTE_ALIGNMENT = 16


class _Engine:
    def __init__(self, name, notes, tf32):
        self.name, self.notes, self.tf32 = name, frozenset(notes), tf32


_TENSOR_CORE = _Engine("tensor_core_tf32", {numerical_note.TENSOR_CORE}, tf32=True)
_TENSOR_CORE_HALF = _Engine("tensor_core_fp16", {numerical_note.TENSOR_CORE}, tf32=False)  # float16 as it is
_FULL = _Engine("full_precision", (), tf32=False)
# cuDNN's float32 matrix products: TF32 in every engine it offers (its cuBLASLt one too), none
# of them noted TENSOR_CORE, so deselecting that note leaves them all (measured on an H200,
# cuDNN 9.19 with frontend 1.32: 3-6e-4 relative error in each, float64 products exact).
_MATMUL_TF32 = _Engine("matmul_tf32", (), tf32=True)

# op -> (its tensor ports in positional order, its output port)
_CONV_OPS = {
    "conv_fprop": (("image", "weight"), "Y"),
    "conv_dgrad": (("loss", "filter"), "DX"),
    "conv_wgrad": (("image", "loss"), "DW"),
}
_CONV_ATTRS = ("padding", "pre_padding", "post_padding", "stride", "dilation", "convolution_mode")


class pygraph:  # noqa: N801
    """An operation graph: tensors and convolution nodes, built into a plan, then executed."""

    def __init__(
        self,
        name: str = "test_graph",
        io_data_type=None,
        intermediate_data_type=None,
        compute_data_type=None,
        handle=None,
        sm_count=None,
        sm_version=None,
        kernel_cache=None,
        device_property=None,
        is_dynamic_shape_enabled: bool = False,
        is_override_shape_enabled: bool = False,
        cuda_graph_retention=None,
        *,
        is_cuda_graph_replay_expected: bool = False,
        **kwargs,
    ):
        if kwargs or is_dynamic_shape_enabled or is_override_shape_enabled:
            raise NotImplementedError("cudnn stand-in: dynamic shapes and extra graph options are not in its subset")
        self.name, self._handle = name, handle
        self._io = io_data_type
        self._compute = compute_data_type or io_data_type
        self._tensors: list[Tensor] = []
        self._nodes: list[tuple] = []  # (op, {port: Tensor}, {attr: value}, [output Tensors], compute type)
        self._validated = self._graph_built = False
        self._plans: list[_Engine] | None = None
        self._barred: set = set()
        self._plan: _Engine | None = None

    def tensor(
        self,
        dim,
        stride=None,
        data_type=None,
        is_virtual: bool = False,
        is_pass_by_value: bool = False,
        ragged_offset=None,
        reordering_type=None,
        name: str = "",
        uid=None,
        ragged_offset_multiplier: int = 1,
        alignment_value: int = 1,
        **kwargs,
    ) -> Tensor:
        if is_pass_by_value or ragged_offset is not None or kwargs:
            raise NotImplementedError("cudnn stand-in: only plain device tensors are in its subset")
        dim = [int(d) for d in dim]
        stride = [int(s) for s in stride] if stride is not None else _row_major(dim)
        return self._add(name, dim, stride, _set(data_type) or self._io, uid, is_virtual)

    def _add(self, name, dim, stride, dtype, uid, is_virtual):
        uid = len(self._tensors) + 1 if uid is None or uid == -1 else uid
        t = Tensor(name or f"tensor_{len(self._tensors)}", dim, stride, dtype, uid, is_virtual)
        self._tensors.append(t)
        return t

    def _conv(self, op, args, name, compute_data_type, out_dims, kwargs):
        ports, out_port = _CONV_OPS[op]
        if len(args) > len(ports) + len(_CONV_ATTRS):
            raise TypeError(f"{op}() takes at most {len(ports) + len(_CONV_ATTRS)} positional arguments")
        inputs = dict(zip(ports, args[: len(ports)]))
        attrs = dict(zip(_CONV_ATTRS, args[len(ports) :]))
        for key, value in kwargs.items():
            if key in ports:
                inputs[key] = value
            elif key in _CONV_ATTRS:
                attrs[key] = value
            else:
                raise TypeError(
                    f"{op}() got an unexpected argument {key!r}; tensor ports are {ports}, attrs are {_CONV_ATTRS}"
                )
        if set(inputs) != set(ports) or not all(isinstance(t, Tensor) for t in inputs.values()):
            raise TypeError(f"{op}() needs the tensors {ports}, made by this graph's tensor()")
        out = self._add(f"{name or op}::{out_port}", out_dims, None, self._compute, None, True)
        if out.dim is not None:
            out.stride = _row_major(out.dim)
        self._nodes.append((op, inputs, attrs, [out], compute_data_type or self._compute))
        self._validated = self._graph_built = False
        return out

    def conv_fprop(self, *args, name: str = "", compute_data_type=None, out_dims=None, **kwargs):
        """conv_fprop(image, weight) -> Y: the cross-correlation of the image with the weight."""
        return self._conv("conv_fprop", args, name, compute_data_type, out_dims, kwargs)

    def conv_dgrad(self, *args, name: str = "", compute_data_type=None, out_dims=None, **kwargs):
        """conv_dgrad(loss, filter) -> DX: the gradient of conv_fprop's image (set DX's dims)."""
        return self._conv("conv_dgrad", args, name, compute_data_type, out_dims, kwargs)

    def conv_wgrad(self, *args, name: str = "", compute_data_type=None, out_dims=None, **kwargs):
        """conv_wgrad(image, loss) -> DW: the gradient of conv_fprop's weight (set DW's dims)."""
        return self._conv("conv_wgrad", args, name, compute_data_type, out_dims, kwargs)

    def matmul(self, A, B, compute_data_type=None, padding: float = 0.0, name: str = ""):  # noqa: N803
        """matmul(A, B) -> C = A @ B: batched ``[*batch, m, k] @ [*batch, k, n] -> [*batch, m, n]``
        (the last two dims are the matrices, all before them batch dims, a batch dim of 1
        broadcast), the operands' strides as declared (a transposed view is a stride)."""
        if not isinstance(A, Tensor) or not isinstance(B, Tensor):
            raise TypeError("matmul() needs the tensors A and B, made by this graph's tensor()")
        if padding:
            raise NotImplementedError("cudnn stand-in: matmul with padding is not in its subset")
        out = self._add(f"{name or 'matmul'}::C", None, None, self._compute, None, True)
        if A.dim is not None and B.dim is not None and len(A.dim) == len(B.dim) >= 3:
            out.dim = [max(a, b) for a, b in zip(A.dim[:-2], B.dim[:-2])] + [A.dim[-2], B.dim[-1]]
            out.stride = _row_major(out.dim)
        self._nodes.append(("matmul", {"A": A, "B": B}, {}, [out], compute_data_type or self._compute))
        self._validated = self._graph_built = False
        return out

    def sdpa(
        self,
        q,
        k,
        v,
        is_inference=None,
        attn_scale=None,
        bias=None,
        block_mask=None,
        use_alibi_mask: bool = False,
        use_padding_mask: bool = False,
        seq_len_q=None,
        seq_len_kv=None,
        use_causal_mask: bool = False,
        use_causal_mask_bottom_right: bool = False,
        sliding_window_length=None,
        diagonal_alignment=diagonal_alignment.TOP_LEFT,
        diagonal_band_left_bound=None,
        diagonal_band_right_bound=None,
        dropout=None,
        rng_dump=None,
        paged_attention_k_table=None,
        paged_attention_v_table=None,
        paged_attention_max_seq_len_kv=None,
        max_total_seq_len_q=None,
        max_total_seq_len_kv=None,
        compute_data_type=data_type.NOT_SET,
        name: str = "",
        score_mod=None,
        generate_stats=None,
        implementation=None,
        score_max=None,
        score_sum_exp=None,
        sink_token=None,
        unfuse_fma: bool = False,
        cu_seq_len_q=None,
        cu_seq_len_kv=None,
        stats_use_log2: bool = False,
    ):
        """sdpa(q, k, v, ...) -> [o, stats]: ``softmax(q @ k^T * attn_scale) @ v`` with the
        softmax statistics (each row's ``max + log(sum exp)``, float32) when
        ``generate_stats`` (training); stats is None otherwise. Exactly one of
        ``generate_stats`` and ``is_inference`` (deprecated) must be set, as in the frontend."""
        if (generate_stats is None) == (is_inference is None):
            raise RuntimeError("Exactly one of {generate_stats, is_inference} must be set (prefer generate_stats).")
        if generate_stats is None:
            generate_stats = not is_inference
        unsupported = {
            "bias": bias is not None,
            "block_mask": block_mask is not None,
            "use_alibi_mask": use_alibi_mask,
            "use_padding_mask": use_padding_mask or seq_len_q is not None or seq_len_kv is not None,
            "dropout": dropout is not None or rng_dump is not None,
            "paged attention": paged_attention_k_table is not None or paged_attention_v_table is not None,
            "ragged totals": max_total_seq_len_q is not None or max_total_seq_len_kv is not None,
            "score_mod": score_mod is not None,
            "score_max/score_sum_exp": score_max is not None or score_sum_exp is not None,
            "sink_token": sink_token is not None,
            "stats_use_log2": stats_use_log2,
            "cu_seq_len": cu_seq_len_q is not None or cu_seq_len_kv is not None,
        }
        causal = _causal_band(
            use_causal_mask,
            use_causal_mask_bottom_right,
            sliding_window_length,
            diagonal_alignment,
            diagonal_band_left_bound,
            diagonal_band_right_bound,
        )
        _refuse(unsupported, "sdpa")
        _check_tensors("sdpa", q=q, k=k, v=v)
        scale = _scale(attn_scale)
        o = self._add(f"{name or 'sdpa'}::O", None, None, self._io, None, True)
        if q.dim is not None and v.dim is not None and len(q.dim) == 4 and len(v.dim) == 4:
            o.dim = [q.dim[0], q.dim[1], q.dim[2], v.dim[3]]
        stats = None
        if generate_stats:
            stats = self._add(f"{name or 'sdpa'}::Stats", None, None, None, None, True)
            if q.dim is not None and len(q.dim) == 4:
                stats.dim = [q.dim[0], q.dim[1], q.dim[2], 1]
                stats.stride = _row_major(stats.dim)
        attrs = {"scale": scale, "causal": causal}
        compute = _set(compute_data_type) or self._compute
        self._nodes.append(("sdpa", {"q": q, "k": k, "v": v}, attrs, [o, stats], compute))
        self._validated = self._graph_built = False
        return [o, stats]

    def sdpa_backward(
        self,
        q,
        k,
        v,
        o,
        dO,  # noqa: N803
        stats,
        attn_scale=None,
        bias=None,
        dBias=None,  # noqa: N803
        use_alibi_mask: bool = False,
        use_padding_mask: bool = False,
        seq_len_q=None,
        seq_len_kv=None,
        max_total_seq_len_q=None,
        max_total_seq_len_kv=None,
        use_causal_mask: bool = False,
        use_causal_mask_bottom_right: bool = False,
        sliding_window_length=None,
        diagonal_alignment=diagonal_alignment.TOP_LEFT,
        diagonal_band_left_bound=None,
        diagonal_band_right_bound=None,
        dropout=None,
        rng_dump=None,
        use_deterministic_algorithm: bool = False,
        compute_data_type=data_type.NOT_SET,
        name: str = "",
        score_mod=None,
        score_mod_bprop=None,
        sink_token=None,
        dSink_token=None,  # noqa: N803
    ):
        """sdpa_backward(q, k, v, o, dO, stats, ...) -> [dQ, dK, dV], the probabilities
        recomputed from the forward's stats (FlashAttention-2's backward)."""
        unsupported = {
            "bias": bias is not None or dBias is not None,
            "use_alibi_mask": use_alibi_mask,
            "use_padding_mask": use_padding_mask or seq_len_q is not None or seq_len_kv is not None,
            "ragged totals": max_total_seq_len_q is not None or max_total_seq_len_kv is not None,
            "dropout": dropout is not None or rng_dump is not None,
            "score_mod": score_mod is not None or score_mod_bprop is not None,
            "sink_token": sink_token is not None or dSink_token is not None,
        }
        causal = _causal_band(
            use_causal_mask,
            use_causal_mask_bottom_right,
            sliding_window_length,
            diagonal_alignment,
            diagonal_band_left_bound,
            diagonal_band_right_bound,
        )
        _refuse(unsupported, "sdpa_backward")
        _check_tensors("sdpa_backward", q=q, k=k, v=v, o=o, dO=dO, stats=stats)
        prefix = name or "sdpa_backward"
        grads = [
            self._add(f"{prefix}::{port}", t.dim, None, self._io, None, True)
            for port, t in (("dQ", q), ("dK", k), ("dV", v))
        ]
        attrs = {"scale": _scale(attn_scale), "causal": causal, "deterministic": use_deterministic_algorithm}
        compute = _set(compute_data_type) or self._compute
        inputs = {"q": q, "k": k, "v": v, "o": o, "dO": dO, "stats": stats}
        self._nodes.append(("sdpa_backward", inputs, attrs, grads, compute))
        self._validated = self._graph_built = False
        return grads

    def _validate_sdpa(self, op, inputs, attrs, outs) -> None:
        """cuDNN's support surface for SDPA (as of 9.19): float16/bfloat16 q, k, v, o and
        gradients, float32 stats and compute, a head dim that is a multiple of 8 and at most
        256 forward, 128 backward; the subset here also wants as many key/value heads as query heads."""
        real = [t for t in list(inputs.values()) + outs if t is not None]
        for t in real:
            if not t.dim or len(t.dim) != 4 or not t.stride or len(t.stride) != 4:
                raise ValueError(f"cudnn: {op} tensor {t.name!r} needs 4 dims and strides [b, h, s, d]")
            if t.data_type not in _NUMPY_TYPES:
                raise cudnnGraphNotSupportedError(f"cudnn stand-in: tensor {t.name!r} has data type {t.data_type}")
        for t in outs:
            if t is not None and t.is_virtual:
                raise ValueError(f"cudnn: the graph's output {t.name!r} is virtual: call set_output(True)")
        stats = inputs.get("stats") if op == "sdpa_backward" else outs[1]
        halves = [t for t in real if t is not stats]
        if any(t.data_type not in (data_type.HALF, data_type.BFLOAT16) for t in halves) or (
            stats is not None and stats.data_type != data_type.FLOAT
        ):
            raise cudnnGraphNotSupportedError(
                f"cudnn: {op} supports float16 and bfloat16 q, k, v, o (and float32 stats) only, got "
                + ", ".join(f"{t.name}: {t.data_type.name}" for t in real)
            )
        if self._nodes[0][4] != data_type.FLOAT:
            raise cudnnGraphNotSupportedError(f"cudnn: {op} computes in float32 (compute_data_type FLOAT)")
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        b, h, l_, d = q.dim
        limit = 256 if op == "sdpa" else 128
        if d % 8 or d > limit or v.dim[3] % 8 or v.dim[3] > limit:
            raise cudnnGraphNotSupportedError(
                f"cudnn: {op} needs head dims that are multiples of 8 and at most {limit}, got {d} and {v.dim[3]}"
            )
        if k.dim[:2] != [b, h] or v.dim[:3] != k.dim[:3] or k.dim[3] != d:
            raise cudnnGraphNotSupportedError(f"cudnn: {op}: q {q.dim}, k {k.dim}, v {v.dim} do not form attention")
        expect = {"sdpa": [[b, h, l_, v.dim[3]], [b, h, l_, 1]]}.get(op, [q.dim, k.dim, v.dim])
        if op == "sdpa_backward":
            if inputs["o"].dim != [b, h, l_, v.dim[3]] or inputs["dO"].dim != inputs["o"].dim:
                raise cudnnGraphNotSupportedError(f"cudnn: {op}: o and dO must be {[b, h, l_, v.dim[3]]}")
            if inputs["stats"].dim != [b, h, l_, 1]:
                raise cudnnGraphNotSupportedError(f"cudnn: {op}: stats must be {[b, h, l_, 1]}")
        for t, want in zip(outs, expect):
            if t is not None and t.dim != want:
                raise cudnnGraphNotSupportedError(f"cudnn: {op}: output {t.name!r} is {t.dim}, expected {want}")
        self._validated = True

    # --- building ---

    def validate(self) -> None:
        if len(self._nodes) != 1:
            raise NotImplementedError(
                "cudnn stand-in: a graph of exactly one convolution, matmul or sdpa node is its subset"
            )
        op, inputs, attrs, outs, _ = self._nodes[0]
        out = outs[0]
        if op == "matmul":
            self._validate_matmul(inputs, out)
            return
        if op in _SDPA_OPS:
            self._validate_sdpa(op, inputs, attrs, outs)
            return
        _check_operands(
            list(inputs.values()), out, 4, "tensor {!r} needs 4 dims and strides (set_dim on a dgrad/wgrad output)"
        )
        for key in ("pre_padding", "post_padding", "convolution_mode"):
            if attrs.get(key) is not None:
                raise NotImplementedError(f"cudnn stand-in: {key} is not in its subset (use padding)")
        if list(attrs.get("dilation") or [1, 1]) != [1, 1]:
            raise NotImplementedError("cudnn stand-in: dilation other than 1 is not in its subset")
        x, w, y = _shapes(op, inputs, out)
        pad, stride = _pair(attrs.get("padding"), 0), _pair(attrs.get("stride"), 1)
        expect = [x[0], w[0]] + [(x[2 + k] + 2 * pad[k] - w[2 + k]) // stride[k] + 1 for k in range(2)]
        if x[1] != w[1] or list(y) != expect:
            raise cudnnGraphNotSupportedError(
                f"cudnn: {op}: image {x}, filter {w} and output {y} do not form a convolution "
                f"with padding {pad} and stride {stride}"
            )
        self._validated = True

    def _validate_matmul(self, inputs, out) -> None:
        a, b = inputs["A"], inputs["B"]
        ndim = len(a.dim or [])
        _check_operands(
            [a, b], out, max(ndim, 3), "matmul tensor {!r} needs >= 3 dims and strides [*batch, rows, columns]"
        )
        batch = [max(x, y) for x, y in zip(a.dim[:-2], b.dim[:-2])]
        broadcast_ok = all({x, y} <= {1, n} for x, y, n in zip(a.dim[:-2], b.dim[:-2], batch))
        if a.dim[-1] != b.dim[-2] or not broadcast_ok or out.dim != batch + [a.dim[-2], b.dim[-1]]:
            raise cudnnGraphNotSupportedError(f"cudnn: matmul of {a.dim} and {b.dim} into {out.dim}")
        self._validated = True

    def build_operation_graph(self) -> None:
        if not self._validated:
            self.validate()
        self._graph_built = True

    def create_execution_plans(self, heuristics=None) -> None:
        if not self._graph_built:
            raise RuntimeError("cudnn: call build_operation_graph() before create_execution_plans()")
        modes = list(heuristics) if heuristics is not None else [heur_mode.A]
        if any(not isinstance(m, heur_mode) for m in modes):
            raise TypeError(f"cudnn: heuristics must be heur_mode values, got {modes!r}")
        plans = []
        tf32_possible = self._io == data_type.FLOAT and self._nodes[0][4] == data_type.FLOAT
        if tf32_possible and self._nodes[0][0] == "matmul":
            self._plans, self._barred, self._plan = [_MATMUL_TF32], set(), None
            return
        tensor_core = _TENSOR_CORE if tf32_possible else _TENSOR_CORE_HALF if self._io == data_type.HALF else None
        for mode in modes:
            ranked = [tensor_core, _FULL] if mode is not heur_mode.FALLBACK and tensor_core else [_FULL]
            plans += [e for e in ranked if e not in plans]
        self._plans, self._barred, self._plan = plans, set(), None

    def deselect_numeric_notes(self, notes) -> pygraph:
        if self._plans is None:
            raise RuntimeError("cudnn stand-in: call create_execution_plans() before deselecting engines")
        notes = set(notes)
        self._barred |= {e for e in self._plans if e.notes & notes}
        return self

    def check_support(self) -> None:
        if self._plans is None:
            raise RuntimeError("cudnn: call create_execution_plans() before check_support()")
        if not [e for e in self._plans if e not in self._barred]:
            raise cudnnGraphNotSupportedError("cudnn: no engine left for the graph after the deselections")

    def build_plans(self, *args, ctx=None, **kwargs) -> None:
        self.check_support()
        self._plan = next(e for e in self._plans if e not in self._barred)

    def build(self, heuristics=None, ctx=None) -> None:
        if not self._validated:
            self.validate()
        self.build_operation_graph()
        if self._plans is None:
            self.create_execution_plans(heuristics)
        self.check_support()
        self.build_plans(ctx=ctx)

    def get_workspace_size(self, handle=None, override_uids=None, override_shapes=None, override_strides=None) -> int:
        """Bytes of workspace the selected plan needs: its engines accumulate the output in
        the compute type there."""
        if self._plan is None:
            raise RuntimeError("Call build() first")
        op, inputs, _, outs, compute = self._nodes[0]
        if op == "sdpa":
            return 0
        if op == "sdpa_backward":  # FlashAttention-2's backward accumulates dQ in float32
            return int(numpy.prod(inputs["q"].dim)) * 4
        return int(numpy.prod(outs[0].dim)) * _NUMPY_TYPES[compute].itemsize

    # --- running ---

    def execute(
        self,
        tensor_dict,
        workspace=None,
        handle=None,
        override_uids=None,
        override_shapes=None,
        override_strides=None,
        tensor_uids=None,
    ) -> None:
        """Runs the selected plan on the bound buffers: writes the output in place."""
        if override_uids is not None or override_shapes is not None or override_strides is not None:
            raise NotImplementedError("cudnn stand-in: shape overrides are not in its subset")
        if tensor_uids is not None:
            raise NotImplementedError("cudnn stand-in: ordered execution is not in its subset")
        if self._plan is None:
            self.build()
        handle = handle if handle is not None else self._handle
        device = handle.device if handle is not None else _runtime.getDevice()
        bound = self._bind(tensor_dict, device)
        size = self.get_workspace_size()
        if size:
            if not isinstance(workspace, _device_array) or workspace.nbytes < size:
                got = getattr(workspace, "nbytes", None)
                raise RuntimeError(f"cudnn: the plan needs a device workspace of {size} bytes, got {got}")
            _check_device(workspace, device, "the workspace")
        op, inputs, attrs, outs, _ = self._nodes[0]
        if op in _SDPA_OPS:
            operands = [bound[t.uid] for t in inputs.values()]
            results = [bound[t.uid] for t in outs if t is not None]

            def sdpa_kernel():
                _SDPA_OPS[op](operands, results, attrs)

            _graph.launch_on(handle.stream if handle is not None else 0, "cudnn", sdpa_kernel, [*operands, *results])
            return
        out = outs[0]
        pad, stride = _pair(attrs.get("padding"), 0), _pair(attrs.get("stride"), 1)
        tf32, operands, result = self._plan.tf32, [bound[t.uid] for t in inputs.values()], bound[out.uid]

        def kernel():
            if op == "matmul":
                values = numpy.matmul(*(_host(a, tf32) for a in operands))
            else:
                values = _COMPUTE[op](*(_host(a, tf32) for a in operands), out.dim, pad, stride)
            numpy.copyto(result._a, values, casting="unsafe")

        # on the handle's stream: recorded, not run, while that stream captures a graph
        _graph.launch_on(handle.stream if handle is not None else 0, "cudnn", kernel, [*operands, result])

    def _bind(self, tensor_dict, device):
        by_name = {t.name: t for t in self._tensors}
        by_uid = {t.uid: t for t in self._tensors}
        bound = {}
        for key, array in tensor_dict.items():
            t = key if isinstance(key, Tensor) else by_name.get(key) if isinstance(key, str) else by_uid.get(key)
            if t is None or t not in self._tensors:
                raise KeyError(f"cudnn: {key!r} is not a tensor of this graph")
            if not isinstance(array, _device_array):
                raise TypeError(
                    f"cudnn stand-in: tensor {t.name!r} is bound to {type(array).__name__}, not a device array"
                )
            _check_device(array, device, f"tensor {t.name!r}")
            strides = [s // array.itemsize for s in array.strides]
            if list(array.shape) != t.dim or strides != t.stride or array.dtype != _NUMPY_TYPES[t.data_type]:
                raise ValueError(
                    f"cudnn: tensor {t.name!r} is declared {t.dim} strides {t.stride} {t.data_type.name}, but its "
                    f"buffer is {list(array.shape)} strides {strides} {array.dtype}: the backend reads the declaration"
                )
            if array.data.ptr % BYTE_ALIGNMENT:
                raise RuntimeError(
                    f"execute(handle, plan->get_raw_desc(), variant_pack_descriptor.get_ptr()) failed with "
                    f"message: tensor {t.name!r}'s buffer is {array.data.ptr % BYTE_ALIGNMENT} bytes off the "
                    f"{BYTE_ALIGNMENT}-byte alignment its descriptor declares, and code: CUDNN_STATUS_EXECUTION_FAILED"
                )
            bound[t.uid] = array
        op, inputs, attrs, outs, _ = self._nodes[0]
        for t in list(inputs.values()) + [t for t in outs if t is not None]:
            if t.uid not in bound:
                raise ValueError(f"cudnn: no buffer for tensor {t.name!r}")
        return bound


# --- helpers and the float64 computation ---------------------------------------------------------


def _refuse(unsupported: dict, op: str) -> None:
    used = [name for name, on in unsupported.items() if on]
    if used:
        raise NotImplementedError(f"cudnn stand-in: {op} with {', '.join(used)} is not in its subset")


def _check_tensors(op, **tensors) -> None:
    for port, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}() needs the tensor {port}, made by this graph's tensor()")


def _scale(attn_scale) -> float:
    if attn_scale is None:
        return 1.0  # the frontend's default: no scaling
    if isinstance(attn_scale, float):
        return attn_scale
    raise NotImplementedError("cudnn stand-in: attn_scale as a tensor is not in its subset (pass a float)")


def _causal_band(use_causal, use_bottom_right, sliding_window, alignment, left, right) -> bool:
    """Whether the masking arguments ask for a top-left causal mask (the subset: that or none),
    with the frontend's own errors for contradictory ones."""
    if use_causal and use_bottom_right:
        raise RuntimeError("use_causal_mask and use_causal_mask_bottom_right cannot both be true")
    if use_causal and right is not None:
        raise RuntimeError("use_causal_mask and diagonal_band_right_bound cannot be set at the same time")
    if sliding_window is not None and left is not None:
        raise RuntimeError("sliding window and left_bound cannot be set at the same time")
    if use_bottom_right or sliding_window is not None or left is not None or alignment != diagonal_alignment.TOP_LEFT:
        raise NotImplementedError("cudnn stand-in: only a top-left causal mask (or none) is in its subset")
    if right is not None and right != 0:
        raise NotImplementedError("cudnn stand-in: diagonal_band_right_bound other than 0 is not in its subset")
    return bool(use_causal or right == 0)


def _attention_probs(q, k, scale, causal):
    """float64 scores of (b, h, l, d) q and (b, h, s, d) k, scaled and masked, and each row's log-sum-exp."""
    s = numpy.matmul(q, numpy.swapaxes(k, -1, -2)) * scale
    if causal:
        s = numpy.where(numpy.arange(s.shape[-1])[None, :] <= numpy.arange(s.shape[-2])[:, None], s, -numpy.inf)
    m = s.max(axis=-1, keepdims=True)
    return s, m + numpy.log(numpy.exp(s - m).sum(axis=-1, keepdims=True))


def _sdpa(operands, results, attrs):
    q, k, v = (a._a.astype(numpy.float64) for a in operands)
    s, lse = _attention_probs(q, k, attrs["scale"], attrs["causal"])
    numpy.copyto(results[0]._a, numpy.matmul(numpy.exp(s - lse), v), casting="unsafe")
    if len(results) > 1:
        numpy.copyto(results[1]._a, lse, casting="unsafe")


def _sdpa_backward(operands, results, attrs):
    q, k, v, o, do = (a._a.astype(numpy.float64) for a in operands[:5])
    lse = operands[5]._a.astype(numpy.float64)
    scale = attrs["scale"]
    s, _ = _attention_probs(q, k, scale, attrs["causal"])
    p = numpy.exp(s - lse)  # from the forward's statistics, as FlashAttention-2 recomputes them
    dv = numpy.matmul(numpy.swapaxes(p, -1, -2), do)
    dp = numpy.matmul(do, numpy.swapaxes(v, -1, -2))
    ds = p * (dp - (do * o).sum(axis=-1, keepdims=True))
    for out, value in zip(
        results, (numpy.matmul(ds, k) * scale, numpy.matmul(numpy.swapaxes(ds, -1, -2), q) * scale, dv)
    ):
        numpy.copyto(out._a, value, casting="unsafe")


_SDPA_OPS = {"sdpa": _sdpa, "sdpa_backward": _sdpa_backward}


def _set(dt):
    return None if dt is None or dt == data_type.NOT_SET else dt


def _check_operands(inputs, out, ndim: int, needs: str) -> None:
    """What cuDNN checks of a node's tensors: ``ndim`` dims and strides each (else
    ``needs``, formatted with the name), a data type, and an output that is not virtual."""
    for t in inputs + [out]:
        if not t.dim or len(t.dim) != ndim or len(t.stride) != ndim:
            raise ValueError("cudnn: " + needs.format(t.name))
        if t.data_type is None or t.data_type not in _NUMPY_TYPES:
            raise cudnnGraphNotSupportedError(f"cudnn stand-in: tensor {t.name!r} has data type {t.data_type}")
    if out.is_virtual:
        raise ValueError(f"cudnn: the graph's output {out.name!r} is virtual: call set_output(True)")


def _row_major(dim):
    stride, out = 1, []
    for d in reversed(dim):
        out.append(stride)
        stride *= d
    return out[::-1]


def _pair(value, default):
    if value is None:
        return (default, default)
    value = list(value)
    if len(value) != 2:
        raise NotImplementedError("cudnn stand-in: 2-D convolutions are its subset")
    return int(value[0]), int(value[1])


def _shapes(op, inputs, out):
    """(image, filter, output) dims of the convolution a node computes or differentiates."""
    if op == "conv_fprop":
        return inputs["image"].dim, inputs["weight"].dim, out.dim
    if op == "conv_dgrad":
        return out.dim, inputs["filter"].dim, inputs["loss"].dim
    return inputs["image"].dim, out.dim, inputs["loss"].dim


def _check_device(array, device, what):
    if array.device.id != device:
        raise ValueError(f"cudnn: {what} is on device {array.device.id}, the handle's device is {device}")


def _host(array, tf32):
    """The operand in float64 (after TF32 rounding when the engine runs TF32 math)."""
    a = array._a
    if tf32 and a.dtype == numpy.float32:
        # TF32 keeps 10 of float32's 23 mantissa bits, rounding to nearest
        bits = numpy.ascontiguousarray(a).view(numpy.uint32)
        a = ((bits + numpy.uint32(0x1000)) & numpy.uint32(0xFFFFE000)).view(numpy.float32)
    return a.astype(numpy.float64)


def _windows(x, kernel, pad, stride, out_hw):
    """(N, C, Ho, Wo, kh, kw) windows of x zero-padded."""
    xp_ = numpy.pad(x, ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    view = numpy.lib.stride_tricks.sliding_window_view(xp_, kernel, axis=(2, 3))
    return view[:, :, :: stride[0], :: stride[1]][:, :, : out_hw[0], : out_hw[1]]


def _fprop(x, w, y_dim, pad, stride):
    win = _windows(x, w.shape[2:], pad, stride, y_dim[2:])
    return numpy.einsum("nchwij,ocij->nohw", win, w, optimize=True)


def _wgrad(x, dy, w_dim, pad, stride):
    win = _windows(x, tuple(w_dim[2:]), pad, stride, dy.shape[2:])
    return numpy.einsum("nchwij,nohw->ocij", win, dy, optimize=True)


def _dgrad(dy, w, x_dim, pad, stride):
    n, c, h, wd = x_dim
    kh, kw = w.shape[2:]
    ho, wo = dy.shape[2:]
    cols = numpy.einsum("nohw,ocij->ncijhw", dy, w, optimize=True)
    dxp = numpy.zeros((n, c, h + 2 * pad[0] + stride[0], wd + 2 * pad[1] + stride[1]))
    for i in range(kh):
        for j in range(kw):
            dxp[:, :, i : i + stride[0] * ho : stride[0], j : j + stride[1] * wo : stride[1]] += cols[:, :, i, j]
    return dxp[:, :, pad[0] : pad[0] + h, pad[1] : pad[1] + wd]


_COMPUTE = {"conv_fprop": _fprop, "conv_dgrad": _dgrad, "conv_wgrad": _wgrad}
