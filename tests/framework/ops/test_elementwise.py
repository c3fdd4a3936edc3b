"""Elementwise ops: arithmetic (and reflected forms), activations, comparisons, inplace.

The table drives forward / backward / inplace / memory checks through the harness; the
hand-written tests below cover what a table cannot: dtype promotion, error messages,
fills and random fills, augmented assignment.
"""

from __future__ import annotations

import operator

import numpy as np
import pytest

import framework as fw
from framework.testing import assert_close, gradcheck

from . import harness
from .harness import BINARY, UNARY, Budget, OpSpec

# Other spellings of an op already checked on all of BINARY: fewer cases suffice.
FEW = [((2, 3), (2, 3)), ((3, 1), (1, 4)), ((2, 3, 4), (4,)), ((), ())]
POS = (0.5, 2.0)  # log, sqrt, divisors, pow bases
ANY = (-2.0, 2.0)


def _sigmoid(a):
    return 1 / (1 + np.exp(-a))


def _leaky(slope):
    return lambda a: np.where(a > 0, a, slope * a)


SPECS = [
    # --- unary: inplace is free when backward reads the result or nothing ---------------
    OpSpec("neg", fw.neg, np.negative, UNARY, inplace=lambda x: x.neg_(), memory="free"),
    OpSpec("-x", operator.neg, np.negative, UNARY),
    OpSpec("exp", fw.exp, np.exp, UNARY, inplace=lambda x: x.exp_(), memory="free"),
    OpSpec("sqrt", fw.sqrt, np.sqrt, UNARY, domain=(POS,), inplace=lambda x: x.sqrt_(), memory="free"),
    OpSpec("tanh", fw.tanh, np.tanh, UNARY, inplace=lambda x: x.tanh_(), memory="free"),
    OpSpec("sigmoid", fw.sigmoid, _sigmoid, UNARY, inplace=lambda x: x.sigmoid_(), memory="free", budget=Budget(1, 5)),
    OpSpec("relu", fw.relu, lambda a: np.maximum(a, 0), UNARY, inplace=lambda x: x.relu_(), memory="free"),
    # leaky_relu_ keeps nothing, but its CPU kernel needs one counted temporary while it
    # runs; the GPU's fused kernel needs none.
    OpSpec(
        "leaky_relu",
        fw.leaky_relu,
        _leaky(0.01),
        UNARY,
        inplace=lambda x: x.leaky_relu_(),
        memory="workspace",
        gpu_memory="free",
    ),
    OpSpec(
        "leaky_relu(0.3)",
        lambda x: x.leaky_relu(0.3),
        _leaky(0.3),
        UNARY,
        inplace=lambda x: x.leaky_relu_(0.3),
        memory="workspace",
        gpu_memory="free",
    ),
    OpSpec("leaky_relu(-0.5)", lambda x: fw.leaky_relu(x, -0.5), _leaky(-0.5), UNARY, budget=Budget(3, 8)),
    # --- unary: backward needs the overwritten input, so inplace copies it -------------
    OpSpec("abs", fw.abs, np.abs, UNARY, inplace=lambda x: x.abs_(), memory="copy"),
    OpSpec("abs()", abs, np.abs, UNARY),
    OpSpec("log", fw.log, np.log, UNARY, domain=(POS,), inplace=lambda x: x.log_(), memory="copy"),
    OpSpec("sin", fw.sin, np.sin, UNARY, inplace=lambda x: x.sin_(), memory="copy"),
    OpSpec("cos", fw.cos, np.cos, UNARY, inplace=lambda x: x.cos_(), memory="copy"),
    OpSpec(
        "clamp",
        lambda x: x.clamp(-0.5, 0.7),
        lambda a: np.clip(a, -0.5, 0.7),
        UNARY,
        inplace=lambda x: x.clamp_(-0.5, 0.7),
        memory="copy",
    ),
    OpSpec(
        "clamp(min)",
        lambda x: fw.clamp(x, min=-0.5),
        lambda a: np.maximum(a, -0.5),
        UNARY,
        inplace=lambda x: x.clamp_(min=-0.5),
        memory="copy",
    ),
    OpSpec(
        "clamp(max)",
        lambda x: x.clamp(max=0.3),
        lambda a: np.minimum(a, 0.3),
        UNARY,
        inplace=lambda x: x.clamp_(max=0.3),
        memory="copy",
    ),
    OpSpec("x**2", lambda x: x**2, np.square, UNARY, inplace=lambda x: x.pow_(2), memory="copy"),
    OpSpec("x**0.5", lambda x: x**0.5, np.sqrt, UNARY, domain=(POS,), inplace=lambda x: x.pow_(0.5), memory="copy"),
    OpSpec("x**-1.5", lambda x: x.pow(-1.5), lambda a: a**-1.5, UNARY, domain=(POS,)),
    # --- with a Python scalar: inplace by a constant is free ---------------------------
    OpSpec("x+2", lambda x: x + 2, lambda a: a + 2, UNARY, inplace=lambda x: x.add_(2), memory="free"),
    OpSpec("x-1.5", lambda x: x - 1.5, lambda a: a - 1.5, UNARY, inplace=lambda x: x.sub_(1.5), memory="free"),
    OpSpec("x*2.5", lambda x: x * 2.5, lambda a: a * 2.5, UNARY, inplace=lambda x: x.mul_(2.5), memory="free"),
    OpSpec("x*=2.5", lambda x: x * 2.5, lambda a: a * 2.5, UNARY, inplace=lambda x: operator.imul(x, 2.5)),
    OpSpec("x/4", lambda x: x / 4.0, lambda a: a / 4.0, UNARY, inplace=lambda x: x.div_(4.0), memory="free"),
    # --- reflected forms ---------------------------------------------------------------
    OpSpec("2+x", lambda x: 2 + x, lambda a: 2 + a, UNARY),
    OpSpec("2-x", lambda x: 2 - x, lambda a: 2 - a, UNARY),
    OpSpec("3*x", lambda x: 3 * x, lambda a: 3 * a, UNARY),
    OpSpec("1/x", lambda x: 1 / x, lambda a: 1 / a, UNARY, domain=(POS,)),
    OpSpec("2**x", lambda x: 2**x, lambda a: 2.0**a, UNARY, budget=Budget(1, 12)),
    # --- two tensors, with broadcasting ------------------------------------------------
    OpSpec("add", operator.add, np.add, BINARY, inplace=lambda x, y: x.add_(y), memory="free"),
    OpSpec(
        "add(alpha)",
        lambda x, y: fw.add(x, y, alpha=2),
        lambda a, b: a + 2 * b,
        BINARY,
        inplace=lambda x, y: x.add_(y, alpha=2),
        memory="free",
    ),
    OpSpec("+=", operator.add, np.add, FEW, inplace=operator.iadd),
    OpSpec("sub", operator.sub, np.subtract, BINARY, inplace=lambda x, y: x.sub_(y), memory="free"),
    OpSpec(
        "sub(alpha)",
        lambda x, y: x.sub(y, alpha=3),
        lambda a, b: a - 3 * b,
        BINARY,
        inplace=lambda x, y: x.sub_(y, alpha=3),
    ),
    OpSpec("-=", operator.sub, np.subtract, FEW, inplace=operator.isub),
    OpSpec("mul", operator.mul, np.multiply, BINARY, inplace=lambda x, y: x.mul_(y), memory="copy"),
    OpSpec("*=", operator.mul, np.multiply, FEW, inplace=operator.imul),
    OpSpec(
        "div",
        operator.truediv,
        np.divide,
        BINARY,
        domain=(ANY, POS),
        inplace=lambda x, y: x.div_(y),
        memory="free",
        budget=Budget(1, 12),
    ),
    OpSpec("/=", operator.truediv, np.divide, FEW, domain=(ANY, POS), inplace=operator.itruediv, budget=Budget(1, 12)),
    OpSpec(
        "pow",
        operator.pow,
        np.power,
        BINARY,
        domain=(POS, ANY),
        inplace=lambda x, y: x.pow_(y),
        memory="copy",
        # PyTorch's masks (zero gradient where the exponent is 0, and where the base is 0
        # for the exponent's gradient) cost two and four elementwise launches
        budget=Budget(1, 21),
    ),
    OpSpec("**=", operator.pow, np.power, FEW, domain=(POS, ANY), inplace=operator.ipow, budget=Budget(1, 21)),
    OpSpec("maximum", fw.maximum, np.maximum, BINARY, budget=Budget(1, 16)),
    OpSpec("max(x, y)", fw.max, np.maximum, FEW, budget=Budget(1, 16)),
    OpSpec("where", lambda x, y: fw.where(x > 0, x, y), lambda a, b: np.where(a > 0, a, b), BINARY),
    OpSpec("where(scalar)", lambda x: fw.where(x < 0.5, x, -1.0), lambda a: np.where(a < 0.5, a, -1.0), UNARY),
    OpSpec("x.where", lambda x, y: x.where(y > 0, y), lambda a, b: np.where(b > 0, a, b), FEW),
    # --- comparisons: bool results, no gradient ----------------------------------------
    OpSpec("==", lambda x, y: x == y.clamp(max=0), lambda a, b: a == np.minimum(b, 0), FEW, grad=False),
    OpSpec("!=", lambda x, y: x != y.clamp(max=0), lambda a, b: a != np.minimum(b, 0), FEW, grad=False),
    OpSpec("<", operator.lt, np.less, FEW, grad=False),
    OpSpec("<=", operator.le, np.less_equal, FEW, grad=False),
    OpSpec(">", operator.gt, np.greater, FEW, grad=False),
    OpSpec(">=", operator.ge, np.greater_equal, FEW, grad=False),
    OpSpec("x > 0.5", lambda x: x > 0.5, lambda a: a > 0.5, UNARY, grad=False),
    OpSpec("eq()", lambda x: x.eq(x), lambda a: a == a, UNARY, grad=False),
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


@pytest.mark.parametrize("case", harness.cases(SPECS, need="inplace"))
def test_inplace_matches_ordinary(case, backend):
    harness.check_inplace(case, backend)


@pytest.mark.parametrize("case", harness.memory_cases(SPECS))
def test_inplace_memory(case, backend):
    harness.check_inplace_memory(case, backend)


def test_the_table_covers_every_inplace_op():
    # Every memory-free / copying inplace op named by the design appears in the table.
    declared = {s.name for s in SPECS if s.memory}
    assert {"relu", "exp", "sqrt", "tanh", "sigmoid", "leaky_relu", "neg", "x+2", "x-1.5", "x/4", "x*2.5"} <= declared
    assert {s.name for s in SPECS if s.memory == "workspace"} == {"leaky_relu", "leaky_relu(0.3)"}
    assert {"sin", "cos", "log", "abs", "x**2", "clamp", "mul"} <= declared
    assert {s.memory for s in SPECS if s.name in ("mul", "x*2.5")} == {"copy", "free"}


# --- dtypes ------------------------------------------------------------------------------

FLOAT_SCALAR_FORMS = [
    lambda x: x + 1,
    lambda x: x - 2.5,
    lambda x: x * 3,
    lambda x: x / 2,
    lambda x: x**2,
    lambda x: x**0.5,
    lambda x: 1 - x,
    lambda x: 2.5 * x,
    lambda x: 1 / x,
    lambda x: 2**x,
    lambda x: x.add(1.5, alpha=2),
]


@pytest.mark.parametrize("form", FLOAT_SCALAR_FORMS)
def test_float32_stays_float32_with_python_scalars(form):
    assert form(fw.tensor([1.0, 2.0])).dtype == fw.float32


@pytest.mark.parametrize(
    "form, values",
    [
        (lambda x: x * 1.5, [1.5, 3.0, 4.5]),
        (lambda x: 1.5 * x, [1.5, 3.0, 4.5]),
        (lambda x: x + 0.5, [1.5, 2.5, 3.5]),
        (lambda x: 0.5 - x, [-0.5, -1.5, -2.5]),
        (lambda x: x / 2, [0.5, 1.0, 1.5]),
        (lambda x: x / fw.tensor([2, 4, 4]), [0.5, 0.5, 0.75]),  # int / int tensors
        (lambda x: 3 / x, [3.0, 1.5, 1.0]),
        (lambda x: x.div(x), [1.0, 1.0, 1.0]),
        (lambda x: x * fw.tensor([0.5, 0.5, 0.5]), [0.5, 1.0, 1.5]),  # int tensor * float32 tensor
        (lambda x: fw.tensor([0.5, 0.5, 0.5]) + x, [1.5, 2.5, 3.5]),
        (lambda x: x**0.5, [1.0, 2**0.5, 3**0.5]),
    ],
)
def test_int_tensor_with_floats_gives_float32(form, values):
    out = form(fw.tensor([1, 2, 3]))
    assert out.dtype == fw.float32
    assert_close(out, np.array(values, dtype=np.float32))


@pytest.mark.parametrize("form", [lambda x: x + 1, lambda x: x * 2, lambda x: 2 - x, lambda x: x + x, lambda x: x**2])
def test_int_with_int_stays_int64(form):
    assert form(fw.tensor([1, 2, 3])).dtype == fw.int64


def test_float64_is_kept_and_wins_over_float32():
    x64 = fw.tensor([1.0], dtype=fw.float64)
    assert (x64 * 2.5).dtype == fw.float64
    assert (x64 + fw.tensor([1.0])).dtype == fw.float64


def test_inplace_keeps_the_dtype_of_the_written_tensor():
    x = fw.tensor([1.0, 2.0])
    x.add_(fw.tensor([0.5, 0.5], dtype=fw.float64))
    x.mul_(fw.tensor([2, 3]))
    assert x.dtype == fw.float32
    assert_close(x, [3.0, 7.5])


def test_inplace_that_would_change_an_int_tensor_to_float_raises_and_keeps_it():
    x = fw.tensor([1, 2, 3])
    for op in (lambda: x.add_(1.5), lambda: x.div_(2), lambda: x.mul_(fw.tensor([0.5, 0.5, 0.5]))):
        with pytest.raises(RuntimeError, match="cast"):
            op()
    assert x.dtype == fw.int64 and x.tolist() == [1, 2, 3] and x._version == 0


# --- inplace errors ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "op, name",
    [
        (lambda x, y: x.add_(y), "add_"),
        (lambda x, y: x.sub_(y), "sub_"),
        (lambda x, y: x.mul_(y), "mul_"),
        (lambda x, y: x.div_(y), "div_"),
        (lambda x, y: x.pow_(y), "pow_"),
        (lambda x, y: x.copy_(y), "copy_"),
        (operator.iadd, "add_"),
    ],
)
def test_inplace_broadcast_that_would_grow_the_tensor_raises_and_leaves_it_unchanged(op, name, backend):
    x = fw.tensor([1.0, 2.0, 3.0], device=backend, requires_grad=True) * 1
    y = fw.tensor(np.full((2, 3), 2.0), device=backend, requires_grad=True)
    before = x.detach().numpy().copy()
    with pytest.raises(RuntimeError) as info:
        op(x, y)
    msg = str(info.value)
    assert msg.startswith(name) and "(3,)" in msg and "(2,3)" in msg.replace(" ", "")
    np.testing.assert_array_equal(x.detach().numpy(), before)
    assert x._version == 0
    x.sum().backward()  # the graph is intact too


def test_a_refused_inplace_kernel_names_the_shapes_whatever_the_array_module_said():
    from framework.autograd.function import _refused_inplace

    # CuPy's words for a result that does not fit the written array:
    got = _refused_inplace(ValueError("Out shape is mismatched"), [np.zeros(3), np.zeros((2, 3))])
    assert got == "non-broadcastable output operand with shape (3,) doesn't match the broadcast shape (2, 3)"
    # NumPy's words, and errors that are not about the result's shape, pass unchanged:
    numpy_words = "non-broadcastable output operand with shape (3,) doesn't match the broadcast shape (2,3)"
    assert _refused_inplace(ValueError(numpy_words), [np.zeros(3), np.zeros((2, 3))]) == numpy_words
    assert _refused_inplace(TypeError("bad cast"), [np.zeros(3), 2.0]) == "bad cast"
    assert _refused_inplace(ValueError("x"), [np.zeros(3), np.zeros(4)]) == "x"


def test_inplace_on_a_leaf_that_requires_grad_raises_before_writing():
    x = fw.tensor([1.0, -2.0], requires_grad=True)
    for op in (lambda: x.relu_(), lambda: x.sin_(), lambda: x.add_(1), lambda: x.fill_(0)):
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            op()
    assert x.tolist() == [1.0, -2.0] and x._version == 0
    with fw.no_grad():
        assert x.relu_() is x
    assert x.tolist() == [1.0, 0.0] and x._version == 1


def test_leaky_relu_inplace_with_negative_slope_refuses():
    x = fw.tensor([1.0, -2.0], requires_grad=True) * 1
    with pytest.raises(RuntimeError, match="leaky_relu_.*slope"):
        x.leaky_relu_(-0.5)
    assert x.tolist() == [1.0, -2.0] and x._version == 0


def test_saved_input_copy_keeps_backward_correct_after_more_inplace_ops():
    # sin_ copies its input; a later exp_ overwrites the buffer again: gradients stay right.
    x = fw.tensor([0.3, -1.2], dtype=fw.float64, requires_grad=True)
    y = (x * 1).sin_().exp_()
    y.sum().backward()
    a = x.detach().numpy()
    assert_close(x.grad, np.exp(np.sin(a)) * np.cos(a))


# --- augmented assignment -------------------------------------------------------------------


@pytest.mark.parametrize("op", ["+=", "-=", "*=", "/=", "**="])
def test_augmented_assignment_keeps_the_object(op):
    x = fw.tensor([1.0, 2.0], requires_grad=True) * 1
    alias = x
    ns = {"x": x}
    exec(f"x {op} 2", ns)  # noqa: S102  (a statement form is what is being tested)
    assert ns["x"] is alias and alias._version == 1
    expected = {"+=": [3, 4], "-=": [-1, 0], "*=": [2, 4], "/=": [0.5, 1], "**=": [1, 4]}[op]
    assert_close(alias, np.array(expected, dtype=np.float32))


# --- fills ----------------------------------------------------------------------------------


def _nonleaf(values, dtype=fw.float64):
    leaf = fw.tensor(values, dtype=dtype, requires_grad=True)
    return leaf, leaf * 1


def _no_gradient(leaf):
    # The overwritten values get no gradient: None (not computed) or zeros both say so.
    return leaf.grad is None or not leaf.grad.numpy().any()


def test_zero_():
    leaf, x = _nonleaf([[1.0, 2.0], [3.0, 4.0]])
    assert x.zero_() is x and x._version == 1
    assert x.tolist() == [[0, 0], [0, 0]]
    (x + leaf).sum().backward()  # the zeroed values carry no gradient to the old ones
    assert leaf.grad.tolist() == [[1, 1], [1, 1]]


def test_fill_with_scalar_and_with_a_tensor():
    leaf, x = _nonleaf([1.0, 2.0, 3.0])
    assert x.fill_(2.5) is x and x._version == 1 and x.tolist() == [2.5] * 3
    v = fw.tensor(4.0, dtype=fw.float64, requires_grad=True)
    x.fill_(v)
    (x * fw.tensor([1.0, 2.0, 3.0], dtype=fw.float64)).sum().backward()
    assert x.tolist() == [4.0] * 3 and x._version == 2
    assert v.grad.item() == 6.0 and _no_gradient(leaf)
    gradcheck(lambda a, b: a.clone().fill_(b), [fw.randn(2, 3, dtype=fw.float64, requires_grad=True), v])


def test_copy_broadcasts_casts_and_routes_the_gradient_to_the_source():
    leaf, x = _nonleaf(np.zeros((2, 3)))
    src = fw.tensor([1.0, 2.0, 3.0], dtype=fw.float64, requires_grad=True)
    assert x.copy_(src) is x and x._version == 1
    assert x.tolist() == [[1, 2, 3], [1, 2, 3]]
    x.sum().backward()
    assert src.grad.tolist() == [2, 2, 2] and _no_gradient(leaf)
    gradcheck(lambda a, b: a.clone().copy_(b), [fw.randn(2, 3, dtype=fw.float64, requires_grad=True), src])
    f32 = fw.zeros(3)
    f32.copy_(fw.tensor([1, 2, 3]))
    assert f32.dtype == fw.float32 and f32.tolist() == [1, 2, 3]
    with pytest.raises(TypeError, match="Tensor"):
        f32.copy_(np.ones(3))


@pytest.mark.parametrize(
    "fill",
    [
        lambda x: x.zero_(),
        lambda x: x.fill_(3.0),
        lambda x, ones=fw.ones(3, 4): x.copy_(ones),  # noqa: B008 (one source for every call)
        lambda x: x.normal_(),
        lambda x: x.uniform_(-1, 1),
    ],
    ids=["zero_", "fill_", "copy_", "normal_", "uniform_"],
)
def test_fills_allocate_nothing(fill):
    x = fw.randn(3, 4, requires_grad=True) * 1
    harness.assert_inplace_cost(lambda: fill(x), x, "free")


def test_normal_and_uniform_are_seeded_and_have_the_asked_distribution():
    fw.manual_seed(7)
    a = fw.zeros(20000).normal_(3.0, 2.0)
    fw.manual_seed(7)
    b = fw.zeros(20000).normal_(3.0, 2.0)
    assert a.dtype == fw.float32 and a.tolist() == b.tolist()
    assert abs(a.mean().item() - 3.0) < 0.05 and abs(a.var().item() ** 0.5 - 2.0) < 0.05
    u = fw.zeros(20000, dtype=fw.float64).uniform_(2.0, 5.0)
    assert u.dtype == fw.float64 and u._version == 1
    vals = u.numpy()
    assert vals.min() >= 2.0 and vals.max() < 5.0 and abs(vals.mean() - 3.5) < 0.05


@pytest.mark.parametrize("fill", [lambda x: x.normal_(), lambda x: x.uniform_()], ids=["normal_", "uniform_"])
def test_random_fills_in_the_graph(fill):
    leaf, x = _nonleaf([1.0, 2.0])
    assert fill(x) is x and x._version == 1
    assert x.grad_fn is not None
    (x + leaf).sum().backward()  # the old values get no gradient through the fill
    assert leaf.grad.tolist() == [1.0, 1.0]
    with pytest.raises(RuntimeError, match="floating point"):
        fill(fw.tensor([1, 2]))


def test_comparisons_with_ties_scalars_and_ints():
    a = fw.tensor([1.0, 2.0, 3.0], requires_grad=True)
    b = fw.tensor([1.0, 0.0, 3.0])
    assert (a == b).tolist() == [True, False, True] and (a != b).tolist() == [False, True, False]
    assert (a <= b).tolist() == [True, False, True] and (a >= 2).tolist() == [False, True, True]
    assert (2 < a).tolist() == [False, False, True]  # reflected: 2 < a is a > 2
    assert (fw.tensor([1, 2]) == fw.tensor([1.0, 2.5])).tolist() == [True, False]
    for out in (a == b, a < 2, a.ge(b)):
        assert out.dtype == fw.bool and not out.requires_grad and out.grad_fn is None


# --- the optimizers' scaled add -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_add_scaled_is_in_place_and_rounds_as_the_two_ops(dtype, layout):
    from framework.backend import add_scaled_

    rng = np.random.default_rng(0)
    y = rng.standard_normal((64, 48)).astype(dtype)
    x = rng.standard_normal((64, 48)).astype(dtype)
    if layout == "transposed":  # not C-contiguous: the xp fallback
        y, x = y.T, x.T
    want = y + dtype(-0.1) * x  # the multiply rounded, then the add: no fused multiply-add
    address = y.__array_interface__["data"][0]
    add_scaled_(y, x, np.float64(-0.1))  # a float64 hyperparameter is taken in the parameter's dtype
    assert y.__array_interface__["data"][0] == address  # in place
    np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_add_scaled_gives_an_element_the_same_bits_wherever_it_lies(dtype):
    # BLAS axpy fuses the multiply-add in its vector loop but not in its tail, so an element
    # of a parameter updated alone and of the same parameter inside a flat buffer differed.
    from framework.backend import ADD_SCALED_BLOCK, add_scaled_

    rng = np.random.default_rng(2)
    n = 2 * ADD_SCALED_BLOCK + 37  # several blocks and a ragged end
    y, x = rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype)
    whole = y.copy()
    add_scaled_(whole, x, -0.37)
    for start, stop in ((0, n), (1, 40), (3, ADD_SCALED_BLOCK + 5), (ADD_SCALED_BLOCK - 7, n - 2)):
        part = y[start:stop].copy()
        add_scaled_(part, x[start:stop].copy(), -0.37)
        np.testing.assert_array_equal(part, whole[start:stop])


def test_add_scaled_op_in_place_and_out_of_place_give_the_same_bits():
    from framework.ops.elementwise import AddScaled

    rng = np.random.default_rng(1)
    p = fw.tensor(rng.standard_normal(1000).astype(np.float32))
    g = fw.tensor(rng.standard_normal(1000).astype(np.float32))
    out = AddScaled.apply(p, g, alpha=-0.1)
    assert out is not p and p._version == 0
    before = fw.memory.allocated_bytes()
    same = AddScaled.apply_(p, g, alpha=-0.1)
    assert same is p and p._version == 1 and fw.memory.allocated_bytes() == before
    np.testing.assert_array_equal(out.numpy(), p.numpy())
