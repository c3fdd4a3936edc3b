"""Replay: run a planned program's nodes on arrays, without autograd's bookkeeping.

:func:`build` turns a :class:`Program` and its :class:`~framework.compile.plan.Plan`
into an :class:`Executor`: one instruction (a closure) per node, over an environment
list ``env`` that holds the array of every value. Instructions come from the kernel
table (:mod:`framework.compile.kernels`: a direct NumPy call writing through ``out=``)
or, for the other ops, call the op's own ``forward``/``backward`` on arrays with a
fresh context object: no version counters, no graph, no saved-tensor objects, no
memory bookkeeping beyond counting the buffers a kernel allocates.

Arena buffers are bound once, when the executor is built. Program inputs are read from
their sources at each call (parameters keep their arrays across calls, because the
plan updates them in place).
"""

from __future__ import annotations

import numpy as np

from .. import memory
from ..autograd.function import CopySlices
from ..tensor import _wrap
from . import kernels
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
    """Runs one planned program: ``executor.run(args)`` returns the step's result."""

    def __init__(self, program, plan):
        self.program = program
        self.plan = plan
        self.env: list = [None] * len(program.values)
        self.scal: list = []
        self.ctxs: dict = {}
        self.arena = None
        self.instructions: list = []
        self.replay_copy_bytes = 0  # bytes inplace kernels returned elsewhere and replay copied back
        self._bind_arena()
        self._build()

    # --- building -----------------------------------------------------------------
    def _bind_arena(self) -> None:
        plan, env, values = self.plan, self.env, self.program.values
        if plan.arena_bytes:
            self.arena = memory.track(np.empty(plan.arena_bytes, dtype=np.uint8), "workspace")
        for vid, off in plan.offsets.items():
            v = values[vid]
            env[vid] = np.ndarray(v.shape, dtype=v.dtype, buffer=self.arena, offset=off, strides=v.strides)

    def _build(self) -> None:
        program, plan = self.program, self.plan
        env, scal, ctxs = self.env, self.scal, self.ctxs
        frees = plan.frees
        for node in program.nodes:
            instr = kernels.lower(node, program, plan, env, scal, ctxs)
            if instr is None:
                instr = self._generic(node)
            self.instructions.append(instr)
            dead = frees.get(node.index)
            if dead:
                self.instructions.append(_freer(env, dead))
            done = plan.ctx_done.get(node.index)
            if done is not None:
                self.instructions.append(_ctx_dropper(ctxs, done))

    def _generic(self, node):
        kind = node.kind
        if kind == "call":
            return self._generic_call(node)
        if kind == "backward":
            return self._generic_backward(node)
        raise RuntimeError(f"fw.compile: no instruction for node kind {kind!r}")

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
        dyn_params = {k: _resolver(t, env, scal) for k, t in node.params.items()
                      if not _is_static(t) and not isinstance(t, StatsOut)}
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
        outputs = node.outputs
        view_fn = node.info.get("copyslices")
        n_in = len(fnode.inputs)
        backward = cls.backward
        track = memory.track
        fresh = [vid is not None and vid not in self.plan.offsets and self.program.values[vid].edge is None
                 for vid in outputs]

        def run():
            ctx = ctxs[fwd]
            ctx.reuse_grad = reuse
            d = ctx.__dict__
            for name, vid in saved:
                d[name] = env[vid]
            g = env[gv]
            if view_fn is not None:
                ctx.next = (None,) * n_in  # run_backward checks the count of gradients against it
                cs = CopySlices.__new__(CopySlices)
                cs.fn, cs.view_fn = ctx, view_fn
                outs = cs.backward(g)
            else:
                outs = backward(ctx, g)
            if type(outs) is not tuple:
                outs = (outs,)
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
        scal = self.scal
        scal[:] = evaluate(program.scalars, scalar_inputs) if program.scalars else ()
        self.bind_inputs(args)
        for instr in self.instructions:
            instr()
        result = self._outputs(program.outputs)
        self._write_back(args)
        self.ctxs.clear()
        env = self.env
        keep = self.plan.offsets
        for vid in range(len(env)):  # kernel-owned arrays go; arena views stay bound
            if vid not in keep:
                env[vid] = None
        return result

    def _outputs(self, template):
        if isinstance(template, Ref):
            return _wrap(self.env[template.id])
        if isinstance(template, ScalarRef):
            return self.scal[template.slot]
        if isinstance(template, (tuple, list)):
            return type(template)(self._outputs(t) for t in template)
        if isinstance(template, dict):
            return {k: self._outputs(t) for k, t in template.items()}
        return template

    def _write_back(self, args) -> None:
        env = self.env
        for wb in self.program.writebacks:
            src, how = wb.source, wb.how
            if how == "scalar":
                _set_scalar(src, self.scal[wb.value])
                continue
            if how == "const":
                _set_scalar(src, wb.value)
                continue
            if how == "grad":
                src.obj._grad = None if wb.value is None else _wrap(env[wb.value])
                continue
            arr = env[wb.value]
            t = src.tensor(args) if src.kind != "state" else src.obj[0].state.get(src.obj[1], {}).get(src.key)
            if how == "bound":
                pass
            elif how == "copy":
                np.copyto(t._data, arr)
            elif how == "rebind":
                if src.kind == "state" and t is None:
                    opt, p = src.obj
                    opt.state.setdefault(p, {})[src.key] = _wrap(arr)
                    memory.retag(arr, "optimizer_state")
                    continue
                t._data = arr
                if src.kind == "param":
                    memory.retag(arr, "parameters")
                elif src.kind == "state":
                    memory.retag(arr, "optimizer_state")
            if t is not None:
                t._vc.bump("compiled step", ("<compiled step>", 0))


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


def _freer(env, dead):
    def free():
        for vid in dead:
            env[vid] = None

    return free


def _ctx_dropper(ctxs, done):
    def drop():
        ctxs.pop(done, None)

    return drop


def build(program, plan) -> Executor:
    """The executor of a planned program."""
    return Executor(program, plan)
