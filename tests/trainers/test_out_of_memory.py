"""A step that runs out of device memory: one line saying what it asked for, the peak and
the batch, and the command line exits 2 (a batch too large for the device is bad input)."""

from __future__ import annotations

import pytest

from trainers import trainer as trainer_module
from trainers.cli import run_cli
from trainers.trainer import Trainer, out_of_memory_message

from .test_trainer import tiny_config


class FakeCupyOutOfMemory(MemoryError):
    """CuPy's ``cupy.cuda.memory.OutOfMemoryError``: its constructor and attributes."""

    def __init__(self, size, total, limit=0):
        self._size, self._total, self._limit = size, total, limit
        super().__init__(f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} bytes).")


def test_the_message_names_the_request_the_peak_and_the_batch():
    msg = out_of_memory_message(FakeCupyOutOfMemory(3 << 20, 5 << 20, 8 << 20), "cuda:0", 7, 256, 6 << 20)
    assert "\n" not in msg
    for fragment in ("cuda:0", "step 7", "batch 256", "asked for 3.0 MB", "5.0 MB allocated", "limit 8.0 MB"):
        assert fragment in msg, msg
    assert "peak so far 6.0 MB" in msg and "data.batch_size" in msg
    host = out_of_memory_message(MemoryError("Unable to allocate 2.00 GiB for an array"), "cpu", 0, 64, 0)
    assert "Unable to allocate 2.00 GiB for an array" in host and "batch 64" in host


def test_out_of_memory_in_a_step_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    def step(self, x, y, lr):
        raise FakeCupyOutOfMemory(123 << 20, 456 << 20)

    monkeypatch.setattr(trainer_module.Trainer, "_train_step", step)
    cfg = tiny_config(tmp_path)
    assert run_cli(lambda: Trainer(cfg).fit()) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(err) == 1 and "out of memory" in err[0] and "asked for 123.0 MB" in err[0], err
    assert f"batch {cfg.data.batch_size}" in err[0]


def test_out_of_memory_in_the_models_check_before_training_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    """The check that runs one sample through the model before step 1 (on a GPU its first
    allocations: a cuDNN plan's workspace is 32 MB) ran out: one line too, not a traceback."""

    def forward(self, x):
        raise FakeCupyOutOfMemory(32 << 20, 1 << 20, 2 << 20)

    cfg = tiny_config(tmp_path)
    monkeypatch.setattr("models.mlp.MLP.forward", forward)
    assert run_cli(lambda: Trainer(cfg).fit()) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(err) == 1 and "out of memory on cpu running one sample through the model" in err[0], err
    assert "asked for 32.0 MB" in err[0] and "limit 2.0 MB" in err[0], err


def test_other_errors_keep_their_traceback(tmp_path, monkeypatch):
    def step(self, x, y, lr):
        raise RuntimeError("a bug")

    monkeypatch.setattr(trainer_module.Trainer, "_train_step", step)
    with pytest.raises(RuntimeError, match="a bug"):
        run_cli(lambda: Trainer(tiny_config(tmp_path)).fit())


@pytest.mark.gpu
def test_a_step_beyond_the_gpus_memory_exits_2_with_one_line(tmp_path, cupy, capsys, gpu_run):
    """End to end on the GPU leg: the pool's limit (CuPy's ``set_limit``, what
    ``CUPY_GPU_MEMORY_LIMIT`` sets) below what a step needs stops the run with one line."""
    pool = cupy.get_default_memory_pool()
    cfg = tiny_config(tmp_path, "device=cuda", "data.batch_size=64")
    with cupy.cuda.Device(0):
        before = pool.get_limit()
        # the model built and checked on one sample first (that check's cuDNN workspace alone
        # is 32 MB), then room for what is in use, not for a step
        trainer = Trainer(cfg)
        pool.free_all_blocks()  # the limit counts cached blocks too: start from what is in use
        pool.set_limit(size=pool.used_bytes() + (64 << 10))
        try:
            assert run_cli(trainer.fit) == 2
        finally:
            pool.set_limit(size=before)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(err) == 1 and "out of memory on cuda:0" in err[0] and "batch 64" in err[0], err
    assert "pool limit" in err[0] and "asked for" in err[0], err
