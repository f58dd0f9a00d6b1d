"""Which files of a project are the framework's and which are the user's.

The framework's files are identical, byte for byte, in the template and in every project made
from it (``make new-project`` copies them untouched) and only they are changed by
``make update-template``. Everything else belongs to the project: its own package (the
template's is ``src/starter``, renamed by new-project), its tests (``tests/<package>/``), its
config groups and experiments, README, LICENSE, dependencies and locks. Standard library
only: new-project runs before any venv exists.
"""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATE_PACKAGE = "starter"  # the user's package in the template itself
FRAMEWORK_PACKAGE = "reprotrain"
RECORD = ".template.json"  # in a project: where it came from (like copier's answers file)

# Framework paths (files or folders), relative to the repository root.
FRAMEWORK = (
    "src/reprotrain",
    "tests",  # minus tests/<user package>/, see framework_pathspecs
    "scripts",
    "Makefile",
    "Dockerfile",
    ".dockerignore",
    ".ci",
    ".github",
    ".pre-commit-config.yaml",
    "conf/seed",  # the project-owned, schema-typed config groups and Hydra's own
    "conf/repro",
    "conf/trainer",
    "conf/logger",
    "conf/debug",
    "conf/hydra",
)


def user_tests(package: str) -> str:
    return f"tests/{package}"


def is_framework(rel: str, package: str) -> bool:
    """True for a framework file; ``package`` is the user's package name of this checkout."""
    if rel == user_tests(package) or rel.startswith(user_tests(package) + "/"):
        return False
    return any(rel == p or rel.startswith(p + "/") for p in FRAMEWORK)


def framework_pathspecs(package: str) -> list[str]:
    """The framework paths as git pathspecs for a checkout whose user package is ``package``."""
    return ["--", *FRAMEWORK, f":(exclude){user_tests(package)}"]


def read_record(root: Path) -> dict | None:
    path = root / RECORD
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def write_record(root: Path, record: dict) -> None:
    record = {**record, "framework_files": list(FRAMEWORK)}
    record["user_files"] = (
        f"everything else: src/{record['package']}/, tests/{record['package']}/, conf/train.yaml "
        "and the user's config groups, README.md, LICENSE, pyproject.toml, requirements*, "
        "docker/base-image.env, docs/"
    )
    text = json.dumps(record, indent=2) + "\n"
    (root / RECORD).write_text(text, encoding="utf-8")
