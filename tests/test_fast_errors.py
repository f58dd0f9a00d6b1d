"""A typo or a bad value fails before torch is imported: in about a second, in one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, base_env

PROBE = """
import sys
sys.argv = ["reprotrain.train", "experiment=selfcheck", *sys.argv[1:]]
from reprotrain import preflight
try:
    preflight.cli_check()
except SystemExit as e:
    print("exit", e.code, "torch imported:", "torch" in sys.modules)
"""


@pytest.mark.parametrize(
    "override",
    ["trainer.epoch=3", "trainer.batch_size=0", "trainer.early_stopping_patience=-1"],
)
def test_a_bad_override_is_refused_without_importing_torch(override):
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, override],
        cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.stdout.strip() == "exit 2 torch imported: False", proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1
