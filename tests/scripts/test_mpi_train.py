"""``mpiexec -n 2 python scripts/train.py``: data parallel training as a user runs it."""

import os
import sys

import numpy as np
import pytest

from framework import backend
from tests.conftest import requires_gpu
from tests.mpi_util import find_mpiexec, needs_mpiexec, run_command
from trainers.checkpoint import load_checkpoint
from trainers.logging import read_scalars

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [pytest.mark.mpi, needs_mpiexec]

CONFIG = """\
experiment: dp
threads: 1
seed: 7
data: {{name: digits, batch_size: {batch}}}
model: {{name: mlp, args: {{hidden: [16]}}}}
optim: {{name: sgd, lr: 0.1, momentum: 0.9}}
train: {{max_steps: 10, eval_every: 5, log_every: 5}}
logging: {{progress: false, timeline: false}}
"""


def train(tmp_path, nprocs, batch, *overrides, timeout=120, config=CONFIG):
    path = tmp_path / f"c{nprocs}.yaml"
    path.write_text(config.format(batch=batch))
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"), "--config", str(path), *overrides]
    if nprocs > 1:
        cmd = [find_mpiexec(), "-n", str(nprocs), *cmd]
    code, out, err, _ = run_command(cmd, timeout, cwd=tmp_path)
    return code, out, err


@pytest.mark.parametrize("policy", ["on", "auto", "off"])
def test_two_ranks_at_batch_b_equal_one_process_at_batch_2b(tmp_path, policy):
    code, out2, err2 = train(tmp_path, 2, 32, "--set", f"inplace={policy}")
    assert code == 0, err2
    code, out1, err1 = train(tmp_path, 1, 64, "--set", f"inplace={policy}")
    assert code == 0, err1
    assert out2.count("TensorBoard logs:") == 1  # only rank 0 prints, logs and saves
    two = load_checkpoint(str(tmp_path / "checkpoints" / "dp" / f"inplace-{policy}_np2" / "step_00000010.npz"))
    one = load_checkpoint(str(tmp_path / "checkpoints" / "dp" / f"inplace-{policy}_np1" / "step_00000010.npz"))
    assert two["model"].keys() == one["model"].keys()
    for name in one["model"]:
        np.testing.assert_allclose(
            np.asarray(two["model"][name]), np.asarray(one["model"][name]), rtol=1e-5, atol=1e-6, err_msg=name
        )
    scalars = read_scalars(str(tmp_path / "runs" / "dp" / f"inplace-{policy}_np2"))
    for tag in ("memory/peak_mb_rank0", "memory/peak_mb_rank1", "memory/peak_mb_max", "perf/samples_per_sec"):
        assert [s for s, _ in scalars[tag]] == [5, 10], tag
    # the loss logged under 2 ranks is the mean over ranks: the 1-process loss
    one_loss = read_scalars(str(tmp_path / "runs" / "dp" / f"inplace-{policy}_np1"))["train/loss"]
    np.testing.assert_allclose([v for _, v in scalars["train/loss"]], [v for _, v in one_loss], rtol=1e-5)
    assert sorted(os.listdir(tmp_path / "runs" / "dp")) == sorted([f"inplace-{policy}_np1", f"inplace-{policy}_np2"])


def test_progress_under_mpiexec_is_printed_as_lines_by_rank_0(tmp_path):
    # Rank 0's output reaches the terminal through mpiexec's pipe: a redrawn bar would
    # show nothing until the end, so it prints lines (here only the last: a short run).
    code, out, err = train(tmp_path, 2, 32, "--set", "logging.progress=true", "--set", "inplace=on")
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("train")]
    assert len(lines) == 1 and lines[0].split()[1] == "10/10", err
    assert "loss=" in lines[0] and "samples/s=" in lines[0] and "peak_mb=" in lines[0]
    assert "\r" not in err


def test_a_diverging_run_stops_every_rank_with_one_message(tmp_path):
    code, out, err = train(
        tmp_path, 2, 32, "--set", "optim.lr=1e12", "--set", "train.max_steps=60", "--set", "train.epochs=3"
    )
    assert code != 0
    assert "Traceback" not in err
    assert "error: loss is" in err or "error: another rank's loss is not finite" in err


def test_sync_bn_makes_a_batchnorm_model_match_one_process(tmp_path):
    # With SyncBatchNorm the statistics of each step cover both ranks' samples, so even a
    # BatchNorm model trains on 2 ranks x 32 exactly as on 1 process x 64.
    config = CONFIG.replace(
        "{{name: mlp, args: {{hidden: [16]}}}}", "{{name: convnet, args: {{channels: [4, 8], norm: bn}}}}"
    )
    assert "convnet" in config
    code, _, err = train(tmp_path, 2, 32, "--set", "distributed.sync_bn=true", config=config)
    assert code == 0, err
    code, _, err = train(tmp_path, 1, 64, config=config)
    assert code == 0, err
    two = load_checkpoint(str(tmp_path / "checkpoints" / "dp" / "inplace-auto_np2" / "step_00000010.npz"))["model"]
    one = load_checkpoint(str(tmp_path / "checkpoints" / "dp" / "inplace-auto_np1" / "step_00000010.npz"))["model"]
    for name in one:
        np.testing.assert_allclose(np.asarray(two[name]), np.asarray(one[name]), rtol=1e-4, atol=1e-5, err_msg=name)


def test_nccl_backend_on_the_cpu_is_one_line_error(tmp_path):
    code, out, err = train(tmp_path, 2, 32, "--set", "distributed.backend=nccl")
    assert code != 0
    assert "Traceback" not in err
    assert "error: distributed backend 'nccl' needs device 'cuda'; on the CPU use 'mpi' or 'auto'" in err


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("comm_backend", ["nccl", "mpi"])
def test_two_ranks_on_gpus_equal_one_process_on_the_cpu(tmp_path, comm_backend):
    """``device: cuda`` under ``mpiexec -n 2``: NCCL (one GPU per rank) or MPI host staging."""
    if comm_backend == "nccl" and backend.device_count() < 2:
        pytest.skip("NCCL needs one GPU per rank: 2 ranks need 2 GPUs")
    code, _, err2 = train(tmp_path, 2, 32, "--set", "device=cuda", "--set", f"distributed.backend={comm_backend}")
    assert code == 0, err2
    code, _, err1 = train(tmp_path, 1, 64)
    assert code == 0, err1
    two = load_checkpoint(str(tmp_path / "checkpoints" / "dp" / "inplace-auto_np2" / "step_00000010.npz"))["model"]
    one = load_checkpoint(str(tmp_path / "checkpoints" / "dp" / "inplace-auto_np1" / "step_00000010.npz"))["model"]
    for name in one:
        assert type(two[name]) is np.ndarray  # checkpoints hold host arrays
        np.testing.assert_allclose(two[name], np.asarray(one[name]), rtol=1e-4, atol=1e-5, err_msg=name)
    scalars = read_scalars(str(tmp_path / "runs" / "dp" / "inplace-auto_np2"))
    for rank in (0, 1):  # GPU memory, counted by each rank's pool hook
        assert all(v > 0 for _, v in scalars[f"memory/peak_mb_rank{rank}"])


GPT_CONFIG = """\
experiment: dpgpt
threads: 1
seed: 7
data: {{name: text, path: corpus.txt, block_size: 16, batch_size: {batch}, eval_batch_size: 16}}
model: {{name: gpt, args: {{n_layer: 1, n_head: 2, n_embd: 16, bias: false}}}}
optim: {{name: adamw, lr: 0.003, decay: matrices, weight_decay: 0.1}}
train: {{max_steps: 6, eval_every: 6, log_every: 3}}
logging: {{progress: false, timeline: false}}
"""


def test_a_language_model_on_two_ranks_equals_one_process_at_twice_the_batch(tmp_path):
    """The text data set's random blocks shared out by the ranks (each takes every second
    index of the epoch's permutation), the tied embedding/head weight's gradient averaged.
    No biases: the key projection's bias has a gradient of exactly zero in exact arithmetic
    (it shifts every score of a query by the same amount), so AdamW turns its rounding noise,
    which differs between the two sums, into updates of size lr."""
    rng = np.random.default_rng(0)
    (tmp_path / "corpus.txt").write_text("".join(rng.choice(list("abcdef gh\n"), 3000)), encoding="utf-8")
    code, _, err = train(tmp_path, 2, 4, config=GPT_CONFIG)
    assert code == 0, err
    code, _, err = train(tmp_path, 1, 8, config=GPT_CONFIG)
    assert code == 0, err
    ck = tmp_path / "checkpoints" / "dpgpt"
    two = load_checkpoint(str(ck / "inplace-auto_np2" / "step_00000006.npz"))
    one = load_checkpoint(str(ck / "inplace-auto_np1" / "step_00000006.npz"))
    assert two["model"].keys() == one["model"].keys()
    for name in one["model"]:
        np.testing.assert_allclose(
            np.asarray(two["model"][name]), np.asarray(one["model"][name]), rtol=1e-5, atol=1e-6, err_msg=name
        )
