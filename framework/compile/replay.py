"""Replay: run a planned program's nodes on arrays, without autograd's bookkeeping.

:func:`build` turns a :class:`Program` and its :class:`~framework.compile.plan.Plan` into
an :class:`Executor`. Nodes with a direct kernel (:mod:`framework.compile.kernels`) become
straight-line Python in ONE generated function (as ``torch.fx`` generates code for a
graph): each is a NumPy call writing through ``out=`` into its planned buffer, and the
arena buffers (and the views of them, computed once) are globals of that function, so a
replayed op costs one NumPy call. The other nodes call the op's own ``forward`` or
``backward`` on arrays with a fresh context object (no version counters, no graph, no
saved-tensor objects), through a closure the generated code calls. ``executor.source``
is the generated code.

Program inputs are bound at each call: their arrays become globals of the generated
function and entries of ``env``, the list that holds every value a kernel makes at run
time (and that the op-code closures read).
"""

from __future__ import annotations

import math
import re

import numpy as np

from .. import backend, memory
from ..autograd.function import CopySlices, _as_array
from ..ops.broadcast import sum_axes
from ..ops.elementwise import relu_array
from ..ops.view import reshape_view
from ..tensor import _wrap
from . import kernels
from .cudagraph import GraphReplay
from .program import Ref, ScalarRef, StatsOut
from .scalars import evaluate


class GuardFailed(Exception):
    """An input no longer matches what the program was captured with (shape, dtype, ...)."""


def _resolver(template, env, scal):
    """A function of no arguments that rebuilds ``template`` from the current env."""
    if isinstance(template, Ref):
        i = template.id
        return lambda: env[i]
    if isinstance(template, ScalarRef):
        s = template.slot
        return lambda: scal[s]
    if isinstance(template, (tuple, list)):
        parts = [_resolver(t, env, scal) for t in template]
        kind = type(template)
        return lambda: kind(p() for p in parts)
    return lambda: template


def _is_static(template) -> bool:
    if isinstance(template, (Ref, ScalarRef, StatsOut)):
        return False
    if isinstance(template, (tuple, list)):
        return all(_is_static(t) for t in template)
    if isinstance(template, dict):
        return all(_is_static(t) for t in template.values())
    return True


class Executor:
    """Runs one planned program: ``executor.run(args, scalar_inputs)`` returns the step's result."""

    debug_marks = False  # set to put a memory.mark() before every node (to compare with the plan)

    def __init__(self, program, plan, cuda_graph: bool = True):
        self.program = program
        self.plan = plan
        dev = program.device
        # a step on a GPU replays as one CUDA graph where the capture succeeds (cudagraph.py)
        self.cuda_graph = GraphReplay(self) if cuda_graph and dev is not None and dev.type == "cuda" else None
        self.env: list = [None] * len(program.values)
        self.scal: list = []
        self.ctxs: dict = {}
        self.arena = None
        self.replay_copy_bytes = 0  # bytes inplace kernels returned elsewhere and replay copied back
        # on a GPU, each check node's device flag: node index -> (check, flag, args) (_check)
        self.flags: dict = {}
        self._bind_arena()
        self._build()

    # --- building -----------------------------------------------------------------
    def _bind_arena(self) -> None:
        plan, values, dev = self.plan, self.program.values, self.program.device
        on_gpu = dev is not None and dev.type == "cuda"
        if plan.arena_bytes:  # ONE allocation, on the step's device
            xp = backend.xp_for(dev) if on_gpu else np
            with backend.device_context(dev or backend.CPU):
                self.arena = memory.track(xp.empty(plan.arena_bytes, dtype=np.uint8), "workspace")
        self.static = {}
        for vid, off in plan.offsets.items():
            v = values[vid]
            if on_gpu:
                self.static[vid] = type(self.arena)(v.shape, v.dtype, memptr=self.arena.data + off, strides=v.strides)
            else:
                self.static[vid] = np.ndarray(v.shape, dtype=v.dtype, buffer=self.arena, offset=off, strides=v.strides)

    def _build(self) -> None:
        program, plan = self.program, self.plan
        gen = Gen(program, plan, self.static, self.env)
        inputs = set(program.inputs)
        for node in program.nodes:
            gen.begin(node)
            if self.debug_marks:
                gen.line(f"mark('node {node.index}')")
            if not kernels.emit(node, gen):
                name = f"g{node.index}"
                gen.globals[name] = self._generic(node)
                gen.line(f"{name}()")
            gen.end()
            # The same arrays, seen again after this node wrote their buffer through another
            # view ("alias" values): op-code closures read them from env.
            for vid in gen.refreshes.get(node.index, ()):
                if vid not in gen.static:
                    gen.line(f"env[{vid}] = {gen.a(program.values[vid].edge[1])}")
            dead = [v for v in plan.frees.get(node.index, ()) if v not in gen.static and v not in inputs]
            if dead:
                gen.line(" = ".join(f"env[{v}]" for v in dead) + " = None")
            done = plan.ctx_done.get(node.index)
            if done is not None and not node.info.get("lowered"):
                gen.line(f"ctxs.pop({done}, None)")
        for vid, arr in gen.static.items():
            self.env[vid] = arr
        self.static = gen.static
        gen.globals.update(env=self.env, scal=self.scal, ctxs=self.ctxs)
        self.source, self._replay = gen.compile(program.name)
        self.input_names = [(vid, f"a{vid}") for vid in program.inputs]
        self.globals = gen.globals
        sinks = set(program.sink_refs())
        self.leftovers = [v for v in range(len(program.values)) if v not in gen.static and (v in sinks or v in inputs)]

    def rebuild(self) -> None:
        """Binds the arena again after the plan's layout changed (a step replayed as a CUDA
        graph holds every buffer in it: cudagraph.py) and generates the replay function
        over the new buffers."""
        self.arena = None
        self._bind_arena()
        self._build()

    def ticked_replay(self, tick):
        """The replay function with ``tick(k)`` called as node k begins: what the kernels
        allocate can then be placed on the plan's timeline (nodes)."""
        source = re.sub(r"^(\s*)# (\d+): .*$", r"\g<0>\n\1tick(\2)", self.source, flags=re.M)
        source = source.replace("def replay():", "def replay_ticked():", 1)
        scope = self.globals
        scope["tick"] = tick
        exec(compile(source, f"<fw.compile: {self.program.name} (ticked)>", "exec"), scope)  # noqa: S102
        return scope.pop("replay_ticked")

    def _generic(self, node):
        kind = node.kind
        if kind == "call":
            return self._generic_call(node)
        if kind == "backward":
            return self._generic_backward(node)
        if kind == "create":
            return self._create(node)
        if kind == "check":
            return self._check(node)
        raise RuntimeError(f"fw.compile: no instruction for node kind {kind!r}")

    def _check(self, node):
        """A check of a tensor's values (``cross_entropy``'s target range), run again. On a GPU
        it keeps what it finds in a device flag of its own (made once), registered after each
        call (:meth:`run`): nothing is read back inside the step, or its CUDA graph."""
        check, args, env, vid = node.info["check"], node.info["args"], self.env, node.inputs[0].id
        dev = self.program.device
        if dev is None or dev.type != "cuda":
            return lambda: check(env[vid], *args)
        if node.index not in self.flags:
            self.flags[node.index] = (check, check.new_flag(dev), args)
        flag = self.flags[node.index][1]
        return lambda: check(env[vid], *args, flag=flag)

    def _create(self, node):
        """A creation recipe (fw.zeros, fw.randn, ...) called again: random draws stay in step."""

        recipe, shape, dtype, dev = (node.info[k] for k in ("recipe", "shape", "dtype", "device"))
        xp, env, vid, track = backend.xp_for(dev), self.env, node.outputs[0], memory.track

        def run():
            with backend.device_context(dev):
                env[vid] = track(recipe(xp, shape, dtype))

        return run

    def _out_for(self, node):
        """A function returning the buffer a call node's kernel must write into, or None."""
        env, plan = self.env, self.plan
        o = node.outputs[0]
        if node.inplace:
            src = node.inputs[0].id
            return lambda: env[src]
        if o in plan.offsets and kernels.writes_out(node.op):
            return lambda: env[o]
        return lambda: None

    def _generic_call(self, node):
        cls = node.op
        env, scal, ctxs = self.env, self.scal, self.ctxs
        args = [_resolver(t, env, scal) for t in node.inputs]
        static_params = {k: t for k, t in node.params.items() if _is_static(t)}
        dyn_params = {
            k: _resolver(t, env, scal)
            for k, t in node.params.items()
            if not _is_static(t) and not isinstance(t, StatsOut)
        }
        stats = [(k, t.values) for k, t in node.params.items() if isinstance(t, StatsOut)]
        needs = node.info.get("needs", (False,) * len(node.inputs))
        out_buf = self._out_for(node)
        o = node.outputs[0]
        inplace = node.inplace
        keep_ctx = node.index in self.plan.ctx_used
        copies = node.info.get("saved_copies", {})
        consts = list(node.info.get("saved_consts", {}).items())
        track = memory.track
        forward = cls.forward
        fresh = o not in self.plan.offsets and not inplace and not node.reinplaced
        is_view = cls.is_view
        executor = self

        def run():
            ctx = cls.__new__(cls)
            ctx.needs_input_grad = needs
            arrays = [a() for a in args]
            params = dict(static_params)
            for k, r in dyn_params.items():
                params[k] = r()
            stat_dicts = []
            for k, _ in stats:
                d = params[k] = {}
                stat_dicts.append(d)
            for name, idx in copies.items():
                ctx.__dict__[name] = track(arrays[idx].copy(), "inplace_copies")
            for name, idx in consts:
                ctx.__dict__[name] = arrays[idx]
            out = ctx.out = out_buf()
            r = forward(ctx, *arrays, **params)
            if isinstance(r, np.generic):
                r = np.asarray(r)
            if out is not None:
                if r is not out:
                    out[...] = r
                    executor.replay_copy_bytes += out.nbytes
                r = out
            elif fresh and not is_view:
                track(r, "activations")
            ctx.out = None
            env[o] = r
            for (_, side), d in zip(stats, stat_dicts):
                for key, vid in side.items():
                    env[vid] = d[key]
            if keep_ctx:
                ctxs[node.index] = ctx

        return run

    def _generic_backward(self, node):
        env, ctxs = self.env, self.ctxs
        fwd = node.info["fwd"]
        fnode = self.program.nodes[fwd]
        cls = node.op
        saved = list(fnode.info.get("saved", {}).items())
        gv = node.info["grad"]
        reuse = node.info.get("reuse_grad", False)
        planned = node.info.get("planned_reuse", False)
        outputs = node.outputs
        view_fn = node.info.get("copyslices")
        base_order = node.info.get("base_order")
        n_in = len(fnode.inputs)
        backward = cls.backward
        track = memory.track
        fresh = [
            vid is not None and vid not in self.plan.offsets and self.program.values[vid].edge is None
            for vid in outputs
        ]

        category = memory.category

        def run():
            with category("gradients"):  # as the engine does: buffers a backward makes are gradients
                _backward()

        def _backward():
            ctx = ctxs[fwd]
            ctx.reuse_grad = reuse
            d = ctx.__dict__
            for name, vid in saved:
                d[name] = env[vid]
            g = env[gv]
            if view_fn is not None:
                ctx.next = (None,) * n_in  # run_backward checks the count of gradients against it
                cs = CopySlices.__new__(CopySlices)
                cs.fn, cs.view_fn, cs.base_order = ctx, view_fn, base_order
                outs = cs.backward(g)
            else:
                outs = backward(ctx, g)
            if type(outs) is not tuple:
                outs = (outs,)
            if planned and outs[0] is not g:
                raise RuntimeError(
                    f"fw.compile: {node.name} was planned to write its gradient over the incoming one "
                    "(kernels.REUSES_GRAD) but returned another array: the op's backward changed; "
                    "update its entry in framework/compile/kernels.py"
                )
            for vid, o, f in zip(outputs, outs, fresh):
                if vid is not None:
                    if isinstance(o, np.generic):
                        o = np.asarray(o)
                    if f:
                        track(o, "gradients")
                    env[vid] = o

        return run

    # --- running ---------------------------------------------------------------------
    def bind_inputs(self, args) -> None:
        """Reads every program input from its source (raises GuardFailed on a mismatch)."""
        env, values = self.env, self.program.values
        for vid in self.program.inputs:
            v = values[vid]
            arr = v.source.read(args)
            if arr is None or arr.shape != v.shape or arr.dtype != v.dtype:
                raise GuardFailed(f"{v.source.name} changed (shape, dtype or presence)")
            env[vid] = arr

    def run(self, args, scalar_inputs):
        program = self.program
        self.scal[:] = evaluate(program.scalars, scalar_inputs) if program.scalars else ()
        for leaf in program.cleared_grads:  # the step's zero_grad(set_to_none=True)
            leaf._grad = None
        graph = self.cuda_graph
        if graph is not None:  # what the last launch handed out stays the caller's
            graph.release()
        self.bind_inputs(args)
        env = self.env
        graphed = graph is not None and graph.run(self.scal)
        g = self.globals  # after graph.run: laying out the graph's arena rebuilds the function
        if not graphed:
            for vid, name in self.input_names:
                g[name] = env[vid]
            if graph is not None and graph.wants_recording():
                with graph.recording() as tick:  # the first replay's allocations, for the capture
                    self.ticked_replay(tick)()
            else:
                self._replay()
        result = self._outputs(program.outputs, graphed)
        given = self._write_back(args)
        if graphed:
            graph.handed_out(given)
        for check, flag, check_args in self.flags.values():  # read later (check_targets), as eager
            check.defer(flag, *check_args)
        self.ctxs.clear()
        for vid in self.leftovers:  # what the caller got is theirs now; the batch is not kept
            env[vid] = None
        for _, name in self.input_names:
            g[name] = None
        return result

    def _outputs(self, template, copy: bool = False):
        """What the step returns; ``copy``: a copy of each array (a graph's buffers are
        written over by its next launch)."""
        if isinstance(template, Ref):
            arr = self.env[template.id]
            return _wrap(arr.copy() if copy else arr)
        if isinstance(template, ScalarRef):
            return self.scal[template.slot]
        if isinstance(template, (tuple, list)):
            return type(template)(self._outputs(t, copy) for t in template)
        if isinstance(template, dict):
            return {k: self._outputs(t, copy) for k, t in template.items()}
        return template

    def _write_back(self, args) -> dict:
        """Puts the step's results where eager leaves them; returns ``{id(array): [tensors]}``
        for the arrays it handed to gradients and rebound tensors."""
        env = self.env
        given: dict = {}
        for wb in self.program.writebacks:
            src, how = wb.source, wb.how
            if how == "scalar":
                _set_scalar(src, self.scal[wb.value])
                continue
            if how == "const":
                _set_scalar(src, wb.value)
                continue
            if how == "grad":
                leaf = args[src.key] if src.kind == "arggrad" else src.obj
                leaf._grad = None if wb.value is None else _wrap(env[wb.value])
                if leaf._grad is not None:
                    given.setdefault(id(leaf._grad._data), []).append(leaf._grad)
                continue
            arr = env[wb.value]
            t = src.tensor(args) if src.kind != "state" else src.obj[0].state.get(src.obj[1], {}).get(src.key)
            if how == "rebind":
                if src.kind == "state" and t is None:
                    opt, p = src.obj
                    t = opt.state.setdefault(p, {})[src.key] = _wrap(arr)
                    memory.retag(arr, "optimizer_state")
                    given.setdefault(id(arr), []).append(t)
                    continue
                t._data = arr
                given.setdefault(id(arr), []).append(t)
                if src.kind == "param":
                    memory.retag(arr, "parameters")
                elif src.kind == "state":
                    memory.retag(arr, "optimizer_state")
            if t is not None:
                t._vc.bump("compiled step", ("<compiled step>", 0))
        return given


def _set_scalar(src, value) -> None:
    if src.kind == "state":
        opt, p = src.obj
        opt.state.setdefault(p, {})[src.key] = value
    elif src.kind == "group":
        opt, gi = src.obj
        group = opt.param_groups[gi]
        key = src.key
        if isinstance(key, tuple):  # an element of a tuple hyperparameter (Adam's betas)
            name, i = key
            items = list(group[name])
            items[i] = value
            group[name] = tuple(items)
        else:
            group[key] = value


def build(program, plan, cuda_graph: bool = True) -> Executor:
    """The executor of a planned program (``cuda_graph``: try to replay a GPU program as
    one CUDA graph)."""
    return Executor(program, plan, cuda_graph)


# --- code generation ------------------------------------------------------------------------


class Gen:
    """Writes the generated replay function (see the module docstring and kernels.emit).

    ``static`` maps the values whose array is fixed when the executor is built (arena
    buffers, versions written into them, views of them) to that array; such a value is the
    global ``a<id>``. A program input is the global ``a<id>`` too, rebound at every call.
    Any other value is ``env[<id>]``, set by whatever makes it at run time.
    """

    def __init__(self, program, plan, static, env):
        self.program, self.plan = program, plan
        self.refreshes: dict = {}  # node index -> values it re-versions without producing them
        for v in program.values:
            if v.edge is not None and v.edge[0] == "alias" and v.producer is not None:
                self.refreshes.setdefault(v.producer, []).append(v.id)
        self.static = dict(static)
        self.env = env
        self.inputs = set(program.inputs)
        self.lines: list[str] = []
        dev = program.device
        # the module the generated calls name ``np``: NumPy, or CuPy for a step on a GPU
        self.xp = backend.xp_for(dev) if dev is not None and dev.type == "cuda" else np
        self.globals = {
            "np": self.xp,
            "np_add_reduce": np.add.reduce,
            "sum_axes": sum_axes,
            "relu_array": relu_array,
            "reshape_view": reshape_view,
            "track": memory.track,
            "as_array": _as_array,
            "mark": memory.mark,
        }
        self.ntemp = 0
        self.node = None
        self.names: dict = {}  # value id -> the one name of its array (versions share it)
        self.temps: list = []  # locals of the current node

    # --- names ------------------------------------------------------------------------
    def a(self, vid) -> str:
        name = self.names.get(vid)
        if name is not None:
            return name
        if vid in self.static:
            name = self.names[vid] = f"a{vid}"
            self.globals[name] = self.static[vid]
            return name
        if vid in self.inputs:
            name = self.names[vid] = f"a{vid}"
            return name
        return f"env[{vid}]"

    def const(self, x) -> str:
        if type(x) in (int, bool, type(None)) or (type(x) is float and math.isfinite(x)):
            return repr(x)  # a float's repr reads back as the same float
        name = f"c{len(self.globals)}"
        self.globals[name] = x
        return name

    def s(self, template) -> str:
        if isinstance(template, Ref):
            return self.a(template.id)
        if isinstance(template, ScalarRef):
            return f"scal[{template.slot}]"
        return self.const(template)

    def fnode(self, node):
        return self.program.nodes[node.info["fwd"]]

    # --- statements -----------------------------------------------------------------------
    def begin(self, node) -> None:
        """Starts a node. An output that is a new version of a buffer, in the same layout,
        is the same array as the version before: it gets the same name (and is fixed when
        that one is)."""
        self.node = node
        values = self.program.values
        for vid in list(node.outputs) + self.refreshes.get(node.index, []):
            if vid is None or vid in self.names:
                continue
            v = values[vid]
            if v.edge is None or v.edge[0] not in ("write", "alias"):
                continue
            src = values[v.edge[1]]
            if (src.shape, src.strides, src.dtype) != (v.shape, v.strides, v.dtype):
                continue
            if src.id in self.static or src.id in self.inputs or src.id in self.names:
                self.names[vid] = self.a(src.id)
                if src.id in self.static:
                    self.static[vid] = self.static[src.id]
        self.line(f"# {node.index}: {node.name}")

    def line(self, text: str) -> None:
        self.lines.append("    " + text)

    def temp(self, expr: str) -> str:
        self.ntemp += 1
        name = f"_t{self.ntemp}"
        self.line(f"{name} = {expr}")
        self.temps.append(name)
        return name

    def end(self) -> None:
        """Ends a node: its temporaries go now (a local would keep an array alive to the end)."""
        if self.temps:
            self.line("del " + ", ".join(self.temps))
            self.temps = []

    def target(self, node, vid):
        """The name of the buffer output ``vid`` of ``node`` must be written into, or None."""
        v = self.program.values[vid]
        if node.kind == "call" and node.inplace and vid == node.outputs[0]:
            return self.a(node.inputs[0].id)
        if vid in self.static:
            return self.a(vid)
        if v.edge is not None and v.edge[0] == "write":
            return self.a(v.edge[1])
        return None

    def buffer(self, node, vid, default):
        out = self.target(node, vid)
        if out is None and default is not None:
            out = self.temp(default)
        return out

    def done(self, vid, name) -> None:
        """The output ``vid`` is now in array ``name``: op-code closures read it from env."""
        if vid not in self.static and name != f"env[{vid}]":
            self.line(f"env[{vid}] = {name}")

    def call(self, node, vid, func, args, extra="", reshape=None, out_override=None) -> bool:
        out = out_override or self.target(node, vid)
        arglist = ", ".join(list(args) + ([extra] if extra else []))
        if out is not None:
            dst = out
            if reshape is not None:
                if vid in self.static:
                    name = f"k{vid}"
                    self.globals[name] = self.static[vid].reshape(reshape)
                    dst = name
                else:
                    dst = f"{out}.reshape({reshape!r})"
            self.line(f"{func}({arglist}, out={dst})")
            self.done(vid, out)
            return True
        expr = f"{func}({arglist})"
        if reshape is not None:
            expr = f"{expr}.reshape({self.program.values[vid].shape!r})"
        cat = "activations" if node.kind == "call" else "gradients"
        self.line(f"env[{vid}] = track(as_array({expr}), {cat!r})")
        return True

    def view(self, o, x, fn, fmt: str) -> bool:
        if x in self.static:
            self.static[o] = fn(self.static[x])
            return True
        self.line(f"env[{o}] = {fmt.format(self.a(x))}")
        return True

    def compile(self, name: str):
        body = self.lines or ["    pass"]
        source = "def replay():\n" + "\n".join(body) + "\n"
        # np.multiply -> np_multiply, a global: one lookup less per call
        for fname in sorted(set(re.findall(r"\bnp\.(\w+)\(", source))):
            self.globals[f"np_{fname}"] = getattr(self.xp, fname)
        source = re.sub(r"\bnp\.(\w+)\(", r"np_\1(", source)
        code = compile(source, f"<fw.compile: {name}>", "exec")
        scope = self.globals
        exec(code, scope)  # noqa: S102  (our own generated code, from the captured program)
        return source, scope["replay"]


class DryGen(Gen):
    """Asks an emitter whether it accepts a node, without writing anything."""

    def __init__(self, program):
        super().__init__(program, None, {}, None)

    def accepts(self, emitter, node) -> bool:
        self.lines, self.static, self.names = [], {}, {}
        return bool(emitter(node, self))

    def view(self, o, x, fn, fmt) -> bool:
        return True


def annotate(program) -> None:
    """Marks the forward/backward pairs that run on direct kernels (``info["lowered"]``).

    A forward runs lowered only together with its backward (they share no context object
    then): both must have an emitter that accepts the node (asked with a dry run).
    """
    backward_of = {n.info["fwd"]: n for n in program.nodes if n.kind == "backward"}
    for n in program.nodes:
        if n.kind == "call":
            n.info["in_shapes"] = [program.values[t.id].shape if isinstance(t, Ref) else () for t in n.inputs]
    if program.device is not None and program.device.type == "cuda":
        # On a GPU every op runs its own code: the direct kernels are NumPy's calls, and
        # the op's own kernels are the ones eager runs (bitwise the same results).
        for n in program.nodes:
            if n.kind in ("call", "backward"):
                n.info["lowered"] = False
        return
    dry = DryGen(program)
    for n in program.nodes:
        if n.kind != "call":
            continue
        ok = kernels.forward_ok(n, program)
        b = backward_of.get(n.index)
        if ok and b is not None:
            ok = n.op in kernels.BACKWARD and not b.info.get("copyslices") and dry.accepts(kernels.BACKWARD[n.op], b)
        if ok and not n.op.is_view:
            ok = dry.accepts(kernels.FORWARD[n.op], n)
        n.info["lowered"] = ok
        if b is not None:
            b.info["lowered"] = ok
