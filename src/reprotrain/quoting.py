"""Quoting for the three languages a path passes through: Hydra overrides, the shell, Make;
and dotted keys, as overrides name them (``{"trainer": {"epochs": 30}}`` is ``trainer.epochs``).

Closes: a run directory with a space, a comma, ``'``, ``~``, ``#``, ``=``, ``[``, ``(`` or a
non-ASCII character breaking ``make resume`` (Hydra's override lexer rejects it) or, worse,
being executed (``RUN=/tmp/x;touch /tmp/PWNED``). Every tool that builds an override from a
path, and every hint printed for a user to paste, goes through these functions.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

__all__ = [
    "flatten", "hydra_override", "hydra_value", "make_assignment", "resume_hint", "shell_quote",
]  # fmt: skip


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (with ``prefix`` before every key); lists and
    scalars are leaves."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def hydra_value(value: str) -> str:
    """``value`` as a single-quoted Hydra override value that parses back to ``value``.

    Hydra resolves ``${...}`` even inside quotes, so ``${`` is escaped for OmegaConf; inside a
    quoted value a run of backslashes is literal unless a quote (or the closing quote)
    follows it, so only those runs are doubled.
    """
    v = re.sub(r"(\\*)(\$\{)", lambda m: m.group(1) * 2 + "\\${", str(value))
    v = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", v)
    v = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, v)
    return f"'{v}'"


def hydra_override(key: str, value: str | Path) -> str:
    """``key='value'``: one command-line override, safe for any path."""
    return f"{key}={hydra_value(str(value))}"


def shell_quote(value: str | Path) -> str:
    return shlex.quote(str(value))


def make_assignment(name: str, value: str | Path) -> str:
    """``NAME=value`` quoted for the shell; the Makefile reads it with ``$(value NAME)``, so
    ``$`` needs no doubling and nothing in ``value`` is expanded by Make or the shell."""
    return shlex.quote(f"{name}={value}")


def resume_hint(run_dir: str | Path) -> str:
    """The command a user pastes to continue ``run_dir``: ``make resume RUN='...'``."""
    return f"make resume {make_assignment('RUN', run_dir)}"
