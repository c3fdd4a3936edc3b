"""The registry: :func:`register_model`, :func:`build_model` and the checks on a model's
arguments (the model modules import it; :mod:`models` imports them)."""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Callable

_REGISTRY: dict[str, Callable] = {}


def _key(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def register_model(name: str):
    """Decorator: registers a model class or factory under ``name`` (case-insensitive).

    Returns the decorated object unchanged. Registering a name twice raises
    ``ValueError`` (two models silently sharing a name is a bug).
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model name must be a non-empty string, got {name!r}")
    key = _key(name)

    def decorate(builder: Callable) -> Callable:
        existing = _REGISTRY.get(key)
        if existing is not None and existing is not builder:
            raise ValueError(f"model {key!r} is already registered (by {_qualname(existing)})")
        _REGISTRY[key] = builder
        return builder

    return decorate


def available_models() -> list[str]:
    """The registered model names, sorted (numbers in names numerically: resnet8 < resnet14)."""
    return sorted(_REGISTRY, key=lambda n: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", n)])


def model_signature(name: str) -> inspect.Signature:
    """The constructor signature of model ``name`` (its keyword arguments and defaults)."""
    return inspect.signature(_lookup(name))


def build_model(name, **kwargs):
    """Builds the registered model ``name`` with constructor keyword arguments ``kwargs``.

    ``name`` may also be a config section with ``.name`` and ``.args`` (``cfg.model``).

    Raises:
        ValueError: unknown model name, or a keyword the model's constructor does not take
            (with a did-you-mean and the valid keywords).
    """
    if not isinstance(name, str) and hasattr(name, "name"):
        section = name
        name = section.name
        kwargs = {**dict(getattr(section, "args", None) or {}), **kwargs}
    if not isinstance(name, str):
        raise ValueError(f"model name must be a string, got {type(name).__name__} {name!r}")
    builder = _lookup(name)
    _check_kwargs(_key(name), builder, kwargs)
    return builder(**kwargs)


def _lookup(name: str) -> Callable:
    builder = _REGISTRY.get(_key(name))
    if builder is not None:
        return builder
    names = available_models()
    close = difflib.get_close_matches(_key(name), names, n=3, cutoff=0.5)
    hint = f" Did you mean {_quoted_or(close)}?" if close else ""
    raise ValueError(f"unknown model {name!r}.{hint} Available models: {', '.join(names)}.")


def _check_kwargs(name: str, builder: Callable, kwargs: dict) -> None:
    params = inspect.signature(builder).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return  # the builder takes anything: it checks its own keywords
    valid = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    bad = [k for k in kwargs if k not in valid]
    if not bad:
        return
    parts = []
    for k in bad:
        close = difflib.get_close_matches(str(k), valid, n=1, cutoff=0.5)
        parts.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    noun = "argument" if len(bad) == 1 else "arguments"
    raise ValueError(
        f"model {name!r} got unknown {noun} {', '.join(parts)}. "
        f"Valid arguments: {', '.join(valid) if valid else '(none)'}."
    )


def _quoted_or(names: list[str]) -> str:
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


def _qualname(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
