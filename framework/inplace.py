"""The inplace policy: one setting that switches every inplace SITE of a training run.

``on`` (the default) takes the inplace path at every site; ``off`` the out-of-place
path; ``auto`` takes it only where the framework PROVES the overwritten tensor dead, and
also rewrites ordinary ops (``x.exp()``, ``a + b``, ``F.relu(x)``) to run in place when
their first input is provably dead (see "auto" below and docs/INPLACE.md). The sites are: activation modules built with ``inplace=None`` (``ReLU``,
``LeakyReLU``, ``Dropout``), residual adds in models, BatchNorm+activation fused as
InPlace-ABN when a model asks for it, optimizer updates, gradient accumulation in the
backward engine, and (in data parallel training) gradients as views of the allreduce
buffer with ``MPI.IN_PLACE``.

Explicit calls such as ``x.add_(y)`` always mutate ``x``: that is their meaning, not a
policy decision. The policy never changes results, only memory (tests hold both
policies to the same losses).
"""

from __future__ import annotations

import contextlib
import dis
import sys
import warnings

POLICIES = ("on", "off", "auto")

_policy = "on"


def get_policy() -> str:
    """The current policy name."""
    return _policy


def set_policy(name: str) -> None:
    """Sets the policy for the whole process: ``"on"`` or ``"off"``."""
    global _policy
    if isinstance(name, bool):  # YAML 1.1 reads bare on/off as booleans
        name = "on" if name else "off"
    if name not in POLICIES:
        raise ValueError(f"unknown inplace policy {name!r}; use one of: {', '.join(POLICIES)}")
    if name == "auto" and _calibration_failed and not _warned[0]:
        _warned[0] = True
        warnings.warn(
            "inplace policy 'auto': the reference-count calibration could not tell a temporary "
            f"from a named variable on this interpreter ({_calibration_failed}); auto rewrites "
            "no ordinary op and its sites act as under 'on'",
            RuntimeWarning,
            stacklevel=2,
        )
    _policy = name


@contextlib.contextmanager
def policy(name: str):
    """Runs the block under policy ``name``, then restores the previous one."""
    prev = _policy
    set_policy(name)
    try:
        yield
    finally:
        set_policy(prev)


def can_write(tensor, explicit: bool | None = None) -> bool:
    """Whether an inplace SITE writes over ``tensor`` (an activation's input, a residual sum).

    ``True``/``False`` (a module's own ``inplace=``) are obeyed as written, as in PyTorch:
    misuse raises at once or at backward. ``None`` follows the policy, except where the
    inplace path could only fail, so that ``on`` never raises where ``off`` works:
    ``tensor`` is (a view of) a leaf that requires grad, or a value autograd holds for
    backward (a ``Dropout`` after ``tanh``, whose backward reads its output). There the
    site takes the out-of-place path and counts ``inplace_site_fallbacks`` in
    :func:`framework.memory.stats`.
    """
    if explicit is not None:
        return bool(explicit)
    if _policy == "off":
        return False
    from . import memory  # noqa: PLC0415
    from .autograd.grad_mode import state  # noqa: PLC0415

    if state.enabled:
        base = tensor._base if tensor._base is not None else tensor
        if (base._requires_grad and base._grad_fn is None) or memory.saved_refcount(tensor._data) > 0:
            memory.count("inplace_site_fallbacks")
            return False
    if _policy == "auto" and not _calibration_failed:
        # The site must also prove that nobody else holds the tensor or its memory.
        if tensor._base is not None or not _sole_array(tensor) or not _owned(tensor, sys._getframe(1), "site"):
            return False
        memory.count("auto_inplace_ops")
        memory.count("auto_inplace_ops." + sys._getframe(1).f_code.co_qualname)
        memory.count("auto_inplace_bytes", tensor._data.nbytes)
    return True


def enabled(explicit: bool | None = None) -> bool:
    """Whether an inplace site takes its inplace path.

    Args:
        explicit: a site's own setting (``ReLU(inplace=True)``); ``None`` follows the policy.
    """
    if explicit is not None:
        return bool(explicit)
    return _policy != "off"


# --- auto: proving a tensor dead ------------------------------------------------------------
#
# A tensor is dead at a call when nothing but the call itself refers to it. CPython counts
# references; what the count must be for a temporary depends on the path the call took:
# frames that pass the tensor on (the op's entry function, ``Function.apply``,
# ``Module.__call__``, a site's ``forward``) hold one reference each, and the caller's
# own instruction may hold one on its value stack (``a + b`` does, ``f(a)`` hands its
# reference over). Those pass-through frames are registered with
# :func:`passes_ownership`; the frame above them is the CALLER, and its current
# instruction tells the path: ``call`` (f(x), x.f()), ``binary`` (x + y) or ``module``
# (m(x), entered through the type's call slot). For each path and each checker (an op
# rewritten by auto, or a policy site) the count of a temporary is measured at import
# by passing a known temporary and a named variable through the real code
# (:func:`calibrate`): the named variable must count exactly one more, or that path is
# never trusted. At run time the tensor is dead when its count equals the temporary's.
# Anything unknown (another opcode, a C function in between, a hook) refuses: refusing
# only costs memory.

_LICENSED: set = set()  # code objects of the pass-through frames
_BASE: dict = {}  # (checker, path) -> references of a temporary, minus pass-through frames
_calibration_failed = ""  # why calibration failed ("" = it worked or has not run)
_calibrating = False
_measuring_rebind = False
_REBIND_REFS = 0  # references one local name adds once the frame's locals were read (calibrated)
_calibration_log: list = []
_warned = [False]
_opnames: dict = {}  # (code, lasti) -> opname of the instruction running at lasti
_MODULE_CALL = None  # Module.__call__'s code (the ``module`` path), set by calibrate()


def passes_ownership(fn):
    """Declares ``fn`` a pass-through frame for ``auto``'s proof; returns ``fn`` unchanged.

    Contract: ``fn`` hands its tensor argument on to the op (or site) that may overwrite
    it and never reads it afterwards, and keeps it in no other variable or container.
    Every framework entry that ``auto`` sees through is marked with it (``fw.exp``,
    ``F.relu``, ``nn.ReLU.forward``, ...); a user-written site's ``forward`` may be too.
    """
    _LICENSED.add(getattr(fn, "__func__", fn).__code__)
    return fn


def _call_kind(code, lasti) -> str:
    """What the instruction running at ``lasti`` is: ``"binary"``, ``"call"``,
    ``"call_kw"`` (a call with keyword arguments: CPython then copies the positional
    ones once more) or ``""`` (anything else)."""
    key = (code, lasti)
    kind = _opnames.get(key)
    if kind is None:
        recent = ["", "", ""]
        for ins in dis.get_instructions(code):  # real instructions only (no inline caches)
            if ins.offset > lasti:
                break
            recent = [recent[1], recent[2], ins.opname]
        op = recent[2]
        if op == "BINARY_OP":
            kind = "binary"
        elif op == "CALL_KW" or (op == "CALL" and "KW_NAMES" in recent[:2]):
            kind = "call_kw"
        elif op == "CALL":
            kind = "call"
        else:
            kind = ""
        _opnames[key] = kind
    return kind


def _owned(t, frame, checker: str) -> bool:
    """Whether the only references to tensor ``t`` are those of the call in progress.

    ``frame`` is the first frame above the checker's own (see the comment above).
    """
    refs = sys.getrefcount(t)
    n = 0
    top = None
    licensed = _LICENSED
    while frame is not None and frame.f_code in licensed:
        n += 1
        top = frame.f_code
        frame = frame.f_back
    if frame is None:
        return False
    path = _call_kind(frame.f_code, frame.f_lasti)
    if not path:
        return False
    if top is _MODULE_CALL and path != "binary":
        # m.__call__(x) reaches Module.__call__ without the type slot's references.
        if "__call__" in frame.f_code.co_names:
            return False
        path = "module" + path[4:]
    if _calibrating:
        _calibration_log.append((checker, path, refs - n))
        return False
    base = _BASE.get((checker, path))
    if base is None:
        return False
    extra = refs - n - base
    if extra == 0:
        return True  # a temporary
    if extra < 0 or not (_REBIND_REFS or _measuring_rebind):
        return False
    # A name in the caller: dead only if this very statement rebinds it before reading it
    # (``out = relu(out)``, ``out = out + identity``).
    names = _rebound_names(frame.f_code, frame.f_lasti)
    if not names:
        return False
    loc = frame.f_locals  # CPython < 3.13 refreshes (and keeps) a snapshot of the locals here
    k = 0
    for name in names:
        if loc.get(name) is t:
            k += 1
    del loc
    extra = sys.getrefcount(t) - n - base  # after the refresh: a stale snapshot no longer counts
    if _measuring_rebind:
        _calibration_log.append((k, extra))
        return False
    return k > 0 and extra == k * _REBIND_REFS


# Names the statement running at an instruction loaded, and stores (or deletes) after it
# before reading them again: the ones that are dead once the call at that instruction
# has run. Nothing is claimed
# (an empty tuple) when the statement jumps or ends, the instruction is inside a try or
# with block (a handler could read the name), the code can read its locals dynamically,
# or an instruction touches fast locals in a way this scan does not know.
_rebinds: dict = {}
_DYNAMIC_NAMES = frozenset({"locals", "vars", "eval", "exec", "_getframe", "currentframe"})
_READS = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR"})
_KILLS = frozenset({"STORE_FAST", "DELETE_FAST"})
_ENDS = frozenset({"RETURN_VALUE", "RETURN_CONST", "RAISE_VARARGS", "RERAISE", "YIELD_VALUE", "SEND",
                   "END_FOR", "FOR_ITER"})
_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)


def _rebound_names(code, lasti) -> tuple:
    key = (code, lasti)
    names = _rebinds.get(key)
    if names is None:
        names = _rebinds[key] = _scan_rebinds(code, lasti)
    return names


def _scan_rebinds(code, lasti) -> tuple:
    if _DYNAMIC_NAMES.intersection(code.co_names):
        return ()
    bytecode = dis.Bytecode(code)
    if any(e.start <= lasti < e.end for e in bytecode.exception_entries):
        return ()
    loaded: set = set()  # names this line loaded up to the current instruction
    read: set = set()
    killed: list = []
    for ins in bytecode:
        if ins.offset <= lasti:
            if ins.starts_line:
                loaded.clear()
            if ins.opname in _READS:
                loaded.add(ins.argval)
            continue
        op = ins.opname
        if ins.starts_line or ins.opcode in _JUMPS or op in _ENDS:
            break  # the statement ends (or may not run on): only what came before counts
        if op in _READS:
            read.add(ins.argval)
        elif op in _KILLS:
            if ins.argval not in read and ins.argval not in killed:
                killed.append(ins.argval)
        elif "FAST" in op:
            return ()  # another way to touch locals (a newer interpreter): claim nothing
    # Only a name this statement loaded can have brought the tensor to the call; checking
    # the others would read f_locals for nothing (``h = a * b`` names h, not a).
    return tuple(name for name in killed if name in loaded)


def _sole_array(t) -> bool:
    """``t``'s array owns its memory and only ``t`` refers to it: no view of it, no node
    that saved it, no ``detach()`` sharing it (each would hold a reference). Callers must
    not hold the array in a local of their own."""
    data = t._data
    return data.base is None and sys.getrefcount(data) <= _SOLE_ARRAY_REFS


def _sole_array_probe(t) -> int:  # the body of _sole_array, measuring
    data = t._data
    return sys.getrefcount(data)


def _measure_sole_array() -> int:
    import numpy as np  # noqa: PLC0415

    class _Holder:  # stands for a tensor and its one slot
        pass

    h = _Holder()
    h._data = np.zeros(1)
    return _sole_array_probe(h)


_SOLE_ARRAY_REFS = _measure_sole_array()


def auto_target(cls, inputs, params) -> bool:
    """Whether ``auto`` runs ``cls`` (an out-of-place call) in place on ``inputs[0]``.

    Called by the apply path before anything else, for ops that declare
    ``auto_inplace``. True when the first input is dead (not a leaf that requires grad,
    not a view, no view of it alive, no node saved it and nothing but the call holds it)
    and the result has its shape and dtype, with no other input sharing its memory.
    """
    Tensor = _Tensor
    x = inputs[0]
    if type(x) is not Tensor or x._base is not None or (x._requires_grad and x._grad_fn is None):
        return False
    data = x._data
    if data.dtype.kind != "f":
        return False
    od = None
    for other in inputs[1:]:
        if isinstance(other, Tensor):
            od = other._data
            if od.dtype != data.dtype or (od.shape != data.shape and not _fits(od.shape, data.shape)):
                return False  # the result would not have x's shape and dtype
            if od is data or x.xp.may_share_memory(od, data):
                return False  # overlap: the kernel would read what it already wrote
        elif type(other) not in (int, float, bool):
            return False
    saves_x = _saves_first_input.get(cls)
    if saves_x is None:
        saves_x = _saves_first_input[cls] = tuple(when for _, idx, when in cls._save_plan if idx == 0)
    if saves_x and _grad_state.enabled and cls.differentiable:
        needs = [isinstance(a, Tensor) and (a._grad_fn is not None or a.requires_grad) for a in inputs]
        for when in saves_x:
            if when is None and any(needs) or when is not None and any(needs[i] for i in when):
                return False  # backward reads x: running in place would only copy it
    check = cls.auto_inplace
    if check is not True and not check(inputs, params):
        return False
    nbytes = data.nbytes
    del data, od  # the proof counts references: hold none of our own
    if not _sole_array(x) or not _owned(x, sys._getframe(2), "apply"):
        return False
    count = _memory.count
    count("auto_inplace_ops")
    count(_stat_keys.get(cls) or _stat_keys.setdefault(cls, "auto_inplace_ops." + cls.__name__))
    count("auto_inplace_bytes", nbytes)
    return True


def _fits(small, big) -> bool:
    """``small`` broadcasts to ``big`` without changing it."""
    return len(small) <= len(big) and all(s == 1 or s == b for s, b in zip(reversed(small), reversed(big)))


_saves_first_input: dict = {}  # op class -> saved_when conditions of its saved first input
_stat_keys: dict = {}  # op class -> its memory.stats() key
_Tensor = _memory = _grad_state = None  # bound by calibrate(), once the framework is loaded


def calibrate() -> None:
    """Measures the reference count of a temporary on each path (see the comment above).

    Runs once when ``framework`` is imported, through the real entry points, from a
    caller compiled outside the framework. A path whose named variable does not count
    exactly one more than its temporary stays untrusted; if none can be trusted, ``auto``
    rewrites nothing and warns once when selected.
    """
    global _calibrating, _calibration_failed, _MODULE_CALL, _policy, _Tensor, _memory, _grad_state
    global _measuring_rebind, _REBIND_REFS
    from . import memory, ops  # noqa: PLC0415
    from .autograd.grad_mode import state  # noqa: PLC0415
    from .tensor import Tensor  # noqa: PLC0415
    from .nn import functional as F  # noqa: PLC0415
    from .nn.module import Module  # noqa: PLC0415

    _MODULE_CALL = Module.__call__.__code__
    _Tensor, _memory, _grad_state = Tensor, memory, state

    class _Site(Module):
        def forward(self, input, residual=None):
            site = can_write(input, None)
            return site

    class _Op(Module):
        def forward(self, input, residual=None):
            return ops.neg(input)

    passes_ownership(_Site.forward)
    passes_ownership(_Op.forward)
    source = (
        "def probes(make, ops, F, site, op):\n"
        "    def call_temp(): ops.neg(make())\n"
        "    def call_named():\n        t = make()\n        ops.neg(t)\n"
        "    def binary_temp(): make() + 1.0\n"
        "    def binary_named():\n        t = make()\n        t + 1.0\n"
        "    def module_temp(): site(make())\n"
        "    def module_named():\n        t = make()\n        site(t)\n"
        "    def call_kw_temp(): ops.add(make(), 1.0, alpha=1)\n"
        "    def call_kw_named():\n        t = make()\n        ops.add(t, 1.0, alpha=1)\n"
        "    def module_kw_temp(): site(make(), residual=None)\n"
        "    def module_kw_named():\n        t = make()\n        site(t, residual=None)\n"
        "    def module_op_kw_temp(): op(make(), residual=None)\n"
        "    def module_op_kw_named():\n        t = make()\n        op(t, residual=None)\n"
        "    def fn_site_kw_temp(): F.residual_add(make(), identity=1.0)\n"
        "    def fn_site_kw_named():\n        t = make()\n        F.residual_add(t, identity=1.0)\n"
        "    def module_op_temp(): op(make())\n"
        "    def module_op_named():\n        t = make()\n        op(t)\n"
        "    def fn_site_temp(): F.residual_add(make(), 1.0)\n"
        "    def fn_site_named():\n        t = make()\n        F.residual_add(t, 1.0)\n"
        "    def rebind():\n        t = make()\n        t = ops.neg(t)\n"
        "    return [(call_temp, call_named), (binary_temp, binary_named), (module_temp, module_named),\n"
        "            (module_op_temp, module_op_named),\n"
        "            (call_kw_temp, call_kw_named), (module_kw_temp, module_kw_named),\n"
        "            (module_op_kw_temp, module_op_kw_named), (fn_site_kw_temp, fn_site_kw_named),\n"
        "            (fn_site_temp, fn_site_named)], rebind\n"
    )
    scope: dict = {}
    exec(compile(source, "<inplace auto calibration>", "exec"), scope)  # noqa: S102
    from .creation import zeros  # noqa: PLC0415

    pairs, rebind_probe = scope["probes"](lambda: zeros(2), ops, F, _Site(), _Op())
    prev, _policy = _policy, "auto"
    _calibrating = True
    logs = []
    try:
        for temp, named in pairs:
            pair = []
            for fn in (temp, named):
                _calibration_log.clear()
                fn()
                pair.append(list(_calibration_log))
            logs.append(pair)
    finally:
        _calibrating = False
        _policy = prev
        _calibration_log.clear()
    _BASE.clear()
    problems = []
    bad = set()
    for temp_log, named_log in logs:
        if len(temp_log) != len(named_log):
            problems.append(f"probes reached different checks: {temp_log} vs {named_log}")
            continue
        for (checker, path, refs), (checker2, path2, refs2) in zip(temp_log, named_log):
            key = (checker, path)
            if (checker2, path2) != key or refs2 != refs + 1 or _BASE.get(key, refs) != refs:
                problems.append(f"{checker}/{path}: temporary {refs}, named {refs2}")
                bad.add(key)
            else:
                _BASE[key] = refs
    for key in bad:
        _BASE.pop(key, None)
    # A name the statement rebinds (t = neg(t)): how many references it adds once the
    # frame's locals have been read (two on CPython < 3.13: the slot and the snapshot).
    _REBIND_REFS = 0
    if ("apply", "call") in _BASE:
        prev, _policy = _policy, "auto"
        _measuring_rebind = True
        try:
            _calibration_log.clear()
            rebind_probe()
            measured = list(_calibration_log)
        finally:
            _measuring_rebind = False
            _policy = prev
            _calibration_log.clear()
        if len(measured) == 1 and measured[0][0] == 1 and measured[0][1] >= 1:
            _REBIND_REFS = measured[0][1]
        else:
            problems.append(f"rebinding a name: {measured}")
    if not _BASE:
        _calibration_failed = "; ".join(problems) or "no path was reached"
    elif problems:
        _calibration_failed = ""
        warnings.warn("inplace auto: untrusted paths: " + "; ".join(problems), RuntimeWarning, stacklevel=2)
