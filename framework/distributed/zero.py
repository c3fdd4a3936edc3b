"""ZeRO (Rajbhandari et al. 2020): the optimizer state, and at stage 2 the gradients, sharded across ranks.

Usage (every rank runs the same program)::

    dp = DataParallel(model)
    opt = ZeroRedundancyOptimizer(dp.parameters(), fw.optim.Adam, data_parallel=dp, stage=2, lr=1e-3)
    for x, y in shard:
        opt.zero_grad()
        loss_fn(dp(x), y).backward()
        dp.finish()                  # stage 2: each rank keeps its shard of the averaged gradients
        opt.step()                   # updates this rank's shard, then all-gathers the parameters

As ``torch.distributed.optim.ZeroRedundancyOptimizer`` (stage 1) and FSDP's ``SHARD_GRAD_OP``
(stage 2), over the layout of :class:`~framework.distributed.data_parallel.DataParallel`:

- Each dtype's parameters are laid out in ONE flat array in the order of their gradients'
  buckets (:meth:`DataParallel.flat_order`), padded to ``world * part`` elements, and each
  ``p._data`` is a view of it. Rank ``r`` owns the contiguous slice ``[r * part, (r + 1) *
  part)`` (a :class:`ShardPlan`): it keeps the optimizer state of that slice only and
  updates only it, with the wrapped optimizer's own rule (``Optimizer._update_over``, the
  code of its flat-buffer step), one call per run of parameters of one parameter group.
- Then the parameters are all-gathered in place (``MPI_Allgather`` with ``MPI.IN_PLACE``,
  or ``ncclAllGather`` on GPUs) over the flat array; under the policy ``off`` out of place
  into a new array (the parameters get new storage, as an ``off`` step gives them).
- Stage 1 reads this rank's slice of the averaged gradients where DataParallel left them
  (its flat gradient buffer, with no copy, under ``auto`` and ``on``). Stage 2 makes
  DataParallel reduce-scatter each bucket straight into this rank's shard of the gradients
  and let the rest go (:meth:`DataParallel._shard_gradients`).

Memory per rank, Rajbhandari et al.'s accounting for parameters, gradients and a state of
``K`` bytes per parameter over ``Ψ`` float32 parameters (Adam: K = 8): stage 0 holds
``(4 + 4 + K) Ψ``, stage 1 ``(4 + 4) Ψ + K Ψ / N``, stage 2 ``4 Ψ + (4 + K) Ψ / N``
(:func:`model_state_bytes`).

The numbers: stage 1 runs stage 0's allreduce and the same elementwise update on each
element, so it is stage 0 bit for bit. Stage 2's reduce-scatter sums the ranks' gradients
in an order of its own: with 2 ranks ``a + b == b + a`` and it is still bit for bit; with
more, each averaged gradient may differ from the allreduce's by rounding, at most
``2 (N - 1) 2^-24 sum_r |g_r| / N`` in float32 (docs/ZERO.md).

One process (no other ranks): the wrapped optimizer steps as it is, as torch's does.
"""

from __future__ import annotations

import copy
import math
from itertools import chain

import numpy as np

from .. import backend, inplace, memory
from ..autograd.grad_mode import enable_grad, no_grad
from ..callsite import call_site
from ..optim.flat import CPU_CHUNK
from ..optim.optimizer import Optimizer, _Updater
from ..tensor import Tensor, _wrap
from .data_parallel import DataParallel

__all__ = ["ShardPlan", "ZeroRedundancyOptimizer", "model_state_bytes"]


def model_state_bytes(numel: int, itemsize: int, state_per_param: int, stage: int, world: int) -> float:
    """Rajbhandari et al.'s bytes per rank of parameters, gradients and optimizer state.

    Args:
        numel: the parameters (Ψ).
        itemsize: bytes of a parameter and of its gradient (4 in float32).
        state_per_param: bytes of optimizer state per parameter (K: Adam's two float32
            moments 8, SGD's momentum 4, plain SGD 0).
        stage: 0 (every rank holds everything), 1 (state sharded), 2 (gradients too).
        world: the number of ranks (N).
    """
    p, k = numel * itemsize, numel * state_per_param
    if stage == 0:
        return p + p + k
    if stage == 1:
        return p + p + k / world
    if stage == 2:
        return p + (p + k) / world
    raise ValueError(f"ZeRO stage must be 0, 1 or 2, got {stage!r}")


class ShardPlan:
    """How one dtype's flat order is cut into ``world`` equal parts, one per rank.

    Attributes:
        dtype, params, offsets: the dtype, its parameters in flat order and where each starts.
        numel: the parameters' elements; padded: ``world * part`` (>= numel, the flat array's length).
        part: each rank's share, ``ceil(numel / world)``.
        first: where this rank's part starts (``rank * part``).
        lo, hi: the elements of parameters in it, ``[lo, hi)`` (the rest of it is padding).
    """

    __slots__ = ("dtype", "params", "offsets", "numel", "world", "rank", "part", "padded", "first", "lo", "hi")

    def __init__(self, dtype, params: list, world: int, rank: int) -> None:
        self.dtype = np.dtype(dtype)
        self.params = list(params)
        self.offsets, off = [], 0
        for p in self.params:
            self.offsets.append(off)
            off += p.numel()
        self.numel, self.world, self.rank = off, world, rank
        self.part = max(1, -(-off // world))
        self.padded = self.part * world
        self.first = rank * self.part
        self.lo = min(self.first, off)
        self.hi = min(self.first + self.part, off)

    def counts(self, start: int, stop: int) -> list[int]:
        """How many elements of ``[start, stop)`` fall in each rank's part."""
        return [max(0, min(stop, (q + 1) * self.part) - max(start, q * self.part)) for q in range(self.world)]

    def pieces(self, lo: int, hi: int) -> list:
        """``(param, a, b, at)`` for each parameter with elements in ``[lo, hi)``: its
        elements ``[a, b)`` (flattened), at ``at`` from ``lo``."""
        out = []
        for p, off in zip(self.params, self.offsets):
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                out.append((p, a - off, b - off, a - lo))
        return out


class _Run:
    """Consecutive elements of a rank's part whose parameters share a parameter group: one
    update of the wrapped optimizer's rule, with its own optimizer state."""

    __slots__ = ("lo", "hi", "group", "pieces", "chunk", "state")

    def __init__(self, lo: int, hi: int, group: int, pieces: list) -> None:
        self.lo, self.hi, self.group, self.pieces = lo, hi, group, pieces
        # as FlatGroup's chunks: cache-sized on the CPU, or a whole parameter when larger
        self.chunk = max([CPU_CHUNK] + [b - a for _, a, b, _ in pieces])
        self.state: dict = {}  # key -> a buffer of hi - lo elements, or a value (Adam's step)


def _runs(plan: ShardPlan, group_of: dict) -> list[_Run]:
    runs: list[_Run] = []
    for piece in plan.pieces(plan.lo, plan.hi):
        gi = group_of[id(piece[0])]
        lo = plan.lo + piece[3]
        hi = lo + piece[2] - piece[1]
        if runs and runs[-1].group == gi:
            run = runs[-1]
            run.pieces.append((piece[0], piece[1], piece[2], lo - run.lo))
            run.hi = hi
            run.chunk = max(run.chunk, piece[2] - piece[1])
        else:
            runs.append(_Run(lo, hi, gi, [(piece[0], piece[1], piece[2], 0)]))
    return runs


class ZeroRedundancyOptimizer:
    """Shards ``optimizer_class``'s state (stage 1), and the gradients (stage 2), across the
    ranks of ``data_parallel`` (see the module doc).

    Args:
        params: the parameters or parameter groups, as for ``optimizer_class``; the ones that
            require grad must be those ``data_parallel`` reduces.
        optimizer_class: the optimizer whose rule updates each rank's shard (SGD, Adam, AdamW).
        data_parallel: the :class:`DataParallel` model whose gradients are averaged.
        stage: 1 (optimizer state sharded) or 2 (gradients sharded too).
        **defaults: the optimizer's hyperparameters (``lr=...``).

    Attributes:
        optim: the wrapped optimizer: its ``param_groups`` are this one's (a learning-rate
            schedule sets them there), its ``state`` stays empty.
        plans: dtype -> :class:`ShardPlan` (empty with one process).
        stage, comm: the stage and ``data_parallel``'s communicator.
    """

    def __init__(self, params, optimizer_class, data_parallel: DataParallel, stage: int = 1, **defaults) -> None:
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(f"optimizer_class must be an Optimizer class (e.g. fw.optim.Adam), got {optimizer_class!r}")
        if not isinstance(data_parallel, DataParallel):
            raise TypeError(f"data_parallel must be a DataParallel, got {type(data_parallel).__name__}")
        if stage not in (1, 2):
            raise ValueError(f"ZeRO stage must be 1 (optimizer state sharded) or 2 (gradients too), got {stage!r}")
        self.optim = optimizer_class(params, **defaults)
        self.dp, self.comm, self.stage = data_parallel, data_parallel.comm, stage
        self._consolidated = None
        self.plans: dict = {}
        self._runs: dict = {}
        self._flat: dict = {}  # dtype -> (the flat parameter array, each parameter's view of it)
        if self.comm.size == 1:
            return
        order = data_parallel.flat_order()
        trainable = [p for p in self._params() if p.requires_grad]
        reduced = [p for ps in order.values() for p in ps]
        if {id(p) for p in trainable} != {id(p) for p in reduced}:
            raise ValueError(
                f"ZeroRedundancyOptimizer must optimize the parameters data_parallel reduces (those that require "
                f"grad): got {len(trainable)} trainable parameters, data_parallel reduces {len(reduced)}"
            )
        group_of = {id(p): gi for gi, g in enumerate(self.optim.param_groups) for p in g["params"]}
        self.plans = {dt: ShardPlan(dt, ps, self.comm.size, self.comm.rank) for dt, ps in order.items()}
        self._runs = {dt: _runs(plan, group_of) for dt, plan in self.plans.items()}
        if stage == 2:
            data_parallel._shard_gradients(self.plans)

    # --- torch.optim's interface ------------------------------------------------------------
    @property
    def param_groups(self) -> list:
        return self.optim.param_groups

    @property
    def defaults(self) -> dict:
        return self.optim.defaults

    def _params(self) -> list:
        return [p for g in self.optim.param_groups for p in g["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Resets the gradients (stage 2: this rank's shards) to None or zeros."""
        self.optim.zero_grad(set_to_none)
        if self.stage == 2:
            self.dp.zero_grad_shards(set_to_none)

    def step(self, closure=None):
        """Updates this rank's shard of the parameters, then all-gathers them (every rank).

        Nothing is updated when there are no gradients (stage 1: no ``.grad``; stage 2: no
        shard since ``zero_grad``), as an optimizer skips parameters without one.

        Returns:
            the closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with enable_grad():
                loss = closure()
        if self.comm.size == 1:
            self.optim.step()
            return loss
        u = _Updater(inplace.enabled())
        site = call_site()
        with no_grad(), memory.category("workspace"):
            for dtype, plan in self.plans.items():
                grad = self._grad_shard(dtype, plan)
                if grad is None:
                    continue
                param = self._flat_params(dtype, plan)
                xp = backend.get_array_module(param)
                send = None if u.inplace else memory.empty((plan.part,), dtype, xp, "parameters")
                for run in self._runs[dtype]:
                    group = self.optim.param_groups[run.group]
                    n = run.hi - run.lo
                    step = n if not u.inplace or xp is not np else run.chunk
                    chunks = [(lo, min(lo + step, n)) for lo in range(0, n, step)]
                    g = grad[run.lo - plan.lo : run.hi - plan.lo]
                    new_p, run.state = self.optim._update_over(param[run.lo : run.hi], g, run.state, group, u, chunks)
                    if send is not None:
                        xp.copyto(send[run.lo - plan.first : run.hi - plan.first], new_p)
                self._all_gather(dtype, plan, param, send, site)
        return loss

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scales the gradients so that their global L2 norm is at most ``max_norm`` (stage 2).

        Each rank sums the squares of its shard in float64; the sums are allreduced. The
        same norm as over the full gradients up to the order of those sums (float64: a
        relative difference of order 1e-16), and each shard is scaled by the op that scales
        a full gradient (``mul_``).

        Returns:
            the norm before clipping.
        """
        if self.stage != 2 or self.comm.size == 1:
            raise RuntimeError("ZeroRedundancyOptimizer.clip_grad_norm_ is for stage 2: clip full gradients as usual")
        shards = []
        for dtype, plan in self.plans.items():
            shard = self.dp.grad_shard(dtype)
            if shard is not None:
                shards.append(shard[: plan.hi - plan.lo])
        local = 0.0
        if shards:  # summed on the device, read back once
            xp = backend.get_array_module(shards[0])
            local = float(backend.to_numpy(xp.stack([(s.astype(np.float64) ** 2).sum() for s in shards])).sum())
        total = math.sqrt(self.comm.allreduce_scalar(local, "sum"))
        if total > max_norm:
            scale = max_norm / (total + 1e-6)
            with no_grad():
                for s in shards:
                    _wrap(s).mul_(scale)
        return total

    def state_bytes(self) -> int:
        """Bytes of the optimizer state this rank holds: its shard's (the wrapped optimizer's
        on one process)."""
        if self.comm.size == 1:
            return self.optim.state_bytes()
        runs = chain.from_iterable(self._runs.values())
        return sum(v.nbytes for run in runs for v in run.state.values() if hasattr(v, "nbytes") and v.ndim)

    def gradient_bytes(self) -> int:
        """Bytes of the gradients this rank holds between steps: every parameter's (stage
        1), or its shard of them (stage 2, padding included)."""
        if self.stage == 1 or self.comm.size == 1:
            return sum(p.nbytes for p in self._params() if p.requires_grad)
        return sum(plan.part * plan.dtype.itemsize for plan in self.plans.values())

    # --- the shards --------------------------------------------------------------------------
    def _grad_shard(self, dtype, plan: ShardPlan):
        """This rank's averaged gradients, ``hi - lo`` elements from ``lo`` (or more), or None
        when there are none this step."""
        if self.stage == 2:
            return self.dp.grad_shard(dtype)
        grads = [p.grad for p in plan.params]
        if all(g is None for g in grads):
            return None
        if any(g is None for g in grads):
            raise RuntimeError(
                "ZeroRedundancyOptimizer.step: some parameters have a gradient and others none; "
                "call data_parallel.finish() after backward (it gives every parameter one)"
            )
        flat = self.dp.flat_grad(dtype)
        if flat is not None:  # DataParallel's flat buffer, read where it is
            return flat[plan.lo : plan.hi]
        out = memory.empty((plan.hi - plan.lo,), dtype, backend.get_array_module(grads[0]._data), "workspace")
        for p, a, b, at in plan.pieces(plan.lo, plan.hi):
            out[at : at + b - a] = p.grad._data.reshape(-1)[a:b]
        return out

    def _flat_params(self, dtype, plan: ShardPlan):
        """The flat parameter array of ``dtype``; laid out (again) when a parameter no longer
        lives in it (its first step, a ``p.data = ...`` or a loaded state dict)."""
        flat, views = self._flat.get(dtype, (None, ()))
        if flat is not None and all(p._data is v for p, v in zip(plan.params, views)):
            return flat
        xp = backend.get_array_module(plan.params[0]._data)
        flat = memory.zeros((plan.padded,), dtype, xp, "parameters")
        for p, off in zip(plan.params, plan.offsets):
            flat[off : off + p.numel()] = p._data.reshape(-1)
        self._set_params(dtype, plan, flat)
        return flat

    def _set_params(self, dtype, plan: ShardPlan, flat) -> None:
        views = [flat[off : off + p.numel()].reshape(p._data.shape) for p, off in zip(plan.params, plan.offsets)]
        for p, v in zip(plan.params, views):
            p._data = v
        self._flat[dtype] = (flat, views)

    def _all_gather(self, dtype, plan: ShardPlan, flat, send, site) -> None:
        """Every rank's updated part to every rank: in place over ``flat``, or (policy off,
        ``send`` this rank's part) into a new flat array the parameters move to."""
        who = type(self).__name__
        if send is None:
            self.comm.allgather_(flat)
            for p in plan.params:
                p._vc.bump(f"allgather_ ({who}.step over the flat parameter buffer)", site)
            return
        send[plan.hi - plan.lo :] = 0  # the padding
        new = memory.empty((plan.padded,), dtype, backend.get_array_module(flat), "parameters")
        self.comm.allgather_copy(send, new)
        self._set_params(dtype, plan, new)
        for p in plan.params:
            p._vc.bump(f"{who}.step (inplace policy off: new storage)", site)

    # --- state dict --------------------------------------------------------------------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gathers every rank's shard of the optimizer state on rank ``to`` (every rank calls it).

        Rank ``to`` then gets it from :meth:`state_dict` in the wrapped optimizer's format
        (each parameter's full state, by its position over all groups): a checkpoint that
        resumes under another stage, or without ZeRO.
        """
        index = {id(p): i for i, p in enumerate(self._params())}
        pieces = []
        for run in chain.from_iterable(self._runs.values()):
            order = list(run.state)
            arrays = {k: backend.to_numpy(v) for k, v in run.state.items() if backend.is_array(v)}
            values = {k: v for k, v in run.state.items() if not backend.is_array(v)}
            for p, a, b, at in run.pieces:
                cut = {k: arr[at : at + b - a] for k, arr in arrays.items()}
                pieces.append((index[id(p)], a, b, order, cut, values))
        gathered = self.comm.gather_object(pieces, root=to)
        if gathered is None:
            return
        params = self._params()
        state: dict = {}
        for i, a, b, order, cut, values in chain.from_iterable(gathered):
            st = state.setdefault(i, {})
            for k in order:
                if k in cut:
                    if k not in st:
                        st[k] = np.empty(params[i].numel(), cut[k].dtype)
                    st[k][a:b] = cut[k]
                else:
                    st[k] = values[k]
        for i, st in state.items():
            for k, v in st.items():
                if isinstance(v, np.ndarray):
                    st[k] = v.reshape(params[i].shape)
        groups = self.optim.state_dict()["param_groups"]
        self._consolidated = {"state": dict(sorted(state.items())), "param_groups": groups}

    def state_dict(self) -> dict:
        """The state :meth:`consolidate_state_dict` gathered on this rank (host NumPy arrays),
        handed over: it is not kept. With one process, the wrapped optimizer's.

        Raises:
            RuntimeError: the state was not consolidated on this rank.
        """
        if self.comm.size == 1:
            return self.optim.state_dict()
        if self._consolidated is None:
            raise RuntimeError(
                f"Optimizer state has not been consolidated on this rank. Please call "
                f"`consolidate_state_dict(to={self.comm.rank})` on all ranks beforehand if you meant to save the "
                "global state."
            )
        out, self._consolidated = self._consolidated, None
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Takes this rank's shard of a state dict in the wrapped optimizer's format (from
        :meth:`state_dict`, of any stage and number of ranks, or from the optimizer itself),
        and the hyperparameters.

        Raises:
            ValueError: the groups do not match, or the parameters of one run disagree on
                their state (keys, or a value such as Adam's step).
        """
        if self.comm.size == 1:
            return self.optim.load_state_dict(state_dict)
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("optimizer state_dict must be a dict with keys 'state' and 'param_groups'")
        self.optim.load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        saved = {int(i): s for i, s in state_dict["state"].items()}
        index = {id(p): i for i, p in enumerate(self._params())}
        with no_grad():
            for dtype, runs in self._runs.items():
                for run in runs:
                    run.state = self._load_run(run, [saved.get(index[id(p)]) or {} for p, *_ in run.pieces], dtype)

    @staticmethod
    def _load_run(run: _Run, states: list, dtype) -> dict:
        first = states[0]
        if any(list(s) != list(first) for s in states):
            raise ValueError(
                "loaded optimizer state: parameters updated together have different state keys "
                f"({sorted({tuple(s) for s in states})})"
            )
        out = {}
        for k, v in first.items():
            if not isinstance(v, Tensor) and not backend.is_array(v):
                if any(s[k] != v for s in states):
                    raise ValueError(f"loaded optimizer state: parameters updated together have different {k!r}")
                out[k] = copy.deepcopy(v)
                continue
            dst = None
            for (p, a, b, at), s in zip(run.pieces, states):
                src = s[k]._data if isinstance(s[k], Tensor) else s[k]
                src = backend.to_device(src, p.device).reshape(-1)[a:b]
                if src.dtype.kind == "f" and k != "step":
                    src = src.astype(dtype, copy=False)
                if dst is None:
                    xp = backend.get_array_module(src)
                    dst = memory.empty((run.hi - run.lo,), src.dtype, xp, "optimizer_state")
                dst[at : at + b - a] = src
            out[k] = dst
        return out

    def __repr__(self) -> str:
        parts = ", ".join(f"{dt}: {plan.hi - plan.lo} of {plan.numel}" for dt, plan in self.plans.items())
        return f"ZeroRedundancyOptimizer(stage={self.stage}, {type(self.optim).__name__}, this rank's shard: {parts})"
