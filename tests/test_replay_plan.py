"""The whole replay plan is trusted, or nothing runs: each way an archive chose what runs.

Each hostile archive here is an untouched commit of a small repository (rule (a) holds for
its code, as in tests/test_trust.py), whose record asks for something else to run: an
environment variable (``PYTHONPATH`` to a ``sitecustomize.py`` the archive carries,
``GIT_TRACE`` to a file), or a resume history whose first leg names a command runner or reads
this machine's environment. The stand-in trainer instantiates ``model`` and calls git, as the
real one does; planted code writes a marker. A refusal must leave no marker, nothing
extracted and no run.
"""

# ruff: noqa: F811  (the fixtures imported from test_trust are parameters here)
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from reprotrain.repro.environment import GPU_ENV_VARS
from reprotrain.tools.archive import archive as arch
from reprotrain.tools.archive import sweep_archive
from reprotrain.tools.reproduce import replay_env, replay_plan, rerun
from reprotrain.tools.reproduce import reproduce as repro
from test_trust import (  # noqa: F401
    _git,
    fake_run,
    job_config,
    one_error_line,
    repack,
    repo,
    reproduce,
    unpack,
)

STAND_IN_TRAINER = """\
import json, os, subprocess, sys
from pathlib import Path
from hydra.utils import instantiate
from omegaconf import OmegaConf
opts = dict(a.split("=", 1) for a in sys.argv[1:] if a.startswith("--config-"))
cfg = OmegaConf.load(Path(opts["--config-path"]) / (opts["--config-name"] + ".yaml"))
subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True)  # as gitinfo does
if os.environ.get("STAND_IN_ENV_DUMP"):
    Path(os.environ["STAND_IN_ENV_DUMP"]).write_text(json.dumps(dict(os.environ)))
if os.environ.get("STAND_IN_STOP_PARENT"):  # as a `kill` of make reproduce would
    os.kill(os.getppid(), 15)
instantiate(cfg.model)
"""


@pytest.fixture
def trainer_repo(repo: Path) -> Path:
    """The small repository, with a trainer that builds the model and asks git."""
    (repo / "src/reprotrain/train.py").write_text(STAND_IN_TRAINER)
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "stand-in trainer")
    return repo


def hostile_archive(tmp_path, repo, config: str, monkeypatch, files=None, **record) -> Path:
    """An archive of an untouched commit of ``repo`` whose run.json gains ``record`` after
    archiving (the manifest regenerated, as its author would) and whose run dir gains
    ``files`` ({path under run/: text})."""
    monkeypatch.setattr("reprotrain.tools.archive.pack.pip_freeze", lambda: "")
    run = fake_run(tmp_path, repo, config)
    for rel, text in (files or {}).items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text(text)
    path, _ = arch.build(run, tmp_path / "out", repo=repo)
    top = unpack(path, tmp_path / "unpacked")
    data = json.loads((top / "run/run.json").read_text())
    (top / "run/run.json").write_text(json.dumps({**data, **record}))
    return repack(top, tmp_path / "hostile.tar.gz")


def assert_nothing_ran(tmp_path: Path, *markers: Path) -> None:
    for marker in markers:
        assert not marker.exists(), f"{marker.name}: archived code ran"
    assert not (tmp_path / "x").exists(), "nothing extracted"
    assert not (tmp_path / "runs").exists(), "no run started"


def test_an_archived_pythonpath_never_reaches_the_rerun(
    tmp_path, trainer_repo, job_config, capsys, monkeypatch
):
    """Was: PYTHONPATH from gpu_env after ours, run/evil/sitecustomize.py imported, then
    REPRODUCED [trust a]."""
    marker = tmp_path / "PWNED"
    evil = f"open({str(marker)!r}, 'w').write('sitecustomize ran')\n"
    path = hostile_archive(
        tmp_path, trainer_repo, job_config, monkeypatch,
        files={"evil/sitecustomize.py": evil},
        environment={"gpu_env": {"PYTHONPATH": "src:../run/evil"}},
    )  # fmt: skip
    rc = reproduce(path, tmp_path, trainer_repo)
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and "asks to set $PYTHONPATH in the re-run's environment" in line
    assert "CUBLAS_WORKSPACE_CONFIG" in line, "the line says what an archive may set"
    assert_nothing_ran(tmp_path, marker)


def test_an_archived_git_trace_appends_to_no_file(
    tmp_path, trainer_repo, job_config, capsys, monkeypatch
):
    victim = tmp_path / "victim.rc"
    victim.write_text("# the victim's file\n")
    path = hostile_archive(
        tmp_path, trainer_repo, job_config, monkeypatch,
        environment={"gpu_env": {"GIT_TRACE": str(victim)}},
    )  # fmt: skip
    rc = reproduce(path, tmp_path, trainer_repo)
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and "$GIT_TRACE" in line
    assert victim.read_text() == "# the victim's file\n", "git appended nothing"
    assert_nothing_ran(tmp_path)


@pytest.mark.parametrize(
    ("where", "value"),
    [
        ("gpu_env", {"LD_PRELOAD": "/tmp/evil.so"}),
        ("gpu_env", {"PATH": "/tmp/evil"}),
        ("gpu_env", {"CUBLAS_WORKSPACE_CONFIG": ":4096:8 /tmp/x"}),
        ("gpu_env", {"NVIDIA_TF32_OVERRIDE": "../../x"}),
        ("gpu_env", {"CUBLASLT_WORKSPACE_SIZE": "4096k"}),
        ("env", {"CUBLAS_WORKSPACE_CONFIG": "/etc/passwd"}),
    ],
)
def test_only_allowlisted_gpu_variables_in_their_own_form_are_accepted(
    tmp_path, repo, job_config, capsys, monkeypatch, where, value
):
    path = hostile_archive(tmp_path, repo, job_config, monkeypatch, environment={where: value})
    rc = reproduce(path, tmp_path, repo)
    line = one_error_line(capsys.readouterr().err)
    name = next(iter(value))
    assert rc == 2 and f"${name}" in line and "nothing extracted" in line
    assert_nothing_ran(tmp_path)


def test_a_recorded_hashseed_must_be_an_integer(tmp_path, repo, job_config, capsys, monkeypatch):
    path = hostile_archive(
        tmp_path, repo, job_config, monkeypatch,
        repro={"level": "strict", "pythonhashseed": "0 -X importtime"},
    )  # fmt: skip
    rc = reproduce(path, tmp_path, repo)
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and "repro.pythonhashseed" in line
    assert_nothing_ran(tmp_path)


def test_every_gpu_variable_the_rule_compares_is_settable_in_its_form_only():
    typical = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "CUBLASLT_WORKSPACE_SIZE": "1024"}
    for name in GPU_ENV_VARS:
        assert replay_env.checked_value(name, typical.get(name, "1"), "t") is not None
        assert replay_env.checked_value(name, None, "t") is None, "recorded unset: unset"
        for bad in ("/tmp/x", "1\n", "$(id)", "1;id", ""):
            with pytest.raises(repro.ReproduceRefused):
                replay_env.checked_value(name, bad, "t")
    assert replay_env.checked_value("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8", "t")
    env = replay_env.apply({"KEEP": "1", "NVIDIA_TF32_OVERRIDE": "1"},
                           {"NVIDIA_TF32_OVERRIDE": None, "PYTHONHASHSEED": "3"})  # fmt: skip
    assert env == {"KEEP": "1", "PYTHONHASHSEED": "3"}


def _resumed(job_config: str, key: str, before) -> tuple[str, list[dict]]:
    """A config and the resume history of a run resumed at step 1 with ``key`` changed from
    ``before`` to the config's value."""
    cfg = yaml.safe_load(job_config)
    node = cfg
    for part in key.split("."):
        node = node[part]
    return job_config, [{"global_step": 1, "overrides": {key: {"from": before, "to": node}}}]


def test_a_command_runner_in_the_resume_history_runs_nothing(
    tmp_path, trainer_repo, job_config, capsys, monkeypatch
):
    """Was: leg 0 built from resumes[].overrides.model.from, unchecked: the command ran."""
    marker = tmp_path / "PWNED"
    runner = {"_target_": "os.system", "_args_": [f"echo ran > {marker}"]}
    config, resumes = _resumed(job_config, "model", runner)
    path = hostile_archive(tmp_path, trainer_repo, config, monkeypatch, resumes=resumes)
    rc = reproduce(path, tmp_path, trainer_repo)
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and "refusing to run the archive's code (nothing extracted)" in line
    assert "the archived resume history (leg 0) model._target_ names 'os.system'" in line
    assert_nothing_ran(tmp_path, marker)


def test_an_environment_interpolation_in_the_resume_history_is_refused(
    tmp_path, trainer_repo, job_config, capsys, monkeypatch
):
    """Was: a `from` of ${oc.env:HOME} trained leg 0 with this machine's value."""
    config, resumes = _resumed(job_config, "trainer.epochs", "${oc.env:HOME}")
    path = hostile_archive(tmp_path, trainer_repo, config, monkeypatch, resumes=resumes)
    rc = reproduce(path, tmp_path, trainer_repo)
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and "resume history (leg 0) trainer.epochs is an interpolation" in line
    assert_nothing_ran(tmp_path)


def test_the_plan_holds_every_leg_and_the_records_part_of_the_command(job_config):
    config, resumes = _resumed(job_config, "trainer.epochs", 7)
    checked = repro.CheckedArchive(
        path=Path("a.tar.gz"), prefix="a", top_name="a", members={}, manifest={},
        manifest_bytes=b"", signature=None,
        record={"seeds": {"base": 5, "source": "entropy"}, "resumes": resumes,
                "environment": {"device": {"resolved": "cpu"},
                                "gpu_env": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}}},
    )  # fmt: skip
    from omegaconf import OmegaConf

    checked.config = OmegaConf.create(config)
    plan = replay_plan.build([("", checked)], None)
    (job,) = plan.jobs
    assert [leg.config["trainer"]["epochs"] for leg in job.legs] == [
        7,
        job.config["trainer"]["epochs"],
    ]
    labels = [label for label, _ in plan.configs()]
    assert labels == ["the archived config", "the archived resume history (leg 0)"]
    assert job.env == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONHASHSEED": "0"}
    assert "seed.base=5" in job.overrides and "trainer.device=cpu" in job.overrides
    env = rerun.rerun_env(Path("/x/source"), job)
    assert env["PYTHONPATH"] == "/x/source/src" and env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_a_sweep_archive_goes_through_the_same_plan_check(
    tmp_path, trainer_repo, job_config, capsys, monkeypatch
):
    """One code path: a sweep job's environment and resume history are checked the same way."""
    monkeypatch.setattr("reprotrain.tools.archive.pack.pip_freeze", lambda: "")
    marker = tmp_path / "PWNED"
    runner = {"_target_": "os.system", "_args_": [f"echo ran > {marker}"]}
    config, resumes = _resumed(job_config, "model", runner)
    sweep = tmp_path / "sweep"
    for i, extra in enumerate(({}, {"resumes": resumes})):
        run = fake_run(tmp_path, trainer_repo, config)
        data = json.loads((run / "run.json").read_text())
        (run / "run.json").write_text(json.dumps({**data, **extra}))
        (sweep / str(i)).parent.mkdir(exist_ok=True)
        run.rename(sweep / str(i))
    path, _ = sweep_archive.build(sweep, tmp_path / "out", trainer_repo)
    rc = reproduce(path, tmp_path, trainer_repo)
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and "job 1's resume history (leg 0) model._target_ names 'os.system'" in line
    assert_nothing_ran(tmp_path, marker)


def test_an_untouched_archive_with_recorded_gpu_settings_still_runs_under_rule_a(
    tmp_path, trainer_repo, job_config, capsys, monkeypatch
):
    """The allowlist takes nothing legitimate away: recorded cuBLAS settings are replayed."""
    gpu_env = dict.fromkeys(GPU_ENV_VARS) | {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    dump = tmp_path / "rerun-env.json"
    monkeypatch.setenv("STAND_IN_ENV_DUMP", str(dump))
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "1")  # recorded unset: unset for the re-run
    path = hostile_archive(tmp_path, trainer_repo, job_config, monkeypatch,
                           environment={"gpu_env": gpu_env})  # fmt: skip
    rc = reproduce(path, tmp_path, trainer_repo)
    out = capsys.readouterr().out
    assert "trust    (a) source/ is commit" in out
    assert rc == rerun.EXIT_RERUN_FAILED  # the stand-in trainer writes no run.json
    env = json.loads(dump.read_text())
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and "NVIDIA_TF32_OVERRIDE" not in env
    assert env["PYTHONPATH"].endswith("/source/src") and env["PYTHONHASHSEED"] == "0"


def test_the_readme_threat_model_names_every_variable_an_archive_may_set():
    from conftest import REPO

    text = (REPO / "docs" / "guarantees.md").read_text()
    model = text[text.index("**Threat model.**") : text.index("## Resume history")]
    row = next(line for line in model.splitlines() if "environment.gpu_env" in line)
    named = {name for name in GPU_ENV_VARS if f"`{name}`" in row}
    assert named == set(GPU_ENV_VARS), set(GPU_ENV_VARS) - named
    assert "`repro.pythonhashseed`" in model and "resumes[].overrides" in model


def test_a_resume_override_of_a_key_the_config_lacks_is_refused_and_a_null_value_is_not():
    """The replay walks the resume history back from the final config: an override whose key
    the config lacks cannot be undone (refused in one line); a key holding null is a value."""
    config = {"trainer": {"epochs": 3, "limit": None}}
    absent = [{"global_step": 1, "overrides": {"trainer.missing": {"from": 1, "to": 2}}}]
    with pytest.raises(replay_plan.NotReplayable, match=r"trainer\.missing is not in the config"):
        replay_plan.plan_replay(config, absent)
    null = [{"global_step": 1, "overrides": {"trainer.limit": {"from": 4, "to": None}}}]
    first = replay_plan.plan_replay(config, null)[0]
    assert first.config["trainer"]["limit"] == 4
