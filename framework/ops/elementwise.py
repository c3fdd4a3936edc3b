"""Elementwise ops: arithmetic, activations, comparisons and the inplace fills.

Each class is one op in both forms: ``Exp.apply(x)`` allocates the output,
``Exp.apply_(x)`` writes into ``x`` through ``ctx.out``. What ``saves`` declares decides
what inplace costs: ops whose backward reads the result (exp, sqrt, tanh, sigmoid,
relu, leaky_relu_) or nothing (add, sub, neg, mul or div by a constant) are free in
place; ops whose backward reads the overwritten input (sin, cos, log, abs, pow, clamp,
mul or div by a tensor that needs a gradient) get a copy of it from the apply path,
counted as ``inplace_copies``. What each backward reads is what PyTorch's reads
(derivatives.yaml), so that the programs PyTorch accepts run here.

On a GPU the activations (relu, leaky_relu, sigmoid, tanh) run as ONE fused kernel each
way (:mod:`.kernels`), in place through the same ``ctx.out`` / reused gradient.
"""

from __future__ import annotations

import numpy as np

from .. import inplace as _inplace
from .. import memory
from ..autograd.function import ABSENT, Function
from ..backend import add_scaled_, get_array_module
from ..tensor import Tensor
from . import kernels as K
from .broadcast import astype, shape_of, sum_to


def _xp(*arrays):
    for a in arrays:
        if a.__class__ is np.ndarray:  # the common case, first
            return np
        if hasattr(a, "dtype") and hasattr(a, "shape"):
            return get_array_module(a)
    return get_array_module(arrays[0])


def _meta(a):
    if a.__class__ is np.ndarray:
        return a.shape, a.dtype
    return shape_of(a), getattr(a, "dtype", None)


def _grad_for(g, meta):
    return sum_to(g, meta[0], meta[1])


def _into(ctx, g, shape=None):
    """``g`` itself when backward may write its result over it, else None (allocate).

    The engine sets ``ctx.reuse_grad`` under policy ``on`` when it has proved the
    incoming gradient dead (see engine._execute); the result must also have g's shape.
    A backward that computes several gradients from g overwrites it LAST.
    """
    if ctx.reuse_grad and (shape is None or shape == g.shape):
        _inplace.count_owned("backward_grad", g.nbytes)
        return g
    return None


# --- the derivative of a mask ---------------------------------------------------------


class MaskedGrad(Function):
    """``g * mask`` where ``mask`` is a function of ``source``'s data alone (relu's
    ``result > 0``, abs's ``sign(x)``): a backward formula's product under
    ``create_graph``. The derivative of a mask is zero, and, as in PyTorch
    (``threshold_backward``, ``leaky_relu_backward``, ``sgn``), the edge to ``source`` is
    recorded and carries it: zeros of ``source``'s shape and dtype."""

    saves = ("source",)
    saved_when = {"source": (0,)}  # read only for g's gradient (its edge again)

    def forward(ctx, g, source, mask=None):
        ctx.ms = _meta(source)
        if hasattr(mask, "shape"):
            ctx.keep(mask=mask)  # counted and freed as a saved tensor
        else:
            ctx.mask = mask  # a number
        return _xp(g).multiply(g, mask)

    def backward(ctx, gg):
        gg_g = mask_grad(gg, ctx.mask, ctx.source) if ctx.needs_input_grad[0] else None
        zeros = None
        if ctx.needs_input_grad[1]:
            zeros = memory.zeros(ctx.ms[0], ctx.ms[1], get_array_module(gg), "gradients")
        return gg_g, zeros


def mask_grad(g, mask, source, out=None):
    """``g * mask`` (``out=`` as NumPy's), ``mask`` a function of ``source``'s data: on
    arrays (a first-order backward) the one multiply; on tensors (``create_graph``) a
    :class:`MaskedGrad`, whose edge to ``source`` carries the mask's zero derivative."""
    if g.__class__ is Tensor:
        return MaskedGrad.apply(g, source, mask=getattr(mask, "_data", mask))
    return _xp(g).multiply(g, mask, out=out)


# --- binary arithmetic ----------------------------------------------------------------


def _on_device(y, x):
    """``y`` itself, or where it is a traced scalar of a step captured into a CUDA graph
    (:mod:`framework.compile.cudagraph`), the 0-d device array of ``x``'s dtype the graph
    reads it from (the same value a Python number gives in ``x``'s dtype)."""
    return y.on_device(x.dtype) if hasattr(y, "on_device") and hasattr(x, "dtype") else y


_ALPHA = {"alpha": lambda c: c.alpha}


class Add(Function):
    inplace_name = "add_"
    auto_inplace = True
    saved_attrs = _ALPHA

    def forward(ctx, x, y, alpha=1):
        ctx.mx, ctx.my, ctx.alpha = _meta(x), _meta(y), alpha
        xp = _xp(x, y)
        if alpha != 1:
            y = y * alpha  # a Python scalar y stays one (xp.multiply would make it float64)
        y = _on_device(y, x)
        return xp.add(x, y, out=ctx.out)

    def backward(ctx, g):
        gx = _grad_for(g, ctx.mx) if ctx.needs_input_grad[0] else None
        gy = None
        if ctx.needs_input_grad[1]:
            gy = _grad_for(g if ctx.alpha == 1 else g * ctx.alpha, ctx.my)
        return gx, gy


class AddScaled(Function):
    """``x + alpha * y`` (``y`` a tensor of ``x``'s shape and dtype), for the optimizers'
    updates: in place it writes over ``x`` with no temporary of ``y``'s size (cache-sized
    blocks of ``alpha * y``); out of place a copy of ``x`` gets the same kernel, so both
    forms round alike (``backend.add_scaled_``). Not differentiable: updates run under
    ``no_grad``.
    """

    inplace_name = "add_"
    differentiable = False

    def forward(ctx, x, y, alpha=1):
        out = ctx.out if ctx.out is not None else memory.empty_like(x)
        if out is not x:  # out of place (or into a buffer a compiled step planned): x first
            get_array_module(x).copyto(out, x)
        add_scaled_(out, y, alpha)
        return out


class Sub(Function):
    inplace_name = "sub_"
    auto_inplace = True
    saved_attrs = _ALPHA

    def forward(ctx, x, y, alpha=1):
        ctx.mx, ctx.my, ctx.alpha = _meta(x), _meta(y), alpha
        xp = _xp(x, y)
        if alpha != 1:
            y = y * alpha  # a Python scalar y stays one (xp.multiply would make it float64)
        y = _on_device(y, x)
        return xp.subtract(x, y, out=ctx.out)

    def backward(ctx, g):
        gx = _grad_for(g, ctx.mx) if ctx.needs_input_grad[0] else None
        gy = _grad_for(-g if ctx.alpha == 1 else g * -ctx.alpha, ctx.my) if ctx.needs_input_grad[1] else None
        return gx, gy


class Mul(Function):
    inplace_name = "mul_"
    auto_inplace = True
    saves = ("x", "y")
    saved_when = {"x": (1,), "y": (0,)}  # each factor is needed only for the other's gradient

    def forward(ctx, x, y):
        ctx.mx, ctx.my = _meta(x), _meta(y)
        y = _on_device(y, x)
        return _xp(x, y).multiply(x, y, out=ctx.out)

    def backward(ctx, g):
        gy = _grad_for(g * ctx.x, ctx.my) if ctx.needs_input_grad[1] else None
        gx = None
        if ctx.needs_input_grad[0]:
            gx = _grad_for(_xp(g).multiply(g, ctx.y, out=_into(ctx, g, ctx.mx[0])), ctx.mx)
        return gx, gy


class Div(Function):
    """``x / y``. Backward reads what PyTorch's reads (derivatives.yaml): ``y`` for both
    gradients, ``x`` for ``y``'s only (``-g * (x / y) / y``), never the result: so a
    program may change the result in place afterwards (``v = x / n; v.mul_(2)``), as in
    PyTorch. In place, ``div_`` by a tensor that needs a gradient keeps a copy of ``x``
    (PyTorch clones it too); by a constant it is free."""

    inplace_name = "div_"
    auto_inplace = True
    saves = ("x", "y")
    saved_when = {"x": (1,)}

    def forward(ctx, x, y):
        ctx.mx, ctx.my = _meta(x), _meta(y)
        y = _on_device(y, x)
        return _xp(x, y).true_divide(x, y, out=ctx.out)

    def backward(ctx, g):
        y = ctx.y
        xp = _xp(g)
        if not ctx.needs_input_grad[1]:
            return _grad_for(xp.true_divide(g, y, out=_into(ctx, g, ctx.mx[0])), ctx.mx), None
        # PyTorch's -g * (x / y) / y, as -((g / y) * x) / y: g / y is x's gradient too
        q = xp.true_divide(g, y)
        if g.__class__ is Tensor:  # create_graph: ops with history
            gy = -((q * ctx.x) / y)
        else:  # one buffer (an array also for 0-d g, where NumPy would return scalars)
            gy = xp.multiply(q, ctx.x, out=xp.empty_like(g))
            xp.true_divide(gy, y, out=gy)
            xp.negative(gy, out=gy)
        gy = _grad_for(gy, ctx.my)
        return (_grad_for(q, ctx.mx) if ctx.needs_input_grad[0] else None), gy


class Pow(Function):
    inplace_name = "pow_"
    auto_inplace = True
    saves = ("x", "y", "result")
    saved_when = {"x": (0, 1), "y": (0, 1), "result": (1,)}
    saved_as = {"x": "self", "y": "exponent"}
    saved_attrs = {"result": lambda c: ABSENT if c.node_name == "PowBackward0" else c.saved_value("result")}

    def forward(ctx, x, y):
        ctx.mx, ctx.my = _meta(x), _meta(y)
        # PyTorch's overloads: pow(Tensor, Scalar), pow(Tensor, Tensor), pow(Scalar, Tensor)
        if not hasattr(y, "shape"):
            ctx.node_name = "PowBackward0"
        elif not hasattr(x, "shape"):
            ctx.node_name = "PowBackward2"
        else:
            ctx.node_name = "PowBackward1"
        return _xp(x, y).power(x, y, out=ctx.out)

    def backward(ctx, g):
        xp = _xp(g)
        gx = gy = None
        if ctx.needs_input_grad[0]:
            x, y = ctx.x, ctx.y
            # d/dx x**y = y * x**(y-1), and 0 where y == 0 (x**0 is constant, even at
            # x == 0 where the formula gives 0 * inf): PyTorch's pow_backward, literally,
            # so that its higher derivatives are PyTorch's too: for a scalar 0 a constant
            # zero (nothing to differentiate again), for a tensor a where() whose masked
            # branch carries no gradient
            if not hasattr(y, "shape"):
                if y == 0:
                    gx = memory.zeros(ctx.mx[0], ctx.mx[1], xp)
                else:
                    gx = _grad_for(g * (y * xp.power(x, y - 1)), ctx.mx)
            else:
                with np.errstate(divide="ignore", invalid="ignore"):  # the masked branch at x == 0
                    branch = g * (y * xp.power(x, y - 1))
                gx = _grad_for(xp.where(y == 0, 0, branch), ctx.mx)
        if ctx.needs_input_grad[1]:
            x = xp.asarray(ctx.x)
            # d/dy x**y = x**y * log(x), taken as 0 where x == 0 and y >= 0
            # (PyTorch's pow_backward_exponent; for y < 0 it is inf * -inf there)
            zero = xp.logical_and(x == 0, xp.asarray(ctx.y) >= 0)
            gy = _grad_for(g * xp.where(zero, 0, ctx.result * xp.log(x)), ctx.my)
        return gx, gy


class Maximum(Function):
    saves = ("x", "y")

    def forward(ctx, x, y):
        ctx.mx, ctx.my = _meta(x), _meta(y)
        return _xp(x, y).maximum(x, y, out=ctx.out)

    def backward(ctx, g):
        xp = _xp(g)
        x, y = ctx.x, ctx.y
        # Ties split the gradient evenly, as PyTorch does.
        share = astype(xp.where(x > y, 1.0, xp.where(x == y, 0.5, 0.0)), g.dtype)
        gx = _grad_for(g * share, ctx.mx) if ctx.needs_input_grad[0] else None
        gy = _grad_for(g * (1 - share), ctx.my) if ctx.needs_input_grad[1] else None
        return gx, gy


class Where(Function):
    saves = ("condition",)

    def forward(ctx, condition, x, y):
        ctx.mx, ctx.my = _meta(x), _meta(y)
        return _xp(condition, x, y).where(condition, x, y)

    def backward(ctx, g):
        xp = _xp(g)
        c = ctx.condition
        gx = _grad_for(xp.where(c, g, 0), ctx.mx) if ctx.needs_input_grad[1] else None
        gy = _grad_for(xp.where(c, 0, g), ctx.my) if ctx.needs_input_grad[2] else None
        return None, gx, gy


# --- unary ----------------------------------------------------------------------------


class Neg(Function):
    inplace_name = "neg_"
    auto_inplace = True

    def forward(ctx, x):
        return _xp(x).negative(x, out=ctx.out)

    def backward(ctx, g):
        return _xp(g).negative(g, out=_into(ctx, g))


class Abs(Function):
    inplace_name = "abs_"
    auto_inplace = True
    saves = ("x",)

    def forward(ctx, x):
        return _xp(x).abs(x, out=ctx.out)

    def backward(ctx, g):
        x = ctx.x
        return mask_grad(g, _xp(g).sign(x), x, out=_into(ctx, g))


class Exp(Function):
    inplace_name = "exp_"
    auto_inplace = True
    saves = ("result",)

    def forward(ctx, x):
        return _xp(x).exp(x, out=ctx.out)

    def backward(ctx, g):
        return _xp(g).multiply(g, ctx.result, out=_into(ctx, g))


class Log(Function):
    inplace_name = "log_"
    auto_inplace = True
    saves = ("x",)

    def forward(ctx, x):
        return _xp(x).log(x, out=ctx.out)

    def backward(ctx, g):
        return _xp(g).true_divide(g, ctx.x, out=_into(ctx, g))


class Sqrt(Function):
    inplace_name = "sqrt_"
    auto_inplace = True
    saves = ("result",)

    def forward(ctx, x):
        return _xp(x).sqrt(x, out=ctx.out)

    def backward(ctx, g):
        return _xp(g).true_divide(g, 2 * ctx.result, out=_into(ctx, g))


class Sin(Function):
    inplace_name = "sin_"
    auto_inplace = True
    saves = ("x",)

    def forward(ctx, x):
        return _xp(x).sin(x, out=ctx.out)

    def backward(ctx, g):
        xp = _xp(g)
        return xp.multiply(g, xp.cos(ctx.x), out=_into(ctx, g))


class Cos(Function):
    inplace_name = "cos_"
    auto_inplace = True
    saves = ("x",)

    def forward(ctx, x):
        return _xp(x).cos(x, out=ctx.out)

    def backward(ctx, g):
        xp = _xp(g)
        # An explicit buffer when g is not reused: for 0-d g NumPy would return a scalar.
        gx = xp.multiply(g, xp.sin(ctx.x), out=_into(ctx, g) if ctx.reuse_grad else xp.empty_like(g))
        return xp.negative(gx, out=gx)


class Tanh(Function):
    inplace_name = "tanh_"
    auto_inplace = True
    saves = ("result",)

    def forward(ctx, x):
        if K.tanh.fits(x):
            return K.launch(K.tanh, x, out=ctx.out)
        return _xp(x).tanh(x, out=ctx.out)

    def backward(ctx, g):
        y = ctx.result
        if K.tanh_backward.fits(g):
            return K.launch(K.tanh_backward, g, y, out=_into(ctx, g))
        xp = _xp(g)
        d = xp.multiply(y, y, out=xp.empty_like(y))  # y * y would be a scalar for 0-d y
        d = xp.subtract(1, d, out=d)
        return xp.multiply(g, d, out=_into(ctx, g) if ctx.reuse_grad else d)


class Sigmoid(Function):
    inplace_name = "sigmoid_"
    auto_inplace = True
    saves = ("result",)

    def forward(ctx, x):
        if K.sigmoid.fits(x):
            return K.launch(K.sigmoid, x, out=ctx.out)
        xp = _xp(x)
        # 1 / (1 + exp(-x)) written through one buffer: the inplace form allocates nothing.
        # (An explicit buffer also when out of place: for 0-d x, NumPy would return a scalar.)
        out = xp.negative(x, out=ctx.out if ctx.out is not None else xp.empty_like(x))
        xp.exp(out, out=out)
        out += 1
        return xp.reciprocal(out, out=out)

    def backward(ctx, g):
        y = ctx.result
        if K.sigmoid_backward.fits(g):
            return K.launch(K.sigmoid_backward, g, y, out=_into(ctx, g))
        xp = _xp(g)
        d = xp.subtract(1, y, out=xp.empty_like(y))  # 1 - y would be a scalar for 0-d y
        d *= y
        return xp.multiply(g, d, out=_into(ctx, g) if ctx.reuse_grad else d)


def relu_array(x, out=None):
    """``max(x, 0)`` of an array (ReLU's forward where no fused kernel runs; a compiled step
    replays it). NumPy's ``maximum`` against a scalar runs a scalar loop: a float array goes
    through ``clip(x, 0, inf)``, NumPy's SIMD loop (5x faster in cache, 1.6x on 33 MB),
    which keeps -0.0 as PyTorch's relu does."""
    xp = _xp(x)
    if xp is np and x.dtype.kind == "f":
        t = x.dtype.type
        return np.clip(x, t(0), t(np.inf), out=out)
    return xp.maximum(x, 0, out=out)


class Relu(Function):
    inplace_name = "relu_"
    auto_inplace = True
    saves = ("result",)

    def forward(ctx, x):
        if K.relu.fits(x):
            return K.launch(K.relu, x, out=ctx.out)
        return relu_array(x, out=ctx.out)

    def backward(ctx, g):
        if K.relu_backward.fits(g):
            return K.launch(K.relu_backward, g, ctx.result, out=_into(ctx, g))
        y = ctx.result
        return mask_grad(g, y > 0, y, out=_into(ctx, g))


class LeakyRelu(Function):
    """``leaky_relu`` out of place: backward reads the input, as PyTorch's
    (LeakyReluBackward0), so the result may be changed in place afterwards. Policy
    ``auto`` runs it in place only where nothing is saved (no gradient to record)."""

    inplace_name = "leaky_relu_"
    auto_inplace = True
    saves = ("x",)
    saved_attrs = {"negative_slope": lambda c: c.slope}

    def forward(ctx, x, negative_slope=0.01):
        ctx.slope = negative_slope
        if K.leaky_relu.fits(x):
            return K.launch(K.leaky_relu, x, negative_slope, out=ctx.out)
        xp = _xp(x)
        # y = max(x, slope*x) for slope <= 1 (min for slope > 1): one counted temporary,
        # where a mask-and-multiply would need three.
        scaled = memory.empty(x.shape, x.dtype, xp, "workspace")
        xp.multiply(x, negative_slope, out=scaled)
        pick = xp.maximum if negative_slope <= 1 else xp.minimum
        return pick(x, scaled, out=ctx.out)

    def backward(ctx, g):
        return _leaky_relu_backward(ctx, g, ctx.x)


class LeakyReluInplace(LeakyRelu):
    """``leaky_relu_``: backward reads the result (x > 0 iff y > 0 for a slope >= 0), so
    the inplace form is free, as PyTorch's (LeakyReluBackward1). With a negative slope
    the sign is lost: backward raises, with PyTorch's message."""

    node_name = "LeakyReluBackward1"
    saves = ("result",)
    auto_inplace = False  # only explicit calls: policy auto runs LeakyRelu in place

    def backward(ctx, g):
        if ctx.slope < 0:
            raise RuntimeError(
                "In-place leakyReLu backward calculation is triggered with a negative slope which is not "
                "supported. This is caused by calling in-place forward function with a negative slope, please "
                "call out-of-place version instead."
            )
        return _leaky_relu_backward(ctx, g, ctx.result)


def _leaky_relu_backward(ctx, g, source):
    """``g`` times leaky_relu's slope at each element, read from ``source`` (the input, or
    the result of the inplace form: both are > 0 at the same elements for a slope >= 0)."""
    if K.leaky_relu_backward.fits(g):
        return K.launch(K.leaky_relu_backward, g, source, ctx.slope, out=_into(ctx, g))
    if ctx.reuse_grad or g.__class__ is Tensor:  # Tensor: create_graph (the zero edge)
        sd = getattr(source, "_data", source)  # the scale: a function of the data alone
        scale = astype(_xp(sd).where(sd > 0, 1, ctx.slope), g.dtype)
        return mask_grad(g, scale, source, out=_into(ctx, g))
    return _xp(g).where(source > 0, g, g * ctx.slope)


class Clamp(Function):
    node_name = "ClampBackward1"  # clamp(Tensor, Scalar?, Scalar?)
    inplace_name = "clamp_"
    auto_inplace = True
    saves = ("x",)
    saved_attrs = {"min": lambda c: c.min, "max": lambda c: c.max}

    def forward(ctx, x, min=None, max=None):
        if min is None and max is None:
            raise ValueError("clamp needs at least one of min and max")
        ctx.min, ctx.max = min, max
        return _xp(x).clip(x, min, max, out=ctx.out)

    def backward(ctx, g):
        x = ctx.x
        xp = _xp(g)
        mask = True
        if ctx.min is not None:
            mask = x >= ctx.min
        if ctx.max is not None:
            mask = x <= ctx.max if mask is True else xp.logical_and(mask, x <= ctx.max)
        return xp.multiply(g, mask, out=_into(ctx, g))


class Cast(Function):
    """A copy in another dtype; the gradient is cast back."""

    node_name = "ToCopyBackward0"

    def forward(ctx, x, dtype=None):
        ctx.dtype = x.dtype
        return x.astype(dtype)

    def backward(ctx, g):
        return astype(g, ctx.dtype)


# --- comparisons (no gradient) ----------------------------------------------------------


def _comparison(ufunc_name):
    class Compare(Function):
        differentiable = False

        def forward(ctx, x, y):
            return getattr(_xp(x, y), ufunc_name)(x, y)

    Compare.__name__ = Compare.__qualname__ = ufunc_name.title().replace("_", "")
    return Compare


Eq = _comparison("equal")
Ne = _comparison("not_equal")
Lt = _comparison("less")
Le = _comparison("less_equal")
Gt = _comparison("greater")
Ge = _comparison("greater_equal")


# --- inplace fills -----------------------------------------------------------------------


class Fill(Function):
    """``x.fill_(v)``: the old values get no gradient; a tensor ``v`` gets the sum."""

    inplace_name = "fill_"

    def forward(ctx, x, value):
        ctx.mv = _meta(value)
        ctx.node_name = "FillBackward3" if hasattr(value, "shape") else "FillBackward2"  # fill_(Tensor) / (Scalar)
        out = ctx.out if ctx.out is not None else x.copy()
        out[...] = value
        return out

    def backward(ctx, g):
        gv = _grad_for(g.sum(), ctx.mv) if ctx.needs_input_grad[1] else None
        return None, gv


class Zero(Function):
    inplace_name = "zero_"

    def forward(ctx, x):
        out = ctx.out if ctx.out is not None else x.copy()
        out.fill(0)
        return out

    def backward(ctx, g):
        return None


class Copy(Function):
    """``x.copy_(src)``: src broadcasts to x and is cast to x's dtype."""

    node_name = "CopyBackwards"

    inplace_name = "copy_"

    def forward(ctx, x, src):
        ctx.ms = _meta(src)
        out = ctx.out if ctx.out is not None else x.copy()
        out[...] = src
        return out

    def backward(ctx, g):
        return None, (_grad_for(g, ctx.ms) if ctx.needs_input_grad[1] else None)


class Normal(Function):
    """``normal_(mean, std)``: new values from the generator; no gradient to the old ones."""

    inplace_name = "normal_"

    def forward(ctx, x, sample=None):
        out = ctx.out if ctx.out is not None else x.copy()
        out[...] = sample(out.shape, out.dtype)
        return out

    def backward(ctx, g):
        return None


class Uniform(Normal):
    """``uniform_(a, b)``: like :class:`Normal`, with uniform samples."""

    inplace_name = "uniform_"
