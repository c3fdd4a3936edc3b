"""Traced Python numbers: hyperparameters and counters that change between calls.

A captured step bakes every Python number an op receives into its attributes, except
the ones that are expected to change between calls: the optimizer's hyperparameters
(``lr`` under a schedule), numbers in optimizer state (Adam's ``step``) and the number
arguments of the step, Python's and NumPy's scalars alike (a NumPy scalar keeps its type
through the recorded operations, as in eager). During capture those are :class:`Sym` objects: they behave
like the number they hold, and every arithmetic operation on them returns a new ``Sym``
that remembers the operation. At replay the recorded operations run again, on the new
inputs, with the same Python operators, so the scalars are bitwise what eager computes.

Python control flow on a ``Sym`` (``if momentum != 0``, ``bool(x)``) records a *guard*:
the comparison is checked again at each call and a different answer captures the step
again. Turning a ``Sym`` into a plain number (``float(x)``, ``int(x)``, a C function
such as ``math.sqrt(x)``) records a guard on its exact value; :meth:`Sym.sqrt` keeps it
symbolic (``framework.optim`` uses it for Adam's bias correction).

Syms are not a float subclass on purpose: C code reads a float subclass's value without
asking, so a silent use could never be detected.
"""

from __future__ import annotations

import math
import numbers
import operator

import numpy as np

_BINARY = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "truediv": operator.truediv,
    "floordiv": operator.floordiv,
    "mod": operator.mod,
    "pow": operator.pow,
}
_UNARY = {"neg": operator.neg, "pos": operator.pos, "abs": abs, "sqrt": math.sqrt, "item": lambda v: v.item()}
_COMPARE = {
    "eq": operator.eq,
    "ne": operator.ne,
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
}
_SYMBOL = {
    "add": "+",
    "sub": "-",
    "mul": "*",
    "truediv": "/",
    "floordiv": "//",
    "mod": "%",
    "pow": "**",
    "eq": "==",
    "ne": "!=",
    "lt": "<",
    "le": "<=",
    "gt": ">",
    "ge": ">=",
}


class Tape:
    """The scalar expressions of one capture, in creation order.

    Each entry is ``(op, operands)``: ``("input", (name,))`` or an operator with operands
    that are slot numbers (``int`` wrapped in :class:`_Slot`) or plain constants.
    ``guards`` are ``(slot, compare op, other operand, expected bool)``.
    """

    def __init__(self):
        self.entries: list[tuple] = []
        self.inputs: list[int] = []  # slots of input entries, in order
        self.guards: list[tuple] = []
        self.values: list = []  # concrete value of each slot during capture

    def add(self, op: str, operands: tuple, value) -> Sym:
        slot = len(self.entries)
        self.entries.append((op, operands))
        self.values.append(value)
        if op == "input":
            self.inputs.append(slot)
        return Sym(self, slot, value)

    def input(self, name: str, value) -> Sym:
        return self.add("input", (name,), value)


class _Slot(int):
    """An operand that refers to another slot (an int subclass, told apart from constants)."""

    __slots__ = ()


def _operand(tape: Tape, x):
    if isinstance(x, Sym):
        if x._tape is not tape:
            raise RuntimeError("a traced number from another capture reached this one")
        return _Slot(x._slot), x._value
    return x, x


class Sym:
    """A traced Python number (see the module docstring)."""

    __slots__ = ("_tape", "_slot", "_value")
    # NumPy scalars on the left (``np.float32(2) * lr``) defer to the Sym's reflected methods
    __array_ufunc__ = None

    def __init__(self, tape: Tape, slot: int, value):
        self._tape, self._slot, self._value = tape, slot, value

    @property
    def value(self):
        return self._value

    def __repr__(self):
        return f"Sym(${self._slot}={self._value!r})"

    # --- arithmetic: a new Sym that remembers the operation ---------------------------
    def _binary(self, name, other, reflected=False):
        if not isinstance(other, (Sym, numbers.Real)):
            return NotImplemented
        tape = self._tape
        a, av = _operand(tape, self)
        b, bv = _operand(tape, other)
        if reflected:
            a, av, b, bv = b, bv, a, av
        return tape.add(name, (a, b), _BINARY[name](av, bv))

    def __add__(self, o):
        return self._binary("add", o)

    def __radd__(self, o):
        return self._binary("add", o, True)

    def __sub__(self, o):
        return self._binary("sub", o)

    def __rsub__(self, o):
        return self._binary("sub", o, True)

    def __mul__(self, o):
        return self._binary("mul", o)

    def __rmul__(self, o):
        return self._binary("mul", o, True)

    def __truediv__(self, o):
        return self._binary("truediv", o)

    def __rtruediv__(self, o):
        return self._binary("truediv", o, True)

    def __floordiv__(self, o):
        return self._binary("floordiv", o)

    def __rfloordiv__(self, o):
        return self._binary("floordiv", o, True)

    def __mod__(self, o):
        return self._binary("mod", o)

    def __rmod__(self, o):
        return self._binary("mod", o, True)

    def __pow__(self, o):
        return self._binary("pow", o)

    def __rpow__(self, o):
        return self._binary("pow", o, True)

    def _unary(self, name):
        return self._tape.add(name, (_Slot(self._slot),), _UNARY[name](self._value))

    def __neg__(self):
        return self._unary("neg")

    def __pos__(self):
        return self._unary("pos")

    def __abs__(self):
        return self._unary("abs")

    def sqrt(self) -> Sym:
        """``math.sqrt`` of the number, kept symbolic."""
        return self._unary("sqrt")

    def as_python(self) -> Sym:
        """The number as an op's operand takes it (PyTorch's rule: a NumPy scalar is a Python
        number, ``item()``), kept symbolic; a Python number is itself."""
        return self._unary("item") if isinstance(self._value, np.generic) else self

    # --- control flow and conversions: guards ---------------------------------------------
    def _compare(self, name, other):
        if not isinstance(other, (Sym, numbers.Real)):
            return NotImplemented
        tape = self._tape
        b, bv = _operand(tape, other)
        result = _COMPARE[name](self._value, bv)
        tape.guards.append((self._slot, name, b, result))
        return result

    def __eq__(self, o):
        return self._compare("eq", o)

    def __ne__(self, o):
        return self._compare("ne", o)

    def __lt__(self, o):
        return self._compare("lt", o)

    def __le__(self, o):
        return self._compare("le", o)

    def __gt__(self, o):
        return self._compare("gt", o)

    def __ge__(self, o):
        return self._compare("ge", o)

    __hash__ = None  # a Sym used as a dict key would be a silent specialization

    def _specialize(self):
        self._tape.guards.append((self._slot, "eq", self._value, True))
        return self._value

    def __bool__(self):
        return bool(self._specialize())

    def __float__(self):
        return float(self._specialize())

    def __int__(self):
        return int(self._specialize())

    def __index__(self):
        return operator.index(self._specialize())


def concrete(x):
    """``x`` with a Sym replaced by its value (other objects unchanged)."""
    return x._value if isinstance(x, Sym) else x


def evaluate(entries: list, inputs: list) -> list:
    """Runs a tape's entries again: ``inputs`` are the new values of its input entries."""
    values: list = [None] * len(entries)
    it = iter(inputs)
    for slot, (op, operands) in enumerate(entries):
        if op == "input":
            values[slot] = next(it)
            continue
        args = [values[a] if type(a) is _Slot else a for a in operands]
        fn = _BINARY.get(op) or _UNARY[op]
        values[slot] = fn(*args)
    return values


def guards_hold(guards: list, values: list) -> bool:
    """Whether every recorded guard gives the answer it gave during capture."""
    for slot, name, other, expected in guards:
        b = values[other] if type(other) is _Slot else other
        if _COMPARE[name](values[slot], b) != expected:
            return False
    return True


def format_entry(slot: int, entry: tuple) -> str:
    op, operands = entry
    if op == "input":
        return f"$s{slot} = {operands[0]}"

    def show(a):
        return f"$s{int(a)}" if type(a) is _Slot else repr(a)

    if op in _UNARY:
        return f"$s{slot} = {op}({show(operands[0])})"
    return f"$s{slot} = {show(operands[0])} {_SYMBOL[op]} {show(operands[1])}"


def format_guard(guard: tuple) -> str:
    slot, name, other, expected = guard
    b = f"$s{int(other)}" if type(other) is _Slot else repr(other)
    return f"($s{slot} {_SYMBOL[name]} {b}) is {expected}"
