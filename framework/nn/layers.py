"""The layers: PyTorch's constructors, defaults, initialisation and reprs.

Inplace sites: ``ReLU``, ``LeakyReLU`` and ``Dropout`` built with ``inplace=None`` (the
default), and ``Sigmoid``/``Tanh`` built with ``inplace=None``, follow the inplace policy
(:func:`framework.inplace.site_target`): they write over their input only where the
policy allows it, and then consume it (the input's old tensor object raises on any later
use). ``True``/``False`` force one path with PyTorch's meaning: ``inplace=True`` changes
the input and returns it, and raises where PyTorch raises. ``InPlaceABN`` is always in
place. ``BatchNorm`` updates its running statistics in place (their versions bump).
"""

from __future__ import annotations

import math
from collections import OrderedDict

from .. import creation
from .. import inplace as _inplace
from ..autograd.grad_mode import no_grad
from ..ops.dropout import check_probability
from . import functional as F
from . import init
from .module import Module
from .parameter import Parameter


def _pair(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


# --- linear and convolution ---------------------------------------------------------------


class Identity(Module):
    """Returns its input (arguments are accepted and ignored, as in PyTorch)."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, input):
        return input


class Linear(Module):
    """``y = x @ weight.T + bias`` for inputs of shape ``(*, in_features)``.

    ``weight`` ``(out_features, in_features)`` is initialised with
    ``kaiming_uniform_(a=sqrt(5))`` and ``bias`` with U(-1/sqrt(in), 1/sqrt(in)), as in PyTorch.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = Parameter(creation.empty(out_features, in_features, dtype=dtype, device=device))
        if bias:
            self.bias = Parameter(creation.empty(out_features, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = self.in_features
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            init.uniform_(self.bias, -bound, bound)

    def forward(self, input):
        return F.linear(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Conv2d(Module):
    """2-D convolution over ``(N, C_in, H, W)``; weight ``(C_out, C_in, kH, kW)``.

    Arguments in PyTorch's order; ``dilation`` and ``groups`` must be 1.

    Initialised as PyTorch: ``kaiming_uniform_(a=sqrt(5))``, bias U(-1/sqrt(fan_in), ...).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=0,
        dilation=1,
        groups: int = 1,
        bias: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        # PyTorch's argument order; only what framework.ops.conv implements is accepted
        if _pair(dilation) != (1, 1) or groups != 1:
            raise NotImplementedError(f"Conv2d supports dilation=1 and groups=1 only, got {dilation=}, {groups=}")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = _pair(kernel_size)
        self.stride = _pair(stride)
        self.padding = _pair(padding)
        self.weight = Parameter(
            creation.empty(out_channels, in_channels, *self.kernel_size, dtype=dtype, device=device)
        )
        if bias:
            self.bias = Parameter(creation.empty(out_channels, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in, _ = init._calculate_fan_in_and_fan_out(self.weight)
            if fan_in != 0:
                bound = 1 / math.sqrt(fan_in)
                init.uniform_(self.bias, -bound, bound)

    def forward(self, input):
        return F.conv2d(input, self.weight, self.bias, self.stride, self.padding)

    def extra_repr(self) -> str:
        s = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"
        if self.padding != (0, 0):
            s += f", padding={self.padding}"
        if self.bias is None:
            s += ", bias=False"
        return s


# --- normalisation --------------------------------------------------------------------------


class _BatchNorm(Module):
    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.affine = affine
        self.track_running_stats = track_running_stats
        if affine:
            self.weight = Parameter(creation.empty(num_features, dtype=dtype, device=device))
            self.bias = Parameter(creation.empty(num_features, dtype=dtype, device=device))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if track_running_stats:
            self.register_buffer("running_mean", creation.zeros(num_features, dtype=dtype, device=device))
            self.register_buffer("running_var", creation.ones(num_features, dtype=dtype, device=device))
            self.register_buffer("num_batches_tracked", creation.tensor(0, dtype=creation.int64, device=device))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self.reset_parameters()

    def reset_running_stats(self) -> None:
        if self.track_running_stats:
            with no_grad():
                self.running_mean.zero_()
                self.running_var.fill_(1)
                self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        if self.affine:
            init.ones_(self.weight)
            init.zeros_(self.bias)

    def _check_input_dim(self, input) -> None:  # pragma: no cover - overridden
        raise NotImplementedError(f"{type(self).__name__} must define _check_input_dim")

    def forward(self, input):
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"{type(self).__name__}({self.num_features}) got an input with {input.shape[1]} channels "
                f"(shape {tuple(input.shape)})"
            )
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            with no_grad():
                self.num_batches_tracked.add_(1)
            # momentum=None: the cumulative moving average (factor 1/n at the n-th batch)
            factor = 1.0 / int(self.num_batches_tracked.item()) if self.momentum is None else self.momentum
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        use_stats = not self.training or self.track_running_stats
        return self._batch_norm(
            input,
            self.running_mean if use_stats else None,
            self.running_var if use_stats else None,
            bn_training,
            factor,
        )

    def _batch_norm(self, input, running_mean, running_var, training, momentum):
        """The normalization itself (SyncBatchNorm replaces it in training mode)."""
        return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, training, momentum, self.eps)

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
            f"track_running_stats={self.track_running_stats}"
        )


class BatchNorm1d(_BatchNorm):
    """Batch normalisation of ``(N, C)`` or ``(N, C, L)`` inputs over the batch (and L).

    Training mode normalises with the batch statistics and updates ``running_mean`` /
    ``running_var`` IN PLACE (their version bumps; ``momentum=None`` is the cumulative
    average); evaluation mode normalises with the running statistics.
    """

    def _check_input_dim(self, input) -> None:
        if input.dim() not in (2, 3):
            raise ValueError(f"expected 2D or 3D input (got {input.dim()}D input)")


class BatchNorm2d(_BatchNorm):
    """Batch normalisation of ``(N, C, H, W)`` inputs per channel (see :class:`BatchNorm1d`)."""

    def _check_input_dim(self, input) -> None:
        if input.dim() != 4:
            raise ValueError(f"expected 4D input (got {input.dim()}D input)")


class InPlaceABN(Module):
    """BatchNorm followed by leaky ReLU, fused and written over the input (InPlace-ABN).

    Always in place: the output IS the input tensor, and backward recovers what it needs
    by inverting the activation and the affine step, so the normalised activations are
    never stored (Rota Bulò et al., CVPR 2018). The input must therefore be a NON-LEAF
    tensor (e.g. a conv or linear output) when it requires grad; a leaf input that needs
    no grad (a data batch) is overwritten. Models use it in place of
    ``BatchNorm + LeakyReLU`` when they want that memory saving; it has no out-of-place
    path of its own.

    Args:
        num_features: channels (dim 1 of the input).
        eps, momentum: as in BatchNorm (running stats are updated in place in training).
        negative_slope: the leaky ReLU slope (> 0, so the activation is invertible).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float = 0.1,
        negative_slope: float = 0.01,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if not negative_slope > 0:
            raise ValueError(f"InPlaceABN needs negative_slope > 0 to invert the activation, got {negative_slope}")
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.negative_slope = negative_slope
        self.weight = Parameter(creation.ones(num_features, dtype=dtype, device=device))
        self.bias = Parameter(creation.zeros(num_features, dtype=dtype, device=device))
        self.register_buffer("running_mean", creation.zeros(num_features, dtype=dtype, device=device))
        self.register_buffer("running_var", creation.ones(num_features, dtype=dtype, device=device))

    def reset_parameters(self) -> None:
        with no_grad():
            self.running_mean.zero_()
            self.running_var.fill_(1)
        init.ones_(self.weight)
        init.zeros_(self.bias)

    def forward(self, input, residual=None):
        """``leaky_relu(BN(input) [+ residual])`` written over ``input`` (returned).

        ``residual`` (same shape as ``input``, e.g. a basic block's identity) is added
        before the activation; it is kept for backward by reference, not copied.
        """
        return self._abn(input, residual, inplace=True)

    def _abn(self, input, residual, inplace: bool):
        """The function, over ``input``'s buffer or (``inplace=False``) into a new tensor."""
        if input.dim() < 2 or input.shape[1] != self.num_features:
            raise ValueError(
                f"{type(self).__name__}({self.num_features}) expects an input of shape "
                f"(N, {self.num_features}, ...), got {tuple(input.shape)}"
            )
        return F.inplace_abn(
            input,
            self.running_mean,
            self.running_var,
            self.weight,
            self.bias,
            training=self.training,
            momentum=self.momentum,
            eps=self.eps,
            negative_slope=self.negative_slope,
            residual=residual,
            inplace=inplace,
        )

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, negative_slope={self.negative_slope}"


# --- activations -----------------------------------------------------------------------------


class _Activation(Module):
    """An activation with an ``inplace`` setting (``None``: follow the policy)."""

    def __init__(self, inplace: bool | None = None):
        super().__init__()
        self.inplace = inplace

    def extra_repr(self) -> str:
        return "" if self.inplace is None else f"inplace={self.inplace}"


class ReLU(_Activation):
    """max(x, 0). ``inplace=None`` (default) is a site of the inplace policy; ``True`` and
    ``False`` force a path, as in PyTorch.

    In place, nothing extra is stored (ReLU's backward reads its output). A policy site
    that writes over its input consumes it (see :mod:`framework.inplace`).
    """

    @_inplace.passes_ownership
    def forward(self, input):
        if self.inplace is not None:
            return F.relu(input, inplace=self.inplace)
        where = _inplace.site_target(input, "ReLU")
        if where is None:
            return F.relu(input)
        return F.relu_(_inplace.consume(input, "ReLU", where))


class LeakyReLU(_Activation):
    """x if x > 0 else negative_slope * x; ``inplace`` as :class:`ReLU` (a negative slope
    has no inplace form: backward could not tell the input's sign from the output).

    As in PyTorch, the out-of-place form saves its input and the inplace form its result:
    under policy ``auto`` the site writes in place only where no gradient is recorded
    (``site_target(saves_differ=True)``), so ``auto`` keeps ``off``'s behaviour."""

    def __init__(self, negative_slope: float = 0.01, inplace: bool | None = None):
        super().__init__(inplace)
        self.negative_slope = negative_slope

    @_inplace.passes_ownership
    def forward(self, input):
        if self.inplace is not None:
            return F.leaky_relu(input, self.negative_slope, inplace=self.inplace)
        if self.negative_slope < 0:
            return F.leaky_relu(input, self.negative_slope)
        where = _inplace.site_target(input, "LeakyReLU", saves_differ=True)
        if where is None:
            return F.leaky_relu(input, self.negative_slope)
        return F.leaky_relu_(_inplace.consume(input, "LeakyReLU", where), self.negative_slope)

    def extra_repr(self) -> str:
        s = f"negative_slope={self.negative_slope}"
        return s if self.inplace is None else s + f", inplace={self.inplace}"


class _OutOfPlaceByDefault(_Activation):
    """An activation that PyTorch has no ``inplace`` flag for: out of place by default;
    ``inplace=None`` makes it a site of the policy (free: these backwards read the output)."""

    op = ""  # the Tensor method name; the inplace form is op + "_"

    def __init__(self, inplace: bool | None = False):
        super().__init__(inplace)

    @_inplace.passes_ownership
    def forward(self, input):
        if self.inplace is not None:
            return getattr(input, self.op + "_" if self.inplace else self.op)()
        where = _inplace.site_target(input, type(self).__name__)
        if where is None:
            return getattr(input, self.op)()
        return getattr(_inplace.consume(input, type(self).__name__, where), self.op + "_")()

    def extra_repr(self) -> str:
        return "" if self.inplace is False else f"inplace={self.inplace}"


class Sigmoid(_OutOfPlaceByDefault):
    """1 / (1 + exp(-x)); see :class:`_OutOfPlaceByDefault` for ``inplace``."""

    op = "sigmoid"


class Tanh(_OutOfPlaceByDefault):
    """tanh(x); see :class:`_OutOfPlaceByDefault` for ``inplace``."""

    op = "tanh"


class Softmax(Module):
    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, input):
        return F.softmax(input, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class LogSoftmax(Softmax):
    def forward(self, input):
        return F.log_softmax(input, self.dim)


class Dropout(Module):
    """Zeroes elements with probability ``p`` in training (scaling the rest by 1/(1-p)).

    Identity in eval mode. ``inplace=None`` follows the policy, as :class:`ReLU`.
    """

    def __init__(self, p: float = 0.5, inplace: bool | None = None):
        super().__init__()
        if p < 0.0 or p > 1.0:  # PyTorch's test: NaN passes it, and raises in forward
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p = p
        self.inplace = inplace

    @_inplace.passes_ownership
    def forward(self, input):
        if not self.training or self.p == 0:
            return F.dropout(input, self.p, self.training)  # the identity: nothing is written
        check_probability(self.p)  # NaN: before a site consumes the input
        if self.inplace is not None:
            return F.dropout(input, self.p, True, inplace=self.inplace)
        where = _inplace.site_target(input, "Dropout")
        if where is None:
            return F.dropout(input, self.p, True)
        return F.dropout(_inplace.consume(input, "Dropout", where), self.p, True, inplace=True)

    def extra_repr(self) -> str:
        return f"p={self.p}" + ("" if self.inplace is None else f", inplace={self.inplace}")


# --- pooling and shape -----------------------------------------------------------------------


class MaxPool2d(Module):
    def __init__(self, kernel_size, stride=None, padding=0):
        super().__init__()
        self.kernel_size = kernel_size
        self.stride = stride if stride is not None else kernel_size
        self.padding = padding

    def forward(self, input):
        return F.max_pool2d(input, self.kernel_size, self.stride, self.padding)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class AvgPool2d(MaxPool2d):
    def forward(self, input):
        return F.avg_pool2d(input, self.kernel_size, self.stride, self.padding)


class AdaptiveAvgPool2d(Module):
    def __init__(self, output_size):
        super().__init__()
        self.output_size = output_size

    def forward(self, input):
        return F.adaptive_avg_pool2d(input, self.output_size)

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}"


class Flatten(Module):
    """Merges dims ``start_dim..end_dim`` (default: all but the batch dim)."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1):
        super().__init__()
        self.start_dim = start_dim
        self.end_dim = end_dim

    def forward(self, input):
        return F.flatten(input, self.start_dim, self.end_dim)

    def extra_repr(self) -> str:
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"


# --- containers -------------------------------------------------------------------------------


class Sequential(Module):
    """Runs its modules in order: ``Sequential(m1, m2)`` or ``Sequential(OrderedDict(...))``."""

    def __init__(self, *args):
        super().__init__()
        if len(args) == 1 and isinstance(args[0], OrderedDict):
            for name, module in args[0].items():
                self.add_module(name, module)
        else:
            for i, module in enumerate(args):
                self.add_module(str(i), module)

    def _index(self, idx: int) -> str:
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"index {idx} is out of range")
        return list(self._modules)[idx % n]

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return type(self)(OrderedDict(list(self._modules.items())[idx]))
        return self._modules[self._index(idx)]

    def __setitem__(self, idx: int, module: Module) -> None:
        setattr(self, self._index(idx), module)

    def __delitem__(self, idx) -> None:
        keys = list(self._modules)[idx] if isinstance(idx, slice) else [self._index(idx)]
        for k in keys:
            del self._modules[k]
        # renumber so indices stay 0..n-1, as PyTorch does
        items = list(self._modules.values())
        self._modules.clear()
        for i, m in enumerate(items):
            self._modules[str(i)] = m

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def append(self, module: Module) -> Sequential:
        self.add_module(str(len(self)), module)
        return self

    def forward(self, input):
        # Each module gets the previous one's output as a temporary (popped from a list
        # this frame no longer names), so policy auto can prove it dead and reuse it.
        chain = [input]
        del input
        for module in self._modules.values():
            chain.append(module(chain.pop()))
        return chain.pop()


class ModuleList(Module):
    """A list of modules, registered (their parameters are found), with list methods."""

    def __init__(self, modules=None):
        super().__init__()
        if modules is not None:
            self.extend(modules)

    def _key(self, idx: int) -> str:
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"index {idx} is out of range")
        return str(idx % n)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return type(self)(list(self._modules.values())[idx])
        return self._modules[self._key(idx)]

    def __setitem__(self, idx: int, module: Module) -> None:
        self.add_module(self._key(idx), module)

    def __delitem__(self, idx) -> None:
        items = list(self._modules.values())
        del items[idx]
        self._modules.clear()
        for i, m in enumerate(items):
            self._modules[str(i)] = m

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def __iadd__(self, modules):
        return self.extend(modules)

    def append(self, module: Module) -> ModuleList:
        self.add_module(str(len(self)), module)
        return self

    def extend(self, modules) -> ModuleList:
        for m in modules:
            self.append(m)
        return self

    def insert(self, index: int, module: Module) -> None:
        items = list(self._modules.values())
        items.insert(index, module)
        self._modules.clear()
        for i, m in enumerate(items):
            self.add_module(str(i), m)

    def forward(self, *args, **kwargs):
        raise NotImplementedError("ModuleList has no forward: iterate over it in your module's forward")


# --- losses --------------------------------------------------------------------------------------

_REDUCTIONS = ("mean", "sum", "none")


class _Loss(Module):
    def __init__(self, reduction: str = "mean"):
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise ValueError(f"{reduction} is not a valid value for reduction; use one of {', '.join(_REDUCTIONS)}")
        self.reduction = reduction

    def extra_repr(self) -> str:
        return "" if self.reduction == "mean" else f"reduction={self.reduction}"


class CrossEntropyLoss(_Loss):
    """Softmax cross entropy of logits ``(N, C)`` and class indices ``(N,)``."""

    def __init__(self, weight=None, *, reduction: str = "mean", label_smoothing: float = 0.0):
        super().__init__(reduction)
        if weight is not None:
            raise NotImplementedError("CrossEntropyLoss: class weights are not supported")
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be between 0.0 and 1.0, got {label_smoothing}")
        self.label_smoothing = label_smoothing

    def forward(self, input, target):
        return F.cross_entropy(input, target, reduction=self.reduction, label_smoothing=self.label_smoothing)


class NLLLoss(_Loss):
    """Negative log likelihood of log-probabilities ``(N, C)`` and class indices ``(N,)``."""

    def __init__(self, weight=None, *, reduction: str = "mean"):
        super().__init__(reduction)
        if weight is not None:
            raise NotImplementedError("NLLLoss: class weights are not supported")

    def forward(self, input, target):
        return F.nll_loss(input, target, reduction=self.reduction)


class MSELoss(_Loss):
    """Mean squared error (``reduction`` ``mean``, ``sum`` or ``none``)."""

    def __init__(self, *, reduction: str = "mean"):
        super().__init__(reduction)

    def forward(self, input, target):
        return F.mse_loss(input, target, reduction=self.reduction)


__all__ = [
    "Identity",
    "Linear",
    "Conv2d",
    "BatchNorm1d",
    "BatchNorm2d",
    "InPlaceABN",
    "ReLU",
    "LeakyReLU",
    "Sigmoid",
    "Tanh",
    "Softmax",
    "LogSoftmax",
    "Dropout",
    "MaxPool2d",
    "AvgPool2d",
    "AdaptiveAvgPool2d",
    "Flatten",
    "Sequential",
    "ModuleList",
    "CrossEntropyLoss",
    "NLLLoss",
    "MSELoss",
]
