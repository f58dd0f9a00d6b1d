"""Every tool answers --help; every user error is one line; paths survive Hydra, shell, Make."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from conftest import REPO, base_env
from reprotrain.errors import ReprotrainError
from reprotrain.quoting import hydra_override, hydra_value, make_assignment, resume_hint
from reprotrain.tools import cli

TOOLS = [
    "archive.archive",
    "reproduce.reproduce",
    "runs.resume",
    "runs.verify",
    "locks.check_lock",
    "locks.env_check",
]
AWKWARD = [
    "/tmp/run a, ü(x)'q'~#&=[",
    "/tmp/x;touch /tmp/PWNED;echo",
    "a\\b",
    "trailing\\",
    "quote\\'s",
    "${oc.env:HOME}",
    "lit\\${x}",
    'dq"x',
    "$HOME `id` $(id)",
    "tab\there",
    "日本語/データ",
]


def run(*cmd: str, cwd: Path = REPO, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        list(cmd), cwd=cwd, env=base_env(), capture_output=True, text=True, timeout=120, **kw
    )


@pytest.mark.parametrize("name", TOOLS)
def test_every_tool_answers_help_with_usage_and_exit_0(name):
    proc = run(sys.executable, "-m", f"reprotrain.tools.{name}", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m reprotrain.tools.") and not proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_the_drill_answers_help():
    proc = run(sys.executable, "scripts/kill_resume_trials.py", "--help")
    assert proc.returncode == 0 and "--trials" in proc.stdout and not proc.stderr


@pytest.mark.parametrize("name", ["archive.archive", "reproduce.reproduce", "runs.resume"])
def test_resume_archive_reproduce_never_take_help_for_a_path(name, tmp_path):
    proc = run(sys.executable, "-m", f"reprotrain.tools.{name}", "--help", cwd=tmp_path)
    assert proc.returncode == 0 and not list(tmp_path.iterdir())


def test_entry_point_turns_user_errors_into_one_line(capsys):
    @cli.entry_point
    def fails(kind: str) -> int:
        if kind == "user":
            raise ReprotrainError("first line\nsecond line")
        if kind == "os":
            raise NotADirectoryError(20, "Not a directory", "/x/file")
        if kind == "usage":
            cli.parser("reprotrain.tools.demo", None).parse_args(["--nope"])
        raise RuntimeError("a bug keeps its traceback")

    assert fails("user") == 2
    assert capsys.readouterr().err == "error: first line; second line\n"
    assert fails("os") == 2
    assert capsys.readouterr().err == "error: /x/file: Not a directory\n"
    assert fails("usage") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: python -m reprotrain.tools.demo: unrecognized arguments")
    assert err.count("\n") == 1
    with pytest.raises(RuntimeError):
        fails("bug")


@pytest.mark.parametrize("value", AWKWARD)
def test_hydra_values_parse_back_to_the_exact_path(value):
    """Through Hydra's override parser and OmegaConf's interpolation, unchanged."""
    override = OverridesParser.create().parse_override(hydra_override("hydra.run.dir", value))
    node = OmegaConf.create({"v": override.value()})
    assert node.v == value


@pytest.mark.parametrize("value", AWKWARD)
def test_printed_hints_survive_the_shell(value):
    """What the user pastes is one argument with the exact text, and runs nothing."""
    words = shlex.split(resume_hint(value))
    assert words == ["make", "resume", f"RUN={value}"]
    echoed = run("sh", "-c", f"printf %s {make_assignment('RUN', value)}")
    assert echoed.stdout == f"RUN={value}"


def _make_ready() -> bool:
    if shutil.which("make") is None:
        return False
    # Never let a test install the venv: only run make when its stamp is up to date.
    return run("make", "-q", ".venv/.installed").returncode == 0


@pytest.mark.skipif(not _make_ready(), reason="needs make and an installed .venv")
def test_make_resume_does_not_execute_an_injected_command(tmp_path):
    pwned = tmp_path / "PWNED"
    for text in (f"{tmp_path}/x;touch {pwned};echo", f"$(touch {pwned})", f"`touch {pwned}`"):
        proc = run("make", "-s", "resume", f"RUN={text}")
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert not pwned.exists()
        errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
        assert len(errors) == 1 and "no such run directory" in errors[0]
        assert text in errors[0], "the path arrives as typed"


@pytest.mark.skipif(not _make_ready(), reason="needs make and an installed .venv")
def test_make_variables_for_paths_are_passed_as_one_argument():
    awkward = "/tmp/a b, c ü(x)'q'~#&=["
    proc = run(
        "make", "-n", "reproduce", f"ARCHIVE={awkward}", f"TRUSTED_SIGNERS={awkward}", "TRUST=1"
    )
    (line,) = [x for x in proc.stdout.splitlines() if "bin/reprotrain " in x]
    argv = shlex.split(line)
    assert argv[argv.index("reproduce") + 1] == awkward
    assert argv[argv.index("--trusted-signers") + 1] == awkward and "--trust" in argv
    proc = run("make", "-n", "reproduce", "ARCHIVE=x", "TRUST=0")
    assert "--trust" not in proc.stdout


def test_resume_hint_is_make_resume_with_a_quoted_run():
    assert resume_hint("/tmp/plain") == "make resume RUN=/tmp/plain"
    assert resume_hint("/tmp/a b") == "make resume 'RUN=/tmp/a b'"
    assert hydra_value("/tmp/plain") == "'/tmp/plain'"


CHILD = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
    "sys.exit(3)\n"
)
PARENT = (
    "import os, sys\n"
    "from reprotrain.tools.runs.resume import run_forwarding_signals\n"
    "sys.exit(run_forwarding_signals([sys.executable, '-c', sys.argv[1]], dict(os.environ)))\n"
)


@pytest.mark.parametrize("sig, expected", [("SIGTERM", 75), ("SIGUSR2", 128 + 12)])
def test_resume_forwards_termination_signals_and_returns_the_trainers_code(sig, expected):
    """make resume runs the trainer as a child: a scheduler's signal must still reach it."""
    import signal as signals

    proc = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD],
        env=base_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(getattr(signals, sig))
        assert proc.wait(timeout=30) == expected
    finally:
        proc.kill()
