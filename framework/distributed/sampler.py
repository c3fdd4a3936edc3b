"""Seeded, epoch-aware sharding of a dataset's indices across data-parallel ranks."""

from __future__ import annotations

import operator
from collections.abc import Iterator

import numpy as np

__all__ = ["DistributedSampler"]


def _as_int(value, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got a bool ({value})")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} ({value!r})") from None


class DistributedSampler:
    """Splits ``range(num_samples)`` into one shard per rank, the same way on every rank.

    Each epoch, every rank draws the same permutation from
    ``np.random.default_rng([seed, epoch])`` (``arange`` when ``shuffle=False``), so the
    ranks agree without communicating. Then, as in PyTorch's ``DistributedSampler``:

    - ``drop_last=True``: the permutation is cut to ``total_size = (num_samples //
      num_replicas) * num_replicas``; the last ``num_samples % num_replicas`` samples of
      the permutation are skipped this epoch.
    - ``drop_last=False``: the permutation is padded to ``total_size = ceil(num_samples /
      num_replicas) * num_replicas`` by wrapping around: the ``total_size - num_samples``
      (< ``num_replicas``) extra entries are the permutation's first entries, repeated
      (cycling again if ``num_samples < num_replicas``). Those samples are seen twice.

    Rank ``r`` takes ``padded[r::num_replicas]``: every rank gets ``len(self)`` indices,
    and apart from the padding every sample goes to exactly one rank.

    Unlike PyTorch, ``num_samples`` is the dataset length (PyTorch's ``num_samples`` is
    the per-rank count, here ``len(self)``).

    Args:
        num_samples: number of samples in the dataset (>= 0).
        num_replicas: number of ranks (>= 1).
        rank: this rank, in ``[0, num_replicas)``.
        shuffle: draw a fresh permutation each epoch; else keep the dataset order.
        seed: non-negative seed, identical on every rank.
        drop_last: drop the tail instead of padding it.
    """

    def __init__(
        self,
        num_samples: int,
        num_replicas: int,
        rank: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        num_samples = _as_int(num_samples, "num_samples")
        num_replicas = _as_int(num_replicas, "num_replicas")
        rank = _as_int(rank, "rank")
        seed = _as_int(seed, "seed")
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas - 1}] for num_replicas={num_replicas}, got {rank}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.num_samples = num_samples
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.epoch = 0
        if self.drop_last:
            self.samples_per_replica = num_samples // num_replicas
        else:
            self.samples_per_replica = -(-num_samples // num_replicas)
        self.total_size = self.samples_per_replica * num_replicas

    @property
    def num_padding(self) -> int:
        """How many indices are repeated per epoch to even out the shards (0 with drop_last)."""
        return max(self.total_size - self.num_samples, 0)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose permutation ``iter(self)`` yields; call it every epoch."""
        self.epoch = self._check_epoch(epoch)

    def indices(self, epoch: int | None = None) -> np.ndarray:
        """This rank's indices for ``epoch`` (default: the one set by :meth:`set_epoch`).

        Returns:
            An int64 array of length ``len(self)``.
        """
        epoch = self.epoch if epoch is None else self._check_epoch(epoch)
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        else:
            order = np.arange(self.num_samples)
        order = order.astype(np.int64, copy=False)
        if self.total_size <= self.num_samples:
            order = order[: self.total_size]
        else:  # pad by wrapping around; num_samples > 0 here since total_size > 0
            order = np.resize(order, self.total_size)
        return order[self.rank :: self.num_replicas].copy()

    def __len__(self) -> int:
        return self.samples_per_replica

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices(self.epoch).tolist())

    def __repr__(self) -> str:
        return (
            f"DistributedSampler(num_samples={self.num_samples}, num_replicas={self.num_replicas}, "
            f"rank={self.rank}, shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last}, "
            f"epoch={self.epoch})"
        )

    @staticmethod
    def _check_epoch(epoch: int) -> int:
        epoch = _as_int(epoch, "epoch")
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        return epoch
