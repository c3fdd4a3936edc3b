"""Compiled training steps: capture a step as a program, plan it, replay it.

``fw.compile(step)`` records one eager run of ``step`` (forward, backward, optimizer) into
a :class:`Program`, runs the passes over it (alias classes and inplace chains, re-inplace,
dead-code elimination, the memory plan) and replays it at later calls, bitwise equal to
the same step run eagerly under policy ``off``. See docs/COMPILE.md.
"""

from .api import CompiledStep, compile, discover
from .capture import CaptureError
from .program import Node, Program, Value

__all__ = ["compile", "CompiledStep", "CaptureError", "Program", "Node", "Value", "discover"]
