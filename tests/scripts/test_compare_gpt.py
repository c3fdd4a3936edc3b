"""scripts/compare_inplace.py on a GPT: the policies and the memory variants (+meln,
+fused) side by side, each in a run folder of its own; the variants hold less for backward."""

from __future__ import annotations

import os

import numpy as np
import pytest

from scripts import compare_inplace
from trainers.config import ConfigError

CONFIG = """\
experiment: gptcmp
threads: 1
data: {{name: text, path: {path}, block_size: 64, batch_size: 16, eval_batch_size: 16}}
model: {{name: gpt, args: {{n_layer: 1, n_head: 2, n_embd: 64, dropout: 0.1}}}}
optim: {{name: adamw, lr: 0.001, decay: matrices}}
train: {{max_steps: 3, eval_every: 3, log_every: 3}}
logging: {{progress: false, timeline: false}}
"""


def test_variants_parse_and_combine():
    assert compare_inplace.variant("on+meln+fused") == (
        "on",
        ["model.args.layer_norm=memory_efficient", "model.args.attention=fused"],
    )
    assert compare_inplace.variant("auto+abn") == ("auto", ["model.args.norm=inplace_abn"])
    assert compare_inplace.variant("compiled") == ("off", [])
    for bad in ("on+meln+meln", "sideways+abn", "on+flash", "compiled+meln"):
        assert compare_inplace.variant(bad) is None
        with pytest.raises(ConfigError, match="on\\+abn"):
            compare_inplace.parse_policies(f"off,{bad}")


def test_step_variants_parse_into_config_overrides():
    """+zero1, +zero2 (under mpiexec) and +acc<k> set distributed.zero and train.accumulate."""
    assert compare_inplace.variant("auto+zero2+acc4") == ("auto", ["distributed.zero=2", "train.accumulate=4"])
    assert compare_inplace.variant("on+abn+zero1") == ("on", ["model.args.norm=inplace_abn", "distributed.zero=1"])
    for bad in ("auto+zero1+zero2", "auto+acc2+acc4", "auto+acc0", "auto+acc", "auto+zero3"):
        assert compare_inplace.variant(bad) is None, bad


def test_compare_runs_the_gpt_variants_into_their_own_folders(tmp_path, capsys):
    rng = np.random.default_rng(0)
    text = "".join(rng.choice(list("abcdefgh \n"), 3000))
    (tmp_path / "t.txt").write_text(text)
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.format(path=tmp_path / "t.txt"))
    sets = [f"logging.logdir={tmp_path}/runs", f"checkpoint.dir={tmp_path}/ck"]
    code = compare_inplace.main(
        ["--config", str(path), "--policies", "off,on+meln,on+fused,auto+meln+fused", "--rounds", "1",
         "--round-steps", "1"] + [arg for s in sets for arg in ("--set", s)]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "runs" / "gptcmp")) == [
        "compare.png",
        "inplace-auto_meln_fused",
        "inplace-off_np1",
        "inplace-on_fused",
        "inplace-on_meln",
    ]
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] and "+" in line.split()[0]}
    header = next(line for line in out.splitlines() if line.startswith("policy")).split("  ")
    assert "eval loss" in [h.strip() for h in header if h.strip()]
    floor = {name: float(cells[2]) for name, cells in rows.items()}
    off_floor = float(next(line for line in out.splitlines() if line.startswith("off ")).split()[2])
    assert floor["on+meln"] < off_floor and floor["on+fused"] < off_floor
    assert floor["auto+meln+fused"] < min(floor["on+meln"], floor["on+fused"])
