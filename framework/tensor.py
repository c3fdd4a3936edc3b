"""Tensor: an array (possibly a view) + a version counter shared with its storage + autograd fields.

A tensor's values live in ``_data``, a NumPy or CuPy array. A view op returns a tensor
whose array is a view of its input's array (the array module keeps shape, strides and
offset), which shares the input's :class:`VersionCounter` and remembers its root
``_base``. Inplace ops write into ``_data`` and bump the version. Autograd fields follow
PyTorch's names: ``requires_grad``, ``grad``, ``grad_fn``, ``is_leaf``, ``_version``.
"""

from __future__ import annotations

import weakref

import numpy as np

from . import backend, memory
from .autograd import engine
from .autograd import node as _node
from .autograd.grad_mode import InferenceVersionCounter, no_grad, state
from .autograd.node import VersionCounter as _VersionCounter
from .autograd.node import _HookHandle
from .autograd.view_meta import UntrackedView, rebase_message
from .inplace.consumed import ConsumedData
from .inplace.proof import passes_ownership as _hands_over

_FLOAT_KINDS = ("f",)


def _is_float(dtype) -> bool:
    dtype = np.dtype(dtype)
    return dtype.kind in _FLOAT_KINDS or dtype.name == "bfloat16"  # ml_dtypes' kind is "V"


class Tensor:
    """An n-dimensional array with autograd. Create one with :func:`framework.tensor`."""

    __slots__ = (
        "_data",
        "_vc",
        "_requires_grad",
        "_grad_fn",
        "_grad",
        "_base",
        "_view_fn",
        "_view_base_fn",
        "_retains_grad",
        "_hooks",
        "_post_acc_hooks",
        "__weakref__",
    )
    __hash__ = object.__hash__  # == is elementwise, so hash by identity as PyTorch does
    __array_priority__ = 1000  # numpy scalars and arrays defer to our reflected operators

    # --- identity and metadata -------------------------------------------------------
    @property
    def shape(self) -> tuple:
        return self._data.shape

    @property
    def dtype(self):
        return self._data.dtype

    @property
    def ndim(self) -> int:
        return self._data.ndim

    @property
    def device(self) -> backend.Device:
        return backend.device_of(self._data)

    @property
    def xp(self):
        """The array module of this tensor (NumPy or CuPy)."""
        return backend.get_array_module(self._data)

    def dim(self) -> int:
        return self._data.ndim

    def numel(self) -> int:
        return int(self._data.size)

    def size(self, dim: int | None = None):
        return self._data.shape if dim is None else self._data.shape[dim]

    def element_size(self) -> int:
        return self._data.itemsize

    @property
    def nbytes(self) -> int:
        return self._data.nbytes

    def stride(self, dim: int | None = None):
        """Strides in elements, as PyTorch reports them."""
        s = tuple(b // self._data.itemsize for b in self._data.strides)
        return s if dim is None else s[dim]

    def is_contiguous(self) -> bool:
        return bool(self._data.flags.c_contiguous)

    def __len__(self) -> int:
        if self._data.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return self._data.shape[0]

    # --- conversion ------------------------------------------------------------------
    def _live(self):
        """The array, after checking that no inplace site consumed this tensor."""
        data = self._data
        if type(data) is ConsumedData:
            raise data.error()
        return data

    def numpy(self) -> np.ndarray:
        """The values as a NumPy array (shares memory on the CPU, like PyTorch).

        As in PyTorch, refused for a tensor that requires grad while grad mode is on.
        """
        data = self._live()
        if state.enabled and self.requires_grad:
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")
        return backend.to_numpy(data)

    def item(self):
        data = self._live()
        if data.size != 1:
            raise RuntimeError(f"a Tensor with {data.size} elements cannot be converted to a Python scalar")
        return data.reshape(()).item()

    def tolist(self):
        return backend.to_numpy(self._live()).tolist()

    def __float__(self):
        return float(self.item())

    def __int__(self):
        return int(self.item())

    def __bool__(self):
        if self._data.size != 1:
            raise RuntimeError("Boolean value of a Tensor with more than one value is ambiguous")
        return bool(self.item())

    def __index__(self):
        if self._data.dtype.kind not in "iub" or self._data.size != 1:
            raise TypeError("only integer tensors of a single element can be converted to an index")
        return int(self.item())

    def __array__(self, dtype=None, copy=None):
        return _numpy_array(self, dtype, copy)

    def to(self, device=None, dtype=None) -> Tensor:
        """A copy on another device and/or dtype (``self`` when nothing changes).

        The copy is recorded by autograd, so gradients flow back to the original.
        """
        if isinstance(device, (np.dtype, type)) and dtype is None:
            device, dtype = None, device
        out = self
        if dtype is not None and np.dtype(dtype) != self.dtype:
            out = _ops.cast(out, dtype)
        if device is not None and backend.device(device) != self.device:
            out = _ops.to_device(out, backend.device(device))
        return out

    def cpu(self) -> Tensor:
        return self.to("cpu")

    def cuda(self, index: int = 0) -> Tensor:
        return self.to(f"cuda:{index}")

    def float(self) -> Tensor:
        return self.to(dtype=np.float32)

    def double(self) -> Tensor:
        return self.to(dtype=np.float64)

    def half(self) -> Tensor:
        return self.to(dtype=np.float16)

    def bfloat16(self) -> Tensor:
        """A bfloat16 copy (needs the ``ml_dtypes`` package, as CuPy's bfloat16 does)."""
        return self.to(dtype=_ops.promotion.bfloat16)

    def long(self) -> Tensor:
        return self.to(dtype=np.int64)

    def bool(self) -> Tensor:
        return self.to(dtype=np.bool_)

    def type_as(self, other: Tensor) -> Tensor:
        return self.to(dtype=other.dtype)

    # --- autograd attributes ----------------------------------------------------------
    @property
    def grad_fn(self):
        base = self._base
        if base is not None and self._view_fn is not None:
            view_fn = self._view_fn
            if view_fn.__class__ is UntrackedView:
                # Made without history and written since (through itself, its base or
                # another view): which history it should have is ambiguous, and PyTorch
                # refuses to guess while the base requires grad.
                if view_fn.stale(self) and base.requires_grad:
                    fn = self._grad_fn
                    name, nr = view_fn.describe(fn.name() if fn is not None else None)
                    raise RuntimeError(rebase_message(view_fn.creation, name, nr, indirect=True))
                return self._grad_fn
            base_fn = base._grad_fn
            if base_fn is not self._view_base_fn and base_fn is not None:
                # The base's history changed (an inplace op on it or on another view of
                # it): replay the view chain on the base to get this view's current
                # history. (A base detached in place keeps its views' history, as in
                # PyTorch: detach_ does not write.)
                with _enable_grad_quiet():
                    fresh = self._view_fn(base)
                self._grad_fn = fresh._grad_fn
                self._view_base_fn = base_fn
        return self._grad_fn

    @property
    def requires_grad(self) -> bool:
        """True for leaves marked so, tensors with history, and (as in PyTorch) every
        view of a tensor that requires grad, even one made under ``no_grad``. (A view
        of an inference tensor is not a view for autograd, as in PyTorch.)"""
        if self._requires_grad or self._grad_fn is not None:
            return True
        base = self._base
        return base is not None and base.requires_grad and self._vc.__class__ is not InferenceVersionCounter

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        if self.grad_fn is not None:
            raise RuntimeError(
                "you can only change requires_grad flags of leaf variables. If you want to use a "
                "computed variable in a subgraph that doesn't require differentiation use "
                "var_no_grad = var.detach()."
            )
        if value and not _is_float(self.dtype):
            raise RuntimeError(f"only Tensors of floating point dtype can require gradients (got {self.dtype})")
        self._requires_grad = bool(value)

    def requires_grad_(self, requires_grad: bool = True) -> Tensor:
        if requires_grad and self.grad_fn is not None:
            return self  # a no-op on a non-leaf, as in PyTorch (only the setter raises)
        self.requires_grad = requires_grad
        return self

    @property
    def is_leaf(self) -> bool:
        return self.grad_fn is None

    @property
    def grad(self):
        """The accumulated gradient (leaves, and non-leaves that called ``retain_grad``)."""
        return self._grad

    @grad.setter
    def grad(self, value) -> None:
        if value is not None:
            if not isinstance(value, Tensor):
                raise TypeError(f"assigned grad must be a Tensor or None, got {type(value).__name__}")
            if value.shape != self.shape:
                raise RuntimeError(f"assigned grad has shape {value.shape}, but the tensor has shape {self.shape}")
            if value.dtype != self.dtype:
                raise RuntimeError(f"assigned grad has dtype {value.dtype}, but the tensor has dtype {self.dtype}")
        self._grad = value

    @property
    def _version(self) -> int:
        vc = self._vc
        if vc.__class__ is InferenceVersionCounter:
            raise RuntimeError("Inference tensors do not track version counter.")
        return vc.value

    def is_inference(self) -> bool:
        """True for a tensor made inside ``inference_mode()`` (see :class:`framework.inference_mode`)."""
        return self._vc.__class__ is InferenceVersionCounter

    @property
    def retains_grad(self) -> bool:
        return self._retains_grad

    def retain_grad(self) -> None:
        """Keeps the gradient of a non-leaf tensor in ``.grad`` after backward.

        As in PyTorch, ``.grad`` is the gradient of the tensor's LATEST value: after an
        inplace op (on the tensor or through a view of it) the hook follows the tensor
        to its new history (see :func:`_follow_retained_grads`).
        """
        if not self.requires_grad:
            raise RuntimeError("can't retain_grad on Tensor that has requires_grad=False")
        if self.is_leaf or self._retains_grad:
            return
        self._retains_grad = True
        ref = weakref.ref(self)

        def keep(grad_array):
            t = ref()
            if t is not None and grad_array.__class__ is Tensor:  # create_graph: with history
                t._grad = grad_array.clone() if t._grad is None else t._grad + grad_array
            elif t is not None:
                g = _wrap(grad_array.copy())
                memory.track(g._data, "gradients")
                if t._grad is None:
                    t._grad = g
                else:
                    t._grad = _wrap(t._grad._data + grad_array)

        keep.retains_grad = True
        node = self.grad_fn
        _attach_retain_hook(node, keep)
        _retained[self] = [keep, weakref.ref(node)]

    def register_hook(self, hook):
        """``hook(grad) -> Tensor | None`` runs when this tensor's gradient is computed.

        A returned tensor replaces the gradient. Returns a handle with ``remove()``.
        """
        if not self.requires_grad:
            raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")
        if self.grad_fn is None:
            if self._hooks is None:
                self._hooks = []
            self._hooks.append(hook)
            return _HookHandle(self._hooks, hook)

        def on_array(grad_array):
            if grad_array.__class__ is Tensor:  # create_graph: gradients are tensors with history
                return hook(grad_array)
            r = hook(_wrap(grad_array))
            return None if r is None else r._data

        node = self.grad_fn
        handle = node.register_prehook(on_array)
        _retain_hook_last(node)
        return handle

    def register_post_accumulate_grad_hook(self, hook):
        """``hook(tensor)`` runs after a leaf's ``.grad`` was accumulated (used by DataParallel)."""
        if self.grad_fn is not None:
            raise RuntimeError("post accumulate grad hooks cannot be registered on non-leaf tensors")
        if self._post_acc_hooks is None:
            self._post_acc_hooks = []
        self._post_acc_hooks.append(hook)
        return _HookHandle(self._post_acc_hooks, hook)

    def backward(self, gradient=None, retain_graph: bool | None = None, create_graph: bool = False, inputs=None):
        """Accumulates d(self)/d(leaf) into every leaf's ``.grad`` (see :func:`autograd.backward`);
        with ``create_graph`` the backward is recorded, for higher-order gradients."""
        self._live()
        engine.backward([self], [gradient], retain_graph=retain_graph, create_graph=create_graph, inputs=inputs)

    def detach(self) -> Tensor:
        """Same values and version counter, no history (inplace on it is seen by autograd)."""
        t = _wrap(self._live())
        t._vc = self._vc
        return t

    def detach_(self) -> Tensor:
        """Removes this tensor's history in place.

        A node that saved this tensor as an INPUT can no longer tell where its gradient
        goes: as in PyTorch, its backward then raises (see ``SavedTensor.unpack``). A
        node that saved it as its OUTPUT is unaffected.
        """
        if self._base is not None:
            raise RuntimeError("Can't detach views in-place. Use detach() instead.")
        fn = self._grad_fn
        if fn is not None:
            fn.__dict__["_output_detached"] = True
            _node.detached_inplace[0] = True
        self._grad_fn = None
        self._requires_grad = False
        return self

    @property
    def data(self) -> Tensor:
        """The escape hatch: same memory, a NEW version counter, no history.

        Changes made through ``.data`` are invisible to autograd, as in PyTorch.
        """
        return _wrap(self._live())

    @data.setter
    def data(self, value: Tensor) -> None:
        # As in PyTorch: the tensor keeps its version counter, and one that requires grad
        # only takes data it could compute a gradient for.
        if not isinstance(value, Tensor):
            raise TypeError(f"data must be set to a Tensor, got {type(value).__name__}")
        if self.requires_grad and not _is_float(value.dtype):
            raise RuntimeError(
                "data set to a tensor that requires gradients must be floating point or complex dtype "
                f"(got {value.dtype})"
            )
        self._data = value._data

    # --- the ops as methods ------------------------------------------------------------
    # Each method is one line that calls the op in framework.ops (imported at the bottom of
    # this file: the one place where Tensor and its ops import each other). Methods that
    # hand ``self`` straight to one op are pass-through frames for policy auto's proof
    # (``@_hands_over``). Groups follow PyTorch's documentation.

    # pointwise math: a new tensor (policy auto may reuse self's buffer when self is dead)
    @_hands_over
    def add(self, other, alpha=1):
        return _ops.add(self, other, alpha=alpha)

    @_hands_over
    def sub(self, other, alpha=1):
        return _ops.sub(self, other, alpha=alpha)

    @_hands_over
    def mul(self, other):
        return _ops.mul(self, other)

    @_hands_over
    def div(self, other):
        return _ops.div(self, other)

    @_hands_over
    def pow(self, exponent):
        return _ops.pow(self, exponent)

    @_hands_over
    def neg(self):
        return _ops.neg(self)

    @_hands_over
    def abs(self):
        return _ops.abs(self)

    @_hands_over
    def exp(self):
        return _ops.exp(self)

    @_hands_over
    def log(self):
        return _ops.log(self)

    @_hands_over
    def sqrt(self):
        return _ops.sqrt(self)

    @_hands_over
    def sin(self):
        return _ops.sin(self)

    @_hands_over
    def cos(self):
        return _ops.cos(self)

    @_hands_over
    def tanh(self):
        return _ops.tanh(self)

    @_hands_over
    def sigmoid(self):
        return _ops.sigmoid(self)

    @_hands_over
    def relu(self):
        return _ops.relu(self)

    @_hands_over
    def leaky_relu(self, negative_slope=0.01):
        return _ops.leaky_relu(self, negative_slope)

    @_hands_over
    def clamp(self, min=None, max=None):
        return _ops.clamp(self, min, max)  # noqa: A002

    def maximum(self, other):
        return _ops.maximum(self, other)

    def where(self, condition, other):
        return _ops.where(condition, self, other)

    # inplace pointwise math: self's storage gets the result and its version bumps; the
    # op refuses (before writing) a leaf that requires grad, or a view of one, with grad on.
    # Free when backward reads the result or nothing (relu_, exp_, add_); a copy of self
    # when backward needs the old value (sin_, log_): docs/INPLACE.md, section 4.
    def add_(self, other, alpha=1):
        return _ops.add_(self, other, alpha=alpha)

    def sub_(self, other, alpha=1):
        return _ops.sub_(self, other, alpha=alpha)

    def mul_(self, other):
        return _ops.mul_(self, other)

    def div_(self, other):
        return _ops.div_(self, other)

    def pow_(self, exponent):
        return _ops.pow_(self, exponent)

    def neg_(self):
        return _ops.neg_(self)

    def abs_(self):
        return _ops.abs_(self)

    def exp_(self):
        return _ops.exp_(self)

    def log_(self):
        return _ops.log_(self)

    def sqrt_(self):
        return _ops.sqrt_(self)

    def sin_(self):
        return _ops.sin_(self)

    def cos_(self):
        return _ops.cos_(self)

    def tanh_(self):
        return _ops.tanh_(self)

    def sigmoid_(self):
        return _ops.sigmoid_(self)

    def relu_(self):
        return _ops.relu_(self)

    def leaky_relu_(self, negative_slope=0.01):
        return _ops.leaky_relu_(self, negative_slope)

    def clamp_(self, min=None, max=None):
        return _ops.clamp_(self, min, max)  # noqa: A002

    def zero_(self):
        return _ops.zero_(self)

    def fill_(self, value):
        return _ops.fill_(self, value)

    def copy_(self, src):
        return _ops.copy_(self, src)

    def normal_(self, mean=0.0, std=1.0):
        return _ops.normal_(self, mean, std)

    def uniform_(self, a=0.0, b=1.0):
        return _ops.uniform_(self, a, b)

    # reductions
    def sum(self, dim=None, keepdim=False, *, axis=None, keepdims=None):
        # axis/keepdims: NumPy's names, which PyTorch accepts as aliases
        if axis is not None:
            dim = axis
        if keepdims is not None:
            keepdim = keepdims
        return _ops.sum(self, dim, keepdim)

    def mean(self, dim=None, keepdim=False, *, axis=None, keepdims=None):
        # axis/keepdims: NumPy's names, which PyTorch accepts as aliases
        if axis is not None:
            dim = axis
        if keepdims is not None:
            keepdim = keepdims
        return _ops.mean(self, dim, keepdim)

    def var(self, dim=None, unbiased=True, keepdim=False, correction=None):
        return _ops.var(self, dim, unbiased, keepdim, correction)

    def amax(self, dim=None, keepdim=False, *, axis=None, keepdims=None):
        # axis/keepdims: NumPy's names, which PyTorch accepts as aliases
        if axis is not None:
            dim = axis
        if keepdims is not None:
            keepdim = keepdims
        return _ops.amax(self, dim, keepdim)

    def max(self, dim=None, keepdim=False):
        return _ops.max(self, dim, keepdim)

    def argmax(self, dim=None, keepdim=False):
        return _ops.argmax(self, dim, keepdim)

    @_hands_over
    def softmax(self, dim=-1):
        return _ops.softmax(self, dim)

    @_hands_over
    def log_softmax(self, dim=-1):
        return _ops.log_softmax(self, dim)

    # masks (free in place: backward reads the mask, or nothing)
    @_hands_over
    def masked_fill(self, mask, value):
        return _ops.masked_fill(self, mask, value)

    def masked_fill_(self, mask, value):
        return _ops.masked_fill_(self, mask, value)

    @_hands_over
    def tril(self, diagonal=0):
        return _ops.tril(self, diagonal)

    @_hands_over
    def triu(self, diagonal=0):
        return _ops.triu(self, diagonal)

    def tril_(self, diagonal=0):
        return _ops.tril_(self, diagonal)

    def triu_(self, diagonal=0):
        return _ops.triu_(self, diagonal)

    # comparisons (no gradient)
    def eq(self, other):
        return _ops.eq(self, other)

    def ne(self, other):
        return _ops.ne(self, other)

    def lt(self, other):
        return _ops.lt(self, other)

    def le(self, other):
        return _ops.le(self, other)

    def gt(self, other):
        return _ops.gt(self, other)

    def ge(self, other):
        return _ops.ge(self, other)

    def allclose(self, other, rtol=1e-05, atol=1e-08, equal_nan=False):
        return _ops.allclose(self, other, rtol, atol, equal_nan)

    # linear algebra
    def matmul(self, other):
        return _ops.matmul(self, other)

    # Views share self's storage and version counter: an inplace op through a view changes
    # self (and bumps its version), and an inplace op on a view of a non-leaf rewrites the
    # base's history (CopySlices). Outputs of unbind/split/chunk refuse inplace while
    # autograd records, as in PyTorch.
    def view(self, *shape):
        """A view with another shape (no copy; raises when the strides do not allow one)."""
        return _ops.view(self, *shape)

    def view_as(self, other):
        return _ops.view_as(self, other)

    def reshape(self, *shape):
        """A view when the strides allow one, otherwise a copy (as in PyTorch)."""
        return _ops.reshape(self, *shape)

    def reshape_as(self, other):
        return _ops.reshape_as(self, other)

    def permute(self, *dims):
        return _ops.permute(self, *dims)

    def transpose(self, dim0, dim1):
        return _ops.transpose(self, dim0, dim1)

    def swapdims(self, dim0, dim1):
        return _ops.swapdims(self, dim0, dim1)

    def swapaxes(self, dim0, dim1):
        return _ops.swapdims(self, dim0, dim1)

    def t(self):
        return _ops.t(self)

    @property
    def T(self):
        return _ops.permute(self, tuple(reversed(range(self.ndim))))

    @property
    def mT(self):
        return _ops._matrix_transpose(self, "mT")

    @property
    def mH(self):
        return _ops._matrix_transpose(self, "mH")  # real dtypes: no conjugate

    @property
    def H(self):
        return _ops._hermitian(self)

    def unsqueeze(self, dim):
        return _ops.unsqueeze(self, dim)

    def squeeze(self, dim=None):
        return _ops.squeeze(self, dim)

    def flatten(self, start_dim=0, end_dim=-1):
        """A view when the strides allow one, otherwise a copy; ``self`` itself when there
        is nothing to flatten (as in PyTorch)."""
        return _ops.flatten(self, start_dim, end_dim)

    def expand(self, *sizes):
        """A view repeating size-1 dimensions with stride 0: writing through it, where two
        elements would share one location, raises."""
        return _ops.expand(self, *sizes)

    def expand_as(self, other):
        return _ops.expand_as(self, other)

    def narrow(self, dim, start, length):
        return _ops.narrow(self, dim, start, length)

    def select(self, dim, index):
        return _ops.select(self, dim, index)

    def unbind(self, dim=0):
        return _ops.unbind(self, dim)

    def split(self, split_size_or_sections, dim=0):
        return _ops.split(self, split_size_or_sections, dim)

    def split_with_sizes(self, split_sizes, dim=0):
        return _ops.split_with_sizes(self, split_sizes, dim)

    def chunk(self, chunks, dim=0):
        return _ops.chunk(self, chunks, dim)

    def as_strided(self, size, stride, storage_offset=None):
        """A view with any size and strides over self's storage (offsets count from the
        base's start, as in PyTorch)."""
        return _ops.as_strided(self, size, stride, storage_offset)

    def clone(self):
        return _ops.clone(self)

    def contiguous(self):
        """``self`` when it is contiguous, else a contiguous copy."""
        return _ops.contiguous(self)

    # indexing: a basic index (ints, slices, None, ...) gives a view, an advanced one (lists,
    # integer or bool tensors) a copy; ``x[i] = v`` writes in place (a version bump).
    def __getitem__(self, index):
        return _ops.getitem(self, index)

    def __setitem__(self, index, value):
        _ops.setitem(self, index, value)

    # operators
    __add__ = __radd__ = add
    __sub__ = sub
    __mul__ = __rmul__ = mul
    __truediv__ = div
    __pow__ = pow
    __neg__ = neg
    __abs__ = abs
    __matmul__ = matmul

    def __rsub__(self, other):
        return _ops.rsub(self, other)

    def __rtruediv__(self, other):
        return _ops.rdiv(self, other)

    def __rpow__(self, other):
        return _ops.rpow(self, other)

    def __rmatmul__(self, other):
        return _ops.matmul(other, self)

    def __iadd__(self, other):
        return _ops.add_(self, other)

    def __isub__(self, other):
        return _ops.sub_(self, other)

    def __imul__(self, other):
        return _ops.mul_(self, other)

    def __itruediv__(self, other):
        return _ops.div_(self, other)

    def __ipow__(self, exponent):
        return _ops.pow_(self, exponent)

    __eq__ = eq
    __ne__ = ne
    __lt__ = lt
    __le__ = le
    __gt__ = gt
    __ge__ = ge

    # --- printing --------------------------------------------------------------------
    def __repr__(self) -> str:
        if type(self._data) is ConsumedData:
            d = self._data
            return f"tensor({d!r}, shape={tuple(d.shape)}, dtype={d.dtype})"
        arr = backend.to_numpy(self._data)
        body = np.array2string(arr, separator=", ", precision=4, prefix="tensor(")
        extras = []
        if self.device.type != "cpu":
            extras.append(f"device='{self.device}'")
        if arr.dtype not in (np.float32, np.int64, np.bool_) or arr.size == 0:
            extras.append(f"dtype={arr.dtype}")
        fn = _grad_fn_or_invalid(self)
        if fn is not None:
            extras.append(f"grad_fn=<{fn}>")
        elif self._requires_grad:
            extras.append("requires_grad=True")
        return "tensor(" + body + "".join(", " + e for e in extras) + ")"

    def __iter__(self):
        if self._data.ndim == 0:
            raise TypeError("iteration over a 0-d tensor")
        for i in range(self._data.shape[0]):
            yield self[i]

    def __reduce__(self):
        # Pickle values only (checkpoints, MPI objects); history is not pickled.
        return (_from_numpy_copy, (backend.to_numpy(self._live()), self._requires_grad))

    @staticmethod
    def _from_array(array) -> Tensor:
        """A new tensor around ``array`` (how the engine, which works on arrays and sits
        below this class, hands out gradients)."""
        return _wrap(array)

    # --- inplace sites ---------------------------------------------------------------
    def _consume(self, site: str, where, policy: str) -> Tensor:
        """Hands this tensor's storage and history to a new tensor object, which an inplace
        SITE returns as its result, and leaves this object consumed (any use raises).

        The new object is what a fresh output of the site would be: same values and
        version counter, ``grad_fn`` (none under ``no_grad``), no ``.grad``, hooks or
        ``retain_grad`` of its own. Sites only consume tensors that own their memory
        alone, so no view of it exists.
        """
        data = self._data
        new = object.__new__(Tensor)
        new._data = data
        new._vc = self._vc
        if state.enabled:
            new._requires_grad = self._requires_grad
            new._grad_fn = self._grad_fn
        else:  # under no_grad the site's out-of-place result would have no history either
            new._requires_grad = False
            new._grad_fn = None
        new._grad = new._base = new._view_fn = new._view_base_fn = new._hooks = new._post_acc_hooks = None
        new._retains_grad = False
        self._data = ConsumedData(data, site, where, policy)
        return new


def _from_numpy_copy(array, requires_grad):
    t = _wrap(np.array(array))
    memory.track(t._data)
    t._requires_grad = requires_grad
    return t


def _wrap(array) -> Tensor:
    """A new tensor around ``array`` with a fresh version counter and no history.

    Inside ``inference_mode()`` it is an inference tensor (no version counter).
    """
    t = object.__new__(Tensor)
    t._data = array
    t._vc = InferenceVersionCounter() if state.inference else _VersionCounter()
    t._requires_grad = False
    t._grad_fn = None
    t._grad = None
    t._base = None
    t._view_fn = None
    t._view_base_fn = None
    t._retains_grad = False
    t._hooks = None
    t._post_acc_hooks = None
    return t


def _grad_fn_or_invalid(t):
    """The name of ``t.grad_fn`` for printing: ``Invalid`` where reading it raises (a view
    whose history can no longer be rebuilt), as PyTorch prints it; None without history."""
    try:
        fn = t.grad_fn
    except RuntimeError:
        return "Invalid"
    return None if fn is None else fn.name()


def _numpy_array(t: Tensor, dtype, copy):
    """``np.array(t)`` / ``np.asarray(t)``: NumPy 2's ``__array__(dtype, copy)`` protocol.

    ``copy=True`` (``np.array``) always returns new memory, so a snapshot never changes
    when ``t`` is later updated in place. ``copy=None`` (``np.asarray``) shares ``t``'s
    memory when it can, as ``t.numpy()`` does; where ``t`` requires grad the shared array
    is read-only, since a write through it would change values autograd relies on
    without a version bump (PyTorch refuses ``numpy()`` there). ``copy=False`` raises
    ``ValueError`` when a copy cannot be avoided (another dtype, or memory on a GPU).
    """
    data = t._live()
    on_host = isinstance(data, np.ndarray)
    convert = dtype is not None and np.dtype(dtype) != data.dtype
    if copy is False and (convert or not on_host):
        why = f"to dtype {np.dtype(dtype)}" if convert else f"from {t.device} to host memory"
        raise ValueError(f"Unable to avoid a copy of the tensor's data ({why}) while creating an array as requested")
    arr = backend.to_numpy(data)
    if convert:
        return arr.astype(dtype)  # a new array
    if copy:
        return arr.copy() if on_host else arr  # to_numpy already copied off a GPU
    if on_host and t.requires_grad:
        arr = arr.view()
        arr.flags.writeable = False
    return arr


# Tensors that retain their gradient, with [hook, weak reference to the node the hook
# sits on]. Weak both ways: a tensor that is gone retains nothing, and an old node is not
# kept alive for its hook.
_retained: weakref.WeakKeyDictionary[Tensor, list] = weakref.WeakKeyDictionary()


def _retain_hook_last(node) -> None:
    # As in PyTorch, the retain_grad hook runs after every tensor hook, whenever they
    # were registered, so .grad holds the gradient the hooks produced.
    hooks = node.__dict__.get("_pre_hooks")
    if hooks:
        hooks.sort(key=lambda h: getattr(h, "retains_grad", False))


def _attach_retain_hook(node, hook) -> None:
    node.register_prehook(hook)
    _retain_hook_last(node)


def _follow_retained_grads() -> None:
    """Moves each retain_grad hook to its tensor's current grad_fn (called by backward).

    An inplace op gives the tensor (or, through a view, its base and its other views)
    a new grad_fn; PyTorch moves the hook when that happens, so ``.grad`` is the
    gradient of the latest value. Moving it here, when a backward starts, gives the same
    result, and costs nothing while no tensor retains its gradient.
    """
    if not _retained:
        return
    for t, entry in list(_retained.items()):
        hook, node_ref = entry
        node = node_ref() if node_ref is not None else None
        try:
            current = t.grad_fn
        except RuntimeError:
            continue  # a view whose history cannot be rebuilt: using it will raise
        if current is node:
            continue
        if node is not None:
            hooks = node.__dict__.get("_pre_hooks")
            if hooks and hook in hooks:
                hooks.remove(hook)
        entry[1] = weakref.ref(current) if current is not None else None
        if current is not None:
            _attach_retain_hook(current, hook)


_node.before_backward.append(_follow_retained_grads)


class _enable_grad_quiet:
    """Grad mode on for the replay of a view chain, without the decorator machinery."""

    __slots__ = ("prev",)

    def __enter__(self):
        self.prev = state.enabled
        state.enabled = True

    def __exit__(self, *exc):
        state.enabled = self.prev


# The one import cycle of the framework: ops build on Tensor, and Tensor's methods call
# the ops. Imported last, when Tensor exists; the methods look ``_ops`` up at call time.
from . import ops as _ops  # noqa: E402

__all__ = ["Tensor", "no_grad"]
