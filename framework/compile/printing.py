"""``print(program)``: one node a line, like an FX graph.

::

    %0: f32[32, 64] = args[0]
    %3: f32[32, 256] = Matmul(%0, %2)                         # models/mlp.py:77
    %4: f32[32, 256] = add_(%3, %1)                           # write %3
    %10: f32[32, 64], %11: f32[64, 256] = MmBackward0(%8; x=%0, y=%2)
    return %7
    layers.1.weight <- %31 (bound)
"""

from __future__ import annotations

import os

from .refs import Ref, ScalarRef, StatsOut
from .scalars import format_entry, format_guard


def _t(template) -> str:
    if isinstance(template, (Ref, ScalarRef, StatsOut)):
        return repr(template)
    if isinstance(template, tuple):
        return "(" + ", ".join(_t(t) for t in template) + ("," if len(template) == 1 else "") + ")"
    if isinstance(template, list):
        return "[" + ", ".join(_t(t) for t in template) + "]"
    if isinstance(template, dict):
        return "{" + ", ".join(f"{k!r}: {_t(v)}" for k, v in template.items()) + "}"
    if isinstance(template, float):
        return repr(template)
    r = repr(template)
    return r if len(r) <= 40 else r[:37] + "..."


def _site(site) -> str:
    file, line = site
    if not line:
        return ""
    try:
        file = os.path.relpath(file)
    except ValueError:
        pass
    return f"{file}:{line}"


def _vals(program, vids, passed=None) -> str:
    parts = []
    for vid in vids:
        if vid is None:
            parts.append("None")
            continue
        if vid == passed:
            parts.append(f"%{vid} (passed on)")  # a gradient the backward hands on unchanged
            continue
        v = program.values[vid]
        parts.append(f"%{vid}: {v.describe()}")
    return ", ".join(parts)


def format_node(program, n) -> str:
    if n.kind == "call":
        args = [_t(t) for t in n.inputs] + [f"{k}={_t(v)}" for k, v in n.params.items()]
        body = f"{n.name}({', '.join(args)})"
    elif n.kind == "backward":
        saved = program.nodes[n.info["fwd"]].info.get("saved", {})
        extra = "; " + ", ".join(f"{k}=%{v}" for k, v in saved.items()) if saved else ""
        body = f"{n.name}(%{n.info['grad']}{extra})"
    elif n.kind == "create":
        body = f"{n.name}({n.info['shape']}, {n.info['dtype']})"
    elif n.kind == "fill":
        body = f"fill({n.info['fill_value']})"
    else:
        body = f"{n.name}({', '.join(_t(t) for t in n.inputs)})"
    notes = []
    if "recomputes" in n.info:
        notes.append(f"recomputes %{n.info['recomputes']}")
    if n.reinplaced:
        notes.append("re-inplaced")
    if n.info.get("elided"):
        notes.append("copy elided")
    if n.info.get("lowered"):
        notes.append("direct kernel")
    site = _site(n.site)
    if site:
        notes.append(site)
    outs = _vals(program, n.outputs, n.info.get("grad"))
    line = f"{outs} = {body}" if outs else body  # a check makes nothing
    return f"{line:<72}  # {', '.join(notes)}" if notes else line


def format_program(program) -> str:
    lines = [f"Program {program.name}: {len(program.nodes)} nodes, {len(program.values)} values"]
    for vid in program.inputs:
        v = program.values[vid]
        lines.append(f"  %{vid}: {v.describe()} = {v.source.name}")
    for i, e in enumerate(program.scalars):
        lines.append("  " + format_entry(i, e))
    for n in program.nodes:
        lines.append("  " + format_node(program, n))
    lines.append(f"  return {_t(program.outputs)}")
    for wb in program.writebacks:
        what = f"${wb.value}" if wb.how == "scalar" else (repr(wb.value) if wb.how == "const" else f"%{wb.value}")
        lines.append(f"  {wb.source.name} <- {what} ({wb.how})")
    for g in getattr(program, "guards", ()):
        lines.append("  guard " + format_guard(g))
    return "\n".join(lines)
