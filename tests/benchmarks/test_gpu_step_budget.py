"""A training step's launches and host synchronizations on the GPU, held to budgets.

A CuPy call costs 7-10 µs from Python and a host synchronization stalls the step, so
the GPU step's speed is bounded by how many it makes (issue 24). Counted on the CuPy
stand-in (``benchmarks.bench_gpu.count_training_step``: one step after a warm-up step,
the loss left on the device), the budgets are ``bench_gpu.STEP_LAUNCH_BUDGET``: ResNet-20
with SGD and momentum, the same launches at batch 64 and 256, and the quickstart's MLP;
no host synchronization in either.
"""

from __future__ import annotations

import pytest

from benchmarks import bench_gpu
from tests.conftest import requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]


@pytest.fixture(autouse=True)
def _standin():
    if not bench_gpu.counts_here():
        pytest.skip("launches are counted on the CuPy stand-in only")


def _check(c, budget, what):
    assert c.host_syncs == 0, f"{what}: host synchronizations at {c.by_site(syncs=True)}"
    assert 0 < c.launches <= budget, f"{what}: {c.launches} launches (budget {budget}): {c.by_kind()}"


def test_a_resnet20_step_is_within_budget_and_the_same_at_batch_64_and_256():
    counts = {batch: bench_gpu.count_training_step("resnet20", "on", batch) for batch in (64, 256)}
    for batch, c in counts.items():
        _check(c, bench_gpu.STEP_LAUNCH_BUDGET["resnet20"], f"ResNet-20 at batch {batch}")
    # the same launches from the same lines: nothing is split by the batch size
    assert counts[64].launch_sites == counts[256].launch_sites


@pytest.mark.parametrize("variant", ["off", "on+InPlaceABN"])
def test_the_other_resnet20_variants_are_within_budget(variant):
    c = bench_gpu.count_training_step("resnet20", variant, 64)
    _check(c, bench_gpu.STEP_LAUNCH_BUDGET["resnet20"], f"ResNet-20 ({variant})")


def test_the_quickstart_mlp_step_is_within_budget():
    c = bench_gpu.count_training_step("quickstart")
    _check(c, bench_gpu.STEP_LAUNCH_BUDGET["quickstart"], "the quickstart MLP")
