"""inplace-lab: a small training framework that shows what inplace operations save.

``import framework as fw``: tensors and creation functions, the functional ops, autograd,
memory accounting and the inplace policy. ``fw.nn`` and ``fw.optim`` hold modules and
optimizers, ``fw.utils.checkpoint`` activation checkpointing.
"""

from . import autograd, backend, inplace, memory
from .autograd import (
    detect_anomaly,
    enable_grad,
    inference_mode,
    is_grad_enabled,
    is_inference_mode_enabled,
    no_grad,
    set_grad_enabled,
)
from .backend import device, is_cuda_available
from .creation import (
    DEFAULT_DTYPE,
    arange,
    bfloat16,
    bool_,
    empty,
    empty_like,
    eye,
    float16,
    float32,
    float64,
    from_numpy,
    full,
    full_like,
    int8,
    int16,
    int32,
    int64,
    manual_seed,
    ones,
    ones_like,
    rand,
    rand_like,
    randn,
    randn_like,
    tensor,
    uint8,
    zeros,
    zeros_like,
)
from .ops import (
    abs,
    add,
    allclose,
    amax,
    argmax,
    as_strided,
    cat,
    chunk,
    clamp,
    clone,
    cos,
    div,
    exp,
    flatten,
    leaky_relu,
    log,
    log_softmax,
    masked_fill,
    matmul,
    max,
    maximum,
    mean,
    mul,
    multinomial,
    narrow,
    neg,
    permute,
    pow,
    relu,
    reshape,
    select,
    sigmoid,
    sin,
    softmax,
    split,
    split_with_sizes,
    sqrt,
    squeeze,
    stack,
    sub,
    sum,
    swapaxes,
    swapdims,
    tanh,
    transpose,
    tril,
    triu,
    unbind,
    unsqueeze,
    var,
    where,
)
from .ops.autocast import (
    autocast,
    clear_autocast_cache,
    get_autocast_dtype,
    is_autocast_cache_enabled,
    is_autocast_enabled,
)
from .tensor import Tensor

bool = bool_  # noqa: A001  (fw.bool, as torch.bool)


def is_inference(t: Tensor):
    """True for a tensor made inside :class:`inference_mode`."""
    return t.is_inference()


from . import (  # noqa: E402  (they build on everything above)
    amp,
    nn,
    optim,
    random,  # noqa: E402,F401
    utils,  # noqa: E402,F401
)
from .compile import compile  # noqa: E402,A004  (fw.compile, like torch.compile; above nn and optim)
from .nn import functional as _F  # noqa: E402
from .nn.module import Module as _Module  # noqa: E402


def _calibrate_auto() -> None:
    """Policy auto's reference counts, measured on this interpreter through the real
    entry points (see framework.inplace.proof)."""

    class _SiteProbe(_Module):  # a site, as nn.ReLU is one
        @inplace.passes_ownership
        def forward(self, input, residual=None):
            at = inplace.site_target(input, "calibration")
            return input if at is None else inplace.consume(input, "calibration", at)

    class _OpProbe(_Module):  # a module whose forward calls an op
        @inplace.passes_ownership
        def forward(self, input, residual=None):
            return neg(input)

    inplace.calibrate(
        Tensor=Tensor,
        make=lambda: zeros(2),
        neg=neg,
        add=add,
        relu=_F.relu,
        residual_add=_F.residual_add,
        site=_SiteProbe(),
        op_module=_OpProbe(),
        module_call=_Module.__call__,
    )


_calibrate_auto()
