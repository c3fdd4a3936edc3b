"""What each conv2d pass costs a GPU in calls, on ResNet-20's layers: counted on the CuPy stand-in.

A GPU pays 7-10 µs for every call from Python whatever it does, so a pass's call count
bounds its speed. For each distinct convolution of ResNet-20 (batch ``--batch``, float32)
and each pass, this counts, on the CuPy and cuDNN-frontend stand-ins:

* ``calls``: calls from the framework into CuPy (the stand-in's Python entry points:
  kernels, copies, and the views and attribute reads around them; an upper bound on the
  kernels launched);
* ``cudnn``: cuDNN frontend ``execute`` calls (:mod:`framework.testing.cupy_standin.counting`);

for the algorithm the GPU takes now (``conv_algorithms.choice``: cuDNN, or with
``--no-frontend`` im2col + matmul) beside what the CPU's choice (chunked Winograd and grid
under the default workspace limit) would cost if run on the GPU, as it did before the GPU
had its own. Run::

    INPLACE_LAB_CUPY=standin python -m benchmarks.gpu_conv_calls --batch 64
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import numpy as np

from benchmarks import common
from framework import backend
from framework.ops import conv
from framework.ops.conv_algorithms import ALGORITHMS, ConvGeometry, choice
from framework.ops.conv_algorithms.workspace import AUTO_WORKSPACE_CAP
from framework.testing import cudnn_standin
from framework.testing.cupy_standin import counting

# ResNet-20's distinct convolutions: (C_in, C_out, H, stride, count in the network)
LAYERS = [
    (3, 16, 32, 1, 1),
    (16, 16, 32, 1, 6),
    (16, 32, 32, 2, 1),
    (32, 32, 16, 1, 5),
    (32, 64, 16, 2, 1),
    (64, 64, 8, 1, 5),
]


PASSES = ("forward", "grad_weight", "grad_input")


def _run(name, plan, x, w, g, geom, limit, xp):
    """One pass of ``plan`` on raw arrays."""
    if name == "forward":
        return ALGORITHMS[plan.forward].forward(x, w, geom, limit, xp)
    if name == "grad_weight":
        return ALGORITHMS[plan.grad_weight].grad_weight(x, g, geom, limit, xp)
    return ALGORITHMS[plan.grad_input].grad_input(g, w, geom, limit, xp, False)


def _calls(fn, library_dirs):
    """(calls from the framework into CuPy, cuDNN executes) while ``fn`` runs. ``library_dirs``:
    the stand-ins (CuPy's first); calls among them are the libraries' own."""
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        caller = frame.f_back
        if event == "call" and frame.f_code.co_filename.startswith(library_dirs[0]):
            if caller is not None and not caller.f_code.co_filename.startswith(library_dirs):
                calls += 1

    with counting.count() as c:
        sys.setprofile(profile)
        try:
            fn()
        finally:
            sys.setprofile(None)
    return calls, c.by_kind().get("cudnn", 0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--no-frontend", action="store_true", help="as without nvidia-cudnn-frontend")
    args = parser.parse_args(argv)
    if backend.cupy_choice() != "standin":
        raise SystemExit("counts on the CuPy stand-in: run with INPLACE_LAB_CUPY=standin")
    if args.no_frontend:
        os.environ[backend.CUDNN_ENV] = "none"
        backend.forget_cudnn()
    xp = backend.cupy_module()
    library_dirs = tuple(os.path.dirname(os.path.abspath(m.__file__)) for m in (xp, cudnn_standin))
    rng = np.random.default_rng(0)
    totals = {"before": [0, 0], "now": [0, 0]}
    print(f"batch {args.batch}, float32; per pass: calls into CuPy (cuDNN executes)")
    print(f"{'layer':<22} {'pass':<12} {'before: CPU choice':>20} {'now: GPU choice':>20}")
    for c, co, hw, stride, count in LAYERS:
        x = xp.asarray(rng.standard_normal((args.batch, c, hw, hw)).astype(np.float32))
        w = xp.asarray(rng.standard_normal((co, c, 3, 3)).astype(np.float32))
        out_hw = ((hw + 2 - 3) // stride + 1,) * 2
        g = xp.asarray(rng.standard_normal((args.batch, co) + out_hw).astype(np.float32))
        geom = ConvGeometry(x.shape, w.shape, (stride, stride), (1, 1), out_hw)
        limit = min(AUTO_WORKSPACE_CAP, x.nbytes // 2)  # conv2d's "auto" limit for this input
        plans = {"before": choice.plan("auto", geom), "now": choice.plan("auto", geom, xp, conv.get_math_mode())}
        for name in PASSES:
            if name == "grad_input" and c == 3:
                continue  # the stem's input needs no gradient
            cells = []
            for when in ("before", "now"):
                call = functools.partial(_run, name, plans[when], x, w, g, geom, limit, xp)
                call()  # plans built, tables made
                calls, cudnn = _calls(call, library_dirs)
                totals[when][0] += calls * count
                totals[when][1] += cudnn * count
                cells.append(f"{calls} ({cudnn}) {getattr(plans[when], name)}")
            print(f"{c}->{co} {hw}x{hw} s{stride} x{count:<4} {name:<12} {cells[0]:>20} {cells[1]:>20}")
    for when, (calls, cudnn) in totals.items():
        print(f"whole network, forward and backward, {when}: {calls} calls into CuPy, {cudnn} cuDNN executes")
    print(
        common.legend(
            [
                ("layer", "in->out channels, input size, stride, x how many such layers ResNet-20 has"),
                ("before: CPU choice", "calls into CuPy (cuDNN executes), algorithm: the CPU's choice run on the GPU"),
                ("now: GPU choice", "the same for the algorithm the GPU takes now; totals count every layer"),
            ]
        )
    )


if __name__ == "__main__":
    main()
