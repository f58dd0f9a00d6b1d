"""PYTHONHASHSEED only works at interpreter start; the entry point re-execs to fix it."""

import os
import subprocess
import sys

from conftest import REPO

PROBE = """
import sys
sys.path.insert(0, {src!r})
from reprotrain.repro import hashseed
if {ensure}:
    hashseed.ensure()
import os
print(hash("reprotrain"), os.environ.get("PYTHONHASHSEED"))
"""


def run_probe(tmp_path, ensure: bool) -> str:
    script = tmp_path / f"probe_{ensure}.py"
    script.write_text(PROBE.format(src=str(REPO / "src"), ensure=ensure))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    return subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_without_the_control_string_hashes_differ_between_processes(tmp_path):
    outs = {run_probe(tmp_path, ensure=False) for _ in range(3)}
    assert len(outs) > 1  # the randomness source is real (3 equal draws: ~2**-128)


def test_ensure_reexecs_with_a_fixed_hash_seed(tmp_path):
    outs = {run_probe(tmp_path, ensure=True) for _ in range(3)}
    assert len(outs) == 1
    assert outs.pop().endswith(" 0")
