"""Utilities over the autograd engine, with PyTorch's names (``torch.utils``):
:mod:`.checkpoint` (activation checkpointing and selective recomputation)."""

from . import checkpoint

__all__ = ["checkpoint"]
