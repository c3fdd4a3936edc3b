"""Policy ``auto``: an ordinary op runs in place only when its first input is provably dead.

Each scenario runs the same code under ``off`` and ``auto`` where it matters, and checks
both what auto did (``memory.stats()``) and that nobody could tell (values, gradients,
tensors the test still holds).
"""

from __future__ import annotations

import dis
import operator

import numpy as np
import pytest

import framework as fw
from framework import inplace, memory, nn
from framework.inplace import proof
from framework.nn import functional as F


@pytest.fixture(autouse=True)
def _auto():
    memory.reset_stats()
    prev = inplace.set_auto_min_bytes(0)  # the tensors here are tiny: prove every one
    try:
        with inplace.policy("auto"):
            yield
    finally:
        inplace.set_auto_min_bytes(prev)


def auto_ops(name: str | None = None) -> int:
    s = memory.stats()
    return s.get("auto_inplace_ops" + ("" if name is None else "." + name), 0)


def leaf(*shape):
    return fw.tensor(np.random.default_rng(0).standard_normal(shape).astype(np.float32), requires_grad=True)


# --- calibration --------------------------------------------------------------------------


def test_calibration_trusts_every_path_and_names_count_one_more():
    for key in [
        ("apply", "call"),
        ("apply", "binary"),
        ("apply", "module"),
        ("apply", "call_kw"),
        ("apply", "module_kw"),
        ("site", "call"),
        ("site", "module"),
        ("site", "call_kw"),
        ("site", "module_kw"),
    ]:
        assert key in proof._BASE, key
    assert proof.status == "" and proof.untrusted == [] and inplace.auto_status() == ""
    assert proof._REBIND_OK  # t = f(t) proven dead, u = t; t = f(t) not, end to end


def test_when_nothing_can_be_proved_auto_acts_as_off_and_warns_once(monkeypatch):
    def broken(**kwargs):
        monkeypatch.setattr(proof, "status", "no path could be trusted: test")

    monkeypatch.setattr(proof, "calibrate", broken)
    with pytest.warns(RuntimeWarning, match="act as under 'off'"):
        inplace.calibrate(
            Tensor=fw.Tensor,
            make=None,
            neg=None,
            add=None,
            relu=None,
            residual_add=None,
            site=None,
            op_module=None,
            module_call=None,
        )
    assert inplace.auto_status().startswith("no path")
    x = leaf(3)
    y = nn.ReLU()(x * 2)  # the site writes nothing
    z = (x * 2) + 1.0  # and no ordinary op is rewritten
    assert auto_ops() == 0 and y is not None and z is not None
    assert memory.stats().get("inplace_ops", 0) == 0


# --- what auto rewrites --------------------------------------------------------------------


def test_temporary_is_reused_and_result_matches_off():
    x = leaf(3, 4)
    y = (x * 2) + 1.0  # x * 2 is a temporary: the add writes into it
    assert auto_ops("Add") == 1 and memory.stats()["auto_inplace_bytes"] == 48
    with inplace.policy("off"):
        ref = (x * 2) + 1.0
    np.testing.assert_array_equal(y.detach().numpy(), ref.detach().numpy())
    y.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.full((3, 4), 2, np.float32))


@pytest.mark.parametrize(
    "make",
    [
        lambda t: fw.exp(t * 1.0),
        lambda t: (t * 1.0).tanh(),
        lambda t: F.relu(t * 1.0),
        lambda t: 3.0 * (t * 1.0),  # __rmul__
        lambda t: 1.0 + (t * 1.0),  # __radd__
        lambda t: fw.add(t * 1.0, 1.0, alpha=2),  # keyword arguments
    ],
)
def test_each_entry_path_reuses_a_temporary(make):
    x = leaf(5)
    with inplace.policy("off"):
        ref = make(x)
    before = auto_ops()
    y = make(x)
    assert auto_ops() == before + 1
    np.testing.assert_array_equal(y.detach().numpy(), ref.detach().numpy())


def test_under_no_grad_ops_that_save_their_input_are_rewritten_too():
    x = fw.tensor(np.linspace(0.1, 1, 6, dtype=np.float32))
    with fw.no_grad():
        y = fw.log(x * 1.0).sin()
    assert auto_ops("Log") == 1 and auto_ops("Sin") == 1
    np.testing.assert_allclose(y.detach().numpy(), np.sin(np.log(x.detach().numpy())), rtol=1e-6)


# --- where auto refuses, and why --------------------------------------------------------------


def test_a_named_tensor_is_never_overwritten():
    x = leaf(4)
    h = x * 2
    before = h.detach().numpy().copy()
    y = h + 1.0
    z = h.exp()
    w = fw.add(h, 1.0)
    assert auto_ops() == 0
    np.testing.assert_array_equal(h.detach().numpy(), before)
    assert y is not h and z is not h and w is not h


def test_leaf_that_requires_grad_and_leaf_used_by_the_user_are_refused():
    x = leaf(4)
    _ = fw.exp(leaf(4))  # a temporary leaf requiring grad: its .grad needs it
    y = x + 1.0
    assert auto_ops() == 0 and y is not x


def test_a_fresh_leaf_without_grad_is_reused():
    y = fw.zeros(3) + 1.0
    assert auto_ops("Add") == 1
    np.testing.assert_array_equal(y.detach().numpy(), np.ones(3, np.float32))


def test_saved_for_backward_is_refused():
    x = leaf(4)
    y = fw.exp(x * 1.0).relu()  # exp's backward reads its output: relu must not overwrite it
    assert auto_ops("Exp") == 1 and auto_ops("Relu") == 0
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), np.exp(x.detach().numpy()), rtol=1e-6)
    x.grad = None
    _ = (x * 1.0).sin()  # sin's backward reads its input
    assert auto_ops("Sin") == 0
    w = leaf(4)
    _ = (x * 1.0) * w  # mul saves x for w's gradient
    assert auto_ops("Mul") == 0


def test_views_and_shared_storage_are_refused():
    x = leaf(3, 4)
    _ = (x * 1.0).t() + 1.0  # the first input is a view: its base is alive
    arr = np.ones(4, np.float32)
    _ = fw.from_numpy(arr) + 1.0  # the array belongs to the caller too
    np.testing.assert_array_equal(arr, np.ones(4, np.float32))
    base = x * 1.0
    v = base[0]
    _ = fw.exp(base * 1.0)  # control: a different temporary is fine
    before = base.detach().numpy().copy()
    assert auto_ops("Exp") == 1 and auto_ops("Add") == 0
    del v
    np.testing.assert_array_equal(base.detach().numpy(), before)


def test_result_shape_or_dtype_different_from_the_input_is_refused():
    a = leaf(4)
    b = leaf(3, 4)
    y = (a * 1.0) + b  # broadcasts to (3, 4): the (4,) buffer is too small
    assert y.shape == (3, 4) and auto_ops("Add") == 0
    _ = fw.arange(4) + 1  # integers: only floating point buffers are reused
    assert auto_ops("Add") == 0


def test_held_in_a_container_or_called_through_c_is_refused():
    x = leaf(4)
    held = [x * 2]
    before = held[0].detach().numpy().copy()
    _ = held[0] + 1.0
    np.testing.assert_array_equal(held[0].detach().numpy(), before)
    assert auto_ops() == 0
    # C functions in between (map, sorted, reduce, starmap): whatever they hold, the
    # tensors the list holds are never written over
    import functools
    import itertools

    xs = [x * 2, x * 3]
    before = [t.detach().numpy().copy() for t in xs]
    for run in (
        lambda: list(map(operator.neg, xs)),
        lambda: list(map(fw.neg, xs)),
        lambda: list(map(nn.ReLU(), xs)),
        lambda: list(map(F.relu, xs)),
        lambda: list(map(F.residual_add, xs, [1.0, 1.0])),
        lambda: list(map(fw.Tensor.exp, xs)),
        lambda: list(itertools.starmap(operator.add, [(t, 1.0) for t in xs])),
        lambda: functools.reduce(operator.add, xs),
        lambda: sorted(xs, key=lambda t: 0),
    ):
        run()
        for t, b in zip(xs, before):
            np.testing.assert_array_equal(t.detach().numpy(), b)
    # a temporary handed to a C function that passes it on is dead either way: rewriting
    # it or not is the interpreter's business (3.10 keeps C calls' arguments like Python
    # calls' ones), but the result is the same
    with inplace.policy("off"):
        ref = operator.add(x * 2, 1.0)
    np.testing.assert_array_equal(operator.add(x * 2, 1.0).detach().numpy(), ref.detach().numpy())


def test_explicit_dunder_call_on_a_named_tensor_is_refused():
    x = leaf(4)
    h = x * 2
    before = h.detach().numpy().copy()
    _ = h.__add__(1.0)  # one reference fewer than a + b on the stack: still counted right
    np.testing.assert_array_equal(h.detach().numpy(), before)
    assert auto_ops() == 0


# --- modules ------------------------------------------------------------------------------------


def test_sequential_hands_each_output_over_and_matches_off():
    fw.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    x = fw.randn(5, 4)
    out = model(x)
    out.sum().backward()
    grads = [p.grad.numpy().copy() for p in model.parameters()]
    assert auto_ops("ReLU") == 1 and auto_ops("Tanh") == 1
    model.zero_grad()
    with inplace.policy("off"):
        ref = model(x)
        ref.sum().backward()
    np.testing.assert_array_equal(out.detach().numpy(), ref.detach().numpy())
    for g, p in zip(grads, model.parameters()):
        np.testing.assert_array_equal(g, p.grad.numpy())


def test_module_input_the_caller_names_is_refused():
    relu = nn.ReLU()
    x = leaf(4)
    h = x - 0.5
    before = h.detach().numpy().copy()
    _ = relu(h)
    np.testing.assert_array_equal(h.detach().numpy(), before)
    _ = relu(x - 0.5)
    assert auto_ops() == 1


def test_hooked_module_and_explicit_dunder_call_are_refused():
    relu = nn.ReLU()
    seen = []
    handle = relu.register_forward_hook(lambda m, args, out: seen.append(args[0].detach().numpy().copy()))
    x = leaf(4)
    _ = relu(x - 0.5)
    np.testing.assert_array_equal(seen[0], x.detach().numpy() - 0.5)  # the hook saw the untouched input
    handle.remove()
    _ = relu.__call__(x - 0.5)
    assert auto_ops() == 0


def test_residual_add_site_and_resnet_block():
    from models.resnet import BasicBlock

    fw.manual_seed(0)
    block = BasicBlock(4, 4)
    x = fw.randn(2, 4, 6, 6)
    y = block(x)
    # unit1's ReLU, the residual add, the final ReLU
    assert auto_ops("ReLU") == 2 and auto_ops("residual_add") == 1
    with inplace.policy("off"):
        ref = block(x)
    np.testing.assert_allclose(y.detach().numpy(), ref.detach().numpy(), rtol=0, atol=0)


def test_trainer_config_accepts_auto(tmp_path):
    from trainers.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("inplace: auto\n")
    assert load_config(path).inplace == "auto"


def test_the_examples_in_docs_inplace_md_do_what_they_say():
    x = leaf(3, 4)

    def rewritten(fn):
        memory.reset_stats()
        fn()
        return {k[len("auto_inplace_ops.") :] for k in memory.stats() if k.startswith("auto_inplace_ops.")}

    h = x * 2
    assert rewritten(lambda: (x * 2) + 1.0) == {"Add"}
    assert rewritten(lambda: h + 1.0) == set()
    assert rewritten(lambda: fw.exp(x * 2).relu()) == {"Exp"}
    assert rewritten(lambda: (x * 2).sin()) == set()
    assert rewritten(lambda: (x * 2).t() + 1.0) == set()
    assert rewritten(lambda: fw.randn(4) + x) == set()
    assert rewritten(lambda: nn.ReLU()(x * 2)) == {"ReLU"}
    bn, relu = nn.BatchNorm1d(4), nn.ReLU()

    def rebound():
        out = bn(x * 1.0)
        out = relu(out)
        return out

    def kept():
        out = bn(x * 1.0)
        y = relu(out)
        return y, out

    assert rewritten(rebound) == {"ReLU"}
    assert rewritten(kept) == set()
    assert rewritten(lambda: relu(bn(x * 1.0))) == {"ReLU"}


@pytest.mark.parametrize("policy", ["on", "auto"])
def test_residual_add_site_takes_the_out_of_place_path_when_the_sum_is_bigger(policy):
    x = leaf(4)
    with inplace.policy(policy):
        y = F.residual_add(x * 1.0, fw.ones(3, 4))  # broadcasting: (4,) cannot hold (3, 4)
        z = F.residual_add(x * 1.0, fw.ones(4, dtype=fw.float64))  # nor float64
    assert y.shape == (3, 4) and z.dtype == fw.float64


# --- a name the statement rebinds ------------------------------------------------------------

# The statements under test live in helpers without ``assert``: pytest rewrites asserts
# into code that calls locals(), and auto refuses to reason about such a frame.


def _rebinding(x):
    out = x * 2
    out = out + 1.0  # the old out is unreachable once this statement ends
    out = fw.exp(out)
    return out


def _read_again(x):
    out = x * 2
    y = out + 1.0  # out is read later
    z = fw.exp(out) * out  # and here, after the call, in the same statement
    alias = out
    out = out + 1.0  # alias still holds the old value
    return y, z, alias, out


def test_a_name_rebound_by_the_same_statement_is_dead():
    x = leaf(4)
    out = _rebinding(x)
    assert auto_ops("Add") == 1 and auto_ops("Exp") == 1
    with inplace.policy("off"):
        ref = _rebinding(x)
    np.testing.assert_array_equal(out.detach().numpy(), ref.detach().numpy())
    assert proof._REBIND_OK


def test_a_name_read_again_or_kept_elsewhere_is_refused():
    x = leaf(4)
    y, z, alias, out = _read_again(x)
    assert auto_ops("Add") == 0
    with inplace.policy("off"):
        ref = _read_again(x)
    for got, want in zip((y, z, alias, out), ref):
        np.testing.assert_array_equal(got.detach().numpy(), want.detach().numpy())


def test_a_frame_that_can_call_locals_is_refused():
    def uses_locals(x):
        out = x * 2
        out = out + 1.0
        return out, locals()

    uses_locals(leaf(4))
    assert auto_ops() == 0


def test_rebinding_inside_try_or_in_a_closure_is_refused():
    x = leaf(4)

    def in_try():
        out = x * 2
        try:
            out = out + 1.0
        except ValueError:
            return out  # the handler could read the old value
        return out

    def in_with():
        out = x * 2
        with fw.no_grad():
            out = out + 1.0
        return out

    def closure():
        out = x * 2

        def inner():
            return out

        out = out + 1.0
        return inner()

    for fn in (in_try, in_with, closure):
        fn()
    assert auto_ops() == 0


def test_a_conditional_rebind_is_right_whichever_branch_runs():
    x = leaf(4)

    def conditional(flag):
        out = x * 2
        out = out + 1.0 if flag else out  # 3.12+: the taken branch stores right after the add
        return out

    for flag in (True, False):
        got = conditional(flag).detach().numpy()
        with inplace.policy("off"):
            want = conditional(flag).detach().numpy()
        np.testing.assert_array_equal(got, want)


def test_pytorch_style_block_gets_the_savings_of_on():
    """torchvision's BasicBlock, written statement by statement, needs no rewriting."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(4)
            self.relu = nn.ReLU()
            self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(4)

        def forward(self, x):
            identity = x
            out = self.conv1(x)
            out = self.bn1(out)
            out = self.relu(out)
            out = self.conv2(out)
            out = self.bn2(out)
            out = out + identity
            out = self.relu(out)
            return out

    fw.manual_seed(0)
    block = Block()
    x = fw.randn(2, 4, 5, 5, requires_grad=True)
    y = block(x)
    y.sum().backward()
    gx = x.grad.numpy().copy()
    assert auto_ops("ReLU") == 2 and auto_ops("Add") == 1
    x.grad = None
    block.zero_grad()
    with inplace.policy("off"):
        ref = block(x)
        ref.sum().backward()
    np.testing.assert_array_equal(y.detach().numpy(), ref.detach().numpy())
    np.testing.assert_allclose(gx, x.grad.numpy(), rtol=1e-6, atol=1e-7)


_CALLS = {"CALL", "CALL_KW", "CALL_FUNCTION", "CALL_METHOD", "CALL_FUNCTION_KW"}


def _rebound_at_calls(fn):
    """What the proof reads at each call of ``fn``: the name the next instruction rebinds."""
    return [proof._classify_caller(fn.__code__, i.offset)[1] for i in dis.get_instructions(fn) if i.opname in _CALLS]


def test_rebind_rule_claims_only_a_loaded_name_stored_right_after_the_call():
    def f(a, b, c):
        a = fw.neg(a)  # a: loaded, then stored right after the call
        b = fw.neg(b) + b  # b: read again before the store
        d = fw.neg(c)  # d: stored, but it did not bring the tensor
        return a, b, d

    assert _rebound_at_calls(f) == ["a", None, None]


def test_rebind_rule_reads_three_thirteens_combined_instructions():
    def f(out, identity):
        out = out + identity  # 3.13: LOAD_FAST_LOAD_FAST (out, identity)
        return out

    binary = [i for i in dis.get_instructions(f) if i.opname == "BINARY_OP" or i.opname == "BINARY_ADD"]
    assert proof._classify_caller(f.__code__, binary[0].offset)[:2] == ("binary", "out")


def test_reading_a_local_leaves_no_snapshot_that_keeps_tensors_alive():
    """``a = a.exp(); del b``: b's memory is freed at once, not when the frame ends."""
    import weakref

    def run():
        a = fw.ones(1000) * 1.0
        b = fw.ones(1000) * 1.0
        ref = weakref.ref(b)
        a = a.exp()  # the rebind rule reads the frame's locals here
        del b
        alive = ref() is not None
        return a, alive

    before = auto_ops("Exp")
    _, alive = run()
    assert auto_ops("Exp") == before + 1  # the rule did run
    assert not alive


def test_tensors_below_the_size_threshold_are_not_worth_the_proof():
    inplace.set_auto_min_bytes(inplace.DEFAULT_AUTO_MIN_BYTES)
    small = fw.randn(16)  # 64 bytes
    _ = (small * 2.0) + 1.0
    assert auto_ops() == 0
    big = fw.randn(inplace.DEFAULT_AUTO_MIN_BYTES // 4)  # float32: exactly the threshold
    _ = (big * 2.0) + 1.0
    assert auto_ops("Add") == 1
    with pytest.raises(ValueError, match="integer >= 0"):
        inplace.set_auto_min_bytes(-1)
