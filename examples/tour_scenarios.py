"""The scenarios of the inplace tour (chapters 1-4), each written once for two libraries.

Each scenario is a function ``fn(lib, note)``: ``lib`` is ``framework`` (``import
framework as fw``) or ``torch``, and only names the two share are used, so what runs on
both is the same code. ``note(expression, value)`` records what the scenario sees;
``with note.attempt(statement):`` records the error a statement raises (or ``no error``).
The ``why`` of each scenario says in one line why it behaves so; ``more`` says where this
framework tells more than PyTorch; ``differs`` explains, row by row, where the two differ
by design. ``examples/inplace_tour.py`` runs and prints them.

Paddle has ``scale_``; this framework and PyTorch write it ``mul_``.
"""

from __future__ import annotations

import contextlib

import framework as fw

# --- recording what a scenario sees --------------------------------------------------------


def is_torch(lib) -> bool:
    return lib.__name__ == "torch"


def show(value) -> str:
    """A value as the tour prints it: tensors as rounded lists, the rest as ``str``."""
    if hasattr(value, "tolist") and hasattr(value, "shape"):
        return str(_rounded(value.detach().tolist()))
    return str(value)


def _rounded(v):
    if isinstance(v, list):
        return [_rounded(e) for e in v]
    return round(v, 4) + 0.0  # + 0.0 turns -0.0 into 0.0


def grad_fn(t) -> str:
    """The name of ``t``'s grad_fn (``None`` for a leaf)."""
    node = t.grad_fn
    if node is None:
        return "None"
    return type(node).__name__ if type(t).__module__.startswith("torch") else node.name()


def copied_for_backward(lib, t, inplace_op) -> int:
    """Runs ``inplace_op(t)``; returns the bytes of ``t``'s old values kept for backward.

    The framework counts them (``inplace_copy_bytes`` in ``fw.memory.stats()``); for
    PyTorch the saved tensors of the new grad_fn are inspected: a saved tensor that does
    not share ``t``'s memory is the copy.
    """
    if is_torch(lib):
        node = inplace_op(t).grad_fn
        saved = [getattr(node, name) for name in dir(node) if name.startswith("_saved_")]
        return sum(s.nbytes for s in saved if isinstance(s, lib.Tensor) and s.data_ptr() != t.data_ptr())
    before = fw.memory.stats().get("inplace_copy_bytes", 0)
    inplace_op(t)
    return fw.memory.stats().get("inplace_copy_bytes", 0) - before


class Notes:
    """What one scenario saw on one library: ``(expression, printed value)`` rows."""

    def __init__(self):
        self.rows: list[tuple[str, str]] = []

    def __call__(self, key: str, value) -> None:
        self.rows.append((key, show(value)))

    @contextlib.contextmanager
    def attempt(self, key: str):
        """Runs the block; records ``no error`` or the error it raised (and goes on)."""
        try:
            yield
        except Exception as e:  # noqa: BLE001  (the error IS the result here)
            self.rows.append((key, f"{type(e).__name__}: {e}"))
        else:
            self.rows.append((key, "no error"))


class Scenario:
    """One case of an article: ``fn(lib, note)`` and what the tour says about it."""

    def __init__(self, number, title, source, why, fn, more=None, differs=None):
        self.number, self.title, self.source, self.why, self.fn = number, title, source, why, fn
        self.more = more  # where this framework says more than PyTorch
        self.differs = differs or {}  # row -> why the two libraries differ there, by design

    def run(self, lib) -> list[tuple[str, str]]:
        """The rows ``fn`` records on ``lib`` (``framework`` or ``torch``)."""
        notes = Notes()
        self.fn(lib, notes)
        return notes.rows


SCENARIOS: list[Scenario] = []
CHAPTERS = {
    "1": "Paddle's introduction to inplace",
    "2": "Paddle's article on inplace memory and speed",
    "3": "PyTorch's article on leaves and version counters",
    "4": "Where the articles are wrong",
}


def scenario(number, title, source, why, more=None, differs=None):
    """Registers the decorated ``fn(lib, note)`` as a scenario of the tour, in order."""

    def register(fn):
        SCENARIOS.append(Scenario(number, title, source, why, fn, more, differs))
        return fn

    return register


# --- 1. Paddle's introduction to inplace -----------------------------------------------------


@scenario(
    "1.1",
    "y = x.scale_(2.0) returns x itself (scale_ is mul_ here)",
    "Paddle intro",
    why="an inplace op writes into x's own storage and returns x, so y is a second name "
    "for the same tensor; the write bumps x's version counter",
)
def returns_itself(lib, note):
    x = lib.tensor([1.0, 2.0, 3.0])
    note("x._version before", x._version)
    y = x.mul_(2.0)
    note("y is x", y is x)
    note("x", x)
    note("x._version after", x._version)


@scenario(
    "1.2",
    "a.scale_(2.0) on a leaf that requires grad raises at once",
    "Paddle intro",
    why="a is the value its gradient belongs to and the optimizer updates: changed in place "
    "it would become an op's output and its .grad would no longer be the gradient of the "
    "parameter you hold (see 4.2)",
    more="the framework names the refused op (mul_) and says what to do instead",
)
def leaf_refuses_inplace(lib, note):
    a = lib.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with note.attempt("a.mul_(2.0)"):
        a.mul_(2.0)
    note("a (unchanged)", a)
    note("a._version", a._version)
    note("a.is_leaf", a.is_leaf)


# --- 2. Paddle's article on inplace memory and speed -------------------------------------------


@scenario(
    "2.1",
    "x.sin_() on a leaf is refused, and x is left as it was",
    "Paddle memory/speed",
    why="the leaf rule of 1.2; the check runs before the kernel, so nothing was written",
    more="the framework names sin_ in the error",
)
def leaf_sin_refused(lib, note):
    x = lib.tensor([0.5, 1.0, 1.5], requires_grad=True)
    with note.attempt("x.sin_()"):
        x.sin_()
    note("x (unchanged)", x)
    note("x._version", x._version)


@scenario(
    "2.2",
    "y = sin(x); y += 1 is accepted",
    "Paddle memory/speed",
    why="y is not a leaf, SinBackward0 saved x (not y) and AddBackward0 saves nothing: no value "
    "that backward reads was overwritten",
)
def add_into_result(lib, note):
    x = lib.tensor([0.5, 1.0, 1.5], requires_grad=True)
    y = lib.sin(x)
    y += 1
    note("y", y)
    note("y._version", y._version)
    note("y.grad_fn", grad_fn(y))
    y.sum().backward()
    note("x.grad", x.grad)
    note("cos(x)", lib.cos(x.detach()))


@scenario(
    "2.3",
    "h.sin_() on a non-leaf h: a correct gradient, at the cost of a copy of h",
    "Paddle memory/speed",
    why="sin's backward needs its input cos(h), which sin_ overwrites: the op first keeps a copy "
    "of h (12 bytes here), so sin_ saves no memory; exp_ and relu_ are free because their "
    "backward reads the result, which is what stays in h",
    more="the framework counts the copy as it happens (inplace_copy_bytes in fw.memory.stats(), "
    "category inplace_copies in fw.memory.breakdown()); PyTorch makes the same copy silently",
)
def sin_on_non_leaf(lib, note):
    x = lib.tensor([0.5, 1.0, 1.5], requires_grad=True)
    h = x * 1  # a non-leaf: autograd may let it be overwritten
    note("bytes kept by h.sin_()", copied_for_backward(lib, h, lambda t: t.sin_()))
    note("h.grad_fn", grad_fn(h))
    h.sum().backward()
    note("x.grad", x.grad)
    note("cos(x)", lib.cos(x.detach()))
    e = x * 1
    note("bytes kept by e.exp_()", copied_for_backward(lib, e, lambda t: t.exp_()))
    r = x * 1
    note("bytes kept by r.relu_()", copied_for_backward(lib, r, lambda t: t.relu_()))


# --- 3. PyTorch's article on leaves and version counters ---------------------------------------


@scenario(
    "3.1",
    "b[0] = 1000 bumps b._version from 0 to 1; then backward refuses",
    "PyTorch leaves/versions",
    why="ExpBackward0 saved its result b at version 0 to compute grad * b; b is now at version 1, "
    "so the saved values are gone and backward would be wrong",
    more="the framework says which op changed b and where: 'modified by fill_ at "
    "<this file>:<line of b[0] = 1000>'; PyTorch says neither",
)
def version_counter(lib, note):
    a = lib.tensor([1.0, 2.0, 3.0], requires_grad=True)
    b = a.exp()
    note("b._version before", b._version)
    b[0] = 1000
    note("b._version after", b._version)
    note("b.is_leaf", b.is_leaf)
    note("b.grad_fn", grad_fn(b))
    with note.attempt("b.sum().backward()"):
        b.sum().backward()


@scenario(
    "3.2",
    "a[:] = 0 on a leaf that requires grad: refused at once (not CopySlices)",
    "PyTorch leaves/versions",
    why="the article's PyTorch accepted the write, gave a the grad_fn CopySlices and failed later in "
    "backward with 'leaf variable has been moved into the graph interior'; PyTorch 2.13 and "
    "this framework refuse the write itself, before it changes anything",
    differs={
        "a[:] = 0": "PyTorch skips the full slice and writes into a itself ('a leaf "
        "Variable'); the framework writes through the view a[:] ('a view of a "
        "leaf Variable'): the same refusal, worded for what was written"
    },
)
def leaf_slice_assign(lib, note):
    a = lib.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with note.attempt("a[:] = 0"):
        a[:] = 0
    note("a (unchanged)", a)
    note("a.is_leaf", a.is_leaf)
    note("a.grad_fn", grad_fn(a))
    note("a._version", a._version)


@scenario(
    "3.3",
    "a.add_(10.) on a leaf raises at once",
    "PyTorch leaves/versions",
    why="the leaf rule of 1.2: the value the optimizer updates cannot become an op's output",
    more="the framework names add_ and suggests `with no_grad():` for a weight update",
)
def leaf_add(lib, note):
    a = lib.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with note.attempt("a.add_(10.)"):
        a.add_(10.0)
    note("a._version", a._version)


@scenario(
    "3.4",
    "the three ways to change a parameter: a.data, a.detach(), no_grad",
    "PyTorch leaves/versions",
    why="all three share a's memory; .data has its own version counter (autograd never sees the "
    "write), detach() shares a's counter, and no_grad writes a itself: the version bumps and "
    "a stays a leaf",
)
def ways_to_change_a_parameter(lib, note):
    a = lib.tensor([1.0, 2.0, 3.0], requires_grad=True)
    a.data.fill_(10.0)
    note("a.data.fill_(10.): a", a)
    note("a.data.fill_(10.): a._version", a._version)
    a.detach().fill_(11.0)
    note("a.detach().fill_(11.): a", a)
    note("a.detach().fill_(11.): a._version", a._version)
    with lib.no_grad():
        a[:] = 12.0
    note("no_grad: a[:] = 12.: a", a)
    note("no_grad: a[:] = 12.: a._version", a._version)
    note("a.is_leaf, a.requires_grad", (a.is_leaf, a.requires_grad))


@scenario(
    "3.5",
    "what sharing the version counter buys: detach() is checked, .data is not",
    "PyTorch leaves/versions",
    why="y = a.sin() saved a for cos(a); a write through .data is invisible, so backward silently "
    "uses the new values (cos(0) = 1, a wrong gradient); a write through detach() bumps the "
    "shared counter and backward refuses",
)
def data_is_unchecked(lib, note):
    a = lib.tensor([0.5, 1.0, 1.5], requires_grad=True)
    y = a.sin()
    a.data.fill_(0.0)
    note("a.data.fill_(0.): a._version", a._version)
    y.sum().backward()
    note("a.grad (cos(a) would be right)", a.grad)
    b = lib.tensor([0.5, 1.0, 1.5], requires_grad=True)
    z = b.sin()
    b.detach().fill_(0.0)
    note("b.detach().fill_(0.): b._version", b._version)
    with note.attempt("z.sum().backward()"):
        z.sum().backward()


@scenario(
    "3.6",
    "d[:] = 1 after f = d @ w2 fails at backward; before it, it works",
    "PyTorch leaves/versions",
    why="matmul saves its inputs (grad_w2 = d.T @ grad): writing d after f was made changes a "
    "saved value; written before, d is simply the constant 1 and w1 gets a zero gradient",
    more="the framework says d is input 'x' of MmBackward0 and names fill_ with its line; "
    "PyTorch names d by its newest grad_fn",
    differs={
        "d.grad_fn": "PyTorch skips the full slice and fills d itself (FillBackward2); the "
        "framework writes through the view d[:] (CopySlices): the same gradient"
    },
)
def write_before_or_after_use(lib, note):
    x = lib.tensor([[1.0, 1.0]])
    w1 = lib.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    w2 = lib.tensor([[1.0, 0.0], [0.0, 1.0]], requires_grad=True)
    d = x @ w1
    f = d @ w2
    d[:] = 1
    with note.attempt("after: f.sum().backward()"):
        f.sum().backward()
    d = x @ w1
    d[:] = 1
    f = d @ w2
    note("d.grad_fn", grad_fn(d))
    with note.attempt("before: f.sum().backward()"):
        f.sum().backward()
    note("w1.grad", w1.grad)
    note("w2.grad", w2.grad)


# --- 4. Where the articles are wrong ----------------------------------------------------------


@scenario(
    "4.1",
    "inplace does not lower computational complexity",
    "correction",
    why="x.add_(y) and x + y do the same n additions and give the same values; only where the "
    "result is written differs (chapter 5 measures what that saves: allocation and memory "
    "traffic, not arithmetic)",
)
def same_arithmetic(lib, note):
    x = lib.tensor([1.0, 2.0, 3.0])
    y = lib.tensor([0.5, 0.5, 0.5])
    z = x + y
    note("z is x", z is x)
    out = x.add_(y)
    note("x.add_(y) is x", out is x)
    note("x == z after add_", x.tolist() == z.tolist())


@scenario(
    "4.2",
    "why a leaf cannot be changed in place (not 'the graph cannot be rebuilt')",
    "correction",
    why="w is the value the gradient belongs to and the optimizer updates; changed in place it would "
    "be v, an op's output: its .grad is None (or, retained, d loss/d v = [4, 5, 6]), not "
    "d loss/d w = [8, 10, 12], the gradient of the parameter you hold",
)
def why_leaves_are_protected(lib, note):
    w = lib.tensor([1.0, 2.0, 3.0], requires_grad=True)
    c = lib.tensor([4.0, 5.0, 6.0])
    v = w.clone()  # what w would turn into if w.mul_(2.0) were allowed
    v.mul_(2.0)
    note("v.is_leaf", v.is_leaf)
    note("v.grad_fn", grad_fn(v))
    v.retain_grad()
    (v * c).sum().backward()
    note("w.grad (d loss / d w)", w.grad)
    note("v.grad (d loss / d v)", v.grad)


@scenario(
    "4.3",
    "a saved tensor's change is an error only when backward reads it",
    "correction",
    why="y = h + 1 keeps nothing of h (the gradient of a sum passes through), so h may change "
    "afterwards; y = h * h keeps h for 2 * h * grad, so changing h breaks it",
)
def error_only_when_read(lib, note):
    x = lib.tensor([1.0, 2.0, 3.0], requires_grad=True)
    h = x * 1
    y = h + 1
    h.add_(5.0)
    with note.attempt("y.sum().backward()  (y = h + 1)"):
        y.sum().backward()
    note("x.grad", x.grad)
    g = x * 1
    z = g * g
    g.add_(5.0)
    with note.attempt("z.sum().backward()  (z = g * g)"):
        z.sum().backward()
