"""One gate for trust (``tools/reproduce/run_trust.py``): every door that composes,
instantiates or re-launches what a directory holds (a run, a sweep, an Optuna study) passes
it, and it decides on everything that will run: each run's config and every override a sweep
recorded (Hydra's and the task's). Rule (a) never lets a process-starting callable of this
checkout through. The archive folders are built by hand, as ``reproduce --verify-only``
extraction leaves them (``test_run_trust.py``); the slow test extracts a real study."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from reprotrain import commands
from reprotrain.sweep_checks import OPTUNA_SWEEPER
from reprotrain.tools.archive.archive_check import MARKER
from reprotrain.tools.reproduce import config_trust, run_trust

LAUNCHER = "reprotrain.tools.runs.resume.run_forwarding_signals"


def hostile_callback(canary: Path) -> str:
    """A Hydra callback override that runs ``touch canary`` through the package's own
    trainer launcher (Hydra's blocklist stops ``os.system``, not this)."""
    return (f"+hydra.callbacks.pwn={{_target_:{LAUNCHER},cmd:[touch,'{canary}'],"
            "env:{PATH:'/usr/bin:/bin'}}")  # fmt: skip


def extracted_study(root: Path, hydra_overrides: list[str], task: list[str]) -> Path:
    """An extracted study archive's sweep dir: the manifest and marker as extraction leaves
    them, one finished trial whose config is this checkout's own."""
    top = root / "top"
    sweep = top / "sweep"
    job = sweep / "0"
    (job / ".hydra").mkdir(parents=True)
    (job / "run.json").write_text(json.dumps({"status": "completed"}))
    (job / "config.resolved.yaml").write_text(yaml.safe_dump({"trainer": {"epochs": 1}}))
    record = {"hydra": {"sweeper": {"_target_": OPTUNA_SWEEPER},
                        "overrides": {"hydra": hydra_overrides, "task": task}}}  # fmt: skip
    (sweep / "multirun.yaml").write_text(yaml.safe_dump(record))
    (top / "MANIFEST.sha256").write_text("")
    (top / "archive.json").write_text("{}")
    for folder in (top, job):
        (folder / MARKER).write_text("{}")
    return sweep


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def test_an_extracted_study_whose_overrides_start_a_process_is_not_resumed(tmp_path, capsys):
    """The attack on 5bba2ff: the study's multirun.yaml edited to name the trainer launcher
    as a Hydra callback; ``reprotrain resume <sweep dir>`` ran ``touch`` with no trust flag."""
    canary = tmp_path / "CANARY"
    hydra = [
        "hydra.mode=MULTIRUN",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=2",
        hostile_callback(canary),
    ]
    sweep = extracted_study(
        tmp_path, hydra, ["experiment=selfcheck", "+hparams_search=smoke_optuna"]
    )
    code = commands.main(["resume", str(sweep)])
    assert not canary.exists(), "the archive's recorded override ran a command"
    line = one_error_line(capsys)
    assert code == 2 and "came from an archive" in line and "multirun.yaml" in line
    assert "names or calls a callable" in line


@pytest.mark.parametrize(
    ("override", "why"),
    [
        ("+model._target_=os.getcwd", "names or calls a callable"),
        ("+model={_target_:builtins.print}", "names or calls a callable"),
        ("hydra.searchpath=[file:///tmp/their-conf]", "sets hydra.searchpath"),
        ("hydra.launcher.setup=[id]", "sets hydra.launcher.setup"),
        ("hydra.job.env_set.PYTHONPATH=/tmp/x", "sets hydra.job.env_set.PYTHONPATH"),
        ("hydra.sweeper.storage=/etc/passwd.journal", "sets hydra.sweeper.storage"),
        ("+trainer.x='${oc.create:{a:1}}'", "calls the resolver oc.create"),
    ],
)
def test_rule_a_refuses_each_override_that_names_code_or_reaches_outside(override, why):
    assert any(why in p for p in config_trust.override_problems([override])), override


def test_the_overrides_a_study_records_pass_rule_a():
    """What ``make sweep`` of a study records is trusted under (a): the gate adds no refusal
    for an archive of the shipped study."""
    ordinary = ["hydra.mode=MULTIRUN", "hydra.sweep.dir=/tmp/s", "hydra/sweeper=optuna",
                "hydra.sweeper.n_trials=3", "hydra.sweeper.direction=${trainer.monitor_mode}imize",
                "hydra.sweeper.params.optimizer.lr=tag(log,interval(0.01,1))",
                "experiment=smoke", "+hparams_search=smoke_optuna", "seed.base=0,1,2",
                "optimizer=sgd,adamw"]  # fmt: skip
    assert config_trust.override_problems(ordinary) == []


def test_rule_a_never_allows_a_callable_that_starts_a_process():
    """Even named by conf/ under its own group, the trainer launcher (and anything calling
    subprocess or os.exec*, directly or through one) is refused; no shipped target is one."""
    rule = config_trust.Rule.of(REPO)
    assert (
        LAUNCHER in rule.starters and "reprotrain.launchers.run_forwarding_signals" in rule.starters
    )
    assert "reprotrain.repro.gitinfo.run_git" in rule.starters  # subprocess.run inside
    forged = {**rule.targets, "model": {*rule.targets["model"], LAUNCHER}}
    found = config_trust.problems(
        {"model": {"_target_": LAUNCHER}}, forged, "c" * 12, rule.starters
    )
    assert found and "starts a process or runs a command" in found[0]
    assert not rule.starters & {t for names in rule.targets.values() for t in names}


def test_a_permit_is_made_only_by_the_gate():
    with pytest.raises(TypeError, match="only by the trust gate"):
        run_trust.Permit("c", "forged")
    with pytest.raises(TypeError, match="not the trust gate's Permit"):
        run_trust.permitted(object())


# ----------------------------------------------------------------- the doors, enumerated

#: Every command that composes, instantiates or launches from a directory it is given, and
#: the module holding its entry. Each calls the gate (``run_trust.require_trust`` /
#: ``admit_plan``) or is gated by ``commands._gated`` before it runs.
DOORS = {
    "resume": "reprotrain/tools/runs/resume.py",
    "reproduce": "reprotrain/tools/reproduce/reproduce.py",
    "bisect": "reprotrain/tools/debugging/bisect.py",
    "eval": "reprotrain/tools/runs/eval.py",
    "report": None,  # commands._gated
    "compare": None,
    "train": None,  # train resume=<checkpoint>
}
GATE_CALLS = {"require_trust", "admit_plan"}


def calls_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)}  # fmt: skip


def test_every_door_passes_the_gate():
    assert set(DOORS) | {"verify"} >= {
        c for c in commands.COMMANDS if c in ("resume", "reproduce", "bisect", "eval", "report",
                                               "compare", "train", "verify")}  # fmt: skip
    for name, module in DOORS.items():
        if module is None:
            assert name in commands.GATED, name
        else:
            assert calls_in(REPO / "src" / module) & GATE_CALLS, f"{name}: {module}"


def test_only_the_gate_makes_a_permit_and_only_permits_launch_from_a_directory():
    """No module but the gate constructs ``Permit``; the launchers of what a directory holds
    (the resume tool, a sweep's continuation, reproduce's re-run) take one."""
    src = REPO / "src" / "reprotrain"
    for path in src.rglob("*.py"):
        tree = ast.parse(path.read_text())
        made = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
                and getattr(n.func, "id", getattr(n.func, "attr", None)) == "Permit"]  # fmt: skip
        if path.name != "run_trust.py":
            assert not made, f"{path} makes a Permit"
    resume = (src / "tools" / "runs" / "resume.py").read_text()
    assert "permit.launch(" in resume and "run_forwarding_signals(" not in resume
    assert "permitted(permit)" in (src / "tools" / "reproduce" / "rerun.py").read_text()
