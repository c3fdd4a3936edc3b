"""Checkpoints that cannot run code, written atomically.

A checkpoint is one NumPy ``.npz`` file (a zip archive of ``.npy`` arrays) that holds
every array of the state (model and optimizer state) plus one more, ``__meta__``: the
UTF-8 bytes of a JSON document with everything else: the structure of the state (dicts, lists, numbers,
strings; each array named by its entry), the RNG state, the data position, the step,
the resolved config and its SHA-256, and the SHA-256 of the arrays.

Loading reads the arrays with ``numpy.load(allow_pickle=False)`` and the rest with
``json``: neither can run code, whatever the file holds (PyTorch made
``torch.load(weights_only=True)`` its default for the same reason). A file that is
not such an archive, was cut short, or whose arrays do not match their checksum is
refused with one line that says what is wrong.

Checkpoints of earlier versions were pickles. They are refused too, with the command
that converts one (``scripts/convert_checkpoint.py --trust-pickle``): unpickling runs
whatever code the file names, so only its owner can decide to do it.

Writing: a temporary file in the same folder, flushed and fsynced, renamed over the
final name (``os.replace`` is atomic), then the folder itself fsynced so that the
rename survives a power cut; only the newest ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import tempfile
import zipfile
from typing import Any

import numpy as np

__all__ = [
    "CheckpointError",
    "checkpoint_path",
    "config_hash",
    "has_checkpoints",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_config",
    "save_checkpoint",
    "write_checkpoint",
]

FORMAT = "inplace-lab checkpoint"
VERSION = 1
META = "__meta__"  # a uint8 array: the JSON metadata
SUFFIX = ".npz"
_NAME = re.compile(r"^step_(\d+)\.npz$")
_OLD_NAME = re.compile(r"^step_(\d+)\.ckpt$")  # pickles of earlier versions
CONVERT_HINT = "python scripts/convert_checkpoint.py --trust-pickle {path}"


class CheckpointError(Exception):
    """A checkpoint that cannot be found, read or trusted (one-line message)."""


def checkpoint_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:08d}{SUFFIX}")


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
    """``(step, path)`` of the checkpoints in ``directory``, oldest first."""
    return _matching(directory, _NAME)


def has_checkpoints(directory: str) -> bool:
    """Whether ``directory`` holds a checkpoint, of this format or an earlier version's pickle."""
    return bool(list_checkpoints(directory) or _matching(directory, _OLD_NAME))


def latest_checkpoint(directory: str) -> str | None:
    """The newest checkpoint in ``directory``, or None if there is none.

    Raises:
        CheckpointError: the folder holds only checkpoints of the old pickle format
            (the message says how to convert the newest).
    """
    found = list_checkpoints(directory)
    if found:
        return found[-1][1]
    old = _matching(directory, _OLD_NAME)
    if old:
        raise CheckpointError(_pickle_message(old[-1][1]))
    return None


def _matching(directory: str, pattern: re.Pattern) -> list[tuple[int, str]]:
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        m = pattern.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(found)


def config_hash(config: dict) -> str:
    """SHA-256 of a config dict in canonical JSON (sorted keys): equal configs, equal hash."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


# --------------------------------------------------------------------------- encoding
#
# The state becomes a JSON tree plus named arrays. JSON has no tuples, no non-string
# keys and no NaN, so those are tagged: {"$tuple": [...]}, {"$dict": [[key, value], ...]}
# (every dict, so that int keys such as the optimizer's parameter indices come back as
# ints), {"$float": "nan"}; an array is {"$array": "a0"} ({"$scalar": "a0"} for a NumPy
# scalar). Decoding accepts exactly these forms and nothing else.


def _encode(obj: Any, arrays: dict[str, np.ndarray], where: str) -> Any:
    if isinstance(obj, (np.ndarray, np.generic)):  # first: np.float64 is also a float
        array = np.asarray(obj)
        if array.dtype.hasobject:
            raise TypeError(
                f"checkpoint value at {where} is an object array; only plain numeric or string arrays can be saved"
            )
        name = f"a{len(arrays)}"
        arrays[name] = np.asarray(array, order="C")  # (ascontiguousarray would make 0-d 1-d)
        return {"$scalar" if isinstance(obj, np.generic) else "$array": name}
    if obj is None or isinstance(obj, (bool, str, int)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"$float": repr(obj)}
    if isinstance(obj, dict):
        items = []
        for key, value in obj.items():
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise TypeError(f"checkpoint dict key {key!r} at {where} must be a str or an int")
            items.append([key, _encode(value, arrays, f"{where}.{key}")])
        return {"$dict": items}
    if isinstance(obj, (list, tuple)):
        encoded = [_encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(obj)]
        return {"$tuple": encoded} if isinstance(obj, tuple) else encoded
    raise TypeError(
        f"checkpoint value at {where} has type {type(obj).__name__}; only dicts, "
        "lists, tuples, numbers, strings, None and NumPy arrays can be saved"
    )


def _decode(node: Any, arrays: dict[str, np.ndarray], path: str) -> Any:
    if node is None or isinstance(node, (bool, str, int, float)):
        return node
    if isinstance(node, list):
        return [_decode(v, arrays, path) for v in node]
    if isinstance(node, dict) and len(node) == 1:
        ((tag, value),) = node.items()
        if (
            tag == "$dict"
            and isinstance(value, list)
            and all(isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], (str, int)) for kv in value)
        ):
            return {k: _decode(v, arrays, path) for k, v in value}
        if tag == "$tuple" and isinstance(value, list):
            return tuple(_decode(v, arrays, path) for v in value)
        if tag == "$float" and value in ("nan", "inf", "-inf"):
            return float(value)
        if tag in ("$array", "$scalar") and isinstance(value, str):
            if value not in arrays:
                raise CheckpointError(
                    f"checkpoint {path!r} names an array {value!r} it does not hold; "
                    "the file is damaged: use an earlier checkpoint"
                )
            return arrays[value][()] if tag == "$scalar" else arrays[value]
    raise CheckpointError(
        f"checkpoint {path!r} holds an entry this version cannot read; "
        "the file is damaged or not a checkpoint of this project"
    )


def _arrays_digest(arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 over every array's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())  # C order; a copy, cheap next to writing the file
    return h.hexdigest()


# --------------------------------------------------------------------------- saving


def save_checkpoint(state: dict, directory: str, step: int, keep: int = 2) -> str:
    """Writes ``state`` atomically as ``<directory>/step_<step>.npz`` and prunes older ones.

    Args:
        state: What :func:`write_checkpoint` takes.
        directory: Folder of the run's checkpoints (created if missing).
        step: The training step, in the file name.
        keep: How many of the newest checkpoints to keep.

    Returns:
        The path written.
    """
    os.makedirs(directory, exist_ok=True)
    final = write_checkpoint(state, checkpoint_path(directory, step))
    for _, old in list_checkpoints(directory)[:-keep]:
        os.unlink(old)
    return final


def write_checkpoint(state: dict, path: str) -> str:
    """Writes ``state`` to ``path`` atomically: the file is complete or absent, never partial.

    Args:
        state: Dicts (str or int keys), lists, tuples, numbers, strings, None and NumPy
            arrays, with the training ``step``; a ``config`` entry (a dict) is also
            stored as its SHA-256.

    Returns:
        ``path``.

    Raises:
        TypeError: a value of another type (an object array, a tensor, a class).
    """
    arrays: dict[str, np.ndarray] = {}
    tree = _encode(state, arrays, "state")
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "step": state.get("step"),
        "arrays_sha256": _arrays_digest(arrays),
        "state": tree,
    }
    if isinstance(state.get("config"), dict):
        meta["config_sha256"] = config_hash(state["config"])
    meta_bytes = np.frombuffer(json.dumps(meta, allow_nan=False).encode(), dtype=np.uint8)

    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp_", suffix=SUFFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **{META: meta_bytes}, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_directory(directory)
    return path


def _fsync_directory(directory: str) -> None:
    """Makes a rename in ``directory`` durable (POSIX; Windows cannot open a folder)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- loading


def _pickle_message(path: str) -> str:
    # Nothing short of unpickling tells whose pickle it is: it is not said to be ours.
    return (
        f"checkpoint {path!r} is a pickle, which can run code when loaded, so it is not read; if it is a "
        "checkpoint of an earlier version of this project (they were pickles) and you trust the file, "
        "convert it with: " + CONVERT_HINT.format(path=path)
    )


def load_checkpoint(path: str) -> dict:
    """Reads a checkpoint written by :func:`save_checkpoint`; runs no code from the file.

    Raises:
        CheckpointError: missing file, an old pickle checkpoint, not a checkpoint of this
            project, a truncated or corrupted file, arrays that fail their checksum.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    with open(path, "rb") as f:
        head = f.read(4)
        size = f.seek(0, io.SEEK_END)
    if size == 0:
        raise CheckpointError(
            f"checkpoint {path!r} is empty (0 bytes): the write was cut short; use an earlier checkpoint"
        )
    if head[:1] == b"\x80" or (path.endswith(".ckpt") and not head.startswith(b"PK")):
        raise CheckpointError(_pickle_message(path))
    if not head.startswith(b"PK"):
        raise CheckpointError(f"{path!r} is not a checkpoint of this project (not an .npz archive)")
    try:
        with np.load(path, allow_pickle=False) as archive:
            if META not in archive.files or not all(n.endswith(".npy") for n in archive.zip.namelist()):
                raise CheckpointError(f"{path!r} is not a checkpoint of this project")
            arrays = {n: archive[n] for n in archive.files}
        meta = json.loads(arrays.pop(META).tobytes())
    except ValueError as e:  # json.JSONDecodeError is a ValueError too
        if "allow_pickle" in str(e):  # an object array: a pickle inside the archive
            raise CheckpointError(
                f"checkpoint {path!r} holds a pickled object array, which could run code when loaded; it is not read"
            ) from None
        raise CheckpointError(_damaged(path, size, e)) from None
    except (zipfile.BadZipFile, EOFError, OSError) as e:
        raise CheckpointError(_damaged(path, size, e)) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path!r} is not a checkpoint of this project")
    if meta.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint {path!r} has format version {meta.get('version')!r}; this version reads {VERSION}"
        )
    if meta.get("arrays_sha256") != _arrays_digest(arrays):
        raise CheckpointError(
            f"checkpoint {path!r} is corrupted: its arrays do not match the "
            "checksum in its metadata; use an earlier checkpoint"
        )
    state = _decode(meta.get("state"), arrays, path)
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"{path!r} is not a checkpoint of this project")
    return state


def read_config(path: str) -> dict | None:
    """The config a checkpoint was written with, read from its metadata alone (not its arrays).

    For looking through a folder's checkpoints (``trainers/runs.py``) without reading
    their weights; :func:`load_checkpoint` checks the whole file before a resume.

    Returns:
        The config dict, or None when the file is not a readable checkpoint of this
        project or holds no config.
    """
    try:
        with np.load(path, allow_pickle=False) as archive:
            meta = json.loads(archive[META].tobytes())
        items = meta["state"]["$dict"]
        config = next(value for key, value in items if key == "config")
        config = _decode(config, {}, path)  # a config holds no arrays
    except (OSError, ValueError, KeyError, TypeError, StopIteration, zipfile.BadZipFile, EOFError, CheckpointError):
        return None
    return config if isinstance(config, dict) else None


def _damaged(path: str, size: int, error: Exception) -> str:
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    return f"checkpoint {path!r} is truncated or corrupted ({size} bytes; {reason}); use an earlier checkpoint"
