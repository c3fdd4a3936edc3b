#!/usr/bin/env python
"""Rewrites docs/CONFIG.md's config reference from the schema (``--check`` only compares)."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from trainers.config import reference_markdown  # noqa: E402

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def render(doc: str) -> str:
    head, rest = doc.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{reference_markdown().rstrip()}\n{END}{tail}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = os.path.join(ROOT, "docs", "CONFIG.md")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    new = render(text)
    if "--check" in argv:
        if new != text:
            print(
                "docs/CONFIG.md's config reference is out of date: run python scripts/gen_config_reference.py",
                file=sys.stderr,
            )
            return 1
        return 0
    with open(path, "w", encoding="utf-8") as f:
        f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
