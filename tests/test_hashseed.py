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


def make_sees(env_value: str | None) -> str:
    """$PYTHONHASHSEED as a recipe started by this Makefile sees it."""
    import shutil

    import pytest

    if shutil.which("make") is None:
        pytest.skip("needs make")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if env_value is not None:
        env["PYTHONHASHSEED"] = env_value
    rule = 'show-hashseed: ; @printf %s "$$PYTHONHASHSEED"'
    proc = subprocess.run(["make", "-s", f"--eval={rule}", "show-hashseed"], cwd=REPO, env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return proc.stdout


def test_make_keeps_a_users_own_hash_seed_and_fixes_it_otherwise():
    """Issue 26: `export PYTHONHASHSEED := 0` silently replaced a user's 123."""
    assert make_sees("123") == "123"
    assert make_sees(None) == "0"


def test_a_users_numeric_hash_seed_is_kept_and_recorded(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(
        f"import sys; sys.path.insert(0, {str(REPO / 'src')!r})\n"
        "from reprotrain.repro import hashseed, determinism\n"
        "hashseed.ensure()\n"
        "print(determinism.effective_flags('strict')['pythonhashseed'])\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                         text=True, check=True).stdout.strip()  # fmt: skip
    assert out == "123"
