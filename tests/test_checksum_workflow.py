"""The CI checksum job: it trains the portable smoke once and compares with the one pin."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "checksum.yml"


def job() -> dict:
    doc = yaml.safe_load(WORKFLOW.read_text())
    on = doc.get("on", doc.get(True))  # YAML 1.1 reads a bare `on` key as True
    assert on and "pull_request" in on and "push" in on
    (only,) = doc["jobs"].values()
    return only


def test_the_checksum_job_runs_the_portable_pin_test_after_a_locked_install():
    runs = [s.get("run", "") for s in job()["steps"]]
    install = next(i for i, r in enumerate(runs) if r.strip() == "make install")
    check = next(i for i, r in enumerate(runs) if "test_reference_job.py::" in r)
    assert install < check
    assert not any("pip install" in r for r in runs), "install only through make install"
    # The node id names the test that holds the committed portable pin (one place for it).
    node = runs[check].split('"')[1]
    path, name = node.split("::")
    source = (ROOT / path).read_text()
    assert f"def {name}(" in source and "PORTABLE_MICRO[key]" in source
    assert '"repro=portable"' in source


@pytest.mark.skipif(shutil.which("actionlint") is None, reason="actionlint binary not on PATH")
def test_actionlint_checksum() -> None:
    proc = subprocess.run(["actionlint", str(WORKFLOW)], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
