"""Configuration of a training run: schema, YAML files with ``base:`` inheritance, overrides.

A run is described by one YAML file (``configs/*.yaml``) plus ``--set key=value``
overrides from the command line::

    cfg = load_config("configs/mlp.yaml", ["optim.lr=0.05", "inplace=off"])
    cfg.optim.lr          # 0.05
    cfg.model.args        # a plain dict, handed to the model constructor

Every key, its type, default and meaning lives in ``SCHEMA`` below; docs/CONFIG.md's
config reference is generated from it (``python -m trainers.config``).

This module is pure Python + PyYAML on purpose: the CLI must be able to reject a bad
config in milliseconds, before NumPy/CuPy/MPI are imported.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import yaml

__all__ = [
    "Config",
    "ConfigError",
    "Field",
    "SCHEMA",
    "config_from_dict",
    "load_config",
    "reference_markdown",
    "resumable_keys",
    "schema_keys",
]


class ConfigError(ValueError):
    """A user error in a config file, an override or a config dict (one-line message)."""


@dataclasses.dataclass(frozen=True)
class Field:
    """One config value.

    Attributes:
        type: One of the names in ``_TYPES`` ("str", "int", "float", "bool", "dict",
            "floats2", "ints", "int?", "str?", "str|bool"); a trailing "?" allows null.
        default: The value used when no file or override sets the key.
        doc: One line for the reference table.
        choices: Allowed values, if the set is fixed.
        min: Inclusive lower bound (numbers; each element for lists).
        gt: Exclusive lower bound.
        lt: Exclusive upper bound.
        parse: The function that parses such values (the one parser of them, raising
            ValueError for a bad one), described by ``parse_doc``.
        from_bool: Maps YAML booleans to values, because YAML 1.1 reads bare
            ``on``/``off``/``yes``/``no`` as booleans.
        resumable: The key may change when a run is resumed and the run stays the same
            run: where it is written, how long it trains, what it shows and how often, how
            fast it runs. Every other key is part of the run's identity (trainers/runs.py).
    """

    type: str
    default: Any
    doc: str
    choices: tuple | None = None
    min: float | None = None
    gt: float | None = None
    lt: float | None = None
    parse: Callable[[str], Any] | None = None
    parse_doc: str = ""
    from_bool: Mapping[bool, Any] | None = None
    resumable: bool = False


def _parse_device(spec: str):
    """The framework's one device parser (``framework.backend.parse_device``)."""
    # Imported here, not at the top, for import time: ``python -m trainers.config`` prints
    # the reference without importing the framework (a test holds it to that).
    from framework.backend import parse_device  # noqa: PLC0415

    return parse_device(spec)


# fmt: off  (a table: one key per row, aligned)
SCHEMA: dict[str, Any] = {
    "experiment": Field(
        "str",
        "default",
        "TensorBoard experiment folder: runs are written to `<logdir>/<experiment>/<run>`",
        resumable=True,
    ),
    "seed": Field("int", 0, "Random seed for parameter init, data order and synthetic data"),
    "device": Field(
        "str",
        "cpu",
        "Where to compute: the CPU (NumPy) or a GPU (CuPy; `cuda` gives each MPI "
        "rank GPU local_rank % GPUs, `cuda:N` is GPU N)",
        parse=_parse_device,
        parse_doc="cpu, cuda or cuda:N (e.g. cuda:0)",
        resumable=True,
    ),
    "inplace": Field(
        "str",
        "auto",
        "Inplace policy of every inplace site of the run: `off` (the "
        "reference), `auto` (in place only where the input is provably dead: the "
        "numbers of `off`, bit for bit) or `on` (every site in place; reading an "
        "overwritten input stops the run with an error naming the site)",
        choices=("off", "auto", "on"),
        from_bool={True: "on", False: "off"},
    ),
    "compile": Field(
        "bool",
        False,
        "Run the training step compiled (`fw.compile`, docs/COMPILE.md): captured "
        "while the first steps run, then replayed with inplace decisions and a memory plan made on "
        "the whole step; the run name gets `_compiled`. On a GPU it replays as one CUDA graph where the "
        "step can be captured (report() says whether and why not); not with train.grad_clip",
    ),
    "recompute": Field(
        "str",
        "none",
        "What backward recomputes instead of keeping (activation checkpointing, docs/RECOMPUTE.md; "
        "Megatron's names): `none`; `full` (each block keeps its input and runs again in backward: "
        "a ResNet's basic blocks, a GPT's Transformer blocks); `selective` (a GPT's attention core, "
        "Korthikanti et al.'s; a ResNet block's BatchNorms and activations, its convolutions' outputs "
        "kept); the run name gets `_recompute-<mode>`; not with compile",
        choices=("none", "full", "selective"),
    ),
    "precision": Field(
        "str",
        "fp32",
        "Mixed precision of the forward pass and loss (`fw.autocast`, docs/PRECISION.md): `fp32` (none), "
        "`bf16` (PyTorch's autocast lists in bfloat16) or `fp16` (float16, with a `GradScaler`: the loss "
        "scaled, steps with inf/NaN gradients skipped); parameters, gradients and optimizer state stay "
        "float32; the run name gets `_bf16`/`_fp16`; bf16 on a GPU needs compute capability 8.0; not with "
        "compile",
        choices=("fp32", "bf16", "fp16"),
    ),
    "conv2d": Field(
        "str",
        "auto",
        "How conv2d picks its algorithm per layer: `auto` (the ones that round like im2col) or "
        "`fast` (Winograd F(4x4, 3x3) on 3x3 stride-1 layers of >= 32 channels: faster, 3-6x "
        "the float32 rounding; docs/BENCHMARKS.md); the run name gets `_conv-fast`",
        choices=("auto", "fast"),
    ),
    "conv_math": Field(
        "str",
        "fp32",
        "How conv2d rounds float32 on a GPU: `fp32` (full float32: cuDNN's TF32 tensor-core engines "
        "deselected) or `tf32` (allowed: faster, float32 inputs rounded to 10 mantissa bits, errors of "
        "~1e-3); the CPU computes in full float32 either way; the run name gets `_conv-tf32`",
        choices=("fp32", "tf32"),
    ),
    "threads": Field(
        "int",
        0,
        "Threads per process for NumPy's BLAS (0: the library's default, "
        "or cores / processes under MPI); small models run fastest on 1",
        min=0,
        resumable=True,
    ),
    "data": {
        "name": Field(
            "str",
            "digits",
            "Dataset: built in (`digits`, `synthetic_*`) or read from disk (`npz`, `cifar10`, `cifar100` from "
            'data.root; `text` from data.path; docs/USAGE.md, "Your own data")',
            choices=("digits", "synthetic_images", "synthetic_regression", "npz", "cifar10", "cifar100", "text"),
        ),
        "batch_size": Field("int", 64, "Training batch size per process", min=1),
        "eval_batch_size": Field("int", 512, "Evaluation batch size per process", min=1, resumable=True),
        "drop_last": Field("bool", True, "Drop the last incomplete training batch of an epoch"),
        "num_train": Field("int", 2048, "Training samples (synthetic sets only)", min=1),
        "num_test": Field("int", 512, "Test samples (synthetic sets only)", min=1),
        "image_size": Field("int", 32, "Image height and width (synthetic_images)", min=1),
        "channels": Field("int", 3, "Image channels (synthetic_images)", min=1),
        "num_classes": Field("int", 10, "Number of classes (synthetic_images)", min=2),
        "noise": Field("float", 1.0, "Noise standard deviation of synthetic data", min=0),
        "in_features": Field("int", 32, "Input features (synthetic_regression)", min=1),
        "out_features": Field("int", 1, "Output features (synthetic_regression)", min=1),
        "test_fraction": Field(
            "float", 0.2, "Fraction held out for evaluation (digits; npz without data.test_root)", gt=0, lt=1
        ),
        "root": Field(
            "str?",
            None,
            "Where the data set is on disk: for `npz` a `.npz` file or a folder of `<x_name>.npy` and "
            "`<y_name>.npy`; for `cifar10`/`cifar100` the folder of the binary version (`cifar-10-batches-bin`, "
            "`cifar-100-binary`) or the folder that holds it; a relative path in a config file is relative to "
            "that file's folder, one given with --set to the current directory",
        ),
        "test_root": Field(
            "str?",
            None,
            "`npz`: the held-out arrays, in data.root's form (relative as data.root); null: hold out "
            "data.test_fraction of data.root's samples",
        ),
        "x_name": Field("str", "x", "`npz`: the inputs' array (the member of the .npz, or the .npy file's stem)"),
        "y_name": Field(
            "str",
            "y",
            "`npz`: the targets' array: integers are class labels (0 to classes - 1), floats regression targets",
        ),
        "labels": Field(
            "str", "fine", "`cifar100`: the 100 fine classes or the 20 coarse ones", choices=("fine", "coarse")
        ),
        "augment": Field(
            "bool",
            False,
            "Image data sets: each training image randomly cropped after 4 pixels of zero padding and flipped "
            "left-right with probability 1/2, drawn from (seed, epoch, sample): a resumed run draws the same",
        ),
        # text: any UTF-8 file, for a language model (trainers/text_data.py)
        "path": Field(
            "str?",
            None,
            "The text file (text); a relative path in a config file is relative to that file's folder, "
            "one given with --set to the current directory",
        ),
        "vocab": Field(
            "str",
            "char",
            "Tokens of the text: `char` (its distinct characters) or `byte` (256)",
            choices=("char", "byte"),
        ),
        "block_size": Field("int", 64, "Tokens per sample: the context of a language model (text)", min=1),
        "val_fraction": Field("float", 0.1, "The text's last fraction held out for validation (text)", gt=0, lt=1),
    },
    "model": {
        "name": Field("str", "mlp", "Model name in the model registry (`models.build_model` checks it)"),
        "args": Field(
            "dict",
            {},
            "Keyword arguments of the model constructor (free-form; checked by the model). "
            "Merged key by key over a base file's while the model stays the same; replaced (by this "
            "file's or override's own `model.args`, or none) where a file or `--set` names another "
            "`model.name`",
        ),
    },
    "optim": {
        "name": Field("str", "sgd", "Optimizer", choices=("sgd", "adam", "adamw")),
        "lr": Field("float", 0.1, "Learning rate (peak learning rate with a schedule)", gt=0),
        "momentum": Field("float", 0.9, "SGD momentum", min=0),
        "dampening": Field("float", 0.0, "SGD dampening", min=0),
        "nesterov": Field("bool", False, "SGD Nesterov momentum"),
        "weight_decay": Field("float", 0.0, "Weight decay (decoupled for adamw)", min=0),
        "decay": Field(
            "str",
            "all",
            "Which parameters weight decay applies to: `all`, or `matrices` (those of 2 or more dims: linear "
            "and embedding weights; biases and LayerNorm weights get none: nanoGPT's two parameter groups)",
            choices=("all", "matrices"),
        ),
        "betas": Field("floats2", [0.9, 0.999], "Adam coefficients of the running averages", min=0, lt=1),
        "eps": Field("float", 1e-8, "Adam denominator epsilon", min=0),
    },
    "schedule": {
        "name": Field("str", "none", "Learning-rate schedule", choices=("none", "step", "multistep", "cosine")),
        "warmup_steps": Field("int", 0, "Linear warmup steps before the schedule starts", min=0),
        "step_size": Field("int", 1000, "Steps between learning-rate decays (step)", min=1),
        "milestones": Field(
            "ints",
            [],
            "Training steps at which the learning rate is multiplied by gamma (multistep; counted from step 0, "
            "warmup included, as PyTorch's MultiStepLR stepped once per step)",
            min=1,
        ),
        "gamma": Field("float", 0.1, "Decay factor per step_size steps (step) or at each milestone (multistep)", min=0),
        "min_lr": Field("float", 0.0, "Final learning rate (cosine)", min=0),
    },
    "sample": {
        "tokens": Field(
            "int",
            0,
            "Tokens a language model writes after training, printed with the summary (0: none)",
            min=0,
            resumable=True,
        ),
        "prompt": Field(
            "str", "", "Text the sample continues (empty: the validation text's first token)", resumable=True
        ),
        "temperature": Field("float", 1.0, "Sampling temperature (logits are divided by it)", gt=0, resumable=True),
        "top_k": Field(
            "int?", None, "Sample among the k most likely tokens only (1: greedy); null: all", min=1, resumable=True
        ),
    },
    "train": {
        "epochs": Field("int", 1, "Training epochs", min=1, resumable=True),
        "max_steps": Field("int?", None, "Stop after this many steps if set (overrides epochs)", min=1, resumable=True),
        "eval_every": Field("int", 100, "Steps between evaluations", min=1, resumable=True),
        "log_every": Field("int", 10, "Steps between logged training metrics", min=1, resumable=True),
        "grad_clip": Field("float", 0.0, "Maximum global gradient norm; 0 = no clipping", min=0),
        "accumulate": Field(
            "int",
            1,
            "Micro-batches of data.batch_size per optimizer step (gradient accumulation): the gradients of "
            "k batches are summed, each batch's loss weighted by its share of the step's samples, and "
            "averaged across processes once per step; the step equals one on a k times larger batch up to "
            "the order of the sums (BatchNorm's statistics stay per micro-batch); the steps, and so "
            "max_steps, log_every, eval_every and checkpoint.every, count optimizer steps; the run name gets `_acc<k>`",
            min=1,
        ),
    },
    "logging": {
        "logdir": Field("str", "runs", "Root folder of TensorBoard logs", resumable=True),
        "run_name": Field(
            "str?",
            None,
            "Run folder name; null = derived from the inplace policy, the number of "
            "processes and whether the model uses InPlace-ABN (`inplace-on_np1_inplace_abn`)",
            resumable=True,
        ),
        "progress": Field(
            "bool",
            True,
            "Show progress on rank 0: a tqdm bar on a terminal, else a line every few seconds",
            resumable=True,
        ),
        "timeline": Field("bool", True, "Log a memory-timeline figure of one training step", resumable=True),
    },
    "checkpoint": {
        "dir": Field("str", "checkpoints", "Folder of checkpoints", resumable=True),
        "every": Field("int", 0, "Steps between checkpoints; 0 = only at the end", min=0, resumable=True),
        "keep": Field("int", 2, "Number of most recent checkpoints kept", min=1, resumable=True),
        "resume": Field(
            "str|bool",
            False,
            "`false`, `auto` (latest in checkpoint.dir; `true` means the same) or a checkpoint path",
            from_bool={True: "auto"},
            resumable=True,
        ),
    },
    "distributed": {
        "bucket_mb": Field("float", 25.0, "Gradient allreduce bucket size in MiB", gt=0, resumable=True),
        "backend": Field(
            "str",
            "auto",
            "How gradients travel between processes: `nccl` (GPU buffers over NCCL, "
            "one GPU per process), `mpi` (MPI; GPU buffers staged through host memory) or `auto` "
            "(NCCL for a GPU run when CuPy can load it, else MPI)",
            choices=("auto", "mpi", "nccl"),
            resumable=True,
        ),
        "sync_bn": Field(
            "bool",
            False,
            "With several processes, replace BatchNorm layers by SyncBatchNorm (statistics over all ranks' samples)",
        ),
        "zero": Field(
            "int",
            0,
            "ZeRO (docs/ZERO.md): `0` every process holds all parameters, gradients and optimizer state; `1` "
            "each holds 1/N of the optimizer state (and updates 1/N of the parameters, then all-gathers them); "
            "`2` also only 1/N of the gradients (each bucket reduce-scattered). Needs mpiexec with 2 or more "
            "processes; `1` needs an optimizer with state (adam, adamw, sgd with momentum); not with compile; "
            "the run name gets `_zero<stage>`",
            choices=(0, 1, 2),
        ),
    },
}
# fmt: on

# The only dict-typed value whose content the schema does not know.
_FREE_FORM = "dict"


# --------------------------------------------------------------------------- types


def _is_number(v: Any) -> bool:
    # bool is an int subclass; "true" for a learning rate is always a mistake.
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_str(v):
    return v if isinstance(v, str) else _BAD


def _check_int(v):
    return v if isinstance(v, int) and not isinstance(v, bool) else _BAD


def _check_float(v):
    return float(v) if _is_number(v) else _BAD


def _check_bool(v):
    return v if isinstance(v, bool) else _BAD


def _check_dict(v):
    if isinstance(v, Mapping) and all(isinstance(k, str) for k in v):
        return copy.deepcopy(dict(v))
    return _BAD


def _check_floats2(v):
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_number(x) for x in v):
        return [float(x) for x in v]
    return _BAD


def _check_ints(v):
    # Increasing, as milestones are: an unsorted list is a typo, not a schedule.
    if isinstance(v, (list, tuple)) and all(_check_int(x) is not _BAD for x in v):
        if all(a < b for a, b in zip(v, v[1:])):
            return [int(x) for x in v]
    return _BAD


def _check_str_or_bool(v):
    return v if isinstance(v, (str, bool)) else _BAD


_BAD = object()

# type name -> (checker returning the normalized value or _BAD, phrase for messages, name in the docs)
_TYPES: dict[str, tuple[Any, str, str]] = {
    "str": (_check_str, "a string", "str"),
    "int": (_check_int, "an int", "int"),
    "float": (_check_float, "a float", "float"),
    "bool": (_check_bool, "a bool (true or false)", "bool"),
    "dict": (_check_dict, "a mapping with string keys", "dict"),
    "floats2": (_check_floats2, "a list of 2 floats", "list of 2 floats"),
    "ints": (_check_ints, "a list of increasing ints (e.g. [32000, 48000])", "list of increasing ints"),
    "int?": (_check_int, "an int or null", "int or null"),
    "str?": (_check_str, "a string or null", "str or null"),
    "str|bool": (_check_str_or_bool, "a string or false", "str or bool"),
}


# --------------------------------------------------------------------------- YAML


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-3`` as a float and rejects duplicate keys.

    PyYAML follows YAML 1.1, where a float needs a dot (``1e-3`` is a string); everyone
    writes learning rates that way, so we use the YAML 1.2 float rule.
    """

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}' (remove one of them)", key_node.start_mark
                )
            seen.add(key if isinstance(key, str) else id(key_node))
        return super().construct_mapping(node, deep=deep)


_FLOAT_TAG = "tag:yaml.org,2002:float"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _FLOAT_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    _FLOAT_TAG,
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)


def _yaml_error(exc: yaml.YAMLError, where: str) -> ConfigError:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return ConfigError(f"YAML syntax error in {where}{at}: {problem}; fix the YAML there")


# --------------------------------------------------------------------------- schema walk


def _flatten_schema(node: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Field]]:
    for key, sub in node.items():
        if isinstance(sub, Field):
            yield prefix + key, sub
        else:
            yield from _flatten_schema(sub, prefix + key + ".")


def schema_keys() -> list[str]:
    """Returns every dotted key of the schema, in schema order (``["experiment", ..., "optim.lr", ...]``)."""
    return [key for key, _ in _flatten_schema(SCHEMA)]


def resumable_keys() -> list[str]:
    """The dotted keys that may change when a run is resumed (``Field.resumable``), in schema order."""
    return [key for key, field in _flatten_schema(SCHEMA) if field.resumable]


def _suggest(key: str, siblings: Sequence[str], prefix: str) -> str:
    """Builds the "; did you mean ...?" / "; valid keys: ..." tail for an unknown key."""
    close = difflib.get_close_matches(key, list(siblings), n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{prefix}{close[0]}'?"
    # A key in the wrong section ("lr" at top level, "train.lr") is best found by its leaf name.
    dotted = schema_keys() + list(_section_keys(SCHEMA))
    leaf = {d: d.rsplit(".", 1)[-1] for d in dotted}
    exact = [d for d, name in leaf.items() if name == key]
    close = exact or [d for d in dotted if difflib.get_close_matches(key, [leaf[d]], cutoff=0.75)]
    close = close or difflib.get_close_matches(prefix + key, dotted, n=3, cutoff=0.6)
    if close:
        return "; did you mean " + " or ".join(f"'{d}'" for d in close[:3]) + "?"
    return "; valid keys: " + ", ".join(siblings)


def _section_keys(node: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    for key, sub in node.items():
        if not isinstance(sub, Field):
            yield prefix + key
            yield from _section_keys(sub, prefix + key + ".")


def _where(source: str | None) -> str:
    return f" in {source}" if source else ""


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


_UNSET = object()


def _coerce(field: Field, value: Any, key: str, source: str | None, in_use: Any = _UNSET) -> Any:
    """Validates one value against its field; returns the normalized value.

    ``in_use`` is the value the config files give the key (for an override), named in the
    message instead of the schema's default.
    """
    if field.from_bool is not None and isinstance(value, bool) and value in field.from_bool:
        value = field.from_bool[value]
    if value is None and field.type.endswith("?"):
        return None
    check, phrase, _ = _TYPES[field.type]
    out = check(value)
    if out is _BAD:
        hint = f"; the default is {_fmt_default(field.default)}"
        if in_use is not _UNSET:
            hint = f"; the config in use has {_fmt_default(in_use)}"
        if field.type in ("str", "str?") and isinstance(value, bool):
            hint = "; YAML reads bare on/off/yes/no/true/false as booleans, so quote the string"
        elif field.type in ("str", "str?") and _is_number(value):
            hint = f"; quote it to make it a string ('{value}')"
        elif field.type == "str|bool" and value is True:
            hint = ""
        raise ConfigError(f"{key} must be {phrase}, got {_show(value)}{_where(source)}{hint}")
    if field.choices is not None and out not in field.choices:
        choices = ", ".join(map(str, field.choices))
        close = difflib.get_close_matches(str(out), list(map(str, field.choices)), n=1)
        tail = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"{key} must be one of {choices}, got {_show(out)}{_where(source)}{tail}")
    if field.parse is not None and isinstance(out, str):
        try:
            field.parse(out)
        except ValueError:
            raise ConfigError(f"{key} must be {field.parse_doc}, got {out!r}{_where(source)}") from None
    numbers = out if isinstance(out, list) else [out]
    for x in numbers:
        if not _is_number(x):
            continue
        if (
            (field.min is not None and x < field.min)
            or (field.gt is not None and x <= field.gt)
            or (field.lt is not None and x >= field.lt)
        ):
            what = f"every element of {key}" if isinstance(out, list) else key
            raise ConfigError(f"{what} must be {_bounds_text(field)}, got {x!r}{_where(source)}")
    return out


def _check_tree(
    raw: Any, node: Mapping[str, Any], source: str | None, prefix: str = "", in_use: Mapping | None = None
) -> dict:
    """Validates a (partial) raw config against a schema section; returns it normalized.

    Missing keys stay missing (defaults are filled after merging), so this runs on each
    file and each override alone and its errors can name where the value came from.
    ``in_use`` is the files' tree an override goes over: its errors name the value it has.
    """
    if not isinstance(raw, Mapping):
        name = prefix[:-1] or "the top level"
        example = next(iter(node))
        raise ConfigError(
            f"{name} must be a mapping of keys (e.g. {prefix}{example}: ...), got {_show(raw)}{_where(source)}"
        )
    out: dict[str, Any] = {}
    for key, value in raw.items():
        key_s = str(key)
        if key_s not in node:
            raise ConfigError(f"unknown key '{prefix}{key_s}'{_where(source)}{_suggest(key_s, list(node), prefix)}")
        sub = node[key_s]
        current = in_use.get(key_s, _UNSET) if isinstance(in_use, Mapping) else _UNSET
        if isinstance(sub, Field):
            out[key_s] = _coerce(sub, value, prefix + key_s, source, current)
        else:
            if not isinstance(value, Mapping):
                raise ConfigError(
                    f"{prefix}{key_s} is a section, so it must be a mapping of keys "
                    f"(e.g. {prefix}{key_s}.{next(iter(sub))}), got {_show(value)}{_where(source)}"
                )
            out[key_s] = _check_tree(
                value, sub, source, prefix + key_s + ".", current if current is not _UNSET else None
            )
    return out


def _merge(base: dict, child: Mapping) -> dict:
    """Deep-merges ``child`` over ``base``: mappings merge key by key, anything else replaces."""
    out = dict(base)
    for key, value in child.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _merge_config(base: dict, child: Mapping) -> dict:
    """Deep-merges a config tree over its base, as :func:`_merge`, except for ``model.args``.

    The arguments belong to the model they were written for: when ``child`` names a
    different ``model.name`` than ``base`` (or the default), its own ``model.args`` (or
    none) replace the base's instead of merging with them, as Hydra's config groups and
    detectron2's ``_BASE_`` users expect when they swap the model.
    """
    merged = _merge(base, child)
    child_model = child.get("model", {})
    base_name = base.get("model", {}).get("name", SCHEMA["model"]["name"].default)
    if "name" in child_model and child_model["name"] != base_name:
        merged["model"]["args"] = copy.deepcopy(child_model.get("args", {}))
    return merged


def _fill_defaults(tree: Mapping[str, Any], node: Mapping[str, Any]) -> dict:
    out = {}
    for key, sub in node.items():
        if isinstance(sub, Field):
            out[key] = copy.deepcopy(tree[key]) if key in tree else copy.deepcopy(sub.default)
        else:
            out[key] = _fill_defaults(tree.get(key, {}), sub)
    return out


# --------------------------------------------------------------------------- Config


class Config:
    """A validated run configuration with attribute access (``cfg.optim.lr``).

    Sections are ``Config`` objects, values are plain Python values (``cfg.model.args``
    is a dict). Build one with ``load_config`` or ``config_from_dict``; it is read-only
    so that what was logged is what ran (change values through overrides instead).
    """

    __slots__ = ("_data", "_prefix")

    def __init__(self, data: Mapping[str, Any], _prefix: str = ""):
        """Wraps an already validated, complete tree; use ``config_from_dict`` to validate."""
        node = _schema_node(_prefix)
        wrapped = {
            k: Config(v, f"{_prefix}{k}.") if not isinstance(node.get(k), Field) and isinstance(v, Mapping) else v
            for k, v in data.items()
        }
        object.__setattr__(self, "_data", wrapped)
        object.__setattr__(self, "_prefix", _prefix)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # keeps copy/pickle from recursing before _data exists
            raise AttributeError(name)
        try:
            return self._data[name]
        except KeyError:
            tail = _suggest(name, list(self._data), self._prefix)
            raise AttributeError(f"config has no key '{self._prefix}{name}'{tail}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"Config is read-only (tried to set '{self._prefix}{name}'); "
            "use an override like --set key=value or config_from_dict()"
        )

    def __getitem__(self, dotted: str) -> Any:
        """Returns a value or section by dotted key: ``cfg["optim.lr"]``."""
        value: Any = self
        for part in dotted.split("."):
            if not isinstance(value, Config) or part not in value._data:
                raise KeyError(f"config has no key '{self._prefix}{dotted}'")
            value = value._data[part]
        return value

    def __contains__(self, key: str) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Config):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable dict values inside

    def __repr__(self) -> str:
        return f"Config({self.to_dict()!r})"

    def __reduce__(self):
        return (Config, (self.to_dict(), self._prefix))

    def to_dict(self) -> dict[str, Any]:
        """Returns plain nested dicts (a deep copy), fit for ``yaml.safe_dump`` and JSON."""
        return {k: v.to_dict() if isinstance(v, Config) else copy.deepcopy(v) for k, v in self._data.items()}

    def to_yaml(self) -> str:
        """Returns the config as YAML, in schema order; ``load_config`` reads it back unchanged."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)


def _schema_node(prefix: str) -> Mapping[str, Any]:
    node: Any = SCHEMA
    for part in filter(None, prefix.split(".")):
        node = node[part]
    return node


# --------------------------------------------------------------------------- loading


def config_from_dict(data: Mapping[str, Any], source: str | None = None) -> Config:
    """Validates a (possibly partial) config dict, fills defaults and returns a ``Config``.

    Args:
        data: Nested dicts, e.g. ``Config.to_dict()`` saved in a checkpoint.
        source: Where the dict came from, named in error messages.

    Raises:
        ConfigError: On an unknown key, a wrong type or a value out of range.
    """
    return Config(_fill_defaults(_check_tree(data, SCHEMA, source), SCHEMA))


def load_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> Config:
    """Reads a YAML config (following ``base:`` files), applies overrides, validates.

    Args:
        path: The YAML file. It may name ``base: other.yaml`` (relative to itself); the
            file is deep-merged over its base (mappings merge, lists replace; ``model.args``
            is replaced when the file names another ``model.name``, see :func:`_merge_config`).
        overrides: ``"dotted.key=value"`` strings; values are parsed as YAML
            (``true``, ``1e-3``, ``[64, 64]``, ``null``). They are merged together, then
            over the file, by the same rule (so their order does not matter).

    Returns:
        The complete, validated ``Config``.

    Raises:
        ConfigError: With a one-line message naming the key and the file or override.
    """
    tree = _load_file(os.fspath(path), chain=())
    override_tree: dict = {}
    for text in overrides:
        override_tree = _merge(override_tree, _parse_override(text, tree))
    return Config(_fill_defaults(_merge_config(tree, override_tree), SCHEMA))


def _load_file(path: str, chain: tuple[tuple[str, str], ...], named_by: str | None = None) -> dict:
    """Loads one file and its bases; ``chain`` holds (realpath, shown path) of the includers."""
    real = os.path.realpath(path)
    if any(real == r for r, _ in chain):
        cycle = " -> ".join([shown for _, shown in chain] + [path])
        raise ConfigError(f"config base cycle: {cycle}; remove one of these 'base:' entries")
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        by = f" (named by 'base:' in {named_by})" if named_by else ""
        raise ConfigError(f"config file not found: {path}{by}; check the path") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        raw = _parse_yaml(text)
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, path) from None
    if raw is None:  # empty, or only comments: almost always the wrong file, never a useful run
        by = f" (named by 'base:' in {named_by})" if named_by else ""
        raise ConfigError(
            f"config file {path}{by} is empty; give it at least one key, or start from one of configs/*.yaml"
        )
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"the top level of {path} must be a mapping of keys (e.g. 'optim: {{lr: 0.1}}'), got {type(raw).__name__}"
        )
    raw = dict(raw)
    base = raw.pop("base", None)
    tree = _check_tree(raw, SCHEMA, path)
    _resolve_paths(tree, path)
    if base is None:
        return tree
    if not isinstance(base, str) or not base:
        raise ConfigError(f"base in {path} must be a path to another YAML file, got {_show(base)}")
    base_path = os.path.normpath(os.path.join(os.path.dirname(path), os.path.expanduser(base)))
    parent = _load_file(base_path, chain + ((real, path),), named_by=path)
    return _merge_config(parent, tree)


# Keys that name a file or folder: a relative path in a config file is relative to that
# file's folder (as ``base:`` is), so a config runs from any directory; one given with --set
# stays as given (relative to the current directory).
_PATH_KEYS = (("data", "path"), ("data", "root"), ("data", "test_root"))


def _resolve_paths(tree: dict, path: str) -> None:
    for section, key in _PATH_KEYS:
        value = tree.get(section, {}).get(key)
        if isinstance(value, str) and value and not os.path.isabs(os.path.expanduser(value)):
            tree[section][key] = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), value))


def _parse_override(text: str, in_use: Mapping | None = None) -> dict:
    """Turns ``"a.b=value"`` into a validated partial tree ``{"a": {"b": value}}``.

    ``in_use``: the config files' tree, whose value of the key an error names.
    """
    where = f"override '{text}'"
    key, sep, value_text = text.partition("=")
    key = key.strip()
    if not sep:
        raise ConfigError(f"bad override '{text}': expected KEY=VALUE, e.g. optim.lr=0.05")
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(f"bad {where}: the key must be dotted names, e.g. optim.lr=0.05")
    try:
        value = _parse_yaml(value_text)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"bad value in {where}: {problem}; quote it or fix the YAML syntax") from None
    node: Any = SCHEMA
    for i, part in enumerate(parts[:-1]):
        node = node.get(part) if isinstance(node, Mapping) else None
        if isinstance(node, Field) and node.type != _FREE_FORM:
            dotted = ".".join(parts[: i + 1])
            raise ConfigError(f"bad {where}: {dotted} is a value, not a section; use {dotted}=VALUE")
    nested: Any = value
    for part in reversed(parts):
        nested = {part: nested}
    return _check_tree(nested, SCHEMA, where, in_use=in_use)


# --------------------------------------------------------------------------- reference


def _fmt_default(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        return repr(value)  # 1e-08, not YAML's 1.0e-08
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def _bounds_text(field: Field) -> str:
    parts = []
    if field.min is not None:
        parts.append(f">= {field.min:g}")
    if field.gt is not None:
        parts.append(f"> {field.gt:g}")
    if field.lt is not None:
        parts.append(f"< {field.lt:g}")
    return " and ".join(parts)


def reference_markdown() -> str:
    """Returns a Markdown table of every config key (key, type, default, description).

    docs/CONFIG.md's config reference is this output, so it cannot drift from the schema.
    """
    lines = ["| Key | Type | Default | Description |", "| --- | --- | --- | --- |"]
    for key, field in _flatten_schema(SCHEMA):
        doc = field.doc.rstrip(".")
        if field.choices:
            doc += ". One of: " + ", ".join(f"`{c}`" for c in field.choices)
        if field.parse_doc:
            doc += f". Must be {field.parse_doc}"
        if _bounds_text(field):
            doc += f". Must be {_bounds_text(field)}"
        if field.resumable:
            doc += ". May change on `--resume`"
        doc = doc.replace("|", "\\|")
        lines.append(f"| `{key}` | {_TYPES[field.type][2]} | `{_fmt_default(field.default)}` | {doc}. |")
    return "\n".join(lines) + "\n"


def _main(argv: Sequence[str]) -> int:
    """``python -m trainers.config`` prints the reference; with a file (and KEY=VALUE) the resolved config."""
    if not argv:
        sys.stdout.write(reference_markdown())
        return 0
    try:
        sys.stdout.write(load_config(argv[0], argv[1:]).to_yaml())
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
