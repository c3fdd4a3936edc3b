"""The Transformer ops through the op harness: gelu (exact and tanh), masked_fill (and
masked_fill_), tril/triu (and their inplace forms), embedding, layer_norm (standard and
memory-efficient) and scaled_dot_product_attention (plain, causal, bool and float masks).

Each spec is checked on the CPU and the gpu leg: forward in float32 against a float64
NumPy reference, gradients and second derivatives in float64 against finite
differences, the inplace form against the ordinary one and its memory cost, the launch
budget on the CuPy stand-in. Hand-written tests below cover what a table cannot: dropout
inside attention, error messages, torch's signatures, the padding row, what is saved.
"""

from __future__ import annotations

import inspect
import math

import ml_dtypes
import numpy as np
import pytest
from scipy.special import erf

import framework as fw
import framework.nn.functional as F
from framework import memory
from framework.ops import kernels_transformer as KT
from framework.testing import assert_close, gradcheck, gradgradcheck

from . import harness
from .harness import UNARY, Budget, OpSpec

# --- references (float64 NumPy) ---------------------------------------------------------------------


def _gelu(a):
    return 0.5 * a * (1 + erf(a / math.sqrt(2)))


def _gelu_tanh(a):
    return 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3)))


def _mask(shape):
    """A fixed boolean pattern of ``shape`` (every third element True)."""
    n = int(np.prod(shape))
    return (np.arange(n) % 3 == 0).reshape(shape)


_CONSTANTS: dict = {}


def _on(x, a):
    """``a`` as a tensor on ``x``'s device, made once per device (so that an op's memory
    and launches are measured without the constant's copy to the device)."""
    key = (a.tobytes(), a.shape, a.dtype.str, str(x.device))
    t = _CONSTANTS.get(key)
    if t is None:
        t = _CONSTANTS[key] = fw.tensor(a, device=x.device)
    return t


IDX = np.array([[0, 2, 1], [2, 2, 3]])  # repeated indices: the gradient adds up


def _layer_norm_ref(k):
    def ref(x, w=None, b=None):
        axes = tuple(range(x.ndim - k, x.ndim))
        mean = x.mean(axis=axes, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
        y = (x - mean) / np.sqrt(var + 1e-5)
        return y * (1 if w is None else w) + (0 if b is None else b)

    return ref


def _attention_ref(mask=None, causal=False, scale=None):
    def ref(q, k, v, m=None):
        m = mask if m is None else m
        s = q @ np.swapaxes(k, -1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
        if causal:
            s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
        if m is not None:
            s = np.where(m, s, -np.inf) if m.dtype == bool else s + m
        p = np.exp(s - s.max(-1, keepdims=True))
        return (p / p.sum(-1, keepdims=True)) @ v

    return ref


LN_CASES = [((2, 3, 4), (4,), (4,)), ((3, 4), (4,), (4,)), ((2, 3, 4), (3, 4), (3, 4))]
LN_DOMAIN = ((-2.0, 2.0), (0.5, 1.5), (-1.0, 1.0))  # weights away from 0 (the memory-efficient mode divides by them)
ATTN_CASES = [((2, 3, 4), (2, 5, 4), (2, 5, 3)), ((1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3, 2))]
# Launch budgets (the backward ones include the harness's loss: 2 launches): contiguous inputs
# show the op's own cost; a transposed or strided input pays for its gradient's way back into
# its storage (and, for attention, CuPy's copies: cuDNN's matmul takes row- or column-major
# matrices only), so those layouts get specs of their own.
CONTIGUOUS, OTHER_LAYOUTS = ("contiguous",), ("transposed", "strided")
# attention: the scores, the row kernel, the output; backward: eight launches (forward is checked
# in float32: each of its two products three launches more, made in float64 on the cuDNN matmul)
ATTN_BUDGET = Budget(forward=3 + 2 * 3, backward=10)
ATTN_LAYOUT_BUDGET = Budget(forward=7 + 2 * 3, backward=22)
BOOL_MASK = np.array([[1, 0, 1, 1, 0], [1, 1, 0, 1, 1], [0, 1, 1, 1, 1]], bool)  # (L=3, S=5)


def _ln(k, me=False, affine=True):
    if affine:
        return lambda x, w, b: F.layer_norm(x, x.shape[x.ndim - k :], w, b, memory_efficient=me)
    return lambda x: F.layer_norm(x, x.shape[x.ndim - k :], memory_efficient=me)


SPECS = [
    OpSpec("gelu", F.gelu, _gelu, UNARY, budget=Budget(1, 5)),
    OpSpec("gelu(tanh)", lambda x: F.gelu(x, approximate="tanh"), _gelu_tanh, UNARY, budget=Budget(1, 5)),
    OpSpec(
        "masked_fill",
        lambda x: x.masked_fill(_on(x, _mask(x.shape)), -1.5),
        lambda a: np.where(_mask(a.shape), -1.5, a),
        UNARY,
        inplace=lambda x: x.masked_fill_(_on(x, _mask(x.shape)), -1.5),
        memory="free",
        budget=Budget(1, 5),
    ),
    OpSpec(
        "masked_fill(broadcast mask)",
        lambda x: fw.masked_fill(x, _on(x, _mask(x.shape[-1:])), 2.0),
        lambda a: np.where(_mask(a.shape[-1:]), 2.0, a),
        [((5,),), ((2, 3),), ((2, 3, 4),)],
        inplace=lambda x: x.masked_fill_(_on(x, _mask(x.shape[-1:])), 2.0),
        memory="free",
        budget=Budget(1, 5),
    ),
    OpSpec(
        "masked_fill(tensor value)",
        lambda x, v: x.masked_fill(_on(x, _mask(x.shape)), v),
        lambda a, v: np.where(_mask(a.shape), v, a),
        [((2, 3), ()), ((2, 3, 4), ())],
        inplace=lambda x, v: x.masked_fill_(_on(x, _mask(x.shape)), v),
        memory="free",
        budget=Budget(1, 7),  # + the value's gradient: a where and a sum
    ),
    OpSpec(
        "tril",
        lambda x: x.tril(),
        lambda a: np.tril(a),
        [((3, 4),), ((2, 3, 4),), ((4, 3),)],
        inplace=lambda x: x.tril_(),
        memory="free",
        budget=Budget(1, 5),
    ),
    OpSpec(
        "triu(1)",
        lambda x: fw.triu(x, 1),
        lambda a: np.triu(a, 1),
        [((3, 4),), ((2, 3, 4),)],
        inplace=lambda x: x.triu_(1),
        memory="free",
        budget=Budget(1, 5),
    ),
    OpSpec(
        "tril(-1)",
        lambda x: fw.tril(x, -1),
        lambda a: np.tril(a, -1),
        [((3, 4),)],
        inplace=lambda x: x.tril_(-1),
        memory="free",
        budget=Budget(1, 5),
    ),
    OpSpec(
        "embedding",
        lambda w: F.embedding(_on(w, IDX), w),
        lambda w: w[IDX],
        [((4, 3),), ((5, 2),)],
        budget=Budget(2, 6),  # the deferred index check and the gather; zeros and the scatter-add
    ),
    OpSpec("layer_norm", _ln(1), _layer_norm_ref(1), LN_CASES[:2], domain=LN_DOMAIN, budget=Budget(2, 11)),
    OpSpec("layer_norm(2 dims)", _ln(2), _layer_norm_ref(2), LN_CASES[2:], domain=LN_DOMAIN, budget=Budget(2, 11)),
    OpSpec(
        "layer_norm(memory_efficient)",
        _ln(1, me=True),
        _layer_norm_ref(1),
        LN_CASES[:2],
        domain=LN_DOMAIN,
        budget=Budget(2, 11),
    ),
    OpSpec(
        "layer_norm(memory_efficient, 2 dims)",
        _ln(2, me=True),
        _layer_norm_ref(2),
        LN_CASES[2:],
        domain=LN_DOMAIN,
        budget=Budget(2, 11),
    ),
    OpSpec(
        "layer_norm(no affine)",
        _ln(1, affine=False),
        _layer_norm_ref(1),
        [((2, 3, 4),), ((5,),)],
        budget=Budget(2, 6),
    ),
    OpSpec(
        "layer_norm(memory_efficient, no affine)",
        _ln(1, me=True, affine=False),
        _layer_norm_ref(1),
        [((2, 3, 4),)],
        budget=Budget(2, 6),
    ),
]
for _layouts, _budget, _extra in ((CONTIGUOUS, ATTN_BUDGET, 0), (OTHER_LAYOUTS, ATTN_LAYOUT_BUDGET, 1)):
    _tag = "" if _extra == 0 else ", layouts"
    SPECS += [
        OpSpec(
            f"sdpa{_tag}",
            F.scaled_dot_product_attention,
            _attention_ref(),
            ATTN_CASES,
            layouts=_layouts,
            budget=_budget,
        ),
        OpSpec(
            f"sdpa(is_causal{_tag})",
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            _attention_ref(causal=True),
            ATTN_CASES,
            layouts=_layouts,
            budget=_budget,
        ),
        OpSpec(  # + the mask's inversion and the fill
            f"sdpa(scale=0.3, bool mask{_tag})",
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=_on(q, BOOL_MASK), scale=0.3),
            _attention_ref(mask=BOOL_MASK, scale=0.3),
            ATTN_CASES[:1],
            layouts=_layouts,
            budget=Budget(_budget.forward + 2, _budget.backward + 2),
        ),
        OpSpec(  # + the scale and the mask's add; the mask's gradient
            f"sdpa(float mask{_tag})",
            lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
            _attention_ref(),
            [((2, 3, 4), (2, 5, 4), (2, 5, 3), (3, 5)), ((2, 3, 4), (2, 5, 4), (2, 5, 3), (2, 3, 5))],
            layouts=_layouts,
            budget=Budget(_budget.forward + 2, _budget.backward + 6),
        ),
    ]


def _make_constants(case, device):
    """The specs' masks and indices, made on the device before anything is counted."""
    case.spec.fn(*case.views(case.storages(np.float32, requires_grad=False, device=device)))


@pytest.mark.parametrize("case", harness.cases(SPECS))
def test_forward(case, backend):
    _make_constants(case, backend)
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
    _make_constants(case, backend)
    harness.check_inplace_memory(case, backend)


# --- torch's names ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (F.gelu, "gelu"),
        (F.embedding, "embedding"),
        (F.layer_norm, "layer_norm"),
        (F.scaled_dot_product_attention, "scaled_dot_product_attention"),
    ],
)
def test_functional_signatures_are_torch_s(ours, theirs, torch):
    want = getattr(torch.nn.functional, theirs)
    try:
        names = list(inspect.signature(want).parameters)
    except ValueError:  # a builtin without a signature: its documented one
        names = {
            "gelu": ["input", "approximate"],
            "scaled_dot_product_attention": [
                "query",
                "key",
                "value",
                "attn_mask",
                "dropout_p",
                "is_causal",
                "scale",
                "enable_gqa",
            ],
        }[theirs]
    got = list(inspect.signature(ours).parameters)
    assert got[: len(names)] == names
    assert got[len(names) :] in ([], ["memory_efficient"])  # Apex's mode, our one addition


def test_module_signatures_are_torch_s(torch):
    for ours, theirs in ((fw.nn.Embedding, torch.nn.Embedding), (fw.nn.LayerNorm, torch.nn.LayerNorm)):
        want = list(inspect.signature(theirs).parameters)
        got = list(inspect.signature(ours).parameters)
        assert got[: len(want)] == want
    assert list(inspect.signature(fw.nn.GELU).parameters) == list(inspect.signature(torch.nn.GELU).parameters)


# --- dropout inside attention ----------------------------------------------------------------------------


def _qkv(shape=(2, 2, 6, 4), device="cpu", dtype=np.float64, requires_grad=True, seed=0):
    rng = np.random.default_rng(seed)
    return [
        fw.tensor(rng.standard_normal(shape), dtype=dtype, device=device, requires_grad=requires_grad) for _ in range(3)
    ]


@pytest.mark.parametrize("causal", [False, True])
def test_attention_dropout_is_a_regenerated_mask(causal, backend):
    """Forward drops whole probabilities with the keep mask of the kept draw; backward
    regenerates exactly that mask (gradients against finite differences at a fixed seed)."""
    q, k, v = _qkv(device=backend)
    p = 0.3

    def fn(q, k, v):
        fw.manual_seed(7)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)

    out = fn(q, k, v)
    useed = fw.testing.to_numpy(out.grad_fn.__dict__["_saved"]["useed"].array)
    keep = KT.keep_mask(useed, (2, 2, 6, 6), p)
    qn, kn, vn = (fw.testing.to_numpy(t.detach()) for t in (q, k, v))
    s = qn @ np.swapaxes(kn, -1, -2) / 2.0
    if causal:
        s = np.where(np.tril(np.ones((6, 6), bool)), s, -np.inf)
    probs = np.exp(s - s.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.where(keep, probs, 0) / (1 - p) @ vn
    assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert 0.5 < keep.mean() < 0.9
    assert gradcheck(fn, [q, k, v])
    assert gradgradcheck(fn, [q, k, v])


def test_attention_dropout_on_the_gpu_matches_the_cpu_for_the_same_draw(cupy):
    """The kernels' hash and the CPU's give the same mask for the same draw: the GPU's
    output and gradients equal the CPU's when the CPU is handed the GPU's draw."""
    from framework.ops import attention as A

    q, k, v = _qkv(device="cuda")
    fw.manual_seed(3)
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.4, is_causal=True)
    draw = fw.testing.to_numpy(out.grad_fn.__dict__["_saved"]["useed"].array)
    g = fw.tensor(np.random.default_rng(5).standard_normal(out.shape), device="cuda")
    gpu = fw.autograd.grad(out, (q, k, v), g)
    qc, kc, vc = _qkv(device="cpu")

    class Fixed:
        def random(self, size, dtype):
            return draw.astype(dtype).reshape(size)

    orig = A._random.generator
    A._random.generator = lambda xp: Fixed()
    try:
        cpu_out = F.scaled_dot_product_attention(qc, kc, vc, dropout_p=0.4, is_causal=True)
    finally:
        A._random.generator = orig
    assert_close(out, fw.testing.to_numpy(cpu_out.detach()), rtol=1e-10, atol=1e-12)
    cpu = fw.autograd.grad(cpu_out, (qc, kc, vc), fw.tensor(fw.testing.to_numpy(g)))
    for a, b in zip(gpu, cpu):
        assert_close(a, fw.testing.to_numpy(b), rtol=1e-9, atol=1e-11)


def test_attention_keeps_no_scores_for_backward():
    """What the node holds: q, k, v (one buffer here), the output, the log-sum-exp (and the
    draw): no (L, S) matrix, whatever the sequence length."""
    q, k, v = _qkv(shape=(1, 2, 64, 8), dtype=np.float32)
    before = memory.saved_bytes()
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
    held = memory.saved_bytes() - before
    io = 3 * q.nbytes  # q, k, v are leaves here (kept by reference: counted as saved tensors)
    lse = 2 * 64 * 4
    assert held == io + out.nbytes + lse + 8
    del out


def test_attention_output_is_laid_out_for_the_head_merge():
    q, k, v = _qkv(shape=(2, 3, 5, 4))
    out = F.scaled_dot_product_attention(q, k, v)
    merged = out.transpose(1, 2)
    assert merged.is_contiguous()  # the head merge is a view: no copy
    assert merged.contiguous() is merged


# --- errors --------------------------------------------------------------------------------------------


def test_attention_refuses_a_mask_with_is_causal():
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="Explicit attn_mask should not be set when is_causal=True"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=fw.ones(6, 6, dtype=fw.bool), is_causal=True)


def test_attention_refuses_mismatched_shapes_and_dtypes():
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="same dtype"):
        F.scaled_dot_product_attention(q, k.to(dtype=fw.float32), v)
    with pytest.raises(RuntimeError, match="must be"):
        F.scaled_dot_product_attention(q, k[..., :3], v)


def test_layer_norm_refuses_a_wrong_shape():
    with pytest.raises(RuntimeError, match=r"expected input with shape \[\*, 5\]"):
        F.layer_norm(fw.randn(2, 4), (5,))


def test_embedding_checks_its_indices_on_the_cpu():
    w = fw.randn(4, 3)
    with pytest.raises(IndexError, match=r"embedding: index 4 out of range in self: indices must be in \[0, 3\]"):
        F.embedding(fw.tensor(np.array([0, 4])), w)
    with pytest.raises(IndexError, match="index -1 out of range"):
        F.embedding(fw.tensor(np.array([[0, 1], [-1, 2]])), w)
    with pytest.raises(RuntimeError, match="scalar types: Long, Int"):
        F.embedding(fw.tensor(np.array([0.0, 1.0])), w)


def test_embedding_checks_its_indices_on_the_gpu_at_the_deferred_check(cupy):
    from framework.ops.loss import check_targets

    check_targets()
    w = fw.randn(4, 3, device="cuda")
    F.embedding(fw.tensor(np.array([0, 9]), device="cuda"), w)
    with pytest.raises(IndexError, match=r"embedding: index 9 out of range in self: indices must be in \[0, 3\]"):
        check_targets()


def test_masked_fill_refuses_a_non_bool_mask():
    x = fw.randn(2, 3)
    with pytest.raises(RuntimeError, match="only supports boolean masks"):
        x.masked_fill(fw.ones(2, 3), 0.0)


def test_gelu_refuses_an_unknown_approximation():
    with pytest.raises(RuntimeError, match="approximate argument must be either none or tanh"):
        F.gelu(fw.randn(3), approximate="fast")


# --- modules ---------------------------------------------------------------------------------------------


def test_embedding_module_initialises_as_torch_and_zeroes_the_padding_row():
    fw.manual_seed(0)
    e = fw.nn.Embedding(50, 8, padding_idx=3)
    w = e.weight.detach().numpy()
    assert np.all(w[3] == 0)
    assert abs(w.std() - 1) < 0.15 and abs(w.mean()) < 0.15
    out = e(fw.tensor(np.array([[3, 1], [1, 3]])))
    out.sum().backward()
    assert np.all(e.weight.grad.numpy()[3] == 0)
    assert np.all(e.weight.grad.numpy()[1] == 2)
    assert repr(e) == "Embedding(50, 8, padding_idx=3)"


def test_embedding_padding_row_gets_no_gradient_the_others_theirs(backend):
    rng = np.random.default_rng(0)
    w = fw.tensor(rng.standard_normal((4, 3)), device=backend, requires_grad=True)
    g = rng.standard_normal(IDX.shape + (3,))
    F.embedding(fw.tensor(IDX, device=backend), w, padding_idx=2).backward(fw.tensor(g, device=backend))
    want = np.zeros((4, 3))
    np.add.at(want, IDX, g)
    want[2] = 0
    assert_close(w.grad, want, rtol=1e-12, atol=1e-12)


def test_layer_norm_module_and_gelu_module():
    ln = fw.nn.LayerNorm(6, memory_efficient=True)
    assert np.all(ln.weight.detach().numpy() == 1) and np.all(ln.bias.detach().numpy() == 0)
    assert "memory_efficient=True" in repr(ln)
    assert fw.nn.LayerNorm(6, bias=False).bias is None
    assert fw.nn.LayerNorm((2, 3), elementwise_affine=False).weight is None
    assert repr(fw.nn.GELU("tanh")) == "GELU(approximate='tanh')"


def test_memory_efficient_layer_norm_keeps_the_output_not_the_input():
    x = fw.randn(8, 64, requires_grad=True) * 1  # a non-leaf: what a block's residual stream is
    ln = fw.nn.LayerNorm(64)
    with memory.category("activations"):
        pass
    before = memory.saved_bytes(parameters=False)
    y = ln(x)
    standard = memory.saved_bytes(parameters=False) - before
    del y
    ln.memory_efficient = True
    y = ln(x)
    efficient = memory.saved_bytes(parameters=False) - before
    # standard: x and two values per row; efficient: y (which a next linear keeps anyway) and one
    assert standard == x.nbytes + 2 * 8 * 4
    assert efficient == y.nbytes + 8 * 4
    lin = fw.nn.Linear(64, 4)
    z = lin(y)
    assert memory.saved_bytes(parameters=False) - before == y.nbytes + 8 * 4  # the same buffer
    del z


def test_multinomial_draws_by_weight_and_is_seeded():
    probs = fw.tensor(np.array([[0.0, 0.2, 0.8], [1.0, 0.0, 0.0]]))
    fw.manual_seed(0)
    a = fw.multinomial(probs, 2000, replacement=True).numpy()
    fw.manual_seed(0)
    b = fw.multinomial(probs, 2000, replacement=True).numpy()
    assert np.array_equal(a, b)
    assert set(a[0]) <= {1, 2} and abs((a[0] == 2).mean() - 0.8) < 0.05
    assert np.all(a[1] == 0)
    assert fw.multinomial(fw.tensor(np.array([0.0, 1.0])), 1).shape == (1,)


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_the_cpu_runs_attention_chunk_by_chunk_with_the_same_numbers(monkeypatch, dropout_p):
    """A few samples' scores at a time: the same output and gradients bit for bit; a block
    of one sample's rows at a time: the same to rounding (a one-row product rounds as BLAS's
    vector kernel does; dK and dV sum over the blocks), the dropout mask's counter continuing
    across chunks; and the scores of one chunk held at a time."""
    from framework.ops import attention as A

    def run():
        q, k, v = _qkv(shape=(4, 2, 16, 8), dtype=np.float32)
        fw.manual_seed(1)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        grads = fw.autograd.grad(out, (q, k, v), fw.ones(*out.shape))
        return [out.detach().numpy()] + [g.numpy() for g in grads]

    whole = run()
    monkeypatch.setattr(A, "CHUNK_SCORES_BYTES", 2 * 16 * 16 * 4)  # one sample per chunk
    for a, b in zip(whole, run()):
        np.testing.assert_array_equal(a, b)
    monkeypatch.setattr(A, "CHUNK_SCORES_BYTES", 1)  # one row of one sample per chunk
    for a, b in zip(whole, run()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(A, "CHUNK_SCORES_BYTES", 2 << 20)
    q, k, v = _qkv(shape=(2, 2, 512, 8), dtype=np.float32, requires_grad=False)
    memory.reset_peak()
    start = memory.allocated_bytes()
    F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    # the output, the log-sum-exp, and one chunk's scores and probabilities (2 MiB each): far
    # below the 4 MiB of the whole scores times the temporaries they would take
    assert memory.max_allocated_bytes() - start < q.nbytes + 2 * 2 * 512 * 4 + 3 * (2 << 20)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_layer_norm_backward_of_half_types_on_the_cpu_sums_in_float32(dtype):
    # Each gradient within one unit in the last place of its largest value of the float64
    # one (x's: 1.5, its x_hat is rebuilt from the half-precision input and statistics, as
    # PyTorch keeps them); summing the 64 rows in bfloat16 was 2.5 units off for the
    # weight's gradient, in float16 1.7. (The memory-efficient mode rebuilds x_hat as
    # (y - bias) / weight from the rounded output: where |weight| is small that is off by
    # more, whatever the sums; docs/TRANSFORMERS.md.)
    rng = np.random.default_rng(0)
    x, w, b = rng.standard_normal((64, 768)) * 3 + 1, rng.standard_normal(768), rng.standard_normal(768)
    g = rng.standard_normal((64, 768))

    def grads(dt):
        ts = [fw.tensor(a.astype(dt), requires_grad=True) for a in (x, w, b)]
        F.layer_norm(ts[0], (768,), ts[1], ts[2]).backward(fw.tensor(g.astype(dt)))
        return [t.grad.numpy().astype(np.float64) for t in ts]

    ulp = float(ml_dtypes.finfo(dtype).eps)
    for name, ours, ref, units in zip(("x", "weight", "bias"), grads(dtype), grads(np.float64), (1.5, 1, 1)):
        err = np.max(np.abs(ours - ref)) / np.max(np.abs(ref))
        assert err <= units * ulp, f"{name}: {err:.2e} > {units} x {ulp:.2e}"


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_layer_norm_create_graph_gives_the_same_first_order_gradients_in_half_types(dtype):
    rng = np.random.default_rng(1)
    x, w, b, g = (rng.standard_normal(s) for s in ((16, 96), (96,), (96,), (16, 96)))
    out = []
    for create_graph in (False, True):
        ts = [fw.tensor(a.astype(dtype), requires_grad=True) for a in (x, w, b)]
        y = F.layer_norm(ts[0], (96,), ts[1], ts[2])
        grads = fw.autograd.grad(y, ts, fw.tensor(g.astype(dtype)), create_graph=create_graph)
        out.append([t.detach().numpy().tobytes() for t in grads])
    assert out[0] == out[1]


def test_layer_norm_saves_its_bias_as_pytorch_does():
    # NativeLayerNormBackward0 saves the bias: freed by backward, and version-checked
    x = fw.randn(4, 8, requires_grad=True)
    b = fw.randn(8, requires_grad=True)
    y = F.layer_norm(x, (8,), None, b)
    assert y.grad_fn._saved_bias.shape == (8,) and F.layer_norm(x, (8,)).grad_fn._saved_bias is None
    y.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        _ = y.grad_fn._saved_bias
    y = F.layer_norm(x, (8,), None, b)
    with fw.no_grad():
        b.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
