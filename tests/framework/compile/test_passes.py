"""Each pass on its own, on small hand-built programs (and a few captured ones).

The builder below writes programs the way capture does: values with their layout, nodes
with templates, ``write`` edges for inplace ops, ``view`` edges for views.
"""

import numpy as np
import pytest

import framework as fw
from framework.compile import alias, dce, plan, reinplace, replay
from framework.compile.program import Program, Ref, Source, WriteBack
from framework.ops import dropout as D
from framework.ops import elementwise as E
from framework.ops import linalg as L
from framework.ops.view import Permute

F32 = np.dtype(np.float32)


class Builder:
    def __init__(self):
        self.p = Program()

    def input(self, name, shape=(4,), kind="arg", obj=None):
        src = Source(kind, name, obj=obj, key=len(self.p.inputs))
        v = self.p.new_value(shape, F32, _strides(shape), source=src, name=name)
        self.p.inputs.append(v.id)
        return v.id

    def op(self, cls, *ins, shape=(4,), inplace=False, view=False, saved=None, **params):
        n = self.p.add_node(
            "call", op=cls, inputs=[Ref(i) if isinstance(i, int) else i for i in ins], params=params, inplace=inplace
        )
        edge = ("write", ins[0]) if inplace else ("view", ins[0]) if view else None
        out = self.p.new_value(shape, F32, _strides(shape), producer=n.index, edge=edge)
        n.outputs = [out.id]
        n.info.update(needs=(False,) * len(ins), saved=saved or {}, kept=[], saved_copies={})
        return out.id

    def backward(self, fwd_value, grad, shape=(4,)):
        fwd = self.p.values[fwd_value].producer
        fnode = self.p.nodes[fwd]
        n = self.p.add_node("backward", op=fnode.op)
        out = self.p.new_value(shape, F32, _strides(shape), producer=n.index)
        n.outputs = [out.id]
        n.info.update(
            fwd=fwd,
            grad=grad,
            reuse_grad=False,
            saved_values=list(fnode.info["saved"].values()),
            label=fnode.op.node_name,
        )
        return out.id


def _strides(shape):
    s, out = 4, []
    for n in reversed(shape):
        out.append(s)
        s *= n
    return tuple(reversed(out))


# --- alias classes and chains --------------------------------------------------------------


def test_union_find():
    uf = alias.UnionFind(6)
    uf.union(0, 1)
    uf.union(2, 3)
    uf.union(1, 3)
    assert uf.find(0) == uf.find(2) and uf.find(4) != uf.find(0)
    assert len({uf.find(i) for i in range(6)}) == 3


def test_views_and_writes_put_values_in_one_class_named_by_its_owner():
    b = Builder()
    x = b.input("x")
    y = b.op(E.Exp, x)
    v = b.op(Permute, y, view=True, dims=(0,))
    w = b.op(E.Relu, v, inplace=True)  # relu_ on the view: a new version of y's buffer
    z = b.op(E.Neg, w)
    classes = alias.alias_classes(b.p)
    assert classes.of[y] == classes.of[v] == classes.of[w] == y
    assert classes.of[z] == z and classes.of[x] == x
    assert alias.inplace_chains(b.p, classes) == [["Exp", "relu_"]]


def test_a_chain_from_an_updated_input_is_bound_back_to_it():
    b = Builder()
    p = b.input("w", kind="param", obj=object())
    g = b.input("g")
    upd = b.op(E.Add, p, g, inplace=True, alpha=-0.1)
    b.p.writebacks.append(WriteBack(b.p.values[p].source, upd))
    alias.bind_writebacks(b.p)
    assert b.p.writebacks[0].how == "bound"
    assert alias.inplace_chains(b.p) == [["w", "add_"]]
    assert alias.unbound_inputs(b.p) == []


def test_an_update_into_a_new_buffer_is_a_rebind_until_re_inplace_binds_it():
    b = Builder()
    p = b.input("w", kind="param", obj=object())
    g = b.input("g")
    new = b.op(E.Add, p, g, alpha=-0.1)  # policy off: a new buffer
    b.p.writebacks.append(WriteBack(b.p.values[p].source, new))
    alias.bind_writebacks(b.p)
    assert b.p.writebacks[0].how == "rebind" and alias.unbound_inputs(b.p)
    assert reinplace.reinplace(b.p) == [b.p.values[new].producer]
    alias.bind_writebacks(b.p)
    assert b.p.writebacks[0].how == "bound" and alias.unbound_inputs(b.p) == []


# --- re-inplace ---------------------------------------------------------------------------------


def test_a_dead_input_is_overwritten():
    b = Builder()
    x = b.input("x")
    y = b.op(E.Exp, x)
    z = b.op(E.Relu, y)  # y dies here
    b.p.outputs = Ref(b.op(E.Neg, z))
    done = reinplace.reinplace(b.p)
    assert [b.p.nodes[i].name for i in done] == ["Relu", "Neg"]  # z dies at Neg too
    assert b.p.values[z].edge == ("write", y)
    classes = alias.alias_classes(b.p)
    assert classes.of[b.p.output_refs()[0]] == y  # one buffer for the chain; returned, so not planned
    kernels_plan = plan.plan_memory(b.p)
    assert kernels_plan.placement[y] == "kernel" and kernels_plan.why[y] == "returned to the caller"


def test_an_input_read_later_is_not_overwritten():
    b = Builder()
    x = b.input("x")
    y = b.op(E.Exp, x)
    z = b.op(E.Relu, y)
    b.op(E.Add, z, y)  # y read after Relu
    reinplace.reinplace(b.p)
    assert b.p.values[z].edge is None


def test_a_value_saved_for_backward_is_not_overwritten():
    b = Builder()
    x = b.input("x")
    y = b.op(E.Exp, x)
    s = b.op(E.Sin, y, saved={"x": y})  # sin's backward reads its input
    z = b.op(E.Relu, y)  # would overwrite y, which SinBackward0 reads later
    b.backward(s, b.op(E.Neg, z))
    reinplace.reinplace(b.p)
    assert b.p.values[z].edge is None


def test_program_inputs_and_returned_values_are_never_overwritten():
    b = Builder()
    x = b.input("x")  # an argument: not state the step updates
    y = b.op(E.Relu, x)
    b.p.outputs = Ref(y)
    z = b.op(E.Exp, y)
    assert reinplace.reinplace(b.p) == []
    assert b.p.values[y].edge is None and b.p.values[z].edge is None


def test_an_operand_in_the_same_buffer_blocks_it():
    b = Builder()
    x = b.input("x")
    y = b.op(E.Exp, x)
    v = b.op(Permute, y, view=True, dims=(0,))
    b.op(E.Add, y, v)  # y + view(y): NumPy would copy the overlapping operand
    assert reinplace.reinplace(b.p) == []


def test_layouts_must_match():
    b = Builder()
    x = b.input("x", shape=(2, 3))
    y = b.op(E.Exp, x, shape=(2, 3))
    b.p.values[y].strides = (4, 8)  # a column-major result
    b.op(E.Relu, y, shape=(2, 3))
    assert reinplace.reinplace(b.p) == []


def test_ops_without_a_free_inplace_form_are_left_alone():
    b = Builder()
    x = b.input("x", shape=(4, 4))
    y = b.op(E.Exp, x, shape=(4, 4))
    b.op(L.Matmul, y, y, shape=(4, 4))  # matmul cannot write over an operand
    assert reinplace.reinplace(b.p) == []


def test_reinplace_captured_sgd_off_binds_every_chain():
    from .helpers import batches, make_model, train_step

    fw.inplace.set_policy("off")
    model = make_model("mlp")
    opt = fw.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    f = fw.compile(train_step(model, opt))
    for x, y in batches("mlp", 2):
        f(x, y)
    r = f.report()
    assert r["unbound_writebacks"] == []
    assert {"Add", "Mul", "AddScaled"} <= set(r["reinplaced_ops"])
    chains = {c[0]: c[1:] for c in r["inplace_chains"]}
    assert chains["layers.1.weight"] == ["AddScaled"]  # p - lr * buf, one BLAS pass
    buf = next(k for k in chains if k.endswith("[layers.1.weight].momentum_buffer"))
    assert chains[buf] == ["Mul", "Add"]
    assert r["copies_avoided_bytes"] > 0


# --- dead-code elimination ---------------------------------------------------------------------


def test_unused_values_are_removed_and_effects_kept():
    b = Builder()
    x = b.input("x")
    used = b.op(E.Exp, x)
    b.op(E.Neg, x)  # nobody reads it
    b.op(D.Dropout, x, p=0.5)  # unused, but it draws random numbers
    p = b.input("w", kind="param", obj=object())
    b.op(E.Add, p, used, inplace=True)  # writes a program input
    b.p.outputs = Ref(used)
    removed = dce.eliminate_dead_code(b.p)
    assert removed == ["Neg"]
    assert [n.name for n in b.p.nodes] == ["Exp", "Dropout", "add_"]
    assert [n.index for n in b.p.nodes] == [0, 1, 2]


def test_fused_attention_with_dropout_draws_random_numbers_and_is_kept_unused():
    # removing it would shift every later draw of the generator; without dropout it is pure
    from framework.ops.attention import ScaledDotProductAttention as SDPA

    for p, kept in ((0.1, ["ScaledDotProductAttention", "Exp"]), (0.0, ["Exp"])):
        b = Builder()
        q = b.input("q", shape=(1, 2, 4))
        b.op(SDPA, q, q, q, None, dropout_p=p, is_causal=True, scale=0.5, shape=(1, 2, 4))
        used = b.op(E.Exp, q, shape=(1, 2, 4))
        b.p.outputs = Ref(used)
        dce.eliminate_dead_code(b.p)
        assert [n.name for n in b.p.nodes] == kept


def test_a_kept_backward_keeps_its_forward():
    b = Builder()
    x = b.input("x")
    y = b.op(E.Exp, x, saved={"result": None})
    b.p.nodes[-1].info["saved"] = {"result": y}
    g = b.input("g")
    gx = b.backward(y, g)
    b.p.outputs = Ref(gx)
    assert dce.eliminate_dead_code(b.p) == []


# --- the memory plan ---------------------------------------------------------------------------


def test_greedy_by_size_reuses_offsets_of_buffers_that_are_dead():
    items = [("a", 100, 0, 2), ("b", 100, 3, 5), ("c", 50, 1, 4), ("d", 300, 6, 7)]
    offsets, top = plan.greedy_by_size(items)
    assert plan.overlapping(items, offsets) == []
    assert offsets["d"] == 0  # the largest, placed first
    assert offsets["a"] == offsets["b"]  # disjoint in time: the same bytes
    assert top == 300


def test_liveness_of_inputs_and_sinks():
    b = Builder()
    x = b.input("x")
    y = b.op(E.Exp, x)
    z = b.op(E.Relu, y)
    b.op(E.Neg, z)
    b.p.outputs = Ref(y)
    classes = alias.alias_classes(b.p)
    iv = plan.liveness(b.p, classes)
    assert iv[x] == (-1, 0)
    assert iv[y] == (0, 3)  # returned: live to the end
    assert iv[z] == (1, 2)


def test_plan_places_kernel_owned_values_outside_the_arena_and_explains_why():
    b = Builder()
    x = b.input("x", shape=(4, 4))
    y = b.op(E.Cast, x, shape=(4, 4), dtype=F32)  # a copy in a dtype: its kernel allocates
    z = b.op(E.Exp, y, shape=(4, 4))
    b.op(E.Neg, z, shape=(4, 4))
    b.p.outputs = Ref(b.op(E.Relu, z, shape=(4, 4)))

    replay.annotate(b.p)
    pl = plan.plan_memory(b.p)
    assert pl.placement[y] == "kernel" and "allocates its own output" in pl.why[y]
    out = b.p.output_refs()[0]
    assert pl.placement[out] == "kernel" and pl.why[out] == "returned to the caller"
    plan.verify(b.p, pl)
    assert pl.planned_peak_bytes >= pl.lower_bound_bytes


def test_verify_catches_a_read_after_a_later_write():
    b = Builder()
    x = b.input("x")
    y = b.op(E.Exp, x)
    b.op(E.Relu, y, inplace=True)  # overwrites y's buffer
    b.op(E.Neg, y)  # reads the old y: stale
    with pytest.raises(AssertionError, match="overwritten by node 1"):
        plan.verify(b.p, plan.plan_memory(b.p))


def test_the_floor_counts_parameters_gradients_state_and_saved_values():
    from .helpers import batches, make_model, train_step

    fw.inplace.set_policy("off")
    model = make_model("mlp")
    opt = fw.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    f = fw.compile(train_step(model, opt))
    for x, y in batches("mlp", 2):
        f(x, y)
    params = sum(p.nbytes for p in model.parameters())
    r = f.report()
    # parameters, gradients and momentum buffers, plus at least the batch saved by the first matmul
    assert r["floor_bytes"] >= 3 * params + 8 * 64 * 4
    # (the floor is not a bound of the peak: gradients and saved activations need not all
    # be live at one moment)
    assert r["lower_bound_bytes"] <= r["planned_peak_bytes"]
