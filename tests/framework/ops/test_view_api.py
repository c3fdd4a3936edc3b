"""The view ops added for PyTorch parity: values, gradients, shared storage and versions.

``view_as``, ``select``, ``narrow`` (negative start), ``swapdims``/``swapaxes``,
``mT``/``mH``/``H``, ``unbind``, ``split``, ``split_with_sizes``, ``chunk`` and
``as_strided`` through the op harness (float32 forward against a float64 NumPy
reference, float64 gradients against finite differences, on every input layout), then
their view and version semantics: writes through them reach the base and bump the one
version counter, and the outputs of ops that return several views refuse inplace ops
while autograd records, as in PyTorch.
"""

from __future__ import annotations

import numpy as np
import pytest

import framework as fw
from framework.testing import assert_close, gradcheck

from . import harness
from .harness import Budget, OpSpec

MULTI_VIEW_MSG = "This view is the output of a function that returns multiple views."


def _take(a, dim, i):
    return np.take(a, i, axis=dim)


SPECS = [
    OpSpec(
        "view_as",
        lambda x, y: x.view_as(y),
        lambda a, b: a.reshape(b.shape),
        [((2, 3), (3, 2)), ((6,), (2, 3))],
        view=True,
        layouts=("contiguous",),
    ),
    OpSpec("select(0,1)", lambda x: x.select(0, 1), lambda a: a[1], [((3,),), ((3, 4),), ((3, 2, 2),)], view=True),
    OpSpec("select(-1,-2)", lambda x: fw.select(x, -1, -2), lambda a: a[..., -2], [((3, 4),), ((2, 3, 4),)], view=True),
    OpSpec(
        "narrow(1,-2,2)", lambda x: fw.narrow(x, 1, -2, 2), lambda a: a[:, -2:], [((3, 4),), ((2, 5, 3),)], view=True
    ),
    OpSpec(
        "swapdims(0,-1)",
        lambda x: fw.swapdims(x, 0, -1),
        lambda a: np.swapaxes(a, 0, -1),
        [((2, 3),), ((2, 3, 4),)],
        view=True,
    ),
    OpSpec("swapaxes(1,2)", lambda x: x.swapaxes(1, 2), lambda a: np.swapaxes(a, 1, 2), [((2, 3, 4),)], view=True),
    OpSpec("mT", lambda x: x.mT, lambda a: np.swapaxes(a, -2, -1), [((2, 3),), ((2, 3, 4),)], view=True),
    OpSpec("mH", lambda x: x.mH, lambda a: np.swapaxes(a, -2, -1), [((2, 3, 4),)], view=True),
    OpSpec("H", lambda x: x.H, lambda a: a.T, [((2, 3),)], view=True),
    OpSpec("unbind(0)[1]", lambda x: x.unbind()[1], lambda a: a[1], [((3,),), ((3, 4),)], view=True),
    OpSpec(
        "unbind(-1) stacked",
        lambda x: fw.stack(fw.unbind(x, -1), 0),
        lambda a: np.moveaxis(a, -1, 0),
        [((2, 3),), ((2, 3, 4),)],
        view=None,
        budget=Budget(1, 23),
    ),
    OpSpec("split(2,1)[1]", lambda x: x.split(2, 1)[1], lambda a: a[:, 2:4], [((3, 5),), ((2, 4, 3),)], view=True),
    OpSpec("split(2,1)[-1]", lambda x: fw.split(x, 2, 1)[-1], lambda a: a[:, 4:], [((3, 5),)], view=True),
    OpSpec(
        "split([1,3],-1) cat",
        lambda x: fw.cat(x.split([1, 3], -1)[::-1], -1),
        lambda a: np.concatenate([a[..., 1:], a[..., :1]], -1),
        [((4,),), ((2, 4),)],
        view=None,
    ),
    OpSpec(
        "split_with_sizes([2,1])[0]",
        lambda x: fw.split_with_sizes(x, [2, 1])[0],
        lambda a: a[:2],
        [((3,),), ((3, 2),)],
        view=True,
    ),
    OpSpec("chunk(2)[1]", lambda x: x.chunk(2)[1], lambda a: a[3:], [((5,),), ((5, 2),)], view=True),
    OpSpec(
        "chunk(3,1) cat",
        lambda x: fw.cat(fw.chunk(x, 3, 1)[::-1], 1),
        lambda a: np.concatenate([a[:, 4:], a[:, 2:4], a[:, :2]], 1),
        [((2, 5),)],
        view=None,
        budget=Budget(1, 12),
    ),
    OpSpec(
        "as_strided((2,2),(1,3),1)",
        lambda x: x.as_strided((2, 2), (1, 3), 1),
        lambda a: np.lib.stride_tricks.as_strided(a.reshape(-1)[1:], (2, 2), (a.itemsize, 3 * a.itemsize)),
        [((2, 3),), ((6,),)],
        view=True,
        layouts=("contiguous",),
        budget=Budget(0, 33, 0, 4),
    ),
    OpSpec(
        "as_strided overlapping",
        lambda x: fw.as_strided(x, (3, 3), (1, 1)),
        lambda a: np.lib.stride_tricks.as_strided(a.reshape(-1), (3, 3), (a.itemsize, a.itemsize)),
        [((5,),)],
        view=True,
        layouts=("contiguous",),
        budget=Budget(0, 30, 0, 4),
    ),
]


@pytest.mark.parametrize("case", harness.cases(SPECS))
def test_forward(case, backend):
    harness.check_forward(case, backend)


@pytest.mark.parametrize("case", harness.cases(SPECS, need="grad"))
def test_backward(case, backend):
    harness.check_backward(case, backend)


@pytest.mark.parametrize("case", harness.cases(SPECS, need="grad"))
def test_double_backward(case, backend):
    harness.check_double_backward(case, backend)


# --- views: shared memory, one version counter, writes reach the base -------------------------

VIEWS = {
    "view_as": lambda x: x.view_as(fw.empty(12)),
    "select": lambda x: x.select(1, 2),
    "narrow": lambda x: fw.narrow(x, 0, -2, 2),
    "swapdims": lambda x: x.swapdims(0, 1),
    "mT": lambda x: x.mT,
    "unbind": lambda x: x.unbind(1)[0],
    "split": lambda x: x.split(2)[1],
    "split_with_sizes": lambda x: x.split_with_sizes([1, 2], 0)[1],
    "chunk": lambda x: x.chunk(2, 1)[0],
    "as_strided": lambda x: x.as_strided((2, 2), (4, 1), 5),
}


@pytest.mark.parametrize("name", sorted(VIEWS))
def test_views_share_storage_and_version(name):
    base = fw.tensor(np.arange(1.0, 13.0).reshape(3, 4))
    v = VIEWS[name](base)
    assert v._base is base and np.shares_memory(v._data, base._data) and v._vc is base._vc
    expected = VIEWS[name](fw.tensor(base.numpy())).numpy()
    v.mul_(-1.0)  # nothing requires grad: every one of them may be written
    assert base._version == 1 and v._version == 1
    flat = base.numpy().reshape(-1)
    assert (flat < 0).sum() == v.numel()  # the write reached exactly the view's elements
    assert_close(v, -expected)


@pytest.mark.parametrize("op", ["unbind", "split", "split_with_sizes", "chunk"])
def test_multi_output_views_refuse_inplace_while_recording(op):
    make = {
        "unbind": lambda t: t.unbind(),
        "split": lambda t: t.split(1),
        "split_with_sizes": lambda t: t.split_with_sizes([1, 2]),
        "chunk": lambda t: t.chunk(3),
    }[op]
    leaf = fw.ones(3, 2, requires_grad=True)
    outs = make(leaf * 1.0)
    before = outs[0].tolist()
    with pytest.raises(RuntimeError, match=MULTI_VIEW_MSG) as err:
        outs[0].add_(1.0)
    assert "Output 0 of" in str(err.value) and "add_" in str(err.value)
    assert outs[0].tolist() == before and outs[0]._version == 0  # refused before writing
    b = leaf * 1.0
    with fw.no_grad():
        outs = make(b)
    with fw.no_grad():
        outs[0].add_(1.0)  # made and written without recording: allowed
    with pytest.raises(RuntimeError, match="A view was created in no_grad mode"):
        outs[1].add_(1.0)
    plain = make(fw.ones(3, 2))
    plain[0].add_(1.0)  # nothing requires grad: allowed
    assert plain[0]._base.tolist()[0] == [2.0, 2.0]


def test_multi_output_view_history_cannot_be_rebuilt_after_the_base_changed():
    # PyTorch: reading grad_fn of an unbind output after an inplace op on its base raises.
    b = fw.ones(2, 3, requires_grad=True) * 1.0
    rows = b.unbind()
    b.mul_(2.0)
    with pytest.raises(RuntimeError, match="its base or another view of its base has been modified inplace"):
        rows[0].grad_fn  # noqa: B018
    assert "grad_fn=<Invalid>" in repr(rows[0])  # printing still works, as in PyTorch


def test_split_and_chunk_sizes_and_errors():
    x = fw.arange(10.0)
    assert [t.shape[0] for t in x.split(3)] == [3, 3, 3, 1]
    assert [t.shape[0] for t in x.chunk(4)] == [3, 3, 3, 1]
    assert [t.shape[0] for t in x.chunk(6)] == [2, 2, 2, 2, 2]  # at most 6 chunks
    assert [t.shape[0] for t in fw.zeros(0).chunk(3)] == [0, 0, 0]
    assert [t.shape[0] for t in fw.zeros(0).split(2)] == [0]
    with pytest.raises(RuntimeError, match="split_with_sizes expects split_sizes to sum exactly to 10"):
        x.split([3, 3])
    with pytest.raises(RuntimeError, match="split expects split_size be non-negative"):
        x.split(-1)
    with pytest.raises(RuntimeError, match="split_size can only be 0 if dimension size is 0"):
        x.split(0)
    with pytest.raises(RuntimeError, match="chunk expects at least a 1-dimensional tensor"):
        fw.tensor(1.0).chunk(2)
    with pytest.raises(IndexError, match="select\\(\\): index 3 out of range"):
        fw.ones(3).select(0, 3)
    with pytest.raises(IndexError, match="Dimension specified as 0 but tensor has no dimensions"):
        fw.tensor(1.0).unbind()


def test_as_strided_counts_from_the_base_storage_and_checks_bounds():
    base = fw.arange(10.0)
    v = base[4:]
    assert v.as_strided((3,), (1,)).tolist() == [4.0, 5.0, 6.0]  # default offset: where v starts
    assert v.as_strided((3,), (1,), 0).tolist() == [0.0, 1.0, 2.0]  # offsets count from the storage
    assert fw.as_strided(base, (2, 2), (0, 3)).tolist() == [[0.0, 3.0], [0.0, 3.0]]
    with pytest.raises(RuntimeError, match="out of bounds for storage of size 40"):
        base.as_strided((3,), (5,), 1)
    with pytest.raises(RuntimeError, match="Negative strides are not supported"):
        base.as_strided((2,), (-1,))
    with pytest.raises(RuntimeError, match="contiguous"):
        fw.from_numpy(np.ones((4, 3)).T).as_strided((2,), (1,))  # a base that is not contiguous
    e = fw.as_strided(base, (3, 3), (0, 1))  # overlapping: a write through it is refused
    with pytest.raises(RuntimeError, match="single memory location"):
        e.add_(1.0)
    assert base._version == 0


def test_as_strided_gradient_of_an_overlapping_view():
    # d/dx sum(as_strided(x, (3, 3), (1, 1))): element k is read min(k, 2, 4 - k) + 1 times.
    x = fw.ones(5, dtype=fw.float64, requires_grad=True)
    fw.as_strided(x, (3, 3), (1, 1)).sum().backward()
    assert x.grad.tolist() == [1.0, 2.0, 3.0, 2.0, 1.0]
    gradcheck(
        lambda x: fw.as_strided(x.expand(4, 5), (2, 3), (1, 1), 1), [fw.ones(5, dtype=fw.float64, requires_grad=True)]
    )


def test_inplace_through_the_new_views_gives_gradients_to_the_base():
    leaf = fw.arange(1.0, 7.0, dtype=fw.float64).view(2, 3).requires_grad_()
    base = leaf * 1.0
    base.select(1, 0).mul_(10.0)  # column 0
    base.mT.narrow(0, -1, 1).mul_(100.0)  # column 2, through a chain of views
    base.as_strided((1,), (1,), 4).mul_(-1.0)  # element (1, 1)
    assert base.tolist() == [[10.0, 2.0, 300.0], [40.0, -5.0, 600.0]]
    base.sum().backward()
    assert leaf.grad.tolist() == [[10.0, 1.0, 100.0], [10.0, -1.0, 100.0]]


def test_flatten_of_one_dim_returns_the_tensor_itself():
    x = fw.randn(5, requires_grad=True)
    assert x.flatten() is x and fw.flatten(x) is x
    y = fw.randn(2, 3, 4)
    assert y.flatten(1, 1) is y and y.flatten(-1, 2) is y
    assert fw.tensor(1.0).flatten().shape == (1,)  # 0-d still gives a new 1-d view


def test_allclose():
    a = fw.tensor([1.0, 2.0, float("nan")])
    assert fw.allclose(a[:2], a[:2] + 1e-9) and a[:2].allclose(a[:2])
    assert not fw.allclose(a[:2], a[:2] + 1e-3)
    assert fw.allclose(a[:2], a[:2] + 1e-3, atol=1e-2)
    assert fw.allclose(fw.tensor([100.0]), fw.tensor([101.0]), rtol=0.011)
    assert not fw.allclose(a, a) and fw.allclose(a, a, equal_nan=True)
    assert fw.allclose(fw.ones(2, 3), fw.ones(3))  # broadcasts
    assert isinstance(fw.allclose(a, a), bool)
    with pytest.raises(RuntimeError, match="did not match"):
        fw.allclose(fw.ones(2), fw.ones(2, dtype=fw.float64))
