"""The import layers of docs/DESIGN.md, read from the source: imports go one way.

Every module of ``framework``, ``models``, ``trainers`` and ``scripts`` belongs to a
layer (the most specific prefix in :data:`LAYERS` wins); a module may import its own
layer and the ones below, never one above. Within the project there is exactly one
import cycle, Tensor <-> ops, and it goes through one documented place: the import of
``framework.ops`` at the bottom of ``framework/tensor.py``. A function-level import of a
project module must say, on its line or the line above, what import time it saves.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("framework", "models", "trainers", "scripts")

# Lowest first. A name covers the module and everything below it, unless a more specific
# name is listed too.
LAYERS = [
    ["framework.backend", "framework.callsite", "framework.testing.cupy_standin"],
    ["framework.memory", "framework.random"],
    ["framework.autograd.grad_mode", "framework.inplace.consumed"],
    ["framework.inplace"],  # the policy and auto's proof: nothing above autograd's grad modes
    ["framework.autograd.node", "framework.autograd.engine", "framework.autograd.view_meta"],
    # tensor and ops: the op contract and the apply path work on tensors
    ["framework.tensor", "framework.ops", "framework.autograd", "framework.creation"],
    ["framework.nn.functional", "framework.utils"],  # utils: checkpointing, over autograd and the ops
    ["framework.nn"],
    ["framework.optim", "framework.amp"],  # amp: the GradScaler steps optimizers
    ["framework.distributed"],
    ["framework.compile"],
    ["framework", "framework.testing"],
    ["models"],
    ["trainers"],
    ["scripts"],
]
# The one allowed cycle: ops build on Tensor, and Tensor's methods call the ops.
DOCUMENTED_CYCLE = ("framework.tensor", "framework.ops")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            found[_module_name(path)] = path
    return found


MODULES = _modules()


def _resolve(module: str, is_package: bool, node) -> list[str]:
    """The project modules an import statement imports."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".")
            if not is_package:
                base = base[:-1]
            base = base[: len(base) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        names = []
        for a in node.names:
            sub = f"{target}.{a.name}"
            names.append(sub if sub in MODULES else target)
    return [n for n in names if n.split(".")[0] in PACKAGES and n in MODULES]


def _imports():
    """``(module, imported module, line, module level?, source line + line above)``."""
    out = []
    for module, path in MODULES.items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        top = set()
        for stmt in tree.body:  # module level, also inside a top-level if/try
            for node in ast.walk(stmt):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    break
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    top.add(id(node))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                text = "\n".join(lines[max(0, node.lineno - 3) : node.end_lineno])
                for target in _resolve(module, path.name == "__init__.py", node):
                    if target != module:
                        out.append((module, target, node.lineno, id(node) in top, text))
    return out


IMPORTS = _imports()


def layer_of(module: str) -> int:
    best, depth = None, -1
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and name.count(".") > depth:
                best, depth = i, name.count(".")
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


def test_imports_go_down_the_layers():
    upward = [
        f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)}) at line {line}"
        for m, t, line, _, _ in IMPORTS
        if layer_of(t) > layer_of(m)
    ]
    assert not upward, "\n".join(upward)


def test_the_only_import_cycle_is_tensor_and_ops_in_one_documented_place():
    edges: dict[str, set] = {}
    documented = []
    for m, t, line, top, text in IMPORTS:
        if not top:
            continue
        if m == DOCUMENTED_CYCLE[0] and (t == DOCUMENTED_CYCLE[1] or t.startswith(DOCUMENTED_CYCLE[1] + ".")):
            documented.append((line, text))
            continue
        edges.setdefault(m, set()).add(t)
    assert len(documented) == 1, f"framework.tensor must import framework.ops in exactly one place: {documented}"
    assert "one import cycle" in documented[0][1].lower(), "the import must say why (the documented cycle)"
    # what is left must be acyclic (depth-first search for a back edge)
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                cycle = path[path.index(t) :] + [t]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_function_level_imports_say_what_import_time_they_save():
    unexplained = [
        f"{m}:{line} imports {t} inside a function"
        for m, t, line, top, text in IMPORTS
        if not top and "import time" not in text.lower()
    ]
    assert not unexplained, "\n".join(unexplained)


def test_the_policy_imports_nothing_above_autograd():
    for m, t, line, _, _ in IMPORTS:
        if m.startswith("framework.inplace"):
            assert layer_of(t) <= layer_of("framework.inplace"), f"{m}:{line} imports {t}"


def test_nothing_refers_outside_the_repository():
    outside = []
    for path in list(ROOT.glob("*.md")) + list((ROOT / "docs").glob("*.md")) + list(MODULES.values()):
        text = path.read_text()
        for needle in ("../shared", "/work/shared", "REFERENCES.md"):
            if needle in text:
                outside.append(f"{path.relative_to(ROOT)} mentions {needle}")
    assert not outside, "\n".join(outside)
