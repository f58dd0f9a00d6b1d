"""The house is one-way: entry -> engine -> ground floor, never back up, and no circles.

Floors (DESIGN: "Floors"): ``train`` (the entry) and ``tools``/``bench`` beside it may import
anything; the engine level (``engine``, ``invariant``) never imports the entry or the tools;
the ground floor (tasks, data, repro, config and the small modules) imports neither the entry,
the tools nor the engine. Module-level imports only: a function may import lazily.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

SRC = REPO / "src"
ENTRY = ("reprotrain.train", "reprotrain.tools", "reprotrain.bench", "reprotrain.selfcheck")
ENGINE = ("reprotrain.engine", "reprotrain.invariant")


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(path: Path) -> set[str]:
    """Framework modules imported at module level (not inside functions or TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("reprotrain")}


def floor(name: str) -> int:
    if name.startswith(ENTRY):
        return 2
    return 1 if name.startswith(ENGINE) else 0


GRAPH = {module_name(p): top_level_imports(p) for p in sorted((SRC / "reprotrain").rglob("*.py"))}


def test_no_module_imports_a_floor_above_its_own():
    upward = [
        f"{name} -> {dep}"
        for name, deps in GRAPH.items()
        for dep in deps
        if dep in GRAPH and floor(dep) > floor(name)
    ]
    assert upward == []


def test_module_level_imports_form_no_circle():
    modules = set(GRAPH)
    edges = {m: {d for d in GRAPH[m] if d in modules and d != m} for m in modules}
    state: dict[str, int] = {}
    cycles: list[str] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join([*path[path.index(d) :], d]))
            elif d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in sorted(modules):
        if m not in state:
            visit(m, [m])
    # A package importing its own submodules in __init__ is not a circle of two floors.
    real = [
        c
        for c in cycles
        if not all(
            p.startswith(c.split(" -> ")[0] + ".") or p == c.split(" -> ")[0]
            for p in c.split(" -> ")
        )
    ]
    assert real == []
