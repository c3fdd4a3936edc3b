"""Policy ``auto``'s proof that a tensor is dead: nothing but the call in progress refers to it.

CPython counts references. When a tensor reaches an inplace site (or an op that ``auto``
may rewrite), the references to it are those of the call machinery, plus one for every
name, container, closure or object that still holds it. The proof compares the count
with what a *temporary* counts on the same path:

- **pass-through frames** (declared with :func:`passes_ownership`: the op entry points,
  ``Function.apply``, ``Module.__call__``, the sites' ``forward``, ``F.relu``, ...) each
  hold the tensor once, in the argument they hand on. On CPython 3.10 a frame that is in
  the middle of a positional or keyword call also keeps the argument on its value stack
  (3.11 and later move it into the callee), so it holds it twice;
- the **caller** (the first frame above them) may keep a reference on its value stack,
  depending on the instruction it is running: ``a + b`` does, ``f(a)`` does on 3.10 and
  not later, ``module(a)`` goes through the type's call slot, keyword arguments are
  copied once more. This is the *path*: ``binary``, ``call``, ``call_kw``, ``module``,
  ``module_kw``;
- the **checker** (the site check or the apply path) holds a fixed number of its own.

The constant for each ``(checker, path)`` is measured when ``framework`` is imported
(:func:`calibrate`), by passing a known temporary and a named variable through the real
entry points from a caller compiled outside the framework: a path is trusted only when
the named variable counts exactly one more than the temporary, and every probe of that
path agrees. At run time a tensor is dead when

1. its count equals the temporary's (nobody else holds it), or
2. it exceeds it by one, and that one reference is a local name that the very next
   instruction of the caller overwrites with the call's result (``out = relu(out)``,
   ``out = out + identity``): checked by reading that one local and comparing identity.
   Nothing can run between the call's return and that store, so no handler, hook or
   other thread can read the old value in between.

Anything else (an unknown instruction, a C function in between, a hook, a frame that can
read its own locals dynamically) refuses: refusing only costs memory. If nothing can be
trusted on an interpreter, ``auto`` proves nothing, and its sites act as under ``off``.
"""

from __future__ import annotations

import bisect
import dis
import inspect
import sys

_PY310 = sys.version_info < (3, 11)
_SNAPSHOT_LOCALS = sys.version_info < (3, 13)  # PEP 667: before 3.13, f_locals is a cached dict

_LICENSED: set = set()  # code objects of the pass-through frames
_BASE: dict = {}  # (checker, path) -> references of a temporary beyond the pass-through frames
_REBIND_OK = False  # rule 2 passed its own calibration
status = "not calibrated"  # "" when calibrated; otherwise why auto proves nothing
untrusted: list = []  # (checker, path, why) of the paths calibration could not trust
_MODULE_CALL = None  # code of Module.__call__: the ``module`` path goes through it
_calibrating = False
_log: list = []


def passes_ownership(fn):
    """Declares ``fn`` a pass-through frame for policy ``auto``; returns ``fn`` unchanged.

    Contract: ``fn`` hands its tensor argument on to the op or site that may overwrite it
    (by position or keyword, or inside ``*args``), keeps it in no other variable or
    container, and never reads it afterwards. Framework entry points are marked with it
    (``fw.exp``, ``F.relu``, ``nn.ReLU.forward``, ...); a user-written site's ``forward``
    may be too.
    """
    _LICENSED.add(getattr(fn, "__func__", fn).__code__)
    return fn


def dead_at(t, frame, checker: str):
    """The caller's frame when tensor ``t`` is dead at the call in progress, else None.

    ``frame`` is the checker's caller (the innermost pass-through frame). The returned
    frame is the first one outside the pass-through chain (the user's statement).
    """
    refs = sys.getrefcount(t) - 1  # minus getrefcount's own argument
    held = 0
    top = None
    licensed = _LICENSED
    while frame is not None and frame.f_code in licensed:
        held += _stack_refs(frame.f_code, frame.f_lasti) if _PY310 else 1
        top = frame.f_code
        frame = frame.f_back
    if frame is None:
        return None
    code = frame.f_code
    info = _callers.get((code, frame.f_lasti))
    if info is None:
        info = _callers[(code, frame.f_lasti)] = _classify_caller(code, frame.f_lasti)
    path, rebound, explicit_call = info
    if not path:
        return None
    if top is _MODULE_CALL and path != "binary":
        if explicit_call:
            return None  # m.__call__(x) skips the type slot's references: another path
        path = "module" + path[4:]
    if _calibrating:
        _log.append((checker, path, refs - held))
        return None
    base = _BASE.get((checker, path))
    if base is None:
        return None
    extra = refs - held - base
    if extra == 0:
        return frame  # a temporary
    if extra == 1 and rebound is not None and _REBIND_OK and _local_is(frame, rebound, t):
        return frame  # the one other reference is a local the caller overwrites next
    return None


def _local_is(frame, name: str, t) -> bool:
    """Whether local ``name`` of ``frame`` refers to ``t``, without keeping anything alive."""
    loc = frame.f_locals
    try:
        return loc.get(name) is t
    finally:
        if _SNAPSHOT_LOCALS:
            # Before 3.13 reading f_locals fills a dict that the frame keeps: it would hold
            # every local of the frame (a tensor the program deletes next included) until
            # the frame ends. Only optimized frames get here (see _rebound_name).
            loc.clear()


# --- what the caller is doing ----------------------------------------------------------------

_callers: dict = {}  # (code, lasti) -> (path, rebound name or None, explicit __call__)
_stack: dict = {}  # (code, lasti) -> references a 3.10 pass-through frame holds
_instructions: dict = {}  # code -> list of its instructions

# Names through which code can read its own frame's locals (it could then hold the dict
# that _local_is clears, or read a value the proof considers gone).
_DYNAMIC_NAMES = frozenset({"locals", "vars", "eval", "exec", "_getframe", "currentframe"})
_LOADS = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR", "LOAD_FAST_LOAD_FAST"})
_STORES = frozenset({"STORE_FAST", "STORE_FAST_LOAD_FAST", "STORE_FAST_STORE_FAST"})
_CALLS_310 = {"CALL_FUNCTION": "call", "CALL_METHOD": "call", "CALL_FUNCTION_KW": "call_kw"}


def _code_instructions(code) -> tuple:
    found = _instructions.get(code)
    if found is None:
        ins = list(dis.get_instructions(code))  # real instructions only, no inline caches
        found = _instructions[code] = (ins, [x.offset for x in ins])
    return found


def _at(code, lasti):
    """The instructions of ``code`` and the index of the one running at ``lasti``.

    During a call, 3.11+ may report an offset inside the call's inline cache: the
    instruction is the last one that starts at or before ``lasti``.
    """
    ins, offsets = _code_instructions(code)
    return ins, bisect.bisect_right(offsets, lasti) - 1


def _path_of(ins, i) -> str:
    op = ins[i].opname
    if _PY310:
        if op in _CALLS_310:
            return _CALLS_310[op]
        return "binary" if op.startswith("BINARY_") and op != "BINARY_SUBSCR" else ""
    if op == "BINARY_OP":
        return "binary"
    if op == "CALL_KW":  # 3.13
        return "call_kw"
    if op == "CALL":
        before = {x.opname for x in ins[max(0, i - 2) : i]}
        return "call_kw" if "KW_NAMES" in before else "call"  # 3.11, 3.12
    return ""


def _classify_caller(code, lasti) -> tuple:
    ins, i = _at(code, lasti)
    if i < 0:
        return ("", None, False)
    return (_path_of(ins, i), _rebound_name(code, ins, i), "__call__" in code.co_names)


def _rebound_name(code, ins, i):
    """The local that the instruction right after the call overwrites with its result, if
    this statement loaded it before the call (so it may be what brought the tensor).

    None inside a ``try`` or ``with`` block: if the op raised after writing, a handler
    could read the name; and in frames that can read their own locals dynamically.
    """
    if not code.co_flags & inspect.CO_OPTIMIZED or _DYNAMIC_NAMES.intersection(code.co_names):
        return None
    if i + 1 >= len(ins) or ins[i + 1].opname not in _STORES:
        return None
    if _in_handled_block(code, ins, ins[i].offset):
        return None
    arg = ins[i + 1].argval
    name = arg[0] if isinstance(arg, tuple) else arg  # 3.13's combined stores: the first is TOS
    for k in range(i - 1, -1, -1):
        x = ins[k]
        if x.opname in _LOADS:
            args = x.argval if isinstance(x.argval, tuple) else (x.argval,)
            if name in args:
                return name
        if x.starts_line:
            break  # only this statement's loads (a multi-line statement may miss some: fine)
    return None


_SETUPS_310 = frozenset({"SETUP_FINALLY", "SETUP_WITH", "SETUP_ASYNC_WITH"})


def _in_handled_block(code, ins, offset) -> bool:
    """Whether an exception at ``offset`` would go to a handler of this frame."""
    if _PY310:
        # A block runs from its SETUP_* to its handler (POP_BLOCK may end it sooner: the
        # range is an over-estimate, which only refuses more).
        return any(x.opname in _SETUPS_310 and x.offset < offset < x.argval for x in ins)
    return any(e.start <= offset < e.end for e in dis.Bytecode(code).exception_entries)


def _stack_refs(code, lasti) -> int:
    """3.10: references a pass-through frame holds while it calls the next one: its own
    argument, plus the value-stack slot of a positional or keyword call."""
    n = _stack.get((code, lasti))
    if n is None:
        ins, i = _at(code, lasti)
        n = _stack[(code, lasti)] = 2 if i >= 0 and ins[i].opname in _CALLS_310 else 1
    return n


# --- calibration ---------------------------------------------------------------------------------

_PROBES = """
def probes(make, neg, add, relu, residual_add, site, op_module):
    def call_temp(): neg(make())
    def call_named():
        t = make()
        neg(t)
    def nested_temp(): relu(make())
    def nested_named():
        t = make()
        relu(t)
    def binary_temp(): make() + 1.0
    def binary_named():
        t = make()
        t + 1.0
    def call_kw_temp(): add(make(), 1.0, alpha=1)
    def call_kw_named():
        t = make()
        add(t, 1.0, alpha=1)
    def module_temp(): op_module(make())
    def module_named():
        t = make()
        op_module(t)
    def module_kw_temp(): op_module(make(), residual=None)
    def module_kw_named():
        t = make()
        op_module(t, residual=None)
    def site_module_temp(): site(make())
    def site_module_named():
        t = make()
        site(t)
    def site_module_kw_temp(): site(make(), residual=None)
    def site_module_kw_named():
        t = make()
        site(t, residual=None)
    def site_call_temp(): residual_add(make(), 1.0)
    def site_call_named():
        t = make()
        residual_add(t, 1.0)
    def site_call_kw_temp(): residual_add(make(), identity=1.0)
    def site_call_kw_named():
        t = make()
        residual_add(t, identity=1.0)
    pairs = [(call_temp, call_named), (nested_temp, nested_named), (binary_temp, binary_named),
             (call_kw_temp, call_kw_named), (module_temp, module_named),
             (module_kw_temp, module_kw_named), (site_module_temp, site_module_named),
             (site_module_kw_temp, site_module_kw_named), (site_call_temp, site_call_named),
             (site_call_kw_temp, site_call_kw_named)]

    def rebound():
        t = make()
        t = neg(t)
        return t

    def rebound_but_aliased():
        t = make()
        u = t
        t = neg(t)
        return t, u

    def rebound_site():
        t = make()
        t = site(t)
        return t
    return pairs, (rebound, rebound_site), rebound_but_aliased
"""


def calibrate(*, make, neg, add, relu, residual_add, site, op_module, module_call, counter) -> None:
    """Measures the count of a temporary on each path (see the module docstring).

    Runs once, from ``framework/__init__.py`` once everything is loaded, through the real
    entry points handed in: ``make()`` returns a fresh tensor; ``neg``, ``add``, ``relu``
    are op entry points (``relu`` one frame deeper than ``neg``); ``residual_add`` a
    functional site; ``site`` a module whose forward is a site; ``op_module`` a module whose
    forward calls an op; ``module_call`` is ``Module.__call__``; ``counter()`` returns how
    many times the checkers proved a tensor dead so far (to check rule 2 end to end).
    """
    global _calibrating, status, _MODULE_CALL, _REBIND_OK
    _MODULE_CALL = module_call.__code__
    scope: dict = {}
    exec(compile(_PROBES, "<inplace auto calibration>", "exec"), scope)  # noqa: S102
    pairs, rebinds, aliased = scope["probes"](make, neg, add, relu, residual_add, site, op_module)
    measured: dict = {}
    problems: list = []
    _BASE.clear()
    _REBIND_OK = False
    status = ""  # let the checkers reach dead_at while probing
    _calibrating = True
    try:
        for temp, named in pairs:
            logs = []
            for fn in (temp, named):
                _log.clear()
                fn()
                logs.append(list(_log))
            t_log, n_log = logs
            if not t_log or [e[:2] for e in t_log] != [e[:2] for e in n_log]:
                problems.append((temp.__name__, "?", f"the probes reached {t_log} and {n_log}"))
                continue
            for (checker, path, refs), (_, _, named_refs) in zip(t_log, n_log):
                if named_refs != refs + 1:
                    problems.append((checker, path, f"a temporary counts {refs}, a named tensor {named_refs}"))
                    measured[(checker, path)] = None
                    continue
                seen = measured.setdefault((checker, path), refs)
                if seen != refs:
                    problems.append((checker, path, f"probes disagree: {seen} and {refs}"))
                    measured[(checker, path)] = None
    finally:
        _calibrating = False
        _log.clear()
    _BASE.update({k: v for k, v in measured.items() if v is not None})
    if _BASE:
        # Rule 2, end to end: ``t = f(t)`` must be proven dead, ``u = t; t = f(t)`` must not.
        _REBIND_OK = True
        for fn in rebinds:
            before = counter()
            fn()
            if counter() != before + 1:
                _REBIND_OK = False
                problems.append(("rebind", fn.__name__, "t = f(t) was not proven dead"))
        before = counter()
        aliased()
        if counter() != before:
            _REBIND_OK = False
            problems.append(("rebind", "aliased", "u = t; t = f(t) was proven dead"))
    untrusted[:] = problems
    status = "" if _BASE else "no path could be trusted: " + "; ".join(f"{c}/{p}: {w}" for c, p, w in problems)
