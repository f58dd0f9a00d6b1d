"""The ``reprotrain`` console script: one command per job, each keeping its exit code, also
through Make (make itself exits 2 on any failure; the job's code goes to EXIT_FILE and to one
stderr line)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from conftest import MICRO, REPO, TINY, base_env, run_json
from reprotrain import commands
from test_statistical_verdict import fake_sweep

SCRIPT = Path(sys.executable).with_name("reprotrain")
#: The installed console script; the container runs from PYTHONPATH without installing the
#: package, and there ``python -m reprotrain`` is the same function.
CLI = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "reprotrain"]


def cli(*args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args], cwd=REPO, env=env or base_env(), capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def error_lines(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if x.startswith("error:")]


# --------------------------------------------------------------------------- the command set


def test_pyproject_declares_the_reprotrain_console_script_and_keeps_reprotrain_train():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["reprotrain"] == "reprotrain.commands:main"
    assert scripts["reprotrain-train"] == "reprotrain.train:cli"
    try:
        installed = metadata.entry_points(group="console_scripts", name="reprotrain")
    except metadata.PackageNotFoundError:  # pragma: no cover - PYTHONPATH-only container
        installed = ()
    for ep in installed:
        assert ep.value == "reprotrain.commands:main"


def test_help_lists_every_command_with_its_exit_codes():
    proc = cli("--help")
    assert proc.returncode == 0, proc.stderr
    for name, command in commands.COMMANDS.items():
        assert re.search(rf"^  {re.escape(name)} ", proc.stdout, re.M), name
        for code, meaning in command.exit_codes.items():
            assert f"{code} {meaning}" in proc.stdout
    for job in ("train", "verify", "resume", "sweep", "archive", "reproduce", "bisect",
                "compare", "eval", "report"):  # fmt: skip
        assert job in commands.COMMANDS


JOBS = ("train", "sweep", "verify", "resume", "archive", "reproduce", "bisect", "compare",
        "eval", "report", "bench", "drill")  # fmt: skip


def make_recipes() -> dict[str, str]:
    recipes: dict[str, str] = {}
    current = None
    for line in (REPO / "Makefile").read_text().splitlines():
        if m := re.match(r"^([a-z-]+):", line):
            current = m.group(1)
            recipes[current] = ""
        elif current and line.startswith("\t"):
            recipes[current] += line + "\n"
    return recipes


def test_every_make_job_recipe_calls_its_reprotrain_command():
    recipes = make_recipes()
    for job in JOBS:
        assert re.search(rf"^\t\$\(RT\) {job}( |$)", recipes[job], re.M), recipes[job]
        # (A template-only job first says in one line where it lives: `in_template`.)
        runs = "\n".join(x for x in recipes[job].splitlines() if "in_template" not in x)
        assert "-m reprotrain" not in runs and "scripts/" not in runs, job
        assert job in commands.COMMANDS


@pytest.mark.parametrize("name", [n for n in commands.COMMANDS if n not in ("train", "gpu-check")])
def test_every_command_answers_help_with_exit_0(name, capfd):
    assert commands.main([name, "--help"]) == 0
    out = capfd.readouterr().out
    assert "usage:" in out


def test_train_help_is_the_trainers_own_through_the_console_script():
    proc = cli("train", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "experiment" in proc.stdout and "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------ exit code 2


@pytest.mark.parametrize("argv", [[], ["nope"], ["--exit-bogus", "train"]])
def test_a_missing_or_unknown_command_is_exit_2(argv):
    proc = cli(*argv)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    if argv:
        assert len(error_lines(proc.stderr)) == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["compare", "--bogus", "a", "b"],
        ["resume", "{missing}"],
        ["archive", "{missing}"],
        ["reproduce", "{missing}.tar.gz"],
        ["bisect", "{missing}", "{missing}"],
        ["compare", "{missing}", "{missing}"],
        ["eval", "{missing}"],
        ["report", "{missing}"],
        ["summary", "{missing}"],
    ],
)
def test_a_bad_argument_to_a_job_is_one_error_line_and_exit_2(argv, tmp_path, capsys):
    argv = [a.format(missing=tmp_path / "nope") for a in argv]
    assert commands.main(argv) == 2
    err = capsys.readouterr().err
    assert len(error_lines(err)) == 1 and "Traceback" not in err, err


# ---------------------------------------------------------------- verdicts: compare, bisect


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sweeps")
    return {
        "a": fake_sweep(root / "a", {"": [0.80, 0.82, 0.81]}),
        "same": fake_sweep(root / "same", {"": [0.805, 0.815, 0.81]}),
        "worse": fake_sweep(root / "worse", {"": [0.60, 0.62, 0.61]}),
        "one": fake_sweep(root / "one", {"": [0.81]}),
    }


@pytest.mark.parametrize(
    ("b", "code", "verdict"),
    [("same", 0, "CONSISTENT"), ("worse", 1, "INCONSISTENT"), ("one", 3, "INCONCLUSIVE")],
)
def test_compare_keeps_its_verdict_codes_through_the_console_script(sweeps, b, code, verdict):
    proc = cli("compare", str(sweeps["a"]), str(sweeps[b]))
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert verdict in proc.stdout


def test_exit_file_and_exit_line_carry_the_jobs_code(sweeps, tmp_path, capsys):
    rc = tmp_path / "rc"
    assert commands.main(["--exit-file", str(rc), "--exit-line", "compare",
                          str(sweeps["a"]), str(sweeps["worse"])]) == 1  # fmt: skip
    assert rc.read_text() == "1\n"
    assert capsys.readouterr().err.splitlines()[-1] == "reprotrain compare: exit 1 (INCONSISTENT)"
    same = [f"--exit-file={rc}", "compare", str(sweeps["a"]), str(sweeps["same"])]
    assert commands.main(same) == 0
    assert rc.read_text() == "0\n", "0 is written too: a stale 1 never survives a success"
    assert commands.main(["--exit-file", str(tmp_path / "no" / "rc"), "compare"]) == 2


def _make_ready() -> bool:
    if shutil.which("make") is None:
        return False
    # Never let a test install the venv: only run make when its stamp is up to date.
    stamp = subprocess.run(["make", "-q", ".venv/.installed"], cwd=REPO, capture_output=True)
    return stamp.returncode == 0


def make(*args: str) -> subprocess.CompletedProcess:
    # A fresh top-level make, also when the suite itself runs under `make test`.
    env = {k: v for k, v in base_env().items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    return subprocess.run(["make", "-s", "--no-print-directory", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)  # fmt: skip


@pytest.mark.skipif(not _make_ready(), reason="needs make and an installed .venv")
def test_make_exits_2_but_exit_file_and_the_last_line_keep_the_real_code(sweeps, tmp_path):
    rc = tmp_path / "rc"
    for b, code, verdict in (("one", 3, "INCONCLUSIVE"), ("worse", 1, "INCONSISTENT")):
        proc = make("compare", f"A={sweeps['a']}", f"B={sweeps[b]}", f"EXIT_FILE={rc}")
        assert proc.returncode == 2, "make's own code for any failing recipe"
        assert rc.read_text() == f"{code}\n"
        lines = [x for x in proc.stderr.splitlines() if not x.startswith("make: ")]
        assert lines[-1] == f"reprotrain compare: exit {code} ({verdict})", proc.stderr
    proc = make("compare", f"A={sweeps['a']}", f"B={sweeps['same']}", f"EXIT_FILE={rc}")
    assert proc.returncode == 0 and rc.read_text() == "0\n"


@pytest.fixture(scope="module")
def completed_run(tmp_path_factory) -> Path:
    """A tiny run trained through ``reprotrain train`` (exit 0)."""
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    proc = cli("train", *MICRO, *TINY, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert run_json(run_dir)["status"] == "completed"
    return run_dir


def test_bisect_of_identical_records_is_exit_0_through_the_console_script(completed_run, tmp_path):
    twin = tmp_path / "twin"
    shutil.copytree(completed_run, twin)
    proc = cli("bisect", str(completed_run), str(twin))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "IDENTICAL" in proc.stdout


# ------------------------------------------------------------------ train: 0 / 2 / 75 / 130


def test_train_refuses_a_bad_override_in_one_line_with_exit_2(tmp_path):
    proc = cli("train", *MICRO, "trainer.epochs=many", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(error_lines(proc.stderr)) == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_train_nproc_is_checked_before_torchrun(tmp_path):
    proc = cli("train", "--nproc", "0", *MICRO, f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2
    assert error_lines(proc.stderr) == ["error: NPROC=0: give at least 1 process"]


@pytest.mark.slow
def test_train_keeps_the_trainers_abort_code_130(tmp_path):
    """Ctrl-C twice: 130 (the first SIGINT's code, 75, is the next test's, by a real signal)."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(  # its own process group: the terminal's Ctrl-C reaches all of it
        [*CLI, "train", *MICRO, "trainer.epochs=100", "logger=none",
         "trainer.checkpoint_every_steps=1", f"hydra.run.dir={run_dir}"],
        cwd=REPO, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while not list((run_dir / "checkpoints").glob("step-*.pt")):
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.2)
    # The second Ctrl-C after the trainer said it got the first, as a user presses it: two
    # sent at once are one to Python (a pending signal's handler runs once).
    os.killpg(proc.pid, signal.SIGINT)
    seen = []
    for line in proc.stdout:  # the log's console lines
        seen.append(line)
        if "SIGINT received" in line:
            os.killpg(proc.pid, signal.SIGINT)
            break
    err = "".join(seen) + proc.communicate(timeout=180)[0]
    assert proc.returncode == 130, err[-2000:]
    assert run_json(run_dir)["status"] == "interrupted"


def test_sigterm_sent_to_reprotrain_reaches_the_trainer(tmp_path):
    """A scheduler signals the process it started: ``reprotrain train`` forwards it, and the
    trainer's checkpoint-and-stop code (75) comes back."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [*CLI, "train", *MICRO, "trainer.epochs=100", "logger=none",
         "trainer.checkpoint_every_steps=1", f"hydra.run.dir={run_dir}"],
        cwd=REPO, env=base_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while not list((run_dir / "checkpoints").glob("step-*.pt")):
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 75, err[-2000:]
    assert run_json(run_dir)["status"] == "interrupted"


# ---------------------------------------------------------------------------------- sweep


def test_sweep_adds_the_seed_list_only_to_a_seed_sweep():
    assert commands.sweep_args([]) == ("1", ["--multirun", "seed.base=0,1,2"])
    given = commands.sweep_args(["--seeds", "3,4", "x=1"])[1]
    assert given == ["--multirun", "seed.base=3,4", "x=1"]
    assert commands.sweep_args(["seed.base=7,8"])[1] == ["--multirun", "seed.base=7,8"]
    optuna = commands.sweep_args(["hydra/sweeper=optuna", "experiment=smoke"])[1]
    assert optuna == ["--multirun", "hydra/sweeper=optuna", "experiment=smoke"]
    search = commands.sweep_args(["experiment=smoke", "+hparams_search=smoke_optuna"])[1]
    assert search == ["--multirun", "experiment=smoke", "+hparams_search=smoke_optuna"]
    assert commands.sweep_args(["--nproc=2", "-m"]) == ("2", ["seed.base=0,1,2", "-m"])


def test_docs_cli_table_states_every_commands_exit_codes_as_the_code_has_them():
    rows = re.findall(r"^\| `([a-z-]+)` \| .* \| (.*) \|$", (REPO / "docs" / "cli.md").read_text(),
                      re.M)  # fmt: skip
    documented = dict(rows)
    assert set(documented) == set(commands.COMMANDS)
    for name, command in commands.COMMANDS.items():
        text = documented[name].replace("`error:`", "error:")
        if text == "as `train`":
            assert command.exit_codes == commands.TRAIN_CODES, name
            continue
        assert text == "; ".join(f"{k} {v}" for k, v in command.exit_codes.items()), name


# -------------------------------------------------------------------------- shell completion


def test_the_command_names_complete(monkeypatch, capsys):
    monkeypatch.setenv("COMP_LINE", "reprotrain re")
    monkeypatch.setenv("COMP_POINT", "13")
    assert commands.main(["-sc", "query=bash"]) == 0
    assert capsys.readouterr().out.split() == ["resume", "report", "reproduce"]


def test_bash_completes_train_overrides_from_the_config_tree(tmp_path):
    """The installed script, in bash: <TAB> after `reprotrain train experiment=sm`."""
    script = (
        'eval "$(reprotrain -sc install=bash)"\n'
        'COMP_LINE="reprotrain train experiment=sm"; COMP_POINT=${#COMP_LINE}; COMP_CWORD=2\n'
        'hydra_bash_completion; echo "${COMPREPLY[@]}"\n'
    )
    if SCRIPT.exists():
        bindir = SCRIPT.parent
    else:  # the container runs from PYTHONPATH: a shim by the command's name
        bindir = tmp_path / "bin"
        bindir.mkdir()
        (bindir / "reprotrain").write_text(f'#!/bin/sh\nexec {sys.executable} -m reprotrain "$@"\n')
        (bindir / "reprotrain").chmod(0o755)
    env = base_env()
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"
    proc = subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "experiment=smoke" in proc.stdout.split() and "experiment=selfcheck" not in proc.stdout
