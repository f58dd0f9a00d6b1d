"""The seam between the framework and the user's room, checked statically.

The framework (src/reprotrain, scripts, the framework tests) names no concrete dataset or
model and never imports the user's package, so a project can replace or delete everything in
it. (That it then still runs is tests/test_new_project.py's deletion test.)
"""

from __future__ import annotations

import re

from conftest import REPO
from reprotrain.tools.template import template_files as tf

USER = tf.TEMPLATE_PACKAGE


def framework_files(suffix: str) -> list:
    return [
        p
        for p in REPO.rglob(f"*{suffix}")
        if ".venv" not in p.parts
        and (
            tf.is_framework(rel := str(p.relative_to(REPO)), USER) or tf.is_template_only(rel, USER)
        )
    ]


def test_the_framework_names_no_concrete_dataset_or_model():
    hits = [
        f"{p.relative_to(REPO)}:{n}"
        for p in (REPO / "src" / "reprotrain").rglob("*")
        if p.is_file() and p.suffix in (".py", ".yaml", ".md", ".txt")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"cifar|resnet", line, re.IGNORECASE)
    ]
    assert hits == []


def test_framework_code_and_tests_never_import_the_users_package():
    imports = re.compile(rf"^\s*(from|import)\s+{USER}\b|[\"']{USER}\.\w", re.MULTILINE)
    hits = [
        str(p.relative_to(REPO)) for p in framework_files(".py") if imports.search(p.read_text())
    ]
    assert hits == []


# The GPU figures measure what users run (the template's reference job, ResNet-18 at batch
# 512): these two template-only files name it, and nothing else of the framework does. They
# never reach a project (template_files), and they build the model from conf/, importing no
# package of the user's room (the test above).
REFERENCE_FIGURES = {"scripts/benchmarks/gpu_check.py", "scripts/benchmarks/reference_model.py"}


def test_benchmarks_drills_and_self_checks_train_the_frameworks_own_job():
    runners = [*(REPO / "scripts").glob("*"), *(REPO / "scripts/benchmarks").glob("*.py")]
    runners.append(REPO / "tests" / "conftest.py")  # MICRO: what the framework tests train
    users = re.compile(r"experiment=(smoke|cifar10_resnet18)\b")
    hits = [str(p.relative_to(REPO)) for p in runners if p.is_file()]
    named = [h for h in hits if users.search((REPO / h).read_text())]
    assert hits and sorted(set(named) - REFERENCE_FIGURES) == []
    assert all(tf.is_template_only(f, USER) for f in REFERENCE_FIGURES)
