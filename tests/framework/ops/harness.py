"""The one harness every op test goes through.

An op is described once, as an :class:`OpSpec`: a function of tensors, its float64 NumPy
reference, optionally its inplace form, the input shapes to try and the value domain of
each input. The harness then checks, for every case (a tuple of input shapes) and every
memory layout of the inputs (contiguous, transposed, strided slice):

- forward in float32 against the float64 reference (dtype, shape, values; inputs untouched;
  a view op shares memory and the version counter with its input, other ops do not);
- backward in float64 against central differences (:func:`framework.testing.gradcheck`);
- the inplace form against the ordinary one: same values and gradients, the same tensor
  object returned, ``_version`` bumped by exactly one; or, where the result would need a
  bigger shape than the written tensor, a RuntimeError that leaves it unchanged;
- what the inplace form costs: nothing (``memory="free"``), or exactly one copy of the
  overwritten input, recorded as ``inplace_copies`` (``memory="copy"``), according to
  ``framework.memory`` and to tracemalloc's NumPy domain.

Each input is a view (in the layout) of a contiguous leaf, its "storage"; gradients are
taken with respect to the storages. A test file is a table of specs plus one-line tests::

    SPECS = [OpSpec("exp", fw.exp, np.exp, UNARY, inplace=lambda x: x.exp_(), memory="free")]

    @pytest.mark.parametrize("case", harness.cases(SPECS))
    def test_forward(case):
        harness.check_forward(case)
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import tracemalloc
import zlib
from typing import Callable, Sequence

import numpy as np
import pytest

import framework as fw
from framework import memory
from framework.autograd import grad as autograd_grad
from framework.testing import assert_close, gradcheck

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
        memory: what the inplace form may allocate: ``"free"`` (nothing) or ``"copy"``
            (one copy of the overwritten input, counted as ``inplace_copies``).
        grad: False for ops without a gradient (comparisons).
        view: True for view ops (output shares memory and version with input 0), False
            for ops that return new memory, None to leave it to a dedicated test.
        layouts: the input layouts to try (``view`` needs contiguous inputs).
        rtol, atol: forward tolerances (float32 against the float64 reference).
    """

    name: str
    fn: Callable
    ref: Callable
    shapes: Sequence[tuple]
    domain: tuple = ((-2.0, 2.0),)
    inplace: Callable | None = None
    memory: str | None = None
    grad: bool = True
    view: bool | None = False
    layouts: tuple = LAYOUTS
    rtol: float = 1e-5
    atol: float = 1e-6

    def __post_init__(self):
        assert self.memory in (None, "free", "copy", "workspace"), self.memory
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

    def storages(self, dtype, requires_grad: bool):
        """Contiguous leaf tensors holding each input (plus the gaps a strided view skips).

        Values are drawn uniformly from the spec's domain with a seed derived from the
        case id, so a failure reproduces.
        """
        rng = np.random.default_rng(zlib.crc32(self.id.encode()))
        leaves = []
        for i, shape in enumerate(self.shapes):
            low, high = self.spec.domain[min(i, len(self.spec.domain) - 1)]
            lay = self.layout_of(i)
            values = np.asarray(rng.uniform(low, high, size=_storage_shape(shape, lay)))
            leaves.append(fw.tensor(values, dtype=dtype, requires_grad=requires_grad))
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

def _arrays(tensors):
    return [t.detach().numpy().copy() for t in tensors]


def _reference(case: Case, inputs):
    return np.asarray(case.spec.ref(*[a.astype(np.float64) for a in _arrays(inputs)]))


def check_forward(case: Case) -> None:
    """float32 forward against the float64 reference; inputs stay untouched."""
    spec = case.spec
    storages = case.storages(np.float32, requires_grad=True)
    inputs = case.views(storages)
    before = _arrays(inputs)
    expected = _reference(case, inputs)

    out = spec.fn(*inputs)

    want_dtype = np.dtype(np.float32) if expected.dtype.kind == "f" else expected.dtype
    assert out.dtype == want_dtype, f"{case.id}: dtype {out.dtype}, expected {want_dtype}"
    assert out.shape == expected.shape, f"{case.id}: shape {out.shape}, expected {expected.shape}"
    assert_close(out, expected, rtol=spec.rtol, atol=spec.atol, msg=case.id)
    for i, (t, b) in enumerate(zip(inputs, before)):
        np.testing.assert_array_equal(t.detach().numpy(), b, err_msg=f"{case.id}: input {i} was modified")
    if spec.view is True:
        assert np.shares_memory(out._data, inputs[0]._data), f"{case.id}: a view must share memory"
        assert out._vc is inputs[0]._vc, f"{case.id}: a view must share the version counter"
    elif spec.view is False and out.numel():
        for i, t in enumerate(inputs):
            assert not np.shares_memory(out._data, t._data), f"{case.id}: output aliases input {i}"
    if spec.grad:
        assert out.requires_grad and out.grad_fn is not None, f"{case.id}: no history recorded"
    else:
        assert not out.requires_grad and out.grad_fn is None, f"{case.id}: no gradient, no history"


def check_backward(case: Case) -> None:
    """float64 gradients of every input (through its layout) against finite differences,
    and the same gradients under policies ``on`` and ``off``.

    Under ``on`` the engine lets a backward write over a dead incoming gradient; ``off``
    takes every backward's allocating path (where NumPy returns scalars for 0-d results),
    so both paths are checked: equal values, and arrays, never NumPy scalars.
    """
    storages = case.storages(np.float64, requires_grad=True)
    gradcheck(lambda *s: case.spec.fn(*case.views(s)), storages)
    grads = {}
    for name in ("on", "off"):
        with fw.inplace.policy(name):
            grads[name] = _grads(case.spec.fn(*case.views(storages)), storages)
    for i, (on, off) in enumerate(zip(grads["on"], grads["off"], strict=True)):
        assert (on is None) == (off is None), f"{case.id}: input {i} has a gradient under one policy only"
        if on is not None:
            for name, g in (("on", on), ("off", off)):
                assert isinstance(g._data, np.ndarray), f"{case.id}: {name} gave a {type(g._data).__name__}"
            np.testing.assert_array_equal(off.numpy(), on.numpy(), err_msg=f"{case.id}: input {i}, off vs on")


def _weights(shape, seed=1):
    return fw.tensor(np.random.default_rng(seed).standard_normal(shape), dtype=fw.float64)


def _grads(out, storages):
    loss = (out * _weights(out.shape)).sum()
    return autograd_grad(loss, storages, allow_unused=True)


def check_inplace(case: Case) -> None:
    """The inplace form against the ordinary one, on a non-leaf (a clone, in the layout).

    Where the ordinary result is bigger than the written tensor (broadcasting would need
    to grow it), the inplace form must raise a RuntimeError and change nothing.
    """
    spec = case.spec
    # Values, identity and version, in float32.
    storages = case.storages(np.float32, requires_grad=True)
    inputs = case.views(storages)
    expected = spec.fn(*inputs)
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
    assert_close(out, expected, rtol=spec.rtol, atol=spec.atol, msg=case.id)

    # Gradients, in float64: d/d(every storage) through the ordinary and the inplace form.
    storages = case.storages(np.float64, requires_grad=True)
    inputs = case.views(storages)
    want = _grads(spec.fn(*inputs), storages)
    target = case.input(0, storages[0].clone())
    got = _grads(spec.inplace(target, *inputs[1:]), storages)
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), f"{case.id}: input {i} gradient presence differs"
        if g is not None:
            assert_close(g, w, rtol=1e-10, atol=1e-12, msg=f"{case.id}: gradient of input {i}")


# --- memory ----------------------------------------------------------------------------------

@dataclasses.dataclass
class Allocations:
    """Net bytes allocated (and still alive) inside an :func:`allocations` block."""

    framework: int = 0  # memory.allocated_bytes()
    framework_peak: int = 0  # memory.max_allocated_bytes() over the block
    numpy: int = 0  # tracemalloc, NumPy's domain
    inplace_copies: int = 0  # memory.breakdown()["inplace_copies"]
    inplace_copy_bytes: int = 0  # memory.stats()["inplace_copy_bytes"]


def _numpy_traced_bytes() -> int:
    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.DomainFilter(True, NUMPY_DOMAIN)])
    return sum(t.size for t in snap.traces)


@contextlib.contextmanager
def allocations():
    """``with allocations() as a: ...``; then ``a.numpy`` etc. hold the block's net bytes."""
    gc_was_on = gc.isenabled()
    gc.disable()  # no collection of older garbage in the middle of the measurement
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    a = Allocations()
    fw_before = memory.allocated_bytes()
    memory.reset_peak()
    copies_before = memory.breakdown()["inplace_copies"]
    stat_before = memory.stats().get("inplace_copy_bytes", 0)
    np_before = _numpy_traced_bytes()
    try:
        yield a
        a.numpy = _numpy_traced_bytes() - np_before
        a.framework = memory.allocated_bytes() - fw_before
        a.framework_peak = memory.max_allocated_bytes() - fw_before
        a.inplace_copies = memory.breakdown()["inplace_copies"] - copies_before
        a.inplace_copy_bytes = memory.stats().get("inplace_copy_bytes", 0) - stat_before
    finally:
        if started:
            tracemalloc.stop()
        if gc_was_on:
            gc.enable()


def assert_inplace_cost(run, target, expect: str, what: str = "") -> None:
    """Runs ``run()`` (an inplace op on ``target``) and checks what its forward allocates.

    ``expect="free"``: zero bytes per framework.memory (live and peak) and per tracemalloc.
    ``expect="copy"``: exactly one copy of ``target``, in every counter and the
    ``inplace_copies`` category.
    ``expect="workspace"``: nothing stays allocated and nothing is copied, but the kernel
    needs one counted temporary of ``target``'s size while it runs (``leaky_relu_``).
    """
    nbytes = target.nbytes if expect == "copy" else 0
    with allocations() as a:
        out = run()
    assert out is target
    got = dataclasses.asdict(a)
    want = {k: nbytes for k in got}
    if expect == "workspace":
        want["framework_peak"] = target.nbytes
    assert got == want, f"{what}: inplace forward allocated {got}, expected {want}"


def check_inplace_memory(case: Case) -> None:
    """The declared cost of the inplace form, with grad; and no copy at all without grad."""
    spec = case.spec
    storages = case.storages(np.float32, requires_grad=True)
    target = storages[0] * 1  # a non-leaf that autograd lets us overwrite
    assert_inplace_cost(lambda: spec.inplace(target, *storages[1:]), target, spec.memory, case.id)
    if len(case.shapes[0]) >= 2:
        # The same through a transposed view of a non-leaf (the base's history is rewritten).
        t_case = dataclasses.replace(case, layout="transposed")
        storages = t_case.storages(np.float32, requires_grad=True)
        inputs = t_case.views(storages)
        target = t_case.input(0, storages[0] * 1)
        assert target._base is not None and not target.is_contiguous()
        assert_inplace_cost(lambda: spec.inplace(target, *inputs[1:]), target, spec.memory, t_case.id)
    # Nothing needs a gradient: nothing is saved, so nothing is copied.
    plain = [s.detach() for s in case.storages(np.float32, requires_grad=False)]
    no_grad_cost = "workspace" if spec.memory == "workspace" else "free"
    assert_inplace_cost(lambda: spec.inplace(plain[0], *plain[1:]), plain[0], no_grad_cost, case.id + " without grad")
