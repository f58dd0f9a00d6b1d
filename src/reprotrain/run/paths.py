"""The one gate for a file or directory that a config value names inside a run directory.

Closes: a config value (a logger's file name, a callback's folder, a run's ``name``) that
writes outside the run, by an absolute path, by ``..``, or through a symlink that leads out.
Every shipped component and every key that forms a run's own directory resolves such a value
here, and nowhere else (tests/test_run_paths.py lists the keys and tries each).
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from reprotrain.errors import ReprotrainError
from reprotrain.shown import shown


class PathOutsideRun(ReprotrainError):
    """A config value names a path that is not inside the run directory."""


def inside(run_dir: str | os.PathLike, value: str | os.PathLike, key: str) -> Path:
    """``run_dir / value`` when ``value`` is a relative path that stays inside ``run_dir``:
    no absolute path, no ``..``, no empty part, and no symlink (among the parts that exist)
    that resolves outside it. Otherwise one line naming ``key``."""
    text = os.fspath(value)
    why = _why_not(text)
    if why is None:
        base = Path(run_dir).resolve()
        target = Path(run_dir, text)
        resolved = target.resolve()
        if resolved != base and base not in resolved.parents:
            why = "it leads out of the run directory through a symlink"
    if why is not None:
        raise PathOutsideRun(
            f"{key}={shown(text)}: {why}; give a path relative to the run directory, without "
            "'..' (e.g. metrics.csv or logs/metrics.csv)"
        )
    return target


def _why_not(text: str) -> str | None:
    if not text or not text.strip():
        return "it is empty"
    if "\x00" in text:
        return "it holds a NUL byte"
    if os.path.isabs(text) or text.startswith("~"):
        return "it is absolute"
    parts = PurePosixPath(text.replace(os.sep, "/")).parts
    if ".." in parts:
        return "it climbs out with '..'"
    return None
