"""Which callables an archived config may name when the archive's *code* is trusted by rule (a).

Closes: an untouched commit whose config names a callable it ships for another purpose. Every
``_target_`` must be one the commit's ``conf/`` names in the same top-level group, and none that
starts a process or runs a command (:func:`process_starters`, even where ``conf/`` names it); no
interpolation; no ``hydra``/``defaults`` key. A sweep's recorded overrides name no callable,
hook, command, search path or resolver that builds nodes (:func:`override_problems`). Argument
values stay the archive's choice. docs/guarantees.md.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from reprotrain.conf import FRAMEWORK_CONF_DIRS, package_header
from reprotrain.errors import ReprotrainError
from reprotrain.run.bounded import load_yaml

_DOTTED = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+$")
REFUSED_TOP_LEVEL = ("hydra", "defaults")


def walk(node: Any, path: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(dotted path, key, value) of every entry, depth first; list items as ``[i]``."""
    if isinstance(node, dict):
        for k, v in node.items():
            here = f"{path}.{k}" if path else str(k)
            yield here, k, v
            yield from walk(v, here)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            here = f"{path}[{i}]"
            yield here, i, v
            yield from walk(v, here)


def trusted_conf_dirs(source: Path) -> list[Path]:
    """``conf/``, the framework's packaged configs and the primary's ``pkg://`` searchpath."""
    dirs = [Path(source) / "conf"]
    dirs += [Path(source) / d for d in FRAMEWORK_CONF_DIRS if (Path(source) / d).is_dir()]
    try:
        train_yaml = Path(source) / "conf" / "train.yaml"
        primary = load_yaml(train_yaml.read_text("utf-8"), str(train_yaml))  # bounded
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ReprotrainError):
        return dirs
    hydra = primary.get("hydra") if isinstance(primary, dict) else None
    for entry in (hydra or {}).get("searchpath") or []:
        if isinstance(entry, str) and entry.startswith("pkg://"):
            rel = Path(*entry.removeprefix("pkg://").split("."))
            if ".." not in rel.parts and Path(source) / "src" / rel not in dirs:
                dirs.append(Path(source) / "src" / rel)
    return dirs


def conf_targets(*conf_dirs: Path) -> dict[str, set[str]]:
    """{top-level group: every ``_target_`` under it} in ``conf_dirs``' YAML (``@package`` too)."""
    out: dict[str, set[str]] = {}
    files = [(Path(d), f) for d in conf_dirs for f in sorted(Path(d).rglob("*.yaml"))]
    for conf_dir, path in files:
        rel = path.relative_to(conf_dir)
        try:
            text = path.read_text(encoding="utf-8")
            data = load_yaml(text, str(path))  # bounded: a bomb is skipped, naming nothing
        except (OSError, UnicodeDecodeError, yaml.YAMLError, ReprotrainError):
            continue
        if not isinstance(data, dict):
            continue
        package = package_header(text)
        if len(rel.parts) == 1 or package == "_global_":
            roots = [(str(k), v) for k, v in data.items() if k != "defaults"]
        elif package and package not in ("_group_", "_here_"):
            roots = [(package.split(".")[0], data)]
        else:
            roots = [(rel.parts[0], data)]
        for group, node in roots:
            out.setdefault(group, set()).update(str(v) for _, k, v in walk(node) if k == "_target_")
    return out


def problems(
    raw: dict[str, Any], allowed: dict[str, set[str]], commit: str, starters: Iterable[str] = ()
) -> list[str]:
    """What in ``raw`` (the archived config, unresolved) the trusted ``conf/`` would not make."""
    found = [f"it sets top-level {k!r}" for k in REFUSED_TOP_LEVEL if k in raw]
    for where, key, value in walk(raw):
        group = re.split(r"[.\[]", where, maxsplit=1)[0]
        if group in REFUSED_TOP_LEVEL:
            continue
        if key == "_target_":
            name = value if isinstance(value, str) else repr(value)
            if not (isinstance(value, str) and _DOTTED.match(value)):
                found.append(f"{where} names {name!r}, which is not a plain dotted name")
            elif value in starters:
                found.append(f"{where} names {value!r}, {STARTS}")
            elif value not in allowed.get(group, set()):
                found.append(
                    f"{where} names {value!r}, which conf/ of commit {commit[:12]} never "
                    f"names under {group!r}"
                )
        elif isinstance(value, str) and "${" in value:
            found.append(f"{where} is an interpolation ({value[:60]!r})")
    return found


STARTS = "a callable of this checkout that starts a process or runs a command"


@dataclass(frozen=True)
class Rule:
    """Rule (a) for one trusted source tree: the callables its ``conf/`` names, per group, less
    every callable of its ``src/`` that starts a process (``process_starters``)."""

    targets: dict[str, set[str]]
    starters: frozenset[str]

    @classmethod
    def of(cls, source: Path) -> Rule:
        targets = conf_targets(*trusted_conf_dirs(source))
        return cls(targets, process_starters(Path(source).resolve() / "src"))

    def problems(self, raw: dict[str, Any], commit: str) -> list[str]:
        return problems(raw, self.targets, commit, self.starters)

    def allowed(self) -> set[str]:
        """Every callable the rule lets a config name, in any group: Hydra's allowlist."""
        return {t for names in self.targets.values() for t in names} - self.starters


#: Calls that start a process or run a command: ``module.function`` (``exec*``, ``spawn*``...).
_SPAWNS = re.compile(
    r"^(subprocess\.\w+|os\.(system|popen|fork\w*|exec\w+|spawn\w+|posix_spawn\w*|startfile)"
    r"|pty\.(spawn|fork)|asyncio\.create_subprocess_\w+)$"
)


@functools.cache
def process_starters(src: Path) -> frozenset[str]:
    """Every callable under ``src`` (``module.name``: a function, or a class by any of its
    methods) that starts a process or runs a command, directly or through another such callable
    of ``src``, and every name that re-exports one. Read from the source, nothing imported;
    a call it cannot name statically (``getattr``, a callable passed in) is not followed."""
    calls: dict[str, set[str]] = {}  # callable -> the dotted names it calls
    aliases: dict[str, str] = {}  # module.name -> what an import bound it to
    for path in sorted(Path(src).rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):
            continue
        bound = _bindings(tree, module, path.name == "__init__.py")
        aliases |= {f"{module}.{k}": v for k, v in bound.items()}
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                calls[f"{module}.{node.name}"] = {
                    _resolve(_dotted(c.func), bound, module)
                    for c in ast.walk(node)
                    if isinstance(c, ast.Call) and _dotted(c.func)
                }
    starters = {name for name, called in calls.items() if any(map(_SPAWNS.match, called))}
    grown = True
    while grown:
        before = len(starters)
        named = starters | {a for a, target in aliases.items() if target in starters}
        starters |= {name for name, called in calls.items() if called & named}
        grown = len(starters) > before
    return frozenset(starters | {a for a, target in aliases.items() if target in starters})


def _bindings(tree: ast.Module, module: str, package: bool) -> dict[str, str]:
    """{local name: dotted name} for every import in the file (relative ones resolved)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:  # ``import a.b`` binds ``a``; ``import a.b as c``: a.b
                top = a.name.split(".")[0]
                out[a.asname or top] = a.name if a.asname else top
        elif isinstance(node, ast.ImportFrom):
            base = module.split(".") if package else module.split(".")[:-1]
            base = base[: len(base) - max(node.level - 1, 0)] if node.level else []
            origin = ".".join([*base, *([node.module] if node.module else [])])
            out |= {(a.asname or a.name): f"{origin}.{a.name}" for a in node.names}
    return out


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a name or an attribute chain on a name; else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _dotted(node.value)):
        return f"{base}.{node.attr}"
    return None


def _resolve(name: str | None, bound: dict[str, str], module: str) -> str:
    head, _, rest = str(name).partition(".")
    origin = bound.get(head, f"{module}.{head}")
    return f"{origin}.{rest}" if rest else origin


#: ``hydra.*`` keys an archive's recorded overrides may set under rule (a): where a sweep
#: writes and how far it searches; nothing that names code, a command, a search path, an env
#: var or a file elsewhere (submitit's ``setup`` lines run in a shell; ``searchpath`` adds
#: configs; a ``storage`` path writes anywhere). Group choices pick this checkout's options.
HYDRA_KEYS = {"hydra.mode", "hydra.sweep.dir", "hydra.sweep.subdir", "hydra.run.dir",
              "hydra.output_subdir", "hydra.job.chdir", "hydra.verbose", "hydra.launcher.n_jobs",
              "hydra.sweeper.n_trials", "hydra.sweeper.n_jobs", "hydra.sweeper.direction",
              "hydra.sweeper.study_name", "hydra.sweeper.resume", "hydra.sweeper.max_batch_size",
              "hydra.sweeper.sampler.seed", "hydra/launcher", "hydra/sweeper",
              "hydra/sweeper/sampler", "hydra/job_logging", "hydra/hydra_logging"}  # fmt: skip
#: Resolvers an override's value may call: each returns a value, none builds a node.
RESOLVERS = {"oc.env", "oc.select", "now", "hydra", "cores_per_job", "run_stamp"}
_META = re.compile(r"\b_(target|args|partial|recursive|convert)_\b")
_RESOLVER = re.compile(r"\$\{\s*([^\s:}]+)\s*:")


def override_problems(lines: Iterable[str]) -> list[str]:
    """What in a sweep's recorded overrides rule (a) would not run: a key or value naming a
    callable (``_target_``, ``_args_``...), a ``hydra.*`` key outside :data:`HYDRA_KEYS`, a
    resolver outside :data:`RESOLVERS`, or a line Hydra cannot parse."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from reprotrain.shown import shown

    parser, found = OverridesParser.create(), []
    for line in map(str, lines):
        try:
            key = parser.parse_override(line).get_key_element()
        except Exception:  # Hydra's parse errors are of several types; any is a refusal
            found.append(f"the override {shown(line, 80)} does not parse")
            continue
        searched = key.startswith("hydra.sweeper.params.")
        if _META.search(line):
            found.append(f"the override {shown(line, 80)} names or calls a callable")
        elif key.split(".")[0].split("/")[0] == "hydra" and key not in HYDRA_KEYS and not searched:
            why = "which rule (a) lets no archive set (it can name code, a command or files)"
            found.append(f"the override {shown(line, 80)} sets {key}, {why}")
        found += [
            f"the override {shown(line, 80)} calls the resolver {shown(name, 40)}"
            for name in _RESOLVER.findall(line)
            if name not in RESOLVERS
        ]
    return found
