"""Runs that never mix: what makes two configs the same run, the folders a run writes, its checkpoints.

**The same run.** A run is what its config trains: the config less the keys that may
change when it is resumed (``Field.resumable`` in ``trainers/config.py``: where it is
written, how long it trains, what it shows and how often, how fast it runs). Two configs
that agree on every other key (seed, data, model, optimizer, schedule, inplace policy,
compile and conv settings, gradient clipping, SyncBatchNorm) train the same run. Its
*id* is the first 12 hex digits of the SHA-256 of that part, in canonical JSON. Every
checkpoint holds the config it was written with, the run's folder name and id; every
run's TensorBoard folder holds ``run.json`` with the same.

**Folders.** A run named ``R`` writes ``<logdir>/<experiment>/R`` and
``<checkpoint.dir>/<experiment>/R``. A run started without a checkpoint never writes
into folders another run has written (event files, ``run.json`` or checkpoints): it
takes the next version of its name, ``R_v2``, ``R_v3``, ... (the folders
Lightning's ``version_N`` gives), so TensorBoard never draws two runs' points in one
curve and no run prunes or resumes another's checkpoints. A resumed run goes on in the
folders of its checkpoint: ``--resume`` takes the newest version of the name whose
latest checkpoint is this config's run, and a checkpoint of another run is refused with
one line that names both runs and the keys they differ in.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from .checkpoint import CheckpointError, has_checkpoints, latest_checkpoint, list_checkpoints, read_config
from .config import ConfigError, config_from_dict, resumable_keys
from .logging import event_files

__all__ = [
    "RUN_FILE",
    "Search",
    "another_run",
    "check_run_file",
    "differences",
    "find_experiment",
    "find_own",
    "holds_a_run",
    "identity",
    "next_free",
    "next_free_experiment",
    "run_id",
    "same_run",
    "version_name",
    "write_run_file",
]

RUN_FILE = "run.json"  # in a run's TensorBoard folder: {"run": name, "id": ..., "config": identity}


def identity(config: Mapping) -> dict:
    """The part of a config (a dict: ``Config.to_dict()`` or a checkpoint's) that makes the run.

    The config is validated and its missing keys filled with the defaults first, so that
    a checkpoint written before a key existed compares equal to a config that leaves the
    key at its default.

    Raises:
        ConfigError: a key this version does not know, or a bad value.
    """
    full = config_from_dict(config).to_dict()
    for key in resumable_keys():
        *sections, leaf = key.split(".")
        node = full
        for s in sections:
            node = node[s]
        del node[leaf]
    return full


def run_id(config: Mapping) -> str:
    """The run's id: 12 hex digits of the SHA-256 of :func:`identity` in canonical JSON."""
    text = json.dumps(identity(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def same_run(theirs: Mapping, ours: Mapping) -> bool:
    """Whether two configs train the same run; a config this version cannot read is another run."""
    try:
        return identity(theirs) == identity(ours)
    except ConfigError:
        return False


def _flat(tree: Mapping, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + str(key)] = value
    return out


def differences(theirs: Mapping, ours: Mapping, most: int = 3) -> str:
    """The keys two runs' configs differ in, ``optim.lr 0.1 there, 0.05 here``, the first ``most`` of them."""
    try:
        a, b = _flat(identity(theirs)), _flat(identity(ours))
    except ConfigError as e:
        return f"a config this version cannot read ({e})"
    keys = [k for k in {**a, **b} if a.get(k, "(unset)") != b.get(k, "(unset)")]
    said = [f"{k} {json.dumps(a.get(k, '(unset)'))} there, {json.dumps(b.get(k, '(unset)'))} here" for k in keys]
    more = f" and {len(said) - most} more keys" if len(said) > most else ""
    return "; ".join(said[:most]) + more


def another_run(what: str, name: str, theirs: Mapping, ours: Mapping) -> str:
    """One line naming both runs: ``<what> is run R (id ...), this config is run ... (id ...): <differences>``."""
    try:
        their_id = run_id(theirs)
    except ConfigError:
        their_id = "unknown"
    return (
        f"{what} is run {name} (id {their_id}), not this config's run (id {run_id(ours)}): {differences(theirs, ours)}"
    )


# --------------------------------------------------------------------------- folders


def version_name(base: str, version: int) -> str:
    """``base`` for version 1, ``base_v<N>`` after it."""
    return base if version == 1 else f"{base}_v{version}"


def _versions(base: str, log_root: str, ckpt_root: str) -> list[tuple[int, str]]:
    """``(version, name)`` of the folders of ``base``'s versions under either root, oldest first."""
    pattern = re.compile(rf"^{re.escape(base)}(?:_v(\d+))?$")
    found = set()
    for root in (log_root, ckpt_root):
        if os.path.isdir(root):
            for name in os.listdir(root):
                m = pattern.match(name)
                if m and (m.group(1) is None or int(m.group(1)) >= 2):
                    found.add((int(m.group(1) or 1), name))
    return sorted(found)


def holds_a_run(run_dir: str, ckpt_dir: str) -> bool:
    """Whether a run has written these folders: TensorBoard events or ``run.json``, or a checkpoint."""
    return bool(event_files(run_dir)) or os.path.exists(os.path.join(run_dir, RUN_FILE)) or has_checkpoints(ckpt_dir)


def next_free(base: str, log_root: str, ckpt_root: str) -> str:
    """The name a new run of ``base`` writes under: ``base``, or the version after the last one that holds a run."""
    taken = [v for v, name in _versions(base, log_root, ckpt_root) if _holds(name, log_root, ckpt_root)]
    return version_name(base, max(taken, default=0) + 1)


def _holds(name: str, log_root: str, ckpt_root: str) -> bool:
    return holds_a_run(os.path.join(log_root, name), os.path.join(ckpt_root, name))


@dataclass
class Search:
    """What :func:`find_own` found: this config's run, and the other runs of the name.

    Attributes:
        name: The folder name of this config's run (a version of the name), or None.
        checkpoint: Its latest checkpoint, or None.
        others: One line for each version whose latest checkpoint is another run's
            (:func:`another_run`), newest first.
    """

    name: str | None = None
    checkpoint: str | None = None
    others: list[str] = field(default_factory=list)


def find_own(base: str, log_root: str, ckpt_root: str, config: Mapping) -> Search:
    """The newest version of ``base`` whose latest checkpoint is ``config``'s run.

    Only each version's latest checkpoint is read (its metadata, not its arrays): a
    version's folder holds one run's checkpoints.

    Raises:
        CheckpointError: a version's folder holds only checkpoints of the old pickle format.
    """
    search = Search()
    for _, name in reversed(_versions(base, log_root, ckpt_root)):
        path = latest_checkpoint(os.path.join(ckpt_root, name))
        if path is None:
            continue
        theirs = read_config(path)
        if theirs is None or same_run(theirs, config):  # unreadable: load_checkpoint says what is wrong
            search.name, search.checkpoint = name, path
            return search
        search.others.append(another_run(f"{os.path.join(ckpt_root, name)}", name, theirs, config))
    return search


def write_run_file(run_dir: str, name: str, config: Mapping) -> None:
    """Writes ``<run_dir>/run.json``: the run's folder name, id and identity config."""
    os.makedirs(run_dir, exist_ok=True)
    doc = {"run": name, "id": run_id(config), "config": identity(config)}
    with open(os.path.join(run_dir, RUN_FILE), "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")


def check_run_file(run_dir: str, config: Mapping) -> None:
    """Refuses to write into a TensorBoard folder whose ``run.json`` names another run.

    Raises:
        CheckpointError: one line naming both runs.
    """
    path = os.path.join(run_dir, RUN_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return  # a folder of an earlier version, or none yet
    except (OSError, ValueError):
        doc = None
    theirs = doc.get("config") if isinstance(doc, dict) else None
    if not isinstance(theirs, dict):
        raise CheckpointError(f"{path} is not a run file of this project; move the folder {run_dir} away")
    if not same_run(theirs, config):
        raise CheckpointError(
            another_run(f"TensorBoard folder {run_dir}", doc.get("run", "?"), theirs, config)
            + "; resume with that run's config, or move the folder away"
        )


# --------------------------------------------------------------------------- experiments
#
# scripts/compare_inplace.py runs several policies into one experiment on purpose, beside the
# figure comparing them: a comparison takes an experiment folder no run has written yet
# (``<experiment>``, or its next version ``<experiment>_v2``, ...), so that the folder holds one
# comparison's runs and its compare.png, and its --resume goes on in the newest one holding a
# checkpoint of its runs.


def _experiment_holds_a_run(log_exp: str, ckpt_exp: str) -> bool:
    names = set()
    for root in (log_exp, ckpt_exp):
        if os.path.isdir(root):
            names.update(os.listdir(root))
    return any(holds_a_run(os.path.join(log_exp, n), os.path.join(ckpt_exp, n)) for n in names)


def next_free_experiment(experiment: str, logdir: str, ckpt_dir: str) -> str:
    """``experiment``, or the version after the last one whose folders hold a run."""
    taken = [
        v
        for v, name in _versions(experiment, logdir, ckpt_dir)
        if _experiment_holds_a_run(os.path.join(logdir, name), os.path.join(ckpt_dir, name))
    ]
    return version_name(experiment, max(taken, default=0) + 1)


def find_experiment(experiment: str, logdir: str, ckpt_dir: str, configs: list[Mapping]) -> str | None:
    """The newest version of ``experiment`` holding a checkpoint of one of ``configs``' runs, or None."""
    for _, name in reversed(_versions(experiment, logdir, ckpt_dir)):
        root = os.path.join(ckpt_dir, name)
        for run in sorted(os.listdir(root)) if os.path.isdir(root) else []:
            found = list_checkpoints(os.path.join(root, run))
            theirs = read_config(found[-1][1]) if found else None
            if theirs is not None and any(same_run(theirs, c) for c in configs):
                return name
    return None
