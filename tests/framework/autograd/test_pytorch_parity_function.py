"""PyTorch's tests of custom autograd Functions (``torch.autograd.Function``), ported.

Each test names its source in ``test/test_autograd.py`` (``TestAutograd`` unless said
otherwise). Left out (see also the list in ``test_pytorch_parity.py``): create_graph and
gradgradcheck parts, ``InplaceFunction`` (a legacy base class), forward-mode AD (``jvp``),
``vmap``, ``_materialize_non_diff_grads``, C++ node hooks (``grad_fn.register_hook``),
``torch._C`` internals (``UndefinedGrad``, ``_functions``), checkpointing and threads;
test_naughty_autograd_function_stashing_ctx (a node here is a Python object: a ctx the
user stashes keeps its saved tensors until backward frees them, even after the graph
that used it is gone, where PyTorch frees them with the graph).
"""

from __future__ import annotations

import gc
import random
import warnings

import numpy as np
import pytest

import framework as fw
from framework.autograd import Function
from framework.autograd.custom_function import once_differentiable
from framework.testing import assert_close, gradcheck

CUSTOM_VIEW_MSG = "This view was created inside a custom Function"
MULTI_VIEW_MSG = "This view is the output of a function that returns multiple views."


def f64(*shape, requires_grad=False, seed=0):
    values = np.random.default_rng(seed).standard_normal(shape)
    return fw.tensor(values, dtype=fw.float64, requires_grad=requires_grad)


class MyFunction(Function):  # test_function
    @staticmethod
    def forward(ctx, tensor1, pyscalar, tensor2):
        ctx.pyscalar = pyscalar
        ctx.save_for_backward(tensor1, tensor2)
        return tensor1 + pyscalar * tensor2 + tensor1 * tensor2

    @staticmethod
    def backward(ctx, grad_output):
        var1, var2 = ctx.saved_tensors
        assert isinstance(var1, fw.Tensor) and isinstance(var2, fw.Tensor)
        assert isinstance(grad_output, fw.Tensor)
        return grad_output + grad_output * var2, None, grad_output * ctx.pyscalar + grad_output * var1


def test_function():  # test_function / _function_test (without create_graph)
    x = fw.randn(5, 5, requires_grad=True)
    y = fw.randn(5, 5, requires_grad=True)
    result = MyFunction.apply(x, 2, y)
    assert result.grad_fn.name() == "MyFunctionBackward"
    result.sum().backward()
    assert_close(x.grad, (y + 1).detach())
    assert_close(y.grad, (x + 2).detach())


def test_once_differentiable():  # test_once_differentiable (the values)
    class Fn(Function):
        @staticmethod
        def forward(ctx, t1, s, t2):
            ctx.s = s
            ctx.save_for_backward(t1, t2)
            return t1 + s * t2 + t1 * t2

        @staticmethod
        @once_differentiable
        def backward(ctx, g):
            assert not fw.is_grad_enabled()
            t1, t2 = ctx.saved_tensors
            return g + g * t2, None, g * ctx.s + g * t1

    x = fw.randn(5, 5, requires_grad=True)
    y = fw.randn(5, 5, requires_grad=True)
    Fn.apply(x, 2, y).sum().backward()
    assert_close(x.grad, (y + 1).detach())


def test_function_returns_input():  # test_function_returns_input
    class Fn(Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    for shape in [(1,), ()]:
        v = fw.ones(shape, requires_grad=True)
        Fn.apply(v).backward()
        assert_close(v.grad, np.full(shape, 2.0))
        with fw.no_grad():
            v.grad.zero_()
        Fn.apply(v.clone()).backward()
        assert_close(v.grad, np.full(shape, 2.0))


def test_function_returns_undefined_tensor():  # test_function_returns_undefined_tensor
    class Fn(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return None

    x = fw.ones(1, requires_grad=True)
    Fn.apply(x).backward()
    assert x.grad is None  # a None gradient stays None, not zeros
    Fn.apply(x**2).backward()
    assert x.grad is None
    Fn.apply(x).sum().backward()
    assert x.grad is None
    assert fw.autograd.grad(Fn.apply(x), x, allow_unused=True)[0] is None


def test_custom_function_exception():  # test_custom_function_exception
    class SimulateBackwardError(Function):
        @staticmethod
        def forward(ctx, inp):
            return inp.clone()

        @staticmethod
        @once_differentiable
        def backward(ctx, inp):
            raise Exception("Simulate error on backward pass")  # noqa: TRY002

    t1 = fw.rand(3, 3, requires_grad=True)
    t2 = fw.rand(3, 3, requires_grad=True)
    tmp = (t1 + t2) * (t1 + t2)
    t3 = SimulateBackwardError.apply(tmp)
    with pytest.raises(Exception, match="Simulate error on backward pass"):
        t3.sum().backward()


def test_custom_function_non_tensor_inputs_outputs():  # test_custom_function_non_tensor_inputs_outputs
    class Fn(Function):
        @staticmethod
        def forward(ctx, t1, t2, scale, t3):
            t4 = t1 + t2 * t3
            t5 = t1 * t2 + t3
            t4 *= scale
            t5 *= scale
            ctx.scale = scale
            ctx.save_for_backward(t1, t2, t3)
            return scale, t4, None, True, t5, "bar", t1

        @staticmethod
        @once_differentiable
        def backward(ctx, *grads):
            assert len(grads) == 7
            assert grads[0] is None and grads[2] is None and grads[3] is None and grads[5] is None
            scale = ctx.scale
            var1, var2, var3 = ctx.saved_tensors
            return (
                grads[1] * scale + grads[4] * var2 * scale + grads[6],
                grads[1] * var3 * scale + grads[4] * var1 * scale,
                None,
                grads[1] * var2 * scale + grads[4] * scale,
            )

    t1 = fw.rand(10, dtype=fw.float64, requires_grad=True)
    t2 = fw.rand(10, dtype=fw.float64, requires_grad=True)
    t3 = fw.rand(10, dtype=fw.float64)
    scale = random.Random(0).randint(1, 10)
    res = Fn.apply(t1, t2, scale, t3)
    assert res[0] == scale and res[2] is None and res[3] is True and res[5] == "bar"
    assert_close(res[1], ((t1 + t2 * t3) * scale).detach())
    assert_close(res[4], ((t1 * t2 + t3) * scale).detach())
    assert_close(res[6], t1.detach())
    fw.autograd.backward([res[1].sum(), res[4].sum(), res[6].sum()])
    assert t1.grad is not None and t2.grad is not None and t3.grad is None

    def foo(t1, t2, t3):
        res = Fn.apply(t1, t2, scale, t3)
        return fw.cat([res[1], res[4], res[6]])

    gradcheck(foo, [t1, t2, t3])


def test_custom_function_no_tensors():  # test_custom_function_no_tensors
    class Fn(Function):
        @staticmethod
        def forward(ctx, t1, t2, scale, t3):
            t4 = t1 + t2 * t3
            t5 = t1 * t2 + t3
            t4 *= scale
            t5 *= scale
            return scale, t4, None, True, t5, "bar", t1

        @staticmethod
        @once_differentiable
        def backward(ctx, *args):
            return args[0], args[1], None, args[2]

    rng = random.Random(1)
    t1, t2, t3 = rng.random(), rng.random(), rng.random()
    scale = rng.randint(0, 10)
    res = Fn.apply(t1, t2, scale, t3)
    assert res == (scale, (t1 + t2 * t3) * scale, None, True, (t1 * t2 + t3) * scale, "bar", t1)


def test_invalid_gradients():  # test_invalid_gradients
    class Fn(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad_output):
            return fw.randn(10)

    inp = fw.randn(5, 5, requires_grad=True)
    with pytest.raises(RuntimeError, match="expected shape"):
        Fn.apply(inp).sum().backward()


def test_hook_none():  # test_hook_none
    class NoneGradientFunction(Function):
        @staticmethod
        def forward(ctx, x, y):
            assert ctx.needs_input_grad[0]
            assert not ctx.needs_input_grad[1]
            return x, y

        @staticmethod
        def backward(ctx, grad_x, grad_y):
            return grad_x, None

    was_called = [False]

    def hook(grad):
        assert grad is not None
        was_called[0] = True

    x = fw.randn(5, 5, requires_grad=True)
    y = fw.randn(5, 5)
    rx, ry = NoneGradientFunction.apply(x, y)
    rx.register_hook(hook)
    ry.register_hook(hook)
    sum([rx, ry]).sum().backward()
    assert was_called[0]


class DoubleMul(Function):  # test_retains_grad_inplace_multiple_outputs, test_tensor_hooks_inplace_multiple_outputs
    @staticmethod
    def forward(ctx, x):
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, g1, g2):
        return g1 * 2 + g2 * 3


def test_retains_grad_inplace_multiple_outputs():  # test_retains_grad_inplace_multiple_outputs
    b = fw.rand(3, 3, requires_grad=True)
    var, mean = DoubleMul.apply(b)
    var.retain_grad()
    mean.retain_grad()
    var.mul_(2)
    (var + mean).sum().backward()
    gvar, gmean = var.grad, mean.grad

    a = b.detach().requires_grad_(True)
    var, mean = DoubleMul.apply(a)
    var.mul_(2)
    out = (var + mean).sum()
    gvar_expected, gmean_expected = fw.autograd.grad(out, inputs=(var, mean))
    assert fw.allclose(gvar, gvar_expected) and fw.allclose(gmean, gmean_expected)


def test_tensor_hooks_inplace_multiple_outputs():  # test_tensor_hooks_inplace_multiple_outputs
    counts = [0, 0, 0]

    def fn0(grad):
        counts[0] += 1
        assert_close(grad, np.ones((3, 3)) * 2)

    def fn1(grad):
        counts[1] += 1
        assert_close(grad, np.ones((3, 3)) * 3)

    def fn2(grad):
        counts[2] += 1
        assert_close(grad, np.ones((3, 3)))

    b = fw.rand(3, 3, requires_grad=True)
    out1, out2 = DoubleMul.apply(b)
    h1 = out1.register_hook(fn0)
    h2 = out2.register_hook(fn1)
    out1.mul_(2)  # out1 has a new node now; fn0 stays with the old value
    h3 = out1.register_hook(fn2)
    (out1 + out2 * 3).sum().backward()
    assert counts == [1, 1, 1]
    h1.remove(), h2.remove(), h3.remove()


def test_no_grad_python_function():  # test_no_grad_python_function
    class MyOp(Function):
        @staticmethod
        def forward(ctx, x):
            return x + 1

        @staticmethod
        def backward(ctx, dy):
            return dy

    x = fw.ones(5, 5, requires_grad=True)
    with fw.no_grad():
        y = MyOp.apply(x)
    assert not y.requires_grad


def test_no_grad_input():  # test_no_grad_input
    class MyFn(Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, grad_output):
            return grad_output

    x = fw.randn(5, requires_grad=True)
    with fw.no_grad():
        y = MyFn.apply(x)
    assert x.requires_grad and y.grad_fn is None


def test_mark_non_differentiable():  # test_mark_non_differentiable
    class Fn(Function):
        @staticmethod
        def forward(ctx, inp):
            output = inp > 0
            ctx.mark_non_differentiable(output)
            return output

        @staticmethod
        def backward(ctx, grad_output):
            return (grad_output * 0).to(fw.float64)

    x = fw.randn(5, 5, requires_grad=True)
    mask = Fn.apply(x)
    assert not mask.requires_grad
    y = fw.where(mask, 0.0, x)  # masked_fill(mask, 0)
    y.sum().backward()
    assert_close(x.grad, np.where(mask.numpy(), 0.0, 1.0))


def test_mark_non_differentiable_mixed():  # test_mark_non_differentiable_mixed
    class Fn(Function):
        @staticmethod
        def forward(ctx, inp):
            a = inp + 1
            b = inp + 2
            ctx.mark_non_differentiable(a)
            return a, b

        @staticmethod
        def backward(ctx, grad_a, grad_b):
            assert (grad_a.numpy() == 0).all()  # materialized zeros
            assert (grad_b.numpy() == 1).all()
            return grad_b

    x = fw.randn(5, 5, requires_grad=True)
    a, b = Fn.apply(x)
    assert not a.requires_grad and b.requires_grad
    b.sum().backward()
    assert x.grad.tolist() == np.ones((5, 5)).tolist()


def test_mark_non_differentiable_none():  # test_mark_non_differentiable_none
    class Fn(Function):
        @staticmethod
        def forward(ctx, inp):
            output = inp.clone()
            ctx.mark_non_differentiable(output)
            return output

        @staticmethod
        def backward(ctx, grad_output):
            return None

    x = fw.randn(5, 5, requires_grad=True)
    r = Fn.apply(x * x)
    (r * x).sum().backward()
    assert_close(x.grad, r.numpy())


def test_return_duplicate():  # test_return_duplicate
    class DoubleDuplicate(Function):
        @staticmethod
        def forward(ctx, x):
            output = x * 2
            return output, output

        @staticmethod
        def backward(ctx, grad1, grad2):
            return grad1 * 2 + grad2 * 2

    def fn(x):
        a, b = DoubleDuplicate.apply(x)
        assert a is b
        return a + b

    gradcheck(fn, [f64(5, 5, requires_grad=True)])


def test_return_duplicate_inplace():  # test_return_duplicate_inplace (without InplaceFunction)
    class DoubleInplace(Function):
        @staticmethod
        def forward(ctx, x):
            x.mul_(2)
            ctx.mark_dirty(x)
            return x, x

        @staticmethod
        def backward(ctx, grad1, grad2):
            return grad1 * 2 + grad2 * 2

    def inplace_fn(x):
        a, b = DoubleInplace.apply(x.clone())
        assert a is b
        return a + b

    x = f64(5, 5, requires_grad=True)
    gradcheck(inplace_fn, [x])
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        DoubleInplace.apply(x)  # can't modify leaf variables in place


def test_return_leaf():  # test_return_leaf
    class Identity(Function):
        @staticmethod
        def forward(ctx, a, b):
            return a, a + b

        @staticmethod
        def backward(ctx, grad_a, grad_b):
            return grad_a + grad_b, grad_b

    hook_called = [False]
    x = fw.randn(5, 5, requires_grad=True)
    y = fw.randn(5, 5, requires_grad=True)
    q, p = Identity.apply(x, y)

    def hook(grad):  # only the gradient from q's use, not x's
        hook_called[0] = True
        assert grad.tolist() == np.ones((5, 5)).tolist()

    q.register_hook(hook)
    (q + p + x).sum().backward()
    assert_close(x.grad, np.full((5, 5), 3.0))
    assert_close(y.grad, np.ones((5, 5)))
    assert hook_called[0]


def test_return_leaf_inplace():  # test_return_leaf_inplace
    class Inplace(Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.mark_dirty(a)
            return a.add_(b), b + 2

        @staticmethod
        def backward(ctx, grad_a, grad_b):
            return grad_a, grad_a + grad_b

    x = fw.randn(5, 5)
    y = fw.randn(5, 5, requires_grad=True)
    q, p = Inplace.apply(x, y)
    assert q is x
    assert q.grad_fn is not None and q.grad_fn.name() == "InplaceBackward"
    assert q.requires_grad
    q.sum().backward()
    assert y.grad.tolist() == np.ones((5, 5)).tolist()


def test_save_none_for_backward():  # test_save_none_for_backward
    class MyFn(Function):
        @staticmethod
        def forward(ctx, inp):
            ctx.save_for_backward(None, inp, None)
            return inp * inp

        @staticmethod
        def backward(ctx, grad_output):
            n1, inp, n2 = ctx.saved_tensors
            assert n1 is None and n2 is None
            return 2 * inp * grad_output

    x = fw.randn(5, 5, requires_grad=True)
    MyFn.apply(x).sum().backward()
    assert_close(x.grad, (2 * x).detach())


def test_too_many_grads():  # test_too_many_grads
    class MyFn(Function):
        @staticmethod
        def forward(ctx, inp):
            return inp

        @staticmethod
        def backward(ctx, grad_output):
            return grad_output, None, None

    x = fw.randn(5, 5, requires_grad=True)
    MyFn.apply(x).sum().backward()
    assert x.grad.tolist() == np.ones((5, 5)).tolist()


def test_dep_nograd():  # test_dep_nograd
    class F1(Function):
        @staticmethod
        def forward(ctx, inp):
            out = fw.randn(*inp.shape)
            ctx.mark_non_differentiable(out)
            return inp, out

        @staticmethod
        def backward(ctx, grad_output, ignored):
            return grad_output

    class F2(Function):
        @staticmethod
        def forward(ctx, inp, ignored):
            return inp

        @staticmethod
        def backward(ctx, grad_output):
            return grad_output, None

    x = fw.randn(5, requires_grad=True)
    a, b = F1.apply(x)
    b = b + 1  # separate F1 from F2 by another op
    assert a.requires_grad and not b.requires_grad
    c = F2.apply(a, b)
    c.backward(fw.ones(*c.shape))
    assert x.grad.tolist() == [1.0] * 5


def test_custom_function_saved_tensors():  # test_custom_function_saved_tensors
    def get_fn(save):
        class MyFn(Function):
            @staticmethod
            def forward(ctx, x):
                if save:
                    ctx.save_for_backward(x, None)
                return x

            @staticmethod
            def backward(ctx, g):
                return g

        return MyFn

    a = fw.randn(5, requires_grad=True)
    y = get_fn(True).apply(a)
    saved = y.grad_fn.saved_tensors
    assert saved[0] is a and saved[1] is None  # a saved input is the input itself
    y.sum().backward()
    with pytest.raises(RuntimeError, match="after they have already been freed"):
        y.grad_fn.saved_tensors  # noqa: B018
    y = get_fn(False).apply(a)
    assert y.grad_fn.saved_tensors == ()


def test_saved_tensor_version_check():  # test_inplace (the version check, through a custom Function)
    class Square(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    x = fw.randn(3, requires_grad=True).clone()
    y = Square.apply(x)
    x.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_custom_autograd_no_early_free():  # test_custom_autograd_no_early_free (gradcheck part)
    class Double(Function):
        @staticmethod
        def forward(ctx, x):
            y = x**2
            ctx.save_for_backward(x, y)
            return y

        @staticmethod
        def backward(ctx, grad_output):
            x, _ = ctx.saved_tensors
            return grad_output * 2 * x

    class Double2(Double):  # uses forward's output in backward
        @staticmethod
        def backward(ctx, grad_output):
            x, y = ctx.saved_tensors
            return grad_output * 2 * y / x

    x = fw.tensor(2.0, dtype=fw.float64, requires_grad=True)
    assert gradcheck(Double.apply, [x])
    assert gradcheck(Double2.apply, [x])
    y = Double2.apply(x)
    fw.autograd.grad(y, x, retain_graph=True)
    fw.autograd.grad(y, x)  # should not error


def test_custom_function_setup_context_simple():  # test_custom_function_setup_context_simple
    class MySquare(Function):
        @staticmethod
        def forward(x):
            return x**2

        @staticmethod
        def setup_context(ctx, inputs, output):
            (x,) = inputs
            ctx.save_for_backward(x)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * 2 * x

    x = fw.randn((), requires_grad=True)
    (gx,) = fw.autograd.grad(MySquare.apply(x), x)
    assert_close(gx, (2 * x).detach())


def test_custom_function_error():  # test_custom_function_error (forward and backward parts)
    class BadFw(Function):
        @staticmethod
        def backward(ctx, foo):
            return foo

    class BadBw(Function):
        @staticmethod
        def forward(ctx, foo):
            return foo.clone()

    inp = fw.rand(1, requires_grad=True)
    with pytest.raises(NotImplementedError, match="must implement the forward"):
        BadFw.apply(inp)
    with pytest.raises(RuntimeError, match="must implement either the backward"):
        BadBw.apply(inp).sum().backward()


def test_grad_mode_restored_reentrant():  # test_grad_mode_restored_reentrant (without create_graph)
    class MyFunction(Function):
        @staticmethod
        def forward(ctx, inp):
            return inp.clone()

        @staticmethod
        def backward(ctx, go):
            original = fw.is_grad_enabled()
            with fw.enable_grad():
                assert fw.is_grad_enabled()
                foo = fw.rand(*go.shape, requires_grad=True)
                (grad,) = fw.autograd.grad(foo**3, foo, grad_outputs=go)
                assert fw.is_grad_enabled()
            assert fw.is_grad_enabled() == original
            return grad

    inp = fw.rand(3, requires_grad=True)
    MyFunction.apply(inp).sum().backward()
    assert inp.grad is not None


def test_custom_function_cycle():  # test_custom_function_cycle
    class MyFn(Function):
        @staticmethod
        def forward(ctx, x, metadata):
            x = x.clone()
            ctx.meta = metadata
            ctx.save_for_backward(x)
            return x

        @staticmethod
        def backward(ctx, gO):
            (x,) = ctx.saved_tensors
            assert_close(x, np.float32(3.14))
            assert_close(ctx.meta["foo"], np.float32(3.14))
            return gO * x, None

    import weakref

    def get_refs(with_backward):
        a = fw.tensor(3.14, requires_grad=True)
        metadata = {}
        out = MyFn.apply(a, metadata)
        metadata["foo"] = out  # a cycle: out -> node -> metadata -> out
        if with_backward:
            out.sum().backward()
            assert_close(a.grad, a.detach())
        return weakref.ref(out)

    for with_backward in (False, True):
        gc.disable()
        try:
            ref = get_refs(with_backward)
            assert ref() is not None  # held by the cycle
        finally:
            gc.enable()
        gc.collect()
        assert ref() is None  # the cycle is collectable


# --- custom Functions and views -----------------------------------------------------------------


class ViewAsFn(Function):  # test_inplace_not_requires_grad
    @staticmethod
    def forward(ctx, inp):
        return inp.view_as(inp)

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_inplace_not_requires_grad():  # test_inplace_not_requires_grad
    a = fw.rand(1, 2)  # does not require grad
    b = fw.rand(1, requires_grad=True)  # the value written does
    view_a = ViewAsFn.apply(a)
    with pytest.raises(RuntimeError, match=CUSTOM_VIEW_MSG):
        view_a += b
    a = fw.rand(1, 2)
    b = fw.rand(1, requires_grad=True)
    view_a = ViewAsFn.apply(a)
    with pytest.raises(RuntimeError, match=CUSTOM_VIEW_MSG):
        view_a.copy_(b)
    a = fw.rand(1, 2)
    b = fw.rand(1, requires_grad=True)
    view_a = a.unbind()[0]
    with pytest.raises(RuntimeError, match=MULTI_VIEW_MSG):
        view_a.copy_(b)
    a = fw.rand(1, 2)  # views that may be written still can
    b = fw.rand(1, requires_grad=True)
    a.select(1, 0).copy_(b)
    assert a.requires_grad


@pytest.mark.parametrize("fn_id", ["one_output", "two_output", "view_of_temp"])
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("make_view", [True, False])
def test_autograd_simple_views_python(fn_id, inplace, make_view):
    # test_autograd_simple_views_python / _do_test_autograd_simple_views_python, float64,
    # without PyTorch's private ctx._is_pure_view (pure_view=False)
    bw_called = [0]
    ga_nz = [False]

    class IdOneOutput(Function):
        @staticmethod
        def forward(ctx, a, make_view):
            return a.narrow(0, 0, 2) if make_view else a.clone()

        @staticmethod
        def backward(ctx, ga):
            bw_called[0] += 1
            return ga, None

    class IdTwoOutput(Function):
        @staticmethod
        def forward(ctx, a, b, make_view):
            a = a.narrow(0, 0, 2) if make_view else a.clone()
            return a, a + b

        @staticmethod
        def backward(ctx, ga, gab):
            bw_called[0] += 1
            ga_nz[0] = not (ga.numpy() == 0).all()
            return ga + gab, gab, None

    class ViewOfTemp(Function):
        @staticmethod
        def forward(ctx, a, make_view):
            ctx.save_for_backward(a)
            a = a.narrow(0, 0, 2) if make_view else a.clone()
            b = a.clone()
            return b.select(0, 0)

        @staticmethod
        def backward(ctx, grad):
            bw_called[0] += 1
            (a,) = ctx.saved_tensors
            res = fw.zeros_like(a)
            res.select(0, 0).copy_(grad)
            return res, None

    err_msg = {
        "one_output": "Output 0 of IdOneOutputBackward is a view and is being modified inplace. " + CUSTOM_VIEW_MSG,
        "two_output": "Output 0 of IdTwoOutputBackward is a view and is being modified inplace. " + MULTI_VIEW_MSG,
        "view_of_temp": "Output 0 of ViewOfTempBackward is a view and is being modified inplace. " + CUSTOM_VIEW_MSG,
    }[fn_id]
    output_is_a_view = make_view or fn_id == "view_of_temp"
    if fn_id == "two_output" and make_view:  # a view returned with another output
        err_msg = "Output 0 of IdTwoOutputBackward is a view and is being modified inplace. " + CUSTOM_VIEW_MSG

    def fn(a, b):
        a = a.clone()  # never modify a, b in place, for gradcheck
        b = b.clone()
        if fn_id == "two_output":
            tmp1, tmp2 = IdTwoOutput.apply(a, b, make_view)
            if inplace:
                tmp1 += 3
                tmp2 += 3
            else:
                tmp1 = tmp1 + 3
                tmp2 = tmp2 + 3
            tmp = tmp1 * tmp2
        else:
            tmp = IdOneOutput.apply(a, make_view) if fn_id == "one_output" else ViewOfTemp.apply(a + b, make_view)
            if inplace:
                tmp += 3
            else:
                tmp = tmp + 3
        return tmp.sum()

    a = fw.ones(2, dtype=fw.float64, requires_grad=True)
    b = fw.ones(2, dtype=fw.float64, requires_grad=True)
    will_raise = inplace and output_is_a_view
    if will_raise:
        with pytest.raises(RuntimeError, match=err_msg):
            gradcheck(fn, [a, b])
        with pytest.raises(RuntimeError, match=err_msg):
            fn(a, b)
        assert bw_called[0] == 0
    else:
        gradcheck(fn, [a, b])
        bw_called[0] = 0
        ga_nz[0] = True
        fn(a, b).abs().backward()
        assert bw_called[0] == 1 and ga_nz[0]


def test_autograd_multiple_views_python():  # test_autograd_multiple_views_python
    bw_called = [0]

    class ComplexView(Function):
        @staticmethod
        def forward(ctx, a, idx):
            res = a.narrow(0, idx, 1)
            res = a.select(0, idx)
            ctx.save_for_backward(a)
            ctx.idx = idx
            return res

        @staticmethod
        def backward(ctx, grad):
            bw_called[0] += 1
            (a,) = ctx.saved_tensors
            res = fw.zeros_like(a)
            res.select(0, ctx.idx).copy_(grad)
            return res, None

    a = fw.ones(2, requires_grad=True)
    out = ComplexView.apply(a.clone(), 1)
    out.sum().backward()
    assert bw_called[0] == 1
    assert a.grad.tolist() == [0.0, 1.0]
    out = ComplexView.apply(a.clone(), 1)
    with pytest.raises(RuntimeError, match="Output 0 of ComplexViewBackward is a view and is being modified inplace"):
        out += 1


def test_autograd_python_custom_function_inplace():  # test_autograd_python_custom_function_inplace
    bw_called = [0]

    class MyAdder(Function):  # I) one output
        @staticmethod
        def forward(ctx, a, b):
            a.add_(b)
            ctx.mark_dirty(a)
            return a

        @staticmethod
        def backward(ctx, grad):
            bw_called[0] += 1
            return grad, grad

    a = fw.ones(2, requires_grad=True)
    b = fw.ones(2, requires_grad=True)
    c = MyAdder.apply(a.clone(), b)
    c.sum().backward()
    assert bw_called[0] == 1

    bw_called[0] = 0  # with an extra inplace op on the output
    c = MyAdder.apply(a.clone(), b)
    c += 2
    c.sum().backward()
    assert bw_called[0] == 1

    bw_called[0] = 0  # the input is a view
    c = MyAdder.apply(a.clone().view_as(a), b)
    c.sum().backward()
    assert bw_called[0] == 1

    class MyAdderBad(Function):  # mark_dirty on a tensor that is not an input
        @staticmethod
        def forward(ctx, a, b):
            c = 3 * a
            c.add_(b)
            ctx.mark_dirty(c)
            return c

        @staticmethod
        def backward(ctx, grad):
            bw_called[0] += 1
            grad = 3 * grad
            return grad, grad

    a = fw.ones(2, requires_grad=True)
    b = fw.ones(2, requires_grad=True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        MyAdderBad.apply(a.clone(), b)
    assert len(w) == 1

    class MyBadAdder(Function):  # II) several outputs
        @staticmethod
        def forward(ctx, a, b):
            a.add_(b)
            ctx.mark_dirty(a)
            return a, a + b

        @staticmethod
        def backward(ctx, ga, gab):
            bw_called[0] += 1
            return ga + gab, ga + gab

    bw_called[0] = 0
    c, d = MyBadAdder.apply(a.clone(), b)
    (c * d).sum().backward()
    assert bw_called[0] == 1

    bw_called[0] = 0  # with an extra inplace op on the output
    c, d = MyBadAdder.apply(a.clone(), b)
    c += 2
    (c * d).sum().backward()
    assert bw_called[0] == 1

    with pytest.raises(RuntimeError, match="your Function modifies inplace an input that is a view of another Tensor"):
        MyBadAdder.apply(a.clone().view_as(a), b)

    class MyOutPlaceAdder(Function):  # III) inplace + another op
        @staticmethod
        def forward(ctx, a, b):
            a.add_(b)
            ctx.mark_dirty(a)
            return a.clone(), a + b

        @staticmethod
        def backward(ctx, ga, gab):
            bw_called[0] += 1
            return ga + gab, ga + 2 * gab

    def fn(a, b):
        orig_a = a.clone().view_as(a)
        c, d = MyOutPlaceAdder.apply(orig_a, b)
        return (c * d).sum()

    with pytest.raises(
        RuntimeError, match="Some elements marked as dirty during the forward method were not returned as output."
    ):
        fn(a, b)


# PyTorch: test_custom_function_mark_dirty_not_differentiable (backward part)
def test_custom_function_mark_dirty_not_differentiable():
    class InplaceMul(Function):
        @staticmethod
        def forward(ctx, x):
            result = x.mul_(2)
            ctx.mark_dirty(result)
            return result

        @staticmethod
        def backward(ctx, grad_output):
            pass

    for requires_grad in (True, False):
        z = fw.tensor(1.0, requires_grad=requires_grad)
        x = z.clone()
        y = InplaceMul.apply(x)
        assert x is y  # a dirty tensor is returned as is
        assert_close(x, (z * 2).detach())


def test_custom_function_mark_output_view_of_intermediate():  # test_custom_function_mark_output_view_of_intermediate
    class Func(Function):
        @staticmethod
        def forward(ctx, inp):
            out = inp.clone().view_as(inp)
            ctx.mark_dirty(out)
            return out

        @staticmethod
        def backward(ctx, gO):
            pass

    a = fw.tensor([1.0], requires_grad=True)
    with pytest.raises(RuntimeError, match="received a tensor that was not an input."):
        Func.apply(a.clone())


class AddOneInplace(Function):  # test_custom_function_inplace_on_non_default_view / _on_view_of_leaf
    @staticmethod
    def forward(ctx, inp):
        inp.add_(1)
        ctx.mark_dirty(inp)
        return inp

    @staticmethod
    def backward(ctx, gO):
        pass


def test_custom_function_inplace_on_non_default_view():  # test_custom_function_inplace_on_non_default_view
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    b, c = a.split_with_sizes([1, 1], dim=0)
    with pytest.raises(RuntimeError, match="output of a function that returns multiple view"):
        AddOneInplace.apply(b)


def test_custom_function_inplace_on_view_of_leaf():  # test_custom_function_inplace_on_view_of_leaf
    a = fw.tensor([1.0, 2.0], requires_grad=True)
    b = a.view_as(a)
    with pytest.raises(RuntimeError, match="a view of a leaf Variable that requires grad"):
        AddOneInplace.apply(b)


def test_custom_function_saving_mutated_view_no_leak():  # test_custom_function_saving_mutated_view_no_leak
    import weakref

    class Test(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.mark_dirty(x)
            ctx.save_for_backward(x)
            return x

        @staticmethod
        def backward(ctx, grad):
            pass

    def scope():
        x = fw.tensor(1.0, requires_grad=True).clone()
        x = x.view_as(x)
        Test.apply(x)
        return weakref.ref(x)

    gc.disable()
    try:
        ref = scope()
        assert ref() is None  # no reference cycle keeps x alive
    finally:
        gc.enable()


def test_custom_function_return_view_in_nograd():  # test_custom_function_return_view_in_nograd
    class Alias(Function):
        @staticmethod
        def forward(ctx, x):
            return x[:]

        @staticmethod
        def backward(ctx, gx):
            return gx

    inp = fw.rand(2, requires_grad=True)
    with fw.no_grad():
        output = Alias.apply(inp)
    with fw.no_grad():
        expected = inp[:]
    assert output.requires_grad == expected.requires_grad  # True: a view of inp (PyTorch's rule)
    with pytest.raises(RuntimeError, match="A view was created in no_grad mode and is being modified inplace"):
        output.zero_()


def test_custom_function_local_inplace():  # test_custom_function_local_inplace
    class MyFn(Function):
        @staticmethod
        def forward(ctx, inp, inplace):
            view = inp.clone()[:3]
            if inplace:
                view += 2
            return view

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    base = fw.rand(10, requires_grad=True)
    assert MyFn.apply(base, False).grad_fn.name() == "MyFnBackward"
    assert MyFn.apply(base, True).grad_fn.name() == "MyFnBackward"


def test_inplace_on_view_python():  # TestAutogradDeviceType.test_inplace_on_view_python
    class PyAdd(Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.mark_dirty(x)
            x.add_(y)
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad, grad

    def func(root, b):
        x = root.clone()
        PyAdd.apply(x.narrow(1, 2, 2).narrow(0, 1, 2), b)
        PyAdd.apply(x.narrow(1, 0, 2).narrow(0, 1, 2), b)
        return x

    gradcheck(func, [f64(4, 4, requires_grad=True), f64(2, 2, requires_grad=True, seed=1)])


def test_inplace_on_view_undefined_grad_output():  # TestAutogradDeviceType.test_inplace_on_view_undefined_grad_output
    a = fw.tensor([1.0], requires_grad=True)
    c = a.clone()
    v = c[:]
    b = fw.tensor(1.0, requires_grad=True)

    class InplaceFunc(Function):
        @staticmethod
        def forward(ctx, x, other):
            ctx.mark_dirty(x)
            return x.mul_(2)

        @staticmethod
        def backward(ctx, grad):
            return grad * 2, None

    out = InplaceFunc.apply(v, b)
    out.backward()
    assert b.grad is None
    assert a.grad.tolist() == [2.0]


def test_custom_function_dirty_view_not_first_input():
    # PyTorch's CopySlices takes the written view as the node's first input; a custom
    # Function may modify any of its inputs in place.
    class AddInto(Function):
        @staticmethod
        def forward(ctx, y, x):
            ctx.mark_dirty(x)
            x.add_(y)
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad, grad

    def func(root, b):
        x = root.clone()
        AddInto.apply(b, x.narrow(0, 1, 2))
        return x * x

    gradcheck(func, [f64(4, 3, requires_grad=True), f64(2, 3, requires_grad=True, seed=1)])
