"""PyTorch 2.13's answers where a review found this framework's different, checked here.

Each test asserts PyTorch's value literally (so it runs without PyTorch); the tests that take
the ``torch`` fixture (tests/conftest.py) compute the same program with PyTorch and compare.
"""

from __future__ import annotations

import numpy as np
import pytest

import framework as fw
from framework.testing import assert_close

# --- pow's gradient at exponent 0 and base 0 ---------------------------------------------


def test_pow_zero_exponent_has_zero_gradient_at_zero():
    x = fw.tensor([0.0, 0.0, 2.0], requires_grad=True)
    (x**0).sum().backward()
    assert x.grad.tolist() == [0.0, 0.0, 0.0]  # PyTorch: 0, not nan (0 * 0**-1)


def test_pow_tensor_exponent_masks_zero_exponents():
    x = fw.tensor([0.0, 0.0, 2.0], requires_grad=True)
    (x ** fw.tensor([0.0, 1.0, 0.0])).sum().backward()
    assert x.grad.tolist() == [0.0, 1.0, 0.0]


@pytest.mark.parametrize("e", [2.0, 0.0, -1.0, -0.5, 0.5])
def test_pow_exponent_gradient_at_zero_base(e):
    # PyTorch's pow_backward_exponent: 0 where base == 0 and exponent >= 0, else result * log(base)
    base = fw.tensor([0.0, 2.0])
    y = fw.tensor([e, e], requires_grad=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        (base**y).sum().backward()
    expected = [0.0 if e >= 0 else -np.inf, 2.0**e * np.log(2.0)]
    assert_close(y.grad, fw.tensor(expected))


def test_pow_scalar_base_gradient():
    y = fw.tensor([0.0, -1.0, 2.0], requires_grad=True)
    (2**y).sum().backward()
    assert_close(y.grad, fw.tensor([np.log(2.0), 0.5 * np.log(2.0), 4 * np.log(2.0)]))
    y = fw.tensor([0.0, -1.0, 2.0], requires_grad=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        (0**y).sum().backward()
    assert y.grad.tolist() == [0.0, -np.inf, 0.0]  # PyTorch's values


def test_pow_gradients_match_torch(torch):
    bases = [0.0, 0.0, 0.0, 2.0, 3.0, 0.5]
    exps = [0.0, 1.0, -1.0, 0.0, 2.5, -0.5]
    ours_x = fw.tensor(bases, dtype=fw.float64, requires_grad=True)
    ours_y = fw.tensor(exps, dtype=fw.float64, requires_grad=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        (ours_x**ours_y).sum().backward()
    tx = torch.tensor(bases, dtype=torch.float64, requires_grad=True)
    ty = torch.tensor(exps, dtype=torch.float64, requires_grad=True)
    (tx**ty).sum().backward()
    np.testing.assert_array_equal(ours_x.grad.numpy(), tx.grad.numpy())
    np.testing.assert_array_equal(ours_y.grad.numpy(), ty.grad.numpy())


# --- reductions over dim=() ------------------------------------------------------------------


@pytest.mark.parametrize("dim", [(), []])
def test_empty_dim_reduces_every_dim(dim):
    x = fw.arange(6.0).reshape(2, 3)
    assert x.sum(dim=dim).item() == 15.0  # PyTorch 2.13: all dims, not none
    assert x.mean(dim=dim).item() == 2.5
    assert fw.amax(x, dim=dim).item() == 5.0
    assert x.var(dim=dim).item() == 3.5
    assert x.sum(dim=dim, keepdim=True).shape == (1, 1)


def test_empty_dim_gradient():
    x = fw.arange(6.0).reshape(2, 3).requires_grad_()
    x.sum(dim=()).backward()
    assert x.grad.tolist() == [[1.0] * 3] * 2


def test_empty_dim_reductions_match_torch(torch):
    a = np.arange(6.0).reshape(2, 3)
    x, t = fw.tensor(a), torch.tensor(a)
    for name in ("sum", "mean", "amax", "var"):
        for keepdim in (False, True):
            ours = getattr(x, name)(dim=(), keepdim=keepdim)
            theirs = getattr(t, name)(dim=(), keepdim=keepdim)
            assert ours.shape == tuple(theirs.shape)
            np.testing.assert_allclose(ours.numpy(), theirs.numpy())


# --- grad_fn._saved_<name> ----------------------------------------------------------------


def test_saved_self_and_other():
    # test_grad_fn_attr_bindings: out2.grad_fn._saved_self == a * 2
    a = fw.ones(1, requires_grad=True)
    b = fw.zeros(1, requires_grad=True)
    out2 = (a * 2) * b
    assert isinstance(out2.grad_fn._saved_self, fw.Tensor)
    assert out2.grad_fn._saved_self.tolist() == [2.0]
    assert out2.grad_fn._saved_other.tolist() == [0.0]
    out2.sum().backward()
    with pytest.raises(RuntimeError, match="after they have already been freed"):
        _ = out2.grad_fn._saved_self


def test_saved_result_and_names_per_op():
    x = fw.tensor([0.5, 2.0], requires_grad=True)
    y = x.exp()
    assert_close(y.grad_fn._saved_result, y)
    assert_close(x.log().grad_fn._saved_self, x)
    p = x ** fw.tensor([2.0, 3.0], requires_grad=True)  # PyTorch: PowBackward1
    assert p.grad_fn._saved_exponent.tolist() == [2.0, 3.0]
    assert_close(p.grad_fn._saved_result, p)
    assert (x**2.0).grad_fn._saved_exponent == 2.0  # a scalar exponent stays a number
    m = x.view(1, 2) @ x.view(2, 1)
    assert m.grad_fn._saved_mat2.shape == (2, 1)  # PyTorch: MmBackward0
    assert fw.where(x > 1, x, x).grad_fn._saved_condition.tolist() == [False, True]
    with pytest.raises(AttributeError):
        _ = y.grad_fn._saved_self  # exp saves its result only, as PyTorch's ExpBackward0


def test_saved_tensor_shares_storage_and_version():
    a = fw.ones(2, requires_grad=True)
    h = a * 1
    out = h * a
    saved = out.grad_fn._saved_self
    assert saved._version == h._version
    h.add_(1)  # the saved input changed: reading it raises as backward would
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _ = out.grad_fn._saved_self


def test_saved_not_needed_is_none():
    # mul saves each factor only for the other's gradient (PyTorch: undefined -> None)
    a = fw.ones(2, requires_grad=True)
    out = a * fw.ones(2)
    assert out.grad_fn._saved_self is None
    assert out.grad_fn._saved_other.tolist() == [1.0, 1.0]


# program(m, a, b, x3, w, bias) -> a tensor whose grad_fn is compared; m is fw or torch
SAVED_CASES = {
    "add": lambda m, a, b, x3, w, bias: a + b,
    "sub": lambda m, a, b, x3, w, bias: a - b,
    "mul": lambda m, a, b, x3, w, bias: a * b,
    "mul by a number": lambda m, a, b, x3, w, bias: a * 2,
    "div": lambda m, a, b, x3, w, bias: a / b,
    "div by a number": lambda m, a, b, x3, w, bias: a / 2,
    "div_": lambda m, a, b, x3, w, bias: (a * 1).div_(b),
    "pow scalar": lambda m, a, b, x3, w, bias: a**2,
    "pow tensor": lambda m, a, b, x3, w, bias: a.abs() ** b,
    "pow scalar base": lambda m, a, b, x3, w, bias: 2**a,
    "pow_": lambda m, a, b, x3, w, bias: (a * 1).pow_(2),
    "maximum": lambda m, a, b, x3, w, bias: m.maximum(a, b),
    "where": lambda m, a, b, x3, w, bias: m.where(a > 0, a, b),
    "neg": lambda m, a, b, x3, w, bias: -a,
    "abs": lambda m, a, b, x3, w, bias: a.abs(),
    "exp": lambda m, a, b, x3, w, bias: a.exp(),
    "exp_": lambda m, a, b, x3, w, bias: (a * 1).exp_(),
    "log": lambda m, a, b, x3, w, bias: a.abs().log(),
    "sqrt": lambda m, a, b, x3, w, bias: a.abs().sqrt(),
    "sin": lambda m, a, b, x3, w, bias: a.sin(),
    "cos": lambda m, a, b, x3, w, bias: a.cos(),
    "tanh": lambda m, a, b, x3, w, bias: a.tanh(),
    "sigmoid": lambda m, a, b, x3, w, bias: a.sigmoid(),
    "relu": lambda m, a, b, x3, w, bias: a.relu(),
    "leaky_relu": lambda m, a, b, x3, w, bias: m.nn.functional.leaky_relu(a, 0.2),
    "leaky_relu_": lambda m, a, b, x3, w, bias: m.nn.functional.leaky_relu(a * 1, 0.2, inplace=True),
    "clamp": lambda m, a, b, x3, w, bias: a.clamp(-1, 1),
    "clamp(min)": lambda m, a, b, x3, w, bias: a.clamp(min=0),
    "sum": lambda m, a, b, x3, w, bias: a.sum(),
    "sum(dim)": lambda m, a, b, x3, w, bias: a.sum(1),
    "sum(dim, keepdim)": lambda m, a, b, x3, w, bias: a.sum(1, keepdim=True),
    "mean": lambda m, a, b, x3, w, bias: a.mean(),
    "mean(dims)": lambda m, a, b, x3, w, bias: x3.mean((0, 1)),
    "amax": lambda m, a, b, x3, w, bias: a.amax(),
    "amax(dim)": lambda m, a, b, x3, w, bias: a.amax(1),
    "max(dim)": lambda m, a, b, x3, w, bias: a.max(1)[0],
    "max(-1, keepdim)": lambda m, a, b, x3, w, bias: a.max(-1, keepdim=True)[0],
    "softmax": lambda m, a, b, x3, w, bias: a.softmax(1),
    "log_softmax": lambda m, a, b, x3, w, bias: a.log_softmax(1),
    "view": lambda m, a, b, x3, w, bias: a.view(12),
    "permute": lambda m, a, b, x3, w, bias: x3.permute(2, 0, 1),
    "expand": lambda m, a, b, x3, w, bias: a[:1].expand(3, 4),
    "select": lambda m, a, b, x3, w, bias: a.select(1, 2),
    "unbind": lambda m, a, b, x3, w, bias: a.unbind(1)[0],
    "cat": lambda m, a, b, x3, w, bias: m.cat([a, b], 1),
    "stack": lambda m, a, b, x3, w, bias: m.stack([a, b]),
    "mm": lambda m, a, b, x3, w, bias: a @ b.T,
    "dot": lambda m, a, b, x3, w, bias: a[0] @ b[0],
    "mv": lambda m, a, b, x3, w, bias: a @ b[0],
    "linear (addmm)": lambda m, a, b, x3, w, bias: m.nn.functional.linear(a, w, bias),
    "linear without bias (mm)": lambda m, a, b, x3, w, bias: m.nn.functional.linear(a, w),
    "linear on 3-d input": lambda m, a, b, x3, w, bias: m.nn.functional.linear(x3, w, bias),
    "clone": lambda m, a, b, x3, w, bias: a.clone(),
    "t": lambda m, a, b, x3, w, bias: a.t(),
    "transpose": lambda m, a, b, x3, w, bias: x3.transpose(0, 2),
    "transpose of a 0-d tensor": lambda m, a, b, x3, w, bias: a[0, 0].transpose(0, -1),
    "rsub": lambda m, a, b, x3, w, bias: 1 - a,
    "rsub (tensor)": lambda m, a, b, x3, w, bias: a.__rsub__(b),
    "max()": lambda m, a, b, x3, w, bias: a.max(),
    "conv2d": lambda m, a, b, x3, w, bias: m.nn.functional.conv2d(x3.reshape(1, 2, 3, 4), w.reshape(5, 2, 2, 1), bias),
    "conv2d (stride, padding, no bias)": lambda m, a, b, x3, w, bias: m.nn.functional.conv2d(
        x3.reshape(1, 2, 3, 4), w.reshape(5, 2, 2, 1), stride=2, padding=1
    ),
    "gelu": lambda m, a, b, x3, w, bias: m.nn.functional.gelu(a),
    "gelu (tanh)": lambda m, a, b, x3, w, bias: m.nn.functional.gelu(a, approximate="tanh"),
    "embedding": lambda m, a, b, x3, w, bias: m.nn.functional.embedding(m.tensor(np.array([[0, 4], [1, 1]])), w),
    "embedding (padding_idx)": lambda m, a, b, x3, w, bias: m.nn.functional.embedding(
        m.tensor(np.array([0, 4])), w, padding_idx=-2
    ),
    "layer_norm": lambda m, a, b, x3, w, bias: m.nn.functional.layer_norm(x3, (4,), a[0], None),
    "layer_norm (2 dims, bias)": lambda m, a, b, x3, w, bias: m.nn.functional.layer_norm(x3, (3, 4), a, b),
}


def _leaves(m):
    rng = np.random.default_rng(0)
    shapes = ((3, 4), (3, 4), (2, 3, 4), (5, 4), (5,))
    return [m.tensor(rng.standard_normal(s), requires_grad=True) for s in shapes]


def _comparable(value):
    if hasattr(value, "detach"):  # a tensor (PyTorch also wraps a number operand in one)
        return np.asarray(value.detach().numpy())
    if isinstance(value, int) and value >= 2**63:  # PyTorch reads a negative int64 back unsigned
        return value - 2**64
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return np.asarray(value)
    return value


@pytest.mark.parametrize("name", list(SAVED_CASES))
def test_saved_names_match_torch(name, torch):
    """Every ``_saved_*`` attribute PyTorch's node has, this one has too (listed by dir()),
    with the same value; and the node's name is PyTorch's."""
    ours = SAVED_CASES[name](fw, *_leaves(fw)).grad_fn
    theirs = SAVED_CASES[name](torch, *_leaves(torch)).grad_fn
    assert ours.name() == theirs.name()
    want = sorted(a for a in dir(theirs) if a.startswith("_saved_"))
    assert sorted(a for a in dir(ours) if a.startswith("_saved_")) == want
    for attr in want:
        mine, theirs_value = _comparable(getattr(ours, attr)), _comparable(getattr(theirs, attr))
        if isinstance(theirs_value, np.ndarray):
            np.testing.assert_allclose(mine, theirs_value, err_msg=f"{name}: {attr}")
        else:
            assert mine == theirs_value, f"{name}: {attr}"


def test_a_renamed_view_node_keeps_its_name_when_made_again_from_the_base():
    # t() and transpose run through permute here; after an inplace op on the base the
    # view's node is made again from the base, with PyTorch's name as before
    base = fw.randn(3, 4, requires_grad=True) * 1
    t, tr = base.t(), base.transpose(1, 0)
    base.mul_(2)
    assert t.grad_fn.name() == "TBackward0" and not [a for a in dir(t.grad_fn) if a.startswith("_saved_")]
    assert tr.grad_fn.name() == "TransposeBackward0" and (tr.grad_fn._saved_dim0, tr.grad_fn._saved_dim1) == (1, 0)
    t.sum().backward()


def test_saved_attributes_are_absent_where_the_node_has_none():
    x = fw.ones(3, requires_grad=True)
    assert "_saved_result" not in dir(x**2) and "_saved_result" not in dir((x**2).grad_fn)
    with pytest.raises(AttributeError, match="PowBackward0"):
        _ = (x**2).grad_fn._saved_result
    with pytest.raises(AttributeError, match="SumBackward0"):
        _ = x.sum().grad_fn._saved_dim
    assert x.sum(0).grad_fn._saved_dim == (0,)


# --- type promotion (torch.result_type) -----------------------------------------------------

# (program, PyTorch 2.13's dtype, PyTorch's values): m is the module (fw or torch)
PROMOTIONS = {
    "dims + float64 0-d": (lambda m: m.ones(2) + m.tensor(1.0, dtype=m.float64), "float32", [2.0, 2.0]),
    "dims + np.float64": (lambda m: m.ones(2) + np.float64(1.5), "float32", [2.5, 2.5]),
    "np.float64 + dims": (lambda m: np.float64(1.5) + m.ones(2), "float32", [2.5, 2.5]),
    "int64 + float": (lambda m: m.ones(2, dtype=m.int64) + 1.5, "float32", [2.5, 2.5]),
    "int32 + float64 0-d": (lambda m: m.ones(2, dtype=m.int32) + m.tensor(1.5, dtype=m.float64), "float64", [2.5, 2.5]),
    "0-d + float64 0-d": (lambda m: m.tensor(1.0) + m.tensor(1.0, dtype=m.float64), "float64", 2.0),
    "0-d float32 * float64 dims": (lambda m: m.tensor(2.0) * m.ones(2, dtype=m.float64), "float64", [2.0, 2.0]),
    "int32 + int64 0-d": (lambda m: m.ones(2, dtype=m.int32) + m.tensor(1, dtype=m.int64), "int32", [2, 2]),
    "int32 + np.int64": (lambda m: m.ones(2, dtype=m.int32) + np.int64(1), "int32", [2, 2]),
    "bool + int": (lambda m: m.ones(2, dtype=m.bool_ if m is fw else m.bool) + 1, "int64", [2, 2]),
    "float16 + float32 dims": (lambda m: m.ones(2, dtype=m.float16) + m.ones(2), "float32", [2.0, 2.0]),
    "float16 + np.float32": (lambda m: m.ones(2, dtype=m.float16) + np.float32(1), "float16", [2.0, 2.0]),
    "uint8 + int8": (lambda m: m.ones(2, dtype=m.uint8) + m.ones(2, dtype=m.int8), "int16", [2, 2]),
    "int64 * float32": (lambda m: m.ones(2, dtype=m.int64) * m.ones(2), "float32", [1.0, 1.0]),
    "int / int": (lambda m: m.ones(2, dtype=m.int32) / 2, "float32", [0.5, 0.5]),
    "int / int (reflected)": (lambda m: 2 / m.ones(2, dtype=m.int32), "float32", [2.0, 2.0]),
    "int / float64 0-d": (lambda m: m.ones(2, dtype=m.int32) / m.tensor(2.0, dtype=m.float64), "float64", [0.5, 0.5]),
    "int ** float": (lambda m: m.full((2,), 4, dtype=m.int32) ** 0.5, "float32", [2.0, 2.0]),
    "float - int (reflected)": (lambda m: 1.5 - m.ones(2, dtype=m.int32), "float32", [0.5, 0.5]),
    "where": (
        lambda m: m.where(m.tensor([True, False]), m.ones(2), m.tensor(2.0, dtype=m.float64)),
        "float32",
        [1.0, 2.0],
    ),
    "where of two numbers": (lambda m: m.where(m.tensor([True, False]), 1.0, 0.0), "float32", [1.0, 0.0]),
    "maximum": (lambda m: m.maximum(m.ones(2), m.tensor(2.0, dtype=m.float64)), "float32", [2.0, 2.0]),
    "clamp int by float": (lambda m: m.clamp(m.tensor([1, 2]), min=0.5), "float32", [1.0, 2.0]),
    "clamp float16 by float": (lambda m: m.ones(2, dtype=m.float16).clamp(min=0.3), "float16", [1.0, 1.0]),
    "clamp int by int": (lambda m: m.tensor([1, 2]).clamp(max=1), "int64", [1, 1]),
    # compared in float32, as PyTorch: 0.1 rounds to the same float32
    "eq in the result type": (lambda m: m.tensor([0.1]) == m.tensor(0.1, dtype=m.float64), "bool", [True]),
}


@pytest.mark.parametrize("name", PROMOTIONS)
def test_type_promotion(name):
    program, dtype, values = PROMOTIONS[name]
    out = program(fw)
    assert str(out.dtype) == dtype
    assert out.tolist() == values


@pytest.mark.parametrize("name", PROMOTIONS)
def test_type_promotion_matches_torch(name, torch):
    program, dtype, values = PROMOTIONS[name]
    theirs = program(torch)
    assert str(theirs.dtype) == "torch." + dtype and theirs.tolist() == values


def test_promotion_keeps_each_gradient_in_its_input_dtype():
    x = fw.ones(2, requires_grad=True)
    s = fw.tensor(3.0, dtype=fw.float64, requires_grad=True)
    out = x * s
    assert out.dtype == fw.float32
    out.sum().backward()
    assert x.grad.dtype == fw.float32 and s.grad.dtype == fw.float64
    assert x.grad.tolist() == [3.0, 3.0] and s.grad.item() == 2.0


@pytest.mark.parametrize(
    "op, message",
    [
        (
            lambda: fw.ones(2, dtype=fw.int64).add_(1.5),
            "result type Float can't be cast to the desired output type Long",
        ),
        (lambda: fw.ones(2, dtype=fw.int32).div_(2), "result type Float can't be cast to the desired output type Int"),
        (
            lambda: fw.ones(2, dtype=fw.bool_).add_(fw.tensor([1, 2])),
            "result type Long can't be cast to the desired output type Bool",
        ),
        (
            lambda: fw.ones(2, dtype=fw.int64).mul_(fw.tensor(0.5, dtype=fw.float64)),
            "result type Double can't be cast to the desired output type Long",
        ),
        (lambda: fw.tensor([1, 2]).clamp_(min=0.5), "result type Float can't be cast to the desired output type"),
    ],
)
def test_inplace_result_that_cannot_be_cast_raises_torchs_error(op, message):
    with pytest.raises(RuntimeError, match=message):
        op()


def test_inplace_computes_in_the_result_type():
    x = fw.ones(2)
    x.add_(fw.tensor([1.0, 2.0], dtype=fw.float64))  # float64 result, written as float32
    assert x.dtype == fw.float32 and x.tolist() == [2.0, 3.0]
    i = fw.ones(2, dtype=fw.int32)
    i.add_(fw.tensor([1, 2]))
    assert i.dtype == fw.int32 and i.tolist() == [2, 3]
    # float32 x times a float64 0-d tensor: computed in float32 (the 0-d one does not promote)
    y = fw.tensor([1 / 3])
    y.mul_(fw.tensor(3.0000001, dtype=fw.float64))
    assert y.numpy()[0] == np.float32(1 / 3) * np.float32(3.0000001)


def test_inplace_promotion_matches_torch(torch):
    for m in (fw, torch):
        y = m.tensor([1 / 3, 0.7])
        y.mul_(m.tensor(3.0000001, dtype=m.float64))
        y.add_(np.float64(0.1))
        y.div_(m.tensor([3.0, 7.0], dtype=m.float64))
        if m is fw:
            ours = y.numpy()
    np.testing.assert_array_equal(ours, y.numpy())


def test_type_promotion_on_every_device(backend):
    # CuPy follows NumPy 2 (NEP 50), which would give float64 here: the rule is the framework's
    ones = fw.ones(2, device=backend)
    assert (ones + fw.tensor(1.0, dtype=fw.float64, device=backend)).dtype == fw.float32
    assert (ones * np.float64(1.5)).dtype == fw.float32
    assert (fw.ones(2, dtype=fw.int32, device=backend) + fw.tensor(1.5, dtype=fw.float64, device=backend)).dtype == (
        fw.float64
    )
    assert (fw.ones(2, dtype=fw.int64, device=backend) / 2).dtype == fw.float32
    x = fw.ones(2, device=backend)
    x.mul_(fw.tensor(3.0, dtype=fw.float64, device=backend))
    assert x.dtype == fw.float32 and x.tolist() == [3.0, 3.0]
    with pytest.raises(RuntimeError, match="result type Float can't be cast to the desired output type Long"):
        fw.ones(2, dtype=fw.int64, device=backend).add_(0.5)


# --- memory format: preserve_format and the gradient layout contract -----------------------

LIKES = {
    "clone": lambda m, t: t.clone(),
    "empty_like": lambda m, t: m.empty_like(t),
    "zeros_like": lambda m, t: m.zeros_like(t),
    "ones_like": lambda m, t: m.ones_like(t, dtype=m.float64),
    "full_like": lambda m, t: m.full_like(t, 2.0),
    "rand_like": lambda m, t: m.rand_like(t),
    "randn_like": lambda m, t: m.randn_like(t),
}
# (input, PyTorch's strides of the result): transposed and permuted inputs are dense and
# keep their strides; a strided slice is not dense and gives a contiguous result
LAYOUTS = {
    "transposed": (lambda m: m.zeros(3, 4).t(), (1, 4)),
    "permuted": (lambda m: m.zeros(2, 3, 4, 5).permute(0, 2, 3, 1), (60, 5, 1, 20)),
    "strided slice": (lambda m: m.zeros(3, 8)[:, ::2], (4, 1)),
    "contiguous": (lambda m: m.zeros(3, 4), (4, 1)),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("like", LIKES)
def test_new_tensors_preserve_a_dense_layout(like, layout, backend):
    make, strides = LAYOUTS[layout]
    t = make(fw).to(backend)
    out = LIKES[like](fw, t)
    assert out.shape == t.shape and out.stride() == strides
    if like == "clone":
        assert out.tolist() == t.tolist()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("like", LIKES)
def test_new_tensor_layouts_match_torch(like, layout, torch):
    make, strides = LAYOUTS[layout]
    assert LIKES[like](torch, make(torch)).stride() == strides


def test_contiguous_of_a_transposed_tensor_is_contiguous():
    t = fw.zeros(3, 4).t()
    assert t.contiguous().stride() == (3, 1) and t.contiguous().is_contiguous()


def test_clone_of_a_transposed_tensor_keeps_values_and_gradient():
    x = fw.arange(12.0).reshape(3, 4).requires_grad_()
    y = x.t().clone()
    assert y.stride() == (1, 4) and y.tolist() == x.t().tolist()
    (y * fw.arange(12.0).reshape(4, 3)).sum().backward()
    assert x.grad.tolist() == fw.arange(12.0).reshape(4, 3).t().tolist()


# (leaf, PyTorch's .grad strides): AccumulateGrad copies into the layout of a dense leaf
LEAVES = {
    "transposed": (lambda m: m.zeros(3, 4).t(), (1, 4)),
    "strided slice": (lambda m: m.zeros(3, 8)[:, ::2], (4, 1)),
    "size-1 dim": (lambda m: m.zeros(1, 4).t(), (1, 1)),
    "permuted": (lambda m: m.zeros(2, 3, 4).permute(2, 0, 1), (1, 12, 4)),
}


@pytest.mark.parametrize("leaf", LEAVES)
def test_grad_follows_the_leafs_layout(leaf, backend):
    make, strides = LEAVES[leaf]
    for policy in ("off", "auto", "on"):
        with fw.inplace.policy(policy):
            x = make(fw).to(backend).detach().requires_grad_()
            (x * 2).sum().backward()
            assert x.grad.stride() == strides and x.grad.tolist() == (fw.ones_like(x) * 2).tolist()
            (x * 3).sum().backward()  # accumulation keeps it
            assert x.grad.stride() == strides and x.grad.tolist() == (fw.ones_like(x) * 5).tolist()


@pytest.mark.parametrize("leaf", LEAVES)
def test_grad_layout_matches_torch(leaf, torch):
    make, strides = LEAVES[leaf]
    x = make(torch).detach().requires_grad_()
    (x * 2).sum().backward()
    (x * 3).sum().backward()
    assert x.grad.stride() == strides


# --- bfloat16 (through ml_dtypes, as CuPy 14) -------------------------------------------------


@pytest.fixture
def bf16():
    pytest.importorskip("ml_dtypes")
    return fw.bfloat16


def test_bfloat16_creation_and_casts(bf16, backend):
    a = fw.tensor([1.0, 2.5, 3.3], dtype=bf16, device=backend)
    assert a.dtype == bf16 and a.tolist() == [1.0, 2.5, 3.296875]  # PyTorch's rounding
    assert (
        fw.zeros(2, dtype=bf16, device=backend).tolist() == [0.0, 0.0]
        and fw.ones(2, 2, dtype=bf16, device=backend).dtype == bf16
    )
    assert fw.ones(2, device=backend).to(bf16).dtype == bf16 and fw.ones(2, device=backend).bfloat16().dtype == bf16
    assert a.float().dtype == fw.float32 and a.float().tolist() == [1.0, 2.5, 3.296875]
    assert a.to(fw.int64).tolist() == [1, 2, 3]
    b = fw.zeros(3, dtype=bf16, device=backend)
    b.copy_(fw.tensor([1.1, 2.2, 3.3], device=backend))
    assert b.dtype == bf16 and b.tolist() == [1.1015625, 2.203125, 3.296875]


def test_bfloat16_elementwise_rounds_each_result(bf16, backend):
    # PyTorch computes each op in float32 and rounds the result to bfloat16
    a = fw.tensor([1.0, 2.5, 3.3], dtype=bf16, device=backend)
    assert (a * a).tolist() == [1.0, 6.25, 10.875]
    assert (a / 3).tolist() == [0.333984375, 0.83203125, 1.1015625]
    assert (a + 1.5).dtype == bf16 and (a + 1.5).tolist() == [2.5, 4.0, 4.8125]
    assert (a - a).tolist() == [0.0, 0.0, 0.0] and (-a).dtype == bf16
    assert fw.relu(fw.tensor([-1.0, 2.0], dtype=bf16, device=backend)).tolist() == [0.0, 2.0]
    assert (a + fw.ones(3, device=backend)).dtype == fw.float32  # promotion: float32 dims win
    assert (a * fw.tensor(2.0, dtype=fw.float64, device=backend)).dtype == bf16  # a 0-d tensor does not promote
    a.mul_(3)
    assert a.dtype == bf16 and a.tolist() == [3.0, 7.5, 9.875]


def test_bfloat16_gradients(bf16, backend):
    x = fw.tensor([1.0, -2.0, 3.0], dtype=bf16, requires_grad=True, device=backend)
    (x * x + x).relu().sum().backward()
    assert x.grad.dtype == bf16 and x.grad.tolist() == [3.0, -3.0, 7.0]


def test_bfloat16_gradient_through_a_scalar_matches_torch(bf16, torch):
    values = [0.1, -1.7, 3.3]
    ours = fw.tensor(values, dtype=bf16, requires_grad=True)
    theirs = torch.tensor(values, dtype=torch.bfloat16, requires_grad=True)
    for x in (ours, theirs):
        (x * 1.7 + x * x).sum().backward()
    assert ours.grad.dtype == bf16 and ours.grad.tolist() == theirs.grad.tolist()


def test_bfloat16_module(bf16):
    net = fw.nn.BatchNorm1d(3).bfloat16()
    assert net.weight.dtype == bf16 and net.running_mean.dtype == bf16
    assert net.num_batches_tracked.dtype == fw.int64
    assert net.float().weight.dtype == fw.float32


def test_bfloat16_elementwise_matches_torch(bf16, torch):
    values = [0.1, -1.7, 3.3, 1e-3, 250.0, -0.0]
    others = [0.3, 2.9, -7.1, 3e-2, 1.5, 2.0]
    ours_a, ours_b = fw.tensor(values, dtype=bf16), fw.tensor(others, dtype=bf16)
    their_a, their_b = torch.tensor(values, dtype=torch.bfloat16), torch.tensor(others, dtype=torch.bfloat16)
    assert ours_a.tolist() == their_a.tolist()

    def m_maximum(a, b):
        return (fw if isinstance(a, fw.Tensor) else torch).maximum(a, b)

    for f in (
        lambda a, b: a + b,
        lambda a, b: a - b,
        lambda a, b: a * b,
        lambda a, b: a / b,
        lambda a, b: -a,
        lambda a, b: a * 1.7,  # mul and div keep the scalar in float32 (PyTorch's opmath)
        lambda a, b: a / 1.7,
        lambda a, b: a + 1.7,  # the others round it to bfloat16 first, as PyTorch's kernels
        lambda a, b: 1.7 - a,
        lambda a, b: m_maximum(a, b),
        lambda a, b: b**2,
        lambda a, b: 1.3**a,
        lambda a, b: a > 1.7,
        lambda a, b: a.clone().mul_(1.7),
        lambda a, b: a.clone().add_(1.7),
        lambda a, b: a.clone().add_(b, alpha=1),
        lambda a, b: a.relu() if hasattr(a, "relu") else a,
        lambda a, b: a.float(),
        lambda a, b: a.double() + 0.1,
    ):
        ours, theirs = f(ours_a, ours_b), f(their_a, their_b)
        assert str(ours.dtype) == str(theirs.dtype).removeprefix("torch.")
        assert ours.tolist() == theirs.tolist()


def test_promotion_and_layouts_change_no_number_under_any_policy():
    def program():
        fw.manual_seed(0)
        w = fw.randn(3, 4).t().detach().requires_grad_()  # a transposed leaf
        s = fw.tensor(0.7, dtype=fw.float64, requires_grad=True)
        h = (w * s + np.float64(0.1)) ** 0
        out = (h + w.clone() * 2 + fw.ones(4, 3, dtype=fw.int64)).relu() / 3
        out.sum().backward()
        return out.detach().numpy(), w.grad.numpy(), w.grad.stride(), s.grad.numpy()

    results = {}
    for policy in ("off", "auto", "on"):
        with fw.inplace.policy(policy):
            results[policy] = program()
    for policy in ("auto", "on"):
        for ours, reference in zip(results[policy], results["off"]):
            np.testing.assert_array_equal(ours, reference)
    assert results["off"][2] == (1, 4) and results["off"][0].dtype == np.float32
