"""The shape of one convolution, shared by every algorithm and by the op that picks one."""

from __future__ import annotations

from typing import NamedTuple


class ConvGeometry(NamedTuple):
    """Shapes and hyper-parameters of ``conv2d(x, w, stride, padding)`` (all ints)."""

    x_shape: tuple  # (N, C, H, W)
    w_shape: tuple  # (Co, C, kh, kw)
    stride: tuple  # (sh, sw)
    padding: tuple  # (ph, pw)
    out_hw: tuple  # (Ho, Wo)

    @property
    def kernel(self) -> tuple:
        return tuple(self.w_shape[2:])

    def dims(self, itemsize):
        """``(k, c, co, p, itemsize)``: the terms of the im2col per-image workspace formulas
        (``k = C*kh*kw``, ``p = Ho*Wo``)."""
        c, co = self.x_shape[1], self.w_shape[0]
        return c * self.w_shape[2] * self.w_shape[3], c, co, self.out_hw[0] * self.out_hw[1], itemsize

    def transposed(self) -> tuple[ConvGeometry, tuple]:
        """The input gradient of a stride-1 convolution as a stride-1 convolution.

        ``grad_x = conv2d(g', w')`` where ``w'[c, o, i, j] = w[o, c, kh-1-i, kw-1-j]`` and
        ``g'`` is the output gradient padded by ``kh-1-ph`` (``kw-1-pw``) zeros on each
        side, or cropped by as much where that is negative. Returns ``(geometry of that
        convolution, (crop_h, crop_w))``; the crops are >= 0 and its padding >= 0.
        """
        n, c, h, w = self.x_shape
        co, _, kh, kw = self.w_shape
        ho, wo = self.out_hw
        qh, qw = kh - 1 - self.padding[0], kw - 1 - self.padding[1]
        crop = (max(0, -qh), max(0, -qw))
        g_shape = (n, co, ho - 2 * crop[0], wo - 2 * crop[1])
        geom = ConvGeometry(g_shape, (c, co, kh, kw), (1, 1), (max(qh, 0), max(qw, 0)), (h, w))
        return geom, crop
