"""``compile: true``: the trainer's step compiled (fw.compile), alone and under mpiexec."""

import gc
import os
import sys

import numpy as np
import pytest

from scripts import compare_inplace
from tests.conftest import requires_gpu
from tests.mpi_util import find_mpiexec, needs_mpiexec, run_command
from trainers.checkpoint import load_checkpoint
from trainers.config import ConfigError, load_config
from trainers.logging import read_scalars
from trainers.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIG = """\
experiment: cmp
threads: 1
seed: 3
data: {{name: digits, batch_size: {batch}}}
model: {{name: mlp, args: {{hidden: [16], norm: bn}}}}
optim: {{name: sgd, lr: 0.1, momentum: 0.9, weight_decay: 0.0001}}
schedule: {{name: cosine, warmup_steps: 2}}
train: {{max_steps: 8, eval_every: 4, log_every: 4}}
logging: {{progress: false, timeline: false}}
"""


def _cfg(tmp_path, *overrides, batch=16):
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.format(batch=batch))
    return load_config(str(path), [f"logging.logdir={tmp_path}/runs", f"checkpoint.dir={tmp_path}/ck", *overrides])


def _compare(tmp_path, policies, *overrides) -> int:
    """scripts/compare_inplace.py on CONFIG, its runs and checkpoints under ``tmp_path``."""
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.format(batch=16))
    sets = [*overrides, f"logging.logdir={tmp_path}/runs", f"checkpoint.dir={tmp_path}/ck"]
    return compare_inplace.main(
        ["--config", str(path), "--policies", policies] + [arg for o in sets for arg in ("--set", o)]
    )


@pytest.mark.parametrize("policy", ["off", "auto"])
def test_a_compiled_run_gives_the_losses_of_the_eager_run_bitwise(tmp_path, policy):
    results = {}
    for compiled in (False, True):
        gc.collect()
        trainer = Trainer(_cfg(tmp_path, f"inplace={policy}", f"compile={str(compiled).lower()}"))
        results[compiled] = (trainer.run_name, trainer.fit())
        if compiled:
            params = [p.detach().numpy().copy() for p in trainer.model.parameters()]
            buffers = [b.numpy().copy() for b in trainer.model.buffers()]
        else:
            eager_params = [p.detach().numpy().copy() for p in trainer.model.parameters()]
            eager_buffers = [b.numpy().copy() for b in trainer.model.buffers()]
        del trainer
    (name_e, eager), (name_c, comp) = results[False], results[True]
    assert name_c == f"inplace-{policy}_np1_compiled" and name_e == f"inplace-{policy}_np1"
    assert comp.losses == eager.losses  # a schedule changes lr every step: traced, not re-captured
    assert all(a.tobytes() == b.tobytes() for a, b in zip(params, eager_params))
    assert all(a.tobytes() == b.tobytes() for a, b in zip(buffers, eager_buffers))
    assert comp.eval_metric == eager.eval_metric
    assert comp.planned_peak_mb is not None and comp.inplace_chains > 0
    tags = read_scalars(comp.run_dir)
    for tag in (
        "memory/planned_peak_mb",
        "memory/planned_arena_mb",
        "memory/planned_lower_bound_mb",
        "memory/capture_peak_mb",
        "memory/peak_mb",
    ):
        assert tag in tags
    assert "memory/planned_peak_mb" not in read_scalars(eager.run_dir)


def test_compile_refuses_what_a_replay_cannot_run(tmp_path):
    with pytest.raises(ConfigError, match="grad_clip"):
        Trainer(_cfg(tmp_path, "compile=true", "train.grad_clip=1.0"))


def test_compare_inplace_accepts_compiled(tmp_path, capsys):
    assert _compare(tmp_path, "off,compiled") == 0
    out = capsys.readouterr().out
    assert "planned MB" in out and "inplace chains" in out
    row = next(line for line in out.splitlines() if line.startswith("compiled"))
    assert "-" not in row.split()[8:10]  # the compiled row has its planned peak and chains
    assert os.path.isdir(tmp_path / "runs" / "cmp" / "inplace-off_np1_compiled")


@pytest.mark.mpi
@needs_mpiexec
def test_two_ranks_compiled_equal_two_ranks_eager(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.format(batch=16))
    names = {}
    for compiled in ("false", "true"):
        cmd = [
            find_mpiexec(),
            "-n",
            "2",
            sys.executable,
            os.path.join(ROOT, "scripts", "train.py"),
            "--config",
            str(path),
            "--set",
            f"compile={compiled}",
            "--set",
            "inplace=off",
        ]
        code, out, err, _ = run_command(cmd, 180, cwd=tmp_path)
        assert code == 0, err
        names[compiled] = "inplace-off_np2" + ("_compiled" if compiled == "true" else "")
    ck = {k: load_checkpoint(str(tmp_path / "checkpoints" / "cmp" / n / "step_00000008.npz")) for k, n in names.items()}
    for name in ck["false"]["model"]:  # two ranks: the sum of two gradients does not depend on the order
        assert np.asarray(ck["true"]["model"][name]).tobytes() == np.asarray(ck["false"]["model"][name]).tobytes()


@pytest.mark.gpu
@requires_gpu
def test_a_compiled_gpu_run_gives_the_losses_of_the_eager_gpu_run_bitwise(tmp_path, gpu_run):
    results = {}
    for compiled in (False, True):
        gc.collect()
        trainer = Trainer(_cfg(tmp_path, "device=cuda", "inplace=off", f"compile={str(compiled).lower()}"))
        results[compiled] = trainer.fit()
        state = [p.detach().cpu().numpy().copy() for p in trainer.model.parameters()]
        state += [b.cpu().numpy().copy() for b in trainer.model.buffers()]
        results[compiled] = (results[compiled], state, trainer.compiled)
        del trainer
    (eager, eager_state, _), (comp, comp_state, step) = results[False], results[True]
    assert comp.losses == eager.losses
    assert all(a.tobytes() == b.tobytes() for a, b in zip(comp_state, eager_state))
    report = step.report()
    # the step replays as one CUDA graph (its products through the cuDNN frontend), the
    # schedule's learning rate read from the device; without the frontend the first Linear
    # calls cuBLAS and the step runs uncaptured, and says so
    from framework import backend

    if backend.cudnn_module() is not None:
        assert report["replay_mode"] == "cuda graph"
        graph = step._current().executor.cuda_graph
        assert graph.launches > 0 and graph.uncaptured == 0 and not graph.baked
        # the trainer uploads each batch into the graph's input slots: none is copied in
        # (the scalars, the graph, the loss and the logits copied out)
        assert graph.inputs_in_slots and graph.copies_in == 0 and report["replay_launches"] == 4
    else:
        assert report["replay_mode"].startswith("uncaptured: node ") and "cuBLAS" in report["replay_mode"]
    tags = read_scalars(comp.run_dir)
    assert "memory/planned_peak_mb" in tags and "memory/planned_arena_mb" in tags and "memory/peak_mb" in tags


@pytest.mark.gpu
@requires_gpu
def test_compare_inplace_runs_compiled_on_the_gpu(tmp_path, capsys, gpu_run):
    assert _compare(tmp_path, "off,auto,compiled", "device=cuda") == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.split()}
    assert {"off", "auto", "compiled"} <= set(rows)
    assert rows["compiled"].split()[-2] == rows["off"].split()[-2]  # the same final loss as eager off
    assert os.path.isdir(tmp_path / "runs" / "cmp" / "inplace-off_np1_compiled")
    assert "memory/planned_arena_mb" in read_scalars(str(tmp_path / "runs" / "cmp" / "inplace-off_np1_compiled"))
