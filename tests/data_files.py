"""Small files in the formats a user brings (CIFAR's binary version, .npz, .npy), for the tests.

No data set is shipped or downloaded: the files are generated. CIFAR's are full size (the
reader checks each file's size against the documented layout), written sparse: the first
``filled`` records of each file hold random labels and pixels, the rest are zero bytes
that take no disk space.
"""

from __future__ import annotations

import os

import numpy as np

PIXELS = 3 * 32 * 32

CIFAR_FILES = {
    "cifar10": (
        "cifar-10-batches-bin",
        [(f"data_batch_{i}.bin", 10000) for i in range(1, 6)] + [("test_batch.bin", 10000)],
    ),
    "cifar100": ("cifar-100-binary", [("train.bin", 50000), ("test.bin", 10000)]),
}


def cifar_record_bytes(name: str) -> int:
    return (2 if name == "cifar100" else 1) + PIXELS


def write_cifar(parent, name: str = "cifar10", filled: int = 64, seed: int = 0) -> str:
    """Writes ``<parent>/<the data set's folder>/*.bin``; returns that folder.

    Record ``i`` of each file (``i < filled``) holds random pixels and the labels
    ``i % classes`` (CIFAR-100: coarse ``i % 20``, fine ``i % 100``).
    """
    folder_name, files = CIFAR_FILES[name]
    folder = os.path.join(os.fspath(parent), folder_name)
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    record = cifar_record_bytes(name)
    for file, count in files:
        rows = np.zeros((filled, record), dtype=np.uint8)
        rows[:, -PIXELS:] = rng.integers(0, 256, size=(filled, PIXELS), dtype=np.uint8)
        if name == "cifar100":
            rows[:, 0] = np.arange(filled) % 20
            rows[:, 1] = np.arange(filled) % 100
        else:
            rows[:, 0] = np.arange(filled) % 10
        with open(os.path.join(folder, file), "wb") as f:
            f.write(rows.tobytes())
            f.truncate(count * record)  # the rest: zero bytes, sparse on disk
    return folder


def classification_arrays(n: int = 96, features: tuple = (1, 4, 4), classes: int = 3, seed: int = 0):
    """Learnable inputs (class means apart) and int64 labels."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % classes
    x = rng.standard_normal((n, *features)) + y.reshape(-1, *[1] * len(features))
    return x.astype(np.float32), y.astype(np.int64)
