"""inplace-lab: a small training framework that shows what inplace operations save.

``import framework as fw``: tensors and creation functions, the functional ops, autograd,
memory accounting and the inplace policy. ``fw.nn`` and ``fw.optim`` hold modules and
optimizers.
"""

from . import backend, memory
from . import inplace
from .tensor import Tensor
from . import autograd
from .autograd import detect_anomaly, enable_grad, is_grad_enabled, no_grad, set_grad_enabled
from .creation import (
    DEFAULT_DTYPE,
    arange,
    bool_,
    empty,
    empty_like,
    eye,
    float16,
    float32,
    float64,
    from_numpy,
    full,
    int32,
    int64,
    manual_seed,
    ones,
    ones_like,
    rand,
    randn,
    randn_like,
    tensor,
    zeros,
    zeros_like,
)
from .backend import device, is_cuda_available
from .ops import (
    abs,
    add,
    amax,
    argmax,
    cat,
    clamp,
    clone,
    cos,
    div,
    exp,
    flatten,
    leaky_relu,
    log,
    log_softmax,
    matmul,
    max,
    maximum,
    mean,
    mul,
    neg,
    permute,
    pow,
    relu,
    reshape,
    sigmoid,
    sin,
    softmax,
    sqrt,
    squeeze,
    stack,
    sub,
    sum,
    tanh,
    transpose,
    unsqueeze,
    var,
    where,
)

bool = bool_  # noqa: A001  (fw.bool, as torch.bool)

from . import nn, optim  # noqa: E402  (they build on everything above)
from . import random  # noqa: E402,F401
from .compile import compile  # noqa: E402,A004  (fw.compile, like torch.compile; above nn and optim)

inplace.calibrate()  # policy auto's reference counts, measured on this interpreter
