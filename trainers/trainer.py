"""The training loop: data, model, optimizer, schedule, evaluation, checkpoints and logs.

One :class:`Trainer` runs one config. The inplace policy of the config is set for the
whole process before the model is built, so every inplace site (activations, residual
adds, InPlace-ABN, optimizer updates, gradient accumulation) follows it. Every
``log_every`` steps the trainer logs loss, accuracy, throughput and memory: the peak
since the last log, the live bytes, and the floor of a step (parameters + gradients +
optimizer state + the bytes autograd holds at the forward/backward boundary).

On a GPU (``device: cuda`` or ``cuda:N``) the trainer makes the process's GPU CuPy's
current device before anything is allocated (under MPI, ``cuda`` gives each rank GPU
``local_rank % device count``), registers the pool hook of :mod:`framework.memory`, so
every ``memory/*`` tag is GPU memory, copies each batch to the device once, and reads
values back to the host only where it must: the loss once per step (a non-finite loss
must stop training before the update), everything else at log points.

SIGINT, SIGTERM and SIGUSR1 stop :meth:`Trainer.fit` after the step in flight, every rank
after the same one (:mod:`trainers.interrupt`), with a checkpoint of that step: it holds
each rank's random state and its share of the open logging window, so a resumed run logs
the points of a run that never stopped.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np

import framework as fw
from framework import backend, memory
from framework.compile.collectives import allreduce_mean_
from framework.distributed.comm import for_device, get_world
from framework.distributed.data_parallel import DataParallel
from framework.distributed.sampler import DistributedSampler
from framework.distributed.sync_batchnorm import SyncBatchNorm
from framework.distributed.zero import ZeroRedundancyOptimizer, model_state_bytes
from framework.ops import conv as conv_ops
from framework.ops.loss import check_targets
from models import build_model, model_signature
from models.layers import set_recompute

from . import runs
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .config import Config, ConfigError, config_from_dict
from .data import DATASETS, DataError, DataLoader, load_dataset
from .interrupt import StopAgreement, StopSignals, signal_name
from .logging import MB, Progress, RunLogger, default_run_name, format_summary, run_dir


def out_of_memory_message(error: MemoryError, device, step: int, batch: int, peak: int, during: str = "") -> str:
    """One line for a step that ran out of memory: what it asked for, the peak, the batch
    (``during``: what ran instead of a training step, e.g. the model's check before step 1).

    ``error`` is CuPy's ``OutOfMemoryError`` (its ``_size``, ``_total`` and ``_limit``: the
    request, what the pool held, the pool's limit) or any other MemoryError (its message).
    """
    size = getattr(error, "_size", None)
    if size is not None:
        asked = f"asked for {size / MB:,.1f} MB with {getattr(error, '_total', 0) / MB:,.1f} MB allocated"
        limit = getattr(error, "_limit", 0)
        if limit:
            asked += f" (pool limit {limit / MB:,.1f} MB)"
    else:
        asked = str(error).strip().rstrip(".") or "an allocation failed"
    where = f"running {during}" if during else f"at step {step} (batch {batch})"
    return (
        f"out of memory on {device} {where}: {asked}; this run's peak so far "
        f"{peak / MB:,.1f} MB. Lower data.batch_size (or set inplace: on)"
    )


class TrainingError(Exception):
    """A run that cannot go on: its loss stopped being finite (exit status 3)."""


class Interrupted(Exception):
    """A run stopped by a signal at a step boundary, after writing its checkpoint.

    Attributes:
        signum: The signal (agreed by every rank: the largest any of them received).
        step, total_steps: The last step done, and the run's length.
        checkpoint: The checkpoint at ``step`` (rank 0's path; None on other ranks).
        run_name: The run's folder name (``inplace-on_np1_inplace_abn``).
    """

    def __init__(self, signum: int, step: int, total_steps: int, checkpoint: str | None, run_name: str):
        self.signum, self.step, self.total_steps = signum, step, total_steps
        self.checkpoint, self.run_name = checkpoint, run_name
        done = " (the run is complete)" if step >= total_steps else ""
        super().__init__(
            f"{signal_name(signum)}: run {run_name} stopped after step {step} of {total_steps}{done}; "
            f"checkpoint: {checkpoint}"
        )

    @property
    def exit_code(self) -> int:
        """128 + the signal, as a shell reports a process the signal ended (130 for Ctrl-C)."""
        return 128 + self.signum


@dataclass
class RunResult:
    """What a finished run reports (also printed as the summary table)."""

    run_dir: str
    steps: int
    # train/loss's last point: the mean loss over the last log window (train.log_every
    # steps), as the progress display's last line shows it; ``losses[-1]`` is the last step's.
    final_loss: float
    eval_metric: float | None
    eval_name: str
    peak_mb: float
    floor_mb: float
    samples_per_sec: float
    step_ms: float
    policy: str  # the policy label: off, auto, on, with +abn where the model uses InPlace-ABN
    # The losses of the steps this fit() trained (a resumed run: from its checkpoint on).
    losses: list = field(default_factory=list)
    timeline: object = None
    # Writes policy auto ran in place per training step (the ops it proved dead and its writes
    # over gradients, optimizer state and linear's product), and the MB they did not allocate.
    auto_ops_per_step: float = 0.0
    auto_saved_mb_per_step: float = 0.0
    planned_peak_mb: float | None = None  # compile: true: the compiled step's planned peak
    inplace_chains: int | None = None  # compile: true: buffers the compiled step writes in place
    timeline_step: int | None = None  # the step ``timeline`` was recorded at
    timeline_floor_mb: float | None = None  # the floor at that step, drawn with the timeline


# --- building blocks from the config ------------------------------------------------------


def build_data(cfg: Config):
    """The config's (train, test) data sets; a data set that cannot be read is a ConfigError (one line)."""
    _, option_names = DATASETS[cfg.data.name]
    options = {k: getattr(cfg.data, k) for k in option_names}
    try:
        return load_dataset(cfg.data.name, seed=cfg.seed, augment=cfg.data.augment, **options)
    except DataError as e:
        raise ConfigError(str(e)) from None


def build_model_for(cfg: Config, train_set):
    """The config's model; sizes it can take from the data set are filled in.

    Raises:
        ConfigError: an unknown ``model.name``, or ``model.args`` the model refuses
            (the model's message names the argument).
    """

    args = dict(cfg.model.args)
    try:
        params = model_signature(cfg.model.name).parameters
    except ValueError as e:
        raise ConfigError(f"model.name: {e}") from None
    shape = train_set.input_shape
    derived = {
        "num_classes": train_set.num_classes if train_set.num_classes else train_set.target_shape[-1],
        "in_features": int(np.prod(shape)),
        "in_channels": shape[0] if len(shape) == 3 else None,
        "image_size": shape[-1] if len(shape) == 3 else None,
        # a language model's vocabulary and context: the text data set's
        "vocab_size": train_set.num_classes,
        "block_size": getattr(train_set, "block_size", None),
    }
    for key, value in derived.items():
        if key in params and key not in args and value is not None:
            args[key] = value
    try:
        return build_model(cfg.model.name, **args)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model.args of model {cfg.model.name!r}: {e}") from None


def uses_inplace_abn(model) -> bool:
    """Whether the model fuses BatchNorm and activation as InPlace-ABN anywhere."""
    return any(isinstance(m, fw.nn.InPlaceABN) for m in model.modules())


def policy_label(policy: str, inplace_abn: bool) -> str:
    """What a run's policy is called wherever it is shown: ``on``, or ``on+abn`` with InPlace-ABN
    (the names ``scripts/compare_inplace.py --policies`` takes)."""
    return f"{policy}+abn" if inplace_abn else policy


def compiled(cfg: Config) -> bool | None:
    """The config's ``compile`` switch; None where this version's config has no such key."""
    value = cfg["compile"] if "compile" in cfg else None
    return value if isinstance(value, bool) else None


def recompute_mode(cfg: Config) -> str:
    """The config's ``recompute`` (``"none"`` where this version's config has no such key)."""
    return cfg["recompute"] if "recompute" in cfg else "none"


#: The lower precision of each mixed-precision setting (``precision: fp32`` runs none).
AUTOCAST_DTYPES = {"bf16": fw.bfloat16, "fp16": fw.float16}


def precision(cfg: Config) -> str:
    """The config's ``precision`` (``fp32`` where this version's config has no such key)."""
    return cfg["precision"] if "precision" in cfg else "fp32"


def conv2d_mode(cfg: Config) -> str:
    """The config's conv2d choosing mode (``"auto"`` where the config has no such key)."""
    return cfg["conv2d"] if "conv2d" in cfg else conv_ops.AUTO


def conv_math(cfg: Config) -> str:
    """The config's conv2d math mode (``"fp32"`` where the config has no such key)."""
    return cfg["conv_math"] if "conv_math" in cfg else "fp32"


def apply_run_settings(cfg: Config) -> None:
    """Sets the process-wide settings a run's numbers depend on: the inplace policy,
    conv2d's choosing mode and its math mode (trainers of several configs can take turns
    in one process)."""
    fw.inplace.set_policy(cfg.inplace)
    conv_ops.set_contraction(conv2d_mode(cfg))
    conv_ops.set_math_mode(conv_math(cfg))


def per_token(out, y):
    """A sequence model's logits ``(B, T, C)`` and targets ``(B, T)`` as ``(B*T, C)`` and
    ``(B*T,)``, so that the loss and the accuracy count every token; others unchanged."""
    if out.ndim == 3 and y.ndim == 2:
        return out.reshape(-1, out.shape[-1]), y.reshape(-1)
    return out, y


def param_groups(cfg: Config, params) -> list:
    """The optimizer's parameter groups: one, or (``optim.decay: matrices``) nanoGPT's two:
    the parameters of 2 or more dims with ``optim.weight_decay``, the others with none."""
    if cfg.optim.decay != "matrices":
        return list(params)
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.optim.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def optimizer_spec(cfg: Config) -> tuple:
    """The config's optimizer class and its hyperparameters."""
    o = cfg.optim
    if o.name == "sgd":
        kwargs = dict(lr=o.lr, momentum=o.momentum, dampening=o.dampening, weight_decay=o.weight_decay)
        return fw.optim.SGD, dict(kwargs, nesterov=o.nesterov)
    cls = fw.optim.Adam if o.name == "adam" else fw.optim.AdamW
    return cls, dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)


def state_per_parameter(cfg: Config) -> int:
    """How many values of optimizer state the config's optimizer keeps per parameter."""
    if cfg.optim.name == "sgd":
        return 1 if cfg.optim.momentum else 0
    return 2  # Adam's and AdamW's two moments


def build_optimizer(cfg: Config, params, data_parallel: DataParallel | None = None):
    """The config's optimizer over ``params``; with ``distributed.zero`` (1 or 2) sharded across
    ``data_parallel``'s ranks (:class:`~framework.distributed.zero.ZeroRedundancyOptimizer`)."""
    cls, kwargs = optimizer_spec(cfg)
    groups = param_groups(cfg, params)
    if cfg.distributed.zero and data_parallel is not None:
        return ZeroRedundancyOptimizer(groups, cls, data_parallel=data_parallel, stage=cfg.distributed.zero, **kwargs)
    return cls(groups, **kwargs)


def learning_rate(cfg: Config, step: int, total_steps: int) -> float:
    """The schedule: linear warmup, then constant, step decay, decay at milestones or cosine to ``min_lr``."""
    base, s = cfg.optim.lr, cfg.schedule
    if step < s.warmup_steps:
        return base * (step + 1) / s.warmup_steps
    k = step - s.warmup_steps
    if s.name == "step":
        return base * s.gamma ** (k // s.step_size)
    if s.name == "multistep":  # milestones count from step 0, warmup included (PyTorch's MultiStepLR)
        return base * s.gamma ** bisect.bisect_right(s.milestones, step)
    if s.name == "cosine":
        span = max(1, total_steps - s.warmup_steps)
        return s.min_lr + (base - s.min_lr) * 0.5 * (1 + math.cos(math.pi * min(k, span) / span))
    return base


def clip_grad_norm_(params, max_norm: float) -> float:
    """Scales gradients in place so their global L2 norm is at most ``max_norm``.

    The squares are summed on the gradients' device and read back once (one device
    synchronization per call on a GPU, not one per parameter).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    squares = [(g._data.astype(np.float64) ** 2).sum() for g in grads]
    total = math.sqrt(float(to_host(grads[0].xp.stack(squares)).sum()))
    if total > max_norm:
        scale = max_norm / (total + 1e-6)
        with fw.no_grad():
            for g in grads:
                g.mul_(scale)
    return total


def _parse_device(spec) -> backend.Device:
    """``backend.parse_device`` with a bad spec as a ConfigError (one line)."""
    try:
        return backend.parse_device(spec)
    except ValueError as e:
        raise ConfigError(f"device: {e}") from None


def gpu_index(spec, local_rank: int, device_count: int) -> int:
    """The GPU a process uses for ``device: cuda`` or ``cuda:N``.

    ``cuda`` gives each process GPU ``local_rank % device_count``: under ``mpiexec -n 4``
    on a node with 4 GPUs, ranks 0..3 use GPUs 0..3; with 2 GPUs, two ranks share each.
    ``cuda:N`` is GPU N for every process (one process, or GPUs already split per rank
    with ``CUDA_VISIBLE_DEVICES``).

    Raises:
        ConfigError: no GPU, ``N`` out of range, or not a cuda device spec.
    """
    dev = _parse_device(spec)
    if dev.type != "cuda":
        raise ConfigError(f"device {spec!r} is not a GPU: use 'cuda' or 'cuda:N'")
    if device_count < 1:
        raise ConfigError(f"device: {spec} asks for a GPU, but CUDA reports none; set device: cpu")
    if dev.index is None:
        return local_rank % device_count
    if dev.index >= device_count:
        raise ConfigError(
            f"device: {spec}, but this machine has {device_count} GPU{'s' if device_count > 1 else ''} "
            f"(cuda:0 to cuda:{device_count - 1}); use device: cuda to give each process its local GPU"
        )
    return dev.index


def no_gpu_message(spec: str) -> str:
    """The one line a user sees when ``device: cuda`` cannot be had."""
    return f"device: {spec} needs CuPy and a CUDA GPU, but {backend.cuda_unavailable_reason()}; or set device: cpu"


def select_device(spec: str, local_rank: int = 0):
    """Parses ``spec`` and, for a GPU, makes it CuPy's current device and counts its memory.

    Call before anything is allocated on the GPU: CuPy allocates on the current device,
    and the pool hook (:func:`framework.memory.enable_gpu_hook`) counts from here on.

    Returns:
        ``Device("cpu")``, or ``Device("cuda", index)`` of the GPU chosen by :func:`gpu_index`.

    Raises:
        ConfigError: a GPU was asked for and none can be used (one line: what and how to fix).
    """
    dev = _parse_device(spec)
    if dev.type == "cpu":
        return dev
    if not backend.is_cuda_available():
        raise ConfigError(no_gpu_message(spec))
    dev = backend.Device("cuda", gpu_index(dev, local_rank, backend.device_count()))
    backend.use_device(dev)
    memory.enable_gpu_hook()
    return dev


def synchronize(device) -> None:
    """Waits for the device's queued work (a no-op on the CPU): call before reading a clock."""
    backend.synchronize(device)


def to_host(value) -> np.ndarray:
    """A NumPy array of a NumPy/CuPy array or scalar (a device value is copied: one sync)."""
    if isinstance(value, (np.ndarray, np.generic, int, float)):
        return np.asarray(value)
    return backend.to_numpy(value)


def host_state(obj):
    """``obj`` with every tensor and device array replaced by a host NumPy array (checkpoints)."""
    if isinstance(obj, fw.Tensor):
        return backend.to_numpy(obj._data)
    if isinstance(obj, dict):
        return type(obj)((k, host_state(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_state(v) for v in obj)
    if hasattr(obj, "shape") and hasattr(obj, "dtype") and not isinstance(obj, (np.ndarray, np.generic)):
        return backend.to_numpy(obj)
    return obj


def limit_threads(threads: int, comm) -> None:
    """Caps BLAS/OpenMP threads: ``threads``, or cores/processes when several ranks share a node.

    Oversubscribed BLAS threads are catastrophic for small matrices (measured here: a
    (32, 64) x (64, 256) product took 28 us on 1 thread and 500 us on 2 busy cores).
    """
    if threads == 0 and comm.local_size > 1:
        threads = max(1, (os.cpu_count() or 1) // comm.local_size)
    if threads > 0:
        from threadpoolctl import threadpool_limits  # noqa: PLC0415

        threadpool_limits(threads)


# --- the trainer ---------------------------------------------------------------------------------


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def _add_auto_stats(window: dict, before: dict, after: dict) -> None:
    """Adds one step's auto-inplace counters (``memory.stats()`` deltas) to ``window``."""
    for key, value in after.items():
        if key.startswith(("auto_inplace", "auto_owned")):
            delta = value - before.get(key, 0)
            if delta:
                window[key] = window.get(key, 0) + delta


# Where the layout below opens, with tensorboard's default port.
DASHBOARD_URL = "http://localhost:6006/#custom_scalars"


def dashboard_layout(eval_name: str) -> dict:
    """The CUSTOM SCALARS tab: memory and speed first, each chart overlaying the runs of
    the experiment (its inplace policies). The one-point ``summary/*`` tags (the HPARAMS
    tab's metrics) sort after the curves in the SCALARS tab."""
    return {
        "memory and speed (one line per run: the inplace policies overlaid)": {
            "peak MB of a training step (memory/peak_mb)": [r"^memory/peak_mb$"],
            "floor MB: parameters, gradients, optimizer state, saved for backward (memory/floor_mb)": [
                r"^memory/floor_mb$"
            ],
            "samples/s (perf/samples_per_sec)": [r"^perf/samples_per_sec$"],
            "policy auto: MB per step it did not allocate (inplace/auto_saved_mb_per_step)": [
                r"^inplace/auto_saved_mb_per_step$"
            ],
        },
        "training: loss and held-out metric": {
            "loss, mean over each log window (train/loss)": [r"^train/loss$"],
            f"held-out {eval_name} (eval/{eval_name})": [rf"^eval/{eval_name}$"],
        },
    }


def _auto_totals(counters: dict) -> tuple[int, int]:
    """Policy auto's writes in place and the bytes they did not allocate: the ops it proved
    dead plus its writes over the framework's own buffers (gradients, optimizer state)."""
    ops = counters.get("auto_inplace_ops", 0)
    ops += sum(v for k, v in counters.items() if k.startswith("auto_owned_ops."))
    return ops, counters.get("auto_inplace_bytes", 0) + counters.get("auto_owned_bytes", 0)


def _new_window() -> dict:
    """The sums of one logging window (``correct``: a device scalar, or None before the first)."""
    return {"loss": 0.0, "correct": None, "seen": 0, "targets": 0, "time": 0.0, "steps": 0, "peak": 0}


def _new_totals() -> dict:
    """What a run sums up to its end, and a checkpoint carries so that a resumed run reports
    the whole run: the open logging window (an interruption can fall inside one), the
    peak, floor, throughput and auto counters so far, the last logged loss and eval, and
    the memory timeline once recorded."""
    return {
        "window": _new_window(),
        "peak": 0,
        "floor": 0,
        "auto": {},  # auto-inplace counters over the whole run
        "timed": {"time": 0.0, "samples": 0, "steps": 0},  # leaving out the first step (warm-up)
        "last_loss": float("nan"),  # train/loss at the last log point
        "eval": None,
        "timeline": None,
        "timeline_floor": None,
    }


# The totals each rank keeps for itself (its window's losses and peak are its own); the
# others are rank 0's, the rank that logs.
_PER_RANK = ("window", "peak", "floor", "auto")


def _timeline_state(timeline) -> dict | None:
    """A memory timeline as arrays a checkpoint can hold (events: seconds, bytes, category, phase)."""
    if timeline is None:
        return None
    events = list(timeline["events"] if isinstance(timeline, dict) else timeline.events)
    marks = list(timeline["marks"] if isinstance(timeline, dict) else timeline.marks)
    columns = list(zip(*events)) if events else [(), (), (), (), ()]
    return {
        "seconds": np.asarray(columns[0], dtype=np.float64),
        "allocated": np.asarray(columns[1], dtype=np.int64),
        "delta": np.asarray(columns[2], dtype=np.int64),
        "category": np.asarray(columns[3], dtype=np.str_),
        "phase": np.asarray(columns[4], dtype=np.str_),
        "mark_seconds": np.asarray([m[0] for m in marks], dtype=np.float64),
        "mark_phase": np.asarray([m[1] for m in marks], dtype=np.str_),
    }


def _timeline_from_state(state: dict | None) -> dict | None:
    """The timeline :func:`_timeline_state` stored, as the ``{"events", "marks"}`` the plots read."""
    if state is None:
        return None
    columns = [state[k].tolist() for k in ("seconds", "allocated", "delta", "category", "phase")]
    marks = list(zip(state["mark_seconds"].tolist(), state["mark_phase"].tolist()))
    return {"events": list(zip(*columns)), "marks": marks}


class Trainer:
    """Trains the model a config describes. ``Trainer(cfg).fit()`` returns a :class:`RunResult`.

    Args:
        cfg: The run's config.
        resume: A checkpoint path, ``"auto"``/True (the run's latest), or False; None
            takes ``checkpoint.resume`` from the config.
        comm: The communicator (default: MPI's world, or one process).
        run_name: The run's folder name; default ``logging.run_name``, else
            :func:`~trainers.logging.default_run_name` of the policy, the number of
            processes, ``inplace_abn`` when the model uses it and ``compiled`` when the
            config compiles the step.
        label: What the progress display calls the run (default ``train``).
        timeline_image: Log the memory timeline of one step as an image when it is
            recorded; False leaves it to the caller (``RunResult.timeline``):
            ``scripts/compare_inplace.py`` draws every policy's on one scale at the end.
    """

    def __init__(
        self,
        cfg: Config,
        resume: str | bool | None = None,
        comm=None,
        run_name: str | None = None,
        label: str | None = None,
        timeline_image: bool = True,
    ):
        self.cfg = cfg
        self.label = label or "train"
        self.timeline_image = timeline_image
        self.comm = comm or get_world()
        check_zero(cfg, self.comm.size)
        limit_threads(cfg.threads, self.comm)
        apply_run_settings(cfg)
        # The GPU first: CuPy allocates on its current device, and the pool hook must be
        # registered before the model reaches the GPU for memory/* to be the GPU's.
        self.device = select_device(cfg.device, self.comm.local_rank)
        # On a GPU a step's loss stays on the device and is read at log points (reading it
        # each step would wait for the whole step): the one place that decides it.
        self.losses_on_device = self.device.type != "cpu"
        self.mem_device = self.device.type  # which memory counter the logs read
        fw.manual_seed(cfg.seed)

        self.train_set, self.test_set = build_data(cfg)
        self.classification = self.train_set.num_classes is not None
        # accuracy (classes), mse (regression) or a language model's loss per token (text)
        self.eval_name = getattr(self.train_set, "eval_metric", "accuracy" if self.classification else "mse")
        self.model = build_model_for(cfg, self.train_set)
        try:
            set_recompute(self.model, recompute_mode(cfg))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.model.to(self.device)
        self._check_model_fits_data()
        self.inplace_abn = uses_inplace_abn(self.model)
        self.policy = policy_label(cfg.inplace, self.inplace_abn)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        _check_compile(cfg, self.device)
        # Mixed precision: forward and loss under autocast; fp16 scales the loss (GradScaler)
        self.precision = precision(cfg)
        _check_precision(self.precision, cfg, self.device)
        self.autocast_dtype = AUTOCAST_DTYPES.get(self.precision)
        self.scaler = fw.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        # Several processes: gradients are averaged through in-place allreduced buckets
        # (framework/distributed/data_parallel.py); parameters start from rank 0's.
        self.dp = None
        self.control_comm = self.comm  # MPI, for host values (the stop signal) whatever carries gradients
        if self.comm.size > 1:
            try:  # NCCL for GPU buffers, or MPI (host staging on a GPU)
                self.comm = for_device(self.comm, self.device, cfg.distributed.backend)
            except (RuntimeError, ValueError) as e:  # a backend this device cannot use: bad input
                raise ConfigError(str(e)) from None

        if self.comm.size > 1 and cfg.compile:
            # A compiled step averages its gradients with ops of its own (between backward
            # and the update): DataParallel's backward hooks cannot be captured.
            _broadcast(list(self.model.parameters()) + list(self.model.buffers()), self.comm)
        elif self.comm.size > 1:
            if cfg.distributed.sync_bn:
                self.model = SyncBatchNorm.convert_sync_batchnorm(self.model, self.comm)
            self.dp = DataParallel(self.model, self.comm, bucket_mb=cfg.distributed.bucket_mb)
        self.net = self.dp if self.dp is not None else self.model
        with memory.category("optimizer_state"):
            self.optimizer = build_optimizer(cfg, self.params, self.dp)
        self.zero = cfg.distributed.zero  # 0 unless sharded (check_zero: only with a DataParallel)
        self.model_states = 0  # parameters + gradients + optimizer state after the last step, this rank
        self.criterion = fw.nn.CrossEntropyLoss() if self.classification else fw.nn.MSELoss()
        self.compiled = None
        if cfg.compile:
            self.compiled = fw.compile(self._step_body, modules=[self.model], optimizers=[self.optimizer])

        sampler = None
        if self.comm.size > 1:
            # Every rank draws the epoch's permutation and takes every size-th index, so
            # N ranks x batch B see exactly the samples of one process x batch N*B.
            sampler = DistributedSampler(
                len(self.train_set),
                self.comm.size,
                self.comm.rank,
                shuffle=True,
                seed=cfg.seed,
                drop_last=cfg.data.drop_last,
            )
        self.loader = DataLoader(
            self.train_set,
            cfg.data.batch_size,
            shuffle=True,
            seed=cfg.seed,
            drop_last=cfg.data.drop_last,
            sampler=sampler,
        )
        self._seed_rank_streams(0)
        k = cfg.train.accumulate  # micro-batches per step: the epoch's last, incomplete group is a step or dropped
        steps_per_epoch = len(self.loader) // k if cfg.data.drop_last else -(-len(self.loader) // k)
        self.total_steps = cfg.train.epochs * steps_per_epoch
        if cfg.train.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.train.max_steps)
        # The step whose memory timeline is recorded: the third (the first two warm caches
        # and the allocator), or the last of a shorter run.
        self.timeline_step = min(2, max(self.total_steps - 1, 0))

        # The name the config gives the run; its folders are a version of it (trainers/runs.py).
        self.base_name = (
            run_name
            or cfg.logging.run_name
            or default_run_name(
                cfg.inplace,
                self.comm.size,
                "inplace_abn" if self.inplace_abn else None,
                "compiled" if compiled(cfg) else None,
                f"recompute-{recompute_mode(cfg)}" if recompute_mode(cfg) != "none" else None,
                "conv-fast" if conv2d_mode(cfg) == "fast" else None,
                "conv-tf32" if conv_math(cfg) == "tf32" else None,
                f"zero{cfg.distributed.zero}" if cfg.distributed.zero else None,
                f"acc{cfg.train.accumulate}" if cfg.train.accumulate > 1 else None,
                None if self.precision == "fp32" else self.precision,
            )
        )
        self.log_root = os.path.dirname(run_dir(cfg.logging.logdir, cfg.experiment, self.base_name))
        self.ckpt_root = os.path.join(cfg.checkpoint.dir, cfg.experiment)
        self.run_id = runs.run_id(cfg.to_dict())
        self.step = 0
        self.totals = _new_totals()
        self.totals_restored = False  # from a checkpoint that holds them (earlier versions' do not)
        self.resumed = False
        self.last_checkpoint = None
        # Where a resume looked and found no checkpoint of this run (the run then starts at
        # step 0), and the other runs it found there: the scripts say so, or refuse when the
        # user asked for a resume.
        self.nothing_to_resume: str | None = None
        self.other_runs: list[str] = []
        if resume is None:
            resume = cfg.checkpoint.resume
        if resume:
            self._resume(resume)
        if not self.resumed:  # a new run: folders no other run has written
            self._use_folders(self._agreed(lambda: runs.next_free(self.base_name, self.log_root, self.ckpt_root)))

    def new_version_note(self) -> str | None:
        """One line when this new run writes a new version of its name (its name's folders
        hold another run, trainers/runs.py); None otherwise."""
        if self.resumed or self.run_name == self.base_name:
            return None
        taken = os.path.join(self.log_root, self.base_name)
        return f"{taken} already holds a run: this run writes {self.run_dir} (checkpoints: {self.ckpt_dir})"

    @property
    def finished(self) -> bool:
        """True when a resumed checkpoint is at (or past) the run's last step: nothing to train."""
        return self.resumed and self.step >= self.total_steps

    def describe_data(self) -> str | None:
        """What a text run's tokens are (its vocabulary), for the run's first line; else None."""
        vocab = getattr(self.train_set, "vocab", None)
        return None if vocab is None else f"data: {self.cfg.data.path} ({vocab.describe()})"

    def sample_text(self) -> str | None:
        """``sample.tokens`` tokens the trained language model writes after ``sample.prompt``
        (the validation text's first token when empty), with the framework's generator seeded
        from the config's seed; None for other models, data or ``sample.tokens: 0``."""
        s = self.cfg.sample
        if not s.tokens or not hasattr(self.model, "generate") or not hasattr(self.train_set, "decode"):
            return None
        try:
            prompt = self.test_set.encode(s.prompt) if s.prompt else self.test_set.tokens[:1].astype(np.int64)
        except ValueError as e:
            raise ConfigError(f"sample.prompt: {e}") from None
        idx = fw.tensor(np.asarray(prompt, dtype=np.int64)[None, :], device=self.device)
        self.model.eval()
        fw.manual_seed(self.cfg.seed)
        try:
            out = self.model.generate(idx, s.tokens, temperature=s.temperature, top_k=s.top_k)
        finally:
            self.model.train()
        return self.train_set.decode(out.numpy()[0])

    def _check_model_fits_data(self) -> None:
        """Runs one training sample through the model (eval mode, no grad) before training.

        Model arguments that do not fit the data (``in_features``, ``image_size``,
        ``num_classes``) are bad input: found here, they stop the run with one line
        (exit 2) instead of a traceback from the first step. Eval mode updates no
        running statistics and draws no dropout masks, so training is unchanged.
        """
        # Fancy indexing: copies (a tensor of a view would hold and count the whole data set).
        xb, yb = self.train_set[np.arange(1)]
        x, y = self._to_tensors(xb, yb)
        self.model.eval()
        try:
            with fw.no_grad():
                out = self.model(x)
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"model {self.cfg.model.name!r} does not fit data {self.cfg.data.name!r}: {e}; check model.args"
            ) from None
        except MemoryError as e:  # CuPy's OutOfMemoryError is one: one sample did not fit
            peak = memory.max_allocated_bytes(self.mem_device)
            raise ConfigError(
                out_of_memory_message(e, self.device, 0, 1, peak, "one sample through the model")
            ) from None
        finally:
            self.model.train()
        if self.classification:  # a class score per target (per token of a sequence)
            want, what = tuple(yb.shape[1:]) + (self.train_set.num_classes,), "num_classes"
        else:
            want, what = tuple(yb.shape[1:]), "the target shape"
        if tuple(out.shape[1:]) != want:
            raise ConfigError(
                f"model {self.cfg.model.name!r} gives outputs of shape {tuple(out.shape[1:])} per sample, but data "
                f"{self.cfg.data.name!r} needs {want} ({what}); leave model.args.num_classes out, or fix it"
            )

    # --- checkpoints ----------------------------------------------------------------------
    def state_dict(self, ranks: list | None = None) -> dict:
        """Everything a resume needs, as host NumPy arrays (a GPU run copies its tensors to the host).

        Loading puts them back on the trainer's device (``load_state_dict`` copies to
        each parameter's device).

        Args:
            ranks: Every rank's :meth:`_rank_state` (what :meth:`save` gathers); None:
                this process's alone.
        """
        totals = self.totals
        return {
            "step": self.step,
            "model": host_state(self.model.state_dict()),
            "optimizer": host_state(self.optimizer.state_dict()),
            "rng": fw.random.get_state(),
            "loader": self.loader.state_dict(),
            "scaler": self.scaler.state_dict(),  # empty unless precision: fp16
            "config": self.cfg.to_dict(),
            "ranks": ranks if ranks is not None else [self._rank_state()],
            "run": {
                "name": self.run_name,  # its folders (trainers/runs.py)
                "id": self.run_id,
                "timed": dict(totals["timed"]),
                "last_loss": totals["last_loss"],
                "eval": totals["eval"],
                "timeline": _timeline_state(totals["timeline"]),
                "timeline_floor": totals["timeline_floor"],
            },
        }

    def _rank_state(self) -> dict:
        """This rank's random state and its share of the totals (the window's device values read back)."""
        state = {key: host_state(self.totals[key]) for key in _PER_RANK}
        window = state["window"]
        if window["correct"] is not None:
            window["correct"] = int(to_host(window["correct"]))
        return {"rng": fw.random.get_state(), **state}

    def save(self) -> str:
        """Writes a checkpoint of this step (rank 0 writes; every rank must call it: it gathers their state)."""
        ranks = self.comm.allgather_object(self._rank_state()) if self.comm.size > 1 else None
        if self.zero:  # the shards of the optimizer state, whole on rank 0 (in a zero: 0 run's format)
            self.optimizer.consolidate_state_dict(to=0)
        path = None
        if self.comm.is_main:
            path = save_checkpoint(self.state_dict(ranks), self.ckpt_dir, self.step, self.cfg.checkpoint.keep)
        self.last_checkpoint = path
        return path

    def _use_folders(self, name: str) -> None:
        """Writes the run's TensorBoard events and checkpoints under ``name`` (a version of its name)."""
        self.run_name = name
        self.run_dir = run_dir(self.cfg.logging.logdir, self.cfg.experiment, name)  # checks the name
        self.ckpt_dir = os.path.join(self.ckpt_root, name)

    def _agreed(self, decide):
        """``decide()`` on rank 0, and its result (or its CheckpointError) on every rank: the
        ranks write and read the same folders, and fail alike."""
        comm = self.control_comm
        if comm.size == 1:
            return decide()
        result = error = None
        if comm.rank == 0:
            try:
                result = decide()
            except CheckpointError as e:
                error = str(e)
        result, error = comm.broadcast_object((result, error), root=0)
        if error is not None:
            raise CheckpointError(error)
        return result

    def _resume(self, resume) -> None:
        """Loads this run's checkpoint: ``resume`` is a path, or ``"auto"``/True for the latest
        checkpoint of the newest version of the run's name that is this config's run."""
        ours = self.cfg.to_dict()
        if resume in (True, "auto"):
            search = self._agreed(lambda: runs.find_own(self.base_name, self.log_root, self.ckpt_root, ours))
            if search.checkpoint is None:
                # resume: auto with nothing of this run saved yet starts fresh (the scripts say so)
                self.nothing_to_resume = os.path.join(self.ckpt_root, self.base_name)
                self.other_runs = search.others
                return
            name, path = search.name, search.checkpoint
        else:
            name, path = None, str(resume)
        state = load_checkpoint(path)
        saved_cfg = config_from_dict(state["config"], source=f"checkpoint {path}")
        saved_run = state.get("run") or {}
        if not runs.same_run(saved_cfg.to_dict(), ours):
            raise CheckpointError(
                runs.another_run(
                    f"checkpoint {path}",
                    saved_run.get("name") or os.path.basename(os.path.dirname(os.path.abspath(path))),  # its folder
                    saved_cfg.to_dict(),
                    ours,
                )
                + "; resume it with its config, or leave out --resume to start this run"
            )
        # A checkpoint goes on in its own folders (earlier versions' name none: the run's name).
        name = name or saved_run.get("name") or self.base_name
        try:
            self._use_folders(name)
        except ValueError:
            raise CheckpointError(f"checkpoint {path} names its run {name!r}, which is no folder name") from None
        runs.check_run_file(self.run_dir, ours)
        ranks = state.get("ranks")
        if ranks is not None and len(ranks) != self.comm.size:
            raise CheckpointError(
                f"checkpoint {path} was written by {len(ranks)} process{'es' if len(ranks) > 1 else ''}, "
                f"this run has {self.comm.size}; resume it with mpiexec -n {len(ranks)}"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.loader.load_state_dict(state["loader"])
        if state.get("scaler") and self.scaler.is_enabled():  # a run saved in fp16 goes on with its scale
            self.scaler.load_state_dict(state["scaler"])
        self.step = state["step"]
        self.totals_restored = ranks is not None
        if ranks is None:  # a checkpoint of an earlier version: rank 0's random state only
            fw.random.set_state(state["rng"])
            self._seed_rank_streams(self.step)
        else:
            mine = ranks[self.comm.rank]
            fw.random.set_state(mine["rng"])
            self.totals.update({key: mine[key] for key in _PER_RANK})
            run = state["run"]
            self.totals.update(
                timed=run["timed"],
                last_loss=run["last_loss"],
                eval=run["eval"],
                timeline=_timeline_from_state(run["timeline"]),
                timeline_floor=run["timeline_floor"],
            )
        self.resumed = True
        self.last_checkpoint = path

    def _seed_rank_streams(self, step: int) -> None:
        """Gives each rank its own random stream (dropout masks) after the shared init.

        Rank 0 keeps the stream the config's seed gives (and a checkpoint restores), so a
        one-process run is unchanged; rank r > 0 draws from (seed, rank, step).
        """
        if self.comm.rank > 0:
            fw.manual_seed(hash((self.cfg.seed, self.comm.rank, step)) % 2**63)

    # --- one step ---------------------------------------------------------------------------
    def _to_tensors(self, x, y):
        if self.device.type == "cpu":
            return fw.from_numpy(x), fw.from_numpy(y)
        return fw.tensor(x, device=self.device), fw.tensor(y, device=self.device)

    def _step_batches(self):
        """The rest of the epoch's training steps, each the list of its micro-batches
        (``(x, y)`` host arrays): ``train.accumulate`` consecutive batches of the loader. The
        epoch's last, incomplete group is a step of its own, or dropped under
        ``data.drop_last``: as the last batch of one ``accumulate`` times as large would be."""
        k, step = self.cfg.train.accumulate, []
        for batch in self.loader:
            step.append(batch)
            if len(step) == k:
                yield step
                step = []
        if step and not self.cfg.data.drop_last:
            yield step

    def _step_tensors(self, batches):
        """A training step's micro-batches as tensors ``(xs, ys)``, one list each: a compiled
        step on a GPU takes its batch into its CUDA graph's static input slots (``upload``:
        the batch is on the device once, not twice)."""
        if self.compiled is not None and self.device.type != "cpu":
            pairs = [self.compiled.upload(x, y, device=self.device) for x, y in batches]
        else:
            pairs = [self._to_tensors(x, y) for x, y in batches]
        return [x for x, _ in pairs], [y for _, y in pairs]

    def _step_body(self, x, y):
        """One whole step, as ``compile: true`` captures and replays it (loss, detached output)."""
        self.optimizer.zero_grad(set_to_none=True)
        out, y = per_token(self.model(x), y)
        loss = self.criterion(out, y)
        loss.backward()
        if self.comm.size > 1:
            allreduce_mean_([p.grad for p in self.params if p.grad is not None], self.comm)
        self.optimizer.step()
        return loss, out.detach()

    def _compiled_step(self, x, y, lr: float):
        if self.comm.size > 1:  # rank 0's running statistics, as DataParallel at each forward
            _broadcast(list(self.model.buffers()), self.comm)
        memory.mark("compiled step")
        captures = self.compiled.captures
        loss, out = self.compiled(x, y)
        if self.compiled.captures != captures:
            # A step that captured (and planned) is left out of memory/peak_mb, which shows the
            # replayed steps; what capturing held is logged as memory/capture_peak_mb.
            memory.reset_peak()
        # the step returned the per-token logits (see _step_body): the targets, flattened alike
        correct = (fw.argmax(out, dim=1) == y.reshape(-1)).sum()._data if self.classification else None
        if self.losses_on_device:  # a copy: the next replay may write over the program's output
            return loss._data.copy(), correct, None
        loss_value = float(loss.item())
        finite = math.isfinite(loss_value)
        if self.comm.size > 1:
            finite = self.comm.allreduce_scalar(0.0 if finite else 1.0, "max") == 0.0
        if not finite:
            check_targets()  # an out-of-range target (a GPU's deferred check) is the better report
            raise TrainingError(
                f"loss is not finite at step {self.step} (lr {lr:g}); a compiled step has already applied "
                "its update. Lower optim.lr"
            )
        return loss_value, correct, None

    def _memory_checked_step(self, xs, ys, lr: float, window):
        """:meth:`_train_step`; running out of device (or host) memory is a ConfigError (exit 2)."""
        try:
            return self._train_step(xs, ys, lr)
        except MemoryError as e:  # CuPy's OutOfMemoryError is one
            peak = max(window["peak"], memory.max_allocated_bytes(self.mem_device))
            raise ConfigError(out_of_memory_message(e, self.device, self.step, len(xs[0]), peak)) from None

    def _train_step(self, xs, ys, lr: float):
        """One optimizer step over the step's micro-batches ``xs`` and ``ys`` (lists of
        tensors: one batch each, or ``train.accumulate``).

        Each micro-batch runs forward and backward; their gradients add up in ``.grad``,
        each loss weighted by its share of the step's samples, so that they sum to the
        gradients of the step's whole batch. With several processes the bucketed reduce
        runs once, after the last backward (the others run in ``no_sync``, as DDP's).

        Returns:
            ``(loss, correct, saved)``: the step's loss (the weighted sum; a device scalar
            on a GPU), its correct predictions (a device scalar, or None) and the most
            bytes autograd held at a forward/backward boundary.
        """
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.compiled is not None:
            return self._compiled_step(xs[0], ys[0], lr)
        sizes = [len(x) for x in xs]
        loss_value = correct = None
        saved = 0
        for i, (x, y) in enumerate(zip(xs, ys)):
            weight = sizes[i] / sum(sizes)
            sync = self.dp is None or i == len(xs) - 1
            with contextlib.nullcontext() if sync else self.dp.no_sync():
                memory.mark("forward")
                with self._autocast():
                    out, y = per_token(self.net(x), y)
                    loss = self.criterion(out, y)
                if self.losses_on_device:
                    value = loss._data  # read with the others at the next log point (_read_losses)
                else:
                    value = float(loss.item())
                    self._check_finite([(self.step, lr, value)], "training stopped before the update")
                value = value if len(xs) == 1 else value * weight  # the step's loss: the weighted sum
                loss_value = value if loss_value is None else loss_value + value
                saved = max(saved, memory.saved_bytes(parameters=False))
                if i == 0:
                    self.optimizer.zero_grad(set_to_none=True)
                memory.mark("backward")
                with self._overflow_expected():  # the loss itself unless precision: fp16 scales it
                    self.scaler.scale(loss if len(xs) == 1 else loss * weight).backward()
            if self.classification:
                # Left on the device: read at the next log point, not here (a GPU would wait
                # for the whole step and lose the overlap of the next step's launch with it).
                hits = (fw.argmax(out.detach(), dim=1) == y).sum()._data
                correct = hits if correct is None else correct + hits
            del out, loss
        if self.dp is not None:
            self.dp.finish()  # averaged gradients, before clipping and the update
        if self.cfg.train.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)  # the true gradients' norm (a no-op unless fp16)
            if self.zero == 2:  # this rank's shard of the gradients: the norm summed over the ranks
                self.optimizer.clip_grad_norm_(self.cfg.train.grad_clip)
            else:
                clip_grad_norm_(self.params, self.cfg.train.grad_clip)
        memory.mark("optimizer")
        self.scaler.step(self.optimizer)  # skipped on inf/NaN gradients (fp16); optimizer.step() otherwise
        self.scaler.update()
        return loss_value, correct, saved

    def _overflow_expected(self):
        """fp16's scaled backward may overflow (to inf): the scaler skips that step, so NumPy's
        overflow warnings are silenced there; other precisions leave them as they are."""
        return np.errstate(over="ignore", invalid="ignore") if self.scaler.is_enabled() else contextlib.nullcontext()

    def _autocast(self):
        """The region a step's forward and loss run in: autocast in the config's precision."""
        return fw.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)

    def _check_finite(self, steps, when: str) -> None:
        """Raises TrainingError at the first non-finite loss of ``steps`` (``(step, lr,
        loss)`` each) on any rank; every rank stops at the same point, or none does."""
        bad = next(((k, lr, v) for k, lr, v in steps if not math.isfinite(v)), None)
        finite = bad is None
        if self.comm.size > 1:
            finite = self.comm.allreduce_scalar(0.0 if finite else 1.0, "max") == 0.0
        if finite:
            return
        check_targets()  # an out-of-range target (a GPU's deferred check) is the better report
        k, lr, _ = bad if bad is not None else steps[0]
        where = f"; the last good checkpoint is {self.last_checkpoint}" if self.last_checkpoint else ""
        what = f"loss is {bad[2]}" if bad is not None else "another rank's loss is not finite"
        raise TrainingError(f"{what} at step {k} (lr {lr:g}): {when}{where}. Lower optim.lr or set train.grad_clip")

    def _read_losses(self, pending: list) -> list[float]:
        """The losses of ``pending`` (``(step, lr, device scalar)`` each, a GPU's steps
        since the last log point) read back in one transfer, checked, as floats."""
        if not pending:
            return []
        xp = backend.get_array_module(pending[0][2])
        values = to_host(xp.stack([loss for _, _, loss in pending]))
        read = [(k, lr, float(v)) for (k, lr, _), v in zip(pending, values.tolist())]
        pending.clear()
        self._check_finite(
            read,
            f"on a GPU the loss is read at log points, so the steps up to {read[-1][0]} have applied their updates",
        )
        return [v for _, _, v in read]

    def floor_bytes(self, saved: int) -> int:
        """Parameters + gradients + optimizer state + activations saved for backward.

        ``saved`` excludes the weights nodes hold (they are counted as parameters). A
        compiled step (``saved`` None) reports the floor of its program.
        """
        if saved is None:
            return self.compiled.plan.floor_bytes
        params = sum(p.nbytes for p in self.params)
        grads = self.optimizer.gradient_bytes() if self.zero == 2 else params  # zero 2: this rank's shard
        return params + grads + self.optimizer.state_bytes() + saved

    def zero_formula_bytes(self) -> float:
        """What Rajbhandari et al.'s accounting says a rank holds of parameters, gradients and
        optimizer state at this run's ZeRO stage and number of processes."""
        numel = sum(p.numel() for p in self.params)
        itemsize = self.params[0].element_size() if self.params else 4
        state = state_per_parameter(self.cfg) * itemsize
        return model_state_bytes(numel, itemsize, state, self.zero, self.comm.size)

    def evaluate(self) -> float:
        """Test accuracy (classification), mean squared error (regression) or the mean cross
        entropy per token (a language model's validation loss).

        The score is summed on the device and read back once, at the end.
        """
        self.model.eval()
        total, score = 0, None
        n, batch = len(self.test_set), self.cfg.data.eval_batch_size
        with fw.no_grad(), self._autocast():
            for start in range(0, n, batch):
                xs, ys = self.test_set[np.arange(start, min(start + batch, n))]
                x, y = self._to_tensors(xs, ys)
                out, y = per_token(self.model(x), y)
                if self.eval_name == "loss":
                    part = fw.nn.functional.cross_entropy(out, y, reduction="sum")._data.astype(np.float64)
                    count = len(y)
                elif self.classification:
                    part = (fw.argmax(out, dim=1) == y).sum()._data.astype(np.float64)
                    count = len(y)
                else:
                    part = ((out - y) ** 2).mean()._data.astype(np.float64) * len(xs)
                    count = len(xs)
                score = part if score is None else score + part
                total += count
        self.model.train()
        return (float(to_host(score)) if score is not None else 0.0) / max(total, 1)

    # --- the loop -------------------------------------------------------------------------------
    def fit(self) -> RunResult | None:
        """Trains to the last step, logging and checkpointing on the way.

        SIGINT, SIGTERM and SIGUSR1 stop it at the end of the step in flight: every rank
        stops after the same step, a checkpoint of that step is written (whatever
        ``checkpoint.every`` says), and :class:`Interrupted` is raised; resuming from
        that checkpoint logs every point once, with the values of a run never stopped.
        After the last step, the final evaluation and the summary are logged before the
        last checkpoint is written; a signal meanwhile lets them finish, then stops the
        complete run.

        Returns:
            The run's :class:`RunResult`; None when the run had already :attr:`finished`
            (a resumed checkpoint at its last step): then nothing is trained, logged or
            saved, the run's event files and checkpoints stay as they were, and
            :meth:`result` gives what the run reported.

        Raises:
            Interrupted: a signal stopped the run (its checkpoint is written).
        """
        if self.finished:
            return None
        cfg = self.cfg
        # purge_step makes TensorBoard drop the points an earlier attempt of this run logged
        # at or after it: a run resumed at step N drops those after N (up to N they were
        # flushed before the checkpoint and are the same points this run would log). No file
        # is deleted. A new run writes folders no run has written (trainers/runs.py).
        first_step = self.step + 1 if self.resumed else 0
        logger = RunLogger(self.run_dir, enabled=self.comm.is_main, purge_step=first_step)
        if self.comm.is_main:
            runs.write_run_file(self.run_dir, self.run_name, cfg.to_dict())
        if not self.resumed or _read_text(os.path.join(self.run_dir, "config.yaml")) != cfg.to_yaml():
            logger.config_text(cfg.to_yaml(), step=first_step)  # again only if it changed
        eval_name = self.eval_name
        logger.layout(dashboard_layout(eval_name), step=first_step)
        progress = Progress(
            total=self.total_steps,
            initial=self.step,
            disable=not (cfg.logging.progress and self.comm.is_main),
            log_every=cfg.train.log_every,
            desc=self.label,
        )
        totals = self.totals
        losses: list[float] = []
        pending: list = []  # on a GPU: (step, lr, loss on the device) since the last log point
        if self.device.type == "cuda":
            memory.enable_gpu_hook()  # CuPy's hooks are per thread: fit() may run in another one
        timeline_step = self.timeline_step  # recorded (and logged) once: a run resumed after it has it
        stop, result = 0, None
        signals = StopSignals(announce=self.comm.is_main, doing=self._doing)
        agreement = StopAgreement(self.control_comm)
        try:
            with signals:
                while self.step < self.total_steps and not stop:
                    for batch in self._step_batches():
                        if self.step >= self.total_steps:
                            break
                        window = totals["window"]
                        lr = learning_rate(cfg, self.step, self.total_steps)
                        # A checkpoint step is a log point too: a run resumed there logs the
                        # same windows, and so the same points, as one that was not stopped.
                        done = self.step + 1
                        log_now = (
                            done % cfg.train.log_every == 0
                            or done == self.total_steps
                            or (cfg.checkpoint.every and done % cfg.checkpoint.every == 0)
                        )
                        # The step's time includes copying its batch to the device (a host-to-GPU
                        # copy also waits for the previous step's queued kernels).
                        t0 = time.perf_counter()
                        xs, ys = self._step_tensors(batch)
                        # The peak of the training step alone: evaluation and checkpoints
                        # between steps (eval batches are larger) must not show up in it.
                        memory.reset_peak()
                        before = memory.stats()
                        record = cfg.logging.timeline and self.step == timeline_step and totals["timeline"] is None
                        if record:
                            with memory.record_timeline(self.mem_device) as tl:
                                loss, correct, saved = self._memory_checked_step(xs, ys, lr, window)
                        else:
                            loss, correct, saved = self._memory_checked_step(xs, ys, lr, window)
                        # what a rank holds of parameters, gradients and optimizer state between steps
                        held = memory.breakdown(self.mem_device)
                        self.model_states = held["parameters"] + held["gradients"] + held["optimizer_state"]
                        if log_now:
                            # Queued GPU work belongs to the steps being timed: wait for it
                            # before the clock closes the window (between log points, each
                            # step's loss read waits for the step before it).
                            synchronize(self.device)
                        dt = time.perf_counter() - t0
                        window["peak"] = max(window["peak"], memory.max_allocated_bytes(self.mem_device))
                        del xs, ys
                        if self.losses_on_device:
                            pending.append((self.step, lr, loss))
                        self.step += 1
                        stop = agreement.after_step(signals.received)
                        if stop or self.step == self.total_steps:
                            late = agreement.close()  # every rank completes the agreement in flight
                            stop = stop or late  # a signal in the last step: the run is complete, then stops
                        if not self.losses_on_device:
                            read = [loss]
                        else:
                            read = self._read_losses(pending) if log_now or stop else []
                        losses.extend(read)
                        totals["floor"] = max(totals["floor"], self.floor_bytes(saved))
                        if record:
                            totals["timeline"], totals["timeline_floor"] = tl, self.floor_bytes(saved)
                            if self.timeline_image:
                                logger.timeline_figure(timeline_step, tl, floor_bytes=totals["timeline_floor"])
                        for value in read:  # step by step, in order: the same sum on every device
                            window["loss"] += value
                        if correct is not None:  # summed on the device, read at the log point
                            window["correct"] = correct if window["correct"] is None else window["correct"] + correct
                        seen = sum(len(xb) for xb, _ in batch)  # every micro-batch's samples
                        window["seen"] += seen
                        window["targets"] += sum(np.size(yb) for _, yb in batch)
                        window["time"] += dt
                        window["steps"] += 1
                        after = memory.stats()
                        _add_auto_stats(window, before, after)
                        _add_auto_stats(totals["auto"], before, after)
                        if self.step > 1 or self.total_steps == 1:
                            timed = totals["timed"]
                            timed["time"] += dt
                            timed["samples"] += seen * self.comm.size
                            timed["steps"] += 1
                        if log_now:
                            totals["peak"] = max(totals["peak"], window["peak"])
                            metrics = self._window_metrics(window, window["peak"], totals["floor"])
                            totals["last_loss"] = metrics["train/loss"]
                            logger.scalars(self.step, metrics)
                            progress.update(
                                self.step,
                                loss=metrics["train/loss"],
                                samples_per_sec=metrics["perf/samples_per_sec"],
                                # The run's peak so far: its last line shows the summary table's.
                                peak_mb=totals["peak"] / MB,
                            )
                            totals["window"] = _new_window()
                        if self.step % cfg.train.eval_every == 0 or self.step == self.total_steps:
                            totals["eval"] = self.evaluate()
                            logger.scalars(self.step, {f"eval/{eval_name}": totals["eval"]})
                        if self.step == self.total_steps:
                            break  # the run's end writes the last checkpoint, after the summary
                        if (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0) or stop:
                            logger.flush()  # every point logged so far is on disk before the checkpoint
                            self.save()
                        if stop:
                            progress.update(self.step)  # its last line names the step it stopped after
                            break
                if self.step == self.total_steps:
                    # The run's end, still under the signal handlers: the summary is logged and
                    # flushed before the last checkpoint, so a checkpoint at the last step is a
                    # run whose final evaluation and summary are done (a resume of it only prints
                    # them, and the sample). A signal during the final evaluation or the summary
                    # is taken here: the run is complete, then it stops.
                    result = self._result(losses)
                    logger.hparams(self.hparams(), self._summary_metrics(result))
                    logger.flush()
                    self.save()
                    stop = agreement.now(stop or signals.received)
        finally:
            progress.close()
        logger.close()
        if stop:  # before the end: the summary waits for it; at the end: the run is complete
            raise Interrupted(stop, self.step, self.total_steps, self.last_checkpoint, self.run_name)
        return result

    def _doing(self) -> str:
        """What the run finishes before a signal stops it (the line the signal prints)."""
        if self.step < self.total_steps:
            return f"step {self.step + 1}"
        return "the run's final evaluation and summary"

    def _summary_metrics(self, result: RunResult) -> dict:
        """The one-point ``summary/*`` tags of a finished run (the HPARAMS tab's metrics)."""
        return {
            "summary/peak_mb": result.peak_mb,
            "summary/floor_mb": result.floor_mb,
            "summary/samples_per_sec": result.samples_per_sec,
            "summary/final_loss": result.final_loss,
            f"summary/eval_{self.eval_name}": result.eval_metric if result.eval_metric is not None else float("nan"),
        }

    def result(self) -> RunResult:
        """The :class:`RunResult` of a run resumed at its end (:attr:`finished`), from its checkpoint.

        What :meth:`fit` returned when the run ended, except ``losses`` (only the steps a
        ``fit`` trains).

        Raises:
            CheckpointError: the checkpoint is of an earlier version, which kept no totals.
        """
        if not self.totals_restored:
            raise CheckpointError(
                f"checkpoint {self.last_checkpoint} was written by an earlier version, without the run's peak, "
                "floor and losses; train the run again (without --resume)"
            )
        return self._result([])

    def hparams(self) -> dict:
        """What tells this run apart from the others of its experiment (the HPARAMS tab).

        The same keys in every run of an experiment (TensorBoard takes the columns from
        one run); ``run`` shows the run's whole name; ``compiled`` appears where the config
        has a ``compile`` key.
        """
        cfg = self.cfg
        # inplace: the policy with InPlace-ABN (on+abn), the column TensorBoard shows by default.
        hp = {"run": self.run_name, "inplace": self.policy, "inplace_abn": self.inplace_abn}
        if compiled(cfg) is not None:
            hp["compiled"] = compiled(cfg)
        if "recompute" in cfg:
            hp["recompute"] = recompute_mode(cfg)
        if "conv2d" in cfg:
            hp["conv2d"] = conv2d_mode(cfg)
        if "conv_math" in cfg:
            hp["conv_math"] = conv_math(cfg)
        if "precision" in cfg:
            hp["precision"] = self.precision
        hp.update(
            {
                "zero": cfg.distributed.zero,
                "accumulate": cfg.train.accumulate,
                "processes": self.comm.size,
                "model": cfg.model.name,
                "batch_size": cfg.data.batch_size,
                "optimizer": cfg.optim.name,
                "lr": cfg.optim.lr,
            }
        )
        return hp

    def time_steps(self, steps: int) -> float:
        """Samples per second of ``steps`` more training steps, not logged or saved.

        Sets this trainer's inplace policy and conv2d modes first, so that trainers of
        several configs can take turns in one process (``scripts/compare_inplace.py``
        alternates them to measure throughput as a distribution). Training goes on from
        where it is.
        """
        apply_run_settings(self.cfg)
        lr = learning_rate(self.cfg, max(self.total_steps - 1, 0), self.total_steps)
        batches = self._step_batches()
        seconds, samples = 0.0, 0
        for _ in range(steps):
            batch = next(batches, None)
            if batch is None:  # the epoch ended: the loader goes on with the next one
                batches = self._step_batches()
                batch = next(batches)
            t0 = time.perf_counter()
            xs, ys = self._step_tensors(batch)
            self._train_step(xs, ys, lr)
            synchronize(self.device)
            seconds += time.perf_counter() - t0
            samples += sum(len(x) for x, _ in batch) * self.comm.size
            del xs, ys
        return samples / seconds if seconds > 0 else float("nan")

    def _window_metrics(self, window, peak, floor) -> dict:
        n = max(window["steps"], 1)
        metrics = {
            "train/loss": window["loss"] / n,
            "perf/samples_per_sec": window["seen"] * self.comm.size / max(window["time"], 1e-9),
            "perf/step_ms": 1000 * window["time"] / n,
            "memory/peak_mb": peak / MB,
            "memory/allocated_mb": memory.allocated_bytes(self.mem_device) / MB,
            "memory/floor_mb": floor / MB,
        }
        check_targets()  # the GPU losses' deferred target checks: read back here, not in the step
        if self.classification:
            correct = 0 if window["correct"] is None else int(to_host(window["correct"]))
            metrics["train/accuracy"] = correct / max(window["targets"], 1)
        # What policy auto did, per training step: writes it ran in place (in total and by
        # op or site: the ops it proved dead, and its writes over the framework's own
        # buffers, framework.inplace.count_owned) and the bytes they did not allocate.
        # Zero under on and off.
        ops, saved = _auto_totals(window)
        metrics["inplace/auto_ops_per_step"] = ops / n
        metrics["inplace/auto_saved_mb_per_step"] = saved / n / MB
        for key, count in window.items():
            if key.startswith(("auto_inplace_ops.", "auto_owned_ops.")):
                metrics["inplace/auto_ops_per_step/" + key.split(".", 1)[1]] = count / n
        if self.scaler.is_enabled():  # fp16: the loss scale now (read back at log points only)
            metrics["train/loss_scale"] = self.scaler.get_scale()
        if self.compiled is not None:  # what the compiled step's plan expects, beside the measured tags
            plan = self.compiled.plan
            metrics["memory/planned_peak_mb"] = plan.planned_peak_bytes / MB
            metrics["memory/planned_arena_mb"] = plan.arena_bytes / MB
            metrics["memory/planned_lower_bound_mb"] = plan.lower_bound_bytes / MB
            metrics["memory/capture_peak_mb"] = self.compiled.report()["eager_peak_bytes"] / MB
        # GPU runs: tracked CuPy arrays at their nbytes; their sum is a little below the
        # pool's allocated_mb, which rounds blocks up and holds untracked temporaries.
        for name, nbytes in memory.breakdown(self.mem_device).items():
            metrics[f"memory/{name}_mb"] = nbytes / MB
        if self.comm.size > 1:  # a collective: every rank computes its metrics
            ranks = self.comm.allgather_object((peak, floor, self.model_states))
            for r, (rank_peak, rank_floor, rank_states) in enumerate(ranks):
                metrics[f"memory/peak_mb_rank{r}"] = rank_peak / MB
                metrics[f"memory/floor_mb_rank{r}"] = rank_floor / MB
                metrics[f"memory/model_states_mb_rank{r}"] = rank_states / MB
            metrics["memory/peak_mb_max"] = max(rank[0] for rank in ranks) / MB
            metrics["memory/model_states_zero_mb"] = self.zero_formula_bytes() / MB
            metrics["train/loss"] = self.comm.allreduce_scalar(metrics["train/loss"], "mean")
        return metrics

    def _result(self, losses: list) -> RunResult:
        totals, timed = self.totals, self.totals["timed"]
        floor = totals["timeline_floor"]
        return RunResult(
            run_dir=self.run_dir,
            steps=self.step,
            final_loss=totals["last_loss"],
            eval_metric=totals["eval"],
            eval_name=self.eval_name,
            peak_mb=max(totals["peak"], totals["window"]["peak"]) / MB,
            floor_mb=totals["floor"] / MB,
            samples_per_sec=timed["samples"] / timed["time"] if timed["time"] else float("nan"),
            step_ms=1000 * timed["time"] / timed["steps"] if timed["steps"] else float("nan"),
            policy=self.policy,
            losses=losses,
            timeline=totals["timeline"],
            auto_ops_per_step=_auto_totals(totals["auto"])[0] / max(self.step, 1),
            auto_saved_mb_per_step=_auto_totals(totals["auto"])[1] / max(self.step, 1) / MB,
            planned_peak_mb=self.compiled.plan.planned_peak_bytes / MB
            if self.compiled and self.compiled.last
            else None,
            inplace_chains=len(self.compiled.report()["inplace_chains"])
            if self.compiled and self.compiled.last
            else None,
            timeline_step=self.timeline_step if totals["timeline"] is not None else None,
            timeline_floor_mb=floor / MB if floor is not None else None,
        )


def _check_compile(cfg: Config, device) -> None:
    """``compile: true`` needs what a captured step can replay."""
    if not cfg.compile:
        return
    if recompute_mode(cfg) != "none":
        raise ConfigError(
            f"compile: true cannot run a checkpointed model (recompute: {recompute_mode(cfg)}): a compiled step "
            "plans its memory itself (docs/COMPILE.md); set recompute: none or compile: false"
        )
    if cfg.train.grad_clip > 0:
        raise ConfigError(
            "compile: true cannot clip gradients: train.grad_clip reads the gradient norm into Python, "
            "which a replayed step does not run; set train.grad_clip: 0 or compile: false"
        )
    if cfg.train.accumulate > 1:
        raise ConfigError(
            f"compile: true captures a step of one batch, and train.accumulate: {cfg.train.accumulate} makes a step "
            "of several; set train.accumulate: 1 or compile: false"
        )


def check_zero(cfg: Config, processes: int) -> None:
    """``distributed.zero`` shards across processes, what a sharded step needs: ConfigError otherwise."""
    zero = cfg.distributed.zero
    if not zero:
        return
    if processes < 2:
        raise ConfigError(
            f"distributed.zero: {zero} shares the optimizer state{' and gradients' if zero == 2 else ''} out among "
            "processes, but this run has one; run it under mpiexec -n N (N >= 2), or set distributed.zero: 0"
        )
    if cfg.compile:
        raise ConfigError(
            f"distributed.zero: {zero} shards what DataParallel reduces, and a compiled step averages its gradients "
            "with ops of its own; set compile: false or distributed.zero: 0"
        )
    if zero == 1 and not state_per_parameter(cfg):
        raise ConfigError(
            "distributed.zero: 1 shards the optimizer state, and sgd without momentum keeps none: nothing to "
            "shard; set distributed.zero: 2 (it shards the gradients too) or 0"
        )


def _check_precision(precision: str, cfg: Config, device) -> None:
    """What ``precision: bf16 | fp16`` needs: an eager step, fp16 unsharded gradients (no
    ZeRO), and for bf16 on a GPU one that computes in bfloat16 (compute capability 8.0,
    Ampere, or later). The CPU takes both:
    every CPU kernel of this framework takes float16 and bfloat16 (products, convolutions
    and normalizations in float32, rounded once; docs/PRECISION.md)."""
    if precision == "fp32":
        return
    if compiled(cfg):
        raise ConfigError(
            f"precision: {precision} cannot run compiled: fw.compile does not support autocast (its replay of a "
            "bf16 step is not the eager step's numbers bit for bit); set compile: false or precision: fp32"
        )
    if precision == "fp16" and cfg.distributed.zero:
        raise ConfigError(
            f"precision: fp16 does not run with distributed.zero: {cfg.distributed.zero} yet: the GradScaler "
            "checks the gradients this rank holds and steps the optimizer, and ZeRO shards both; use "
            "precision: bf16 (no scaler) or distributed.zero: 0"
        )
    if precision == "bf16" and device.type == "cuda":
        props = backend.device_properties(device)
        major, minor = props["compute_capability"]
        if major < 8:
            raise ConfigError(
                f"precision: bf16 needs a GPU of compute capability 8.0 or later; {props['name']} ({device}) "
                f"is {major}.{minor}: use precision: fp16 there"
            )


def _broadcast(tensors, comm) -> None:
    """Every rank gets rank 0's values of ``tensors`` (in place)."""
    for t in tensors:
        data = t._data
        if data.flags.c_contiguous and data.flags.writeable:
            comm.broadcast_(data, root=0)
        else:
            tmp = np.ascontiguousarray(data)
            comm.broadcast_(tmp, root=0)
            data[...] = tmp


def summary_table(results: list[RunResult]) -> str:
    rows = [
        {
            "run": os.path.basename(r.run_dir),
            "steps": r.steps,
            "final loss": r.final_loss,
            f"eval {r.eval_name}": r.eval_metric,
            "peak MB": r.peak_mb,
            "floor MB": r.floor_mb,
            "samples/s": r.samples_per_sec,
        }
        for r in results
    ]
    columns = [(k, k) for k in rows[0]] if rows else []
    return format_summary(rows, columns, SUMMARY_LEGEND)


# What the summary tables' columns mean (scripts/train.py's and compare_inplace.py's).
SUMMARY_LEGEND = (
    (
        "final loss",
        "train/loss's last point: the mean over the last train.log_every steps, as on the progress line",
    ),
    ("eval accuracy", "on the held-out set at the last step"),
    ("eval mse", "on the held-out set at the last step"),
    ("eval loss", "a language model's mean cross entropy per validation token (nats) at the last step"),
    (
        "peak MB",
        "the highest live array memory of a training step (evaluation left out); MB = 2^20 bytes",
    ),
    (
        "floor MB",
        "what a step cannot do without: parameters, gradients, optimizer state and what autograd holds for backward",
    ),
    ("samples/s", "over the whole run, leaving out the first step (warm-up)"),
)
