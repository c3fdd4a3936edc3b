"""The inplace tour: every scenario of the well-known inplace articles, run and explained.

    python examples/inplace_tour.py [--quick] [--plot PATH] [--no-torch]

Most people learned inplace from a few widely read articles: Paddle's introduction to
inplace, a Paddle article on inplace memory and speed, and a PyTorch article on leaves
and version counters. This tour runs each of their scenarios on this framework, prints
what happens (values, ``_version``, ``is_leaf``, ``grad_fn``, the error) with a one-line
reason, corrects the articles where they are wrong, and measures their experiment.

Each scenario is one function written once against the names this framework shares
with PyTorch: ``lib`` is ``framework`` (``import framework as fw``) or ``torch``. Where
PyTorch is installed (``pip install torch==2.13.0``) the same function runs on it too and
both results are printed side by side; a result that differs is explained in the
scenario (``differs``: by design, or where the framework says more). A difference the
tour does not explain is printed as UNEXPECTED and the tour exits with status 1.

Paddle has ``scale_``; this framework and PyTorch write it ``mul_``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import re
import statistics
import sys
import textwrap
import time
import tracemalloc

try:
    import resource  # page faults; Unix only
except ImportError:  # pragma: no cover  (Windows)
    resource = None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from anywhere, without installing the project
    sys.path.insert(0, ROOT)

import framework as fw  # noqa: E402

DEFAULT_PLOT = os.path.join("runs", "tour", "inplace_add.png")  # runs/ is not committed


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

@scenario("1.1", "y = x.scale_(2.0) returns x itself (scale_ is mul_ here)", "Paddle intro",
          why="an inplace op writes into x's own storage and returns x, so y is a second name "
              "for the same tensor; the write bumps x's version counter")
def returns_itself(lib, note):
    x = lib.tensor([1.0, 2.0, 3.0])
    note("x._version before", x._version)
    y = x.mul_(2.0)
    note("y is x", y is x)
    note("x", x)
    note("x._version after", x._version)


@scenario("1.2", "a.scale_(2.0) on a leaf that requires grad raises at once", "Paddle intro",
          why="a is the value its gradient belongs to and the optimizer updates: changed in place "
              "it would become an op's output and its .grad would no longer be the gradient of the "
              "parameter you hold (see 4.2)",
          more="the framework names the refused op (mul_) and says what to do instead")
def leaf_refuses_inplace(lib, note):
    a = lib.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with note.attempt("a.mul_(2.0)"):
        a.mul_(2.0)
    note("a (unchanged)", a)
    note("a._version", a._version)
    note("a.is_leaf", a.is_leaf)


# --- 2. Paddle's article on inplace memory and speed -------------------------------------------

@scenario("2.1", "x.sin_() on a leaf is refused, and x is left as it was", "Paddle memory/speed",
          why="the leaf rule of 1.2; the check runs before the kernel, so nothing was written",
          more="the framework names sin_ in the error")
def leaf_sin_refused(lib, note):
    x = lib.tensor([0.5, 1.0, 1.5], requires_grad=True)
    with note.attempt("x.sin_()"):
        x.sin_()
    note("x (unchanged)", x)
    note("x._version", x._version)


@scenario("2.2", "y = sin(x); y += 1 is accepted", "Paddle memory/speed",
          why="y is not a leaf, SinBackward saved x (not y) and AddBackward saves nothing: no value "
              "that backward reads was overwritten")
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


@scenario("2.3", "h.sin_() on a non-leaf h: a correct gradient, at the cost of a copy of h",
          "Paddle memory/speed",
          why="sin's backward needs its input cos(h), which sin_ overwrites: the op first keeps a copy "
              "of h (12 bytes here), so sin_ saves no memory; exp_ and relu_ are free because their "
              "backward reads the result, which is what stays in h",
          more="the framework counts the copy as it happens (inplace_copy_bytes in fw.memory.stats(), "
               "category inplace_copies in fw.memory.breakdown()); PyTorch makes the same copy silently")
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

@scenario("3.1", "b[0] = 1000 bumps b._version from 0 to 1; then backward refuses", "PyTorch leaves/versions",
          why="ExpBackward saved its result b at version 0 to compute grad * b; b is now at version 1, "
              "so the saved values are gone and backward would be wrong",
          more="the framework says which op changed b and where: 'modified by fill_ at "
               "<this file>:<line of b[0] = 1000>'; PyTorch says neither",
          differs={"b.grad_fn": "PyTorch prints CopySlices; the framework also names the op "
                                "inside it (FillBackward)"})
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


@scenario("3.2", "a[:] = 0 on a leaf that requires grad: refused at once (not CopySlices)",
          "PyTorch leaves/versions",
          why="the article's PyTorch accepted the write, gave a the grad_fn CopySlices and failed later in "
              "backward with 'leaf variable has been moved into the graph interior'; PyTorch 2.13 and "
              "this framework refuse the write itself, before it changes anything",
          differs={"a[:] = 0": "PyTorch skips the full slice and writes into a itself ('a leaf "
                               "Variable'); the framework writes through the view a[:] ('a view of a "
                               "leaf Variable'): the same refusal, worded for what was written"})
def leaf_slice_assign(lib, note):
    a = lib.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with note.attempt("a[:] = 0"):
        a[:] = 0
    note("a (unchanged)", a)
    note("a.is_leaf", a.is_leaf)
    note("a.grad_fn", grad_fn(a))
    note("a._version", a._version)


@scenario("3.3", "a.add_(10.) on a leaf raises at once", "PyTorch leaves/versions",
          why="the leaf rule of 1.2: the value the optimizer updates cannot become an op's output",
          more="the framework names add_ and suggests `with no_grad():` for a weight update")
def leaf_add(lib, note):
    a = lib.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with note.attempt("a.add_(10.)"):
        a.add_(10.0)
    note("a._version", a._version)


@scenario("3.4", "the three ways to change a parameter: a.data, a.detach(), no_grad", "PyTorch leaves/versions",
          why="all three share a's memory; .data has its own version counter (autograd never sees the "
              "write), detach() shares a's counter, and no_grad writes a itself: the version bumps and "
              "a stays a leaf")
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


@scenario("3.5", "what sharing the version counter buys: detach() is checked, .data is not",
          "PyTorch leaves/versions",
          why="y = a.sin() saved a for cos(a); a write through .data is invisible, so backward silently "
              "uses the new values (cos(0) = 1, a wrong gradient); a write through detach() bumps the "
              "shared counter and backward refuses")
def data_is_unchecked(lib, note):
    a = lib.tensor([0.5, 1.0, 1.5], requires_grad=True)
    y = a.sin()
    a.data.fill_(0.0)
    note("a.data.fill_(0.): a._version", a._version)
    y.sum().backward()
    note("a.grad (cos(a) = [0.88, 0.54, 0.07]?)", a.grad)
    b = lib.tensor([0.5, 1.0, 1.5], requires_grad=True)
    z = b.sin()
    b.detach().fill_(0.0)
    note("b.detach().fill_(0.): b._version", b._version)
    with note.attempt("z.sum().backward()"):
        z.sum().backward()


@scenario("3.6", "d[:] = 1 after f = d @ w2 fails at backward; before it, it works", "PyTorch leaves/versions",
          why="matmul saves its inputs (grad_w2 = d.T @ grad): writing d after f was made changes a "
              "saved value; written before, d is simply the constant 1 and w1 gets a zero gradient",
          more="the framework says d is input 'x' of MatmulBackward and names fill_ with its line; "
               "PyTorch names d by its newest grad_fn",
          differs={"d.grad_fn": "PyTorch skips the full slice and fills d itself (FillBackward); the "
                                "framework writes through the view d[:] (CopySlices): the same gradient"})
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

@scenario("4.1", "inplace does not lower computational complexity", "correction",
          why="x.add_(y) and x + y do the same n additions and give the same values; only where the "
              "result is written differs (chapter 5 measures what that saves: allocation and memory "
              "traffic, not arithmetic)")
def same_arithmetic(lib, note):
    x = lib.tensor([1.0, 2.0, 3.0])
    y = lib.tensor([0.5, 0.5, 0.5])
    z = x + y
    note("z is x", z is x)
    out = x.add_(y)
    note("x.add_(y) is x", out is x)
    note("x == z after add_", x.tolist() == z.tolist())


@scenario("4.2", "why a leaf cannot be changed in place (not 'the graph cannot be rebuilt')", "correction",
          why="w is the value the gradient belongs to and the optimizer updates; changed in place it would "
              "be v, an op's output: its .grad is None (or, retained, d loss/d v = [4, 5, 6]), not "
              "d loss/d w = [8, 10, 12], the gradient of the parameter you hold")
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


@scenario("4.3", "a saved tensor's change is an error only when backward reads it", "correction",
          why="y = h + 1 keeps nothing of h (the gradient of a sum passes through), so h may change "
              "afterwards; y = h * h keeps h for 2 * h * grad, so changing h breaks it")
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


# --- comparing and printing ------------------------------------------------------------------

_BACKWARD_NUMBER = re.compile(r"(Backward)\d+")


def comparable(value: str) -> str:
    """What must agree between the libraries: an error's type and first clause, grad_fn
    names without PyTorch's overload number (``ExpBackward0``), every other value exactly."""
    m = re.match(r"(\w+(Error|Exception)): (.*)", value, re.S)
    if m:
        return m.group(1) + ": " + re.split(r"[:(.]", m.group(3), maxsplit=1)[0].strip()
    return _BACKWARD_NUMBER.sub(r"\1", value)


def unexplained_differences(sc: Scenario, ours, theirs) -> list[str]:
    """Rows where the libraries differ and the scenario does not say why, and rows it says
    differ that no longer do (the explanation would be stale)."""
    if [key for key, _ in ours] != [key for key, _ in theirs]:
        return ["the two runs recorded different rows"]
    problems = []
    for (key, a), (_, b) in zip(ours, theirs):
        differ = comparable(a) != comparable(b)
        if differ and key not in sc.differs:
            problems.append(f"{key}: framework and PyTorch differ and the tour does not say why")
        if not differ and key in sc.differs:
            problems.append(f"{key}: the tour explains a difference that is gone")
    return problems


WIDTH = 100
KEY_WIDTH = 38
SHORT = 28


def _wrapped(prefix: str, text: str, indent: int) -> str:
    return textwrap.fill(text, WIDTH, initial_indent=prefix, subsequent_indent=" " * indent,
                         break_long_words=False, break_on_hyphens=False)


def print_scenario(sc: Scenario, ours, theirs=None) -> list[str]:
    """Prints one scenario; returns the unexplained differences."""
    print(f"\n[{sc.number}] {sc.title}   ({sc.source})")
    for i, (key, a) in enumerate(ours):
        b = theirs[i][1] if theirs is not None else None
        label = f"  {key:<{KEY_WIDTH}} "
        if b is None:
            print(_wrapped(label, a, len(label)))
        elif a == b:
            print(_wrapped(label, f"{a}   (torch: same)", len(label)))
        elif len(a) <= SHORT and len(b) <= SHORT:
            print(f"{label}{a:<{SHORT}} | torch: {b}")
        else:
            print(f"  {key}")
            print(_wrapped("      framework: ", a, 17))
            print(_wrapped("      torch:     ", b, 17))
    print(_wrapped("  why: ", sc.why, 7))
    if sc.more:
        print(_wrapped("  framework says more: ", sc.more, 7))
    problems = []
    if theirs is not None:
        for key, reason in sc.differs.items():
            print(_wrapped(f"  differs by design ({key}): ", reason, 7))
        problems = unexplained_differences(sc, ours, theirs)
        for p in problems:
            print(f"  UNEXPECTED: {p}")
    return problems


# --- 5. the measured experiment: add_ against add ----------------------------------------------

IN_PLACE = "x.add_(y)"
DROPPED = "x = x + y"
KEPT = "xs.append(xs[-1] + y)"
AUTO = "x = x + y, auto"
VARIANTS = (IN_PLACE, DROPPED, KEPT, AUTO)
TORCH_VARIANTS = (IN_PLACE, DROPPED, KEPT)  # PyTorch's eager mode has no policy auto
VARIANT_NOTES = {
    IN_PLACE: "in place",
    DROPPED: "out of place (policy off), each result frees the previous one",
    KEPT: "out of place, every result kept alive (as autograd keeps activations)",
    AUTO: "the same code under policy auto: x is proven dead at each step and the add runs in place",
}


def _run_variant(lib, variant, holder, y, n_ops):
    """Runs ``n_ops`` additions; returns what the variant keeps (the last x, or all results).

    ``holder`` is a one-element list with x, popped only in :func:`_additions`: nothing
    else refers to x, so that ``x = x + y`` frees each previous result as it goes.
    """
    if lib is not fw:
        return _additions(variant, holder, y, n_ops)
    # `x = x + y` stays out of place under policy off; under auto the framework proves x
    # dead and runs it in place (its own answer to this experiment).
    with fw.inplace.policy("auto" if variant == AUTO else "off"):
        return _additions(DROPPED if variant == AUTO else variant, holder, y, n_ops)


def _additions(variant, holder, y, n_ops):
    x = holder.pop()
    if variant == IN_PLACE:
        for _ in range(n_ops):
            x.add_(y)
        return x
    if variant == DROPPED:
        for _ in range(n_ops):
            x = x + y
        return x
    xs = [x]
    del x
    for _ in range(n_ops):
        xs.append(xs[-1] + y)
    return xs


def _page_faults() -> int:
    """Minor page faults of this process so far (0 where the OS does not say)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0


def time_variants(lib, size, n_ops, repeats) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """Seconds and page faults per run of each variant, the variants alternating in each repeat.

    A page fault is the OS handing the process a fresh page of memory (zeroed) the first
    time it is touched: what allocating new memory costs beyond the allocator's call.
    """
    variants = VARIANTS if lib is fw else TORCH_VARIANTS
    seconds = {v: [] for v in variants}
    faults = {v: [] for v in variants}
    y = lib.ones(size, size)
    for _ in range(repeats):
        for variant in variants:
            holder = [lib.ones(size, size)]
            gc.collect()
            faults0 = _page_faults()
            start = time.perf_counter()
            kept = _run_variant(lib, variant, holder, y, n_ops)
            seconds[variant].append(time.perf_counter() - start)
            faults[variant].append(_page_faults() - faults0)
            del kept
    return seconds, faults


def measure_memory(size, n_ops) -> dict[str, dict[str, int]]:
    """Bytes each variant allocates, on this framework, by its counter and by tracemalloc.

    ``allocated``: every buffer allocated during the run, added up (from the framework's
    allocation timeline); ``peak``: the counter's high-water mark above the start;
    ``traced_peak``: tracemalloc's (every Python allocation, so a few KB of objects too);
    ``live``: what the counter still counts once the run returned its result;
    ``auto_ops``: the ops policy auto ran in place.
    """
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    out = {}
    try:
        y = fw.ones(size, size)
        for variant in VARIANTS:
            holder = [fw.ones(size, size)]
            gc.collect()
            base = fw.memory.allocated_bytes()
            auto_ops = fw.memory.stats().get("auto_inplace_ops", 0)
            fw.memory.reset_peak()
            tracemalloc.reset_peak()
            traced_base = tracemalloc.get_traced_memory()[0]
            with fw.memory.record_timeline("cpu") as timeline:
                kept = _run_variant(fw, variant, holder, y, n_ops)
            traced_peak = tracemalloc.get_traced_memory()[1] - traced_base
            out[variant] = {
                "allocated": sum(delta for _, _, delta, _, _ in timeline.events if delta > 0),
                "peak": fw.memory.max_allocated_bytes() - base,
                "traced_peak": traced_peak,
                "live": fw.memory.allocated_bytes() - base,
                "auto_ops": fw.memory.stats().get("auto_inplace_ops", 0) - auto_ops,
            }
            del kept
    finally:
        if started:
            tracemalloc.stop()
    return out


def experiment(size, n_ops, repeats, torch=None):
    """Times and measures the variants; returns ``(seconds, page faults, memory)``, the first
    two by library (``framework``, ``torch``) and variant."""
    times, faults = {}, {}
    times["framework"], faults["framework"] = time_variants(fw, size, n_ops, repeats)
    memory = measure_memory(size, n_ops)
    if torch is not None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # NumPy's elementwise add runs on one core too
        try:
            times["torch"], faults["torch"] = time_variants(torch, size, n_ops, repeats)
        finally:
            torch.set_num_threads(threads)
    return times, faults, memory


def _mb(nbytes) -> str:
    return f"{nbytes / 1e6:.1f}"


def _ms(seconds, reduce) -> str:
    return f"{reduce(seconds) * 1e3:.1f}" if seconds else "-"


def print_experiment(times, faults, memory, size, n_ops, repeats) -> None:
    print(f"\n5. The measured experiment: {n_ops} additions on a {size}x{size} float32 tensor "
          f"({size * size * 4 / 1e6:.1f} MB), {repeats} repeat(s), the variants alternating")
    libs = list(times)
    print(f"\n  time of {n_ops} ops (ms) and page faults (median over the repeats)")
    print(f"  {'variant':<24}" + "".join(f"{lib + ' min':>16}{'median':>8}{'faults':>8}" for lib in libs))
    for v in VARIANTS:
        cells = [f"{_ms(times[lib].get(v), min):>16}{_ms(times[lib].get(v), statistics.median):>8}"
                 f"{statistics.median(faults[lib][v]) if v in faults[lib] else '-':>8}" for lib in libs]
        print(f"  {v:<24}" + "".join(cells))
    print("\n  memory on the framework (MB; tracemalloc also counts a few KB of Python objects)")
    print(f"  {'variant':<24}{'allocated':>12}{'peak (counter)':>17}{'peak (tracemalloc)':>21}{'live after':>13}")
    for v in VARIANTS:
        m = memory[v]
        print(f"  {v:<24}{_mb(m['allocated']):>12}{_mb(m['peak']):>17}{_mb(m['traced_peak']):>21}"
              f"{_mb(m['live']):>13}")
    print()
    for v in VARIANTS:
        print(f"  {v:<24}{VARIANT_NOTES[v]}")
    if "torch" in times:
        print("  PyTorch's CPU allocator does not report to tracemalloc: its memory is not measured here.")
    med = {v: statistics.median(times["framework"][v]) for v in VARIANTS}
    print(_wrapped(
        "  what it shows: ",
        f"every variant does the same {n_ops} x {size * size:,} float32 additions, so inplace does not "
        f"lower the arithmetic. add_ allocates nothing ({_mb(memory[IN_PLACE]['allocated'])} MB) and peaks "
        f"at {_mb(memory[IN_PLACE]['peak'])} MB above the start. `x = x + y` allocates "
        f"{_mb(memory[DROPPED]['allocated'])} MB in all but peaks at one extra tensor "
        f"({_mb(memory[DROPPED]['peak'])} MB), since each result frees the previous one, and takes "
        f"{med[DROPPED] / med[IN_PLACE]:.1f}x add_'s time (the allocator hands the freed buffer back: two "
        f"buffers take turns). Keeping every result peaks at {_mb(memory[KEPT]['peak'])} MB and takes "
        f"{med[KEPT] / med[IN_PLACE]:.1f}x the time: each result is fresh memory the OS must map, and the "
        f"data no longer stays in the caches ({statistics.median(faults['framework'][KEPT])} page faults "
        f"against {statistics.median(faults['framework'][IN_PLACE])} for add_). Under policy auto the same `x = x + y` ran "
        f"{memory[AUTO]['auto_ops']} of {n_ops} additions in place ({_mb(memory[AUTO]['allocated'])} MB "
        f"allocated, {med[AUTO] / med[IN_PLACE]:.1f}x add_'s time). Inplace saves allocation and memory "
        "bandwidth, not arithmetic.",
        17))
    if "torch" in times:
        t_med = {v: statistics.median(times["torch"][v]) for v in TORCH_VARIANTS}
        print(_wrapped(
            "  on PyTorch: ",
            f"`x = x + y` takes {t_med[DROPPED] / t_med[IN_PLACE]:.1f}x add_'s time with "
            f"{statistics.median(faults['torch'][DROPPED])} page faults (against "
            f"{statistics.median(faults['framework'][DROPPED])} on the framework): its results land on fresh "
            "pages where NumPy reused the freed buffer; keeping every result takes "
            f"{t_med[KEPT] / t_med[IN_PLACE]:.1f}x add_'s time.", 14))


def plot_experiment(times, memory, size, n_ops, path) -> None:
    """Bar chart: time per variant and library (median, min marked), and memory per variant."""
    import matplotlib  # noqa: PLC0415  (only this chapter needs it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 4.8))
    libs = list(times)
    width = 0.8 / len(libs)
    for i, lib in enumerate(libs):
        ks = [k for k, v in enumerate(VARIANTS) if v in times[lib]]
        xs = [k + (i - (len(libs) - 1) / 2) * width for k in ks]
        med = [statistics.median(times[lib][VARIANTS[k]]) * 1e3 for k in ks]
        low = [min(times[lib][VARIANTS[k]]) * 1e3 for k in ks]
        ax_t.bar(xs, med, width, label=f"{lib} (median)")
        ax_t.plot(xs, low, "k_", markersize=14, label="min" if i == 0 else None)
        for x, m in zip(xs, med):
            ax_t.annotate(f"{m:.0f}", (x, m), ha="center", va="bottom", fontsize=8)
    ax_t.set_xticks(range(len(VARIANTS)), VARIANTS, fontsize=8)
    ax_t.set_ylabel(f"ms for {n_ops} ops")
    ax_t.set_title(f"time: {n_ops} additions on {size}x{size} float32")
    ax_t.legend(fontsize=8)
    series = (("allocated", "allocated in all"), ("peak", "peak (framework counter)"),
              ("traced_peak", "peak (tracemalloc)"))
    width = 0.8 / len(series)
    for i, (field, label) in enumerate(series):
        xs = [k + (i - 1) * width for k in range(len(VARIANTS))]
        values = [memory[v][field] / 1e6 for v in VARIANTS]
        ax_m.bar(xs, values, width, label=label)
        for x, m in zip(xs, values):
            ax_m.annotate(f"{m:.0f}", (x, m), ha="center", va="bottom", fontsize=8)
    ax_m.set_xticks(range(len(VARIANTS)), VARIANTS, fontsize=8)
    ax_m.set_ylabel("MB above the start")
    ax_m.set_title("memory on the framework")
    ax_m.legend(fontsize=8)
    fig.suptitle("the same arithmetic: inplace saves allocation and memory traffic")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- the tour ---------------------------------------------------------------------------------

def import_torch():
    """PyTorch if it is installed, else None."""
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return None
    return torch


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Run every scenario of the well-known inplace articles.")
    parser.add_argument("--quick", action="store_true",
                        help="a short experiment (10 ops, 1 repeat) instead of 100 ops x 5 repeats")
    parser.add_argument("--plot", default=DEFAULT_PLOT, metavar="PATH",
                        help=f"where to save the experiment's bar chart (.png; default {DEFAULT_PLOT})")
    parser.add_argument("--no-torch", action="store_true", help="do not run the scenarios on PyTorch")
    args = parser.parse_args(argv)
    if not args.plot.lower().endswith(".png"):
        parser.error(f"--plot must name a .png file, got {args.plot!r}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:  # a bad --plot fails now, not after the whole tour ran
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
    except OSError as e:
        print(f"error: cannot make the folder of --plot {args.plot!r}: {e.strerror}", file=sys.stderr)
        return 2
    torch = None if args.no_torch else import_torch()
    if torch is not None:
        print(f"The inplace tour: this framework side by side with PyTorch {torch.__version__}")
    else:
        print("The inplace tour: this framework only (PyTorch is not installed or --no-torch was given)")
    problems = []
    chapter = None
    for sc in SCENARIOS:
        if sc.number.split(".")[0] != chapter:
            chapter = sc.number.split(".")[0]
            print(f"\n{chapter}. {CHAPTERS[chapter]}")
        ours = sc.run(fw)
        theirs = sc.run(torch) if torch is not None else None
        problems += print_scenario(sc, ours, theirs)
    size, n_ops, repeats = (1000, 10, 1) if args.quick else (1000, 100, 5)
    times, faults, memory = experiment(size, n_ops, repeats, torch)
    print_experiment(times, faults, memory, size, n_ops, repeats)
    try:
        plot_experiment(times, memory, size, n_ops, args.plot)
    except OSError as e:
        print(f"error: cannot write the bar chart to {args.plot!r}: {e.strerror}", file=sys.stderr)
        return 2
    print(f"\n  bar chart: {args.plot}")
    if problems:
        print(f"\n{len(problems)} UNEXPECTED difference(s) from PyTorch: see above")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
