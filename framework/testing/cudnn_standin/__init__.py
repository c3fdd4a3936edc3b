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
``matmul`` (batched, 3-D operands, strides as declared), the build steps,
``get_workspace_size`` and ``execute``. What it does beyond that subset raises
(NotImplementedError or the frontend's own error), never silently differs.

How it behaves like the real one, and what it checks that the real one would get wrong
silently or crash on:

- a graph computes nothing until it is built; ``execute`` builds it when it was not (as
  the real one does), binds buffers by :class:`Tensor`, name or uid, and refuses a buffer
  whose shape, strides (the backend reads the declared ones) or dtype differ from its
  tensor's, a buffer on another device than the handle's, a missing operand and a
  workspace smaller than ``get_workspace_size()``;
- the plans: for float32 input and output, heuristics rank a tensor-core engine first
  (TF32 math: inputs rounded to 10 mantissa bits, as cuDNN does on Ampere and later GPUs
  unless the graph deselects ``numerical_note.TENSOR_CORE``), then a full-precision one;
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


class _Engine:
    def __init__(self, name, notes, tf32):
        self.name, self.notes, self.tf32 = name, frozenset(notes), tf32


_TENSOR_CORE = _Engine("tensor_core_tf32", {numerical_note.TENSOR_CORE}, tf32=True)
_TENSOR_CORE_HALF = _Engine("tensor_core_fp16", {numerical_note.TENSOR_CORE}, tf32=False)  # float16 as it is
_FULL = _Engine("full_precision", (), tf32=False)

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
        self._nodes: list[tuple] = []  # (op, {port: Tensor}, {attr: value}, output Tensor)
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
        self._nodes.append((op, inputs, attrs, out, compute_data_type or self._compute))
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
        """matmul(A, B) -> C = A @ B: batched ``[b, m, k] @ [b, k, n] -> [b, m, n]`` (a batch of
        1 broadcast), the operands' strides as declared (a transposed view is a stride)."""
        if not isinstance(A, Tensor) or not isinstance(B, Tensor):
            raise TypeError("matmul() needs the tensors A and B, made by this graph's tensor()")
        if padding:
            raise NotImplementedError("cudnn stand-in: matmul with padding is not in its subset")
        out = self._add(f"{name or 'matmul'}::C", None, None, self._compute, None, True)
        if A.dim is not None and B.dim is not None and len(A.dim) == 3 and len(B.dim) == 3:
            out.dim = [max(A.dim[0], B.dim[0]), A.dim[1], B.dim[2]]
            out.stride = _row_major(out.dim)
        self._nodes.append(("matmul", {"A": A, "B": B}, {}, out, compute_data_type or self._compute))
        self._validated = self._graph_built = False
        return out

    # --- building ---

    def validate(self) -> None:
        if len(self._nodes) != 1:
            raise NotImplementedError("cudnn stand-in: a graph of exactly one convolution or matmul is its subset")
        op, inputs, attrs, out, _ = self._nodes[0]
        if op == "matmul":
            self._validate_matmul(inputs, out)
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
        _check_operands([a, b], out, 3, "matmul tensor {!r} needs 3 dims and strides [batch, rows, columns]")
        batch = max(a.dim[0], b.dim[0])
        if a.dim[2] != b.dim[1] or {a.dim[0], b.dim[0]} - {1, batch} or out.dim != [batch, a.dim[1], b.dim[2]]:
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
        out, compute = self._nodes[0][3], self._nodes[0][4]
        return int(numpy.prod(out.dim)) * _NUMPY_TYPES[compute].itemsize

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
        op, inputs, attrs, out, _ = self._nodes[0]
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
            bound[t.uid] = array
        op, inputs, attrs, out, _ = self._nodes[0]
        for t in list(inputs.values()) + [out]:
            if t.uid not in bound:
                raise ValueError(f"cudnn: no buffer for tensor {t.name!r}")
        return bound


# --- helpers and the float64 computation ---------------------------------------------------------


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
