"""Quoting for Hydra overrides, the shell and Make; dotted keys as overrides name them.

Closes: a path with a space, quote or ``;`` breaking ``make resume`` or being executed.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

__all__ = ["flatten", "hydra_override", "hydra_value", "make_assignment", "resume_hint"]


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (``prefix`` first); lists are leaves."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def hydra_value(value: str) -> str:
    """``value`` single-quoted for Hydra, parsing back to ``value``: ``${`` escaped (resolved
    even in quotes), backslash runs doubled only before a quote or the end."""
    v = re.sub(r"(\\*)(\$\{)", lambda m: m.group(1) * 2 + "\\${", str(value))
    v = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", v)
    v = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, v)
    return f"'{v}'"


def hydra_override(key: str, value: str | Path) -> str:
    """``key='value'``: one command-line override, safe for any path."""
    return f"{key}={hydra_value(str(value))}"


def make_assignment(name: str, value: str | Path) -> str:
    """``NAME=value`` quoted for the shell (Make reads ``$(value NAME)``: nothing expanded)."""
    return shlex.quote(f"{name}={value}")


def resume_hint(run_dir: str | Path) -> str:
    """The command a user pastes to continue ``run_dir``: ``make resume RUN='...'``."""
    return f"make resume {make_assignment('RUN', run_dir)}"
