"""Automatic mixed precision, as ``torch.amp``: ``fw.amp.autocast`` (also ``fw.autocast``)
and ``fw.amp.GradScaler``. See docs/PRECISION.md."""

from ..ops.autocast import autocast
from .grad_scaler import GradScaler, OptState

__all__ = ["autocast", "GradScaler", "OptState"]
