"""The model registry: ``build_model(name, **kwargs)`` builds a registered model.

The config system passes ``model.name`` and ``model.args`` straight to
:func:`build_model`, so its errors are user-facing: an unknown name or an unknown
keyword raises ``ValueError`` with a did-you-mean and the valid choices. Register a
model (a class or a factory function) with the :func:`register_model` decorator::

    @register_model("mlp")
    class MLP(nn.Module): ...

    model = build_model("mlp", hidden=[64, 64])   # lists from YAML are fine

Registered here: ``mlp``, ``convnet``, ``resnet`` and the CIFAR ResNets ``resnet8``,
``resnet14``, ``resnet20``, ``resnet32`` (``resnet`` with a fixed depth), and ``gpt``
(nanoGPT's language model).
"""

from __future__ import annotations

from . import convnet, gpt, mlp, resnet  # noqa: F401  (importing a model's module registers it)
from .convnet import ConvNet
from .gpt import GPT
from .mlp import MLP
from .registry import available_models, build_model, model_signature, register_model
from .resnet import ResNet

__all__ = ["GPT", "MLP", "ConvNet", "ResNet", "available_models", "build_model", "model_signature", "register_model"]
