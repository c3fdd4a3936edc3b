"""2-D convolution and pooling on NCHW arrays: ``conv2d``, ``max_pool2d``, ``avg_pool2d``,
``adaptive_avg_pool2d``.

How conv2d computes (the same code runs on NumPy and CuPy):

* forward: the input is padded into a workspace buffer, ``as_strided`` gives a
  ``(N, C, kh, kw, Ho, Wo)`` window view of it without copying, the view is copied once
  into an im2col workspace ``cols`` and ONE matrix product with the weight gives the
  output. Which product is the ``contraction`` (see :data:`CONTRACTIONS`);
  ``benchmarks/bench_conv.py`` measures them and the fastest is the default.
* backward: ``grad_weight`` rebuilds ``cols`` from the saved input (a workspace freed at
  once, rather than keeping a 9x larger buffer alive between forward and backward) and
  contracts it with the output gradient; ``grad_input`` is a col2im fused with the
  product: for each of the kh*kw kernel offsets one matrix product ``w[:, :, i, j].T @ g``
  into one reused ``(N, C, Ho*Wo)`` workspace, slice-added into the padded gradient.
  The only Python loops run over kernel offsets, never over pixels, channels or batch.
* saved for backward: ``x`` only when the weight needs a gradient, ``w`` only when the
  input does; nothing else (the bias gradient needs only the output gradient).

Every padding buffer, im2col buffer and temporary goes through :mod:`framework.memory`
(category ``workspace``), so the counter sees them. The ``tensordot`` and ``einsum``
contractions are kept for comparison: they work on the window view directly and let the
array module make its own (uncounted) copies, which is one reason they are not the default.

Max pooling saves the argmax of each window as a window offset in the smallest unsigned
dtype that holds ``kh*kw`` offsets (``uint8`` for every usual kernel): one byte per
output element, instead of the whole input (4 bytes per input element for float32, 16x
more for a 2x2 pool). It is a private array, so an inplace op on the pooled input after
the pool (a later ``relu_``) costs nothing and cannot break its backward.
"""

from __future__ import annotations

import contextlib

from .. import memory
from ..autograd.function import Function
from ..backend import get_array_module

CONTRACTIONS = ("batched", "gemm", "tensordot", "einsum")
_default = ["gemm"]  # fastest of CONTRACTIONS forward+backward in benchmarks/bench_conv.py (CPU)


def get_contraction() -> str:
    """The contraction conv2d uses now (one of :data:`CONTRACTIONS`)."""
    return _default[-1]


def set_contraction(name: str) -> None:
    """Makes ``name`` (one of :data:`CONTRACTIONS`) the contraction conv2d uses."""
    _default[0] = _check_contraction(name)


@contextlib.contextmanager
def contraction(name: str):
    """``with contraction("gemm"): ...``: conv2d calls inside use that contraction."""
    _default.append(_check_contraction(name))
    try:
        yield
    finally:
        _default.pop()


def _check_contraction(name):
    if name not in CONTRACTIONS:
        raise ValueError(f"unknown conv2d contraction {name!r}; use one of {', '.join(CONTRACTIONS)}")
    return name


# --- argument and geometry helpers ------------------------------------------------------

def _pair(value, name: str, fn: str, minimum: int) -> tuple[int, int]:
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{fn}: {name} must be an int or a pair of ints, got {value!r}")
        pair = tuple(value)
    else:
        pair = (value, value)
    for v in pair:
        if isinstance(v, bool) or not isinstance(v, int) and not hasattr(v, "__index__"):
            raise TypeError(f"{fn}: {name} must be an int or a pair of ints, got {value!r}")
    pair = (int(pair[0]), int(pair[1]))
    if min(pair) < minimum:
        raise ValueError(f"{fn}: {name} must be >= {minimum}, got {value!r}")
    return pair


def _out_size(fn, hw, kernel, stride, padding):
    """Output (Ho, Wo); raises when the kernel does not fit in the padded input."""
    ph, pw = hw[0] + 2 * padding[0], hw[1] + 2 * padding[1]
    if kernel[0] > ph or kernel[1] > pw:
        raise RuntimeError(
            f"{fn}: calculated padded input size per channel: ({ph} x {pw}). Kernel size: "
            f"({kernel[0]} x {kernel[1]}). Kernel size can't be greater than actual input size; "
            "use a smaller kernel, more padding, or a larger input"
        )
    return (ph - kernel[0]) // stride[0] + 1, (pw - kernel[1]) // stride[1] + 1


def _check_4d(fn, x, what="input"):
    if x.ndim != 4:
        raise RuntimeError(f"{fn}: expected a 4-D {what} (N, C, H, W), got shape {tuple(x.shape)}")


def _pad(x, padding, value, xp, category="workspace"):
    """``x`` padded by ``value`` in a counted buffer (``x`` itself when there is no padding)."""
    ph, pw = padding
    if ph == 0 and pw == 0:
        return x
    n, c, h, w = x.shape
    buf = memory.empty((n, c, h + 2 * ph, w + 2 * pw), x.dtype, xp, category)
    # Fill only the border: the interior is overwritten by x right after.
    if ph:
        buf[:, :, :ph] = value
        buf[:, :, -ph:] = value
    if pw:
        buf[:, :, ph:-ph or None, :pw] = value
        buf[:, :, ph:-ph or None, -pw:] = value
    buf[:, :, ph : ph + h, pw : pw + w] = x
    return buf


def _windows(xpad, kernel, stride, out_hw):
    """The ``(N, C, kh, kw, Ho, Wo)`` view of every window of ``xpad`` (no copy)."""
    xp = get_array_module(xpad)
    sn, sc, sh, sw = xpad.strides
    n, c = xpad.shape[:2]
    return xp.lib.stride_tricks.as_strided(
        xpad,
        shape=(n, c, kernel[0], kernel[1], out_hw[0], out_hw[1]),
        strides=(sn, sc, sh, sw, sh * stride[0], sw * stride[1]),
    )


def _offset(i, j, stride, out_hw):
    """The (rows, cols) slices of the padded input that kernel offset (i, j) touches."""
    return (
        slice(None),
        slice(None),
        slice(i, i + stride[0] * (out_hw[0] - 1) + 1, stride[0]),
        slice(j, j + stride[1] * (out_hw[1] - 1) + 1, stride[1]),
    )


def _unpad(gpad, padding, hw):
    ph, pw = padding
    if ph == 0 and pw == 0:
        return gpad
    return gpad[:, :, ph : ph + hw[0], pw : pw + hw[1]]


def _contiguous(a, xp):
    """``a`` itself when C-contiguous, else a counted contiguous copy (BLAS needs strides)."""
    if a.flags.c_contiguous:
        return a
    out = memory.empty(a.shape, a.dtype, xp, "workspace")
    xp.copyto(out, a)
    return out


# --- conv2d contractions ------------------------------------------------------------------
# Each one: forward(view, w) -> out (N, Co, Ho, Wo); prep_weight(g) / prep_input(g) ->
# the output gradient in the layout each gradient product wants; grad_weight(gw_g, view,
# w_shape) -> (Co, C, kh, kw); grad_input_offset(gx_g, wt_ij (C, Co), tmp) -> (N, C, Ho, Wo)
# for one kernel offset.

class _Batched:
    """cols ``(N, C*kh*kw, Ho*Wo)``; ``matmul(w2, cols)`` batched over N gives NCHW directly."""

    @staticmethod
    def cols(view, xp):
        cols = memory.empty(view.shape, view.dtype, xp, "workspace")
        xp.copyto(cols, view)
        n, c, kh, kw, ho, wo = view.shape
        return cols.reshape(n, c * kh * kw, ho * wo)

    @classmethod
    def forward(cls, view, w, xp):
        n, _, _, _, ho, wo = view.shape
        co = w.shape[0]
        cols = cls.cols(view, xp)
        out = memory.empty((n, co, ho, wo), w.dtype, xp, "activations")
        xp.matmul(_contiguous(w, xp).reshape(co, -1), cols, out=out.reshape(n, co, ho * wo))
        return out

    @staticmethod
    def prep_input(g, xp):
        n, co, ho, wo = g.shape
        return _contiguous(g, xp).reshape(n, co, ho * wo)

    prep_weight = prep_input

    @classmethod
    def grad_weight(cls, g3, view, w_shape, xp):
        cols = cls.cols(view, xp)
        n, co, k = g3.shape[0], g3.shape[1], cols.shape[1]
        per_image = memory.empty((n, co, k), g3.dtype, xp, "workspace")
        xp.matmul(g3, cols.transpose(0, 2, 1), out=per_image)
        del cols
        return per_image.sum(axis=0).reshape(w_shape)

    @staticmethod
    def grad_input_offset(g3, wt_ij, tmp, out_hw, xp):
        n, c = g3.shape[0], wt_ij.shape[0]
        tmp = tmp.reshape(n, c, -1)
        xp.matmul(wt_ij, g3, out=tmp)
        return tmp.reshape(n, c, out_hw[0], out_hw[1])


class _Gemm:
    """cols ``(C*kh*kw, N*Ho*Wo)``: one large GEMM, then a transpose to NCHW."""

    @staticmethod
    def cols(view, xp):
        n, c, kh, kw, ho, wo = view.shape
        cols = memory.empty((c, kh, kw, n, ho, wo), view.dtype, xp, "workspace")
        xp.copyto(cols, view.transpose(1, 2, 3, 0, 4, 5))
        return cols.reshape(c * kh * kw, n * ho * wo)

    @classmethod
    def forward(cls, view, w, xp):
        n, _, _, _, ho, wo = view.shape
        co = w.shape[0]
        cols = cls.cols(view, xp)
        flat = memory.empty((co, n * ho * wo), w.dtype, xp, "workspace")
        xp.matmul(_contiguous(w, xp).reshape(co, -1), cols, out=flat)
        del cols
        out = memory.empty((n, co, ho, wo), w.dtype, xp, "activations")
        xp.copyto(out, flat.reshape(co, n, ho, wo).transpose(1, 0, 2, 3))
        return out

    @staticmethod
    def prep_weight(g, xp):
        n, co, ho, wo = g.shape
        gt = memory.empty((co, n, ho, wo), g.dtype, xp, "workspace")
        xp.copyto(gt, g.transpose(1, 0, 2, 3))
        return gt.reshape(co, n * ho * wo)

    @classmethod
    def grad_weight(cls, gt, view, w_shape, xp):
        cols = cls.cols(view, xp)
        return xp.matmul(gt, cols.T).reshape(w_shape)

    # grad input: the per-offset products batched over N, as in _Batched. Measured: a
    # (C, N*Ho*Wo) product per offset needs a transposed slice-add that costs more than
    # the one large GEMM saves.
    prep_input = _Batched.prep_input
    grad_input_offset = _Batched.grad_input_offset


class _Tensordot:
    """``tensordot`` on the window view (the array module copies it internally)."""

    @staticmethod
    def forward(view, w, xp):
        t = xp.tensordot(w, view, axes=([1, 2, 3], [1, 2, 3]))  # (Co, N, Ho, Wo)
        out = memory.empty((t.shape[1], t.shape[0]) + t.shape[2:], w.dtype, xp, "activations")
        xp.copyto(out, t.transpose(1, 0, 2, 3))
        return out

    @staticmethod
    def prep_input(g, xp):
        return g

    prep_weight = prep_input

    @staticmethod
    def grad_weight(g, view, w_shape, xp):
        return xp.tensordot(g, view, axes=([0, 2, 3], [0, 4, 5]))

    @staticmethod
    def grad_input_offset(g, wt_ij, tmp, out_hw, xp):
        return xp.tensordot(wt_ij, g, axes=([1], [1])).transpose(1, 0, 2, 3)


class _Einsum:
    """``einsum(..., optimize=True)`` on the window view."""

    @staticmethod
    def forward(view, w, xp):
        return memory.track(xp.einsum("ocij,ncijhw->nohw", w, view, optimize=True), "activations")

    @staticmethod
    def prep_input(g, xp):
        return g

    prep_weight = prep_input

    @staticmethod
    def grad_weight(g, view, w_shape, xp):
        return xp.einsum("nohw,ncijhw->ocij", g, view, optimize=True)

    @staticmethod
    def grad_input_offset(g, wt_ij, tmp, out_hw, xp):
        return xp.einsum("co,nohw->nchw", wt_ij, g, optimize=True)


_IMPLS = {"batched": _Batched, "gemm": _Gemm, "tensordot": _Tensordot, "einsum": _Einsum}


class Conv2d(Function):
    """2-D cross-correlation (PyTorch's conv2d) of NCHW ``x`` with ``w`` (Co, C, kh, kw)."""

    saves = ("x", "w")
    saved_when = {"x": (1,), "w": (0,)}  # x only for w's gradient, w only for x's

    def forward(ctx, x, w, b=None, stride=(1, 1), padding=(0, 0), contraction="batched"):
        fn = "conv2d"
        _check_4d(fn, x)
        if w.ndim != 4:
            raise RuntimeError(f"{fn}: expected a 4-D weight (C_out, C_in, kh, kw), got shape {tuple(w.shape)}")
        if x.shape[1] != w.shape[1]:
            raise RuntimeError(
                f"{fn}: input has {x.shape[1]} channels (shape {tuple(x.shape)}) but the weight "
                f"{tuple(w.shape)} expects {w.shape[1]} input channels; check C_in of the layer"
            )
        if x.dtype != w.dtype or x.dtype.kind != "f":
            raise TypeError(
                f"{fn}: input ({x.dtype}) and weight ({w.dtype}) must have the same floating dtype"
            )
        if b is not None and (b.shape != (w.shape[0],) or b.dtype != w.dtype):
            raise RuntimeError(
                f"{fn}: bias must be a {w.dtype} vector of shape ({w.shape[0]},), got "
                f"{b.dtype} {tuple(b.shape)}"
            )
        xp = get_array_module(x)
        out_hw = _out_size(fn, x.shape[2:], w.shape[2:], stride, padding)
        ctx.geom = (x.shape, w.shape, stride, padding, out_hw)
        ctx.impl = _IMPLS[contraction]
        xpad = _pad(x, padding, 0, xp)
        out = ctx.impl.forward(_windows(xpad, w.shape[2:], stride, out_hw), w, xp)
        if b is not None:
            out += b.reshape(1, -1, 1, 1)
        return out

    def backward(ctx, g):
        xp = get_array_module(g)
        x_shape, w_shape, stride, padding, out_hw = ctx.geom
        impl = ctx.impl
        need_x, need_w, need_b = ctx.needs_input_grad
        gx = gw = gb = None
        if need_b:
            gb = g.sum(axis=(0, 2, 3))
        if not (need_x or need_w):
            return gx, gw, gb
        if need_w:
            x = ctx.x
            xpad = _pad(x, padding, 0, xp)
            view = _windows(xpad, w_shape[2:], stride, out_hw)
            gw = impl.grad_weight(impl.prep_weight(g, xp), view, w_shape, xp)
            del view
            del xpad
        if need_x:
            w = ctx.w
            n, c, h, wd = x_shape
            kh, kw = w_shape[2:]
            # (kh, kw, C, Co): wt[i, j] = w[:, :, i, j].T, contiguous for the products
            wt = memory.empty((kh, kw, c, w_shape[0]), w.dtype, xp, "workspace")
            xp.copyto(wt, w.transpose(2, 3, 1, 0))
            gpad = memory.zeros((n, c, h + 2 * padding[0], wd + 2 * padding[1]), g.dtype, xp, "gradients")
            tmp = memory.empty((n, c, out_hw[0], out_hw[1]), g.dtype, xp, "workspace")
            gp = impl.prep_input(g, xp)
            for i in range(kh):
                for j in range(kw):
                    gpad[_offset(i, j, stride, out_hw)] += impl.grad_input_offset(gp, wt[i, j], tmp, out_hw, xp)
            gx = _unpad(gpad, padding, (h, wd))
        return gx, gw, gb


def conv2d(input, weight, bias=None, stride=1, padding=0):  # noqa: A002  (PyTorch's names)
    """2-D convolution (cross-correlation, as PyTorch's ``conv2d``) over NCHW input.

    Args:
        input: ``(N, C_in, H, W)`` float tensor.
        weight: ``(C_out, C_in, kh, kw)`` tensor of the same dtype.
        bias: optional ``(C_out,)`` tensor.
        stride: int or (sh, sw), >= 1.
        padding: int or (ph, pw) zeros on each side, >= 0.

    Returns:
        ``(N, C_out, Ho, Wo)`` with ``Ho = (H + 2 ph - kh) // sh + 1`` (same for W).
    """
    stride = _pair(stride, "stride", "conv2d", 1)
    padding = _pair(padding, "padding", "conv2d", 0)
    return Conv2d.apply(input, weight, bias, stride=stride, padding=padding, contraction=get_contraction())


# --- pooling ----------------------------------------------------------------------------------

def _pool_args(fn, kernel_size, stride, padding):
    kernel = _pair(kernel_size, "kernel_size", fn, 1)
    stride = kernel if stride is None or stride == () or stride == [] else _pair(stride, "stride", fn, 1)
    padding = _pair(padding, "padding", fn, 0)
    if padding[0] > kernel[0] // 2 or padding[1] > kernel[1] // 2:
        raise ValueError(f"{fn}: pad should be at most half of kernel size, but got pad={padding} and kernel_size={kernel}")
    return kernel, stride, padding


def _index_dtype(xp, n_offsets):
    for dt in (xp.uint8, xp.uint16, xp.uint32):
        if n_offsets <= xp.iinfo(dt).max + 1:
            return dt
    return xp.int64


class MaxPool2d(Function):
    """Max over each window; saves the window offset of each max (one byte per output)."""

    def forward(ctx, x, kernel=(2, 2), stride=(2, 2), padding=(0, 0)):
        fn = "max_pool2d"
        _check_4d(fn, x)
        xp = get_array_module(x)
        out_hw = _out_size(fn, x.shape[2:], kernel, stride, padding)
        ctx.geom = (x.shape, kernel, stride, padding, out_hw)
        low = -xp.inf if x.dtype.kind == "f" else (xp.iinfo(x.dtype).min if x.dtype.kind in "iu" else False)
        xpad = _pad(x, padding, low, xp)
        shape = x.shape[:2] + out_hw
        out = memory.empty(shape, x.dtype, xp, "activations")
        track_index = any(ctx.needs_input_grad)
        idx = memory.zeros(shape, _index_dtype(xp, kernel[0] * kernel[1]), xp, "activations") if track_index else None
        better = memory.empty(shape, bool, xp, "workspace")
        nan = memory.empty(shape, bool, xp, "workspace") if x.dtype.kind == "f" else None
        for k in range(kernel[0] * kernel[1]):
            v = xpad[_offset(k // kernel[1], k % kernel[1], stride, out_hw)]
            if k == 0:
                xp.copyto(out, v)
                continue
            xp.greater(v, out, out=better)
            if nan is not None:  # NaN wins, so it propagates as in PyTorch
                xp.isnan(v, out=nan)
                xp.logical_or(better, nan, out=better)
            xp.copyto(out, v, where=better)
            if track_index:
                xp.copyto(idx, idx.dtype.type(k), where=better)  # a typed scalar: CuPy checks casts
        if track_index:
            ctx.keep(indices=idx)
        return out

    def backward(ctx, g):
        xp = get_array_module(g)
        x_shape, kernel, stride, padding, out_hw = ctx.geom
        idx = ctx.indices
        n, c, h, w = x_shape
        gpad = memory.zeros((n, c, h + 2 * padding[0], w + 2 * padding[1]), g.dtype, xp, "gradients")
        hit = memory.empty(idx.shape, bool, xp, "workspace")
        tmp = memory.empty(idx.shape, g.dtype, xp, "workspace")
        for k in range(kernel[0] * kernel[1]):
            xp.equal(idx, k, out=hit)
            xp.multiply(g, hit, out=tmp)
            gpad[_offset(k // kernel[1], k % kernel[1], stride, out_hw)] += tmp
        return _unpad(gpad, padding, (h, w))


class AvgPool2d(Function):
    """Mean over each window, padding zeros included in the count (PyTorch's default)."""

    def forward(ctx, x, kernel=(2, 2), stride=(2, 2), padding=(0, 0)):
        fn = "avg_pool2d"
        _check_4d(fn, x)
        if x.dtype.kind != "f":
            raise TypeError(f"{fn}: expected a floating input, got {x.dtype}")
        xp = get_array_module(x)
        out_hw = _out_size(fn, x.shape[2:], kernel, stride, padding)
        ctx.geom = (x.shape, kernel, stride, padding, out_hw)
        xpad = _pad(x, padding, 0, xp)
        out = memory.empty(x.shape[:2] + out_hw, x.dtype, xp, "activations")
        for k in range(kernel[0] * kernel[1]):
            v = xpad[_offset(k // kernel[1], k % kernel[1], stride, out_hw)]
            if k == 0:
                xp.copyto(out, v)
            else:
                out += v
        out *= 1.0 / (kernel[0] * kernel[1])
        return out

    def backward(ctx, g):
        xp = get_array_module(g)
        x_shape, kernel, stride, padding, out_hw = ctx.geom
        n, c, h, w = x_shape
        share = memory.empty(g.shape, g.dtype, xp, "workspace")
        xp.multiply(g, 1.0 / (kernel[0] * kernel[1]), out=share)
        gpad = memory.zeros((n, c, h + 2 * padding[0], w + 2 * padding[1]), g.dtype, xp, "gradients")
        for k in range(kernel[0] * kernel[1]):
            gpad[_offset(k // kernel[1], k % kernel[1], stride, out_hw)] += share
        return _unpad(gpad, padding, (h, w))


def _adaptive_matrix(xp, n_in, n_out, dtype):
    """(n_out, n_in): row i averages PyTorch's bin [floor(i n_in / n_out), ceil((i+1) n_in / n_out))."""
    i = xp.arange(n_out)
    start = (i * n_in) // n_out
    end = ((i + 1) * n_in + n_out - 1) // n_out
    pos = xp.arange(n_in)
    inside = (pos[None, :] >= start[:, None]) & (pos[None, :] < end[:, None])
    return (inside / (end - start)[:, None]).astype(dtype)


class AdaptiveAvgPool2dSeparable(Function):
    """Adaptive mean pooling for any sizes: ``Ph @ x @ Pw.T`` (bins overlap when sizes do not divide)."""

    def forward(ctx, x, output_size=(1, 1)):
        xp = get_array_module(x)
        ph = _adaptive_matrix(xp, x.shape[2], output_size[0], x.dtype)
        pw = _adaptive_matrix(xp, x.shape[3], output_size[1], x.dtype)
        ctx.ph, ctx.pw = ph, pw  # tiny (out x in) matrices, not inputs: plain attributes
        rows = xp.matmul(ph, x)  # (N, C, oh, W)
        return xp.matmul(rows, pw.T)

    def backward(ctx, g):
        xp = get_array_module(g)
        return xp.matmul(xp.matmul(ctx.ph.T, g), ctx.pw)


def max_pool2d(input, kernel_size, stride=None, padding=0):  # noqa: A002
    """Max pooling over NCHW input (PyTorch's ``max_pool2d``, ``ceil_mode=False``).

    Args:
        input: ``(N, C, H, W)`` tensor.
        kernel_size: int or (kh, kw).
        stride: int or pair; defaults to ``kernel_size``.
        padding: int or pair of implicit ``-inf`` padding, at most half the kernel.

    Backward routes each output's gradient to the first maximum of its window (NaN counts
    as the maximum). Saves one small index per output, not the input.
    """
    kernel, stride, padding = _pool_args("max_pool2d", kernel_size, stride, padding)
    return MaxPool2d.apply(input, kernel=kernel, stride=stride, padding=padding)


def avg_pool2d(input, kernel_size, stride=None, padding=0):  # noqa: A002
    """Average pooling over NCHW input (PyTorch's ``avg_pool2d``: ``count_include_pad=True``).

    Args:
        input: ``(N, C, H, W)`` float tensor.
        kernel_size: int or (kh, kw).
        stride: int or pair; defaults to ``kernel_size``.
        padding: int or pair of implicit zero padding, at most half the kernel; the zeros
            count in each window's mean.
    """
    kernel, stride, padding = _pool_args("avg_pool2d", kernel_size, stride, padding)
    return AvgPool2d.apply(input, kernel=kernel, stride=stride, padding=padding)


def adaptive_avg_pool2d(input, output_size):  # noqa: A002
    """Averages NCHW input down to ``output_size`` (int, or (oh, ow) where None keeps that size).

    When the input size is a multiple of the output size this is ``avg_pool2d`` with
    kernel = stride = H // oh (W likewise); otherwise each output averages PyTorch's bin
    ``[floor(i H / oh), ceil((i + 1) H / oh))``, computed as two small matrix products.
    """
    fn = "adaptive_avg_pool2d"
    _check_4d(fn, input)
    if isinstance(output_size, (tuple, list)):
        if len(output_size) != 2:
            raise ValueError(f"{fn}: output_size must be an int or a pair, got {output_size!r}")
        size = tuple(input.shape[2 + k] if s is None else s for k, s in enumerate(output_size))
    else:
        size = (output_size, output_size)
    size = _pair(size, "output_size", fn, 1)
    h, w = input.shape[2:]
    if h == 0 or w == 0:
        raise RuntimeError(f"{fn}: input of shape {tuple(input.shape)} has an empty spatial dimension")
    if h % size[0] == 0 and w % size[1] == 0:
        kernel = (h // size[0], w // size[1])
        return AvgPool2d.apply(input, kernel=kernel, stride=kernel, padding=(0, 0))
    if input.dtype.kind != "f":
        raise TypeError(f"{fn}: expected a floating input, got {input.dtype}")
    return AdaptiveAvgPool2dSeparable.apply(input, output_size=size)
