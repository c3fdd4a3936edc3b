"""Every shipped config runs: ``configs/*.yaml`` trained for a few steps as a user runs it.

``configs/mpi_*.yaml`` are the data-parallel experiments: they run under
``mpiexec -n 2`` (one BLAS thread per rank). The runs are kept short with overrides of
the step count, the synthetic data size, a text's context and its sample only, so what is
checked is the config as shipped: its keys, its ``base:`` chain, its model and model
arguments, its data. A config of data on disk (CIFAR-10) gets generated files in the
documented layout (``data.root``).
"""

import glob
import os
import re
import sys

import pytest

from tests.data_files import write_cifar
from tests.mpi_util import find_mpiexec, needs_mpiexec, run_command
from trainers.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
SHORT = [
    "train.max_steps=2",
    "train.eval_every=2",
    "train.log_every=1",
    "data.batch_size=16",
    "data.num_train=64",
    "data.num_test=32",
    "data.eval_batch_size=32",
    "data.block_size=32",  # the text configs' context (and so their model's)
    "sample.tokens=5",
    "logging.progress=false",
]


def test_there_are_configs_and_the_usage_doc_lists_each_one():
    assert "quickstart.yaml" in CONFIGS and any(c.startswith("mpi_") for c in CONFIGS)
    with open(os.path.join(ROOT, "docs", "USAGE.md"), encoding="utf-8") as f:
        usage = f.read()
    table = usage.split("| config | what it runs |")[1].split("\n\n")[0]
    assert sorted(re.findall(r"^\| `([\w.]+\.yaml)`", table, re.M)) == CONFIGS


@pytest.mark.parametrize(
    "name",
    [c if not c.startswith("mpi_") else pytest.param(c, marks=[pytest.mark.mpi, needs_mpiexec]) for c in CONFIGS],
)
def test_shipped_config_trains(tmp_path, name):
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"), "--config", os.path.join(ROOT, "configs", name)]
    for override in SHORT:
        cmd += ["--set", override]
    data = load_config(os.path.join(ROOT, "configs", name)).data.name
    if data.startswith("cifar"):  # its evaluation covers the whole test set: 10,000 images
        cmd += ["--set", f"data.root={write_cifar(tmp_path / 'data', data)}"]
    if name.startswith("mpi_"):
        cmd = [find_mpiexec(), "-n", "2", *cmd]
    code, out, err, _ = run_command(cmd, timeout=300, cwd=tmp_path)
    assert code == 0, err
    assert out.count("TensorBoard logs:") == 1, out  # one summary, from rank 0
    run = re.search(r"TensorBoard logs: (\S+)", out).group(1)
    assert os.path.isdir(tmp_path / run)
    assert any(".out.tfevents." in f for f in os.listdir(tmp_path / run))
    assert glob.glob(str(tmp_path / "checkpoints" / "*" / "*" / "step_00000002.npz"))
    if name.startswith("mpi_"):
        assert run.endswith("_np2")
