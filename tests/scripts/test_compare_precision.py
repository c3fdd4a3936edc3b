"""scripts/compare_inplace.py with the precision variants (+bf16, +fp16): each in a run folder
of its own, beside the float32 run; a bfloat16 forward holds less for backward."""

from __future__ import annotations

import os

import numpy as np
import pytest

from scripts import compare_inplace
from tests.scripts.test_compare_gpt import CONFIG
from trainers.config import ConfigError


def test_precision_variants_parse_and_combine():
    assert compare_inplace.variant("auto+bf16") == ("auto", ["precision=bf16"])
    assert compare_inplace.variant("on+abn+fp16") == ("on", ["model.args.norm=inplace_abn", "precision=fp16"])
    assert compare_inplace.variant("on+meln+bf16") == (
        "on",
        ["model.args.layer_norm=memory_efficient", "precision=bf16"],
    )
    for bad in ("auto+bf16+fp16", "auto+bf16+bf16", "auto+fp8", "compiled+bf16"):
        assert compare_inplace.variant(bad) is None
        with pytest.raises(ConfigError, match="auto\\+bf16"):
            compare_inplace.parse_policies(f"off,{bad}")


def test_compare_runs_a_bf16_variant_beside_float32(tmp_path, capsys):
    rng = np.random.default_rng(0)
    (tmp_path / "t.txt").write_text("".join(rng.choice(list("abcdefgh \n"), 3000)))
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.format(path=tmp_path / "t.txt"))
    sets = [f"logging.logdir={tmp_path}/runs", f"checkpoint.dir={tmp_path}/ck"]
    code = compare_inplace.main(
        ["--config", str(path), "--policies", "auto,auto+bf16", "--rounds", "1", "--round-steps", "1"]
        + [arg for s in sets for arg in ("--set", s)]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "runs" / "gptcmp")) == [
        "compare.png",
        "inplace-auto_np1",
        "inplace-auto_np1_bf16",
    ]
    rows = [line.split() for line in out.splitlines()]  # the table's rows: peak MB, then floor MB
    floor = {c[0]: float(c[2]) for c in rows if c[:1] in (["auto"], ["auto+bf16"]) and c[1].replace(".", "").isdigit()}
    assert floor["auto+bf16"] < floor["auto"]
