"""``fw.compile(step)``: capture once, check guards at every call, replay.

See docs/COMPILE.md for the design. This module wires the pieces: it finds the modules
and optimizers a step uses, computes the guards, captures (:mod:`.capture`), runs the
passes (:mod:`.alias`, :mod:`.reinplace`, :mod:`.dce`, :mod:`.plan`), builds the executor
(:mod:`.replay`) and keeps a small cache of programs.
"""

from __future__ import annotations

import contextlib
import time
import types
import warnings
import weakref

import numpy as np

from .. import backend, memory
from .. import inplace as _inplace
from ..autograd import node as _node
from ..autograd.grad_mode import state as _grad_state
from ..creation import _infer_dtype as _tensor_dtype
from ..creation import tensor as _tensor
from ..nn.module import Module
from ..optim.optimizer import Optimizer
from ..tensor import Tensor, _wrap
from . import alias, replay
from .capture import CaptureError, Recorder, _RefuseValueReads
from .dce import eliminate_dead_code
from .plan import plan_memory, verify
from .program import Source, WriteBack
from .recompute import check_budget, rematerialize
from .reinplace import reinplace
from .report import explain as _explain
from .report import make_report
from .scalars import Sym, Tape, evaluate, guards_hold

CACHE_SIZE = 8


# --- finding what the step uses ------------------------------------------------------------


def discover(fn, depth: int = 3):
    """The modules and optimizers a step can reach: through its closure, defaults, bound
    ``self``, the globals its code names, and one level into plain objects' attributes
    (a trainer's ``self.model``). Returns ``(modules, optimizers)``, each in order found."""
    modules, optimizers, seen = [], [], set()

    def visit(obj, d):
        if id(obj) in seen or d < 0:
            return
        seen.add(id(obj))
        if isinstance(obj, Module):
            modules.append(obj)
        elif isinstance(obj, Optimizer):
            optimizers.append(obj)
        elif isinstance(obj, (types.FunctionType, types.MethodType)):
            f = getattr(obj, "__func__", obj)
            visit(getattr(obj, "__self__", None), d - 1)
            for cell in f.__closure__ or ():
                try:
                    visit(cell.cell_contents, d - 1)
                except ValueError:  # an empty cell
                    pass
            for v in (f.__defaults__ or ()) + tuple((f.__kwdefaults__ or {}).values()):
                visit(v, d - 1)
            g = f.__globals__
            for name in _names(f.__code__):
                if name in g:
                    visit(g[name], d - 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                visit(v, d - 1)
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v, d - 1)
        elif (
            obj is not None
            and not isinstance(obj, (type, types.ModuleType, str, bytes, int, float, bool, Tensor, np.ndarray))
            and hasattr(obj, "__dict__")
        ):
            for v in vars(obj).values():
                visit(v, d - 1)

    visit(fn, depth)
    top = []
    for m in modules:  # keep only outermost modules (their submodules come with them)
        if not any(m is not o and any(m is s for s in o.modules()) for o in modules):
            top.append(m)
    return top, optimizers


def _names(code) -> set:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _names(c)
    return names


# --- the compiled callable ------------------------------------------------------------------


class _Entry:
    """One captured program with its guard key, executor and report."""

    def __init__(self, key, program, readers, exit_key):
        self.key = key
        self.program = program
        self.readers = readers  # how to read each traced scalar input at a call
        self.exit_key = exit_key
        self.plan = None
        self.executor = None
        self.report = None
        self.replays = 0

    def scalar_inputs(self, flat):
        return [r(flat) for r in self.readers]


class CompiledStep:
    """A training step that replays its captured program (see :func:`compile`).

    Attributes:
        program: the program of the last call (``print(compiled.program)``).
        captures: how many times the step was captured.
    """

    def __init__(
        self,
        step,
        modules=None,
        optimizers=None,
        explain=False,
        cache_size=CACHE_SIZE,
        cuda_graph=True,
        memory_budget=1.0,
    ):
        if not callable(step):
            raise TypeError(f"fw.compile expects a function, got {type(step).__name__}")
        self.memory_budget = memory_budget
        self.step = step
        self.__name__ = getattr(step, "__name__", "step")
        self.__doc__ = getattr(step, "__doc__", None)
        self._given = (modules, optimizers)
        self.modules = self.optimizers = None
        self.explain_on_capture = explain
        self.cuda_graph = bool(cuda_graph)
        self.cache_size = int(cache_size)
        self.cache: list[_Entry] = []
        self.captures = 0
        self.last: _Entry | None = None
        self._warned = False

    @property
    def memory_budget(self) -> float:
        """The fraction of eager's activations the step keeps for backward, as torch.compile's
        ``activation_memory_budget`` (docs/COMPILE.md, "A memory budget"). Part of each
        program's identity: a program planned at another budget is captured again."""
        return self._memory_budget

    @memory_budget.setter
    def memory_budget(self, value) -> None:
        self._memory_budget = check_budget(value)

    # --- what the step uses -------------------------------------------------------------
    def _discover(self):
        modules, optimizers = self._given
        found_m, found_o = discover(self.step)
        self.modules = list(modules) if modules is not None else found_m
        if isinstance(modules, Module):
            self.modules = [modules]
        self.optimizers = list(optimizers) if optimizers is not None else found_o
        params, names, seen = [], {}, set()
        for m in self.modules:
            for name, p in m.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
                    names[id(p)] = name
        for k, opt in enumerate(self.optimizers):
            for gi, g in enumerate(opt.param_groups):
                for pi, p in enumerate(g["params"]):
                    if id(p) not in seen:
                        seen.add(id(p))
                        params.append(p)
                        names[id(p)] = f"opt{k}.param_groups[{gi}][{pi}]"
        self.params, self.param_names = params, names
        self.all_modules = [s for m in self.modules for s in m.modules()]
        self.buffers = [(f"{name}", b) for m in self.modules for name, b in m.named_buffers() if b is not None]

    # --- guards ---------------------------------------------------------------------------
    def _key(self, flat, kw_names):
        sig = []
        for a in flat:
            if isinstance(a, Tensor):
                d = a._data
                sig.append((d.shape, d.dtype, d.strides, type(d), _device_index(d), a._requires_grad))
            elif isinstance(a, bool) or a is None or isinstance(a, str):
                sig.append(("const", a))
            elif _traced_kind(a):
                sig.append(type(a))
            else:
                sig.append(("object", id(a)))
        params = tuple(
            (p._data.shape, p._data.dtype, _device_index(p._data), p._requires_grad, p._grad is None)
            for p in self.params
        )
        opts = []
        for opt in self.optimizers:
            groups = tuple(  # traced numbers by type (a NumPy scalar is recorded as an op takes it)
                tuple((k, type(v) if _traced_kind(v) else v) for k, v in g.items() if k != "params")
                for g in opt.param_groups
            )
            state = tuple(tuple(opt.state[p]) if p in opt.state else () for g in opt.param_groups for p in g["params"])
            opts.append((groups, state))
        return (
            _inplace.get_policy(),
            _grad_state.enabled,
            bool(_grad_state.anomaly),
            tuple(sig),
            kw_names,
            tuple(m.training for m in self.all_modules),
            params,
            tuple(opts),
            len(self.params),
            self._memory_budget,
        )

    # --- calling ----------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.modules is None:
            self._discover()
        for opt in self.optimizers:  # a program's buffers are per parameter: no flat ones under it
            opt._unflatten()
        kw_names = tuple(sorted(kwargs))
        flat = list(args) + [kwargs[k] for k in kw_names]
        key = self._key(flat, kw_names)
        reason = None
        for entry in self.cache:
            if entry.key != key:
                continue
            if entry.program.guards:
                values = evaluate(entry.program.scalars, entry.scalar_inputs(flat))
                if not guards_hold(entry.program.guards, values):
                    reason = "a traced number changed a guarded comparison"
                    continue
            if entry.executor is None:
                self._build(entry)
            try:
                if entry.replays == 0:  # the first replay measures its own peak (see report())
                    for leaf in entry.program.cleared_grads:  # freed first: not part of the baseline
                        leaf._grad = None
                    dev = entry.program.device
                    with _counting(dev), memory.record_timeline(_timeline_kind(dev)) as tl:
                        result = entry.executor.run(flat, entry.scalar_inputs(flat))
                    # the arena was allocated before this call: count it with the step's inputs
                    entry.replay_peak_bytes = (
                        tl.peak - tl.events[0][1] + entry.plan.persistent_bytes + entry.plan.arena_bytes
                    )
                else:
                    result = entry.executor.run(flat, entry.scalar_inputs(flat))
            except replay.GuardFailed as e:
                reason = str(e)
                break
            entry.replays += 1
            self.last = entry
            return result
        if self.cache and reason is None:
            reason = self._why(key)
        return self._capture(flat, kw_names, key, reason)

    def upload(self, *arrays, device=None):
        """The step's positional tensor arguments, made from host arrays (NumPy) on
        ``device`` (the last program's device when None), to pass to the next call.

        Where the last call launched a captured CUDA graph, each array is copied straight
        into that graph's static input slot for its position, and the tensor returned IS
        the slot: a call given it copies nothing in, and the batch is on the device once
        (beside the caller's, a slot would be a second copy). As PyTorch's static inputs,
        the tensors are the graph's: the next ``upload``, and any call given other
        arguments, writes over them. Anywhere else (the CPU, no graph launched at the
        last call, a keyword argument, an array of another shape or dtype), each is
        ``fw.tensor(array, device=device)``.
        """
        if device is None:
            if self.last is None:
                raise ValueError("upload(): give device= (no program was captured yet to take it from)")
            device = self.last.program.device or backend.CPU
        dev = backend.device(device)
        graph = self.last.executor.cuda_graph if self.last is not None and self.last.executor is not None else None
        out = []
        for i, a in enumerate(arrays):
            slot = graph.slot_for(i) if graph is not None and graph.device == dev else None
            if slot is not None and isinstance(a, (np.ndarray, list, tuple)):
                host = np.asarray(a, dtype=_tensor_dtype(a))
                if host.shape == slot.shape and host.dtype == slot.dtype:
                    with backend.device_context(dev):
                        slot.set(np.ascontiguousarray(host))  # one host-to-device copy
                    out.append(_wrap(slot))
                    continue
            out.append(_tensor(a, device=dev))
        return tuple(out)

    def _why(self, key) -> str:
        names = (
            "inplace policy",
            "grad mode",
            "anomaly mode",
            "argument shapes/dtypes/strides/devices",
            "keyword names",
            "module train/eval modes",
            "parameters (shape, dtype, device, requires_grad, .grad set)",
            "optimizer hyperparameters or state layout",
            "parameter set",
            "memory budget",
        )
        last = self.cache[0].key
        diff = [n for n, a, b in zip(names, key, last) if a != b]
        return "changed: " + ", ".join(diff) if diff else "no cached program matched"

    def _capture(self, flat, kw_names, key, reason):
        # Silent: the first capture, and the one that follows a step which changed its own
        # guarded state (the first optimizer step creates the momentum buffers).
        silent = not self.cache or (
            any(e.exit_key == key for e in self.cache) and not any(e.key == key for e in self.cache)
        )
        if not silent and not self._warned:
            self._warned = True
            warnings.warn(
                f"fw.compile({self.__name__}): capturing the step again ({reason}); "
                f"programs are cached (up to {self.cache_size})",
                RuntimeWarning,
                stacklevel=3,
            )
        t0 = time.perf_counter()
        entry, result = self._record(flat, kw_names, key)
        entry.capture_seconds = time.perf_counter() - t0
        self.captures += 1
        self.cache.insert(0, entry)
        del self.cache[self.cache_size :]
        if entry.exit_key == entry.key:  # a steady step: plan now (a warm-up step may never replay)
            self._build(entry)
        self.last = entry
        if self.explain_on_capture and entry.executor is not None:
            self.explain()
        return result

    def _record(self, flat, kw_names, key):
        externals, readers = [], []
        tape = Tape()
        for i, a in enumerate(flat):
            name = f"args[{i}]" if i < len(flat) - len(kw_names) else f"kwargs[{kw_names[i - len(flat)]!r}]"
            if isinstance(a, Tensor):
                externals.append((a, Source("arg", name, key=i)))
                if a._grad is not None:  # a step that accumulates into an argument's .grad
                    externals.append((a._grad, Source("arggrad", name + ".grad", key=i)))
        for p in self.params:
            name = self.param_names[id(p)]
            externals.append((p, Source("param", name, p)))
            if p._grad is not None:
                externals.append((p._grad, Source("grad", name + ".grad", p)))
        for name, b in self.buffers:
            externals.append((b, Source("buffer", name, b)))
        for k, opt in enumerate(self.optimizers):
            for p, st in opt.state.items():
                pname = self.param_names.get(id(p), "?")
                for sk, sv in st.items():
                    if isinstance(sv, Tensor):
                        externals.append((sv, Source("state", f"opt{k}.state[{pname}].{sk}", (opt, p), sk)))
        sym_args = list(flat)
        for i, a in enumerate(flat):
            if _traced_kind(a):
                sym_args[i] = tape.input(f"args[{i}]", a)
                readers.append(_arg_reader(i))
        device = _step_device(externals)
        restore = self._trace_optimizers(tape, readers)
        entry_state = self._snapshot()
        rec = Recorder(externals, tape, self.__name__)
        rec.program.device = device
        n_pos = len(flat) - len(kw_names)
        pos, kw = sym_args[:n_pos], dict(zip(kw_names, sym_args[n_pos:]))
        try:
            with _counting(device), memory.record_timeline(_timeline_kind(device)) as tl, _RefuseValueReads():
                rec.timeline = tl
                _node.capture = rec
                try:
                    result = self.step(*pos, **kw)
                finally:
                    _node.capture = None
            program = rec.program
            program.outputs = rec.output_template(result)
            self._writebacks(rec, entry_state)
            rec.check_unknown()
        finally:
            restore()
        program.scalars = tape.entries
        # the same comparison once (keyed with the operand's type: a slot is an int subclass)
        program.guards = list({(g[0], g[1], type(g[2]), g[2], g[3]): g for g in tape.guards}.values())
        entry = _Entry(key, program, readers, self._key(flat, kw_names))
        entry.timeline = tl
        entry.start_bytes = tl.events[0][1]
        entry.result_template = program.outputs
        return entry, _concrete(result)

    def _trace_optimizers(self, tape, readers):
        """Replaces the optimizers' numbers by traced scalars; returns the function that
        puts concrete values back (and records the scalar write-backs)."""
        swapped = []
        for k, opt in enumerate(self.optimizers):
            for gi, g in enumerate(opt.param_groups):
                for name, v in list(g.items()):
                    if name == "params":
                        continue
                    if _traced_kind(v):
                        g[name] = tape.input(f"opt{k}.param_groups[{gi}].{name}", v)
                        readers.append(_group_reader(opt, gi, name, None))
                        swapped.append(("group", opt, gi, name, v))
                    elif isinstance(v, tuple) and v and all(_traced_kind(x) for x in v):
                        g[name] = tuple(
                            tape.input(f"opt{k}.param_groups[{gi}].{name}[{j}]", x) for j, x in enumerate(v)
                        )
                        for j in range(len(v)):
                            readers.append(_group_reader(opt, gi, name, j))
                        swapped.append(("group", opt, gi, name, v))
            for p, st in opt.state.items():
                pname = self.param_names.get(id(p), "?")
                for sk, sv in list(st.items()):
                    if _traced_kind(sv):
                        st[sk] = tape.input(f"opt{k}.state[{pname}].{sk}", sv)
                        readers.append(_state_reader(opt, p, sk))
        self._swapped = swapped

        def restore():
            for _, opt, gi, name, _v in swapped:
                g = opt.param_groups[gi]
                if isinstance(g.get(name), (Sym, tuple)) and _holds_sym(g[name]):
                    g[name] = _concrete(g[name])
            for opt in self.optimizers:
                for st in opt.state.values():
                    for sk, sv in list(st.items()):
                        if isinstance(sv, Sym):
                            st[sk] = sv.value

        return restore

    def _snapshot(self):
        """What the step may change, held by weak references: capture must not keep alive
        what the step frees (the previous gradients, replaced optimizer state)."""

        def ref(x):
            return None if x is None else weakref.ref(x)

        return {
            "params": [
                (p, ref(p._data), ref(p._grad), ref(p._grad._data) if p._grad is not None else None)
                for p in self.params
            ],
            "buffers": [(name, b, ref(b._data)) for name, b in self.buffers],
            "state": [
                (
                    k,
                    opt,
                    {
                        p: {sk: ref(v) if isinstance(v, Tensor) else v for sk, v in st.items()}
                        for p, st in opt.state.items()
                    },
                )
                for k, opt in enumerate(self.optimizers)
            ],
        }

    def _writebacks(self, rec, entry_state):
        program = rec.program
        for p, dref, gref, gdref in entry_state["params"]:
            name = self.param_names[id(p)]
            rec.writeback(Source("param", name, p), p, dref())
            grad = gref() if gref is not None else None
            if (
                gref is not None
                and grad is None
                or p._grad is not grad
                or (grad is not None and p._grad._data is not gdref())
            ):
                if p._grad is None:
                    program.writebacks.append(WriteBack(Source("grad", name + ".grad", p), None, "grad"))
                else:
                    vid = rec.lookup(p._grad._data)
                    if vid is None:
                        vid = rec.external(p._grad)
                    program.writebacks.append(WriteBack(Source("grad", name + ".grad", p), vid, "grad"))
            elif grad is not None:
                vid = rec.lookup(grad._data)
                if vid is not None and program.values[vid].source is None:  # accumulated in place
                    program.writebacks.append(WriteBack(Source("grad", name + ".grad", p), vid, "grad"))
        # Leaves other than the parameters (an argument that requires grad) get their new
        # gradient too.
        known = {id(p) for p in self.params}
        for leaf, vid in rec.leaf_grads.values():
            if id(leaf) in known:
                continue
            src = next((s for r, s in rec.externals if r() is leaf), None)
            if src is not None and src.kind == "arg":
                gsrc = Source("arggrad", src.name + ".grad", key=src.key)
            else:
                gsrc = Source("grad", (src.name if src is not None else "tensor") + ".grad", leaf)
            program.writebacks.append(WriteBack(gsrc, vid, "grad"))
        # A gradient the step dropped without reading (zero_grad(set_to_none=True)) is
        # dropped at the start of each replay too, as eager frees it before the forward.
        read = {id(program.values[v].source.obj) for v in program.inputs if program.values[v].source.kind == "grad"}
        program.cleared_grads = [
            p
            for p, _, gref, _ in entry_state["params"]
            if gref is not None and id(p) not in read and p._grad is not gref()
        ]
        for name, b, dref in entry_state["buffers"]:
            rec.writeback(Source("buffer", name, b), b, dref())
        for k, opt, before in entry_state["state"]:
            for p, st in opt.state.items():
                pname = self.param_names.get(id(p), "?")
                old = before.get(p, {})
                for sk, sv in st.items():
                    src = Source("state", f"opt{k}.state[{pname}].{sk}", (opt, p), sk)
                    if isinstance(sv, Sym):
                        program.writebacks.append(WriteBack(src, sv._slot, "scalar"))
                    elif isinstance(sv, Tensor):
                        if sk not in old:
                            vid = rec.lookup(sv._data)
                            if vid is None:
                                raise CaptureError(
                                    f"fw.compile: optimizer state {src.name} was made outside recorded ops"
                                )
                            program.writebacks.append(WriteBack(src, vid, "rebind"))
                        else:
                            before_t = old[sk]() if isinstance(old[sk], weakref.ref) else None
                            rec.writeback(src, sv, before_t._data if before_t is not None else None)
                    elif sk not in old or (not isinstance(old[sk], (Sym, weakref.ref)) and old[sk] != sv):
                        program.writebacks.append(WriteBack(src, sv, "const"))
        for _, opt, gi, name, _v in self._swapped:
            now = opt.param_groups[gi].get(name)
            if not _holds_sym(now) or _sym_inputs_unchanged(now):
                continue
            src = Source("group", f"param_groups[{gi}].{name}", (opt, gi), name)
            if isinstance(now, Sym):
                program.writebacks.append(WriteBack(src, now._slot, "scalar"))

    # --- looking at it ------------------------------------------------------------------------
    def _current(self) -> _Entry:
        if self.last is None:
            raise RuntimeError(f"fw.compile({self.__name__}): call the step once first (it is captured then)")
        if self.last.executor is None:
            self._build(self.last)
        return self.last

    @property
    def program(self):
        """The program of the last call (``print(compiled.program)``)."""
        return self._current().program

    @property
    def plan(self):
        """The memory plan of the last call's program (:class:`~framework.compile.plan.Plan`)."""
        return self._current().plan

    def report(self) -> dict:
        """What the passes and the plan did to the last call's program (bytes are totals).

        Keys: ``eager_peak_bytes`` (the capture step's peak, every tracked buffer),
        ``planned_peak_bytes``, ``lower_bound_bytes`` (the arena packed perfectly),
        ``floor_bytes`` (parameters + gradients + optimizer state + what backward reads
        from forward), ``arena_bytes``, ``persistent_bytes``, ``replay_peak_bytes`` (the
        last replay's measured peak, None before one), ``inplace_chains`` (each chain as
        op names, input first), ``reinplaced_ops``, ``removed_ops`` (DCE),
        ``copies_avoided_bytes`` (write-backs bound to their own buffer by the passes, and
        copies elided), ``unbound_writebacks`` (inputs whose chain does not end in their
        own buffer), ``kernel_owned`` (buffers not in the arena, with the reason),
        ``replay_copy_bytes`` (bytes inplace ops whose kernel returned another array copied
        back, over all replays: eager copies them too), ``nodes``,
        ``captures``, ``replays``, ``capture_seconds``, ``build_seconds``; under a memory
        budget: ``saved_bytes`` (of the floor, what backward reads from forward),
        ``memory_budget``, ``recomputed`` (each node backward runs again, with its FLOPs and
        bytes), ``recompute_flops``, ``recompute_bytes``, ``saved_bytes_eager`` and
        ``saved_bytes_least`` (nothing recomputed; the least any choice keeps).
        """

        return make_report(self, self._current())

    def explain(self, draw: str | None = None, file=None) -> str:
        """Prints (and returns) the inplace chains and the memory plan; ``draw=path`` also
        saves the plan as a figure (buffers as boxes: lifetime on x, offset on y)."""

        return _explain(self, self._current(), draw=draw, file=file)

    # --- building -----------------------------------------------------------------------------
    def _build(self, entry: _Entry) -> None:
        """Runs the passes and the planner on a captured program, then builds its executor."""
        t0 = time.perf_counter()
        program = entry.program
        # what backward recomputes instead of keeping, under the memory budget (first: the
        # other passes and the plan see the recomputed nodes as ordinary ones)
        entry.recompute = rematerialize(program, self._memory_budget)
        # what each node's kernel allocated for its results while capturing (before the
        # passes rewrite outputs into their inputs): the plan separates it from temporaries
        for v in program.values:
            if v.producer is not None and v.edge is None:
                info = program.nodes[v.producer].info
                info["new_bytes"] = info.get("new_bytes", 0) + v.nbytes
        replay.annotate(program)
        alias.bind_writebacks(program)
        before = {id(wb.source): wb.how for wb in program.writebacks}
        before_bytes = {
            id(wb.source): program.values[wb.value].nbytes
            for wb in program.writebacks
            if wb.how == "rebind" and wb.value is not None
        }
        reinplaced = reinplace(program)
        names = [program.nodes[i].name for i in reinplaced if not program.nodes[i].info.get("elided")]
        elided = [program.nodes[i] for i in reinplaced if program.nodes[i].info.get("elided")]
        elided_bytes = sum(program.values[n.outputs[0]].nbytes for n in elided)
        removed = eliminate_dead_code(program)
        classes = alias.bind_writebacks(program)
        bound_now = sum(
            before_bytes.get(id(wb.source), 0)
            for wb in program.writebacks
            if wb.how == "bound" and before.get(id(wb.source)) == "rebind"
        )
        transient = _transients(program, entry.timeline)
        entry.plan = plan = plan_memory(program, classes, transient)
        verify(program, plan)
        entry.eager_peak_bytes = entry.timeline.peak - entry.start_bytes + plan.persistent_bytes
        entry.timeline = None  # its events were only needed for the transients
        entry.executor = replay.build(program, plan, self.cuda_graph)
        entry.build_seconds = time.perf_counter() - t0
        entry.report = {
            "reinplaced_ops": names,
            "removed_ops": removed,
            "copies_avoided_bytes": bound_now + elided_bytes,
            "copies_elided": len(elided),
        }


# --- helpers ---------------------------------------------------------------------------------


def _device_index(arr):
    """The guard's device of an array: None on the CPU, the GPU's index on CUDA."""
    dev = backend.device_of(arr)
    return None if dev.type == "cpu" else dev.index


def _step_device(externals) -> backend.Device:
    """The one device every tensor the step starts from lives on (CaptureError if several)."""
    found = {}
    for t, src in externals:
        found.setdefault(backend.device_of(t._data), src.name)
    if len(found) > 1:
        where = ", ".join(f"{name} on {dev}" for dev, name in found.items())
        raise CaptureError(f"fw.compile: the step's tensors live on several devices ({where}); a program runs on one")
    return next(iter(found), backend.CPU)


def _counting(device):
    """On a GPU, the pool hook for the block (the plan and the report count the GPU pool);
    one that was already on stays on, one turned on here is turned off after."""
    if device is None or device.type == "cpu":
        return contextlib.nullcontext()
    return memory.gpu_hook()


def _timeline_kind(device) -> str:
    return "cpu" if device is None or device.type == "cpu" else "cuda"


def _traced_kind(v) -> bool:
    """A number the capture traces instead of baking: Python's and NumPy's (not booleans)."""
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def _holds_sym(v) -> bool:
    return isinstance(v, Sym) or (isinstance(v, tuple) and any(isinstance(x, Sym) for x in v))


def _sym_inputs_unchanged(v) -> bool:
    items = v if isinstance(v, tuple) else (v,)
    return all(isinstance(x, Sym) and x._tape.entries[x._slot][0] == "input" for x in items)


def _concrete(x):
    if isinstance(x, Sym):
        return x.value
    if isinstance(x, tuple):
        return tuple(_concrete(i) for i in x)
    if isinstance(x, list):
        return [_concrete(i) for i in x]
    return x


def _arg_reader(i):
    return lambda flat: flat[i]


def _group_reader(opt, gi, name, j):
    if j is None:
        return lambda flat: opt.param_groups[gi][name]
    return lambda flat: opt.param_groups[gi][name][j]


def _state_reader(opt, p, key):
    return lambda flat: opt.state[p][key]


def _transients(program, timeline) -> dict:
    """node index -> the most bytes its kernel held beyond what was live before it (its new
    outputs, what it kept for backward, its temporaries) while capturing."""
    if timeline is None:
        return {}
    events = timeline.events
    out = {}
    for n in program.nodes:
        span = n.info.get("events")
        if not span:
            continue
        e0, e1 = span
        if e1 <= e0:
            continue
        before = events[e0 - 1][1] if e0 > 0 else events[0][1]
        peak = max(e[1] for e in events[e0:e1])
        if peak > before:
            out[n.index] = peak - before
    return out


def compile(  # noqa: A001
    step=None,
    *,
    modules=None,
    optimizers=None,
    explain: bool = False,
    cache_size: int = CACHE_SIZE,
    cuda_graph: bool = True,
    fullgraph: bool = True,
    dynamic: bool | None = None,
    mode: str | None = None,
    memory_budget: float = 1.0,
):
    """Compiles a training step: captured at its first call, replayed at the next ones.

    Args:
        step: a function that runs one training step and returns the loss (or any tensors).
        modules: the modules whose train/eval mode and parameters the guards check; found
            from the step's closure and globals when not given.
        optimizers: likewise for optimizers (their hyperparameters are traced).
        explain: print the inplace chains and the memory plan after each capture.
        cache_size: how many captured programs are kept (one per guard key).
        cuda_graph: on a GPU, replay the step as one CUDA graph where it can be captured
            (docs/COMPILE.md, "CUDA graphs"); False: always replay it node by node.
        fullgraph, dynamic, mode: ``torch.compile``'s, for code written for it
            (:func:`_torch_options`): the whole step is one graph (``fullgraph=True``; no
            graph breaks: what cannot be captured raises), each new shape is captured
            again (``dynamic`` None or False), ``mode`` None, ``"default"`` or
            ``"reduce-overhead"`` (CUDA graphs, as ``cuda_graph=True``). Anything else
            raises a ValueError.
        memory_budget: ``torch.compile``'s ``activation_memory_budget``, in [0, 1]: the
            bytes backward keeps from forward, as a fraction of the way from the least any
            choice of recomputation keeps (0: recompute all that can be recomputed) to what
            eager keeps (1, the default: nothing is recomputed). Backward recomputes the
            cheapest values to get under it (docs/COMPILE.md, "A memory budget"); the
            numbers stay bitwise eager ``off``'s. Another value raises a ValueError.

    Returns:
        A :class:`CompiledStep` with the step's signature. Usable as a decorator, with or
        without arguments.
    """
    _torch_options(fullgraph, dynamic, mode, cuda_graph)
    memory_budget = check_budget(memory_budget)
    if step is None:
        return lambda fn: CompiledStep(fn, modules, optimizers, explain, cache_size, cuda_graph, memory_budget)
    return CompiledStep(step, modules, optimizers, explain, cache_size, cuda_graph, memory_budget)


def _torch_options(fullgraph, dynamic, mode, cuda_graph) -> None:
    """Checks ``torch.compile``'s options against what a captured step does; raises a
    ValueError for one it cannot honour rather than accept it and do otherwise."""
    if fullgraph is not True:
        raise ValueError(
            "fw.compile(fullgraph=False) is not supported: a step is captured whole or refused with an error "
            "naming the line (there are no graph breaks); leave fullgraph=True"
        )
    if dynamic:
        raise ValueError(
            "fw.compile(dynamic=True) is not supported: a program is specialized to its input shapes, and a "
            "new shape is captured again (dynamic=None or False)"
        )
    if mode not in (None, "default", "reduce-overhead"):
        raise ValueError(
            f"fw.compile(mode={mode!r}) is not supported: fw.compile does not autotune kernels; mode is None, "
            "'default' or 'reduce-overhead' (CUDA graphs on a GPU)"
        )
    if mode == "reduce-overhead" and not cuda_graph:
        raise ValueError("fw.compile(mode='reduce-overhead') replays CUDA graphs: it contradicts cuda_graph=False")
