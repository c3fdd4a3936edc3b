"""The stand-in counts what a GPU pays for: one launch per kernel CuPy would run, one host
synchronization per call that waits for the device, each by kind and call site."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import framework as fw
import framework.testing.cupy_standin as cp
from framework.testing import cupyx_standin as cpx
from framework.testing.cupy_standin import counting
from tests.conftest import requires_gpu
from tests.framework.ops import harness


def _x():
    return cp.arange(12, dtype=cp.float32).reshape(3, 4)


# (id, op(x, i) on x a 3x4 float32 array and i = [0, 2] on the device, launches by kind, host syncs by kind)
CASES = [
    # views and empty memory: nothing runs on the device
    ("reshape (contiguous)", lambda x, i: x.reshape(4, 3), {}, {}),
    ("transpose", lambda x, i: x.T, {}, {}),
    ("slice", lambda x, i: x[1:, ::2], {}, {}),
    ("int index (0-d view)", lambda x, i: x[1, 2], {}, {}),
    ("broadcast_to", lambda x, i: cp.broadcast_to(x[0], (5, 4)), {}, {}),
    ("expand_dims, squeeze", lambda x, i: cp.expand_dims(x, 0).squeeze(0), {}, {}),
    ("ravel (contiguous)", lambda x, i: x.ravel(), {}, {}),
    ("empty", lambda x, i: cp.empty((100,), cp.float32), {}, {}),
    ("empty_like", lambda x, i: cp.empty_like(x), {}, {}),
    ("astype, same dtype, copy=False", lambda x, i: x.astype(cp.float32, copy=False), {}, {}),
    ("asarray of a device array", lambda x, i: cp.asarray(x), {}, {}),
    # one kernel each
    ("reshape (needs a copy)", lambda x, i: x.T.reshape(12), {"copy": 1}, {}),
    ("ufunc", lambda x, i: cp.exp(x), {"elementwise": 1}, {}),
    ("ufunc out=", lambda x, i: cp.add(x, 1, out=x), {"elementwise": 1}, {}),
    ("operator", lambda x, i: x * 2.5, {"elementwise": 1}, {}),
    ("inplace operator", lambda x, i: x.__iadd__(1), {"elementwise": 1}, {}),
    ("where", lambda x, i: cp.where(x > 3, x, 0), {"elementwise": 2}, {}),
    ("ufunc on an empty array", lambda x, i: cp.exp(x[:0]), {}, {}),
    ("sum()", lambda x, i: x.sum(), {"reduction": 1}, {}),
    ("sum(axis, keepdims)", lambda x, i: x.sum(axis=1, keepdims=True), {"reduction": 1}, {}),
    ("amax(axis)", lambda x, i: cp.amax(x, axis=0), {"reduction": 1}, {}),
    ("argmax", lambda x, i: x.argmax(axis=1), {"reduction": 1}, {}),
    ("var: mean, then squares", lambda x, i: x.var(axis=0), {"reduction": 2}, {}),
    ("cumsum", lambda x, i: x.cumsum(axis=1), {"scan": 1}, {}),
    ("matmul", lambda x, i: x @ x.T, {"matmul": 1}, {}),
    ("dot", lambda x, i: cp.dot(x, x.T), {"matmul": 1}, {}),
    (
        "matmul of strided operands: cuBLAS needs copies",
        lambda x, i: x[:, ::2] @ x[::2, :2],
        {"copy": 2, "matmul": 1},
        {},
    ),
    (
        "matmul into a strided out",
        lambda x, i: cp.matmul(x[:2], x[:2].T, out=x[1:3, 1:3]),
        {"copy": 1, "matmul": 1},
        {},
    ),
    (
        "batched matmul over a broadcast: pointer arrays",
        lambda x, i: cp.matmul(x.reshape(3, 1, 4), x.T),  # x.T is copied: above 2-d CuPy wants C order
        {"copy": 1, "elementwise": 3, "matmul": 1},
        {},
    ),
    ("einsum", lambda x, i: cp.einsum("ij,kj->ik", x, x), {"matmul": 1}, {}),
    ("copy", lambda x, i: x.copy(), {"copy": 1}, {}),
    ("copyto", lambda x, i: cp.copyto(x, x[::-1]), {"copy": 1}, {}),
    ("astype (a cast)", lambda x, i: x.astype(cp.float64), {"elementwise": 1}, {}),
    ("ascontiguousarray of a transpose", lambda x, i: cp.ascontiguousarray(x.T), {"copy": 1}, {}),
    ("zeros: a memset", lambda x, i: cp.zeros((4, 4)), {"memset": 1}, {}),
    ("zeros_like: a memset", lambda x, i: cp.zeros_like(x), {"memset": 1}, {}),
    ("ones: a fill", lambda x, i: cp.ones((4, 4)), {"elementwise": 1}, {}),
    ("full: a fill", lambda x, i: cp.full((4,), 2.0), {"elementwise": 1}, {}),
    ("fill", lambda x, i: x.fill(0), {"elementwise": 1}, {}),
    ("arange", lambda x, i: cp.arange(10), {"elementwise": 1}, {}),
    ("eye: zeros, then the diagonal", lambda x, i: cp.eye(3, 4), {"memset": 1, "elementwise": 1}, {}),
    ("concatenate", lambda x, i: cp.concatenate([x, x, x]), {"copy": 1}, {}),
    ("stack", lambda x, i: cp.stack([x, x]), {"copy": 1}, {}),
    ("gather: x[index array]", lambda x, i: x[i], {"gather": 1}, {}),
    ("gather with a host index: copied first", lambda x, i: x[[0, 2]], {"h2d": 1, "gather": 1}, {}),
    ("take", lambda x, i: x.take(i, axis=1), {"gather": 1}, {}),
    (
        "mask: scan, count read back, gather",
        lambda x, i: x[x > 5],
        {"elementwise": 1, "scan": 1, "gather": 1},
        {"mask": 1},
    ),
    ("setitem of a slice, scalar", lambda x, i: x.__setitem__((slice(None), 0), 1.0), {"elementwise": 1}, {}),
    ("setitem of a slice, array", lambda x, i: x.__setitem__(slice(0, 1), x[2:3]), {"copy": 1}, {}),
    ("setitem by index array", lambda x, i: x.__setitem__(i, 0.0), {"scatter": 1}, {}),
    ("scatter_add", lambda x, i: cpx.scatter_add(x, i, 1.0), {"scatter": 1}, {}),
    ("asarray of a host array", lambda x, i: cp.asarray(np.ones(3)), {"h2d": 1}, {}),
    ("random", lambda x, i: cp.random.default_rng(0).standard_normal((3,), cp.float32), {"random": 2}, {}),
    # host synchronizations
    ("get", lambda x, i: x.get(), {}, {"get": 1}),
    ("get of a transpose: a copy first", lambda x, i: x.T.get(), {"copy": 1}, {"get": 1}),
    ("asnumpy", lambda x, i: cp.asnumpy(x), {}, {"get": 1}),
    ("float", lambda x, i: float(x[0, 1]), {}, {"float": 1}),
    ("int", lambda x, i: int(x[0, 1]), {}, {"int": 1}),
    ("bool", lambda x, i: bool(x[0, 1]), {}, {"bool": 1}),
    ("item", lambda x, i: x[0, 1].item(), {}, {"item": 1}),
    ("tolist", lambda x, i: x.tolist(), {}, {"tolist": 1}),
    ("nonzero: the count read back", lambda x, i: x.nonzero(), {"scan": 1, "elementwise": 1}, {"nonzero": 1}),
    ("Device.synchronize", lambda x, i: cp.cuda.Device(0).synchronize(), {}, {"synchronize": 1}),
    ("Stream.synchronize", lambda x, i: cp.cuda.get_current_stream().synchronize(), {}, {"synchronize": 1}),
    ("deviceSynchronize", lambda x, i: cp.cuda.runtime.deviceSynchronize(), {}, {"synchronize": 1}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_counts_each_kind(case):
    _, op, launches, syncs = case
    x, i = _x(), cp.asarray([0, 2])
    with counting.count() as c:
        op(x, i)
    assert c.by_kind() == launches, f"launches {c.by_kind()}, expected {launches}"
    assert c.by_kind(syncs=True) == syncs, f"host syncs {c.by_kind(syncs=True)}, expected {syncs}"
    assert c.launches == sum(launches.values()) and c.host_syncs == sum(syncs.values())


def test_the_site_is_the_callers_line_and_blocks_nest():
    x = _x()
    with counting.count() as outer:
        y = x + 1  # one launch here
        with counting.count() as inner:
            float(y.sum())
        line = test_the_site_is_the_callers_line_and_blocks_nest.__code__.co_firstlineno
    here = __file__.rsplit("/", 1)[-1]
    sites = {site.rsplit("/", 1)[-1] for site in outer.by_site()}
    assert sites == {f"{here}:{line + 3}", f"{here}:{line + 5}"}, sites
    assert inner.launches == 1 and inner.host_syncs == 1
    assert outer.launches == 2 and outer.host_syncs == 1
    assert inner.by_site(syncs=True) == {next(iter(inner.by_site())): 1}


def test_nothing_is_counted_outside_a_block():
    x = _x()
    x + 1
    with counting.count() as c:
        pass
    assert c.launches == 0 and c.host_syncs == 0 and c.by_kind() == {} and c.by_site() == {}


@pytest.mark.gpu
@requires_gpu
def test_the_op_harness_holds_each_spec_to_its_budget():
    """The gpu leg of the op harness fails an op that launches or syncs more than its spec
    allows, forward and backward (counted on the stand-in; real CuPy counts nothing)."""
    if not harness.counts_launches("cuda"):
        pytest.skip("launches are counted on the CuPy stand-in only")
    spec = harness.OpSpec("exp", fw.exp, np.exp, [((2, 3),)], layouts=("contiguous",))
    case = harness.cases([spec])[0].values[0]
    harness.check_forward(case, "cuda")  # one kernel: within the default budget
    harness.check_backward(case, "cuda")
    tight = dataclasses.replace(case, spec=dataclasses.replace(spec, budget=harness.Budget(forward=0, backward=0)))
    with pytest.raises(AssertionError, match=r"forward made 1 launches \(budget 0\)"):
        harness.check_forward(tight, "cuda")
    with pytest.raises(AssertionError, match=r"backward made \d+ launches \(budget 0\)"):
        harness.check_backward(tight, "cuda")
    reads_back = dataclasses.replace(spec, fn=lambda x: fw.exp(x) * (1.0 if x.sum().item() > -1e9 else 0.0))
    case = dataclasses.replace(case, spec=reads_back)
    with pytest.raises(AssertionError, match=r"forward made 1 host synchronizations \(budget 0\)"):
        harness.check_forward(case, "cuda")
