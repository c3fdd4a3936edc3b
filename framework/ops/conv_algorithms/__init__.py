"""How :mod:`framework.ops.conv` computes: the convolution algorithms, the rule that picks
one per layer, the pooling kernels, and the workspace limit they all respect.

- :mod:`.workspace`: the workspace limit, chunking of the batch, counted buffers.
- :mod:`.im2col`: im2col + one product per chunk, for every geometry; its product is one
  of four contractions (``batched``, ``gemm``, ``tensordot``, ``einsum``).
- :mod:`.grid`: stride 1: im2col over the padded grid (contiguous copies, one GEMM per
  chunk), the input gradient as the transposed convolution.
- :mod:`.winograd`: 3x3 stride 1: Winograd F(2x2, 3x3) and F(4x4, 3x3).
- :mod:`.choice`: which of them ``contraction("auto")`` (the default) takes per layer.
- :mod:`.gpu`: the GPU's: one cuDNN frontend call per pass (``cudnn``, ``cudnn_tf32``),
  or one im2col copy and one matmul (``im2col_gpu``) without the frontend; unchunked.
- :mod:`.pooling`: max and average pooling kernels.

Every algorithm has the same three entry points, on raw arrays (NumPy or CuPy, the
module ``xp`` of the caller), for a :class:`~.geometry.ConvGeometry` and a byte limit:
``forward(x, w, geom, limit, xp)``, ``grad_weight(x, g, geom, limit, xp)`` and
``grad_input(g, w, geom, limit, xp, overwrite)``; ``unsupported(geom)`` says why one
cannot run a geometry (None when it can). Nothing here touches autograd: the op
(:class:`framework.ops.conv.Conv2d`) decides what is saved and which pass runs.
"""

from .geometry import ConvGeometry
from .gpu import CUDNN, CUDNN_TF32, IM2COL_GPU
from .grid import GRID
from .im2col import BATCHED, EINSUM, GEMM, TENSORDOT
from .winograd import WINOGRAD2, WINOGRAD4

#: Every algorithm by name; the first four are the im2col contractions (every geometry),
#: the last three the GPU's (chosen on a GPU, never forced by name).
ALGORITHMS = {
    a.name: a for a in (BATCHED, GEMM, TENSORDOT, EINSUM, GRID, WINOGRAD2, WINOGRAD4, CUDNN, CUDNN_TF32, IM2COL_GPU)
}

__all__ = ["ALGORITHMS", "ConvGeometry"]
