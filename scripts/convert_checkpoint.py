#!/usr/bin/env python
"""Convert a pickle checkpoint of an earlier version into the current ``.npz`` format.

    python scripts/convert_checkpoint.py --trust-pickle checkpoints/quickstart/inplace-on_np1/step_00004000.ckpt

Unpickling runs whatever code the file names, so this is the one place that unpickles,
and only with ``--trust-pickle``: use it on checkpoints you wrote yourself, never on
files from elsewhere. The converted checkpoint is written next to the old one as
``step_<N>.npz`` (or to ``--out``), where ``--resume`` finds it; the old file is kept.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainers.checkpoint import checkpoint_path, write_checkpoint  # noqa: E402

EXIT_BAD_INPUT = 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="the old pickle checkpoint (step_<N>.ckpt)")
    p.add_argument(
        "--trust-pickle", action="store_true", help="I wrote this file or trust who did: unpickling it may run code"
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="PATH",
        help="where to write the .npz (default: step_<N>.npz next to the old file)",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        print(convert(args.checkpoint, args.out, trust_pickle=args.trust_pickle))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


def convert(path: str, out: str | None = None, *, trust_pickle: bool = False) -> str:
    """Unpickles ``path`` (only with ``trust_pickle``) and writes it as a ``.npz`` checkpoint.

    Returns:
        The path written.

    Raises:
        ValueError: no ``trust_pickle``, a missing file, or a file that is not an old
            checkpoint (one line each).
    """

    if not trust_pickle:
        raise ValueError(
            f"converting {path} unpickles it, and unpickling can run any code the file "
            "names; pass --trust-pickle if you wrote it or trust who did"
        )
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {path!r} does not exist")
    import pickle  # noqa: PLC0415  (only here, and only for a file the user vouched for)

    try:
        with open(path, "rb") as f:
            state = pickle.load(f)  # noqa: S301
    except Exception as e:  # noqa: BLE001  (any failure of a foreign file is one line)
        raise ValueError(f"{path!r} cannot be unpickled ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise ValueError(f"{path!r} is not a checkpoint of this project (no step)")
    out = out or checkpoint_path(os.path.dirname(os.path.abspath(path)), state["step"])
    try:
        return write_checkpoint(state, out)
    except TypeError as e:
        raise ValueError(f"{path!r} holds a value the new format cannot store: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
