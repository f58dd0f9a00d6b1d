"""A run's overrides and compact config, printed once at its start (docs/seeing-a-run.md).
Closes: a secret or a fake line in the banner (the redacted config, values ``shown``)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from reprotrain.shown import shown

#: Columns of a config line before it wraps.
WIDTH = 100
WHOLE_WORDS = {"break_long_words": False, "break_on_hyphens": False}


def task_overrides() -> list[str]:
    """The command line's overrides, as Hydra parsed them (none outside a Hydra app)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return []
    # Unresolved: iterating the ListConfig would resolve an `${oc.env:...}` the user typed,
    # printing the secret the record keeps as a digest.
    return [str(o) for o in OmegaConf.to_container(HydraConfig.get().overrides.task)]


def _items(value: Any, prefix: str = "") -> list[str]:
    """``key=value`` for each leaf of a mapping, nested keys dotted."""
    if not isinstance(value, dict):
        return [f"{prefix}={_text(value)}"] if prefix else [_text(value)]
    out: list[str] = []
    for key, sub in value.items():
        if key == "_partial_":
            continue
        if key == "_target_" and not prefix:
            out.insert(0, _text(sub))  # the component's class, named first and bare
            continue
        out += _items(sub, f"{prefix}.{key}" if prefix else str(key))
    return out


def _text(value: Any) -> str:
    if value is None:
        return "null"
    if value == "":
        return "''"
    if isinstance(value, list):
        return "[" + ",".join(_text(v) for v in value) + "]"
    return shown(value, 80)


def config_lines(container: dict[str, Any], width: int = WIDTH) -> list[str]:
    """One line per top-level key of the resolved config (wrapped), indented by two."""
    pad = max((len(str(k)) for k in container), default=0) + 2
    lines: list[str] = []
    for key, value in container.items():
        text = " ".join(_items(value)) or "{}"
        lead = f"  {shown(key):<{pad}}"
        lines += textwrap.wrap(
            text, width, initial_indent=lead, subsequent_indent=" " * len(lead), **WHOLE_WORDS
        )
    return lines


def start_banner(container: dict[str, Any], overrides: list[str], resolved: Path) -> str:
    """The run's overrides and its compact resolved config, as one log message."""
    given = " ".join(shown(o) for o in overrides) or "none (the defaults)"
    head = [f"overrides: {given}", f"config (resolved; in full: {shown(resolved)}):"]
    return "\n".join(head + config_lines(container))
