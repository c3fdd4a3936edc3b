"""Optimizers with ``torch.optim``'s names and update rules: ``SGD``, ``Adam``, ``AdamW``.

``step()`` is an inplace site: under the policy ``on`` parameters and state are updated
in place (versions bump), under ``off`` they are rebound to new storage (the version of
each parameter bumps too). Both give identical results.
"""

from .adam import Adam, AdamW
from .optimizer import Optimizer, required
from .sgd import SGD

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "required"]
