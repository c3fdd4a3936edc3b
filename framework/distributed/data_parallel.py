"""Data-parallel training: one model replica per rank, gradients averaged by bucketed allreduce.

Usage (every rank runs the same program)::

    dp = DataParallel(model)                 # broadcasts rank 0's parameters and buffers
    opt = SGD(dp.parameters(), lr=0.1)
    for x, y in shard:                        # each rank its own part of the global batch
        opt.zero_grad()
        loss = loss_fn(dp(x), y)
        loss.backward()                       # buckets are allreduced while backward runs
        dp.finish()                           # wait for them and average; then step
        opt.step()

How it works (as PyTorch DDP):

- Parameters that require grad are grouped, in REVERSE registration order (the order
  backward produces their gradients), per dtype, into buckets of at most ``bucket_mb``
  MiB (a larger parameter gets a bucket of its own).
- A post-accumulate-grad hook on every parameter marks it ready; when every parameter of a
  bucket is ready the bucket's non-blocking allreduce starts, so communication overlaps
  the rest of backward. MPI libraries without an asynchronous progress thread (MPICH's
  default) move a non-blocking collective forward only inside MPI calls, so every later
  hook also tests the launched buckets (``poll_in_hooks``, on by default): without those
  polls all the work would wait for :meth:`finish`. Buckets are launched strictly in bucket index order (a ready bucket
  waits for every lower-index one), so all ranks issue the collectives in the same order.
- :meth:`DataParallel.finish` launches the buckets not launched yet (a parameter that got
  no gradient this step contributes its current ``.grad``, or zeros when it has none, so
  ranks never deadlock and it still receives the other ranks' average), waits for every
  handle and divides by the world size. It is idempotent.

The inplace policy (``framework.inplace.enabled()``, read once at construction):

- ``on``: each bucket is one flat buffer (``framework.memory``, category ``gradients``; the
  buckets of one dtype are consecutive slices of one array) and before every forward each
  ``p.grad`` is set to a view of its slice of it (a slice is
  zero-filled when ``p.grad`` was ``None``). Backward then accumulates straight into the
  bucket (the engine adds into an existing ``.grad`` in place) and the allreduce runs
  ``MPI.IN_PLACE`` on it: no gradient copy at all, and ``p.grad`` stays the same view
  from step to step.
- ``off``: gradients stay separate arrays; a complete bucket is packed into a send buffer,
  reduced with ``iallreduce_copy`` into a receive buffer, and after the wait unpacked into
  NEW gradient arrays (``p.grad = new tensor``); the two buffers are then freed.

Both policies give the same numbers. Gradients are never zeroed behind the user's back:
as in PyTorch, ``optimizer.zero_grad()`` resets them and, without it, gradients keep
accumulating.

:meth:`DataParallel.no_sync` skips the allreduce for the backward of forwards run inside
it (gradient accumulation); the first synced backward after it reduces the accumulated sum.

ZeRO stage 2 (:class:`~framework.distributed.zero.ZeroRedundancyOptimizer` calls
:meth:`DataParallel._shard_gradients`): under every policy each gradient moves into its
bucket's send buffer as it arrives and ``.grad`` is let go; a complete bucket is
reduce-scattered straight into this rank's shard of the averaged gradients
(:meth:`grad_shard`), which is all a rank keeps.

Buffers (BatchNorm running statistics) are broadcast from rank 0 at every forward, as
PyTorch DDP does by default (``broadcast_buffers=True``), so every rank evaluates and
checkpoints the same statistics.

On a GPU the buckets live on the parameters' device (every parameter must be on one).
With a :class:`~framework.distributed.comm.NcclCommunicator` each bucket is reduced by
NCCL on a side CUDA stream that starts after the gradients enqueued so far, so the
overlap with backward happens on the GPU; with the MPI communicator a GPU bucket is
staged through host memory (a copy each way: the fallback when NCCL is missing).

With one process (``comm.size == 1``) the wrapper is a passthrough: no buckets, no hooks,
the same API.
"""

from __future__ import annotations

import contextlib
import weakref

import numpy as np

from .. import backend, inplace, memory
from ..autograd.grad_mode import state as _grad_state
from ..callsite import call_site
from ..nn.module import Module
from ..tensor import Tensor, _wrap
from .comm import Communicator, get_world

__all__ = ["DataParallel"]

_MIB = 1024 * 1024


class _Bucket:
    """Parameters whose gradients are reduced by one collective."""

    __slots__ = (
        "index",
        "dtype",
        "params",
        "offsets",
        "numel",
        "buffer",
        "views",
        "ready",
        "launched",
        "handle",
        "recv",
        "counts",
        "pad",
        "span",
    )

    def __init__(self, index: int, dtype) -> None:
        self.index = index
        self.dtype = np.dtype(dtype)
        self.params: list[Tensor] = []
        self.offsets: list[int] = []
        self.numel = 0
        self.buffer = None  # policy on: the flat gradient buffer (xp array)
        self.views: list[Tensor] = []  # policy on: p.grad of each parameter
        self.ready: set[int] = set()  # ids of the parameters ready this step
        self.launched = False
        self.handle = None
        self.recv = None  # policy off: the receive buffer in flight
        # gradients sharded (ZeRO stage 2): each rank's count of the reduce-scatter, the
        # zeros after the dtype's last bucket up to the shards' padded length, and the
        # (start, stop) slice of this rank's shard the bucket's reduction writes
        self.counts: list[int] = []
        self.pad = 0
        self.span = (0, 0)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def add(self, p: Tensor) -> None:
        self.params.append(p)
        self.offsets.append(self.numel)
        self.numel += p.numel()

    def slice(self, i: int, flat):
        p = self.params[i]
        off = self.offsets[i]
        return flat[off : off + p.numel()].reshape(p.shape)


def _grad_enabled() -> bool:
    return bool(_grad_state.enabled)


class DataParallel(Module):
    """Wraps ``module`` so that every rank trains the same model on its own data.

    Args:
        module: the model (every rank builds it the same way; rank 0's values win).
        comm: the communicator; defaults to :func:`framework.distributed.comm.get_world`.
        bucket_mb: the largest bucket in MiB (a larger parameter gets its own bucket).
        broadcast_buffers: broadcast buffers from rank 0 at every forward (the default,
            as PyTorch DDP).

    Attributes:
        module: the wrapped model.
        comm: the communicator.
        inplace: the policy read at construction (True: gradients are bucket views).
        buckets: the gradient buckets, in launch order (empty with one process).
    """

    def __init__(
        self, module: Module, comm: Communicator | None = None, bucket_mb: float = 25.0, broadcast_buffers: bool = True
    ) -> None:
        super().__init__()
        if not isinstance(module, Module):
            raise TypeError(f"DataParallel wraps an nn.Module, got {type(module).__name__}")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb!r}")
        self.module = module
        object.__setattr__(self, "comm", get_world() if comm is None else comm)
        object.__setattr__(self, "inplace", inplace.enabled())
        object.__setattr__(self, "bucket_mb", float(bucket_mb))
        object.__setattr__(self, "broadcast_buffers", bool(broadcast_buffers))
        object.__setattr__(self, "buckets", [])
        object.__setattr__(self, "_require_sync", True)  # False inside no_sync()
        object.__setattr__(self, "_sync_backward", True)  # captured at each forward
        object.__setattr__(self, "_expect_sync", False)  # a synced forward ran since finish()
        object.__setattr__(self, "_hooks_fired", False)  # a synced backward ran since finish()
        object.__setattr__(self, "poll_in_hooks", True)  # progress launched buckets from hooks
        object.__setattr__(self, "_next_launch", 0)
        object.__setattr__(self, "_where", {})  # id(param) -> (bucket, index)
        object.__setattr__(self, "_hook_handles", [])
        object.__setattr__(self, "xp", np)  # the array module of the gradients
        object.__setattr__(self, "_plans", None)  # ZeRO stage 2: dtype -> shard plan (see _shard_gradients)
        object.__setattr__(self, "_shards", {})  # ZeRO stage 2: dtype -> this rank's gradient shard, or None
        object.__setattr__(self, "_fresh", {})  # ZeRO stage 2: dtype -> the shard is new this step
        object.__setattr__(self, "_pending", {})  # ZeRO stage 2: dtype -> [(lo, hi, this step's sum)] to add
        if self.comm.size == 1:
            return
        for p in module.parameters():
            self._broadcast_array(p)
        self._broadcast_module_buffers()
        self._build_buckets()

    # -- construction ---------------------------------------------------------------------

    def _broadcast_array(self, t: Tensor) -> None:
        data = t._data
        if data.flags.c_contiguous and getattr(data.flags, "writeable", True):  # CuPy has no flag
            self.comm.broadcast_(data, root=0)
        else:  # a strided (or read-only host) array: through a contiguous copy
            tmp = backend.get_array_module(data).ascontiguousarray(data)
            self.comm.broadcast_(tmp, root=0)
            data[...] = tmp
        t._vc.bump("broadcast_ (DataParallel)", call_site())  # rank 0's values replaced ours in place

    def _broadcast_module_buffers(self) -> None:
        for b in self.module.buffers():
            self._broadcast_array(b)

    def _build_buckets(self) -> None:
        cap = self.bucket_mb * _MIB
        params = [p for p in self.module.parameters() if p.requires_grad]
        devices = {backend.device_of(p._data) for p in params}
        if len(devices) > 1:
            raise ValueError(
                "DataParallel needs every parameter on one device, found "
                f"{', '.join(sorted(map(str, devices)))}; call model.to(device) first"
            )
        if params:
            object.__setattr__(self, "xp", backend.get_array_module(params[0]._data))
        open_by_dtype: dict = {}
        for p in reversed(params):
            dt = np.dtype(p.dtype)
            b = open_by_dtype.get(dt)
            if b is not None and b.params and b.nbytes + p.numel() * dt.itemsize > cap:
                b = None
            if b is None:
                b = _Bucket(len(self.buckets), dt)
                self.buckets.append(b)
                open_by_dtype[dt] = b
            self._where[id(p)] = (b, len(b.params))
            b.add(p)
        if self.inplace:
            # One buffer per dtype, the buckets consecutive slices of it: every gradient of
            # a dtype is a view of one flat array, in bucket order, which an optimizer over
            # flat buffers reads as it is (framework.optim.flat) instead of gathering it.
            sizes: dict = {}
            for b in self.buckets:
                sizes[b.dtype] = sizes.get(b.dtype, 0) + b.numel
            flats = {dt: memory.zeros((n,), dt, self.xp, "gradients") for dt, n in sizes.items()}
            starts = dict.fromkeys(sizes, 0)
            for b in self.buckets:
                b.buffer = flats[b.dtype][starts[b.dtype] : starts[b.dtype] + b.numel]
                starts[b.dtype] += b.numel
                b.views = [_wrap(b.slice(i, b.buffer)) for i in range(len(b.params))]
        for b in self.buckets:
            ref = weakref.ref(self)
            for p in b.params:
                self._hook_handles.append(p.register_post_accumulate_grad_hook(_make_hook(ref)))

    # -- forward ---------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        if self.comm.size == 1:
            return self.module(*args, **kwargs)
        if self._hooks_fired and _grad_enabled():
            raise RuntimeError(
                "DataParallel: the previous synced backward was not finished; call "
                "dp.finish() after loss.backward() and before optimizer.step()"
            )
        if self.broadcast_buffers:
            self._broadcast_module_buffers()
        if _grad_enabled() and self.buckets:
            object.__setattr__(self, "_sync_backward", self._require_sync)
            if self._require_sync:
                object.__setattr__(self, "_expect_sync", True)
            if self.inplace and self._plans is None:
                self._bind_grad_views()
        return self.module(*args, **kwargs)

    def _bind_grad_views(self) -> None:
        """Points every ``p.grad`` at its bucket slice, keeping what it already holds."""
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._adopt(b, i, p)

    @staticmethod
    def _adopt(b: _Bucket, i: int, p: Tensor) -> None:
        view = b.views[i]
        g = p.grad
        if g is view:
            return
        if g is None:
            view._data[...] = 0
        else:  # a gradient made elsewhere (set by the user, or made after zero_grad)
            view._data[...] = g._data
        view._vc.bump("copy_ (gradient into its DataParallel bucket)", call_site())
        p.grad = view

    # -- backward hooks ---------------------------------------------------------------------

    def _on_grad_ready(self, p: Tensor) -> None:
        if not self._sync_backward:
            return  # inside no_sync(): accumulate locally
        b, i = self._where[id(p)]
        if b.launched:
            raise RuntimeError(
                "DataParallel: a parameter received a gradient after its bucket's allreduce "
                "started (two synced backwards in one step?); run the earlier ones inside "
                "dp.no_sync(), and call dp.finish() after the last"
            )
        object.__setattr__(self, "_hooks_fired", True)
        if self.poll_in_hooks and self._next_launch:
            for launched in self.buckets[: self._next_launch]:
                launched.handle.test()  # progress only: completion is taken in finish()
        if self._plans is not None:
            self._pack(b, i, p)
        elif self.inplace:
            self._adopt(b, i, p)
        b.ready.add(id(p))
        if len(b.ready) == len(b.params):
            self._launch_ready()

    def _launch_ready(self) -> None:
        buckets = self.buckets
        while self._next_launch < len(buckets):
            b = buckets[self._next_launch]
            if len(b.ready) < len(b.params):
                return
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        if self._plans is not None:
            b.handle = self._reduce_scatter(b)
        elif self.inplace:
            for i, p in enumerate(b.params):
                self._adopt(b, i, p)  # zeros for a parameter with no gradient
            b.handle = self.comm.iallreduce_(b.buffer)
        else:
            send = memory.empty((b.numel,), b.dtype, self.xp, "gradients")
            for i, p in enumerate(b.params):
                dst = b.slice(i, send)
                if p.grad is None:
                    dst[...] = 0
                else:
                    dst[...] = p.grad._data
            b.recv = memory.empty((b.numel,), b.dtype, self.xp, "gradients")
            b.handle = self.comm.iallreduce_copy(send, b.recv)
        b.launched = True
        object.__setattr__(self, "_next_launch", b.index + 1)

    # -- public API --------------------------------------------------------------------------

    def finish(self) -> None:
        """Completes the gradient sync of this step: call it before ``optimizer.step()``.

        Launches the buckets not launched yet (parameters without a gradient this step
        contribute their current ``.grad`` or zeros), waits for every allreduce and divides
        by the world size (gradients sharded: every reduce-scatter, and this rank's shard).
        Calling it again, or after a ``no_sync`` backward, does nothing. Every rank must
        call it the same number of times.
        """
        if self.comm.size == 1 or not (self._expect_sync or self._hooks_fired):
            return
        for b in self.buckets[self._next_launch :]:
            self._launch(b)
        n = self.comm.size
        site = call_site()
        for b in self.buckets:
            out = b.handle.wait()
            if self._plans is not None:
                pass  # the shard is averaged below, once per dtype
            elif self.inplace:
                self.xp.divide(out, n, out=out)
                for view in b.views:  # every gradient of the bucket changed in place
                    view._vc.bump("allreduce_ (DataParallel.finish)", site)
            else:
                for i, p in enumerate(b.params):
                    g = memory.empty(p.shape, b.dtype, self.xp, "gradients")
                    self.xp.divide(b.slice(i, out), n, out=g)
                    p.grad = _wrap(g)
                b.recv = None
            b.handle = None
            b.launched = False
            b.ready.clear()
        if self._plans is not None:
            self._average_shards()
        object.__setattr__(self, "_next_launch", 0)
        object.__setattr__(self, "_expect_sync", False)
        object.__setattr__(self, "_hooks_fired", False)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward of the forwards run inside accumulates locally, without allreduce.

        The first synced backward after it reduces the accumulated gradients::

            with dp.no_sync():
                loss_fn(dp(x1), y1).backward()
            loss_fn(dp(x2), y2).backward()
            dp.finish()
        """
        prev = self._require_sync
        object.__setattr__(self, "_require_sync", False)
        try:
            yield
        finally:
            object.__setattr__(self, "_require_sync", prev)

    # -- sharded gradients (ZeRO stage 2) ---------------------------------------------------

    def flat_order(self) -> dict:
        """Each dtype's parameters in the order of its gradients' flat buffer (the dtype's
        buckets one after the other, each in its parameters' order): the layout that
        :class:`~framework.distributed.zero.ZeroRedundancyOptimizer` shards. Empty with
        one process."""
        order: dict = {}
        for b in self.buckets:
            order.setdefault(b.dtype, []).extend(b.params)
        return order

    def flat_grad(self, dtype):
        """The flat gradient array of ``dtype`` (policies ``auto`` and ``on``) while every
        ``.grad`` of the dtype is still its bucket view, in :meth:`flat_order`; else None."""
        flat = None
        for b in self.buckets:
            if b.dtype != dtype or b.buffer is None:
                continue
            if any(p.grad is not view for p, view in zip(b.params, b.views)):
                return None
            flat = memory.root_buffer(b.buffer)
        return flat

    def _shard_gradients(self, plans: dict) -> None:
        """Keeps only this rank's shard of each dtype's averaged gradients (ZeRO stage 2).

        Called by :class:`~framework.distributed.zero.ZeroRedundancyOptimizer`, which
        decides the shards: ``plans`` maps each dtype to a plan over :meth:`flat_order`
        (``first``, ``part``, ``padded`` and ``counts(start, stop)``). From then on, under
        every policy, a bucket is packed at its launch into a buffer of its own, its
        parameters' ``.grad`` are let go, and the buffer is reduce-scattered straight into
        this rank's shard (:meth:`grad_shard`); the buffer goes once its reduction is
        complete, so no rank holds more than its shard of the gradients between steps.
        The full gradient buffers of the policies ``auto`` and ``on`` are freed.
        """
        if self._plans is not None:
            raise RuntimeError("DataParallel: the gradients are sharded already")
        starts = dict.fromkeys(plans, 0)
        last = {b.dtype: b for b in self.buckets}
        for b in self.buckets:
            plan = plans[b.dtype]
            start = starts[b.dtype]
            stop = start + b.numel
            starts[b.dtype] = stop
            b.pad = plan.padded - stop if b is last[b.dtype] else 0
            b.counts = plan.counts(start, stop + b.pad)
            lo = min(max(start - plan.first, 0), plan.part)
            b.span = (lo, max(min(stop + b.pad - plan.first, plan.part), lo))
            for p, view in zip(b.params, b.views):
                if p.grad is view:
                    p.grad = None
            b.buffer, b.views = None, []
        object.__setattr__(self, "_plans", dict(plans))
        object.__setattr__(self, "_shards", dict.fromkeys(plans))

    def _pack(self, b: _Bucket, i: int, p: Tensor) -> None:
        """Moves ``p``'s gradient (zeros when it has none) into bucket ``b``'s send buffer and
        lets ``.grad`` go: a rank keeps its shard of the average, nothing else. The buffer
        is made at the bucket's first gradient; a bucket of one parameter (without padding)
        sends that parameter's gradient itself, with no copy."""
        g = p.grad
        p.grad = None
        if b.buffer is None:
            if len(b.params) == 1 and not b.pad and g is not None and g._data.flags.c_contiguous:
                b.buffer = g._data.reshape(-1)
                return
            b.buffer = memory.empty((b.numel + b.pad,), b.dtype, self.xp, "gradients")
            b.buffer[b.numel :] = 0
        dst = b.slice(i, b.buffer)
        if id(p) in b.ready:  # a second synced backward before finish(): its gradient adds up, as in .grad
            if g is not None:
                dst += g._data
        elif g is None:
            dst[...] = 0
        else:
            dst[...] = g._data

    def _reduce_scatter(self, b: _Bucket):
        """Starts bucket ``b``'s reduce-scatter (packing the gradients not packed yet)."""
        for i, p in enumerate(b.params):
            if id(p) not in b.ready:  # finish(): no gradient this step, or not yet moved in
                self._pack(b, i, p)
        send, b.buffer = b.buffer, None
        shard = self._step_shard(b.dtype)
        lo, hi = b.span
        if self._fresh[b.dtype]:
            recv = shard[lo:hi]
        else:  # the shard holds gradients not zeroed since: this step's sum is added at finish
            recv = memory.empty((hi - lo,), b.dtype, self.xp, "gradients")
            self._pending[b.dtype].append((lo, hi, recv))
        return self.comm.ireduce_scatter(send, recv, b.counts)  # the handle lets send go when done

    def _step_shard(self, dtype):
        """This step's shard of ``dtype``: a new one after ``zero_grad(set_to_none=True)``,
        which the reduce-scatters write straight into, else the one kept."""
        if dtype not in self._fresh:
            shard = self._shards[dtype]
            self._fresh[dtype] = shard is None
            self._pending[dtype] = []
            if shard is None:
                self._shards[dtype] = memory.empty((self._plans[dtype].part,), dtype, self.xp, "gradients")
        return self._shards[dtype]

    def _average_shards(self) -> None:
        n = self.comm.size
        for dtype, fresh in self._fresh.items():
            shard = self._shards[dtype]
            if fresh:
                self.xp.divide(shard, n, out=shard)
            for lo, hi, part in self._pending[dtype]:
                self.xp.divide(part, n, out=part)
                self.xp.add(shard[lo:hi], part, out=shard[lo:hi])
        self._fresh.clear()
        self._pending.clear()

    def grad_shard(self, dtype):
        """This rank's shard of the averaged gradients of ``dtype`` (ZeRO stage 2): the
        ``part`` elements of the dtype's flat order from ``first`` on (see
        :meth:`_shard_gradients`; the last rank's ends in zeros of padding), or None
        before the first sync and after ``zero_grad(set_to_none=True)``."""
        return self._shards.get(np.dtype(dtype))

    def zero_grad_shards(self, set_to_none: bool = True) -> None:
        """Lets the gradient shards go (``set_to_none``) or zeroes them (ZeRO stage 2)."""
        for dtype, shard in self._shards.items():
            if set_to_none:
                self._shards[dtype] = None
            elif shard is not None:
                shard.fill(0)

    def bucket_of(self, p: Tensor) -> _Bucket | None:
        """The bucket holding ``p``'s gradient (None with one process or when frozen)."""
        where = self._where.get(id(p))
        return None if where is None else where[0]

    def extra_repr(self) -> str:
        return (
            f"size={self.comm.size}, buckets={len(self.buckets)}, bucket_mb={self.bucket_mb}, "
            f"grads_as_bucket_views={self.inplace and bool(self.buckets) and self._plans is None}"
            + (", gradients sharded" if self._plans is not None else "")
        )


def _make_hook(ref):
    def hook(p):
        dp = ref()
        if dp is not None:
            dp._on_grad_ready(p)

    return hook
