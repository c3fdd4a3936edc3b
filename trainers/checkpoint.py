"""Checkpoints written atomically: a crash mid-write never leaves a broken file behind.

A checkpoint is one pickle file holding plain data (NumPy arrays, numbers, dicts):
model and optimizer state, RNG state, data-loader position, step, and the resolved
config. It is written to a temporary file in the same folder, flushed to disk, then
renamed over the final name (``os.replace`` is atomic on POSIX and Windows), and
only the newest ``keep`` checkpoints are kept.

Checkpoints are trusted local files: pickle can run code when loading, so never load
one from a source you do not trust.
"""

from __future__ import annotations

import os
import pickle
import re
import tempfile

_NAME = re.compile(r"^step_(\d+)\.ckpt$")


class CheckpointError(Exception):
    """A checkpoint that cannot be found or read."""


def checkpoint_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:08d}.ckpt")


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
    """``(step, path)`` of the checkpoints in ``directory``, oldest first."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        m = _NAME.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(found)


def latest_checkpoint(directory: str) -> str | None:
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def save_checkpoint(state: dict, directory: str, step: int, keep: int = 2) -> str:
    """Writes ``state`` atomically as ``step_<step>.ckpt`` and prunes older ones."""
    os.makedirs(directory, exist_ok=True)
    final = checkpoint_path(directory, step)
    fd, tmp = tempfile.mkstemp(prefix=".tmp_", suffix=".ckpt", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    for _, old in list_checkpoints(directory)[:-keep]:
        os.unlink(old)
    return final


def load_checkpoint(path: str) -> dict:
    """Reads a checkpoint written by :func:`save_checkpoint`."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    try:
        with open(path, "rb") as f:
            state = pickle.load(f)
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
        raise CheckpointError(f"checkpoint {path!r} cannot be read ({e}); it may be from another version") from None
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"{path!r} is not a checkpoint of this project")
    return state
