"""CI runs what the README says, first: `.ci/run` opens with the README's two commands,
exactly as written, before it installs anything; what `make test` skipped for a missing
extra or binary is listed, and run again once CI has installed it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import REPO
from test_test_policy import inner_pytest


def readme_two_commands() -> list[str]:
    """The lines of the first two blocks of the README's "Two commands", without comments."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)[:2]
    lines = [line.split("#", 1)[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line]


def ci_commands() -> list[str]:
    """.ci/run's command lines, comments and blank lines left out, in order."""
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    out = [line.split(" #", 1)[0].strip() for line in lines if not line.lstrip().startswith("#")]
    return [line for line in out if line and not line.startswith(("set -", 'cd "$(dirname'))]


def test_ci_opens_with_the_readmes_two_commands_exactly_and_installs_nothing_before():
    readme = readme_two_commands()
    assert readme == ['make train ARGS="experiment=smoke"', "make test"]
    assert ci_commands()[:2] == readme
    assert (REPO / ".ci" / "run").read_text().startswith("#!/usr/bin/env bash\n")


def test_ci_installs_the_extras_then_runs_what_make_test_skipped_for_them():
    commands = ci_commands()
    installs = [i for i, c in enumerate(commands) if "EXTRAS=" in c or "apt_install" in c]
    assert installs and min(installs) > 1
    extras = max(i for i in installs if "EXTRAS=" in commands[i])
    assert commands.index("make test-skipped") > extras
    assert commands.index("make test-slow") == len(commands) - 1


def test_make_test_prints_the_15_slowest_and_lists_what_it_skipped_for_an_install():
    recipe = subprocess.run(["make", "-n", "test"], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout  # fmt: skip
    assert "--durations=15" in recipe
    assert "--skipped-to=build/tests/skipped-for-installs.txt" in recipe


def test_the_tests_skipped_for_an_extra_or_a_binary_are_listed_and_run_again(tmp_path):
    source = """
        import pytest

        def test_extra():
            pytest.importorskip("reprotrain_no_extra", reason="optional extra not installed: x")

        def test_binary():
            pytest.skip("qemu-x86_64 not on PATH")

        def test_device():
            pytest.skip("needs a CUDA device")

        def test_runs():
            pass
        """
    listed = tmp_path / "out" / "skipped.txt"
    proc = inner_pytest(tmp_path, source, f"--skipped-to={listed}")
    assert proc.returncode == 0, proc.stdout
    assert listed.read_text().splitlines() == [
        "test_inner.py::test_binary", "test_inner.py::test_extra",
    ]  # fmt: skip
    again = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "-rA", f"@{listed}"], cwd=tmp_path, capture_output=True, text=True,
                           env=inner_env(), check=False)  # fmt: skip
    assert "2 skipped" in again.stdout and "test_device" not in again.stdout, again.stdout


def inner_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "tests"), str(REPO / "src")]))
