"""``cupy.cuda.compiler`` of the stand-in: the exception NVRTC's errors come as.

The stand-in compiles nothing; it raises :class:`CompileException` where real CuPy would
hand NVRTC a source that cannot compile (see ``cupy_standin/_kernels.py``).
"""

from __future__ import annotations


class CompileException(Exception):
    """``cupy.cuda.compiler.CompileException``: NVRTC's log, the source, the kernel's name."""

    def __init__(self, msg, source, name, options, backend="nvrtc"):
        super().__init__(msg)
        self._msg, self.source, self.name, self.options, self.backend = msg, source, name, options, backend

    def get_message(self) -> str:
        return self._msg
