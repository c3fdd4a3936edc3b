"""The one harness every op test goes through.

An op is described once, as an :class:`OpSpec`: a function of tensors, its float64 NumPy
reference, optionally its inplace form, the input shapes to try and the value domain of
each input. The harness then checks, for every case (a tuple of input shapes) and every
memory layout of the inputs (contiguous, transposed, strided slice):

- forward in float32 against the float64 reference (dtype, shape, values; inputs untouched;
  a view op shares memory and the version counter with its input, other ops do not);
- backward in float64 against central differences (:func:`framework.testing.gradcheck`);
- second derivatives in float64: the gradient taken with ``create_graph=True``,
  differentiated again, against central differences of the first-order gradient
  (:func:`framework.testing.gradgradcheck`, fast mode);
- the inplace form against the ordinary one: same values and gradients, the same tensor
  object returned, ``_version`` bumped by exactly one; or, where the result would need a
  bigger shape than the written tensor, a RuntimeError that leaves it unchanged;
- what the inplace form costs: nothing (``memory="free"``), or exactly one copy of the
  overwritten input, recorded as ``inplace_copies`` (``memory="copy"``), according to
  ``framework.memory`` and to tracemalloc's NumPy domain.

Each input is a view (in the layout) of a contiguous leaf, its "storage"; gradients are
taken with respect to the storages. A test file is a table of specs plus one-line tests
that take the ``backend`` fixture of ``tests/conftest.py``::

    SPECS = [OpSpec("exp", fw.exp, np.exp, UNARY, inplace=lambda x: x.exp_(), memory="free")]

    @pytest.mark.parametrize("case", harness.cases(SPECS))
    def test_forward(case, backend):
        harness.check_forward(case, backend)

Every check then runs on ``"cpu"`` (NumPy) and on ``"cuda"`` (CuPy), the GPU leg marked
``gpu`` and skipped where :func:`framework.backend.is_cuda_available` is False. On the GPU
the inputs hold the same values as on the CPU, and each check compares with the NumPy
reference or with the CPU result, never only with the GPU itself: forward against the
float64 NumPy reference; backward against finite differences AND against the CPU's
gradients; the inplace form against the CPU's ordinary form. Memory is measured with
what applies on each device: on the CPU ``framework.memory``'s buffer counter and
tracemalloc's NumPy domain; on the GPU ``framework.memory``'s CuPy pool hook (which counts
allocations rounded up to the pool's 512-byte unit) and the ``inplace_copy_bytes``
event counter; tracemalloc sees no GPU memory. Where the GPU is the CuPy stand-in, each
op's forward and backward are also held to the spec's :class:`Budget` of kernel launches
and host synchronizations (counted by the stand-in; real CuPy counts nothing). Aliasing
is checked by data-pointer ranges (:func:`memory_overlaps`) on every device, never with
``xp.shares_memory``, whose CuPy answers are wrong for 0-d arrays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import tracemalloc
import zlib
from collections.abc import Callable, Sequence

import numpy as np
import pytest

import framework as fw
from framework import backend as fw_backend
from framework import memory
from framework.autograd import grad as autograd_grad
from framework.testing import assert_close, cupy_standin, gradcheck, gradgradcheck
from framework.testing.cupy_standin import counting

NUMPY_DOMAIN = np.lib.tracemalloc_domain  # 389047: where NumPy reports array data

# Cases (one shape per input) used by most tables; each stays <= 24 elements so that
# finite differences are cheap.
UNARY = [((),), ((5,),), ((2, 3),), ((2, 3, 4),)]
BINARY = [
    ((), ()),
    ((2, 3), (2, 3)),
    ((2, 3), ()),  # a 0-d tensor broadcasts like a scalar
    ((), (2, 3)),  # ... also as the first input (inplace: must refuse)
    ((3, 1), (1, 4)),  # both sides broadcast (inplace: must refuse)
    ((2, 3, 4), (4,)),
    ((4,), (2, 3, 4)),  # (inplace: must refuse)
]
# How inputs are laid out in memory: as allocated, as a transposed view of a storage in
# reversed shape, or as every other element of the last dim (a strided slice).
LAYOUTS = ("contiguous", "transposed", "strided")


@dataclasses.dataclass(frozen=True)
class Budget:
    """What one call of an op may cost on a GPU: kernel launches and host synchronizations
    of its forward and of its backward, at most, over every case and layout of its spec.

    Counted on the gpu leg when it runs on the CuPy stand-in (its ``counting``: one launch
    per kernel real CuPy would run, one sync per call that waits for the device); real
    CuPy counts nothing, so there the budget is not checked. The default fits one or two
    kernels forward and a backward of a few elementwise kernels per input plus the
    gradient's way back through the input's layout; ops that need more say so in their
    spec, with the numbers they make today, so that any added launch or sync fails.
    """

    forward: int = 2
    backward: int = 10
    forward_syncs: int = 0
    backward_syncs: int = 0


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One op (or one way of calling it) and how to check it.

    Attributes:
        name: shows in test ids.
        fn: ``fn(*tensors) -> Tensor``, the ordinary (out-of-place) form.
        ref: ``ref(*float64 arrays) -> array``, the NumPy reference.
        shapes: the cases: each a tuple with one shape per input.
        domain: ``(low, high)`` of the uniform values of each input; the last repeats.
        inplace: ``inplace(target, *others) -> Tensor``, the inplace form (writes into
            the first input and must return it), or None.
        memory: what the inplace form may allocate: ``"free"`` (nothing), ``"copy"``
            (one copy of the overwritten input, counted as ``inplace_copies``) or
            ``"workspace"`` (one counted temporary of the input's size while it runs).
        gpu_memory: the same on a GPU where it differs (a fused kernel needs no
            temporary: ``"free"``), else None.
        grad: False for ops without a gradient (comparisons).
        view: True for view ops (output shares memory and version with input 0), False
            for ops that return new memory, None to leave it to a dedicated test.
        layouts: the input layouts to try (``view`` needs contiguous inputs).
        rtol, atol: forward tolerances (float32 against the float64 reference).
        budget: launches and host syncs allowed on a GPU (:class:`Budget`).
    """

    name: str
    fn: Callable
    ref: Callable
    shapes: Sequence[tuple]
    domain: tuple = ((-2.0, 2.0),)
    inplace: Callable | None = None
    memory: str | None = None
    gpu_memory: str | None = None
    grad: bool = True
    view: bool | None = False
    layouts: tuple = LAYOUTS
    rtol: float = 1e-5
    atol: float = 1e-6
    budget: Budget = Budget()

    def __post_init__(self):
        assert self.memory in (None, "free", "copy", "workspace"), self.memory
        assert self.gpu_memory in (None, "free", "copy", "workspace"), self.gpu_memory
        assert self.gpu_memory is None or self.memory is not None, f"{self.name}: gpu_memory without memory"
        assert self.memory is None or self.inplace is not None, f"{self.name}: memory without inplace"

    def __repr__(self):
        return self.name


# --- cases: shapes x layouts ------------------------------------------------------------


def _fit(layout: str, ndim: int) -> str:
    """The layout an input of ``ndim`` dims gets: transposing needs 2 dims, striding 1."""
    if layout == "transposed" and ndim < 2:
        layout = "strided"
    if layout == "strided" and ndim < 1:
        layout = "contiguous"
    return layout


def _storage_shape(shape: tuple, layout: str) -> tuple:
    if layout == "transposed":
        return shape[::-1]
    if layout == "strided":
        return shape[:-1] + (2 * shape[-1],)
    return shape


def _in_layout(t, layout: str):
    """The view of a storage tensor that has the case's shape in ``layout``."""
    if layout == "transposed":
        return t.permute(*reversed(range(t.ndim)))
    if layout == "strided":
        return t[..., ::2]
    return t


@dataclasses.dataclass(frozen=True)
class Case:
    """One spec, one tuple of input shapes, one layout."""

    spec: OpSpec
    shapes: tuple
    layout: str

    @property
    def id(self) -> str:
        shapes = ",".join("x".join(map(str, s)) or "0d" for s in self.shapes)
        return f"{self.spec.name}-{shapes}-{self.layout}"

    def layout_of(self, i: int) -> str:
        return _fit(self.layout, len(self.shapes[i]))

    def storages(self, dtype, requires_grad: bool, device: str = "cpu"):
        """Contiguous leaf tensors holding each input (plus the gaps a strided view skips).

        Values are drawn uniformly from the spec's domain with a seed derived from the
        case id, so a failure reproduces, and are the same on every device.
        """
        rng = np.random.default_rng(zlib.crc32(self.id.encode()))
        leaves = []
        for i, shape in enumerate(self.shapes):
            low, high = self.spec.domain[min(i, len(self.spec.domain) - 1)]
            lay = self.layout_of(i)
            values = np.asarray(rng.uniform(low, high, size=_storage_shape(shape, lay)))
            leaves.append(fw.tensor(values, dtype=dtype, device=device, requires_grad=requires_grad))
        return leaves

    def views(self, storages):
        """The inputs the op sees: each storage in its layout (a non-contiguous view)."""
        return [_in_layout(s, self.layout_of(i)) for i, s in enumerate(storages)]

    def input(self, i: int, storage):
        return _in_layout(storage, self.layout_of(i))


def cases(specs, *, need: str | None = None):
    """pytest params: every case x layout of every spec.

    Args:
        need: ``"grad"`` keeps specs with a gradient, ``"inplace"`` those with an
            inplace form; None keeps all.
    """
    out = []
    for spec in specs:
        if need == "grad" and not spec.grad:
            continue
        if need == "inplace" and spec.inplace is None:
            continue
        for shapes in spec.shapes:
            max_ndim = max((len(s) for s in shapes), default=0)
            for layout in spec.layouts:
                if layout == "transposed" and max_ndim < 2 or layout == "strided" and max_ndim < 1:
                    continue
                case = Case(spec, tuple(shapes), layout)
                out.append(pytest.param(case, id=case.id))
    return out


def memory_cases(specs):
    """pytest params: one per spec with a declared inplace memory cost (its largest case)."""
    out = []
    for spec in specs:
        if spec.memory is None:
            continue
        shapes = max(spec.shapes, key=lambda s: (int(np.prod(s[0])), len(s[0])))
        case = Case(spec, tuple(shapes), "contiguous")
        out.append(pytest.param(case, id=spec.name))
    return out


# --- the checks -----------------------------------------------------------------------------

# Gradients computed on a GPU against the CPU's, both float64: only the order of the
# floating point operations differs (GPU reductions, fused multiply-adds).
CROSS_DEVICE_RTOL, CROSS_DEVICE_ATOL = 1e-8, 1e-10


def _arrays(tensors):
    return [t.detach().numpy().copy() for t in tensors]  # host copies, from any device


def _reference(case: Case, inputs):
    return np.asarray(case.spec.ref(*[a.astype(np.float64) for a in _arrays(inputs)]))


def memory_range(a) -> tuple[int, int]:
    """``[first byte, last byte + 1)`` of the elements of a NumPy or CuPy array, from its data
    pointer, shape and strides (negative strides reach below the pointer)."""
    iface = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    lo = hi = iface["data"][0]
    for n, stride in zip(a.shape, a.strides):
        if stride > 0:
            hi += (n - 1) * stride
        else:
            lo += (n - 1) * stride
    return lo, hi + a.itemsize


def memory_overlaps(a, b) -> bool:
    """Whether two arrays' byte ranges overlap (neither empty): the aliasing check of these
    tests, on every device. Not ``xp.shares_memory``: CuPy's answers by element addresses
    that an elementwise kernel reports, which for 0-d arrays are a local variable's (two
    distinct 0-d arrays "share", a 0-d view does not share with its base)."""
    if a.size == 0 or b.size == 0:
        return False
    (a_lo, a_hi), (b_lo, b_hi) = memory_range(a), memory_range(b)
    return a_lo < b_hi and b_lo < a_hi


def counts_launches(device: str) -> bool:
    """Whether ``device`` runs on the CuPy stand-in, which counts launches and host syncs."""
    return device != "cpu" and fw_backend.cupy_module() is cupy_standin


@contextlib.contextmanager
def within_budget(case: Case, device: str, what: str):
    """Counts the launches and host syncs of the block (on the stand-in) against the
    spec's :class:`Budget` for ``what`` ("forward" or "backward")."""
    if not counts_launches(device):
        yield
        return
    with counting.count() as c:
        yield
    budget = case.spec.budget
    launches, syncs = getattr(budget, what), getattr(budget, what + "_syncs")
    assert c.host_syncs <= syncs, (
        f"{case.id}: {what} made {c.host_syncs} host synchronizations (budget {syncs}): {c.by_site(syncs=True)}"
    )
    assert c.launches <= launches, f"{case.id}: {what} made {c.launches} launches (budget {launches}): {c.by_kind()}"


def check_forward(case: Case, device: str = "cpu") -> None:
    """float32 forward against the float64 reference; inputs stay untouched; on the
    stand-in's GPU, within the spec's launch and host-sync budget."""
    spec = case.spec
    storages = case.storages(np.float32, requires_grad=True, device=device)
    inputs = case.views(storages)
    before = _arrays(inputs)
    expected = _reference(case, inputs)

    with within_budget(case, device, "forward"):
        out = spec.fn(*inputs)

    want_dtype = np.dtype(np.float32) if expected.dtype.kind == "f" else expected.dtype
    assert out.dtype == want_dtype, f"{case.id}: dtype {out.dtype}, expected {want_dtype}"
    assert out.shape == expected.shape, f"{case.id}: shape {out.shape}, expected {expected.shape}"
    assert out.device == fw.device(device), f"{case.id}: output on {out.device}, inputs on {device}"
    assert_close(out, expected, rtol=spec.rtol, atol=spec.atol, msg=case.id)
    for i, (t, b) in enumerate(zip(inputs, before)):
        np.testing.assert_array_equal(t.detach().numpy(), b, err_msg=f"{case.id}: input {i} was modified")
    if spec.view is True:
        assert memory_overlaps(out._data, inputs[0]._data), f"{case.id}: a view must share memory"
        assert out._vc is inputs[0]._vc, f"{case.id}: a view must share the version counter"
    elif spec.view is False and out.numel():
        for i, t in enumerate(inputs):
            assert not memory_overlaps(out._data, t._data), f"{case.id}: output aliases input {i}"
    if spec.grad:
        assert out.requires_grad and out.grad_fn is not None, f"{case.id}: no history recorded"
    else:
        assert not out.requires_grad and out.grad_fn is None, f"{case.id}: no gradient, no history"


def check_backward(case: Case, device: str = "cpu") -> None:
    """float64 gradients of every input (through its layout) against finite differences,
    the same gradients under policies ``on`` and ``off``, and on a GPU against the CPU's
    (and, on the stand-in, the backward within the spec's launch and host-sync budget).

    Under ``on`` the engine lets a backward write over a dead incoming gradient; ``off``
    takes every backward's allocating path (where NumPy returns scalars for 0-d results),
    so both paths are checked: equal values, and arrays, never NumPy scalars.
    """
    storages = case.storages(np.float64, requires_grad=True, device=device)
    gradcheck(lambda *s: case.spec.fn(*case.views(s)), storages)
    if counts_launches(device):
        out = case.spec.fn(*case.views(storages))
        loss = (out * _weights(out.shape, device=out.device)).sum()
        with within_budget(case, device, "backward"):
            autograd_grad(loss, storages, allow_unused=True)
    grads = {}
    for name in ("on", "off"):
        with fw.inplace.policy(name):
            grads[name] = _grads(case.spec.fn(*case.views(storages)), storages)
    for i, (on, off) in enumerate(zip(grads["on"], grads["off"], strict=True)):
        assert (on is None) == (off is None), f"{case.id}: input {i} has a gradient under one policy only"
        if on is not None:
            for name, g in (("on", on), ("off", off)):
                assert fw.backend.is_array(g._data), f"{case.id}: {name} gave a {type(g._data).__name__}"
            np.testing.assert_array_equal(off.numpy(), on.numpy(), err_msg=f"{case.id}: input {i}, off vs on")
    if device == "cpu":
        return
    cpu = case.storages(np.float64, requires_grad=True)
    want = _grads(case.spec.fn(*case.views(cpu)), cpu)
    for i, (g, w) in enumerate(zip(grads["on"], want)):
        assert (g is None) == (w is None), f"{case.id}: input {i} gradient presence differs from the CPU"
        if g is not None:
            assert g.device == fw.device(device), f"{case.id}: gradient of input {i} on {g.device}"
            assert_close(
                g,
                w,
                rtol=CROSS_DEVICE_RTOL,
                atol=CROSS_DEVICE_ATOL,
                msg=f"{case.id}: gradient of input {i} on {device} against the CPU",
            )


def check_double_backward(case: Case, device: str = "cpu") -> None:
    """Second derivatives in float64 (through every input's layout) against finite
    differences of the first-order gradients (:func:`framework.testing.gradgradcheck`,
    fast mode); on a GPU also the second derivatives against the CPU's."""
    storages = case.storages(np.float64, requires_grad=True, device=device)
    fn = lambda *s: case.spec.fn(*case.views(s))  # noqa: E731
    gradgradcheck(fn, storages)
    if device == "cpu":
        return
    cpu = case.storages(np.float64, requires_grad=True)
    want = _second(fn, cpu)
    for i, (g, w) in enumerate(zip(_second(fn, storages), want)):
        assert (g is None) == (w is None), f"{case.id}: input {i} second derivative presence differs from the CPU"
        if g is not None:
            assert g.device == fw.device(device), f"{case.id}: second derivative of input {i} on {g.device}"
            assert_close(
                g,
                w,
                rtol=CROSS_DEVICE_RTOL,
                atol=CROSS_DEVICE_ATOL,
                msg=f"{case.id}: second derivative of input {i} on {device} against the CPU",
            )


def _second(fn, storages):
    """d/d(storages) of <gradient, fixed weights>, the gradient taken with create_graph."""
    out = fn(*storages)
    grads = autograd_grad(
        (out * _weights(out.shape, device=out.device)).sum(), storages, create_graph=True, allow_unused=True
    )
    phi = None
    for k, g in enumerate(grads):
        if g is not None and g.requires_grad:
            term = (g * _weights(g.shape, seed=2 + k, device=g.device)).sum()
            phi = term if phi is None else phi + term
    if phi is None:
        return [None] * len(storages)
    return autograd_grad(phi, storages, allow_unused=True)


def _weights(shape, seed=1, device="cpu"):
    return fw.tensor(np.random.default_rng(seed).standard_normal(shape), dtype=fw.float64, device=device)


def _grads(out, storages):
    loss = (out * _weights(out.shape, device=out.device)).sum()
    return autograd_grad(loss, storages, allow_unused=True)


def check_inplace(case: Case, device: str = "cpu") -> None:
    """The inplace form on ``device`` against the ordinary one on the CPU, on a non-leaf
    (a clone, in the layout).

    Where the ordinary result is bigger than the written tensor (broadcasting would need
    to grow it), the inplace form must raise a RuntimeError and change nothing.
    """
    spec = case.spec
    on_cpu = device == "cpu"
    # Values, identity and version, in float32.
    cpu = case.storages(np.float32, requires_grad=True)
    expected = spec.fn(*case.views(cpu))
    storages = cpu if on_cpu else case.storages(np.float32, requires_grad=True, device=device)
    inputs = case.views(storages)
    target = case.input(0, storages[0].clone())
    version, values = target._version, target.detach().numpy().copy()

    if expected.shape != target.shape:
        with pytest.raises(RuntimeError, match="broadcast"):
            spec.inplace(target, *inputs[1:])
        assert target._version == version, f"{case.id}: a refused inplace op bumped the version"
        np.testing.assert_array_equal(target.detach().numpy(), values, err_msg=f"{case.id}: refused op wrote")
        return

    out = spec.inplace(target, *inputs[1:])
    assert out is target, f"{case.id}: the inplace form must return the tensor it wrote"
    assert target._version == version + 1, f"{case.id}: version went {version} -> {target._version}"
    assert out.dtype == expected.dtype and out.shape == expected.shape
    assert out.device == fw.device(device)
    assert_close(out, expected, rtol=spec.rtol, atol=spec.atol, msg=case.id)

    # Gradients, in float64: d/d(every storage) through the ordinary form on the CPU and
    # the inplace form on the device.
    cpu = case.storages(np.float64, requires_grad=True)
    want = _grads(spec.fn(*case.views(cpu)), cpu)
    storages = cpu if on_cpu else case.storages(np.float64, requires_grad=True, device=device)
    inputs = case.views(storages)
    target = case.input(0, storages[0].clone())
    got = _grads(spec.inplace(target, *inputs[1:]), storages)
    rtol, atol = (1e-10, 1e-12) if on_cpu else (CROSS_DEVICE_RTOL, CROSS_DEVICE_ATOL)
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), f"{case.id}: input {i} gradient presence differs"
        if g is not None:
            assert_close(g, w, rtol=rtol, atol=atol, msg=f"{case.id}: gradient of input {i}")


# --- memory ----------------------------------------------------------------------------------

# CuPy's memory pool hands out blocks in multiples of 512 bytes, and framework.memory's
# pool hook counts those block sizes (``mem_size``; cupy.cuda.memory._round_size).
GPU_POOL_UNIT = 512


def gpu_pool_bytes(nbytes: int) -> int:
    """What the CuPy pool hook counts for an array of ``nbytes``."""
    return -(-nbytes // GPU_POOL_UNIT) * GPU_POOL_UNIT


@dataclasses.dataclass
class Allocations:
    """Net bytes allocated (and still alive) inside an :func:`allocations` block."""

    framework: int = 0  # memory.allocated_bytes() (on a GPU: the CuPy pool hook's count)
    framework_peak: int = 0  # memory.max_allocated_bytes() over the block
    numpy: int = 0  # tracemalloc, NumPy's domain (CPU only: 0 on a GPU, where nothing is traced)
    inplace_copies: int = 0  # memory.breakdown()["inplace_copies"] (the device's tracked buffers)
    inplace_copy_bytes: int = 0  # memory.stats()["inplace_copy_bytes"] (any device)


def _numpy_traced_bytes() -> int:
    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.DomainFilter(True, NUMPY_DOMAIN)])
    return sum(t.size for t in snap.traces)


@contextlib.contextmanager
def allocations(device: str = "cpu"):
    """``with allocations() as a: ...``; then ``a.numpy`` etc. hold the block's net bytes.

    On ``"cuda"`` the framework numbers are the CuPy pool's and ``a.numpy`` stays 0.
    """
    on_cpu = device == "cpu"
    gc_was_on = gc.isenabled()
    gc.disable()  # no collection of older garbage in the middle of the measurement
    started = on_cpu and not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    a = Allocations()
    try:
        with contextlib.ExitStack() as stack:
            if not on_cpu:
                # The CuPy pool hook counts for the block only (kept if it was on before): while
                # it is on, memory queries report the GPU; the CPU tests that follow read the host.
                stack.enter_context(memory.gpu_hook())
            fw_before = memory.allocated_bytes()
            memory.reset_peak()
            copies_before = memory.breakdown()["inplace_copies"]
            stat_before = memory.stats().get("inplace_copy_bytes", 0)
            np_before = _numpy_traced_bytes() if on_cpu else 0
            yield a
            a.numpy = _numpy_traced_bytes() - np_before if on_cpu else 0
            a.framework = memory.allocated_bytes() - fw_before
            a.framework_peak = memory.max_allocated_bytes() - fw_before
            a.inplace_copies = memory.breakdown()["inplace_copies"] - copies_before
            a.inplace_copy_bytes = memory.stats().get("inplace_copy_bytes", 0) - stat_before
    finally:
        if started:
            tracemalloc.stop()
        if gc_was_on:
            gc.enable()


def assert_inplace_cost(run, target, expect: str, what: str = "", device: str = "cpu", gpu_slack: int = 0) -> None:
    """Runs ``run()`` (an inplace op on ``target``) and checks what its forward allocates.

    ``expect="free"``: zero bytes per framework.memory (live and peak) and per tracemalloc.
    ``expect="copy"``: exactly one copy of ``target``, in every counter and the
    ``inplace_copies`` category.
    ``expect="workspace"``: nothing stays allocated and nothing is copied, but the kernel
    needs one counted temporary of ``target``'s size while it runs (``leaky_relu_``).

    On ``"cuda"`` the pool hook sees every allocation in 512-byte blocks, the framework's
    counted buffers and small uncounted temporaries alike (``add_(y, alpha=2)`` scales
    ``y`` first). So: what stays allocated is exact (nothing, or one block-rounded copy),
    ``inplace_copy_bytes`` is exact, and what comes and goes is at least the workspace and
    at most the workspace plus ``gpu_slack`` bytes (room for temporaries of the other
    operands, never of the target when it is larger than a block).
    """
    nbytes = target.nbytes if expect == "copy" else 0
    with allocations(device) as a:
        out = run()
    assert out is target
    got = dataclasses.asdict(a)
    if device == "cpu":
        want = {k: nbytes for k in got}
        if expect == "workspace":
            want["framework_peak"] = target.nbytes
        assert got == want, f"{what}: inplace forward allocated {got}, expected {want}"
        return
    live, transient = a.framework, a.framework_peak - a.framework
    low = gpu_pool_bytes(target.nbytes) if expect == "workspace" else 0
    msg = f"{what} on {device}: inplace forward allocated {got} (pool bytes)"
    assert live == gpu_pool_bytes(nbytes), f"{msg}; expected {gpu_pool_bytes(nbytes)} to stay allocated"
    assert a.inplace_copy_bytes == nbytes, f"{msg}; expected {nbytes} inplace_copy_bytes"
    assert low <= transient <= low + gpu_slack, f"{msg}; expected {low}..{low + gpu_slack} bytes to come and go"


def _slack(others) -> int:
    return sum(gpu_pool_bytes(t.nbytes) for t in others if isinstance(t, fw.Tensor))


def check_inplace_memory(case: Case, device: str = "cpu") -> None:
    """The declared cost of the inplace form, with grad; and no copy at all without grad."""
    spec = case.spec
    cost = spec.gpu_memory if device != "cpu" and spec.gpu_memory is not None else spec.memory
    storages = case.storages(np.float32, requires_grad=True, device=device)
    target = storages[0] * 1  # a non-leaf that autograd lets us overwrite
    assert_inplace_cost(
        lambda: spec.inplace(target, *storages[1:]), target, cost, case.id, device, _slack(storages[1:])
    )
    if len(case.shapes[0]) >= 2:
        # The same through a transposed view of a non-leaf (the base's history is rewritten).
        t_case = dataclasses.replace(case, layout="transposed")
        storages = t_case.storages(np.float32, requires_grad=True, device=device)
        inputs = t_case.views(storages)
        target = t_case.input(0, storages[0] * 1)
        assert target._base is not None and not target.is_contiguous()
        assert_inplace_cost(
            lambda: spec.inplace(target, *inputs[1:]), target, cost, t_case.id, device, _slack(inputs[1:])
        )
    # Nothing needs a gradient: nothing is saved, so nothing is copied.
    plain = [s.detach() for s in case.storages(np.float32, requires_grad=False, device=device)]
    no_grad_cost = "workspace" if cost == "workspace" else "free"
    assert_inplace_cost(
        lambda: spec.inplace(plain[0], *plain[1:]),
        plain[0],
        no_grad_cost,
        case.id + " without grad",
        device,
        _slack(plain[1:]),
    )
