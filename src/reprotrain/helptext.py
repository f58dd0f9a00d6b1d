"""``--help`` that lists the config groups a user can choose from, ``<group>_schema`` nodes
left out (``${reprotrain_config_groups:}`` in ``conf/hydra/help/reprotrain.yaml``)."""

from __future__ import annotations

from typing import Any

RESOLVER = "reprotrain_config_groups"
# Hydra's own groups worth showing: how a sweep is launched. The rest are Hydra internals.
SHOWN_HYDRA_GROUPS = ("hydra/launcher",)


def config_groups(loader: Any, config_name: str, overrides: list[str]) -> dict[str, list[str]]:
    """{group: [options]} from a Hydra ConfigLoader, nested groups and searchpath's too."""
    from hydra.core.object_type import ObjectType

    def options_of(group: str, only: Any) -> list[str]:
        return loader.get_group_options(
            group, results_filter=only, config_name=config_name, overrides=list(overrides)
        )

    groups: dict[str, list[str]] = {}

    def walk(parent: str) -> None:
        for name in sorted(options_of(parent, ObjectType.GROUP)):
            group = f"{parent}/{name}" if parent else name
            if group == "hydra" or (group.startswith("hydra/") and group not in SHOWN_HYDRA_GROUPS):
                continue
            options = [o for o in options_of(group, ObjectType.CONFIG) if not o.endswith("_schema")]
            if options:
                groups[group] = sorted(options)
            walk(group)

    walk("")
    if "hydra" in options_of("", ObjectType.GROUP):
        for group in SHOWN_HYDRA_GROUPS:
            if options := options_of(group, ObjectType.CONFIG):
                groups[group] = sorted(options)
    return groups


def format_groups(groups: dict[str, list[str]], choices: dict[str, Any]) -> str:
    """Aligned lines ``group  opt_a*, opt_b`` (``*``: chosen; ``debug: null``: "(none chosen)")."""
    width = max((len(g) for g in groups), default=0)
    lines = []
    for group, options in groups.items():
        value = choices.get(group)
        many = isinstance(value, list | tuple) or type(value).__name__ == "ListConfig"
        picked = set() if value is None else {str(v) for v in (value if many else [value])}
        shown = ", ".join(f"{o}*" if o in picked else o for o in options)
        note = "   (none chosen)" if group in choices and not picked else ""
        lines.append(f"  {group.ljust(width)}  {shown}{note}")
    return "\n".join(lines)


#: The template without ``--help``: Hydra resolves it for every run, and listing takes seconds.
NOT_ASKED = "  (listed by --help)"


def help_asked(argv: list[str]) -> bool:
    return "--help" in argv or "-h" in argv


def _resolve(*, _root_: Any) -> str:
    import sys

    from hydra.core.global_hydra import GlobalHydra

    if not help_asked(sys.argv[1:]):
        return NOT_ASKED
    gh = GlobalHydra.instance()
    if not gh.is_initialized():  # pragma: no cover - only reachable outside Hydra's --help
        return "  (config groups are listed when run through Hydra's --help)"
    hydra = _root_.hydra
    groups = config_groups(gh.config_loader(), hydra.job.config_name, list(hydra.overrides.hydra))
    return format_groups(groups, dict(hydra.runtime.choices))


def register_resolver() -> None:
    """Make ``${reprotrain_config_groups:}`` available; idempotent."""
    from reprotrain.hydra_api import register_resolver

    register_resolver(RESOLVER, _resolve)
