"""Runs a script (``scripts/train.py``, ``scripts/compare_inplace.py``) that sends a signal to itself at a given step.

    STOP_SIGNAL=SIGTERM STOP_AT=7 [STOP_RANK=1] [STOP_RUN=inplace-on_np1] [STOP_READY=path] \\
        python tests/stop_driver.py scripts/train.py --config ...

During step ``STOP_AT`` (1-based) of the run named ``STOP_RUN`` (any run when unset), on
rank ``STOP_RANK`` (0 when unset), the process sends itself ``STOP_SIGNAL``: a real signal
to a real handler, at a step the test chose, so that the test knows where the run must
stop. ``STOP_AT`` is 2 or more: compare_inplace.py's throughput rounds run at step 0
or at the end. With ``STOP_READY`` instead of a signal, it writes that file then (the
test then signals the launcher from outside). Everything else is the script as a user
runs it.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainers.trainer import Trainer  # noqa: E402

_AT = int(os.environ["STOP_AT"])
_RANK = int(os.environ.get("STOP_RANK", "0"))
_RUN = os.environ.get("STOP_RUN")
_train_step = Trainer._train_step
_done = []


def _step_then_signal(self, x, y, lr):
    out = _train_step(self, x, y, lr)
    here = self.step + 1 == _AT and self.comm.rank == _RANK and _RUN in (None, self.run_name)
    if here and not _done:  # once (the throughput rounds of compare_inplace.py stay at their step)
        _done.append(True)
        if "STOP_READY" in os.environ:
            with open(os.environ["STOP_READY"], "w") as f:
                f.write(str(_AT))
        else:
            os.kill(os.getpid(), getattr(signal, os.environ["STOP_SIGNAL"]))
    return out


Trainer._train_step = _step_then_signal

if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
