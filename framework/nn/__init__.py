"""Neural network building blocks with ``torch.nn``'s names: ``from framework import nn``.

``nn.Module`` and ``nn.Parameter``, the layers (``nn.Linear``, ``nn.Conv2d``,
``nn.BatchNorm2d``, ``nn.InPlaceABN``, ``nn.ReLU``, ``nn.Embedding``, ``nn.LayerNorm``,
``nn.GELU``, ...), ``nn.functional`` (``F``) and
``nn.init``. Activation and dropout modules built with ``inplace=None`` follow the
inplace policy of :mod:`framework.inplace`.
"""

from . import functional, init
from .layers import (
    AdaptiveAvgPool2d,
    AvgPool2d,
    BatchNorm1d,
    BatchNorm2d,
    Conv2d,
    CrossEntropyLoss,
    Dropout,
    Flatten,
    Identity,
    InPlaceABN,
    LeakyReLU,
    Linear,
    LogSoftmax,
    MaxPool2d,
    ModuleList,
    MSELoss,
    NLLLoss,
    ReLU,
    Sequential,
    Sigmoid,
    Softmax,
    Tanh,
)
from .layers_transformer import GELU, Embedding, LayerNorm
from .module import Module
from .parameter import Parameter

__all__ = [
    "functional",
    "init",
    "Module",
    "Parameter",
    "AdaptiveAvgPool2d",
    "AvgPool2d",
    "BatchNorm1d",
    "BatchNorm2d",
    "Conv2d",
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "GELU",
    "LayerNorm",
    "Flatten",
    "Identity",
    "InPlaceABN",
    "LeakyReLU",
    "Linear",
    "LogSoftmax",
    "MaxPool2d",
    "ModuleList",
    "MSELoss",
    "NLLLoss",
    "ReLU",
    "Sequential",
    "Sigmoid",
    "Softmax",
    "Tanh",
]
