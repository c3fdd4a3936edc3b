"""View ops (shared storage and version counter), reshape's view-or-copy, cat and stack."""

from __future__ import annotations

import numpy as np
import pytest

import framework as fw
from framework.testing import assert_close

from . import harness
from .harness import UNARY, Budget, OpSpec

ND = [((5,),), ((2, 3),), ((2, 3, 4),)]
ND2 = [((2, 3),), ((2, 3, 4),)]
ND3 = [((2, 3, 4),)]
CONTIGUOUS = ("contiguous",)

SPECS = [
    OpSpec("view(-1)", lambda x: x.view(-1), lambda a: a.reshape(-1), UNARY, view=True, layouts=CONTIGUOUS),
    OpSpec("view(3,2)", lambda x: x.view(3, 2), lambda a: a.reshape(3, 2), [((2, 3),)], view=True, layouts=CONTIGUOUS),
    # Inserting a size-1 dim is a view of any strides.
    OpSpec("view(2,1,3)", lambda x: x.view((2, 1, 3)), lambda a: a.reshape(2, 1, 3), [((2, 3),)], view=True),
    OpSpec("reshape(3,2)", lambda x: x.reshape(3, 2), lambda a: a.reshape(3, 2), [((2, 3),)], view=None),
    OpSpec("reshape(-1)", lambda x: fw.reshape(x, (-1,)), lambda a: a.reshape(-1), UNARY, view=None),
    OpSpec("transpose(0,1)", lambda x: x.transpose(0, 1), lambda a: a.swapaxes(0, 1), ND2, view=True),
    OpSpec("transpose(-1,0)", lambda x: fw.transpose(x, -1, 0), lambda a: a.swapaxes(-1, 0), ND3, view=True),
    OpSpec("permute(2,0,1)", lambda x: x.permute(2, 0, 1), lambda a: a.transpose(2, 0, 1), ND3, view=True),
    OpSpec("permute((-1,0,1))", lambda x: fw.permute(x, (-1, 0, 1)), lambda a: a.transpose(2, 0, 1), ND3, view=True),
    OpSpec("t()", lambda x: x.t(), lambda a: a.T, [((2, 3),)], view=True),
    OpSpec("t() 1-d", lambda x: x.t(), lambda a: a, [((),), ((5,),)], view=True),
    OpSpec("T", lambda x: x.T, lambda a: a.T, ND, view=True),
    OpSpec("unsqueeze(0)", lambda x: x.unsqueeze(0), lambda a: a[None], UNARY, view=True),
    OpSpec("unsqueeze(-1)", lambda x: fw.unsqueeze(x, -1), lambda a: a[..., None], UNARY, view=True),
    OpSpec("unsqueeze(1)", lambda x: x.unsqueeze(1), lambda a: np.expand_dims(a, 1), ND, view=True),
    OpSpec("squeeze()", lambda x: x.squeeze(), np.squeeze, [((2, 1, 3),), ((1,),), ((1, 1),), ((2, 3),)], view=True),
    OpSpec("squeeze(1)", lambda x: fw.squeeze(x, 1), lambda a: a.squeeze(1), [((2, 1, 3),), ((3, 1),)], view=True),
    OpSpec("squeeze(0) of size 2", lambda x: x.squeeze(0), lambda a: a, [((2, 3),)], view=True),
    # (a 1-d tensor's flatten() is the tensor itself, as in PyTorch: see test_pytorch_views.py)
    OpSpec("flatten()", lambda x: x.flatten(), lambda a: a.reshape(-1), [((),), ((2, 3),), ((2, 3, 4),)], view=None),
    OpSpec("flatten(1)", lambda x: fw.flatten(x, 1), lambda a: a.reshape(2, -1), ND3, view=None),
    OpSpec("flatten(0,1)", lambda x: x.flatten(0, 1), lambda a: a.reshape(6, 4), ND3, view=None),
    OpSpec(
        "expand(2,3,4)",
        lambda x: x.expand(2, 3, 4),
        lambda a: np.broadcast_to(a, (2, 3, 4)),
        [((3, 1),), ((4,),), ((),)],
        view=True,
    ),
    OpSpec("expand(-1,4)", lambda x: x.expand(-1, 4), lambda a: np.broadcast_to(a, (3, 4)), [((3, 1),)], view=True),
    OpSpec(
        "expand_as",
        lambda x, y: x.expand_as(y),
        lambda a, b: np.broadcast_to(a, b.shape),
        [((3, 1), (2, 3, 4))],
        view=True,
    ),
    OpSpec("narrow(1,1,2)", lambda x: x.narrow(1, 1, 2), lambda a: a[:, 1:3], ND2, view=True),
    OpSpec("narrow(-1,0,1)", lambda x: x.narrow(-1, 0, 1), lambda a: a[..., 0:1], ND, view=True),
    OpSpec("clone", fw.clone, np.copy, UNARY),
    OpSpec("cat", lambda x, y: fw.cat([x, y]), lambda a, b: np.concatenate([a, b]), [((2, 3), (1, 3)), ((5,), (2,))]),
    OpSpec(
        "cat(dim=1)",
        lambda x, y: fw.cat((x, y), dim=1),
        lambda a, b: np.concatenate([a, b], 1),
        [((2, 1), (2, 3)), ((2, 1, 2), (2, 3, 2))],
    ),
    OpSpec(
        "cat(dim=-1) of 3",
        lambda x, y: fw.cat([x, y, x], -1),
        lambda a, b: np.concatenate([a, b, a], -1),
        [((2, 3, 1), (2, 3, 2))],
    ),
    OpSpec("stack", lambda x, y: fw.stack([x, y]), lambda a, b: np.stack([a, b]), [((), ()), ((2, 3), (2, 3))]),
    OpSpec(
        "stack(dim=-1)",
        lambda x, y: fw.stack([x, y, y], dim=-1),
        lambda a, b: np.stack([a, b, b], -1),
        [((5,), (5,)), ((2, 3), (2, 3))],
        budget=Budget(1, 13),
    ),
    OpSpec("stack(dim=1)", lambda x, y: fw.stack([x, y], 1), lambda a, b: np.stack([a, b], 1), [((2, 3), (2, 3))]),
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


# --- reshape: a view when the strides allow one, a copy otherwise ----------------------------


def _shares(a, b):
    return np.shares_memory(a._data, b._data)


@pytest.mark.parametrize(
    "make, shape, is_view",
    [
        (lambda: fw.randn(2, 3), (3, 2), True),
        (lambda: fw.randn(2, 3), (6,), True),
        (lambda: fw.randn(2, 3, 4)[:, 1], (2, 2, 2), True),  # splitting a dim: a view of a slice
        (lambda: fw.randn(2, 3, 4)[:, 1], (8,), False),  # its rows are not evenly spaced
        (lambda: fw.randn(2, 3).T, (6,), False),
        (lambda: fw.randn(2, 3).T, (3, 1, 2), True),  # only a size-1 dim inserted
        (lambda: fw.randn(2, 6)[:, ::2], (6,), True),  # every other element: evenly spaced
        (lambda: fw.randn(2, 5)[:, ::2], (6,), False),  # ... not any more
        (lambda: fw.randn(2, 5)[:, ::2], (2, 3, 1), True),
    ],
)
def test_reshape_views_when_strides_allow_else_copies(make, shape, is_view):
    x = make()
    y = x.reshape(shape)
    assert y.shape == shape
    assert_close(y, x.numpy().reshape(shape))
    assert _shares(x, y) == is_view
    assert (y._vc is x._vc) == is_view
    if is_view:
        assert y._base is (x._base if x._base is not None else x)
        y.fill_(7.0)  # writes show through the base, and the shared version moves
        assert (x.numpy() == 7.0).all() and x._version == 1
    else:
        assert y._base is None
        y.fill_(7.0)
        assert not (x.numpy() == 7.0).any() and x._version == 0


def test_view_refuses_incompatible_strides_and_points_to_reshape():
    with pytest.raises(RuntimeError, match=r"reshape"):
        fw.randn(2, 3).T.view(6)
    assert fw.randn(2, 3).T.reshape(6).shape == (6,)


def test_flatten_of_non_contiguous_copies():
    x = fw.randn(2, 3)
    assert _shares(x, x.flatten()) and not _shares(x, x.T.flatten())
    assert_close(x.T.flatten(), x.numpy().T.reshape(-1))


def test_contiguous_returns_self_or_a_copy():
    x = fw.randn(2, 3)
    assert x.contiguous() is x
    c = x.T.contiguous()
    assert c.is_contiguous() and not _shares(c, x)
    assert_close(c, x.numpy().T)


# --- views share storage and version --------------------------------------------------------

VIEWS = [
    lambda x: x.view(3, 4),
    lambda x: x.transpose(0, 1),
    lambda x: x.permute(1, 0),
    lambda x: x.t(),
    lambda x: x.T,
    lambda x: x.unsqueeze(0),
    lambda x: x.unsqueeze(0).squeeze(0),
    lambda x: x.flatten(),
    lambda x: x.narrow(1, 1, 2),
    lambda x: x[:, 0:1].expand(4, 5),
    lambda x: x.T.T[1:],  # a chain of views
]


@pytest.mark.parametrize("make_view", VIEWS)
def test_views_share_memory_and_version_with_the_base(make_view):
    base = fw.randn(4, 3)
    v = make_view(base)
    assert _shares(base, v) and v._base is base and v._version == base._version == 0
    base.add_(1.0)  # a write to the base is seen by the view, values and version
    assert v._version == 1
    assert_close(v, make_view(fw.tensor(base.numpy())))
    if v._data.strides and 0 in v._data.strides:
        return  # an expanded view cannot be written (next test)
    v.mul_(0.0)  # a write through the view reaches the base
    assert base._version == 2
    assert (make_view(fw.tensor(base.numpy())).numpy() == 0).all()


def test_inplace_on_an_expanded_view_raises_before_writing():
    x = fw.tensor([[1.0], [2.0]])
    e = x.expand(2, 3)
    with pytest.raises(RuntimeError, match="single memory location"):
        e.add_(1.0)
    assert x.tolist() == [[1.0], [2.0]] and x._version == 0


def test_inplace_through_a_view_gives_gradients_to_the_base():
    leaf = fw.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    base = leaf * 1
    base.T[0].mul_(10.0)  # column 0 of base, through a transposed view
    assert base.tolist() == [[10.0, 2.0], [30.0, 4.0]]
    base.sum().backward()
    assert leaf.grad.tolist() == [[10.0, 1.0], [10.0, 1.0]]


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (lambda x: x.permute(0, 0, 1), RuntimeError, "permutation"),
        (lambda x: x.transpose(0, 3), IndexError, "Dimension out of range"),
        (lambda x: x.unsqueeze(4), IndexError, "Dimension out of range"),
        (lambda x: x.t(), RuntimeError, "<= 2 dimensions"),
        (lambda x: x.expand(3, 3, 4), RuntimeError, "expanded size"),
        (lambda x: x.expand(3, 4), RuntimeError, "number of sizes"),
        (lambda x: x.narrow(2, 3, 2), IndexError, "exceeds dimension size"),
        (lambda x: x.view(5, 5), RuntimeError, "view size"),
        (lambda x: fw.cat([]), RuntimeError, "non-empty"),
        (lambda x: fw.stack([x, x[0]]), RuntimeError, "equal size"),
        (lambda x: fw.stack([]), RuntimeError, "non-empty"),
    ],
)
def test_shape_errors(bad, error, match):
    with pytest.raises(error, match=match):
        bad(fw.randn(2, 3, 4))


def test_squeeze_of_a_dim_that_is_not_1_is_a_no_op():
    assert fw.randn(2, 3).squeeze(0).shape == (2, 3)
    assert fw.randn(2, 1, 1).squeeze((1, 2)).shape == (2,)
