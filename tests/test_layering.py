"""The house is one-way: tools -> entry -> engine -> rooms -> ground floor -> records, never
back up, and no circles.

Floors (DESIGN: "Floors"), from the top:

- the tools (``tools``, ``commands``, ``python -m reprotrain``, ``selfcheck``) may import
  anything;
- the entry, ``train`` and its ``exits``, imports everything but the tools;
- the engine level (``step.runner``, ``reduction``, ``invariant``; ``start`` (with its
  provenance), ``build`` and ``loop`` above them) imports neither the entry nor the tools;
- the rooms (tasks, data, resume, the ``Step`` base, config, loggers and the small modules)
  import none of the above; among them, ``data`` imports nothing of ``step``, ``resume`` or
  the loop (issue 56: it did, for the batch helpers and the digester);
- the ground floor, the primitives every stage shares (the trainer's state, the batch helpers,
  the object digester, the metric sums they hold), imports no stage: only records;
- the records (the run directory ``run``, ``hashing``, ``repro``, and the errors, events and
  quoting they use) import nothing but records: a record never depends on what it records.

Every import counts, at module level or inside a function: an import moved into a function
still ties the two modules together, so it may not close a circle. (A function may still
import a heavy third-party library lazily: torch, matplotlib.) A private name (``_x``) stays
inside its module: no module imports another's.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

SRC = REPO / "src"
# The tools: the `reprotrain` command (commands.py, python -m reprotrain) and what it runs.
TOOLS = ("reprotrain.commands", "reprotrain.__main__", "reprotrain.tools", "reprotrain.selfcheck")
ENTRY = ("reprotrain.train", "reprotrain.exits")
# The engine level: the step and the reduction, and around them the run's start, its build,
# its provenance and the loop (the Trainer) that train() calls.
ENGINE = ("reprotrain.step.runner", "reprotrain.invariant", "reprotrain.reduction",
          "reprotrain.build", "reprotrain.loop", "reprotrain.start")  # fmt: skip
# The ground floor: the primitives every stage shares, in rooms of their own (issue 56).
GROUND = ("reprotrain.state", "reprotrain.batches", "reprotrain.digest", "reprotrain.tasks.metrics")
# The records: what a run writes and compares, and the little they need.
RECORDS = ("reprotrain.run", "reprotrain.hashing", "reprotrain.repro", "reprotrain.errors",
           "reprotrain.events", "reprotrain.quoting", "reprotrain.shown",
           "reprotrain.hydra_api", "reprotrain.extras")  # fmt: skip
FILES = sorted((SRC / "reprotrain").rglob("*.py"))


def module_name(path: Path, root: Path = SRC) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module an ``ImportFrom`` names, relative imports resolved."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imported_names(
    path: Path, root: Path = SRC, package: str = "reprotrain"
) -> set[tuple[str, str | None]]:
    """(module, name) for every import anywhere in the file: module level, inside functions,
    under TYPE_CHECKING. ``name`` is the imported attribute of a ``from`` import, else None;
    ``module.attr`` read through a name an import bound counts as importing ``attr``."""
    module, tree = module_name(path, root), ast.parse(path.read_text())
    found: set[tuple[str, str | None]] = set()
    bound: dict[str, str] = {}  # local name -> the module (or attribute) an import bound
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {(a.name, None) for a in node.names}
            bound |= {a.asname: a.name for a in node.names if a.asname}
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node, module, path.name == "__init__.py")
            found |= {(base, a.name) for a in node.names}
            bound |= {a.asname or a.name: f"{base}.{a.name}" for a in node.names}
    for node in ast.walk(tree):
        is_read = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        if is_read and node.value.id in bound:
            found.add((bound[node.value.id], node.attr))
    return {(m, n) for m, n in found if m == package or m.startswith(f"{package}.")}


NAMES = {module_name(p): imported_names(p) for p in FILES}


def dependencies(name: str) -> set[str]:
    """The framework modules ``name`` imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    out: set[str] = set()
    for mod, attr in NAMES[name]:
        full = f"{mod}.{attr}" if attr else mod
        out.add(full if full in NAMES else mod)  # ``from pkg import mod`` or a name of ``mod``
    return {d for d in out if d in NAMES and d != name}


GRAPH = {name: dependencies(name) for name in NAMES}


def floor(name: str) -> int:
    if name.startswith(TOOLS):
        return 5
    if name.startswith(ENTRY):
        return 4
    if name.startswith(ENGINE):
        return 3
    if name.startswith(RECORDS):
        return 0
    return 1 if name in GROUND else 2


def circles(edges: dict[str, set[str]]) -> list[str]:
    """Every back edge of a depth-first walk, as the circle it closes."""
    state: dict[str, int] = {}
    found: list[str] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                found.append(" -> ".join([*path[path.index(d) :], d]))
            elif d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    return found


def test_the_import_scan_sees_imports_inside_functions(tmp_path):
    """Was: only module-level imports were scanned, so a circle closed inside a function hid."""
    pkg = tmp_path / "reprotrain"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f():\n    from reprotrain import b\n    return b\n")
    (pkg / "b.py").write_text("from reprotrain.a import f\n")
    found = {module_name(p, tmp_path): imported_names(p, tmp_path) for p in pkg.glob("*.py")}
    assert ("reprotrain", "b") in found["reprotrain.a"]
    edges = {"reprotrain.a": {"reprotrain.b"}, "reprotrain.b": {"reprotrain.a"}}
    assert circles(edges) == ["reprotrain.a -> reprotrain.b -> reprotrain.a"]


def test_no_module_imports_a_floor_above_its_own():
    upward = [
        f"{name} -> {dep}"
        for name, deps in GRAPH.items()
        for dep in deps
        if floor(dep) > floor(name)
    ]
    assert upward == []


def test_imports_anywhere_in_a_module_form_no_circle():
    # A package's __init__ importing its own submodules is not a circle between two modules.
    edges = {
        m: {d for d in deps if not d.startswith(m + ".") and not m.startswith(d + ".")}
        for m, deps in GRAPH.items()
    }
    assert circles(edges) == []


def room(name: str) -> str:
    """The room a module lives in: its top-level package or module (``reprotrain.run``)."""
    return ".".join(name.split(".")[:2])


def test_the_records_rooms_depend_one_way():
    """Issue 47: run/ (serialisation, the run directory) and repro/ (the machine, the
    environment, checkpoints) depended on each other (record.py -> repro.jsonsafe,
    repro.checkpoint -> run.record). Between the records' rooms every arrow runs one way."""
    rooms = {room(m) for m in GRAPH if floor(m) == 0}
    edges = {r: set() for r in rooms}
    for name, deps in GRAPH.items():
        for dep in deps:
            if room(name) in rooms and room(dep) in rooms and room(dep) != room(name):
                edges[room(name)].add(room(dep))
    assert circles(edges) == []
    assert "reprotrain.repro" not in edges["reprotrain.run"]


def test_the_rooms_form_no_circle():
    """Issue 56: ``reduction`` imported ``step.state`` while ``step.runner`` imported
    ``reduction``: no module circle, but the two rooms leaned on each other. Between any two
    rooms of the framework every arrow runs one way."""
    edges: dict[str, set[str]] = {room(m): set() for m in GRAPH}
    for name, deps in GRAPH.items():
        edges[room(name)] |= {room(d) for d in deps} - {room(name)}
    assert circles(edges) == []


def chains_down(edges: dict[str, set[str]]) -> dict[str, list[str]]:
    """Each room's longest import chain down from it (a graph without circles); its length
    is the room's floor."""
    memo: dict[str, list[str]] = {}

    def down(r: str) -> list[str]:
        if r not in memo:
            memo[r] = [r, *max((down(d) for d in sorted(edges[r])), key=len, default=[])]
        return memo[r]

    return {r: down(r) for r in sorted(edges)}


def longest_chain(edges: dict[str, set[str]]) -> list[str]:
    return max(chains_down(edges).values(), key=len)


def test_the_longest_chain_of_rooms_climbs_at_most_twelve_floors():
    """Issue 56: the house had 15 floors (train -> loop -> build -> ... -> run -> errors).
    Rolled up to rooms (a top-level module or package, ``room``), the longest import chain,
    imports inside functions counted, passes at most 12 rooms; the measure fails on a chain of
    13 (the loggers reading the extras' list from the lock tool made one)."""
    edges = room_edges()
    chain = longest_chain(edges)
    assert len(chain) <= 12, " -> ".join(chain)
    made = {r: set(e) or {"x"} for r, e in edges.items()}  # three floors under every bottom
    made |= {"x": {"y"}, "y": {"z"}, "z": set()}
    assert len(longest_chain(made)) == len(longest_chain(edges)) + 3


def room_edges() -> dict[str, set[str]]:
    """The import graph rolled up to rooms: room -> the other rooms it imports."""
    edges: dict[str, set[str]] = {room(m): set() for m in GRAPH}
    for name, deps in GRAPH.items():
        edges[room(name)] |= {room(d) for d in deps} - {room(name)}
    return edges


DESIGN = REPO / "docs" / "design.md"
PICTURE = ("<!-- import picture: generated by tests/test_layering.py -->", "<!-- end -->")


def picture_span(text: str) -> tuple[int, int]:
    """Where design.md's generated picture lies, between its two markers."""
    return text.index(PICTURE[0]) + len(PICTURE[0]), text.index(PICTURE[1])


def picture(edges: dict[str, set[str]]) -> str:
    """The rooms by floor (a room's floor: the rooms on the longest chain down from it), the
    longest chain, and the counts, as the text docs/design.md shows."""
    height = {r: len(chain) for r, chain in chains_down(edges).items()}
    top = max(height.values())
    short = {r: r.removeprefix("reprotrain.") for r in edges}
    lines = [f"{n:>2}  {', '.join(sorted(short[r] for r in edges if height[r] == n))}"
             for n in range(top, 0, -1)]  # fmt: skip
    chain = " -> ".join(short[r] for r in longest_chain(edges))
    arrows = sum(len(e) for e in edges.values())
    counts = f"{len(edges)} rooms, {arrows} arrows, {top} floors, {len(circles(edges))} circles"
    return "\n".join(["```text", *lines, "", f"longest: {chain}", counts, "```"])


def test_design_md_shows_the_current_import_picture():
    """docs/design.md's import picture is this graph's (regenerate it with
    ``.venv/bin/python tests/test_layering.py``); it fails when a new import changes a floor."""
    text = DESIGN.read_text()
    begin, end = picture_span(text)
    assert text[begin:end].strip() == picture(room_edges()), "run tests/test_layering.py"
    moved = room_edges()
    moved["reprotrain.errors"] = {"reprotrain.new"}  # one room and one arrow more
    moved["reprotrain.new"] = set()
    assert picture(moved) != picture(room_edges())


def test_the_private_name_check_sees_from_imports_and_attribute_reads(tmp_path):
    pkg = tmp_path / "reprotrain"
    pkg.mkdir()
    (pkg / "a.py").write_text("from reprotrain.b import _x\nfrom reprotrain import b\nb._y\n")
    pairs = imported_names(pkg / "a.py", tmp_path)
    assert {("reprotrain.b", "_x"), ("reprotrain.b", "_y")} <= pairs


def test_no_private_name_is_imported_across_modules():
    crossing = sorted(
        f"{name} imports {mod}.{attr}"
        for name, pairs in NAMES.items()
        for mod, attr in pairs
        if attr and attr.startswith("_") and not attr.startswith("__") and mod != name
    )
    assert crossing == []


FACE = "reprotrain.api"
FACE_BUDGET = 21  # names: the task, step, callback and logger bases, context and output, data,
# errors, a fetch


def test_the_users_room_imports_the_framework_only_through_its_face():
    """src/starter (the room a project replaces) imports ``reprotrain.api`` (or the package,
    which re-exports it) and nothing else of the framework, anywhere in a file; everything
    behind the face may move in a template update."""
    room = sorted((SRC / "starter").rglob("*.py"))
    assert room
    behind = sorted(
        f"{path.relative_to(SRC)}: {mod}.{name}"
        for path in room
        for mod, name in imported_names(path)
        if not (mod == FACE or mod.startswith(f"{FACE}."))
        and not (mod == "reprotrain" and name in FACE_NAMES)
    )
    assert behind == []


def test_the_face_is_small_and_the_package_re_exports_it():
    import reprotrain
    from reprotrain import api

    assert len(api.__all__) <= FACE_BUDGET
    assert sorted(reprotrain.FACE) == sorted(api.__all__)
    assert all(getattr(reprotrain, name) is getattr(api, name) for name in api.__all__)


def _face_names() -> set[str]:
    tree = ast.parse((SRC / "reprotrain" / "api.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__all__":
            return {elt.value for elt in node.value.elts}
    return set()


FACE_NAMES = _face_names()


def test_the_entry_stays_short_and_train_reads_its_config_in_few_places():
    """Issues 36 and 47: train.py is at most 120 lines and ``train()`` about 40 that read
    as start, build, fit (in that order), handing each part what it reads. Counted with the
    AST: every ``cfg`` name in ``train()`` is one stay of the config walk; at most 10."""
    path = SRC / "reprotrain" / "train.py"
    text = path.read_text()
    tree = ast.parse(text)
    (train,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train"]
    stays = [n for n in ast.walk(train) if isinstance(n, ast.Name) and n.id == "cfg"]
    assert len(text.splitlines()) <= 120
    assert len(stays) <= 10, [n.lineno for n in stays]
    assert train.end_lineno - train.lineno + 1 <= 45  # one screen of calls
    calls = [n for n in ast.walk(train) if isinstance(n, ast.Call)]
    named = sorted((c.lineno, getattr(c.func, "id", None) or getattr(c.func, "attr", None))
                   for c in calls)  # fmt: skip
    order = [name for _, name in named if name in ("start", "build", "Trainer", "fit")]
    assert order == ["start", "build", "Trainer", "fit"], order


def test_the_data_room_builds_nothing():
    """Issue 47: a dataset ``_target_`` is built in the build room (``components.build_dataset``),
    like every other; the data modules import neither it nor the ``_target_`` builder."""
    data = [name for name in GRAPH if name.startswith("reprotrain.data")]
    back = [f"{name} -> {dep}" for name in data for dep in GRAPH[name]
            if dep in ("reprotrain.components", "reprotrain.build")]  # fmt: skip
    assert data and back == [], back


def test_the_ground_floor_imports_no_stage():
    """Issue 56: the trainer's state (``step/state.py``), the batch helpers (``step/batches.py``)
    and the object digester (in ``resume/audit.py``) lived inside stage rooms, so ``data/``
    imported ``step/`` and ``resume/`` and ``reduction`` reached back into ``step/``. Each is a
    ground-floor room now that imports records only."""
    assert set(GROUND) <= set(GRAPH)
    up = [f"{name} -> {dep}" for name in GROUND for dep in GRAPH[name] if floor(dep) > 0
          and dep not in GROUND]  # fmt: skip
    assert up == [], up


def test_data_imports_nothing_of_step_resume_or_the_loop():
    """Issue 56: the data room sits below the stages that consume its batches."""
    data = [name for name in GRAPH if name.startswith("reprotrain.data")]
    stages = ("reprotrain.step", "reprotrain.resume", "reprotrain.loop")
    back = [f"{name} -> {dep}" for name in data for dep in GRAPH[name] if dep.startswith(stages)]
    assert data and back == [], back


def test_the_benchmark_scripts_form_no_circle():
    """Issue 56: ``scripts/benchmarks``' reference_model.py and results.py imported each other,
    inside functions, which hid the circle; the scripts are held to the framework's rule."""
    root = REPO / "scripts"
    found = {module_name(p, root): imported_names(p, root, "benchmarks")
             for p in sorted((root / "benchmarks").glob("*.py"))}  # fmt: skip
    edges = {
        m: {f"{mod}.{a}" if f"{mod}.{a}" in found else mod for mod, a in pairs} & set(found) - {m}
        for m, pairs in found.items()
    }
    assert len(edges) > 5 and circles(edges) == []


if __name__ == "__main__":  # rewrite docs/design.md's import picture
    text = DESIGN.read_text()
    begin, end = picture_span(text)
    DESIGN.write_text(f"{text[:begin]}\n{picture(room_edges())}\n{text[end:]}")
