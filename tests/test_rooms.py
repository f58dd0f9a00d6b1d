"""The whole config is a parameter of at most a few functions (issue 47): everything else takes
what it uses (a node, a frozen settings object, the redacted container, a few values).

A parameter is the whole config when it is named ``cfg``, or is typed ``DictConfig`` (also
``"DictConfig"``, ``DictConfig | None``) under a name that is not one of a node's: a top-level
key of the schema (``dataset``, ``trainer``, ``logger``, ...), a Hydra node (``sweeper``,
``sampler``, ``launcher``), ``node`` or a name ending ``_cfg`` / ``_node``. Signatures on one
line or many are the same to the parser. Hydra's callback hooks (``on_job_end(config, ...)``)
are not counted: Hydra, not the framework, chooses what they are given.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from conftest import REPO

SRC = REPO / "src" / "reprotrain"
MOST = 10
HYDRA_NODES = ("sweeper", "sampler", "launcher", "hydra")


def node_names() -> set[str]:
    from reprotrain.config import TrainConfig

    return {f.name for f in dataclasses.fields(TrainConfig)} | {*HYDRA_NODES, "node"}


def typed_dict_config(annotation: ast.expr | None) -> bool:
    """``DictConfig``, ``"DictConfig"`` or a union with it (not ``dict[str, DictConfig]``)."""
    if annotation is None:
        return False
    text = ast.unparse(annotation).strip("'\"")
    return any(part.strip().strip("'\"") == "DictConfig" for part in text.split("|"))


def takes_whole_config(arg: ast.arg, nodes: set[str]) -> bool:
    if arg.arg == "cfg":
        return True
    name = arg.arg
    is_node = name in nodes or name.endswith(("_cfg", "_node"))
    return typed_dict_config(arg.annotation) and not is_node


def hydra_hooks() -> set[str]:
    from hydra.experimental.callback import Callback

    return {name for name in vars(Callback) if name.startswith("on_")}


def whole_config_functions(root: Path = SRC) -> list[str]:
    nodes, hooks, found = node_names(), hydra_hooks(), []
    for path in sorted(root.rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) or fn.name in hooks:
                continue
            args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
            hits = [a.arg for a in args if takes_whole_config(a, nodes)]
            if hits:
                found.append(f"{path.relative_to(root)}:{fn.lineno} {fn.name}({hits[0]})")
    return found


def test_the_whole_config_is_a_parameter_of_at_most_ten_functions() -> None:
    found = whole_config_functions()
    assert len(found) <= MOST, (
        f"{len(found)} functions take the whole config (at most {MOST}); pass what they use:\n"
        + "\n".join(found)
    )


def test_the_count_sees_each_form_of_a_whole_config_parameter(tmp_path: Path) -> None:
    """The counter is not blind: one-line and multi-line signatures, ``cfg`` untyped,
    ``DictConfig`` under another name, quoted or in a union; a node or a dict of nodes is not
    counted."""
    (tmp_path / "m.py").write_text(
        "def a(cfg): ...\n"
        "def b(\n    x: int,\n    config: 'DictConfig',\n) -> None: ...\n"
        "def c(recorded: DictConfig | dict): ...\n"
        "class K:\n    def d(self, *, master: DictConfig | None = None): ...\n"
        "def e(dataset: DictConfig, model_cfg: DictConfig, node: DictConfig): ...\n"
        "def f(groups: dict[str, DictConfig], settings: object): ...\n"
        "def on_job_end(config: DictConfig): ...\n"
    )
    found = whole_config_functions(tmp_path)
    assert [f.split(" ")[1] for f in found] == ["a(cfg)", "b(config)", "c(recorded)", "d(master)"]


def rooms_in_the_tree() -> set[str]:
    """Each package and top-level module of the framework, as the table names it."""
    rooms = {
        f"src/reprotrain/{p.name}/" if p.is_dir() else f"src/reprotrain/{p.name}"
        for p in SRC.iterdir()
        if (p.is_dir() and any(p.glob("*.py"))) or p.suffix == ".py"
    }
    return rooms - {"src/reprotrain/__init__.py", "src/reprotrain/__main__.py"}


def rooms_in_the_table() -> set[str]:
    """The ``src/reprotrain/...`` paths in the first column of the rooms table."""
    text = (REPO / "docs" / "design.md").read_text()
    section = text[text.index("## The framework's rooms") :].split("\n## ")[0]
    first = [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| `src/")]
    return {m for cell in first for m in re.findall(r"`(src/reprotrain/[^`]+)`", cell)}


def test_the_rooms_table_in_design_md_matches_the_tree() -> None:
    """docs/design.md's rooms table names every package and top-level module of
    ``src/reprotrain`` (first column), and names none that is gone."""
    tree, table = rooms_in_the_tree(), rooms_in_the_table()
    assert sorted(tree - table) == [], "rooms missing from docs/design.md's table"
    assert sorted(table - tree) == [], "docs/design.md's table names rooms that are gone"


def test_every_framework_class_named_for_a_step_is_in_the_step_glossary() -> None:
    """docs/design.md: "step" is one optimizer update; a class named ``...Step...`` is listed in
    the glossary table (a per-step helper is named for what it is: ``LossFeed``, ``Profiler``)."""
    text = (REPO / "docs" / "design.md").read_text()
    section = text.split('### One meaning of "step"', 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`(\w+)`", section))
    classes = {
        node.name
        for path in SRC.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ClassDef) and "Step" in node.name
    }
    assert classes, "no Step class found: the glossary test reads the wrong tree"
    assert classes <= listed, f"named for a step but not in the glossary: {classes - listed}"
