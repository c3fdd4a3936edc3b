"""Data sets, samplers and a loader that produce plain NumPy arrays.

Everything here is NumPy only: the trainer wraps batches into tensors (and moves them to
the device) later, so this module imports neither ``framework`` nor ``models`` and never
downloads anything.

Data sets (:func:`load_dataset`):

- ``digits``: scikit-learn's bundled 8x8 handwritten digits, stratified train/test split,
  standardized with the train set's mean and std.
- ``synthetic_images``: CIFAR-shaped, class-conditional images: a smooth random template
  per class plus Gaussian noise.
- ``synthetic_regression``: ``y = x @ W + b + noise * eps`` with ``x ~ N(0, 1)``.

All randomness comes from ``np.random.default_rng`` seeded with ``[seed, stream]``, so the
same seed gives identical arrays and each stream (templates, train, test, ...) is
independent of the sizes requested for the others.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from . import text_data

__all__ = [
    "ArrayDataset",
    "DATASETS",
    "DataLoader",
    "RandomSampler",
    "Sampler",
    "load_dataset",
]

# Stream ids mixed into the seed so that, e.g., the test set does not change when
# num_train does.
_STREAM_TEMPLATES = 0
_STREAM_TRAIN = 1
_STREAM_TEST = 2
_STREAM_SPLIT = 3
_STREAM_WEIGHTS = 4


# --------------------------------------------------------------------------- data sets


@dataclass
class ArrayDataset:
    """An in-memory data set of inputs ``x`` and targets ``y`` (first axis = sample).

    Attributes:
        x: Inputs, shape ``(N, *input_shape)``.
        y: Targets: int64 labels ``(N,)`` for classification, ``(N, out)`` for regression.
        num_classes: Number of classes, or None for regression.
    """

    x: np.ndarray
    y: np.ndarray
    num_classes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.x, np.ndarray) or not isinstance(self.y, np.ndarray):
            raise TypeError(
                f"ArrayDataset needs NumPy arrays, got x: {type(self.x).__name__}, y: {type(self.y).__name__}"
            )
        if self.x.ndim < 1 or self.y.ndim < 1 or len(self.x) != len(self.y):
            raise ValueError(
                f"ArrayDataset: x and y need the same number of samples on axis 0, got "
                f"x.shape={self.x.shape}, y.shape={self.y.shape}"
            )

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: Any) -> tuple[np.ndarray, np.ndarray]:
        """Returns ``(x[index], y[index])``; an index array gives copies (fancy indexing)."""
        return self.x[index], self.y[index]

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one input sample, e.g. ``(1, 8, 8)``."""
        return tuple(self.x.shape[1:])


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_float(name: str, value: Any, low: float, high: float | None = None, open_interval: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if open_interval:
        ok = low < value and (high is None or value < high)
        bounds = f"in ({low}, {high})"
    else:
        ok = low <= value and (high is None or value <= high)
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
    if not ok or not math.isfinite(value):
        raise ValueError(f"{name} must be {bounds}, got {value}")
    return value


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])


def _load_digits(seed: int, test_fraction: float = 0.2) -> tuple[ArrayDataset, ArrayDataset]:
    """Digits (1797 images, 10 classes): stratified split, train-standardized."""
    from sklearn.datasets import load_digits  # bundled with scikit-learn: no download

    test_fraction = _check_float("test_fraction", test_fraction, 0.0, 1.0, open_interval=True)
    bunch = load_digits()
    images = np.asarray(bunch.data, dtype=np.float64).reshape(-1, 1, 8, 8)
    labels = np.asarray(bunch.target, dtype=np.int64)
    num_classes = int(labels.max()) + 1

    # Stratified shuffle split: per class, a seeded permutation; at least one sample of
    # every class lands on each side.
    rng = _rng(seed, _STREAM_SPLIT)
    test_parts = []
    for c in range(num_classes):
        members = np.flatnonzero(labels == c)
        n_test = min(max(round(len(members) * test_fraction), 1), len(members) - 1)
        test_parts.append(rng.permutation(members)[:n_test])
    is_test = np.zeros(len(labels), dtype=bool)
    is_test[np.concatenate(test_parts)] = True
    train_idx = rng.permutation(np.flatnonzero(~is_test))
    test_idx = rng.permutation(np.flatnonzero(is_test))

    train_x = images[train_idx]
    mean, std = train_x.mean(), train_x.std()

    def make(idx: np.ndarray, x: np.ndarray) -> ArrayDataset:
        x = ((x - mean) / std).astype(np.float32)
        return ArrayDataset(x, labels[idx].copy(), num_classes=num_classes)

    return make(train_idx, train_x), make(test_idx, images[test_idx])


def _interp_matrix(size: int, low: int) -> np.ndarray:
    """(size, low) matrix of linear-interpolation weights (align_corners=True)."""
    if low == 1:
        return np.ones((size, 1))
    pos = np.linspace(0.0, low - 1, size)
    left = np.minimum(np.floor(pos).astype(np.int64), low - 2)
    frac = pos - left
    m = np.zeros((size, low))
    rows = np.arange(size)
    m[rows, left] = 1.0 - frac
    m[rows, left + 1] = frac
    return m


def _balanced_labels(rng: np.random.Generator, n: int, num_classes: int) -> np.ndarray:
    # Counts differ by at most one between classes; order is random.
    return rng.permutation(np.arange(n, dtype=np.int64) % num_classes)


def _load_synthetic_images(
    seed: int,
    num_train: int = 10000,
    num_test: int = 2000,
    image_size: int = 32,
    channels: int = 3,
    num_classes: int = 10,
    noise: float = 1.0,
) -> tuple[ArrayDataset, ArrayDataset]:
    """Class templates (smooth, unit std) plus ``noise`` times Gaussian noise."""
    num_train = _check_int("num_train", num_train, 1)
    num_test = _check_int("num_test", num_test, 1)
    image_size = _check_int("image_size", image_size, 1)
    channels = _check_int("channels", channels, 1)
    num_classes = _check_int("num_classes", num_classes, 2)
    noise = _check_float("noise", noise, 0.0)

    # Smooth templates: a coarse random grid bilinearly upsampled (separable, so two
    # matrix products), then normalized per class so the signal-to-noise ratio depends
    # on `noise` alone.
    low = max(1, min(4, image_size))
    coarse = _rng(seed, _STREAM_TEMPLATES).standard_normal((num_classes, channels, low, low))
    up = _interp_matrix(image_size, low)
    templates = up @ coarse @ up.T  # (K, C, H, W)
    templates -= templates.mean(axis=(1, 2, 3), keepdims=True)
    templates /= templates.std(axis=(1, 2, 3), keepdims=True) + 1e-12
    templates = templates.astype(np.float32)

    def make(n: int, stream: int) -> ArrayDataset:
        rng = _rng(seed, stream)
        y = _balanced_labels(rng, n, num_classes)
        x = rng.standard_normal((n, channels, image_size, image_size), dtype=np.float32)
        if noise != 1.0:
            x *= np.float32(noise)
        x += templates[y]
        return ArrayDataset(x, y, num_classes=num_classes)

    return make(num_train, _STREAM_TRAIN), make(num_test, _STREAM_TEST)


def _load_synthetic_regression(
    seed: int,
    num_train: int = 4096,
    num_test: int = 1024,
    in_features: int = 32,
    out_features: int = 1,
    noise: float = 0.1,
) -> tuple[ArrayDataset, ArrayDataset]:
    """Linear regression with Gaussian noise (``noise`` defaults to 0.1)."""
    num_train = _check_int("num_train", num_train, 1)
    num_test = _check_int("num_test", num_test, 1)
    in_features = _check_int("in_features", in_features, 1)
    out_features = _check_int("out_features", out_features, 1)
    noise = _check_float("noise", noise, 0.0)

    wrng = _rng(seed, _STREAM_WEIGHTS)
    # Scaled so y has roughly unit variance before the noise, whatever in_features is.
    w = wrng.standard_normal((in_features, out_features)) / math.sqrt(in_features)
    b = wrng.standard_normal(out_features)
    w, b = w.astype(np.float32), b.astype(np.float32)

    def make(n: int, stream: int) -> ArrayDataset:
        rng = _rng(seed, stream)
        x = rng.standard_normal((n, in_features), dtype=np.float32)
        eps = rng.standard_normal((n, out_features), dtype=np.float32)
        y = x @ w + b + np.float32(noise) * eps
        return ArrayDataset(x, y.astype(np.float32, copy=False), num_classes=None)

    return make(num_train, _STREAM_TRAIN), make(num_test, _STREAM_TEST)


#: name -> (loader, its option names).
DATASETS: dict[str, tuple[Callable[..., tuple[Any, Any]], tuple[str, ...]]] = {
    "digits": (_load_digits, ("test_fraction",)),
    "synthetic_images": (
        _load_synthetic_images,
        ("num_train", "num_test", "image_size", "channels", "num_classes", "noise"),
    ),
    "synthetic_regression": (
        _load_synthetic_regression,
        ("num_train", "num_test", "in_features", "out_features", "noise"),
    ),
    "text": (text_data.load_text, text_data.OPTIONS),  # any UTF-8 file (trainers/text_data.py)
}


def load_dataset(name: str, *, seed: int = 0, **options: Any) -> tuple[ArrayDataset, ArrayDataset]:
    """Builds the (train, test) data sets called ``name``.

    Args:
        name: One of ``digits``, ``synthetic_images``, ``synthetic_regression``.
        seed: Non-negative integer; the same seed gives identical arrays.
        **options: Data-set specific options (see the module docstring and the
            ``_load_*`` functions for names and defaults).

    Returns:
        ``(train, test)`` ArrayDatasets.

    Raises:
        ValueError: Unknown name, unknown option, or an invalid option value.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(sorted(DATASETS))}")
    seed = _check_int("seed", seed, 0)
    fn, allowed = DATASETS[name]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for dataset {name!r}; valid options: {', '.join(allowed)}"
        )
    return fn(seed, **options)


# --------------------------------------------------------------------------- samplers


class Sampler(Protocol):
    """Anything with ``indices(epoch)`` returning the 1-D int index array of that epoch."""

    def indices(self, epoch: int) -> np.ndarray: ...


class RandomSampler:
    """Seeded, epoch-aware order over ``range(num_samples)``.

    Args:
        num_samples: Number of samples in the data set.
        shuffle: Permute per epoch; otherwise ``arange(num_samples)``.
        seed: Non-negative integer; epoch ``e`` uses ``default_rng([seed, e])``.
    """

    def __init__(self, num_samples: int, shuffle: bool = True, seed: int = 0) -> None:
        self.num_samples = _check_int("num_samples", num_samples, 0)
        self.shuffle = bool(shuffle)
        self.seed = _check_int("seed", seed, 0)

    def __len__(self) -> int:
        return self.num_samples

    def indices(self, epoch: int) -> np.ndarray:
        """The int64 index array of ``epoch`` (reproducible, different per epoch)."""
        epoch = _check_int("epoch", epoch, 0)
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)


# --------------------------------------------------------------------------- loader


class DataLoader:
    """Batches of ``(x, y)`` NumPy arrays, resumable mid-epoch.

    Iteration: ``iter(loader)`` yields the *rest of the current epoch*, starting at the
    saved batch, then advances to the next epoch. So ``for epoch ...: for x, y in loader``
    walks consecutive epochs, and a loader restored with :meth:`load_state_dict`
    continues exactly where the saved one stopped. The position is advanced *before* a
    batch is handed out, so :meth:`state_dict` taken after consuming a batch always names
    the next batch to produce (after the last batch of epoch ``e`` it is ``(e + 1, 0)``).
    Breaking out of the loop keeps the position; the next ``iter`` resumes there. An
    iterator stops early if the position is changed under it (``set_epoch``,
    ``load_state_dict``, or another iterator); use one iterator at a time.

    Batches are built by fancy indexing, so they are fresh copies: inplace ops on a batch
    never touch the data set.

    Args:
        dataset: An :class:`ArrayDataset` (or anything with ``__len__`` and
            ``__getitem__(index_array) -> (x, y)``).
        batch_size: Samples per batch, >= 1.
        shuffle: Shuffle each epoch (ignored when ``sampler`` is given).
        seed: Seed of the default :class:`RandomSampler` (ignored with ``sampler``).
        drop_last: Drop the last, incomplete batch of each epoch.
        sampler: Object with ``indices(epoch)``, e.g. a ``DistributedSampler``; its
            indices must lie in ``[0, len(dataset))``.

    Raises:
        ValueError: Bad batch_size, a sampler out of range, or no batch per epoch.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        sampler: Sampler | None = None,
    ) -> None:
        self.dataset = dataset
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.drop_last = bool(drop_last)
        if sampler is None:
            sampler = RandomSampler(len(dataset), shuffle=shuffle, seed=seed)
        elif not callable(getattr(sampler, "indices", None)):
            raise TypeError(f"sampler must have an indices(epoch) method, got {type(sampler).__name__}")
        self.sampler = sampler
        self._epoch = 0
        self._batch = 0
        self._cache: tuple[int, np.ndarray] | None = None
        if len(self) == 0:
            raise ValueError(
                f"DataLoader would yield no batches per epoch ({len(self._indices(0))} "
                f"samples, batch_size={self.batch_size}, drop_last={self.drop_last}); "
                "use a smaller batch_size or drop_last=False"
            )

    # -- position

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return self._epoch

    @property
    def batch(self) -> int:
        """Index, within :attr:`epoch`, of the next batch to produce."""
        return self._batch

    def set_epoch(self, epoch: int) -> None:
        """Moves to the first batch of ``epoch``, unless already inside ``epoch``.

        Keeping the position when ``epoch`` is the current one makes the PyTorch-style
        ``loader.set_epoch(e); for batch in loader`` loop resume-safe: after
        :meth:`load_state_dict` mid-epoch, ``set_epoch`` of that epoch does not restart
        it. To restart the current epoch, ``load_state_dict({"epoch": e, "batch": 0})``.
        """
        epoch = _check_int("epoch", epoch, 0)
        if epoch != self._epoch:
            self._epoch, self._batch = epoch, 0

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "batch"}`` of the next batch to be produced."""
        return {"epoch": self._epoch, "batch": self._batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restores a position saved by :meth:`state_dict`."""
        if not isinstance(state, dict) or set(state) != {"epoch", "batch"}:
            raise ValueError(f"DataLoader state must be a dict with keys 'epoch' and 'batch', got {state!r}")
        epoch = _check_int("state['epoch']", state["epoch"], 0)
        batch = _check_int("state['batch']", state["batch"], 0)
        n = self._num_batches(epoch)
        if batch > n:
            raise ValueError(
                f"state['batch']={batch} is past the end of epoch {epoch} ({n} batches); "
                "was the state saved with another batch_size, data set or sampler?"
            )
        if batch == n:  # the epoch was finished: normalize to the start of the next one
            epoch, batch = epoch + 1, 0
        self._epoch, self._batch = epoch, batch

    # -- iteration

    def _indices(self, epoch: int) -> np.ndarray:
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        idx = np.asarray(self.sampler.indices(epoch))
        if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
            raise ValueError(
                f"sampler.indices({epoch}) must be a 1-D integer array, got shape {idx.shape} dtype {idx.dtype}"
            )
        n = len(self.dataset)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise ValueError(
                f"sampler.indices({epoch}) has indices in [{idx.min()}, {idx.max()}] but "
                f"the data set has {n} samples; build the sampler for this data set"
            )
        idx = idx.astype(np.int64, copy=False)
        self._cache = (epoch, idx)
        return idx

    def _num_batches(self, epoch: int) -> int:
        n = len(self._indices(epoch))
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __len__(self) -> int:
        """Batches per epoch (of the current epoch, for a sampler whose size varies)."""
        return self._num_batches(self._epoch)

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        epoch, start = self._epoch, self._batch
        idx = self._indices(epoch)
        n = self._num_batches(epoch)
        bs = self.batch_size
        if start >= n:  # nothing left (e.g. set by hand): move on
            self._epoch, self._batch = epoch + 1, 0
            return
        for b in range(start, n):
            batch = self.dataset[idx[b * bs : (b + 1) * bs]]
            position = (epoch + 1, 0) if b + 1 == n else (epoch, b + 1)
            self._epoch, self._batch = position
            yield batch
            if (self._epoch, self._batch) != position:
                return  # the position was changed under us: this iterator is stale
