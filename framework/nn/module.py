"""Module: the base of every layer and model, with PyTorch's registration and traversal API."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import numpy as np

from .. import backend, memory
from .. import inplace as _inplace
from ..autograd.function import _HookHandle
from ..autograd.grad_mode import no_grad
from ..ops import promotion as _promotion
from ..tensor import Tensor, _is_float, _wrap
from .parameter import Parameter


class _IncompatibleKeys(namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])):
    """What ``load_state_dict(strict=False)`` could not match."""

    def __repr__(self):
        if not self.missing_keys and not self.unexpected_keys:
            return "<All keys matched successfully>"
        return super().__repr__()

    __str__ = __repr__


def _addindent(s: str, spaces: int) -> str:
    lines = s.split("\n")
    if len(lines) == 1:
        return s
    first = lines.pop(0)
    return first + "\n" + "\n".join(" " * spaces + line for line in lines)


class Module:
    """Base class of layers and models.

    Subclasses call ``super().__init__()`` first, then assign :class:`Parameter` s,
    sub-modules and buffers (:meth:`register_buffer`) as attributes; ``__setattr__``
    registers them, in assignment order, and every traversal (``parameters()``,
    ``state_dict()``, ``to()``, ``train()``) follows that order. Calling the module runs
    its forward pre-hooks, ``forward`` and its forward hooks.

    Memory: parameters are counted as ``parameters``, and so are buffers (running
    statistics are model state, part of a training step's floor).
    """

    training: bool

    def __init__(self):
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_non_persistent_buffers_set", set())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_forward_hooks", [])
        object.__setattr__(self, "_forward_pre_hooks", [])

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f'Module [{type(self).__name__}] is missing the required "forward" function')

    def __call__(self, *args, **kwargs):
        if self._forward_pre_hooks or self._forward_hooks:
            return self._call_with_hooks(*args, **kwargs)
        return self.forward(*args, **kwargs)

    def _call_with_hooks(self, *args, **kwargs):
        # Not a pass-through frame for policy auto: a forward hook reads the inputs after
        # forward, so nothing a hooked module receives is ever proven dead.
        for hook in tuple(self._forward_pre_hooks):
            r = hook(self, args)
            if r is not None:
                args = r if isinstance(r, tuple) else (r,)
        out = self.forward(*args, **kwargs)
        for hook in tuple(self._forward_hooks):
            r = hook(self, args, out)
            if r is not None:
                out = r
        return out

    def register_forward_pre_hook(self, hook):
        """``hook(module, args) -> None | new args`` runs before ``forward``; returns a handle."""
        self._forward_pre_hooks.append(hook)
        return _HookHandle(self._forward_pre_hooks, hook)

    def register_forward_hook(self, hook):
        """``hook(module, args, output) -> None | new output`` runs after ``forward``."""
        self._forward_hooks.append(hook)
        return _HookHandle(self._forward_hooks, hook)

    # --- registration ---------------------------------------------------------------
    def _check_name(self, name, kind: str) -> None:
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"cannot assign {kind} before Module.__init__() call")
        if not isinstance(name, str):
            raise TypeError(f"{kind} name should be a string. Got {type(name).__name__}")
        if name == "" or "." in name:
            raise KeyError(f'{kind} name can\'t be empty or contain ".", got: {name!r}')

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        """Adds a parameter (or a ``None`` placeholder, e.g. a missing bias)."""
        self._check_name(name, "parameter")
        if hasattr(self, name) and name not in self._parameters:
            raise KeyError(f"attribute '{name}' already exists")
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(
                f"cannot assign '{type(param).__name__}' object to parameter '{name}' (nn.Parameter or None required)"
            )
        if param is not None and param.grad_fn is not None:
            raise ValueError(
                f"Cannot assign non-leaf Tensor to parameter '{name}'. Model parameters must be "
                "created explicitly. To express '{name}' as a function of another Tensor, compute "
                "the value in the forward() method."
            )
        self._parameters[name] = param

    def register_buffer(self, name: str, tensor: Tensor | None, persistent: bool = True) -> None:
        """Adds a buffer: state that is not a parameter (BatchNorm's running statistics).

        Buffers move with ``to()``, appear in ``buffers()`` and, when ``persistent``, in
        ``state_dict()``. Their memory is counted as ``parameters`` (model state).
        """
        self._check_name(name, "buffer")
        if hasattr(self, name) and name not in self._buffers:
            raise KeyError(f"attribute '{name}' already exists")
        if tensor is not None and not isinstance(tensor, Tensor):
            raise TypeError(
                f"cannot assign '{type(tensor).__name__}' object to buffer '{name}' (Tensor or None required)"
            )
        if tensor is not None:
            memory.retag(tensor._data, "parameters")
        self._buffers[name] = tensor
        if persistent:
            self._non_persistent_buffers_set.discard(name)
        else:
            self._non_persistent_buffers_set.add(name)

    def add_module(self, name: str, module: Module | None) -> None:
        """Adds a child module (``None`` is allowed as a placeholder)."""
        self._check_name(name, "module")
        if hasattr(self, name) and name not in self._modules:
            raise KeyError(f"attribute '{name}' already exists")
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"{type(module).__name__} is not a Module subclass")
        self._modules[name] = module

    register_module = add_module

    def __setattr__(self, name: str, value) -> None:
        d = self.__dict__
        params = d.get("_parameters")
        if isinstance(value, Parameter):
            if params is None:
                raise AttributeError("cannot assign parameters before Module.__init__() call")
            self._remove_from(name, d, self._buffers, self._modules)
            self.register_parameter(name, value)
        elif params is not None and name in params:
            if value is not None:
                raise TypeError(
                    f"cannot assign '{type(value).__name__}' as parameter '{name}' (nn.Parameter or None expected)"
                )
            self.register_parameter(name, value)
        elif isinstance(value, Module):
            if "_modules" not in d:
                raise AttributeError("cannot assign module before Module.__init__() call")
            self._remove_from(name, d, self._parameters, self._buffers)
            self._modules[name] = value
        elif "_modules" in d and name in d["_modules"]:
            if value is not None:
                raise TypeError(
                    f"cannot assign '{type(value).__name__}' as child module '{name}' (nn.Module or None expected)"
                )
            self._modules[name] = value
        elif "_buffers" in d and name in d["_buffers"]:
            if value is not None and not isinstance(value, Tensor):
                raise TypeError(f"cannot assign '{type(value).__name__}' as buffer '{name}' (Tensor or None expected)")
            if value is not None:
                memory.retag(value._data, "parameters")
            self._buffers[name] = value
        else:
            object.__setattr__(self, name, value)

    @staticmethod
    def _remove_from(name, *dicts) -> None:
        for dct in dicts:
            if name in dct:
                del dct[name]

    def __getattr__(self, name: str):
        # Only reached when normal lookup fails: the registered things.
        d = self.__dict__
        for key in ("_parameters", "_buffers", "_modules"):
            reg = d.get(key)
            if reg is not None and name in reg:
                return reg[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __delattr__(self, name: str) -> None:
        for key in ("_parameters", "_buffers", "_modules"):
            reg = self.__dict__.get(key)
            if reg is not None and name in reg:
                del reg[name]
                self._non_persistent_buffers_set.discard(name)
                return
        object.__delattr__(self, name)

    def __dir__(self):
        keys = list(super().__dir__()) + list(self._parameters) + list(self._modules) + list(self._buffers)
        return sorted(k for k in set(keys) if not k[0].isdigit())

    # --- traversal ---------------------------------------------------------------------
    def named_modules(self, memo: set | None = None, prefix: str = "", remove_duplicate: bool = True):
        """Yields ``(name, module)`` for this module and every descendant, depth first."""
        if memo is None:
            memo = set()
        if remove_duplicate:
            if self in memo:
                return
            memo.add(self)
        yield prefix, self
        for name, module in self._modules.items():
            if module is None:
                continue
            sub = prefix + ("." if prefix else "") + name
            yield from module.named_modules(memo, sub, remove_duplicate)

    def modules(self):
        for _, m in self.named_modules():
            yield m

    def named_children(self):
        """Yields ``(name, module)`` for the direct children."""
        seen = set()
        for name, module in self._modules.items():
            if module is not None and module not in seen:
                seen.add(module)
                yield name, module

    def children(self):
        for _, m in self.named_children():
            yield m

    def _named_members(self, get_members, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        seen = set()
        modules = self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate) if recurse else [(prefix, self)]
        for module_prefix, module in modules:
            for k, v in get_members(module):
                if v is None or (remove_duplicate and id(v) in seen):
                    continue
                if remove_duplicate:
                    seen.add(id(v))
                yield module_prefix + ("." if module_prefix else "") + k, v

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """Yields ``(dotted name, parameter)``; a shared parameter appears once."""
        return self._named_members(lambda m: m._parameters.items(), prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True):
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._named_members(lambda m: m._buffers.items(), prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True):
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    def get_submodule(self, target: str) -> Module:
        """The descendant at dotted path ``target`` (``""`` is this module)."""
        if target == "":
            return self
        mod = self
        for item in target.split("."):
            if item not in mod._modules or mod._modules[item] is None:
                raise AttributeError(f"{type(mod).__name__} has no submodule `{item}` (looking for `{target}`)")
            mod = mod._modules[item]
        return mod

    def apply(self, fn) -> Module:
        """Calls ``fn(module)`` on every descendant (children first) and on self."""
        for m in self.children():
            m.apply(fn)
        fn(self)
        return self

    # --- modes and gradients --------------------------------------------------------------
    def train(self, mode: bool = True) -> Module:
        """Sets training mode on this module and every descendant; returns self."""
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        object.__setattr__(self, "training", mode)
        for m in self.children():
            m.train(mode)
        return self

    def eval(self) -> Module:
        """Evaluation mode: ``train(False)`` (BatchNorm uses running stats, Dropout is off)."""
        return self.train(False)

    def requires_grad_(self, requires_grad: bool = True) -> Module:
        for p in self.parameters():
            p.requires_grad_(requires_grad)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Resets the parameters' gradients: to ``None`` (default), or to zeros in place."""
        for p in self.parameters():
            _zero_grad(p, set_to_none)

    # --- devices and dtypes ------------------------------------------------------------------
    def _apply(self, fn, floating_only: bool = False) -> Module:
        """Maps every parameter, gradient and buffer array through ``fn(array) -> array``.

        Parameters keep their identity (their storage is rebound, as PyTorch's
        ``param.data = fn(param.data)``), so optimizers built before still see them.
        """

        def convert(array):
            if floating_only and not _is_float(array.dtype):
                return array
            return fn(array)

        for m in self.modules():
            for p in m._parameters.values():
                if p is None:
                    continue
                new = convert(p._data)
                if new is not p._data:
                    p._data = new
                    memory.retag(new, "parameters")
                if p._grad is not None:
                    g = convert(p._grad._data)
                    if g is not p._grad._data:
                        p._grad = _wrap(memory.track(g, "gradients"))
            for name, b in m._buffers.items():
                if b is None:
                    continue
                new = convert(b._data)
                if new is not b._data:
                    memory.retag(new, "parameters")
                    nb = _wrap(new)
                    nb._requires_grad = b._requires_grad
                    m._buffers[name] = nb
        return self

    def to(self, device=None, dtype=None) -> Module:
        """Moves (in place) parameters and buffers to ``device`` and/or floating ``dtype``.

        ``to("cuda")``, ``to(fw.float64)``, ``to("cpu", fw.float32)``. Integer buffers
        (``num_batches_tracked``) keep their dtype. Returns self.
        """
        if isinstance(device, (np.dtype, type)) and dtype is None:
            device, dtype = None, device
        dev = backend.device(device) if device is not None else None
        if dtype is not None:
            dtype = np.dtype(dtype)
            if not _is_float(dtype):
                raise TypeError(f"nn.Module.to only accepts floating point dtypes, but got desired dtype={dtype}")

        def fn(array):
            out = array
            if dtype is not None and _is_float(array.dtype) and array.dtype != dtype:
                out = out.astype(dtype)
            if dev is not None and backend.device_of(out) != dev:
                out = backend.to_device(out, dev)
            return out

        return self._apply(fn)

    def cpu(self) -> Module:
        return self.to("cpu")

    def cuda(self, device: int = 0) -> Module:
        return self.to(f"cuda:{device}")

    def float(self) -> Module:
        return self.to(dtype=np.float32)

    def double(self) -> Module:
        return self.to(dtype=np.float64)

    def half(self) -> Module:
        return self.to(dtype=np.float16)

    def bfloat16(self) -> Module:
        """Floating parameters and buffers to bfloat16 (needs ``ml_dtypes``)."""
        return self.to(dtype=_promotion.bfloat16)

    # --- state dict --------------------------------------------------------------------------
    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):
        """An ordered dict ``dotted name -> tensor`` of parameters and persistent buffers.

        The tensors share memory with the module (``detach()`` ed unless ``keep_vars``),
        as in PyTorch: clone them, or serialise them, to keep a snapshot.
        """
        if destination is None:
            destination = OrderedDict()
        for name, p in self._parameters.items():
            if p is not None:
                destination[prefix + name] = p if keep_vars else p.detach()
        for name, b in self._buffers.items():
            if b is not None and name not in self._non_persistent_buffers_set:
                destination[prefix + name] = b if keep_vars else b.detach()
        for name, m in self._modules.items():
            if m is not None:
                m.state_dict(destination=destination, prefix=prefix + name + ".", keep_vars=keep_vars)
        return destination

    def load_state_dict(self, state_dict, strict: bool = True):
        """Copies values from ``state_dict`` into the parameters and buffers (in place).

        Values may be tensors or NumPy arrays; they are cast to each target's dtype and
        device. Every problem is collected and reported in ONE error: keys the module
        expects but ``state_dict`` lacks, keys it has but the module does not (both only
        when ``strict``), and shape mismatches (always).

        Returns:
            ``(missing_keys, unexpected_keys)`` as a named tuple.

        Raises:
            RuntimeError: listing every missing key, unexpected key and size mismatch.
        """
        if not hasattr(state_dict, "keys"):
            raise TypeError(f"Expected state_dict to be dict-like, got {type(state_dict).__name__}.")
        own = self.state_dict(keep_vars=True)
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        mismatched = []
        for k, target in own.items():
            if k not in state_dict:
                continue
            value = state_dict[k]
            shape = tuple(value.shape) if hasattr(value, "shape") else np.shape(value)
            if shape != tuple(target.shape):
                mismatched.append(
                    f"size mismatch for {k}: copying a param with shape {shape} from checkpoint, "
                    f"the shape in current model is {tuple(target.shape)}."
                )
        errors = []
        if strict:
            if unexpected:
                errors.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ". ")
            if missing:
                errors.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ". ")
        errors.extend(mismatched)
        if errors:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}:\n\t" + "\n\t".join(errors))
        with no_grad():
            for k, target in own.items():
                if k not in state_dict:
                    continue
                value = state_dict[k]
                if not isinstance(value, Tensor):
                    # an array of any device as it is (np.asarray refuses CuPy arrays);
                    # copy_ moves it to the target's device
                    value = _wrap(value if backend.is_array(value) else np.asarray(value))
                target.copy_(value)
        return _IncompatibleKeys(missing, unexpected)

    # --- printing ------------------------------------------------------------------------------
    def extra_repr(self) -> str:
        """The text between the parentheses of this module's repr (set it in subclasses)."""
        return ""

    def _get_name(self) -> str:
        return type(self).__name__

    def __repr__(self) -> str:
        extra = self.extra_repr()
        lines = extra.split("\n") if extra else []
        for name, module in self._modules.items():
            lines.append("(" + name + "): " + _addindent(repr(module), 2))
        main = self._get_name() + "("
        if lines:
            if len(lines) == 1 and not self._modules:
                main += lines[0]
            else:
                main += "\n  " + "\n  ".join(lines) + "\n"
        return main + ")"


def _zero_grad(p: Tensor, set_to_none: bool) -> None:
    if p.grad is None:
        return
    if set_to_none:
        p.grad = None
        return
    g = p.grad
    if g.grad_fn is not None:
        g.detach_()
    else:
        g.requires_grad_(False)
    with no_grad():
        g.zero_()


_inplace.passes_ownership(Module.__call__)
