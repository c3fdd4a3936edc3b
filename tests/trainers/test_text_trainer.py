"""The trainer on a language model: per-token loss and accuracy, the validation loss as
the evaluation, a sample at the end, and the compiled step (bitwise the eager losses)."""

from __future__ import annotations

import numpy as np
import pytest

from trainers.config import load_config
from trainers.trainer import Trainer

CONFIG = """\
experiment: lm
threads: 1
seed: 2
data: {{name: text, path: {path}, block_size: 16, batch_size: 4, eval_batch_size: 8}}
model: {{name: gpt, args: {{n_layer: 1, n_head: 2, n_embd: 16, dropout: 0.1}}}}
optim: {{name: adamw, lr: 0.003, decay: matrices, weight_decay: 0.1}}
schedule: {{name: cosine, warmup_steps: 2}}
train: {{max_steps: 6, eval_every: 3, log_every: 3}}
sample: {{tokens: 12, temperature: 0.8, top_k: 5}}
logging: {{progress: false, timeline: false}}
"""


@pytest.fixture
def config(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "t.txt").write_text("".join(rng.choice(list("abcdefgh éè\n"), 4000)), encoding="utf-8")
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.format(path=tmp_path / "t.txt"))

    def load(*overrides):
        return load_config(str(path), [f"logging.logdir={tmp_path}/runs", f"checkpoint.dir={tmp_path}/ck", *overrides])

    return load


def test_a_language_model_trains_evaluates_its_loss_and_writes_a_sample(config):
    trainer = Trainer(config(), resume=False)
    assert trainer.model.config.vocab_size == trainer.train_set.num_classes == 12
    assert trainer.model.config.block_size == 16
    assert "character-level vocabulary: 12 tokens" in trainer.describe_data()
    result = trainer.fit()
    assert result.eval_name == "loss" and 0 < result.eval_metric < 10
    sample = trainer.sample_text()
    assert isinstance(sample, str) and len(sample) == 13  # the prompt's token and 12 more
    assert set(sample) <= set("abcdefgh éè\n")


def test_the_compiled_step_gives_the_eager_losses_bit_for_bit(config):
    losses = {}
    for compiled in (False, True):
        trainer = Trainer(config(f"compile={str(compiled).lower()}", "inplace=off"), resume=False)
        losses[compiled] = trainer.fit().losses
    assert losses[True] == losses[False]
