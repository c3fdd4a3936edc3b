"""``mpiexec -n 2 python scripts/train.py`` with distributed.zero and train.accumulate."""

import numpy as np
import pytest

from tests.mpi_util import needs_mpiexec
from tests.scripts.test_mpi_train import train
from trainers.checkpoint import load_checkpoint
from trainers.logging import read_scalars

pytestmark = [pytest.mark.mpi, needs_mpiexec]

CONFIG = """\
experiment: zero
threads: 1
seed: 7
data: {{name: digits, batch_size: {batch}}}
model: {{name: mlp, args: {{hidden: [16]}}}}
optim: {{name: adamw, lr: 0.01, weight_decay: 0.1, decay: matrices}}
train: {{max_steps: 10, eval_every: 5, log_every: 5}}
logging: {{progress: false, timeline: false}}
"""


def test_two_ranks_sharded_and_accumulating_equal_one_process_on_the_whole_batch_and_resume(tmp_path):
    """2 ranks x 2 micro-batches of 16 under ZeRO stage 2 (the reduce-scatter once per step),
    stopped after step 5 and resumed from its checkpoint (the optimizer state saved whole),
    end where 1 process x 64 does, up to the order of the sums. Each rank logs what it holds
    of parameters, gradients and optimizer state: the paper's bytes (stage 2: 4 + 12 / N per
    parameter). Bit-for-bit equality with stage 0 is mpi_worker_zero.py's (test_zero.py)."""
    sharded = ("--set", "train.accumulate=2", "--set", "distributed.zero=2")
    code, _, err = train(tmp_path, 2, 16, *sharded, "--set", "train.max_steps=5", config=CONFIG)
    assert code == 0, err
    code, out, err = train(tmp_path, 2, 16, *sharded, "--resume", config=CONFIG)
    assert code == 0 and "resumed from step 5" in out, err
    code, _, err = train(tmp_path, 1, 64, config=CONFIG)
    assert code == 0, err
    run = "inplace-auto_np2_zero2_acc2"
    ck = tmp_path / "checkpoints" / "zero"
    two = load_checkpoint(str(ck / run / "step_00000010.npz"))
    one = load_checkpoint(str(ck / "inplace-auto_np1" / "step_00000010.npz"))
    for name in one["model"]:
        np.testing.assert_allclose(two["model"][name], one["model"][name], rtol=1e-4, atol=1e-5, err_msg=name)
    for i, state in one["optimizer"]["state"].items():  # consolidated: every parameter's whole state
        assert list(two["optimizer"]["state"][i]) == list(state) == ["step", "exp_avg", "exp_avg_sq"]
        np.testing.assert_allclose(two["optimizer"]["state"][i]["exp_avg"], state["exp_avg"], rtol=1e-3, atol=1e-6)
    scalars = read_scalars(str(tmp_path / "runs" / "zero" / run))
    one_loss = read_scalars(str(tmp_path / "runs" / "zero" / "inplace-auto_np1"))["train/loss"]
    np.testing.assert_allclose([v for _, v in scalars["train/loss"]], [v for _, v in one_loss], rtol=1e-5)
    (_, want), *_ = scalars["memory/model_states_zero_mb"]
    numel = sum(v.size for v in one["model"].values())
    assert want * 2**20 == pytest.approx(4 * numel + 12 * numel / 2)
    for rank in (0, 1):
        held = [v for _, v in scalars[f"memory/model_states_mb_rank{rank}"]]
        assert len(held) == 2 and all(abs(v - want) <= 0.02 * want for v in held), (rank, held, want)
        assert all(v > 0 for _, v in scalars[f"memory/floor_mb_rank{rank}"])
