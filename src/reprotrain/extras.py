"""The optional extras, one list: each a hashed lock of its own (``requirements-<extra>.lock``),
installed with ``make install EXTRAS=...``.

A room of its own on the bottom floor: the lock tool (``repro/requirements_lock.py``) compiles
and checks one lock per extra, the loggers name the extra a backend needs; neither imports the
other for it (docs/design.md, "The framework's rooms").
"""

from __future__ import annotations

#: {extra: its head package}. An extra counts as installed when its head package is; then its
#: whole lock is expected. Each names the logger backend it brings.
EXTRAS: dict[str, str] = {"mlflow": "mlflow", "wandb": "wandb"}


def install_command(*extras: str) -> str:
    """The one command that installs the hashed, locked extras."""
    return f"make install EXTRAS={','.join(extras)}"


EXTRAS_INSTALL = install_command(*EXTRAS)
