"""fw.autocast against torch.autocast (PyTorch 2.13): the lists, the models op by op, the
cache, nesting, and the promise that no inplace policy changes a number under autocast.

- The lists: every PyTorch name :data:`framework.ops.autocast.POLICIES` gives a policy is
  one torch's dispatcher has an ``AutocastCPU`` / ``AutocastCUDA`` kernel for, and every op
  of this framework that no list names has none there (:data:`TORCH_NAMES` maps each op
  class to the PyTorch op it is).
- The GPT and ResNet-20 forward under ``autocast("cpu", bfloat16)``: each op's output
  dtype equals the same op's in the PyTorch twin (``benchmarks/gpt_torch.py``,
  ``benchmarks.bench_models.torch_model``), recorded op by op on both sides.
- The CUDA list on the GPU leg (the CuPy stand-in in CI): each listed op's output dtype.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import framework as fw
import framework.nn.functional as F
from framework import ops as fw_ops
from framework.autograd import function as fn_module
from framework.ops import autocast as ac
from framework.ops import conv, dropout, elementwise, embedding, gelu, masking, norm, reduce
from framework.testing import to_numpy
from models import GPT, build_model

#: Each op class of the framework and the PyTorch op it is (for ops in OPS, their names
#: there); the list check below covers all of them.
TORCH_NAMES = {
    **{cls: names for cls, names in ac.OPS.items()},
    reduce.Mean: ("mean",),
    reduce.Var: ("var",),
    reduce.Amax: ("amax",),
    elementwise.Add: ("add",),
    elementwise.Sub: ("sub",),
    elementwise.Mul: ("mul",),
    elementwise.Div: ("div",),
    elementwise.Sqrt: ("sqrt",),
    elementwise.Tanh: ("tanh",),
    elementwise.Sigmoid: ("sigmoid",),
    elementwise.Relu: ("relu",),
    elementwise.LeakyRelu: ("leaky_relu",),
    elementwise.Where: ("where",),
    elementwise.Maximum: ("maximum",),
    gelu.Gelu: ("gelu",),
    embedding.Embedding: ("embedding",),
    dropout.Dropout: ("dropout",),
    masking.MaskedFill: ("masked_fill",),
    norm.BatchNorm: ("batch_norm",),
    norm.BatchNormEval: ("batch_norm",),
    conv.MaxPool2d: ("max_pool2d",),
    conv.AvgPool2d: ("avg_pool2d",),
    conv.AdaptiveAvgPool2dSeparable: ("adaptive_avg_pool2d",),
}


def _registered(torch, name: str, key: str) -> bool:
    """Whether torch has an autocast kernel (``key``) for any overload of ``aten::name``."""
    packet = getattr(torch.ops.aten, name)
    for overload in packet.overloads():
        full = f"aten::{name}" + ("" if overload == "default" else f".{overload}")
        try:
            if torch._C._dispatch_has_kernel_for_dispatch_key(full, key):
                return True
        except RuntimeError:  # an overload of Python's (sum.int): no dispatcher entry
            continue
    return False


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_lists_are_torchs(device, torch):
    key = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}[device]
    listed = ac.POLICIES[device]
    for name in listed:
        assert _registered(torch, name, key), f"{name}: torch 2.13 has no {key} kernel"
    table = ac._TABLES[device]
    for cls, names in TORCH_NAMES.items():
        torch_has = [n for n in names if _registered(torch, n, key)]
        if cls in table:
            assert torch_has, f"{cls.__name__} is cast on {device}, but torch lists none of {names}"
            assert listed[torch_has[0]] == table[cls]
        else:
            assert not torch_has, f"{cls.__name__} ({names}) is on torch's {device} list, not on ours"


# --- the models, op by op ------------------------------------------------------------------

# Shape ops (the same dtype in, the same out) and what either side runs only sometimes
# (PyTorch's dropout at p=0; this framework's running-statistic updates) are left out.
_OURS_SKIPPED = {"Cast", "GetItem", "View", "Permute", "Split", "Clone", "Expand", "ReshapeCopy", "RunningStatUpdate"}
_THEIRS_SKIPPED = {"__get__", "arange", "split", "view", "transpose", "size", "contiguous", "__getitem__", "dropout"}
_THEIRS_SKIPPED |= {"flatten", "dim"}
_NAMES = {  # PyTorch's function names -> this framework's op classes
    "add": "Add",
    "add_": "Add",  # the twin's residual `out += identity`
    "embedding": "Embedding",
    "layer_norm": "LayerNorm",
    "linear": "Linear",
    "matmul": "Matmul",
    "mul": "Mul",
    "__eq__": "Equal",
    "masked_fill": "MaskedFill",
    "softmax": "Softmax",
    "gelu": "Gelu",
    "cross_entropy": "CrossEntropy",
    "scaled_dot_product_attention": "ScaledDotProductAttention",
    "conv2d": "Conv2d",
    "batch_norm": "BatchNorm",
    "relu": "Relu",
    "adaptive_avg_pool2d": "AvgPool2d",  # output 1x1 of an 8x8 map: one window
    "pad": "Cat",  # option A's zero channels: F.pad in the twin, cat with zeros here
}


def _record_ours(monkeypatch) -> list:
    """Each op's (class name, output dtype), in call order; a bfloat16 ``mul``/``div`` by a
    number (computed in float32 and rounded once, :func:`framework.ops._opmath`) as one op."""
    log, inside = [], []
    apply, opmath = fn_module._apply, fw_ops._opmath

    def spy(cls, inputs, params, inplace):
        out = apply(cls, inputs, params, inplace)
        if not inside:
            log.append((cls.__name__, out._data.dtype.name))
        return out

    def spy_opmath(op, *args, **params):
        inside.append(op)
        try:
            out = opmath(op, *args, **params)
        finally:
            inside.pop()
        log.append((op.__name__, out._data.dtype.name))
        return out

    monkeypatch.setattr(fn_module, "_apply", spy)
    monkeypatch.setattr(fw_ops, "_opmath", spy_opmath)
    return log


def _record_theirs(torch):
    from torch.overrides import TorchFunctionMode  # noqa: PLC0415

    class Recorder(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.log = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                self.log.append((getattr(func, "__name__", str(func)), str(out.dtype).replace("torch.", "")))
            return out

    return Recorder()


def _compared(ours, theirs):
    """Both logs without shape ops and integer results (BatchNorm's ``num_batches_tracked += 1``)."""
    mine = [(name, dt) for name, dt in ours if name not in _OURS_SKIPPED and dt != "int64"]
    twin = [(_NAMES.get(name, name), dt) for name, dt in theirs if name not in _THEIRS_SKIPPED and dt != "int64"]
    return mine, twin


@pytest.mark.parametrize("attention", ["math", "fused"])
def test_gpt_forward_op_by_op_as_torch_autocast(attention, torch, monkeypatch):
    from benchmarks import gpt_torch  # noqa: PLC0415

    fw.manual_seed(0)
    model = GPT(vocab_size=29, block_size=16, n_layer=2, n_head=2, n_embd=16, attention=attention)
    twin = gpt_torch.from_ours(model, dtype=torch.float32)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 29, (2, 16)), rng.integers(0, 29, (2, 16))
    recorder = _record_theirs(torch)
    with torch.autocast("cpu", dtype=torch.bfloat16), recorder:
        tlogits, tloss = twin(torch.from_numpy(x), torch.from_numpy(y))
    log = _record_ours(monkeypatch)
    with fw.autocast("cpu", dtype=fw.bfloat16):
        logits, loss = model(fw.tensor(x), fw.tensor(y))
    monkeypatch.undo()
    mine, twin_log = _compared(log, recorder.log)
    assert len(mine) > 20
    assert mine == twin_log
    assert logits.dtype == fw.bfloat16 and loss.dtype == fw.float32
    # the values too, as far as bfloat16 rounds alike (PyTorch rounds a linear layer's
    # product and bias once, this framework twice)
    assert loss.item() == pytest.approx(tloss.item(), abs=2e-2)
    want = tlogits.detach().float().numpy()
    assert np.abs(logits.detach().float().numpy() - want).max() <= 3e-2 * np.abs(want).max()
    loss.backward()
    assert {p.grad.dtype for p in model.parameters()} == {np.dtype(np.float32)}


def test_resnet20_forward_op_by_op_as_torch_autocast(torch, monkeypatch):
    from benchmarks.bench_models import torch_model  # noqa: PLC0415

    twin = torch_model("resnet20")
    model = build_model("resnet20", norm="bn")
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    y = np.array([1, 7])
    recorder = _record_theirs(torch)
    with torch.autocast("cpu", dtype=torch.bfloat16), recorder:
        torch.nn.functional.cross_entropy(twin(torch.from_numpy(x)), torch.from_numpy(y))
    log = _record_ours(monkeypatch)
    with fw.autocast("cpu", dtype=fw.bfloat16):
        out = F.cross_entropy(model(fw.tensor(x)), fw.tensor(y))
    monkeypatch.undo()
    mine, twin_log = _compared(log, recorder.log)
    assert len(mine) > 60
    assert mine == twin_log
    assert out.dtype == fw.float32
    out.backward()
    assert {p.grad.dtype for p in model.parameters()} == {np.dtype(np.float32)}


# --- the promise: no inplace policy changes a number under autocast ---------------------------


def _train_steps(make, batch, policy, steps=2):
    """Losses and final parameters of ``steps`` SGD steps under autocast and ``policy``."""
    fw.inplace.set_policy(policy)
    fw.manual_seed(0)
    model = make()
    opt = fw.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with fw.autocast("cpu"):
            loss = batch(model)
        loss.backward()
        grads = [to_numpy(p.grad).copy() for p in model.parameters()]
        opt.step()
        losses.append(loss.item())
    return losses, grads, [to_numpy(p).copy() for p in model.parameters()]


_IMAGES = np.random.default_rng(1).standard_normal((4, 3, 16, 16)).astype(np.float32)
_TOKENS = np.random.default_rng(2).integers(0, 29, (2, 2, 16))


@pytest.mark.parametrize(
    "name",
    ["resnet8", "resnet8_abn", "gpt_math", "gpt_fused"],
)
def test_every_inplace_policy_gives_the_same_numbers_under_autocast(name):
    if name.startswith("resnet"):
        norm_kind = "inplace_abn" if name.endswith("abn") else "bn"

        def make():
            return build_model("resnet8", norm=norm_kind, width=8)

        def batch(m):
            return F.cross_entropy(m(fw.tensor(_IMAGES)), fw.tensor(np.array([0, 1, 2, 3])))
    else:

        def make():
            return GPT(vocab_size=29, block_size=16, n_layer=1, n_head=2, n_embd=32, dropout=0.1, attention=name[4:])

        def batch(m):
            return m(fw.tensor(_TOKENS[0]), fw.tensor(_TOKENS[1]))[1]

    ref = _train_steps(make, batch, "off")
    before = fw.inplace.set_auto_min_bytes(0)  # auto tries every tensor, however small
    try:
        for policy in ("auto", "on"):
            fw.memory.reset_stats()
            got = _train_steps(make, batch, policy)
            ran = fw.memory.stats()
            assert ran.get("auto_inplace_ops" if policy == "auto" else "inplace_ops", 0) > 0, policy
            assert got[0] == ref[0], policy
            for a, b in zip(got[1] + got[2], ref[1] + ref[2]):
                np.testing.assert_array_equal(a, b, err_msg=policy)
    finally:
        fw.inplace.set_auto_min_bytes(before)


# --- the region: cache, nesting, decorator, dtypes ----------------------------------------------


def _cast_node(out):
    """The Cast node that fed the weight into a linear layer's output ``out``."""
    return out.grad_fn.next[1]


def test_casts_of_a_parameter_are_cached_within_a_region_as_torch(torch):
    w = fw.randn(4, 4, requires_grad=True)
    x = fw.randn(2, 4)
    with fw.autocast("cpu"):
        a, b = F.linear(x, w), F.linear(x, w)
        assert _cast_node(a) is _cast_node(b)
        with fw.no_grad():  # a cast made without grad is not cached (torch 2.13 neither)
            F.linear(x, w)
        c = F.linear(x, w)
        assert _cast_node(c) is _cast_node(a)
        with fw.autocast("cpu", enabled=False):
            assert F.linear(x, w).dtype == fw.float32
        assert _cast_node(F.linear(x, w)) is _cast_node(a)  # an inner region keeps the cache
    with fw.autocast("cpu"):
        assert _cast_node(F.linear(x, w)) is not _cast_node(a)  # the outermost exit cleared it
    with fw.autocast("cpu", cache_enabled=False):
        assert _cast_node(F.linear(x, w)) is not _cast_node(F.linear(x, w))
    with fw.autocast("cpu"):  # no cache for tensors that are not leaves requiring grad
        h = w * 1.0
        assert _cast_node(F.linear(x, h)) is not _cast_node(F.linear(x, h))
    # torch: the same (its ToCopyBackward0 node is shared exactly where ours is)
    tw, tx = torch.randn(4, 4, requires_grad=True), torch.randn(2, 4)

    def tcast(out):
        return out.grad_fn.next_functions[1][0].next_functions[0][0]

    with torch.autocast("cpu"):
        ta = torch.nn.functional.linear(tx, tw)
        assert tcast(ta) is tcast(torch.nn.functional.linear(tx, tw))
        with torch.no_grad():
            torch.nn.functional.linear(tx, tw)
        assert tcast(torch.nn.functional.linear(tx, tw)) is tcast(ta)
        th = tw * 1.0
        assert tcast(torch.nn.functional.linear(tx, th)) is not tcast(torch.nn.functional.linear(tx, th))
    with torch.autocast("cpu"):
        assert tcast(torch.nn.functional.linear(tx, tw)) is not tcast(ta)


def test_state_nesting_and_the_decorator():
    assert not fw.is_autocast_enabled("cpu") and fw.get_autocast_dtype("cpu") == fw.bfloat16
    assert fw.get_autocast_dtype("cuda") == fw.float16 and not fw.is_autocast_enabled()
    x, w = fw.randn(2, 4), fw.randn(3, 4)

    @fw.autocast("cpu", dtype=fw.float16)
    def f():
        assert fw.is_autocast_enabled("cpu") and fw.get_autocast_dtype("cpu") == fw.float16
        with fw.autocast("cpu"):  # the dtype defaults to the enclosing region's
            assert F.linear(x, w).dtype == fw.float16
        with fw.autocast("cpu", dtype=fw.bfloat16):
            inner = F.linear(x, w).dtype
        return F.linear(x, w).dtype, inner

    assert f() == (fw.float16, fw.bfloat16)
    assert not fw.is_autocast_enabled("cpu") and fw.get_autocast_dtype("cpu") == fw.bfloat16
    assert fn_module.autocast is None  # no cost outside a region
    with fw.autocast("cuda"):  # CUDA's region leaves the CPU's tensors alone
        assert F.linear(x, w).dtype == fw.float32
    with pytest.raises(RuntimeError, match="unsupported autocast device_type 'tpu'"):
        fw.autocast("tpu")


def test_what_autocast_leaves_alone():
    x64, w64 = fw.randn(2, 4, dtype=fw.float64), fw.randn(3, 4, dtype=fw.float64)
    x, w = fw.randn(2, 4), fw.randn(3, 4, requires_grad=True)
    with fw.autocast("cpu"):
        assert F.linear(x64, w64).dtype == fw.float64  # float64 is never cast
        assert fw.matmul(x, w.t()).dtype == fw.bfloat16
        assert (x + x).dtype == fw.float32 and fw.exp(x).dtype == fw.float32  # not on the CPU list
        assert fw.cat([x.to(fw.bfloat16), x]).dtype == fw.float32  # promote
        assert fw.cat([x.to(fw.bfloat16), x.to(fw.bfloat16)]).dtype == fw.bfloat16
        y = fw.randn(2, 4)
        y.relu_()  # inplace ops are not cast
        assert F.mse_loss(x.to(fw.bfloat16), x).dtype == fw.float32  # fp32 list: both inputs cast
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fw.autocast("cpu", dtype=fw.float64):  # as torch: a warning, and the region is off
            assert not fw.is_autocast_enabled("cpu")
    assert "not supported" in str(caught[0].message)


# --- the CUDA list, on the GPU leg ------------------------------------------------------------

_H = fw.float16


def _cuda_case(name):
    dev = "cuda"

    def t(*shape, dtype=fw.float32):
        return fw.randn(*shape, device=dev).to(dtype)

    cases = {
        "linear": (lambda: F.linear(t(2, 4), t(3, 4), t(3)), _H),
        "matmul": (lambda: t(2, 4) @ t(4, 3), _H),
        "conv2d": (lambda: F.conv2d(t(1, 2, 5, 5), t(3, 2, 3, 3)), _H),
        "sdpa": (lambda: F.scaled_dot_product_attention(t(1, 2, 4, 8), t(1, 2, 4, 8), t(1, 2, 4, 8)), _H),
        "layer_norm": (lambda: F.layer_norm(t(2, 6, dtype=_H), (6,), t(6), t(6)), fw.float32),
        "softmax": (lambda: F.softmax(t(2, 6, dtype=_H), dim=-1), fw.float32),
        "log_softmax": (lambda: F.log_softmax(t(2, 6, dtype=_H), dim=-1), fw.float32),
        "sum": (lambda: t(2, 6, dtype=_H).sum(), fw.float32),
        "exp": (lambda: fw.exp(t(3, dtype=_H)), fw.float32),
        "log": (lambda: fw.log(t(3, dtype=_H).abs()), fw.float32),
        "pow": (lambda: t(3, dtype=_H) ** 2, fw.float32),
        "cross_entropy": (
            lambda: F.cross_entropy(t(4, 5, dtype=_H), fw.tensor(np.array([0, 1, 2, 3]), device=dev)),
            fw.float32,
        ),
        "mse_loss": (lambda: F.mse_loss(t(4, dtype=_H), t(4)), fw.float32),
        "gelu (none)": (lambda: F.gelu(t(4, dtype=_H)), _H),
        "batch_norm (none)": (
            lambda: F.batch_norm(t(2, 3, 4, 4, dtype=_H), None, None, t(3), t(3), training=True),
            _H,
        ),
        "mean (none)": (lambda: t(2, 6, dtype=_H).mean(), _H),
        "add (none)": (lambda: t(2, dtype=_H) + t(2), fw.float32),
    }
    return cases[name]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name",
    [
        "linear",
        "matmul",
        "conv2d",
        "sdpa",
        "layer_norm",
        "softmax",
        "log_softmax",
        "sum",
        "exp",
        "log",
        "pow",
        "cross_entropy",
        "mse_loss",
        "gelu (none)",
        "batch_norm (none)",
        "mean (none)",
        "add (none)",
    ],
)
def test_the_cuda_list_on_the_gpu_leg(name):
    """PyTorch's CUDA list (docs: "CUDA Ops that can autocast to float16", "... to float32";
    autocast_mode.h), float16: each op's output dtype (the list itself is held to torch's
    dispatcher above)."""
    run, want = _cuda_case(name)
    with fw.autocast("cuda"):
        out = run()
    assert out.dtype == want and out.device.type == "cuda"


def test_lists_name_only_ops_the_framework_has():
    for device, lists in ac.POLICIES.items():
        named = {n for names in ac.OPS.values() for n in names}
        assert set(lists) <= named, device
