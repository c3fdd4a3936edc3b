"""PyTorch's view tests (``test/test_view_ops.py``: ``TestViewOps``, ``TestOldViewOps``), ported.

``is_view_of(base, v)`` is PyTorch's check: ``v`` is a view whose ``_base`` is ``base``
and that shares its memory. Left out (see also ``test_pytorch_parity.py``): dtype views
(``view(dtype)``), complex views (``view_as_real/complex``, ``real``/``imag``, ``conj``),
``diagonal``, ``unfold``, ``movedim``, ``tensor_split``/``hsplit``/``vsplit``/``dsplit``,
``ravel``, ``broadcast_to``/``broadcast_tensors``/``atleast_*``, ``*_copy`` ops,
``resize_``/``set_``, quantized and sparse tensors, inplace view ops (``t_``,
``transpose_``, ``squeeze_``, ``unsqueeze_``, ``swapdims_``, ``as_strided_``): none of
them is part of this framework. test_chunk_view and test_split_view are skipped in
PyTorch itself.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

import framework as fw
from framework.testing import assert_close, gradcheck


def is_view_of(base, other) -> bool:  # TestViewOps.is_view_of
    return other is not base and other._base is base and np.shares_memory(other._data, base._data)


def is_view_of_same_base(v1, v2) -> bool:  # TestViewOps.is_view_of_same_base
    return v1._base is not None and v1 is not v2 and is_view_of(v1._base, v2)


def rand(*shape, seed=0, dtype=fw.float32):
    return fw.tensor(np.random.default_rng(seed).standard_normal(shape), dtype=dtype)


# --- TestViewOps ------------------------------------------------------------------------------


def test_select_view():  # test_select_view
    t = fw.ones(5, 5)
    v = t.select(0, 2)
    assert is_view_of(t, v)
    v[0] = 0
    assert t[2, 0].tolist() == v[0].tolist() == 0.0


def test_unbind_view():  # test_unbind_view
    t = fw.zeros(5, 5)
    for idx, v in enumerate(fw.unbind(t)):
        assert is_view_of(t, v)
        v[0] = idx + 1  # t does not require grad: writing an output is allowed
        assert t[idx, 0].tolist() == v[0].tolist() == idx + 1


def test_unbind():  # test_unbind
    stacked = fw.randn(3, 10, 10, requires_grad=True)
    x, y, z = stacked.unbind()
    grad = fw.randn(3, 10, 10)
    fw.autograd.backward([x, y, z], list(grad.unbind()))
    assert_close(stacked.grad, grad)
    for i in range(3):  # only one gradient provided (#9977)
        stacked = fw.randn(3, 10, 10, requires_grad=True)
        outs = stacked.unbind()
        gi = grad.unbind()[i]
        (g,) = fw.autograd.grad(outs[i], stacked, gi)
        g_expected = fw.stack([gi if j == i else fw.zeros_like(gi) for j in range(3)], dim=0)
        assert_close(g, g_expected)
    stacked = fw.tensor(np.random.default_rng(0).standard_normal((3, 4, 2)), dtype=fw.float64, requires_grad=True)
    gradcheck(lambda x: fw.stack(x.unbind(1), 0), [stacked])


def test_expand_view():  # test_expand_view
    t = fw.ones(5, 1)
    v = t.expand(5, 5)
    assert is_view_of(t, v)
    v[2, 2] = 0  # writes the one element the whole row shares
    assert t[2, 0].tolist() == v[2, 2].tolist() == 0.0


def test_expand_as_view():  # test_expand_as_view
    t = fw.ones(5, 1)
    e = fw.empty(5, 5)
    v = t.expand_as(e)
    assert is_view_of(t, v)
    v[2, 2] = 0
    assert t[2, 0].tolist() == v[2, 2].tolist() == 0.0


def test_narrow_view():  # test_narrow_view
    t = fw.ones(5, 5)
    v = fw.narrow(t, 1, 2, 2)
    assert is_view_of(t, v)
    v[0, 0] = 0
    assert t[0, 2].tolist() == v[0, 0].tolist() == 0.0


def test_permute_view():  # test_permute_view
    t = fw.ones(5, 5)
    v = t.permute(1, 0)
    assert is_view_of(t, v)
    v[0, 1] = 0
    assert t[1, 0].tolist() == v[0, 1].tolist() == 0.0


@pytest.mark.parametrize("fn", [fw.swapdims, fw.swapaxes, fw.transpose])
def test_transpose_view(fn):  # test_transpose_view
    t = fw.ones(5, 5)
    v = fn(t, 0, 1)
    assert is_view_of(t, v)
    v[0, 1] = 0
    assert t[1, 0].tolist() == v[0, 1].tolist() == 0.0


def test_t_view():  # test_t_view
    t = fw.ones(5, 5)
    v = t.t()
    assert is_view_of(t, v)
    v[0, 1] = 0
    assert t[1, 0].tolist() == v[0, 1].tolist() == 0.0


@pytest.mark.parametrize("op", ["T", "H", "mT", "mH"])
def test_T_view(op):  # test_T_view
    t = fw.ones(5, 5)
    v = getattr(t, op)
    assert is_view_of(t, v)
    v[0, 1] = 0
    assert t[1, 0].tolist() == v[0, 1].tolist() == 0.0


def test_squeeze_view():  # test_squeeze_view
    t = fw.ones(5, 1, 5)
    v = fw.squeeze(t)
    assert is_view_of(t, v)
    v[0, 1] = 0
    assert v._base is t and t[0, 0, 1].tolist() == 0.0


def test_unsqueeze_view():  # test_unsqueeze_view
    t = fw.ones(5, 5)
    v = fw.unsqueeze(t, 1)
    assert is_view_of(t, v)
    v[0, 0, 1] = 0
    assert t[0, 1].tolist() == v[0, 0, 1].tolist() == 0.0


def test_as_strided_view():  # test_as_strided_view
    t = fw.ones(5, 5)
    v = fw.as_strided(t, (25,), (1,))
    assert is_view_of(t, v)
    v[6] = 0
    assert t[1, 1].tolist() == v[6].tolist() == 0.0


@pytest.mark.parametrize(
    "make, prepro, size, strides, offset",
    [
        (lambda: fw.arange(0.0, 25.0), lambda x: x.view(5, 5), [3, 3], [6, 2], 2),
        (lambda: rand(12), None, [1, 2, 1, 5], [0, 5, 100, 1], 2),  # a crazy stride at a dim of size 1
        (lambda: rand(5), None, [3, 3, 3], [0, 1, 0], 2),  # expand
        (lambda: rand(5), None, [3, 3, 3], [0, 0, 0], 4),
        (lambda: rand(5), lambda x: x.expand(5, 5), [5, 5], [0, 1], 0),
        (lambda: rand(35), None, [6, 6], [5, 1], 2),  # overlapping, not expanded
        (lambda: rand(15), None, [3, 2], [3, 6], 2),
        (lambda: rand(3, 4), None, [4, 3], [1, 4], None),  # transpose
        (lambda: rand(2, 3), lambda x: x.expand(10, 2, 3), [2, 3], [3, 1], 0),  # select of an expanded input
    ],
)
def test_as_strided_gradients(make, prepro, size, strides, offset):  # test_as_strided_gradients
    x = make().double().detach().requires_grad_()

    def closure(x):
        if prepro is not None:
            x = prepro(x)
        return x.as_strided(size, strides, offset)

    gradcheck(closure, [x])


def test_as_strided_outside_the_input():  # test_as_strided_gradients ("getting things outside the input")
    x = rand(6, 2)
    assert x[3:].as_strided([3, 2], [2, 1], 0).tolist() == x[:3].tolist()  # offsets count from the storage
    # As in PyTorch, as_strided's gradient is taken w.r.t. its input's own elements: the
    # storage elements it reads outside its input (here all of them) get none.
    xd = rand(6, 2, dtype=fw.float64).requires_grad_()
    x[3:].as_strided([3, 2], [2, 1], 0)
    xd[3:].as_strided([3, 2], [2, 1], 0).sum().backward()
    assert xd.grad.tolist() == np.zeros((6, 2)).tolist()


def test_view_view():  # test_view_view
    t = fw.ones(5, 5)
    v = t.view(25)
    assert is_view_of(t, v)
    v[6] = 0
    assert t[1, 1].tolist() == v[6].tolist() == 0.0


def test_view_as_view():  # test_view_as_view
    t = fw.ones(5, 5)
    e = fw.empty(25)
    v = t.view_as(e)
    assert is_view_of(t, v)
    v[6] = 0
    assert t[1, 1].tolist() == v[6].tolist() == 0.0


def test_contiguous_self():  # test_contiguous_self
    t = fw.ones(5, 5)
    assert t.contiguous() is t


def test_contiguous_nonview():  # test_contiguous_nonview
    t = fw.ones(5, 5)
    nv = t.t().contiguous()
    assert not is_view_of(t, nv)
    nv[0, 0] = 0
    assert t[0, 0].tolist() != nv[0, 0].tolist()


def test_reshape_view():  # test_reshape_view
    t = fw.ones(5, 5)
    v = fw.reshape(t, (25,))
    assert is_view_of(t, v)
    v[6] = 0
    assert t[1, 1].tolist() == v[6].tolist() == 0.0


def test_reshape_as_view():  # test_reshape_as_view
    t = fw.ones(5, 5)
    e = fw.empty(25)
    v = t.reshape_as(e)
    assert is_view_of(t, v)
    v[6] = 0
    assert t[1, 1].tolist() == v[6].tolist() == 0.0


def test_reshape_nonview():  # test_reshape_nonview
    t = fw.ones(5, 5)
    nv = fw.reshape(t.t(), (25,))
    assert not is_view_of(t, nv)
    nv[6] = 0
    assert t[1, 1].tolist() != nv[6].tolist()


def _test_writes_propagate(t, v):
    v[(0,) * v.ndim] = 0
    assert t[(0,) * t.ndim].tolist() == v[(0,) * v.ndim].tolist() == 0.0


def test_flatten_view():  # test_flatten_view
    t = fw.ones(1, 2, 3, 4)
    v = t.flatten()
    assert is_view_of(t, v)
    _test_writes_propagate(t, v)

    t = fw.tensor(1.0)  # zero-dimensional
    v = t.flatten()
    _test_writes_propagate(t, v)
    assert is_view_of(t, v)

    t = fw.ones(1, 2, 3, 4).transpose(2, 3)
    v = t.flatten(0, 1)
    _test_writes_propagate(t, v)
    assert is_view_of_same_base(t, v)

    # stride[i] = stride[i + 1] * size[i + 1] holds for 3 groups:
    t = fw.ones(720).as_strided((2, 3, 2, 3, 5, 4), (6, 2, 15, 5, 1, 0))
    v1 = t.flatten(0, 1)
    v2 = v1.flatten(1, 3)
    v3 = v2.flatten(2, 2)
    for v in (v1, v2, v3):
        _test_writes_propagate(t, v)
        assert is_view_of_same_base(t, v)


def test_flatten_nonview():  # test_flatten_nonview
    def assert_is_nonview(t, nv):
        assert nv._base is None
        nv[(0,) * nv.ndim] = 0
        assert t[(0,) * t.ndim].tolist() != nv[(0,) * nv.ndim].tolist()

    t = fw.ones(2, 3, 2, 3).transpose(2, 3)
    assert_is_nonview(t, t.flatten(1, 3))
    t = fw.ones(2, 2).T
    assert_is_nonview(t, t.flatten())
    t = fw.ones(2, 2)
    assert t.flatten(1, 1) is t  # start_dim == end_dim: the tensor itself


def test_basic_indexing_slice_view():  # test_basic_indexing_slice_view
    t = fw.ones(5, 5)
    v = t[:2, :3]
    assert is_view_of(t, v)
    v[0, 0] = 0
    assert t[0, 0].tolist() == v[0, 0].tolist()


def test_basic_indexing_ellipses_view():  # test_basic_indexing_ellipses_view
    t = fw.ones(5, 5)
    v = t[..., :2]
    assert is_view_of(t, v)
    v[0, 0] = 0
    assert t[0, 0].tolist() == v[0, 0].tolist()


def test_basic_indexing_newaxis_view():  # test_basic_indexing_newaxis_view
    t = fw.ones(5, 5)
    v = t[None, :2, 3]
    assert is_view_of(t, v)
    v[0, 0] = 0
    assert t[0, 3].tolist() == v[0, 0].tolist()


def test_advanced_indexing_nonview():  # test_advanced_indexing_nonview
    t = fw.ones(3, 3)
    rows = fw.tensor([[0, 0], [2, 2]])
    cols = fw.tensor([[0, 1], [2, 2]])
    nv = t[rows, cols]
    assert not is_view_of(t, nv)
    nv[1, 1] = 0
    assert t[2, 2].tolist() != nv[1, 1].tolist()


def test_advanced_indexing_assignment():  # test_advanced_indexing_assignment
    t = fw.ones(3, 3)
    rows = fw.tensor([[0, 0], [2, 2]])
    cols = fw.tensor([[0, 1], [2, 2]])
    t[rows, cols] = 0
    assert t[2, 2].tolist() == 0.0


# --- TestOldViewOps ---------------------------------------------------------------------------


def test_empty_reshape():  # test_empty_reshape
    x = fw.randn(0, 6)
    assert x.reshape(1, 0, 6, 1, 1).shape == (1, 0, 6, 1, 1)
    assert np.shares_memory(x._data, x.reshape(1, 0, 6, 1, 1)._data) or x.numel() == 0
    with pytest.raises(RuntimeError):
        x.reshape(0, -1)  # NumPy semantics: no size inferred for a dim with a degree of freedom


def test_expand():  # test_expand
    tensor = fw.rand(1, 8, 1)
    tensor2 = fw.rand(5)
    template = fw.rand(4, 8, 5)
    target = template.shape
    assert tensor.expand_as(template).shape == target
    assert tensor.expand(4, 8, 5).shape == target
    assert tensor.expand(target).shape == target
    assert tensor2.expand_as(template).shape == target
    assert tensor2.expand(4, 8, 5).shape == target
    assert tensor2.expand(target).shape == target
    assert tensor2.expand(1, 5).expand(2, 2, 5).tolist() == np.tile(tensor2.numpy(), (2, 2, 1)).tolist()
    noncontig = fw.randn(5, 2, 1, 3)[:, 0]
    assert not noncontig.is_contiguous()
    assert noncontig.expand(2, 5, 4, 3).tolist() == np.tile(noncontig.numpy(), (2, 1, 4, 1)).tolist()
    expanded = tensor2.expand(1, 1, 5)
    unsqueezed = tensor2.unsqueeze(0).unsqueeze(1)
    assert expanded.tolist() == unsqueezed.tolist()
    assert expanded.stride() == unsqueezed.stride()
    assert tensor.expand(4, -1, 5).tolist() == tensor.expand(4, 8, 5).tolist()
    with pytest.raises(RuntimeError):
        tensor2.expand(-1, -1)
    assert fw.zeros(0).expand((0,)).shape == (0,)


def test_view_empty():  # test_view_empty
    x = fw.randn(0, 6)
    assert x.view(1, 0, 6, 1, 1).shape == (1, 0, 6, 1, 1)


def test_reshape():  # test_reshape
    x = fw.randn(3, 3)
    assert np.shares_memory(x._data, x.reshape(-1)._data)
    assert np.shares_memory(x._data, x.reshape(1, 9, 1)._data)
    assert fw.reshape(x, (9,)).tolist() == x.reshape(9).tolist()
    with pytest.raises(RuntimeError):
        x.reshape(-1, -1)
    y = fw.randn(4, 4, 4)[:, 0, :]
    assert not np.shares_memory(y._data, y.reshape(-1)._data)
    assert y.contiguous().view(-1).tolist() == y.reshape(-1).tolist()
    assert np.shares_memory(y.reshape(2, 2, 4)._data, y._data)
    s = fw.randn(())
    assert np.shares_memory(s._data, s.reshape(())._data)
    assert s.reshape(-1).shape == (1,)
    with pytest.raises(RuntimeError):
        s.reshape(2)
    empty = fw.tensor([])
    assert empty.reshape(-1).shape == (0,) and empty.reshape([0]).shape == (0,)
    assert empty.reshape([0, 1]).shape == (0, 1)
    assert empty.reshape([1, -1]).shape == (1, 0)
    with pytest.raises(RuntimeError):
        empty.reshape(1)
    x = fw.randn(3, 3)
    assert np.shares_memory(x._data, x.reshape_as(fw.rand(9))._data)
    assert np.shares_memory(x._data, x.reshape_as(fw.rand(1, 9, 1))._data)
    with pytest.raises(RuntimeError):
        x.reshape_as(fw.rand(10))


def test_flatten():  # test_flatten
    zero_dim = fw.tensor(123)
    flat0 = zero_dim.flatten()
    one_dim = fw.tensor([123])
    assert zero_dim.shape == () and flat0.shape == (1,)
    assert flat0.tolist() == one_dim.tolist()
    src = fw.randn(5, 5, 5, 5)
    for (start, end), shape in [
        ((0, -1), (625,)),
        ((0, 2), (125, 5)),
        ((0, 1), (25, 5, 5)),
        ((1, 2), (5, 25, 5)),
        ((2, 3), (5, 5, 25)),
        ((-2, -1), (5, 5, 25)),
        ((2, 2), (5, 5, 5, 5)),
    ]:
        flat = src.flatten(start, end)
        assert flat.shape == shape
        assert src.view(-1).tolist() == flat.view(-1).tolist()
    with pytest.raises(IndexError, match="Dimension out of range"):
        src.flatten(5, 10)
    with pytest.raises(RuntimeError, match="start_dim cannot come after end_dim"):
        src.flatten(2, 0)


def test_narrow():  # test_narrow
    x = fw.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    assert x.narrow(0, 0, 1).tolist() == [[0, 1, 2]]
    assert x.narrow(0, 0, 2).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert x.narrow(0, 1, 1).tolist() == [[3, 4, 5]]
    assert x.narrow(0, -1, 1).tolist() == [[6, 7, 8]]
    assert x.narrow(0, -2, 2).tolist() == [[3, 4, 5], [6, 7, 8]]
    assert x.narrow(0, -3, 3).tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert x.narrow(-1, -1, 1).tolist() == [[2], [5], [8]]
    assert x.narrow(-2, -1, 1).tolist() == [[6, 7, 8]]


def test_narrow_tensor():  # test_narrow_tensor
    x = fw.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    assert x.narrow(0, fw.tensor(0), 1).tolist() == [[0, 1, 2]]
    for bad in (fw.tensor(0.0), fw.tensor([0]), fw.tensor([0, 1])):
        with pytest.raises(RuntimeError, match="0-dim integral"):
            x.narrow(0, bad, 1)


def test_t():  # test_t
    x = fw.randn(())
    assert x.t().tolist() == x.tolist()
    x = fw.arange(4)
    assert x.t().tolist() == x.tolist()
    x = fw.rand(2, 2)
    assert x.t().tolist() == x.transpose(0, 1).tolist()
    with pytest.raises(RuntimeError, match="expects a tensor with <= 2 dimensions, but self is 3D"):
        fw.rand(2, 2, 2).t()


def test_split():  # test_split
    tensor = fw.rand(7, 4)
    splits = tensor.split(3, 0)
    start = 0
    for target_size, split in zip(([3, 4], [3, 4], [1, 4]), splits, strict=True):
        assert list(split.shape) == target_size
        assert tensor.narrow(0, start, target_size[0]).tolist() == split.tolist()
        start += target_size[0]
    tensor = fw.randn(20, 10)  # variable sections
    for dim, sizes, targets in (
        (0, [5, 5, 10], ([5, 10], [5, 10], [10, 10])),
        (1, [2, 2, 6], ([20, 2], [20, 2], [20, 6])),
    ):
        start = 0
        for target_size, split in zip(targets, tensor.split(sizes, dim), strict=True):
            assert list(split.shape) == target_size
            assert tensor.narrow(dim, start, target_size[dim]).tolist() == split.tolist()
            start += target_size[dim]


def test_chunk():  # test_chunk
    tensor = fw.rand(4, 7)
    start = 0
    for target_size, split in zip(([4, 3], [4, 3], [4, 1]), tensor.chunk(3, 1), strict=True):
        assert list(split.shape) == target_size
        assert tensor.narrow(1, start, target_size[1]).tolist() == split.tolist()
        start += target_size[1]
    for bad in (0, -2):
        with pytest.raises(RuntimeError, match="chunk expects.*greater than 0"):
            tensor.chunk(bad)


def test_unsqueeze():  # test_unsqueeze (without unsqueeze_)
    x = fw.randn(2, 3, 4)
    assert x.unsqueeze(1).tolist() == x.view(2, 1, 3, 4).tolist()
    x = x[:, 1]
    assert not x.is_contiguous()
    assert x.unsqueeze(1).tolist() == x.contiguous().view(2, 1, 4).tolist()


def test_big_transpose():  # test_big_transpose
    t = fw.rand(456, 789)
    assert np.array_equal(t.t().contiguous().numpy(), t.numpy().transpose())


def test_T():  # test_T
    a = fw.randn(2, 3, 4)
    assert a.T.tolist() == a.permute(2, 1, 0).tolist()
    b = fw.randn(10)
    assert b.T.tolist() == b.tolist()
    scalar = fw.tensor(5)
    assert scalar.T.tolist() == scalar.tolist()


@pytest.mark.parametrize("dtype", [fw.float32, fw.int64, fw.bool_])
@pytest.mark.parametrize("op", ["T", "H", "mT", "mH"])
def test_transposes(op, dtype):  # test_transposes (real dtypes: H is T, mH is mT)
    shapes = ((), (2, 3), (2, 3, 4)) if op[0] == "m" else ((), (2, 3))
    for shape in shapes:
        a = fw.tensor(np.random.default_rng(0).integers(-5, 5, size=shape), dtype=dtype)
        t2 = a if a.ndim == 0 else a.transpose(-2, -1)
        assert getattr(a, op).tolist() == t2.tolist()


@pytest.mark.parametrize("op", ["H", "mT", "mH"])
def test_transposes_errors(op):  # test_transposes_errors
    for shape in ((2,), (2, 3, 4)) if op == "H" else ((2,),):
        with pytest.raises(RuntimeError, match="only supported on matrices"):
            getattr(fw.ones(*shape), op)  # noqa: B018


@pytest.mark.parametrize("fn", [fw.swapdims, fw.swapaxes, fw.transpose])
def test_transpose_invalid(fn):  # test_transpose_invalid
    x = fw.randn(5, 6, 7, 8)
    with pytest.raises(IndexError, match="Dimension out of range"):
        fn(x, 5, 0)
    with pytest.raises(IndexError, match="Dimension out of range"):
        fn(x, 0, 5)


@pytest.mark.parametrize("fn", [fw.swapdims, fw.swapaxes, fw.transpose])
def test_transpose_vs_numpy(fn):  # test_transpose_vs_numpy
    rng = random.Random(0)
    for nd in range(5):
        shape = tuple(rng.randint(2, 4) for _ in range(nd))
        x = rand(*shape)
        for src, dst in itertools.permutations(range(nd), r=2):
            if rng.random() > 0.5:
                src -= nd
            if rng.random() > 0.5:
                dst -= nd
            assert np.array_equal(fn(x, src, dst).numpy(), np.swapaxes(x.numpy(), src, dst))
    x = fw.randn(2, 3, 5, 7, 11)  # a dim swapped with itself
    assert np.array_equal(fn(x, 0, 0).numpy(), x.numpy())


def test_view():  # test_view
    tensor = fw.rand(15)
    template = fw.rand(3, 5)
    empty = fw.empty(0)
    target = template.shape
    assert tensor.view_as(template).shape == target
    assert tensor.view(3, 5).shape == target
    assert tensor.view((3, 5)).shape == target
    assert tensor.view(-1, 5).shape == target
    assert tensor.view(3, -1).shape == target
    tensor.view(5, 3).fill_(random.Random(0).uniform(0, 1))
    assert empty.view_as(empty).shape == (0,)
    assert empty.view(0).shape == (0,)
    assert empty.view(0, 3, 0, 1).shape == (0, 3, 0, 1)
    assert empty.view(0, 3, 0, 1).view(0).shape == (0,)
    assert empty.view(-1).shape == (0,)  # size inference with empty tensors
    assert empty.view(10, 3, -1).shape == (10, 3, 0)
    with pytest.raises(RuntimeError, match=r"because the unspecified dimension size -1 can be any value"):
        empty.view(-1, 0)
    with pytest.raises(RuntimeError, match=r"because the unspecified dimension size -1 can be any value"):
        empty.view(3, 0, -1, 0)
    for bad in ((15, 0), (7, -1), (15, -1, -1)):
        with pytest.raises(RuntimeError):
            tensor.view(*bad)

    # a view of a tensor that is contiguous only in the dims it touches
    tensor = fw.rand(4, 2, 5, 1, 6, 2, 9, 3).transpose(-1, 2).transpose(-2, 3)
    contig = tensor.clone()
    for size in (
        [8, 1, 3, 3, 3, 4, 1, 3, 5],
        [2, 4, 3, 1, 9, 2, 2, 3, 5, 1],
        [1, 1, 2, 1, 4, 3, 1, 1, 9, 1, 2, 1, 2, 3, 1, 5, 1, 1],
    ):
        assert tensor.view(*size).tolist() == contig.view(*size).tolist()
    for bad in ((-1,), (24, 9, 6, 2, 1, 5), (8, 3, 9, 6, 10), (8, 3, 54, 2, 1, 5)):
        with pytest.raises(RuntimeError):
            tensor.view(*bad)

    tensor = fw.empty(1, 1).expand(3, 4)  # stride-0 dims: all contiguous
    contig = tensor.clone()
    for size in ((-1,), (1, -1, 1), (-1, 1), (6, 2, 1), (1, 6, 2, 1)):
        assert tensor.view(*size).tolist() == contig.view(*size).tolist()


def test_reshape_view_semantics():  # test_reshape_view_semantics
    tensor = fw.randn(15, 4)
    view = tensor.reshape(20, 3)
    assert view.shape == (20, 3) and np.shares_memory(view._data, tensor._data)
    copy = tensor.transpose(0, 1).reshape(20, 3)
    assert copy.shape == (20, 3) and not np.shares_memory(copy._data, tensor._data)


@pytest.mark.parametrize("dtype", [fw.float16, fw.float32, fw.float64, fw.int32, fw.int64, fw.bool_])
def test_view_all_dtypes(dtype):  # test_view_all_dtypes_and_devices
    x = fw.tensor([[1, 2], [3, 4], [5, 6]], dtype=dtype)
    assert x.view(6).shape == (6,)
