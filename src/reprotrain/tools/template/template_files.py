"""Which files of the template a project receives, whose they are, and which stay behind.

``FRAMEWORK`` (shipped byte for byte, changed only by ``make update-template``), the user's
room (``user_room``: copied once, renamed) or ``TEMPLATE_ONLY`` (tests, benchmarks, drills);
``test_new_project`` checks every tracked file is in exactly one. Standard library only.
"""

from __future__ import annotations

import json
from fnmatch import fnmatchcase
from pathlib import Path

TEMPLATE_PACKAGE = "starter"  # the user's package in the template itself
FRAMEWORK_PACKAGE = "reprotrain"
RECORD = ".template.json"  # in a project: where it came from (like copier's answers file)

# Framework paths (files or folders), relative to the repository root.
FRAMEWORK = (
    "src/reprotrain",
    "src/hydra_plugins",  # the framework's Hydra plugins (hydra/sweeper=optuna)
    "docs",  # the manual (a docs site): the framework's, so update-template refreshes it
    "mkdocs.yml",
    "Makefile",
    "Dockerfile",
    ".dockerignore",
    ".ci",
    ".github/workflows/lint.yml",
    ".github/workflows/reproduce.yml",
    ".pre-commit-config.yaml",
    "scripts/pin_base.py",  # make pin-base: the project's own container base
    "conf/seed",  # the project-owned, schema-typed config groups and Hydra's own
    "conf/repro",
    "conf/trainer",
    "conf/logger",
    "conf/debug",
    "conf/hydra",
)

# The user's room, besides the package itself (fnmatch patterns; a folder takes its files).
USER_ROOM = (
    "conf",
    "pyproject.toml",
    "requirements*.in",
    "requirements*.lock*",
    "docker",
    ".gitignore",
    "README.md",  # the template's own README stays; new-project writes the project's
    "LICENSE",
)

# The framework's own tests, benchmarks, drills, maintainer scripts and notes: template only.
TEMPLATE_NOTES = "docs/notes"  # under docs/, but the template's own
TEMPLATE_ONLY = (
    "tests",  # the framework's tests (tests/<package>: the example room's, see user_room)
    "scripts",
    ".github/workflows/checksum.yml",  # pins the template's reference bits
    TEMPLATE_NOTES,
)
# Written into the room by new-project instead of copied from the template.
WRITTEN = ("README.md", "LICENSE", "tests")


def _under(rel: str, patterns: tuple[str, ...] | list[str]) -> bool:
    return any(rel == p or rel.startswith(p + "/") or fnmatchcase(rel, p) for p in patterns)


def is_framework(rel: str, package: str) -> bool:
    """True for a file every project holds byte for byte (``package``: this checkout's)."""
    return _under(rel, FRAMEWORK) and not _under(rel, [TEMPLATE_NOTES])


def is_user_room(rel: str, package: str) -> bool:
    """The user's package and tests, conf/ (less the framework's groups), deps, locks, README."""
    room = (f"src/{package}", f"tests/{package}", *USER_ROOM)
    return not is_framework(rel, package) and _under(rel, room)


def is_template_only(rel: str, package: str) -> bool:
    """True for the framework's own checks and tools that a project does not receive."""
    owned = is_framework(rel, package) or is_user_room(rel, package)
    return not owned and _under(rel, TEMPLATE_ONLY)


def ships(rel: str, package: str) -> bool:
    """True for a template file new-project copies into a project."""
    return is_framework(rel, package) or (is_user_room(rel, package) and not _under(rel, WRITTEN))


def framework_pathspecs() -> list[str]:
    """The framework paths as git pathspecs."""
    return ["--", *FRAMEWORK, f":(exclude){TEMPLATE_NOTES}"]


def read_record(root: Path) -> dict | None:
    path = root / RECORD
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def write_record(root: Path, record: dict) -> None:
    record = {**record, "framework_files": list(FRAMEWORK)}
    record["user_files"] = (
        f"everything else: src/{record['package']}/, tests/, conf/train.yaml and the user's "
        "config groups, README.md, LICENSE, pyproject.toml, requirements*, docker/base-image.env"
    )
    (root / RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
