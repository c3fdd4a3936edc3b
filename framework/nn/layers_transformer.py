"""The Transformer layers: ``Embedding``, ``LayerNorm`` and ``GELU``, with PyTorch's
constructors, defaults, initialisation and reprs.

``LayerNorm(memory_efficient=True)`` is Apex's ``FusedLayerNorm(memory_efficient=True)``:
backward keeps the output instead of the input (same numbers). ``GELU`` is no site of
the inplace policy: its backward reads its input, so writing over it would need a copy
(docs/TRANSFORMERS.md).
"""

from __future__ import annotations

from .. import creation
from ..autograd.grad_mode import no_grad
from . import functional as F
from . import init
from .module import Module
from .parameter import Parameter


class Embedding(Module):
    """A lookup table of ``num_embeddings`` vectors of ``embedding_dim``: ``weight[input]``.

    ``weight`` is initialised from N(0, 1), the ``padding_idx`` row (if any) with zeros, as
    in PyTorch; that row gets no gradient. ``max_norm``, ``scale_grad_by_freq`` and
    ``sparse`` must keep their defaults.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight=None,
        _freeze: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if max_norm is not None or scale_grad_by_freq or sparse:
            raise NotImplementedError("Embedding: max_norm, scale_grad_by_freq and sparse are not supported")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise AssertionError("Padding_idx must be within num_embeddings")
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.max_norm, self.norm_type = max_norm, norm_type
        self.scale_grad_by_freq, self.sparse = scale_grad_by_freq, sparse
        if _weight is None:
            self.weight = Parameter(
                creation.empty(num_embeddings, embedding_dim, dtype=dtype, device=device), requires_grad=not _freeze
            )
            self.reset_parameters()
        else:
            if tuple(_weight.shape) != (num_embeddings, embedding_dim):
                raise AssertionError("Shape of weight does not match num_embeddings and embedding_dim")
            self.weight = Parameter(_weight, requires_grad=not _freeze)

    def reset_parameters(self) -> None:
        init.normal_(self.weight)
        if self.padding_idx is not None:
            with no_grad():
                self.weight[self.padding_idx].fill_(0)

    def forward(self, input):
        return F.embedding(input, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        return s


class LayerNorm(Module):
    """Layer normalization over the last dims ``normalized_shape``.

    ``weight`` starts at ones and ``bias`` at zeros (``elementwise_affine``; ``bias=False``
    leaves the bias out), as in PyTorch. ``memory_efficient=True`` keeps the output instead
    of the input for backward (Apex's mode; a weight element of 0 cannot be inverted there).
    """

    def __init__(
        self,
        normalized_shape,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
        memory_efficient: bool = False,
    ):
        super().__init__()
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(int(n) for n in normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        if elementwise_affine:
            self.weight = Parameter(creation.empty(*self.normalized_shape, dtype=dtype, device=device))
            if bias:
                self.bias = Parameter(creation.empty(*self.normalized_shape, dtype=dtype, device=device))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            init.ones_(self.weight)
            if self.bias is not None:
                init.zeros_(self.bias)

    def forward(self, input):
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps, self.memory_efficient)

    def extra_repr(self) -> str:
        s = f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
        return s + (", memory_efficient=True" if self.memory_efficient else "")


class GELU(Module):
    """``x * Phi(x)`` (``approximate="tanh"``: the tanh approximation), out of place (see
    the module docstring)."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, input):
        return F.gelu(input, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
