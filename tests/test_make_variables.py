"""Every Make variable is data: quoted with the Makefile's ``q`` (``$(value ...)``, so Make
never expands a ``$(shell ...)`` in it either) or validated to its type, and ``ARGS`` is
split into words by ``reprotrain --args`` without being expanded. A canary file that any
expansion would create must never appear, and a failing inner command fails ``make``."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, base_env

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def make(*args: str, dry: bool = True, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {k: v for k, v in base_env().items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    cmd = ["make", "-s", "--no-print-directory", "-C", str(REPO), *(["-n"] if dry else []), *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def _venv_ready() -> bool:
    """Never let a test install the venv: real runs only while its stamp is up to date."""
    stamp = subprocess.run(["make", "-q", ".venv/.installed"], cwd=REPO, capture_output=True)
    return stamp.returncode == 0


needs_venv = pytest.mark.skipif(not _venv_ready(), reason="needs make and an installed .venv")


def hostile(canary: Path) -> list[str]:
    """Values that would create ``canary`` if Make or the shell expanded them."""
    return [
        f"1; touch {canary}",
        f"$(shell touch {canary})",
        f"`touch {canary}`",
        f"$$(touch {canary})",
        f"x' ; touch {canary}; '",
        f"a\nb; touch {canary}",
    ]


#: (target, variable, the target's other variables, the option that receives the value)
CASES = [
    ("verify", "NPROC", [], "--nproc"),
    ("verify", "NPROC_B", [], "--nproc-b"),
    ("eval", "CKPT", ["RUN=r"], "--checkpoint"),
    ("resume", "RUN", [], "resume"),
    ("resume", "NPROC", ["RUN=r"], "--nproc"),
    ("drill", "NPROC", [], "--nproc"),
]


def recipe_argv(stdout: str) -> list[str]:
    (line,) = [x for x in stdout.replace("\\\n", " ").splitlines() if "bin/reprotrain " in x]
    # the newline travels as "$RT_NEWLINE", as the recipe's shell reads it
    return shlex.split(line.replace('"$RT_NEWLINE"', '"\n"'))


@pytest.mark.parametrize(("target", "variable", "rest", "option"), CASES)
def test_a_variable_reaches_its_job_as_one_inert_argument(target, variable, rest, option, tmp_path):
    canary = tmp_path / "C"
    for value in hostile(canary):
        proc = make(target, f"{variable}={value}", *rest)
        assert not canary.exists(), f"{variable}={value!r} ran a command"
        argv = recipe_argv(proc.stdout)
        assert argv[argv.index(option) + 1] == value, proc.stdout


def test_args_is_split_into_words_but_never_expanded(tmp_path):
    canary = tmp_path / "C"
    text = f"name='a b' $(shell touch {canary}) `touch {canary}` ;touch {canary} $$HOME"
    proc = make("train", f"ARGS={text}")
    assert not canary.exists()
    argv = recipe_argv(proc.stdout)
    assert argv[argv.index("--args") + 1] == text
    from reprotrain.commands import split_args

    words = split_args(text)
    assert words[0] == "name=a b" and "`touch" in words and "$$HOME" in words


def test_commands_append_the_args_words_after_the_command():
    from reprotrain.commands import _options

    _, _, argv = _options(["--exit-line", "--args", "x='1 2' $(id)", "train", "--nproc", "1"])
    assert argv == ["train", "--nproc", "1", "x=1 2", "$(id)"]


@pytest.mark.parametrize("variable", ["NAME", "DEST"])
def test_new_project_names_are_data(variable, tmp_path):
    canary = tmp_path / "C"
    other = "DEST=" + str(tmp_path / "d") if variable == "NAME" else "NAME=mylab"
    for value in hostile(canary):
        proc = make("new-project", f"{variable}={value}", other)
        assert not canary.exists(), f"{variable}={value!r} ran a command"
        (line,) = [x for x in proc.stdout.splitlines() if "new_project.py" in x]
        argv = shlex.split(line.replace('"$RT_NEWLINE"', '"\n"'))
        assert value in argv[-2:]


@needs_venv
def test_unknown_extras_are_refused_as_data(tmp_path):
    canary = tmp_path / "C"
    for value in hostile(canary):
        proc = make("install", f"EXTRAS={value}", dry=False)
        assert not canary.exists(), f"EXTRAS={value!r} ran a command"
        assert proc.returncode == 2 and "error: unknown extra in EXTRAS=" in proc.stderr


@needs_venv
def test_a_failing_job_fails_make_and_runs_nothing_after_it(tmp_path):
    """``make verify "NPROC=1; touch C"`` made make exit 0 (the shell ran touch after the
    failed verify): now verify gets the whole text, refuses it in one line, make fails."""
    canary = tmp_path / "C"
    proc = make("verify", f"NPROC=1; touch {canary}", dry=False)
    assert proc.returncode == 2 and not canary.exists()
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "--nproc" in errors[0], proc.stderr


@needs_venv
def test_a_run_dir_with_a_newline_is_one_argument_not_a_syntax_error(tmp_path):
    """``make resume RUN=$'a\\nb'`` was a /bin/sh syntax error (the newline ended the line)."""
    proc = make("resume", f"RUN={tmp_path}/a\nb", dry=False)
    assert proc.returncode == 2 and "Syntax error" not in proc.stderr
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "no such run directory" in errors[0], proc.stderr


@needs_venv
def test_no_command_line_variable_is_expanded_into_a_recipes_environment(tmp_path):
    """Make exports command-line variables to recipes, expanding them: any variable at all
    (one the Makefile never names, too) with ``$(shell ...)`` ran it before the job."""
    canary = tmp_path / "C"
    proc = make("report", f"RUN={tmp_path}/none", f"FOO=$(shell touch {canary})",
                f"NPROC=$(shell touch {canary})", dry=False)  # fmt: skip
    assert proc.returncode == 2 and not canary.exists()
    proc = make("drill", f"NPROC=$(shell touch {canary})")  # its recursive make runs under -n
    assert not canary.exists()


@pytest.mark.parametrize("variable", ["IMAGE", "GPUS"])
def test_docker_names_are_data_checked_before_docker_runs(variable, tmp_path):
    """``make docker-train IMAGE=...`` / ``GPUS=...`` reached the shell (IMAGE unquoted, in a
    line ``make -n`` runs too) and Make expanded them: now the text is never expanded, IMAGE
    is quoted, and a value with anything docker would not take is one error: line, exit 2,
    before any docker command."""
    canary = tmp_path / "C"
    for value in hostile(canary):
        make("docker-train", f"{variable}={value}")  # -n: the $(MAKE) line runs even there
        proc = make("docker-train", f"{variable}={value}", dry=False)
        assert not canary.exists(), f"{variable}={value!r} ran a command"
        assert proc.returncode == 2 and f"error: {variable}=" in proc.stderr, proc.stderr
    dry = make("docker-train", "IMAGE=my/img:1.0", "GPUS=device=0,1").stdout
    assert "'my/img:1.0'" in dry and "--gpus '\"device=0,1\"'" in dry, dry


@needs_venv
def test_pythonhashseed_is_exported_as_typed_never_expanded(tmp_path):
    """The one exported variable: a value of your own reaches the job as its text; a
    ``$(shell ...)`` in it is never run (Make exported it expanded)."""
    canary = tmp_path / "C"
    make("report", f"RUN={tmp_path}/none", f"PYTHONHASHSEED=$(shell touch {canary})", dry=False)
    assert not canary.exists()
    echo = make("--eval", "seed: ; @echo $$PYTHONHASHSEED", "seed", "PYTHONHASHSEED=77", dry=False)
    assert echo.stdout.strip() == "77"


# ------------------------------------------------------------------ every variable (issue 52)

MAKEFILE = (REPO / "Makefile").read_text()


def settings_in_text() -> set[str]:
    """The settings, as the Makefile's gate reads them: the names given a default with ?=."""
    return set(re.findall(r"^(?:export )?([A-Za-z_][A-Za-z0-9_]*) *\?=", MAKEFILE, re.M))


def make_database() -> str:
    proc = make("-p", "-q", "help")  # -q: nothing runs; -p: every variable and rule Make knows
    return proc.stdout


def variables_read() -> set[str]:
    """Every variable the Makefile reads, from Make's own database (not a hand list): each name
    Make knows (defined by the Makefile, Make's own, the environment's) that the Makefile's text
    names, and each setting."""
    pattern = r"^(?:override |export )?([^\s#:=?+!]+) *[:?+!]?= |^define (\S+)"
    known = {a or b for a, b in re.findall(pattern, make_database(), re.M)}
    words = set(re.findall(r"[A-Za-z_.][A-Za-z0-9_.]*", MAKEFILE))
    return (known & words) | settings_in_text()


def test_the_settings_gate_lists_the_same_settings_as_the_text():
    printed = make("--eval", "settings: ; @echo $(SETTINGS)", "settings", dry=False).stdout
    assert set(printed.split()) == settings_in_text()
    assert {"ARGS", "RUN", "ENGINE", "BASE_REF", "IMAGE", "CA_BUNDLE"} <= settings_in_text()
    read = variables_read()  # the derivation sees the Makefile's own and Make's variables
    assert {"VENV", "PY", "q", "NL", "BASE_DIGEST", "BASE_IMAGE", "MAKE", "MAKEFILE_LIST"} <= read


def test_every_variable_the_makefile_reads_that_is_not_a_setting_is_refused_at_once(tmp_path):
    """``make -n docker-build BASE_DIGEST='$(shell ...)'`` ran it, and a backtick in
    BASE_IMAGE reached the shell: a command line may not replace any of the Makefile's own
    variables (VENV, q, BASE_DIGEST, MAKE, ...). Each is refused, all named in one line, before
    anything runs, even under ``make -n``."""
    internal = sorted(variables_read() - settings_in_text())
    assert len(internal) > 30, internal
    canary = tmp_path / "C"
    for value in (f"$(shell touch {canary})", f"`touch {canary}`"):
        for dry in (True, False):
            proc = make("docker-build", *(f"{v}={value}" for v in internal), dry=dry)
            assert proc.returncode == 2 and not canary.exists(), proc.stderr
            (line,) = proc.stderr.splitlines()
            named = line.split("(a typo?): ", 1)[1].split(";", 1)[0].split()
            assert "*** error: not a setting of this Makefile" in line
            assert sorted(named) == internal
    for one in ("BASE_DIGEST", "BASE_IMAGE", "VENV", "ARG"):  # ARG: a typo of ARGS
        proc = make("-n", "train", f"{one}=`touch {canary}`")
        assert proc.returncode == 2 and f"(a typo?): {one};" in proc.stderr and not canary.exists()


#: Every target (the .PHONY list, the one list of them).
TARGETS = re.search(r"^\.PHONY:((?:.*\\\n)*.*)", MAKEFILE, re.M).group(1).replace("\\", " ").split()
#: Targets whose recipe refuses a hostile setting before any job runs: cheap to run for real.
REAL = ["help", "verify", "resume", "archive", "reproduce", "bisect", "compare", "report", "eval",
        "install", "docker-base", "docker-build", "docker-train", "docker-test"]  # fmt: skip
#: Checked against a character set by the first line of their recipes (check_docker_names,
#: check_engine), before any use; for real below and in test_docker_names_are_data_...
VALIDATED = {"GPUS", "ENGINE", "IMAGE", "BASE_REF", "BASE_NAME", "DEBIAN_MIRROR"}


def quoted(value: str) -> str:
    """``value`` as the Makefile's ``q`` writes it into a recipe line."""
    return "'" + value.replace("'", "'\\''").replace("\n", "'\"$RT_NEWLINE\"'") + "'"


@pytest.mark.parametrize("form", range(6))
def test_every_setting_is_inert_in_every_target(form, tmp_path):
    """Every setting at once, each with its own canary, in every target: under ``make -n``
    (recipes expanded, ``$(MAKE)`` lines run) from the command line and from the environment,
    no canary appears, and the recipes hold each value only single-quoted by ``q`` (what the
    shell would run); then for real, in the targets that refuse such a value before any job,
    and in the container targets with a stand-in engine, so that every quoted value reaches
    a real shell."""
    settings = sorted(settings_in_text())
    canaries = {v: tmp_path / f"{v}.canary" for v in settings}
    values = {v: hostile(canaries[v])[form] for v in settings}
    given = [f"{v}={value}" for v, value in values.items()]
    dry = make("-k", *TARGETS, *given)
    environ = {k: v for k, v in base_env().items() if k not in ("MAKEFLAGS", "MAKELEVEL")}
    environ.update(values)
    cmd = ["make", "-s", "-n", "-k", "-C", str(REPO), *TARGETS]
    runs = [dry, subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=300)]
    for run in runs:
        for v, value in values.items():
            bare = run.stdout.replace(quoted(value), "")
            assert v in VALIDATED or str(canaries[v]) not in bare, f"{v} unquoted in a recipe"
    if _venv_ready():
        runs.append(make("-k", *REAL, *given, dry=False))
        assert runs[-1].returncode != 0  # refused, not run: those recipes check values first
        bins = tmp_path / "bin"
        bins.mkdir()
        for tool in ("podman", "mmdebstrap"):
            (bins / tool).write_text("#!/bin/sh\nexit 0\n")
            (bins / tool).chmod(0o755)
        fine = {"ENGINE": "podman", "IMAGE": "x:1", "BASE_REF": "b", "BASE_NAME": "b", "GPUS": "",
                "DEBIAN_MIRROR": "http://m"}  # fmt: skip
        switches = {v: "0" for v in ("KILL", "TRUST", "WITH_CKPT", "ALLOW_INCOMPLETE")}
        real = [f"{v}={fine.get(v, switches.get(v, value))}" for v, value in values.items()]
        environ = {**environ_without(values), "PATH": f"{bins}{os.pathsep}{os.environ['PATH']}"}
        cmd = ["make", "-s", "-k", "-C", str(REPO), "docker-build", "docker-test", "docker-train"]
        runs.append(subprocess.run([*cmd, *real], env=environ, capture_output=True, text=True))
        assert "engine: podman" in runs[-1].stdout, runs[-1].stderr
    ran = sorted(v for v, canary in canaries.items() if canary.exists())
    assert ran == [], f"ran a command from {ran}: " + "\n".join(r.stderr[-2000:] for r in runs)


def environ_without(names) -> dict[str, str]:
    return {k: v for k, v in base_env().items() if k not in (*names, "MAKEFLAGS", "MAKELEVEL")}


def test_the_extras_are_one_list_the_requirements_files_make_and_the_loggers_agree_on():
    """One home for the optional extras: a ``requirements-<extra>.in`` file. ``make install``
    accepts exactly those, the lock checker expects exactly those, and the loggers' install
    line names them (three lists before)."""
    from reprotrain.extras import EXTRAS, EXTRAS_INSTALL
    from reprotrain.loggers.settings import EXTRA_OF

    files = {p.name[len("requirements-") : -len(".in")] for p in REPO.glob("requirements-*.in")}
    files.discard("dev")
    made = subprocess.run(["make", "-s", "-p", "-n", "help"], cwd=REPO, capture_output=True,
                          text=True, timeout=60).stdout  # fmt: skip
    known = next(line for line in made.splitlines() if line.startswith("KNOWN_EXTRAS :="))
    assert set(known.split(":=", 1)[1].split()) == files == set(EXTRAS) == set(EXTRA_OF.values())
    assert f"make install EXTRAS={','.join(sorted(files))}" == EXTRAS_INSTALL
