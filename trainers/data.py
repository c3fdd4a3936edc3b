"""Data sets, samplers and a loader that produce plain NumPy arrays.

Everything here is NumPy only: the trainer wraps batches into tensors (and moves them to
the device) later, so this module imports neither ``framework`` nor ``models`` and never
downloads anything.

Data sets (:func:`load_dataset`; :data:`DATASETS` is the registry, one entry each):

- ``digits``: scikit-learn's bundled 8x8 handwritten digits, stratified train/test split,
  standardized with the train set's mean and std.
- ``synthetic_images``: CIFAR-shaped, class-conditional images: a smooth random template
  per class plus Gaussian noise.
- ``synthetic_regression``: ``y = x @ W + b + noise * eps`` with ``x ~ N(0, 1)``.
- ``npz``: a user's arrays ``x`` and ``y`` from a ``.npz`` file or a folder of ``.npy``
  files (memory-mapped), with a second set for evaluation or a held-out fraction.
- ``cifar10``, ``cifar100``: the binary version of CIFAR-10/100 from a folder, read as
  bytes (never unpickled), normalized per channel with the data sets' usual mean and std.

Files are read with ``numpy.load(allow_pickle=False)`` or as raw bytes: nothing loaded can
run code. A file that is missing, cut short, of the wrong shape or type, or holds labels
out of range raises :class:`DataError` with one line that names the file and what to fix.

Any image set can be augmented (``augment=True``): a random crop after 4 pixels of zero
padding and a left-right flip per training sample, drawn from ``(seed, epoch, sample)``:
the same for any number of processes and for a resumed run (:class:`RandomCropFlip`).

All randomness comes from ``np.random.default_rng`` seeded with ``[seed, stream]``, so the
same seed gives identical arrays and each stream (templates, train, test, ...) is
independent of the sizes requested for the others.
"""

from __future__ import annotations

import math
import numbers
import os
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from . import text_data

__all__ = [
    "ArrayDataset",
    "DATASETS",
    "DataError",
    "DataLoader",
    "RandomCropFlip",
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
_STREAM_AUGMENT = 5


class DataError(ValueError):
    """A data set that cannot be read as configured (a one-line message naming the file)."""


# --------------------------------------------------------------------------- data sets


@dataclass
class ArrayDataset:
    """A data set of inputs ``x`` and targets ``y`` (first axis = sample).

    ``x`` may be a read-only memory map of a file and of any numeric type: batches are
    built from it on demand (``prepare`` makes them the model's float32 inputs), so only
    the batches in use are in memory.

    Attributes:
        x: Inputs, shape ``(N, *input_shape)``.
        y: Targets: int64 labels ``(N,)`` for classification, ``(N, out)`` for regression.
        num_classes: Number of classes, or None for regression.
        rows: The samples of ``x`` and ``y`` this set holds (a split of one file, without
            copying it), or None for all of them.
        prepare: Turns a batch of ``x`` into the model's input (e.g. bytes to normalized
            float32); None: batches are ``x``'s own values.
        augment: Applied to training batches before ``prepare`` (:class:`RandomCropFlip`).
    """

    x: np.ndarray
    y: np.ndarray
    num_classes: int | None = None
    rows: np.ndarray | None = None
    prepare: Callable[[np.ndarray], np.ndarray] | None = None
    augment: Callable[[np.ndarray, np.ndarray, int], np.ndarray] | None = None

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
        return len(self.x) if self.rows is None else len(self.rows)

    def __getitem__(self, index: Any) -> tuple[np.ndarray, np.ndarray]:
        """Returns ``(x[index], y[index])`` as the model takes them; an index array gives copies."""
        return self.batch(index)

    def batch(self, index: Any, epoch: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The samples ``index`` (an index array or a slice), augmented when ``epoch`` is given.

        Args:
            index: Positions in this set.
            epoch: The training epoch the batch belongs to; None (evaluation): not augmented.
        """
        rows = index if self.rows is None else self.rows[index]
        x, y = self.x[rows], self.y[rows]
        if self.augment is not None and epoch is not None:
            samples = np.arange(len(self))[index] if isinstance(index, slice) else np.asarray(index)
            x = self.augment(x, samples, epoch)
        if self.prepare is not None:
            x = self.prepare(x)
        return x, y

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one input sample, e.g. ``(1, 8, 8)``."""
        return tuple(self.x.shape[1:])

    @property
    def target_shape(self) -> tuple[int, ...]:
        """Shape of one target: ``()`` for a label, ``(out,)`` for regression."""
        return tuple(self.y.shape[1:])


class RandomCropFlip:
    """The standard CIFAR augmentation: a random crop after zero padding, and a left-right flip.

    Each training sample of each epoch gets its crop offset and flip from
    ``default_rng([seed, stream, epoch])``, drawn for the whole epoch at once and indexed
    by the sample: the same images whatever the batch size, the number of processes, or
    where a resumed run picks up. Padding is zero in the stored values (black pixels of
    a byte image, as the usual ``RandomCrop(32, padding=4)`` transform before ``Normalize``).

    Args:
        num_samples: Samples of the training set.
        seed: The run's seed.
        padding: Pixels of padding on each side (4: the crop moves up to 4 pixels each way).
    """

    def __init__(self, num_samples: int, seed: int, padding: int = 4) -> None:
        self.num_samples = _check_int("num_samples", num_samples, 1)
        self.seed = _check_int("seed", seed, 0)
        self.padding = _check_int("padding", padding, 0)
        self._epoch: tuple[int, np.ndarray, np.ndarray] | None = None

    def draws(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Every sample's crop offset ``(N, 2)`` in ``[0, 2 * padding]`` and flip ``(N,)`` in ``epoch``."""
        if self._epoch is None or self._epoch[0] != epoch:
            rng = np.random.default_rng([self.seed, _STREAM_AUGMENT, epoch])
            offsets = rng.integers(0, 2 * self.padding + 1, size=(self.num_samples, 2))
            flips = rng.random(self.num_samples) < 0.5
            self._epoch = (epoch, offsets, flips)
        return self._epoch[1], self._epoch[2]

    def __call__(self, x: np.ndarray, samples: np.ndarray, epoch: int) -> np.ndarray:
        """Crops and flips the images ``x`` (``(B, C, H, W)``) of ``samples`` in ``epoch``."""
        offsets, flips = self.draws(epoch)
        b, c, h, w = x.shape
        p = self.padding
        padded = np.zeros((b, c, h + 2 * p, w + 2 * p), dtype=x.dtype)
        padded[:, :, p : p + h, p : p + w] = x
        rows = offsets[samples, 0][:, None] + np.arange(h)  # (B, H)
        cols = offsets[samples, 1][:, None] + np.arange(w)  # (B, W)
        cols = np.where(flips[samples][:, None], cols[:, ::-1], cols)
        # One gather: out[i, ch, r, q] = padded[i, ch, rows[i, r], cols[i, q]].
        return padded[
            np.arange(b)[:, None, None, None],
            np.arange(c)[None, :, None, None],
            rows[:, None, :, None],
            cols[:, None, None, :],
        ]


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


def _split(targets: np.ndarray, num_classes: int | None, test_fraction: float, rng) -> tuple[np.ndarray, ...]:
    """Seeded (train, test) index arrays holding out ``test_fraction`` of the samples.

    With class labels (``num_classes`` given), stratified: per class a seeded permutation,
    so every class of two samples or more lands on both sides. For regression targets, one
    permutation. Each side gets at least one sample.
    """
    n = len(targets)
    if num_classes is None:
        order = rng.permutation(n)
        n_test = min(max(round(n * test_fraction), 1), n - 1)
        return order[n_test:], order[:n_test]
    test_parts = []
    for c in range(num_classes):
        members = np.flatnonzero(targets == c)
        if len(members) < 2:  # a class of one sample: training only
            continue
        n_test = min(max(round(len(members) * test_fraction), 1), len(members) - 1)
        test_parts.append(rng.permutation(members)[:n_test])
    is_test = np.zeros(n, dtype=bool)
    if test_parts:
        is_test[np.concatenate(test_parts)] = True
    return rng.permutation(np.flatnonzero(~is_test)), rng.permutation(np.flatnonzero(is_test))


def _load_digits(seed: int, test_fraction: float = 0.2) -> tuple[ArrayDataset, ArrayDataset]:
    """Digits (1797 images, 10 classes): stratified split, train-standardized."""
    from sklearn.datasets import load_digits  # bundled with scikit-learn: no download

    test_fraction = _check_float("test_fraction", test_fraction, 0.0, 1.0, open_interval=True)
    bunch = load_digits()
    images = np.asarray(bunch.data, dtype=np.float64).reshape(-1, 1, 8, 8)
    labels = np.asarray(bunch.target, dtype=np.int64)
    num_classes = int(labels.max()) + 1

    train_idx, test_idx = _split(labels, num_classes, test_fraction, _rng(seed, _STREAM_SPLIT))
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


# --------------------------------------------------------------------------- a user's arrays (npz)


def _as_float32(x: np.ndarray) -> np.ndarray:
    """A batch as the model's input: a new, writable float32 array (never a view of a file)."""
    return np.array(x, dtype=np.float32)


def _read_failure(key: str, path: str, error: Exception) -> DataError:
    """One line for a file NumPy could not read (its own messages suggest unpickling: never here)."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    if "pickle" in text or "Python objects" in text or "Object arrays" in text:
        reason = (
            "it holds Python objects (pickled data), which could run code when loaded, so it is not read; "
            "save plain numeric arrays (numpy.save, numpy.savez)"
        )
    elif "mmap length" in text or "could only read" in text or "EOF" in text or isinstance(error, EOFError):
        reason = f"it is cut short ({os.path.getsize(path):,} bytes; {text}); write it again"
    else:
        reason = f"{text}; it must be a .npz archive or .npy files written by NumPy"
    return DataError(f"{key}: cannot read {path}: {reason}")


def _read_arrays(path: str, x_name: str, y_name: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` from a ``.npz`` file (read into memory: its members are zip entries) or a
    folder of ``<x_name>.npy`` and ``<y_name>.npy`` (memory-mapped, read only)."""
    if not os.path.exists(path):
        raise DataError(f"{key}: {path} does not exist; give a .npz file or a folder of {x_name}.npy and {y_name}.npy")
    if os.path.isdir(path):
        arrays = []
        for name in (x_name, y_name):
            file = os.path.join(path, name + ".npy")
            if not os.path.isfile(file):
                present = sorted(f for f in os.listdir(path) if f.endswith(".npy"))
                raise DataError(
                    f"{key}: {path} has no {name}.npy (it has: {', '.join(present) or 'no .npy file'}); "
                    f"a folder needs {x_name}.npy and {y_name}.npy (data.x_name, data.y_name)"
                )
            try:
                arrays.append(np.load(file, mmap_mode="r", allow_pickle=False))
            except (ValueError, OSError, EOFError) as e:
                raise _read_failure(key, file, e) from None
        return arrays[0], arrays[1]
    if path.endswith(".npy"):
        raise DataError(
            f"{key}: {path} is one .npy file, which holds one array; give the folder of {x_name}.npy and "
            f"{y_name}.npy, or a .npz file with both"
        )
    try:
        with np.load(path, allow_pickle=False) as archive:
            if not isinstance(archive, np.lib.npyio.NpzFile):
                raise DataError(f"{key}: {path} is not a .npz archive; give a .npz file or a folder of .npy files")
            for name in (x_name, y_name):
                if name not in archive.files:
                    raise DataError(
                        f"{key}: {path} has no array '{name}' (it has: {', '.join(archive.files) or 'none'}); "
                        "set data.x_name and data.y_name to the names of the inputs and targets"
                    )
            return archive[x_name], archive[y_name]
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
        if isinstance(e, DataError):
            raise
        raise _read_failure(key, path, e) from None


def _checked_arrays(x: np.ndarray, y: np.ndarray, where: str) -> tuple[np.ndarray, np.ndarray, bool]:
    """Checks one set's shapes and types; returns ``(x, y as int64 labels or float32 targets, is_labels)``."""
    if x.dtype.kind not in "iuf" or x.ndim < 2:
        raise DataError(
            f"{where}: inputs must be a numeric array of shape (samples, features...), got {x.dtype} {x.shape}"
        )
    if len(x) == 0 or len(x) != len(y):
        raise DataError(f"{where}: inputs and targets need the same number of samples (> 0), got {len(x)} and {len(y)}")
    if y.dtype.kind in "iu":
        if y.ndim != 1:
            raise DataError(
                f"{where}: integer targets are class labels, one per sample: shape ({len(y)},), got {y.shape}"
            )
        return x, np.asarray(y, dtype=np.int64), True
    if y.dtype.kind == "f":
        y = np.asarray(y, dtype=np.float32)
        return x, (y[:, None] if y.ndim == 1 else y), False
    raise DataError(f"{where}: targets must be integer class labels or float regression targets, got dtype {y.dtype}")


def _load_npz(
    seed: int,
    root: str | None = None,
    test_root: str | None = None,
    x_name: str = "x",
    y_name: str = "y",
    test_fraction: float = 0.2,
) -> tuple[ArrayDataset, ArrayDataset]:
    """A user's arrays: ``root`` for training, ``test_root`` (or a seeded held-out fraction) for evaluation.

    Integer targets are class labels ``0 .. classes - 1`` (classes: the largest label + 1);
    float targets are regression targets. Inputs keep their type on disk and become
    float32 batch by batch.
    """
    if not root:
        raise DataError("data.root: data 'npz' needs the path of a .npz file or a folder of .npy files")
    x, y, labels = _checked_arrays(*_read_arrays(root, x_name, y_name, "data.root"), f"data.root {root}")
    if test_root:
        tx, ty, test_labels = _checked_arrays(
            *_read_arrays(test_root, x_name, y_name, "data.test_root"), f"data.test_root {test_root}"
        )
        if tx.shape[1:] != x.shape[1:] or ty.shape[1:] != y.shape[1:] or test_labels != labels:
            raise DataError(
                f"data.test_root {test_root}: samples of shape {tx.shape[1:]} with targets {ty.dtype} {ty.shape[1:]}, "
                f"but data.root's are {x.shape[1:]} with {y.dtype} {y.shape[1:]}; both sets need the same"
            )
    num_classes = None
    if labels:
        every = [(root, y)] + ([(test_root, ty)] if test_root else [])
        for where, lab in every:
            if lab.min() < 0:
                i = int(np.argmin(lab))
                raise DataError(
                    f"data {where}: label {int(lab[i])} of sample {i} is out of range; labels are 0 to classes - 1"
                )
        num_classes = max(int(lab.max()) for _, lab in every) + 1
        if num_classes < 2:
            raise DataError(f"data.root {root}: every label is 0; a classifier needs at least two classes")
    if test_root:
        return (
            ArrayDataset(x, y, num_classes, prepare=_as_float32),
            ArrayDataset(tx, ty, num_classes, prepare=_as_float32),
        )
    test_fraction = _check_float("test_fraction", test_fraction, 0.0, 1.0, open_interval=True)
    if len(x) < 2:
        raise DataError(f"data.root {root}: one sample cannot be split into a training and a test set")
    train_rows, test_rows = _split(y, num_classes, test_fraction, _rng(seed, _STREAM_SPLIT))
    return (
        ArrayDataset(x, y, num_classes, rows=train_rows, prepare=_as_float32),
        ArrayDataset(x, y, num_classes, rows=test_rows, prepare=_as_float32),
    )


# --------------------------------------------------------------------------- CIFAR-10/100, binary version

# The layout documented with the data sets (https://www.cs.toronto.edu/~kriz/cifar.html):
# records of label byte(s) then 3,072 pixel bytes (1,024 red, 1,024 green, 1,024 blue,
# each 32x32 row by row). Mean and std per channel of the training images (in [0, 1]).
_CIFAR = {
    "cifar10": {
        "title": "CIFAR-10",
        "folder": "cifar-10-batches-bin",
        "train": tuple((f"data_batch_{i}.bin", 10000) for i in range(1, 6)),
        "test": (("test_batch.bin", 10000),),
        "label_bytes": 1,
        "classes": {"label": 10},
        "mean": (0.4914, 0.4822, 0.4465),
        "std": (0.2470, 0.2435, 0.2616),
    },
    "cifar100": {
        "title": "CIFAR-100",
        "folder": "cifar-100-binary",
        "train": (("train.bin", 50000),),
        "test": (("test.bin", 10000),),
        "label_bytes": 2,  # coarse label, then fine label
        "classes": {"coarse": 20, "fine": 100},
        "mean": (0.5071, 0.4865, 0.4409),
        "std": (0.2673, 0.2564, 0.2762),
    },
}
_CIFAR_PIXELS = 3 * 32 * 32


def _cifar_folder(root: str | None, spec: dict) -> str:
    """The folder holding the binary files: ``root`` itself or ``root/<folder>``.

    The second is what ``root`` means to the usual vision data set classes: the folder
    the archive was extracted into.
    """
    first = spec["train"][0][0]
    hint = f"download the binary version of {spec['title']} and give its folder ({spec['folder']}) or the one above"
    if not root:
        raise DataError(f"data.root is not set; {hint}")
    if not os.path.isdir(root):
        raise DataError(f"data.root: {root} is not a folder; {hint}")
    for folder in (root, os.path.join(root, spec["folder"])):
        if os.path.isfile(os.path.join(folder, first)):
            return folder
    python_version = os.path.isfile(os.path.join(root, first.removesuffix(".bin")))
    why = " (that is the Python version: pickles, which are never loaded here)" if python_version else ""
    raise DataError(f"data.root: {root} holds neither {first} nor {spec['folder']}/{first}{why}; {hint}")


def _read_cifar_records(folder: str, files, spec: dict) -> np.ndarray:
    """The records of ``files``, ``(samples, label bytes + 3072)`` bytes, read without unpickling anything."""
    record = spec["label_bytes"] + _CIFAR_PIXELS
    out = np.empty((sum(n for _, n in files), record), dtype=np.uint8)
    start = 0
    for name, count in files:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise DataError(f"data.root: {folder} has no {name}; {spec['title']}'s binary version has all of its files")
        size = os.path.getsize(path)
        if size != count * record:
            raise DataError(
                f"data.root: {path} is {size:,} bytes, not {count * record:,} ({count:,} records of {record:,} bytes): "
                f"cut short, or not {spec['title']}'s binary version"
            )
        with open(path, "rb") as f:
            f.readinto(memoryview(out[start : start + count]).cast("B"))
        start += count
    return out


def _check_cifar_labels(labels: np.ndarray, classes: int, spec: dict, folder: str, files) -> None:
    """Refuses the first label >= ``classes``, naming its file and record."""
    bad = np.flatnonzero(labels >= classes)
    if not len(bad):
        return
    first = int(bad[0])
    ends = np.cumsum([count for _, count in files])
    k = int(np.searchsorted(ends, first, side="right"))  # the file that holds it
    file, record = files[k][0], first - (int(ends[k - 1]) if k else 0)
    other = " (is it CIFAR-100's? then data.name: cifar100)" if spec["label_bytes"] == 1 else ""
    raise DataError(
        f"data.root: record {record} of {os.path.join(folder, file)} has label {int(labels[first])}, but "
        f"{spec['title']}'s labels are 0 to {classes - 1}{other}"
    )


def _normalizer(spec: dict) -> Callable[[np.ndarray], np.ndarray]:
    mean = np.asarray(spec["mean"], dtype=np.float32)[:, None, None]
    std = np.asarray(spec["std"], dtype=np.float32)[:, None, None]

    def prepare(x: np.ndarray) -> np.ndarray:
        # As the usual ToTensor() then Normalize(mean, std) transforms: bytes / 255, then per channel.
        out = x.astype(np.float32)
        out /= np.float32(255)
        out -= mean
        out /= std
        return out

    return prepare


def _load_cifar(name: str, root: str | None, labels: str = "fine") -> tuple[ArrayDataset, ArrayDataset]:
    spec = _CIFAR[name]
    which = labels if len(spec["classes"]) > 1 else "label"
    classes = spec["classes"][which]
    offset = spec["label_bytes"] - 1 if which in ("fine", "label") else 0  # CIFAR-100: coarse byte, then fine
    folder = _cifar_folder(root, spec)
    prepare = _normalizer(spec)
    sets = []
    for files in (spec["train"], spec["test"]):
        records = _read_cifar_records(folder, files, spec)
        y = records[:, offset].astype(np.int64)
        _check_cifar_labels(y, classes, spec, folder, files)
        x = records[:, spec["label_bytes"] :].reshape(len(records), 3, 32, 32)  # a view: no copy
        sets.append(ArrayDataset(x, y, classes, prepare=prepare))
    return sets[0], sets[1]


def _load_cifar10(seed: int, root: str | None = None) -> tuple[ArrayDataset, ArrayDataset]:
    """CIFAR-10's binary version: ``data_batch_1.bin`` .. ``data_batch_5.bin``, ``test_batch.bin``."""
    return _load_cifar("cifar10", root)


def _load_cifar100(seed: int, root: str | None = None, labels: str = "fine") -> tuple[ArrayDataset, ArrayDataset]:
    """CIFAR-100's binary version: ``train.bin``, ``test.bin``; ``labels``: ``fine`` (100) or ``coarse`` (20)."""
    if labels not in _CIFAR["cifar100"]["classes"]:
        raise ValueError(f"labels must be 'fine' or 'coarse', got {labels!r}")
    return _load_cifar("cifar100", root, labels)


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
    "npz": (_load_npz, ("root", "test_root", "x_name", "y_name", "test_fraction")),
    "cifar10": (_load_cifar10, ("root",)),
    "cifar100": (_load_cifar100, ("root", "labels")),
    "text": (text_data.load_text, text_data.OPTIONS),  # any UTF-8 file (trainers/text_data.py)
}


def load_dataset(
    name: str, *, seed: int = 0, augment: bool = False, **options: Any
) -> tuple[ArrayDataset, ArrayDataset]:
    """Builds the (train, test) data sets called ``name``.

    Args:
        name: A key of :data:`DATASETS`.
        seed: Non-negative integer; the same seed gives identical arrays.
        augment: Crop and flip the training images at random (:class:`RandomCropFlip`).
        **options: Data-set specific options (see the module docstring and the
            ``_load_*`` functions for names and defaults).

    Returns:
        ``(train, test)`` ArrayDatasets.

    Raises:
        DataError: A file that is missing, cut short, of the wrong shape or type, or
            labels out of range; augmentation of a set that holds no images.
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
    train, test = fn(seed, **options)
    if augment:
        if len(train.input_shape) != 3:
            raise DataError(
                f"data.augment crops and flips images (channels, height, width), but data {name!r} gives "
                f"samples of shape {train.input_shape}; set data.augment: false"
            )
        train.augment = RandomCropFlip(len(train), seed)
    return train, test


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
    never touch the data set. A data set with a ``batch(indices, epoch)`` method (an
    :class:`ArrayDataset`) builds them itself, so it can augment them for the epoch.

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
        make = getattr(self.dataset, "batch", None)
        for b in range(start, n):
            chosen = idx[b * bs : (b + 1) * bs]
            batch = make(chosen, epoch) if make is not None else self.dataset[chosen]
            position = (epoch + 1, 0) if b + 1 == n else (epoch, b + 1)
            self._epoch, self._batch = position
            yield batch
            if (self._epoch, self._batch) != position:
                return  # the position was changed under us: this iterator is stale
