"""Where the user's code called into the framework: the ``(file, line)`` errors name."""

from __future__ import annotations

import os
import sys

_FRAMEWORK_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def call_site(depth: int = 1) -> tuple:
    """``(file, line)`` of the first frame outside the framework (the user's call),
    searching from ``depth`` frames above this function."""
    f = sys._getframe(depth)
    while f is not None and f.f_code.co_filename.startswith(_FRAMEWORK_DIR):
        f = f.f_back
    return (f.f_code.co_filename, f.f_lineno) if f is not None else ("<unknown>", 0)


def frame_site(frame) -> tuple:
    """``(file, line)`` of ``frame``."""
    return (frame.f_code.co_filename, frame.f_lineno)
