"""The ``text`` data set: any UTF-8 text file, as blocks of tokens for a language model.

- **Vocabulary** (``data.vocab``): ``byte`` (256 tokens, the file's bytes themselves; the
  tokens are read straight from a memory map of the file) or ``char`` (the distinct
  characters of the file, sorted by code point; the file is memory-mapped and decoded,
  and its token ids are held in memory, 2 bytes a character for up to 65536 characters).
  The run prints which one, with its size.
- **Splits**: the first ``1 - data.val_fraction`` of the tokens train, the rest validate
  (nanoGPT's contiguous 90/10 split by default).
- **Samples**: sample ``i`` is ``block_size`` tokens and, as targets, the same shifted by
  one. Training samples start at every position: the loader's seeded permutation gives
  random contiguous blocks, and under MPI its ``DistributedSampler`` gives each rank its
  share of them. Validation samples are the split's consecutive non-overlapping blocks, so
  the validation loss counts each validation token once.
- **A file that cannot serve** (missing, unreadable, empty, not UTF-8 text, or too short
  for one block in either split) is a :class:`~trainers.config.ConfigError`: one line,
  exit status 2, before anything is written.

The validation loss of the unigram model of the training tokens (each token's training
frequency, add-one smoothed) is computed on load: the baseline a language model must beat.
"""

from __future__ import annotations

import codecs
import math
import os

import numpy as np

from .config import ConfigError

__all__ = ["OPTIONS", "TextDataset", "load_text"]

#: The ``data.*`` keys the text data set reads.
OPTIONS = ("path", "vocab", "block_size", "val_fraction")
VOCABS = ("char", "byte")
_CHUNK = 1 << 20  # bytes decoded at a time while checking the file is text


class TextDataset:
    """Blocks of ``block_size`` tokens of a token stream and their next tokens.

    Attributes:
        num_classes: the vocabulary's size (the trainer's classes: one per token).
        block_size: tokens per sample.
        eval_metric: ``"loss"``: the trainer evaluates the mean cross entropy per token.
        unigram_loss: the unigram baseline's validation loss (nats per token), or None.
    """

    eval_metric = "loss"

    def __init__(self, tokens: np.ndarray, block_size: int, stride: int, vocab: Vocabulary, unigram_loss=None):
        self.tokens, self.block_size, self.stride, self.vocab = tokens, block_size, stride, vocab
        self.num_classes = vocab.size
        self.unigram_loss = unigram_loss
        self._offsets = np.arange(block_size + 1, dtype=np.int64)

    def __len__(self) -> int:
        return (len(self.tokens) - 1 - self.block_size) // self.stride + 1

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.block_size,)

    def __getitem__(self, index) -> tuple[np.ndarray, np.ndarray]:
        """``(x, y)`` int64 arrays ``(len(index), block_size)``: each block and its next tokens."""
        starts = np.asarray(index, dtype=np.int64).reshape(-1) * self.stride
        if starts.size and (starts.min() < 0 or starts.max() + self.block_size >= len(self.tokens)):
            raise IndexError(f"sample index out of range for {len(self)} samples")
        rows = self.tokens[starts[:, None] + self._offsets].astype(np.int64)
        return rows[:, :-1], rows[:, 1:]

    def decode(self, ids) -> str:
        """The text of token ids."""
        return self.vocab.decode(ids)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` (ValueError for a character the vocabulary lacks)."""
        return self.vocab.encode(text)


class Vocabulary:
    """Tokens <-> text: bytes (``kind="byte"``) or the file's characters (``kind="char"``)."""

    def __init__(self, kind: str, chars: np.ndarray | None = None):
        self.kind = kind
        self.chars = chars  # the code points of the char vocabulary, sorted
        self.size = 256 if kind == "byte" else len(chars)

    def decode(self, ids) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if self.kind == "byte":
            return bytes(ids.astype(np.uint8).tolist()).decode("utf-8", errors="replace")
        return "".join(map(chr, self.chars[ids].tolist()))

    def encode(self, text: str) -> np.ndarray:
        if self.kind == "byte":
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        ids = np.searchsorted(self.chars, points)
        missing = (ids >= len(self.chars)) | (self.chars[np.minimum(ids, len(self.chars) - 1)] != points)
        if missing.any():
            bad = chr(int(points[np.argmax(missing)]))
            raise ValueError(f"character {bad!r} is not in the text's vocabulary")
        return ids.astype(np.int64)

    def describe(self) -> str:
        if self.kind == "byte":
            return "byte-level vocabulary: 256 tokens (the file's bytes)"
        return f"character-level vocabulary: {self.size} tokens (the file's distinct characters)"


def _fail(path, why: str, fix: str) -> ConfigError:
    return ConfigError(f"data.path {path!r}: {why}; {fix}")


def _map(path: str) -> np.ndarray:
    """The file's bytes, memory-mapped (read-only): a missing, unreadable or empty file fails."""
    if not path:
        raise ConfigError("data.path is not set: the text data set needs a UTF-8 text file (data.path: my.txt)")
    if not os.path.isfile(path):
        raise _fail(path, "no such file", "give data.path the path of a UTF-8 text file")
    try:
        if os.path.getsize(path) == 0:
            raise _fail(path, "the file is empty", "give a file with text in it")
        return np.memmap(path, dtype=np.uint8, mode="r")
    except OSError as e:
        raise _fail(path, f"cannot be read ({e.strerror or e})", "check its permissions") from None


def _check_text(path: str, data: np.ndarray) -> None:
    """UTF-8 text, no NUL byte (a binary file), checked chunk by chunk (constant memory)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    for start in range(0, len(data), _CHUNK):
        chunk = data[start : start + _CHUNK].tobytes()
        if b"\x00" in chunk:
            at = start + chunk.index(b"\x00")
            raise _fail(path, f"not text (a NUL byte at offset {at})", "give a UTF-8 text file")
        try:
            decoder.decode(chunk, final=start + _CHUNK >= len(data))
        except UnicodeDecodeError as e:
            where = f"not UTF-8 text (an invalid byte at offset {start + e.start})"
            raise _fail(path, where, "give a UTF-8 text file") from None


def _char_tokens(data: np.ndarray) -> tuple[np.ndarray, Vocabulary]:
    points = np.frombuffer(data.tobytes().decode("utf-8").encode("utf-32-le"), dtype=np.uint32)
    chars, ids = np.unique(points, return_inverse=True)
    return ids.astype(np.uint16 if len(chars) <= 1 << 16 else np.uint32), Vocabulary("char", chars)


def _unigram_loss(train: np.ndarray, val: np.ndarray, size: int) -> float:
    """Validation cross entropy (nats per token) of the training tokens' add-one smoothed frequencies."""
    counts = np.bincount(train, minlength=size).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(-(np.bincount(val, minlength=size) * log_p).sum() / len(val))


def load_text(seed: int, path=None, vocab: str = "char", block_size: int = 64, val_fraction: float = 0.1):
    """The (train, validation) :class:`TextDataset` of the file ``path`` (``seed`` unused:
    the split is fixed, the order is the loader's).

    Raises:
        ConfigError: the file cannot serve (see the module docstring), or a bad option.
    """
    if vocab not in VOCABS:
        raise ConfigError(f"data.vocab must be one of {', '.join(VOCABS)}; got {vocab!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"data.block_size must be a positive integer, got {block_size!r}")
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction must be in (0, 1), got {val_fraction!r}")
    path = os.path.expanduser(str(path)) if path else ""
    data = _map(path)
    _check_text(path, data)
    tokens, vocabulary = (data, Vocabulary("byte")) if vocab == "byte" else _char_tokens(data)
    n_val = max(1, int(math.floor(len(tokens) * val_fraction)))
    n_train = len(tokens) - n_val
    need = block_size + 1
    if n_train < need or n_val < need:
        raise _fail(
            path,
            f"{len(tokens)} tokens ({vocabulary.kind}s) are too few for one block of {block_size} (and its next "
            f"token) in both splits: training gets {n_train}, validation {n_val} (data.val_fraction {val_fraction})",
            "use a longer text, or a smaller data.block_size",
        )
    train_tokens, val_tokens = tokens[:n_train], tokens[n_train:]
    baseline = _unigram_loss(np.asarray(train_tokens), np.asarray(val_tokens), vocabulary.size)
    train = TextDataset(train_tokens, block_size, 1, vocabulary, baseline)
    val = TextDataset(val_tokens, block_size, block_size, vocabulary, baseline)
    return train, val
