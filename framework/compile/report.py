"""``compiled.report()`` and ``compiled.explain()``: what the passes did and the memory plan.

The plan figure follows the classic memory-planner drawings: one box per arena buffer,
its lifetime (first definition to last use, in node indices) on x and its offset in the
arena on y; buffers the kernels allocate themselves are drawn above the arena, hatched,
packed as if freed memory were reused perfectly.
"""

from __future__ import annotations

import sys

from .alias import inplace_chains, unbound_inputs
from .plan import greedy_by_size
from .printing import _site
from .recompute import seconds

MB = 1024 * 1024


def make_report(compiled, entry) -> dict:
    program, plan = entry.program, entry.plan
    classes = plan.classes
    kernel_owned = []
    for c, p in plan.placement.items():
        if p == "kernel":
            kernel_owned.append(
                {"value": f"%{c}", "bytes": plan.nbytes[c], "interval": plan.intervals[c], "why": plan.why.get(c, "")}
            )
    return {
        "eager_peak_bytes": entry.eager_peak_bytes,
        "planned_peak_bytes": plan.planned_peak_bytes,
        "lower_bound_bytes": plan.lower_bound_bytes,
        "floor_bytes": plan.floor_bytes,
        "saved_bytes": plan.saved_bytes,
        **_recompute(entry),
        "arena_bytes": plan.arena_bytes,
        "persistent_bytes": plan.persistent_bytes,
        "replay_peak_bytes": getattr(entry, "replay_peak_bytes", None),
        "inplace_chains": inplace_chains(program, classes),
        "reinplaced_ops": list(entry.report["reinplaced_ops"]),
        "removed_ops": list(entry.report["removed_ops"]),
        "copies_avoided_bytes": entry.report["copies_avoided_bytes"],
        "copies_elided": entry.report["copies_elided"],
        "unbound_writebacks": [wb.source.name for wb in unbound_inputs(program)],
        "kernel_owned": kernel_owned,
        # an inplace op whose own kernel returned another array is copied back (as eager does)
        "replay_copy_bytes": entry.executor.replay_copy_bytes if entry.executor is not None else 0,
        "nodes": len(program.nodes),
        "direct_kernels": sum(
            1 for n in program.nodes if n.info.get("lowered") or n.kind in ("grad_sum", "copy", "fill")
        ),
        "captures": compiled.captures,
        "replays": entry.replays,
        **_replay_mode(entry),
        "capture_seconds": getattr(entry, "capture_seconds", None),
        "build_seconds": getattr(entry, "build_seconds", None),
    }


def _recompute(entry) -> dict:
    """What backward recomputes under the memory budget: ``memory_budget``, ``recomputed``
    (each node copied into backward: ``op``, its ``value``, the forward value it
    ``recomputes``, its ``flops`` and the ``bytes`` it reads and writes, ``site``), their
    totals ``recompute_flops`` and ``recompute_bytes``, and what backward would read from
    forward with nothing recomputed (``saved_bytes_eager``) and at budget 0
    (``saved_bytes_least``, None at budget 1: the pass then looks at nothing)."""
    rc = entry.recompute
    rows = []
    for n in entry.program.nodes:
        if "recomputes" in n.info:
            flops, nbytes = n.info["recompute_cost"]
            rows.append(
                {
                    "op": n.name,
                    "value": f"%{n.outputs[0]}",
                    "recomputes": f"%{n.info['recomputes']}",
                    "flops": flops,
                    "bytes": nbytes,
                    "site": _site(n.site),
                }
            )
    return {
        "memory_budget": rc.budget,
        "recomputed": rows,
        "recompute_flops": sum(r["flops"] for r in rows),
        "recompute_bytes": sum(r["bytes"] for r in rows),
        "saved_bytes_eager": entry.plan.saved_bytes if rc.eager_bytes is None else rc.eager_bytes,
        "saved_bytes_least": rc.least_bytes,
    }


def _replay_mode(entry) -> dict:
    """How the step replays: ``replay_mode`` ("cpu", "cuda graph", "uncaptured: <why>"),
    ``replay_launches`` (the launches of one graph replay: the graph, its input copies and
    its copies out; None when it does not replay as a graph), ``graph_captures``,
    ``arena_kernel_allocations`` (how many of the kernels' own allocations the plan's
    arena holds: all of them once the step is laid out for a graph, else 0),
    ``kept_copies`` (arrays the caller still held in a tensor when the graph's memory was
    to be written again, copied out first) and ``arenas_left`` (arenas left to a caller who
    held graph memory otherwise: a view, a detached tensor)."""
    ex = entry.executor
    graph = ex.cuda_graph if ex is not None else None
    dev = entry.program.device
    none = {"graph_captures": 0, "arena_kernel_allocations": 0, "kept_copies": 0, "arenas_left": 0}
    if dev is None or dev.type == "cpu":
        return {"replay_mode": "cpu", "replay_launches": None, **none}
    if graph is None:
        return {
            "replay_mode": "uncaptured: CUDA graphs off (fw.compile(cuda_graph=False))",
            "replay_launches": None,
            **none,
        }
    return {
        "replay_mode": graph.mode(),
        "replay_launches": graph.launches_per_replay(),
        "graph_captures": graph.captures,
        "arena_kernel_allocations": len(entry.plan.kernel_allocations),
        "kept_copies": graph.kept_copies,
        "arenas_left": graph.arenas_left,
    }


def _mb(n) -> str:
    return f"{n / MB:.3f} MB" if n is not None else "n/a"


def explain(compiled, entry, draw=None, file=None) -> str:
    r = make_report(compiled, entry)
    program, plan = entry.program, entry.plan
    lines = [f"fw.compile({compiled.__name__}): {r['nodes']} nodes, {r['direct_kernels']} on direct kernels"]
    lines.append(
        f"  eager peak (capture) {_mb(r['eager_peak_bytes'])}, planned peak {_mb(r['planned_peak_bytes'])}, "
        f"lower bound {_mb(r['lower_bound_bytes'])}, floor {_mb(r['floor_bytes'])}"
    )
    lines.append(
        f"  arena {_mb(r['arena_bytes'])} ({sum(1 for p in plan.placement.values() if p == 'arena')} "
        f"buffers), persistent {_mb(r['persistent_bytes'])}, replay peak {_mb(r['replay_peak_bytes'])}"
    )
    if r["replay_mode"] != "cpu":
        launches = f", {r['replay_launches']} launches a replay" if r["replay_launches"] is not None else ""
        lines.append(f"  replays as: {r['replay_mode']}{launches}")
    lines.extend(_explain_recompute(r, entry.recompute))
    lines.append(f"  re-inplaced: {', '.join(r['reinplaced_ops']) or 'none'}")
    lines.append(
        f"  copies avoided: {r['copies_avoided_bytes']} bytes ({r['copies_elided']} copies elided); "
        f"removed by DCE: {', '.join(r['removed_ops']) or 'none'}"
    )
    if r["unbound_writebacks"]:
        lines.append(f"  NOT bound to their own buffer (rebound): {', '.join(r['unbound_writebacks'])}")
    lines.append("  inplace chains (input first):")
    for chain in r["inplace_chains"]:
        lines.append("    " + " -> ".join(chain))
    lines.append("  memory plan (arena offset, bytes, live from node to node, first value):")
    rows = sorted(((off, plan.nbytes[c], plan.intervals[c], c) for c, off in plan.offsets.items()))
    for off, nb, (s, e), c in rows:
        lines.append(f"    @{off:>10}  {nb:>10}  [{s:>4}, {e:>4}]  %{c} {program.values[c].describe()}")
    if plan.kernel_allocations:
        held = sum(nb for _, nb, _, _ in plan.kernel_allocations)
        lines.append(
            f"  the kernels' own allocations ({len(plan.kernel_allocations)}, {_mb(held)} in all) are in the "
            "arena too, for the CUDA graph: nothing is allocated while the step replays"
        )
    kernel = [(plan.intervals[c], plan.nbytes[c], c) for c, p in plan.placement.items() if p == "kernel"]
    if kernel and not plan.kernel_allocations:
        lines.append("  allocated by their kernels (not in the arena):")
        for (s, e), nb, c in sorted(kernel):
            lines.append(f"    {nb:>10}  [{s:>4}, {e:>4}]  %{c} {program.values[c].describe()}: {plan.why.get(c, '')}")
    text = "\n".join(lines)
    print(text, file=file or sys.stdout)
    if draw:
        draw_plan(program, plan, draw, title=f"fw.compile({compiled.__name__}) memory plan")
    return text


def _explain_recompute(r, rc) -> list[str]:
    """The memory budget's lines of explain(): what backward recomputes, and at what cost."""
    head = f"  memory budget {r['memory_budget']:g}: saved for backward {_mb(r['saved_bytes'])}"
    if r["saved_bytes_least"] is not None and r["saved_bytes_eager"] != r["saved_bytes_least"]:
        head += f" (with nothing recomputed {_mb(r['saved_bytes_eager'])}, at budget 0 {_mb(r['saved_bytes_least'])})"
    rows = r["recomputed"]
    if not rows:
        lines = [head + f"; nothing recomputed{': ' + rc.why if rc.why else ''}"]
    else:
        cost = seconds(r["recompute_flops"], r["recompute_bytes"]) * 1e3
        lines = [
            head,
            f"  recomputed in backward: {len(rows)} ops, {r['recompute_flops']} FLOPs, {r['recompute_bytes']} bytes "
            f"read and written (about {cost:.3f} ms at the cost model's rates):",
        ]
        for row in rows:
            lines.append(
                f"    {row['value']} = {row['op']} again (recomputes {row['recomputes']}): {row['flops']} FLOPs, "
                f"{row['bytes']} bytes  {row['site']}"
            )
    if rc.banned:
        why = ", ".join(f"{reason} ({count})" for reason, count in sorted(rc.banned.items()))
        lines.append(f"  kept, not recomputable: {why}")
    return lines


def draw_plan(program, plan, path: str, title: str = "memory plan") -> str:
    """Saves the plan as a PNG: arena buffers as boxes (lifetime on x, offset on y)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.patches import Rectangle  # noqa: PLC0415

    n = max(len(program.nodes), 1)
    fig, ax = plt.subplots(figsize=(10, 5.5))
    top = plan.arena_bytes / MB
    cmap = plt.get_cmap("tab20")
    for k, (c, off) in enumerate(sorted(plan.offsets.items(), key=lambda kv: kv[1])):
        s, e = plan.intervals[c]
        ax.add_patch(
            Rectangle(
                (max(s, 0), off / MB),
                max(e - max(s, 0), 0.6),
                plan.nbytes[c] / MB,
                facecolor=cmap(k % 20),
                edgecolor="black",
                linewidth=0.4,
            )
        )
    # Buffers the kernels allocate (hatched): in the arena where a CUDA graph placed them,
    # else above it, where they would sit if freed memory were reused perfectly (packed
    # the same greedy way): their height over time.
    if plan.kernel_allocations:
        boxes = [(off, nb, s, min(e, n)) for off, nb, s, e in plan.kernel_allocations]
        base, ktop, note = 0.0, 0, " arena top; hatched: the kernels' own allocations, placed for the CUDA graph"
    else:
        kernel = [
            (c, plan.nbytes[c], max(plan.intervals[c][0], 0), min(plan.intervals[c][1], n))
            for c, p in plan.placement.items()
            if p == "kernel"
        ]
        koff, ktop = greedy_by_size(kernel)
        boxes = [(koff[c], nb, s, e) for c, nb, s, e in kernel]
        base, note = top, " arena top; above: buffers the kernels allocate (hatched)"
    for off, nb, s, e in boxes:
        ax.add_patch(
            Rectangle(
                (s, base + off / MB),
                max(e - s, 0.6),
                nb / MB,
                facecolor="none",
                edgecolor="grey",
                hatch="///",
                linewidth=0.4,
            )
        )
    y = top + ktop / MB
    ax.axhline(top, color="black", linewidth=1)
    ax.text(0, top, note, va="bottom", fontsize=8)
    ax.set_xlim(0, n)
    ax.set_ylim(0, max(y, top) * 1.05 + 1e-6)
    ax.set_xlabel("node (program order): lifetime")
    ax.set_ylabel("offset (MB)")
    ax.set_title(f"{title}: arena {plan.arena_bytes / MB:.2f} MB, planned peak {plan.planned_peak_bytes / MB:.2f} MB")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
