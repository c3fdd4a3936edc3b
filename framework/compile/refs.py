"""What node templates refer to: values (:class:`Ref`), traced scalars (:class:`ScalarRef`)
and side outputs (:class:`StatsOut`). Their own module so that :mod:`.printing` can read
templates without importing :mod:`.program`, which prints through it."""

from __future__ import annotations


class Ref:
    """A reference to a value inside a node template."""

    __slots__ = ("id",)

    def __init__(self, vid: int):
        self.id = vid

    def __repr__(self):
        return f"%{self.id}"


class ScalarRef:
    """A reference to a traced scalar (slot of ``Program.scalars``) inside a template."""

    __slots__ = ("slot",)

    def __init__(self, slot: int):
        self.slot = slot

    def __repr__(self):
        return f"$s{self.slot}"


class StatsOut:
    """A dict attribute that forward fills with side outputs (BatchNorm's ``stats``)."""

    __slots__ = ("values",)

    def __init__(self, values: dict):
        self.values = values  # key -> value id (arrays); other keys are left to forward

    def __repr__(self):
        return "{" + ", ".join(f"{k}: %{v}" for k, v in self.values.items()) + "}"
