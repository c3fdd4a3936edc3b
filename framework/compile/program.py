"""The Program: nodes (op, inputs, outputs, attributes) over SSA values.

A :class:`Value` is one version of one buffer's contents: shape, dtype, layout (byte
strides) and, when it shares memory with an earlier value, the *edge* that made it so:
``("view", src)`` for a view, ``("write", src)`` for a new version written in place over
``src``'s buffer, ``("alias", src)`` for the very same array seen again after a write
into its buffer through another view. Which values alias is derived from those edges by
:mod:`framework.compile.alias`.

A :class:`Node` is one recorded event, in program order. ``kind`` says what replay does:

``call``      an op's forward (``op`` is the Function class; ``inplace`` writes input 0)
``backward``  an op's backward (``fwd`` is the index of its forward node)
``grad_sum``  ``a + b`` of two gradients (in place into ``a`` when ``inplace``)
``copy``      a copy of a value (a leaf's first gradient that could not be adopted)
``fill``      a new buffer filled with a constant (the root gradient of ``backward()``)
``create``    a tensor made by a creation recipe (``fw.zeros``, ``fw.randn``, ...)

Node inputs and attributes are *templates*: a value reference (:class:`Ref`), a traced
scalar (an int slot into the program's scalar table), a constant, or a tuple/list/dict of
those. A value's array at replay is bound by its producer, or, for program inputs, read
from its :class:`Source`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .printing import format_program
from .refs import Ref, ScalarRef, StatsOut  # noqa: F401  (the template types, re-exported)


@dataclass(frozen=True)
class Source:
    """Where a program input is read at replay.

    ``kind`` is one of ``arg`` (``key`` = argument index), ``param`` (``obj`` = the
    Parameter), ``grad`` (``obj`` = the leaf whose ``.grad`` is read), ``buffer`` and
    ``tensor`` (``obj`` = the tensor), ``arggrad`` (the ``.grad`` of argument ``key``),
    ``state`` (``obj`` = (optimizer, parameter), ``key`` = the state entry), ``group`` (an
    optimizer hyperparameter: ``obj`` = (optimizer, group index)). ``name`` is what
    printing shows.
    """

    kind: str
    name: str
    obj: object = None
    key: object = None

    def read(self, args):
        """The input's array now (None when the tensor is gone)."""
        kind = self.kind
        if kind == "arg":
            return args[self.key]._data
        if kind == "param" or kind == "buffer" or kind == "tensor":
            return self.obj._data
        if kind == "grad" or kind == "arggrad":
            g = (args[self.key] if kind == "arggrad" else self.obj)._grad
            return None if g is None else g._data
        opt, p = self.obj
        t = opt.state.get(p, {}).get(self.key)
        return None if t is None else t._data

    def tensor(self, args=None):
        """The tensor object behind the source (for write-backs)."""
        kind = self.kind
        if kind == "arg":
            return args[self.key]
        if kind == "grad":
            return self.obj._grad
        if kind == "arggrad":
            return args[self.key]._grad
        if kind == "state":
            opt, p = self.obj
            return opt.state[p][self.key]
        return self.obj

    def same(self, other: Source) -> bool:
        """Whether two sources read the same place (identity of the objects behind them)."""
        if self is other:
            return True
        if self.kind != other.kind or self.key != other.key:
            return False
        a, b = self.obj, other.obj
        if isinstance(a, tuple) and isinstance(b, tuple):
            return len(a) == len(b) and all(x is y for x, y in zip(a, b))
        return a is b

    @property
    def mutable_state(self) -> bool:
        """Whether the step is expected to update this input in place (its chain is reported)."""
        return self.kind in ("param", "buffer", "state")


@dataclass(eq=False)
class Value:
    """One version of a buffer's contents."""

    id: int
    shape: tuple
    dtype: np.dtype
    strides: tuple
    producer: int | None = None  # node index; None for program inputs
    edge: tuple | None = None  # ("view" | "write" | "alias", source value id)
    source: Source | None = None  # program inputs only
    dense: bool = True  # occupies exactly prod(shape) * itemsize bytes (may own a planned buffer)
    name: str = ""
    version: int = 0  # writes into its buffer before it was defined (capture bookkeeping)
    dead: bool = False  # its producer was removed by dead-code elimination
    writable: bool = True  # False for read-only views (a broadcast gradient): never written over

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n

    def describe(self) -> str:
        shape = ", ".join(str(s) for s in self.shape)
        return f"{_dtype_name(self.dtype)}[{shape}]"


def _dtype_name(dtype) -> str:
    d = np.dtype(dtype)
    return (
        {"f": "f", "i": "i", "u": "u", "b": "b"}.get(d.kind, d.kind) + str(d.itemsize * 8) if d.kind != "b" else "bool"
    )


@dataclass(eq=False)
class Node:
    """One recorded event (see the module docstring for the kinds)."""

    index: int
    kind: str
    op: object = None  # the Function class (call, backward)
    inputs: list = field(default_factory=list)  # templates
    params: dict = field(default_factory=dict)  # templates
    outputs: list = field(default_factory=list)  # value ids (None: no gradient for that input)
    inplace: bool = False  # writes input 0's buffer (its output 0 is a "write" of it)
    site: tuple = ("<unknown>", 0)
    # call: needs (needs_input_grad), saved {name: value id}, saved_copies {name: input index},
    #       result_copied (an inplace kernel that returned another array: replay copies back)
    # backward: fwd (forward node index), reuse_grad, grad (value id of the incoming gradient)
    # create: recipe (callable (xp, shape, dtype) -> array), device
    # check: check (callable (array, *args, flag=None), see loss.TargetRangeCheck), args
    # fill: fill_value
    info: dict = field(default_factory=dict)
    reinplaced: bool = False  # made inplace by the re-inplace pass (not by the step itself)

    @property
    def name(self) -> str:
        """The op's name as users know it: ``add_``, ``Matmul``, ``ReluBackward0``, ``grad_sum``."""
        if self.kind == "call":
            op = self.op
            if self.inplace and not self.reinplaced:
                return getattr(op, "inplace_name", None) or op.__name__.lower() + "_"
            return op.__name__
        if self.kind == "backward":
            return self.info.get("label") or self.op.node_name
        if self.kind in ("create", "check"):
            return self.info.get("label", self.kind)
        return self.kind

    def value_refs(self) -> list[int]:
        """Every value this node reads (inputs, attributes, saved values, incoming gradient)."""
        out: list[int] = []
        for t in self.inputs:
            _collect(t, out)
        for t in self.params.values():
            _collect(t, out)
        if self.kind == "backward":
            out.append(self.info["grad"])
            out.extend(self.info.get("saved_values", ()))
        return out


def _collect(template, out: list) -> None:
    if isinstance(template, Ref):
        out.append(template.id)
    elif isinstance(template, (tuple, list)):
        for t in template:
            _collect(t, out)
    elif isinstance(template, dict):
        for t in template.values():
            _collect(t, out)


@dataclass(frozen=True)
class WriteBack:
    """After the step, ``source`` (a parameter, buffer or state entry) holds value ``value``.

    ``how`` is decided by the passes: ``bound`` (the value already lives in the input's
    own buffer: nothing to do), ``rebind`` (the tensor is pointed at the value's array),
    ``grad`` (a leaf's new ``.grad``), ``scalar`` (a Python number in optimizer state or
    a hyperparameter: ``value`` is a scalar slot), ``const`` (a Python number the step
    set: ``value`` is that number).
    """

    source: Source
    value: int | None
    how: str = "rebind"


@dataclass(eq=False)
class Program:
    """A captured step: values, nodes, outputs and write-backs, plus what the passes add."""

    values: list = field(default_factory=list)
    nodes: list = field(default_factory=list)
    inputs: list = field(default_factory=list)  # value ids of program inputs, in order of first use
    outputs: object = None  # template of what the step returns (Refs inside)
    writebacks: list = field(default_factory=list)
    scalars: list = field(default_factory=list)  # traced scalar expressions (see scalars.py)
    guards: list = field(default_factory=list)  # comparisons on traced scalars (see scalars.py)
    cleared_grads: list = field(default_factory=list)  # leaves whose .grad the step drops first
    name: str = "step"
    device: object = None  # the backend.Device every array of the step lives on (None: the CPU)

    # --- building -----------------------------------------------------------------
    def new_value(self, shape, dtype, strides, producer=None, edge=None, source=None, dense=True, name="") -> Value:
        v = Value(len(self.values), tuple(shape), np.dtype(dtype), tuple(strides), producer, edge, source, dense, name)
        self.values.append(v)
        return v

    def add_node(self, kind: str, **kw) -> Node:
        n = Node(len(self.nodes), kind, **kw)
        self.nodes.append(n)
        return n

    # --- queries ------------------------------------------------------------------
    def output_refs(self) -> list[int]:
        out: list[int] = []
        _collect(self.outputs, out)
        return out

    def sink_refs(self) -> list[int]:
        """Values that must survive the program: returned values and write-backs."""
        out = self.output_refs()
        for wb in self.writebacks:
            if wb.value is not None and wb.how != "scalar":
                out.append(wb.value)
        return out

    def users(self) -> dict[int, list[int]]:
        """value id -> indices of the nodes that read it, in order."""
        users: dict[int, list[int]] = {}
        for n in self.nodes:
            for v in n.value_refs():
                lst = users.setdefault(v, [])
                if not lst or lst[-1] != n.index:
                    lst.append(n.index)
        return users

    def renumber(self) -> None:
        """Makes ``node.index`` match positions again after nodes were removed."""
        remap = {}
        for i, n in enumerate(self.nodes):
            remap[n.index] = i
            n.index = i
        for v in self.values:
            if v.producer is not None:
                v.producer = remap.get(v.producer)
        for n in self.nodes:
            if n.kind == "backward":
                n.info["fwd"] = remap[n.info["fwd"]]

    # --- printing -------------------------------------------------------------------
    def __str__(self) -> str:
        return format_program(self)

    def __repr__(self) -> str:
        return f"<Program {self.name}: {len(self.nodes)} nodes, {len(self.values)} values>"
