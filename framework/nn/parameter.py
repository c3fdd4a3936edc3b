"""Parameter: a leaf tensor that requires grad and is counted as ``parameters`` memory."""

from __future__ import annotations

from .. import backend, memory
from ..creation import empty
from ..tensor import Tensor, _wrap


class Parameter(Tensor):
    """A Tensor that a :class:`~framework.nn.Module` registers as a learnable parameter.

    ``Parameter(t)`` shares ``t``'s memory and version counter (as ``t.detach()`` does, and
    as PyTorch's ``nn.Parameter`` does) and is always a leaf. Its buffer is moved to the
    ``parameters`` category of :mod:`framework.memory`; so is any buffer later bound with
    ``p.data = new``.

    Args:
        data: the initial values (a Tensor); ``None`` gives an empty float32 parameter.
        requires_grad: whether autograd computes a gradient for it (default True).
    """

    __slots__ = ()

    def __new__(cls, data: Tensor | None = None, requires_grad: bool = True):
        if data is None:
            data = empty(0)
        if not isinstance(data, Tensor):
            raise TypeError(f"Parameter expects a Tensor, got {type(data).__name__}: wrap it with fw.tensor() first")
        self = object.__new__(cls)
        self._data = data._data
        self._vc = data._vc
        self._requires_grad = False
        self._grad_fn = None
        self._grad = None
        self._base = None
        self._view_fn = None
        self._view_base_fn = None
        self._retains_grad = False
        self._hooks = None
        self._post_acc_hooks = None
        self.requires_grad = requires_grad  # validates the dtype
        memory.retag(self._data, "parameters")
        return self

    def __init__(self, data: Tensor | None = None, requires_grad: bool = True):
        pass  # everything happens in __new__

    @property
    def data(self) -> Tensor:
        """Same memory, a new version counter, no history (see :attr:`Tensor.data`)."""
        return Tensor.data.fget(self)

    @data.setter
    def data(self, value: Tensor) -> None:
        Tensor.data.fset(self, value)
        memory.retag(self._data, "parameters")

    def __repr__(self) -> str:
        return "Parameter containing:\n" + super().__repr__()

    def __reduce__(self):
        return (_rebuild_parameter, (backend.to_numpy(self._data), self._requires_grad))

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        copy = _from_array(self._data.copy(), self._requires_grad)
        if self._grad is not None:
            copy._grad = _wrap(memory.track(self._grad._data.copy(), "gradients"))
        memo[id(self)] = copy
        return copy


def _from_array(array, requires_grad: bool) -> Parameter:
    return Parameter(_wrap(array), requires_grad)  # _wrap gives a fresh version counter


def _rebuild_parameter(array, requires_grad):
    import numpy as np  # noqa: PLC0415

    return _from_array(np.array(array), requires_grad)
