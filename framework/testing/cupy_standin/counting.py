"""What costs time on a GPU, counted: kernel launches and host synchronizations.

A CuPy call from Python costs 7-10 µs whatever it does (a reduction about 28 µs), and a
host synchronization stalls the Python thread until the GPU drains its queue, so a step's
GPU speed is bounded by how many of each it makes. The stand-in cannot time a GPU, but
it can count these exactly: every routine that would launch a kernel on a real GPU calls
:func:`launch`, every call that would wait for the device calls :func:`host_sync`.

This module is the stand-in's own (real CuPy has none): tests and benchmarks use it to
hold launch and host-sync budgets, per op and per training step::

    from framework.testing.cupy_standin import counting

    with counting.count() as c:
        step()
    assert c.launches <= 400 and c.host_syncs == 0
    print(c.by_kind())

Kinds name what a real GPU would run: ``"elementwise"`` (ufuncs, fills, casts, ``where``),
``"reduction"``, ``"scan"`` (cumsum, the count of a mask), ``"copy"`` (copies, copyto,
concatenate, a reshape that must copy), ``"memset"`` (``zeros``), ``"matmul"`` (matmul,
dot, einsum), ``"gather"`` and ``"scatter"`` (advanced indexing, take, put,
``scatter_add``), ``"sort"``, ``"random"``, ``"h2d"`` (a host-to-device copy), ``"nccl"``,
and for the kernels and libraries others add: ``"kernel"`` (``ElementwiseKernel``,
``ReductionKernel``, ``RawKernel``), ``"cudnn"``, and ``"graph"`` (one
``cupy.cuda.Graph.launch``, whatever it replays). Views, ``empty`` and an operation on
an empty array launch nothing (CuPy skips the kernel). Host synchronizations: ``"get"``
(``.get()``, ``asnumpy``, printing), ``"float"``, ``"int"``, ``"bool"``, ``"complex"``,
``"item"``, ``"tolist"``, ``"tobytes"``, ``"mask"`` and ``"nonzero"`` (the count of a
boolean mask read back), ``"synchronize"`` (device, stream, event).

The site of a count is the first frame outside the stand-in and ``framework/backend.py``
(whose helpers only pass a call on).
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys

_STANDIN_DIR = os.path.dirname(os.path.abspath(__file__))
# framework/backend.py: its helpers (to_numpy, to_device, synchronize...) only pass a call
# on, so the site is their caller's line.
_BACKEND = os.path.join(os.path.dirname(os.path.dirname(_STANDIN_DIR)), "backend.py")


class Counts:
    """Launches and host synchronizations made while a :func:`count` block ran.

    Attributes:
        launch_sites: Counter of ``(kind, "file:line")`` -> launches.
        sync_sites: Counter of ``(kind, "file:line")`` -> host synchronizations.
    """

    def __init__(self) -> None:
        self.launch_sites: collections.Counter = collections.Counter()
        self.sync_sites: collections.Counter = collections.Counter()

    @property
    def launches(self) -> int:
        return sum(self.launch_sites.values())

    @property
    def host_syncs(self) -> int:
        return sum(self.sync_sites.values())

    def by_kind(self, syncs: bool = False) -> dict:
        """``{kind: count}`` of the launches (or, with ``syncs``, of the host synchronizations)."""
        out: collections.Counter = collections.Counter()
        for (kind, _site), n in (self.sync_sites if syncs else self.launch_sites).items():
            out[kind] += n
        return dict(out)

    def by_site(self, syncs: bool = False) -> dict:
        """``{"file:line": count}``: where in the caller's code the launches (or syncs) came from."""
        out: collections.Counter = collections.Counter()
        for (_kind, site), n in (self.sync_sites if syncs else self.launch_sites).items():
            out[site] += n
        return dict(out)


_active: list[Counts] = []

#: Set by :mod:`.cuda.graph` while some stream captures: ``guard("launch" | "sync", kind)``
#: raises what CUDA or CuPy raise for a launch it cannot record or a host synchronization.
_capture_guard = None


def _call_site() -> str:
    """``file:line`` of the first frame outside the stand-in and framework/backend.py (the
    code that made the call)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not (path.startswith(_STANDIN_DIR + os.sep) or path == _BACKEND):
            break
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.relpath(frame.f_code.co_filename)}:{frame.f_lineno}"


def launch(kind: str, n: int = 1, stream_checked: bool = False) -> None:
    """Records ``n`` kernel launches of ``kind`` (a no-op unless a :func:`count` block is open).
    ``stream_checked``: the caller launched on a stream it named and checked against
    stream capture itself (a library handle's stream), not on the current stream."""
    if _capture_guard is not None and not stream_checked:
        _capture_guard("launch", kind)
    if _active:
        site = _call_site()
        for c in _active:
            c.launch_sites[(kind, site)] += n


def host_sync(kind: str) -> None:
    """Records one host synchronization of ``kind`` (a no-op unless a :func:`count` block is open)."""
    if _capture_guard is not None:
        _capture_guard("sync", kind)
    if _active:
        site = _call_site()
        for c in _active:
            c.sync_sites[(kind, site)] += 1


def count_after(fn, warmup: int = 1) -> Counts:
    """Counts one call of ``fn`` after ``warmup`` uncounted calls (which make the caches,
    lazily built state and optimizer buffers a first call makes): e.g. one training step."""
    for _ in range(warmup):
        fn()
    with count() as c:
        fn()
    return c


@contextlib.contextmanager
def count():
    """Counts the launches and host synchronizations made inside the block (blocks nest)."""
    c = Counts()
    _active.append(c)
    try:
        yield c
    finally:
        _active.remove(c)
