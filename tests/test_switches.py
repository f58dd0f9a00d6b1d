"""Make switches read as people write them: 0/no/false/off (or nothing) is off, 1/yes/true/on
is on, anything else is one error line before the job runs (the Makefile's ``on`` and
``check_switches``)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from conftest import REPO, base_env

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")

#: (target, switch, the flag it turns on, the target's other required variables)
SWITCHES = [
    ("verify", "KILL", "--kill", []),
    ("archive", "WITH_CKPT", "--with-checkpoint", ["RUN=r"]),
    ("archive", "ALLOW_INCOMPLETE", "--allow-incomplete", ["RUN=r"]),
    ("reproduce", "ALLOW_DATA_DRIFT", "--allow-data-drift", ["ARCHIVE=a.tar.gz"]),
    ("reproduce", "TRUST", "--trust", ["ARCHIVE=a.tar.gz"]),
]


def make(*args: str, dry: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in base_env().items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    cmd = ["make", "-s", "--no-print-directory", *(["-n"] if dry else []), *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("target", "switch", "flag", "rest"), SWITCHES)
def test_each_switch_is_off_for_0_no_false_off_and_on_for_1_yes_true_on(target, switch, flag, rest):
    for value in ("0", "no", "false", "off", "OFF", ""):
        proc = make(target, f"{switch}={value}", *rest)
        assert flag not in proc.stdout, f"{switch}={value!r} turned {flag} on"
    for value in ("1", "yes", "true", "on", "True"):
        proc = make(target, f"{switch}={value}", *rest)
        assert flag in proc.stdout, f"{switch}={value!r} left {flag} off"


@pytest.mark.parametrize("value", ["maybe", "2", "1 0"])
def test_a_value_that_is_no_switch_is_one_line_before_the_job(value):
    proc = make("verify", f"KILL={value}", dry=False)
    assert proc.returncode == 2
    lines = [x for x in proc.stderr.splitlines() if not x.startswith("make: ")]
    assert lines == [
        f"error: KILL={value} is not a switch; write KILL=1 (or yes/true/on) to turn it on; "
        "KILL=0 (or no/false/off) or nothing leaves it off"
    ]
    assert "verify" not in proc.stdout


def test_make_sweep_with_an_empty_seed_list_is_one_line_not_one_job():
    proc = make("sweep", "SEEDS=", "ARGS=experiment=selfcheck", dry=False)
    assert proc.returncode == 2
    lines = [x for x in proc.stderr.splitlines() if not x.startswith("make: ")]
    assert len(lines) == 2 and "has an empty seed" in lines[0], proc.stderr
    assert lines[1] == "reprotrain sweep: exit 2 (refused or failed (one error: line))"
