"""Checkpoints: an exact round trip, atomic and durable writes, and files that are refused
without running anything (pickles, pickled arrays, truncated or corrupted files)."""

import json
import os
import pickle
import stat
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from trainers import checkpoint as ckpt
from trainers.checkpoint import (
    CheckpointError,
    config_hash,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sample_state():
    return {
        "step": 7,
        "model": {
            "w": np.arange(6, dtype=np.float32).reshape(2, 3).T,
            "count": np.array(5),
            "half": np.ones(3, np.float16),
        },
        "optimizer": {
            "state": {0: {"momentum_buffer": np.full(3, 0.5)}, 3: {}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "nesterov": False, "params": [0, 3], "note": None}],
        },
        "rng": {"seed": 0, "numpy": {"bit_generator": "PCG64", "state": {"state": 2**127 + 5, "inc": 3}}},
        "loader": {"epoch": 1, "batch": 2},
        "scalars": [np.float32(2.5), float("nan"), float("-inf"), -0.0],
        "config": {"model": {"name": "mlp", "args": {"hidden": [16]}}, "seed": 3},
    }


class Evil:
    """Unpickling this creates the marker file: proof that code from the file ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_round_trip_keeps_values_types_and_shapes(tmp_path):
    state = sample_state()
    path = save_checkpoint(state, str(tmp_path), 7)
    assert path == str(tmp_path / "step_00000007.npz")
    back = load_checkpoint(path)
    assert back.keys() == state.keys()
    assert back["optimizer"]["state"].keys() == {0, 3}  # int keys stay ints
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert back["rng"] == state["rng"]  # 128-bit ints exactly
    for name, value in state["model"].items():
        got = back["model"][name]
        assert type(got) is np.ndarray and got.dtype == value.dtype and got.shape == value.shape
        np.testing.assert_array_equal(got, value)
    s = back["scalars"]
    assert type(s[0]) is np.float32 and s[0] == 2.5
    assert np.isnan(s[1]) and s[2] == float("-inf") and str(s[3]) == "-0.0"
    assert back["loader"] == {"epoch": 1, "batch": 2} and back["config"] == state["config"]


def test_metadata_names_step_config_hash_and_array_checksum(tmp_path):
    state = sample_state()
    path = save_checkpoint(state, str(tmp_path), 7)
    with np.load(path, allow_pickle=False) as archive:
        meta = json.loads(archive[ckpt.META].tobytes())
    assert meta["format"] == ckpt.FORMAT and meta["step"] == 7
    assert meta["config_sha256"] == config_hash(state["config"]) != config_hash({"seed": 4})
    assert len(meta["arrays_sha256"]) == 64


def test_unsavable_values_are_refused_before_writing(tmp_path):
    for bad in (
        {"step": 1, "x": object()},
        {"step": 1, "x": np.array([None], dtype=object)},
        {"step": 1, "x": {(1, 2): 3}},
    ):
        with pytest.raises(TypeError):
            save_checkpoint(bad, str(tmp_path), 1)
    assert [n for n in os.listdir(tmp_path)] == []


def test_keep_prunes_old_checkpoints_and_latest_is_the_newest(tmp_path):
    for step in (1, 2, 3, 4):
        save_checkpoint({"step": step}, str(tmp_path), step, keep=2)
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [3, 4]
    assert latest_checkpoint(str(tmp_path)).endswith("step_00000004.npz")
    assert latest_checkpoint(str(tmp_path / "none")) is None


def test_the_folder_is_fsynced_after_the_rename(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"))
        real_fsync(fd)

    def replace(a, b):
        calls.append(("replace", os.path.basename(b)))
        real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    save_checkpoint({"step": 1}, str(tmp_path), 1)
    assert calls == [("fsync", "file"), ("replace", "step_00000001.npz"), ("fsync", "dir")]


# ------------------------------------------------------------------ files that are refused


def test_a_crafted_pickle_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    for name in ("step_00000001.ckpt", "evil.npz", "evil.bin"):
        path = tmp_path / name
        path.write_bytes(pickle.dumps({"step": 1, "payload": Evil(marker)}))
        with pytest.raises(CheckpointError, match="pickle") as info:
            load_checkpoint(str(path))
        assert "\n" not in str(info.value)
        assert "scripts/convert_checkpoint.py --trust-pickle" in str(info.value)
        # Whose pickle it is cannot be known without unpickling it: it is not called ours.
        assert "is a pickle, which can run code when loaded" in str(info.value)
        assert "if it is a checkpoint of an earlier version of this project" in str(info.value)
    assert not marker.exists()


def test_a_pickled_object_array_inside_an_npz_is_refused(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "step_00000001.npz"
    meta = json.dumps({"format": ckpt.FORMAT, "version": ckpt.VERSION, "state": {"$array": "a0"}})
    np.savez(path, **{ckpt.META: np.frombuffer(meta.encode(), np.uint8)}, a0=np.array([Evil(marker)], dtype=object))
    with pytest.raises(CheckpointError, match="pickled object array"):
        load_checkpoint(str(path))
    assert not marker.exists()


def test_truncated_empty_and_foreign_files_are_refused_in_one_line(tmp_path):
    path = save_checkpoint(sample_state(), str(tmp_path), 7)
    data = open(path, "rb").read()
    for cut in (len(data) // 2, len(data) - 10, 30):
        short = tmp_path / f"cut{cut}.npz"
        short.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated or corrupted") as info:
            load_checkpoint(str(short))
        assert "\n" not in str(info.value)
    (tmp_path / "empty.npz").write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty"):
        load_checkpoint(str(tmp_path / "empty.npz"))
    (tmp_path / "text.npz").write_text("hello")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        load_checkpoint(str(tmp_path / "text.npz"))
    plain = tmp_path / "plain.npz"
    np.savez(plain, x=np.ones(2))
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        load_checkpoint(str(plain))
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(str(tmp_path / "missing.npz"))


def test_a_flipped_byte_is_caught(tmp_path):
    path = save_checkpoint({"step": 1, "w": np.arange(1000, dtype=np.float64)}, str(tmp_path), 1)
    data = bytearray(open(path, "rb").read())
    at = data.index(np.arange(1000, dtype=np.float64)[500:502].tobytes())
    data[at] ^= 0xFF
    bad = tmp_path / "flipped.npz"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="truncated or corrupted"):  # the zip's CRC-32
        load_checkpoint(str(bad))


def test_arrays_that_do_not_match_their_checksum_are_refused(tmp_path):
    # A well-formed archive whose array changed after its metadata was written (the zip's
    # own CRC is right): only the SHA-256 in the metadata can tell.
    path = save_checkpoint({"step": 1, "w": np.zeros(4)}, str(tmp_path), 1)
    with np.load(path, allow_pickle=False) as archive:
        meta = archive[ckpt.META]
    forged = tmp_path / "forged.npz"
    np.savez(forged, **{ckpt.META: meta}, a0=np.ones(4))
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(str(forged))


def test_unknown_entries_in_the_metadata_are_refused(tmp_path):
    meta = json.dumps(
        {
            "format": ckpt.FORMAT,
            "version": ckpt.VERSION,
            "arrays_sha256": ckpt._arrays_digest({}),
            "state": {"$dict": [["step", 1], ["x", {"$class": "os.system"}]]},
        }
    )
    path = tmp_path / "odd.npz"
    np.savez(path, **{ckpt.META: np.frombuffer(meta.encode(), np.uint8)})
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(str(path))
    with zipfile.ZipFile(path, "a") as zf:  # a member that is not an array
        zf.writestr("notes.txt", "hi")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        load_checkpoint(str(path))


def test_a_folder_of_old_pickles_says_how_to_convert(tmp_path):
    (tmp_path / "step_00000010.ckpt").write_bytes(pickle.dumps({"step": 10}))
    (tmp_path / "step_00000020.ckpt").write_bytes(pickle.dumps({"step": 20}))
    with pytest.raises(CheckpointError, match="step_00000020.ckpt.*--trust-pickle"):
        latest_checkpoint(str(tmp_path))


# ------------------------------------------------------------------ converting old pickles


def convert(*args):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "convert_checkpoint.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_convert_needs_trust_and_then_writes_the_new_format(tmp_path):
    state = sample_state()
    state["step"] = 20
    old = tmp_path / "step_00000020.ckpt"
    old.write_bytes(pickle.dumps(state))
    r = convert(str(old))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--trust-pickle" in r.stderr
    assert list_checkpoints(str(tmp_path)) == []
    r = convert("--trust-pickle", str(old))
    assert r.returncode == 0, r.stderr
    new = str(tmp_path / "step_00000020.npz")
    assert r.stdout.strip() == new and latest_checkpoint(str(tmp_path)) == new
    back = load_checkpoint(new)
    np.testing.assert_array_equal(back["model"]["w"], state["model"]["w"])
    assert back["rng"] == state["rng"] and back["optimizer"]["state"].keys() == {0, 3}


def test_convert_without_trust_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.ckpt"
    evil.write_bytes(pickle.dumps({"step": 1, "x": Evil(marker)}))
    r = convert(str(evil))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert not marker.exists()


def test_loading_never_imports_pickle_machinery_for_the_state(tmp_path):
    # The loader reads JSON and .npy only: a state full of look-alike tags stays data.
    state = {"step": 1, "text": '{"$array": "a0"}', "d": {"$tuple": "not a tag"}}
    back = load_checkpoint(save_checkpoint(state, str(tmp_path), 1))
    assert back == state
    src = open(ckpt.__file__, encoding="utf-8").read()
    assert "import pickle" not in src and "allow_pickle=False" in src
