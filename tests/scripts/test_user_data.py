"""``scripts/train.py`` on a user's own data: npz and CIFAR-10 files, one process and ``mpiexec -n 2``.

Bad data is bad input like a bad config: one line, exit status 2, and nothing written
(no ``runs/`` or ``checkpoints/``). Two ranks at batch B train as one process at batch
2B: the data sets are sharded across ranks like the built-in ones, augmentation included.
"""

import os
import sys

import numpy as np
import pytest

from tests.data_files import classification_arrays, write_cifar
from tests.mpi_util import REPO, find_mpiexec, needs_mpiexec, run_command
from trainers.checkpoint import load_checkpoint

TRAIN = REPO / "scripts" / "train.py"

CONFIG = """\
experiment: own
seed: 2
threads: 1
data: {{name: {name}, root: {root}, batch_size: {batch}, augment: {augment}}}
model: {{name: mlp, args: {{hidden: [16]}}}}
optim: {{name: sgd, lr: 0.05, momentum: 0.9}}
train: {{max_steps: 6, log_every: 3, eval_every: 6}}
logging: {{progress: false, timeline: false}}
"""


def train(tmp_path, nprocs=1, *overrides, name="npz", root="d.npz", batch=32, augment="false"):
    path = tmp_path / f"c{nprocs}.yaml"
    path.write_text(CONFIG.format(name=name, root=root, batch=batch, augment=augment))
    cmd = [sys.executable, str(TRAIN), "--config", str(path), *(a for o in overrides for a in ("--set", o))]
    if nprocs > 1:
        cmd = [find_mpiexec(), "-n", str(nprocs), *cmd]
    return run_command(cmd, 240, cwd=tmp_path)[:3]


def assert_bad_input(tmp_path, result, *fragments):
    code, out, err = result
    assert code == 2, (code, out, err)
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "checkpoints").exists()


@pytest.fixture
def npz(tmp_path):
    x, y = classification_arrays(n=400, features=(64,), classes=4)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    return tmp_path / "d.npz"


def test_a_npz_file_trains(tmp_path, npz):
    code, out, err = train(tmp_path)
    assert code == 0, err
    assert "inplace-auto_np1" in out and os.path.isfile(tmp_path / "checkpoints/own/inplace-auto_np1/step_00000006.npz")


@pytest.mark.parametrize(
    "setup, overrides, fragments",
    [
        (lambda d: None, ["data.root=nowhere.npz"], ["data.root: nowhere.npz does not exist"]),
        (lambda d: np.savez(d / "d.npz", x=np.zeros((8, 3)), y=np.arange(8) - 1), [], ["label -1 of sample 0"]),
        (lambda d: np.savez(d / "d.npz", inputs=np.zeros((8, 3)), y=np.arange(8)), [], ["no array 'x'", "data.x_name"]),
        # a path in a config file is relative to the file's folder: the message names it resolved
        (lambda d: (d / "d.npz").write_bytes(b"PK\x03\x04 not really"), [], ["cannot read {tmp}/d.npz: "]),
        (lambda d: None, ["data.name=cifar10", "data.root=."], ["holds neither data_batch_1.bin"]),
        (lambda d: np.savez(d / "d.npz", x=np.zeros((8, 3)), y=np.arange(8)), ["data.augment=true"], ["augment"]),
    ],
)
def test_bad_data_is_one_line_exit_2_and_nothing_written(tmp_path, setup, overrides, fragments):
    setup(tmp_path)
    fragments = [f.replace("{tmp}", str(tmp_path)) for f in fragments]
    assert_bad_input(tmp_path, train(tmp_path, 1, *overrides), *fragments)


def test_an_empty_config_is_one_line_exit_2_and_nothing_written(tmp_path):
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    code, out, err, _ = run_command([sys.executable, str(TRAIN), "--config", "empty.yaml"], 120, cwd=tmp_path)
    assert_bad_input(tmp_path, (code, out, err), "empty.yaml is empty")


def final_model(tmp_path, nprocs):
    return load_checkpoint(str(tmp_path / f"checkpoints/own/inplace-auto_np{nprocs}/step_00000006.npz"))["model"]


@needs_mpiexec
@pytest.mark.mpi
@pytest.mark.parametrize("data", ["npz", "cifar10"])
def test_two_ranks_at_batch_b_train_as_one_process_at_batch_2b(tmp_path, data):
    if data == "npz":
        x, y = classification_arrays(n=400, features=(64,), classes=4)
        os.makedirs(tmp_path / "pair")
        np.save(tmp_path / "pair" / "x.npy", x)
        np.save(tmp_path / "pair" / "y.npy", y)
        kwargs = dict(name="npz", root="pair")
    else:  # every sample augmented by its own draw, whichever rank takes it
        kwargs = dict(name="cifar10", root=write_cifar(tmp_path, "cifar10", filled=400), augment="true")
    code, _, err = train(tmp_path, 2, batch=16, **kwargs)
    assert code == 0, err
    code, _, err = train(tmp_path, 1, batch=32, **kwargs)
    assert code == 0, err
    two, one = final_model(tmp_path, 2), final_model(tmp_path, 1)
    for name in one:
        np.testing.assert_allclose(two[name], one[name], rtol=1e-5, atol=1e-6, err_msg=name)
