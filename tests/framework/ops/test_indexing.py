"""``__getitem__`` (basic: views; integer/boolean tensors: copies) and ``__setitem__``."""

from __future__ import annotations

import numpy as np
import pytest

import framework as fw
from framework.testing import assert_close, gradcheck

from . import harness
from .harness import UNARY, Budget, OpSpec

ND = [((5,),), ((2, 3),), ((2, 3, 4),)]
ND2 = [((2, 3),), ((2, 3, 4),)]
ND3 = [((2, 3, 4),)]

IDX = fw.tensor([0, 2, 0])  # with a duplicate: its gradient accumulates
MASK = fw.tensor([[True, False, True], [False, False, True]])


def _np_index(index):
    """The same index for the NumPy reference (tensors -> arrays)."""
    items = index if isinstance(index, tuple) else (index,)
    out = tuple(it.numpy() if isinstance(it, fw.Tensor) else it for it in items)
    return out if isinstance(index, tuple) else out[0]


def _fmt(index) -> str:
    """``index`` as it is written between brackets, for test ids: ``1:,::2``, ``...,T[0, 2]``."""
    if isinstance(index, tuple):
        return ",".join(_fmt(i) for i in index) if index else "()"
    if isinstance(index, slice):
        parts = ["" if p is None else str(p) for p in (index.start, index.stop, index.step)]
        return ":".join(parts if index.step is not None else parts[:2])
    if index is Ellipsis:
        return "..."
    if isinstance(index, fw.Tensor):
        return f"T{index.tolist()}".replace("True", "1").replace("False", "0")
    return str(index)


def getitem(index, shapes, view=True, **kw):
    return OpSpec(f"x[{_fmt(index)}]", lambda x: x[index], lambda a: a[_np_index(index)], shapes, view=view, **kw)


def setitem(index, shapes, value=None, through=None, **kw):
    """``y = x * 1; y[index] = v`` as a function of (x, v), or of x for a constant ``value``.

    ``through`` writes through a view of y instead: ``through(y)[index] = v``.
    """
    view = through or (lambda y: y)
    np_index = _np_index(index)

    if value is None:

        def fn(x, v):
            y = x * 1
            view(y)[index] = v
            return y

        def ref(a, b):
            a = a.copy()
            view(a)[np_index] = b
            return a
    else:

        def fn(x):
            y = x * 1
            view(y)[index] = value
            return y

        def ref(a):
            a = a.copy()
            view(a)[np_index] = value
            return a

    what = "v" if value is None else repr(value)
    name = f"y{'.T' if through else ''}[{_fmt(index)}]={what}"
    return OpSpec(name, fn, ref, shapes, **kw)


SPECS = [
    # --- basic indexing: views ---------------------------------------------------------
    getitem(1, ND),
    getitem(-1, ND2),
    getitem((1, 2), ND2),  # a 0-d view
    getitem((slice(1, None), slice(None, None, 2)), ND2),
    getitem(None, UNARY),
    getitem(Ellipsis, UNARY),
    getitem((), [((),)]),
    getitem((Ellipsis, 1), ND2),
    getitem((0, None, Ellipsis, slice(1, 3)), ND3),
    getitem((slice(None), -1), ND2),
    getitem(fw.tensor(1), ND),  # a 0-d integer tensor indexes like an int
    # --- advanced indexing: copies ------------------------------------------------------
    getitem(IDX, [((3,),), ((3, 2),)], view=False, budget=Budget(6, 6, 1, 0)),
    getitem((slice(None), IDX), [((2, 3),)], view=False, budget=Budget(6, 6, 1, 0)),
    getitem((1, IDX), [((2, 3),)], view=False, budget=Budget(6, 6, 1, 0)),
    getitem((fw.tensor([1, 0, 1]), IDX), [((2, 3),)], view=False, budget=Budget(12, 6, 1, 0)),
    getitem([1, 0, 1], [((2, 3),)], view=False, budget=Budget(6, 6, 1, 0)),
    getitem(MASK, [((2, 3),)], view=False, budget=Budget(3, 6, 1, 0)),
    getitem((MASK, Ellipsis), [((2, 3, 4),)], view=False, layouts=("contiguous",), budget=Budget(3, 4, 1, 0)),
    OpSpec("x[x>0]", lambda x: x[x > 0], lambda a: a[a > 0], ND, budget=Budget(3, 6, 1, 0)),
    # --- setitem: gradients to the kept part of y and to the value ----------------------
    setitem(0, [((2, 3), (3,)), ((2, 3), ()), ((2, 3), (1,)), ((3,), ())], budget=Budget(2, 11)),
    setitem((slice(None), slice(1, None)), [((2, 3), (2, 2)), ((2, 3), (2, 1))], budget=Budget(2, 11)),
    setitem((Ellipsis, 0), [((2, 3, 4), (2, 3)), ((2, 3, 4), (3,))], budget=Budget(2, 11)),
    setitem((slice(1, None), 0), [((3, 2),)], value=5.0),
    setitem(Ellipsis, [((), ())]),
    setitem(fw.tensor([2, 0]), [((3, 2), (2, 2)), ((3, 2), (2,)), ((3,), (2,))], budget=Budget(7, 11, 1, 0)),
    setitem(fw.tensor([2, 0]), [((3, 2),)], value=-1.0, budget=Budget(7, 7, 1, 0)),
    setitem((slice(None), fw.tensor([1])), [((2, 3), (2, 1)), ((2, 3), ())], budget=Budget(7, 10, 1, 0)),
    setitem(MASK, [((2, 3), (3,)), ((2, 3), ())], budget=Budget(4, 12, 0, 1)),
    setitem(MASK, [((2, 3),)], value=0.5, budget=Budget(4, 8)),
    setitem(1, [((2, 3), (2,))], through=lambda y: y.T),  # writes column 1 of y
    setitem(MASK, [((3, 2), ())], through=lambda y: y.T, budget=Budget(4, 15, 0, 1)),
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


# --- getitem: views versus copies -------------------------------------------------------------

BASIC = [
    1,
    -1,
    (1, 2),
    (slice(1, None), slice(None, None, 2)),
    None,
    Ellipsis,
    (Ellipsis, 1),
    (None, 0, None),
    fw.tensor(2),
]


@pytest.mark.parametrize("index", BASIC)
def test_basic_indexing_is_a_view_sharing_memory_and_version(index):
    base = fw.randn(3, 4)
    v = base[index]
    assert np.shares_memory(v._data, base._data) and v._base is base and v._vc is base._vc
    v.fill_(5.0)  # (for a 0-d view too: a view, not a copied scalar)
    assert base._version == 1 and (base.numpy()[_np_index(index)] == 5.0).all()
    base.zero_()
    assert v._version == 2 and not v.numpy().any()


@pytest.mark.parametrize(
    "index", [fw.tensor([0, 2]), [0, 1], (slice(None), fw.tensor([1, 1])), fw.tensor([True, False, True])]
)
def test_advanced_indexing_is_a_copy(index):
    base = fw.randn(3, 4)
    before = base.numpy().copy()
    c = base[index]
    assert not np.shares_memory(c._data, base._data) and c._base is None and c._vc is not base._vc
    c.fill_(5.0)
    np.testing.assert_array_equal(base.numpy(), before)
    assert base._version == 0


def test_duplicate_indices_accumulate_gradients():
    x = fw.tensor([1.0, 2.0, 3.0], requires_grad=True)
    x[fw.tensor([0, 0, 2, 0])].sum().backward()
    assert x.grad.tolist() == [3.0, 0.0, 1.0]
    y = fw.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    (y[[1, 1]] * fw.tensor([[1.0, 2.0], [10.0, 20.0]])).sum().backward()
    assert y.grad.tolist() == [[0.0, 0.0], [11.0, 22.0]]


def test_bad_index_raises():
    with pytest.raises(IndexError, match="unsupported index"):
        fw.randn(3)["a"]
    with pytest.raises(IndexError):
        fw.randn(3)[5]


@pytest.mark.parametrize(
    "index",
    [
        fw.tensor([0, 3]),
        fw.tensor([0, -4]),
        (slice(None), fw.tensor([2, 2, 4])),
        (Ellipsis, fw.tensor([[0], [5]])),
        (fw.tensor([1]), None, fw.tensor([4])),
    ],
    ids=["3 in dim of 3", "-4 in dim of 3", "dim 1", "after ...", "around None"],
)
def test_out_of_bounds_index_arrays_raise_on_every_device(index, backend):
    # NumPy raises by itself; CuPy would wrap the index around: the framework checks.
    x = fw.zeros(3, 4, device=backend, requires_grad=True) * 1
    with pytest.raises(IndexError, match="out of bounds"):
        x[index]
    with pytest.raises(IndexError, match="out of bounds"):
        x[index] = 1.0
    assert x[fw.tensor([-3, 2])].shape == (2, 4)  # negative indices within bounds are fine


def test_index_dims_map_each_index_array_to_its_dimension():
    # The bounds check that runs where the array module does not check (CuPy).
    from framework.ops import _check_index_bounds, _index_dims

    a = np.zeros((2, 3, 4, 5))
    i, b = np.array([1]), np.ones((2, 3), dtype=bool)
    assert [n for _, n in _index_dims(a.shape, (i, slice(None), i))] == [2, 4]
    assert [n for _, n in _index_dims(a.shape, (b, i))] == [4]  # the mask takes two dims
    assert [n for _, n in _index_dims(a.shape, (None, i, Ellipsis, i))] == [2, 5]
    assert [n for _, n in _index_dims(a.shape, (Ellipsis, i, None))] == [5]
    _check_index_bounds(a, (np.array([1, -2]), Ellipsis, np.array([4, -5])))
    with pytest.raises(IndexError, match=r"outside \[-5, 4\] for a dimension of size 5"):
        _check_index_bounds(a, (Ellipsis, np.array([5])))
    with pytest.raises(IndexError, match=r"outside \[-3, 2\]"):
        _check_index_bounds(a, (0, np.array([-4]), Ellipsis))


# --- setitem --------------------------------------------------------------------------------


def test_setitem_basic_gradients_by_hand():
    x = fw.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    v = fw.tensor(10.0, requires_grad=True)
    y = x * 2
    y[1:3] = v * 3
    assert y.tolist() == [2.0, 30.0, 30.0, 8.0]
    (y * fw.tensor([1.0, 2.0, 3.0, 4.0])).sum().backward()
    assert x.grad.tolist() == [2.0, 0.0, 0.0, 8.0]  # the overwritten part gets nothing
    assert v.grad.item() == 3 * (2.0 + 3.0)  # the value gets the gradient of what it wrote


def test_setitem_advanced_and_boolean_gradients_by_hand():
    w = fw.tensor([1.0, 2.0, 3.0, 4.0])
    x = fw.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    v = fw.tensor([5.0, 6.0], requires_grad=True)
    y = x * 1
    y[fw.tensor([3, 0])] = v
    assert y.tolist() == [6.0, 2.0, 3.0, 5.0]
    (y * w).sum().backward()
    assert x.grad.tolist() == [0.0, 2.0, 3.0, 0.0] and v.grad.tolist() == [4.0, 1.0]

    x = fw.tensor([1.0, -2.0, 3.0, -4.0], requires_grad=True)
    s = fw.tensor(7.0, requires_grad=True)
    y = x * 1
    y[y < 0] = s
    assert y.tolist() == [1.0, 7.0, 3.0, 7.0]
    (y * w).sum().backward()
    assert x.grad.tolist() == [1.0, 0.0, 3.0, 0.0] and s.grad.item() == 2.0 + 4.0


@pytest.mark.parametrize(
    "index, value",
    [(0, 1.0), ((slice(None), 1), fw.tensor([1.0, 2.0])), (fw.tensor([1]), 3.0), (MASK, fw.tensor(2.0))],
    ids=["int-scalar", "slice-tensor", "int-tensor", "mask"],
)
def test_setitem_bumps_the_version_once_and_keeps_the_object(index, value):
    y = fw.randn(2, 3, requires_grad=True) * 1
    data = y._data
    y[index] = value
    assert y._version == 1 and y._data is data


def test_setitem_on_a_leaf_that_requires_grad_raises_and_changes_nothing():
    x = fw.tensor([1.0, 2.0, 3.0], requires_grad=True)
    for index in (0, slice(1, None), fw.tensor([0]), fw.tensor([True, False, True])):
        with pytest.raises(RuntimeError, match="leaf Variable"):
            x[index] = 0.0
    assert x.tolist() == [1.0, 2.0, 3.0] and x._version == 0
    with fw.no_grad():
        x[0] = 0.0
        x[fw.tensor([2])] = 0.0
    assert x.tolist() == [0.0, 2.0, 0.0] and x._version == 2


def test_setitem_of_a_value_that_requires_grad_into_a_plain_tensor():
    y = fw.zeros(2, 3, dtype=fw.float64)
    v = fw.tensor([1.0, 2.0, 3.0], dtype=fw.float64, requires_grad=True)
    y[1] = v
    assert y.requires_grad and y.grad_fn is not None
    y.sum().backward()
    assert v.grad.tolist() == [1.0, 1.0, 1.0]
    gradcheck(lambda a: (lambda z: (z.__setitem__(fw.tensor([0, 1]), a), z)[1])(fw.zeros(3, 3, dtype=fw.float64)), [v])


def test_setitem_is_seen_by_a_backward_that_needed_the_old_values():
    y = fw.tensor([0.5, 1.0], requires_grad=True) * 1
    z = y.sin()  # saves y
    y[0] = 0.0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_setitem_value_that_does_not_fit_raises_and_changes_nothing():
    y = fw.zeros(2, 3, requires_grad=True) * 1
    for index, value in [(0, fw.ones(4)), (fw.tensor([0, 1]), fw.ones(3, 3)), (MASK, fw.ones(2))]:
        with pytest.raises(RuntimeError):
            y[index] = value
    assert not y.detach().numpy().any() and y._version == 0
    assert_close(y, np.zeros((2, 3), dtype=np.float32))
