"""One GPT block's saved tensors counted against Korthikanti et al.'s formula
(benchmarks/bench_transformer_memory.py, at its quick points): the listing, the exact
bytes, the 5% agreement, what each variant removes, and the block's inplace sites as the
policy finds them (auto bit for bit off's: the benchmark checks it as it runs)."""

from __future__ import annotations

import pytest

from benchmarks import bench_transformer_memory as B


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    png = tmp_path_factory.mktemp("fig") / "m.png"
    out = B.main(["--quick", "--figure", str(png)])
    assert png.stat().st_size > 10_000
    return out["results"]


def test_the_listing_is_every_tensor_backward_keeps_and_the_paper_s_count_within_5_percent(quick):
    assert len(quick) == 2  # two (s, b, h, a) points
    for (s, b, h, a), rows in quick.items():
        off = rows["off"]
        assert [(e.node, e.name) for e in off["listing"]] == [(n, k) for n, k, _ in B.PAPER_TERMS]
        sbh = s * b * h
        # exactly the paper's tensors, plus the LayerNorms' row statistics and the causal mask
        assert off["held"] == 66 * sbh + 9 * a * s * s * b + 16 * s * b + s * s
        assert abs(off["held"] / (66 * sbh + 9 * a * s * s * b) - 1) < 0.05


def test_what_each_variant_keeps(quick):
    for (s, b, h, a), rows in quick.items():
        sbh = s * b * h
        off = rows["off"]["held"]
        assert rows["auto"]["held"] == rows["on"]["held"] == off  # inplace sites keep the same tensors
        assert off - rows["on+meln"]["held"] == 8 * sbh + 8 * s * b  # the two LayerNorm inputs (and means)
        # no scores, probabilities or their mask; the log-sum-exp and the dropout draw instead
        assert rows["on+fused"]["held"] == 66 * sbh + 16 * s * b + 4 * a * s * b + 8
        for v, r in rows.items():
            assert r["held"] == r["exact"], v
            assert r["peak"] >= r["held"], v


def test_auto_finds_the_block_s_inplace_sites(quick):
    for rows in quick.values():
        auto = rows["auto"]["stats"]
        # the scale of the scores, the causal mask, softmax's input, both dropouts of the
        # residual branches, both residual adds
        for site, n in (("Mul", 1), ("MaskedFill", 1), ("Softmax", 1), ("Dropout", 2), ("residual_add", 2)):
            assert auto.get(f"auto_inplace_ops.{site}") == n, (site, auto)
        # the attention dropout would write over softmax's saved output: the site refuses
        assert auto.get("inplace_site_fallbacks") == 1
        assert rows["on"]["stats"].get("inplace_site_fallbacks") == 1
        assert "auto_inplace_ops.Gelu" not in auto  # its backward reads its input


def test_recomputation_keeps_what_korthikanti_et_al_count_within_2_percent(quick):
    """Selective (the attention core): 66sbh, the as^2 terms gone; full: the block's input,
    4sbh. During the backward the recomputation brings back exactly what the block would
    have kept (held + recomputed = off's bytes); the outputs and gradients are off's bit
    for bit (the benchmark checks it as it runs)."""
    for point, rows in quick.items():
        s, b, h, a = point
        sbh = s * b * h
        assert rows["on+selective"]["held"] == 66 * sbh + 16 * s * b  # q, k, v kept; no scores, no causal mask
        assert rows["on+full"]["held"] == 4 * sbh  # the input alone
        for v in ("on+selective", "on+full"):
            r = rows[v]
            assert abs(r["held"] / r["formula"] - 1) < 0.02, v
            assert r["held"] + r["recomputed"] == rows["off"]["held"], v
            assert abs((r["held"] + r["recomputed"]) / B.formula("off", *point) - 1) < 0.02, v


def test_without_dropout_a_block_keeps_64sbh_plus_4as2b(monkeypatch):
    """Issue 41: the docs gave `66sbh + 9as^2b` for any block; it is the count with dropout.
    Without it the probabilities' mask and dropped copy (as^2b + 4as^2b) and the two residual
    masks (2sbh) are gone."""
    block = B._block
    monkeypatch.setattr(B, "_block", lambda point, settings, seed=0: block(point, {**settings, "dropout": 0.0}, seed))
    s, b, h, a = point = (32, 2, 32, 2)
    held = B.measure(point, "off")["held"]
    assert held == 64 * s * b * h + 4 * a * s * s * b + 16 * s * b + s * s
