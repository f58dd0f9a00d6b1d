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
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.object_type import ObjectType
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


def stored(cs: ConfigStore, name: str, group: str | None = None) -> bool:
    """Whether ``group/name`` is in the store (a lookup: ``cs.load`` would deep-copy it)."""
    return cs.get_type(f"{group}/{name}.yaml" if group else f"{name}.yaml") is ObjectType.CONFIG


def store_once(cs: ConfigStore, name: str, node: Any, group: str | None = None, **kw: Any) -> None:
    """``cs.store``, unless ``group/name`` is stored already: registering is idempotent, and
    Hydra 1.4 warns when a name is stored again (1.5 will refuse it)."""
    if not stored(cs, name, group):
        cs.store(name=name, node=node, group=group, **kw)


def store_tree(root: Path, cs: ConfigStore) -> None:
    """Store every ``root/**/<name>.yaml`` not stored yet as ``<group>/<name>``."""
    for path in sorted(root.rglob("*.yaml")):
        rel = path.relative_to(root)
        group = rel.parent.as_posix() if rel.parent != Path(".") else None
        if not stored(cs, rel.stem, group):  # parsed once per process
            text = path.read_text(encoding="utf-8")
            node = OmegaConf.create(OmegaConf.load(path) or {})
            cs.store(name=rel.stem, node=node, group=group, package=package_header(text),
                     provider="reprotrain")  # fmt: skip


def hydra_callback_targets() -> set[str]:
    """The ``_target_`` of each Hydra callback the wiring declares: what Hydra itself builds
    before the run starts, so Hydra 1.4's allowlist must name it (``train.cli``)."""
    from reprotrain.allowlist import targets_in

    wiring = OmegaConf.load(HERE / "reprotrain.yaml")
    return targets_in(OmegaConf.select(wiring, "hydra.callbacks", default={}))


def register() -> None:
    """Register the wiring, the help page and the self-check job (idempotent)."""
    cs = ConfigStore.instance()
    for root in (HERE, SELFCHECK):
        store_tree(root, cs)
