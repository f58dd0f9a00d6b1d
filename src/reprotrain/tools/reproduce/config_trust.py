"""Which callables an archived config may name when the archive's *code* is trusted by rule (a).

Closes: an untouched commit whose config names a callable it ships for another purpose. Every
``_target_`` must be one the commit's ``conf/`` names in the same top-level group; no
interpolation; no ``hydra``/``defaults`` key. Argument values stay the archive's choice.
docs/guarantees.md.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from reprotrain.conf import FRAMEWORK_CONF_DIRS, package_header

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
        primary = yaml.safe_load((Path(source) / "conf" / "train.yaml").read_text("utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
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
            data = yaml.safe_load(text)
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
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


def problems(raw: dict[str, Any], allowed: dict[str, set[str]], commit: str) -> list[str]:
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
            elif value not in allowed.get(group, set()):
                found.append(
                    f"{where} names {value!r}, which conf/ of commit {commit[:12]} never "
                    f"names under {group!r}"
                )
        elif isinstance(value, str) and "${" in value:
            found.append(f"{where} is an interpolation ({value[:60]!r})")
    return found
