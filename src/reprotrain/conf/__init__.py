"""The framework's own Hydra configs, registered in Hydra's ConfigStore.

``conf/train.yaml`` (the user's) starts its defaults with ``- reprotrain``: this package's
``reprotrain.yaml``, the framework's wiring (the typed schema, run and sweep directory
layout, the sweep summary callback, the ``--help`` page). The framework's own job
(``experiment=selfcheck``: ``src/reprotrain/selfcheck/conf``) is registered the same way,
so no ``hydra.searchpath`` is needed in the user's config. Each YAML keeps its place in the
tree: ``<dir>/<group>/<name>.yaml`` is the option ``<group>=<name>``; a ``# @package``
header is honoured.
"""

from __future__ import annotations

import re
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

HERE = Path(__file__).resolve().parent
SELFCHECK = HERE.parent / "selfcheck" / "conf"
#: The framework's packaged config trees, relative to a checkout (what trust reads too).
FRAMEWORK_CONF_DIRS = ("src/reprotrain/conf", "src/reprotrain/selfcheck/conf")
_PACKAGE = re.compile(r"#\s*@package\s+(\S+)\s*$")


def package_header(text: str) -> str | None:
    """The ``# @package`` of a YAML file: Hydra reads it from the leading comment lines."""
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            return None
        found = _PACKAGE.match(line)
        if found:
            return found.group(1)
    return None


def store_tree(root: Path, cs: ConfigStore) -> list[str]:
    """Store every ``root/**/<name>.yaml`` as ``<group>/<name>``; return what was stored."""
    stored = []
    for path in sorted(root.rglob("*.yaml")):
        rel = path.relative_to(root)
        group = rel.parent.as_posix() if rel.parent != Path(".") else None
        text = path.read_text(encoding="utf-8")
        node = OmegaConf.create(OmegaConf.load(path) or {})
        cs.store(group=group, name=rel.stem, node=node, package=package_header(text),
                 provider="reprotrain")  # fmt: skip
        stored.append(rel.with_suffix("").as_posix())
    return stored


def register() -> None:
    """Register the wiring, the help page and the self-check job (idempotent)."""
    cs = ConfigStore.instance()
    for root in (HERE, SELFCHECK):
        store_tree(root, cs)
