"""Project hygiene a user expects: a licence, pre-commit hooks, lint in CI."""

from __future__ import annotations

import yaml

from conftest import REPO


def test_license_is_mit_for_the_contributors() -> None:
    text = (REPO / "LICENSE").read_text()
    assert text.startswith("MIT License") and "reprotrain contributors" in text


def test_pre_commit_runs_ruff_lint_format_and_the_lock_check() -> None:
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    hooks = {h["id"]: h for repo in config["repos"] for h in repo["hooks"]}
    assert "ruff check" in hooks["ruff-lint"]["entry"]
    assert "ruff format" in hooks["ruff-format"]["entry"]
    assert hooks["check-lock"]["entry"] == "make check-lock"
    assert hooks["check-lock"]["pass_filenames"] is False


def test_a_workflow_runs_make_lint_on_pull_requests() -> None:
    doc = yaml.safe_load((REPO / ".github" / "workflows" / "lint.yml").read_text())
    on = doc.get("on", doc.get(True))  # YAML 1.1 reads a bare `on` key as True
    assert "pull_request" in on and "push" in on
    (job,) = doc["jobs"].values()
    runs = [s.get("run", "") for s in job["steps"]]
    assert "make lint" in runs and "make check-lock" in runs
    assert not any("pip install" in r for r in runs), "install only through make"
