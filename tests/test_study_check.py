"""A verdict checks every record it stands on: study.json is recomputed from the runs (a
forged best or a deleted trial is a difference). The malformed records refused before
anything re-runs (study.json, a job's overrides, a resume entry) are in test_trust.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import MICRO, REPO, TINY, base_env
from reprotrain.tools.sweeps import optuna_study
from test_optuna_sweeps import fake_trial, settings
from test_trust import repack, unpack


@pytest.fixture
def study_dir(tmp_path) -> tuple[Path, dict]:
    sweep = tmp_path / "study"
    fake_trial(sweep, 0, {"optimizer.lr": 0.5}, [0.2, 0.4], "completed")
    fake_trial(sweep, 1, {"optimizer.lr": 0.05}, [0.6, 0.5], "completed")
    fake_trial(sweep, 2, {"optimizer.lr": 0.9}, [0.3], "completed")
    (sweep / "optimization_results.yaml").write_text(
        yaml.safe_dump({"best_params": {"optimizer.lr": 0.05}, "best_value": 0.6})
    )
    return sweep, optuna_study.write_study(sweep, settings(seed=3))


def differences(*args, **kwargs) -> list[str]:
    from reprotrain.tools.reproduce import study_check

    return study_check.differences(*args, **kwargs)


def test_a_study_that_matches_its_runs_has_no_difference(study_dir, tmp_path):
    sweep, study = study_dir
    replay = tmp_path / "replay"
    shutil.copytree(sweep, replay)
    assert differences(study, sweep, replay) == []


def test_a_forged_best_is_a_difference(study_dir):
    sweep, study = study_dir
    forged = {**study, "best": study["trials"][2]}
    found = differences(forged, sweep)
    assert any(line.startswith("best: study.json says trial 2") for line in found), found


def test_deleted_trials_are_differences(study_dir):
    sweep, study = study_dir
    shutil.rmtree(sweep / "0")
    shutil.rmtree(sweep / "2")
    found = differences(study, sweep)
    assert any("trial 0 (0), which is not in the archived runs" in x for x in found), found
    assert any("n_trials=3; the archive holds 1" in x for x in found), found


def test_a_replayed_value_that_moved_is_a_difference_only_when_bits_are_promised(
    study_dir, tmp_path
):
    sweep, study = study_dir
    replay = tmp_path / "replay"
    shutil.copytree(sweep, replay)
    (replay / "1" / "metrics.jsonl").write_text(json.dumps({"epoch": 0, "val_acc": 0.1}) + "\n")
    assert any("value 0.6 in study.json, 0.1 in the replay" in x for x in differences(
        study, sweep, replay, values=True))  # fmt: skip
    assert differences(study, sweep, replay, values=False) == []
    shutil.rmtree(replay / "2")
    assert any("trial 2 (2): status completed in study.json, missing in the replay" in x
               for x in differences(study, sweep, replay, values=False))  # fmt: skip


def test_a_journal_that_holds_other_trials_is_a_difference(tmp_path):
    """The study's storage is checked against the runs too: study.json and the runs edited
    to agree with each other still disagree with study.journal."""
    from test_optuna_storage import FIXED, SPACE, FakeLauncher, runner

    sweep = tmp_path / "study"
    runner(sweep, FakeLauncher(), n_trials=3).run(FIXED)  # the journal of a 3-trial study
    import optuna

    from reprotrain.tools.sweeps.optuna_sweeper import open_journal

    trials = optuna.load_study(study_name="smoke", storage=open_journal(
        sweep / "study.journal")).trials  # fmt: skip
    for t in trials:
        fake_trial(sweep, t.number, t.params, [t.value], "completed")
    record = {**settings(seed=7, n_startup_trials=2), "study_name": "smoke", "search_space": SPACE}
    study = optuna_study.write_study(sweep, record)
    assert study["storage_agrees"] is True and differences(study, sweep) == []
    rows = [{"epoch": 0, "val_acc": 0.99}]  # a better trial 1, in its run and in study.json
    (sweep / "1" / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    forged = optuna_study.write_study(sweep, record)
    assert forged["storage_agrees"] is False
    assert any("does not hold the archived trials" in x for x in differences(forged, sweep))


# ------------------------------------------------------ a real study, forged and trimmed


def cli(*args: str) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("reprotrain")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "reprotrain"]
    return subprocess.run([*cmd, *args], cwd=REPO, env=base_env(), capture_output=True,
                          text=True, timeout=600)  # fmt: skip


@pytest.mark.slow
def test_a_forged_or_trimmed_study_archive_is_not_reproduced(tmp_path):
    sweep = tmp_path / "study"
    proc = cli("sweep", *MICRO, *TINY, "+hparams_search=smoke_optuna", "hydra.sweeper.n_trials=3",
               f"hydra.sweep.dir={sweep}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = cli("archive", str(sweep), "--out-dir", str(tmp_path / "archives"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    (archive,) = (tmp_path / "archives").glob("*.tar.gz")

    top = unpack(archive, tmp_path / "forged")
    study = json.loads((top / "sweep" / "study.json").read_text())
    worst = min((t for t in study["trials"] if t["value"] is not None), key=lambda t: t["value"])
    study["best"] = worst  # a false best, the plugin's file made to agree
    (top / "sweep" / "study.json").write_text(json.dumps(study))
    (top / "sweep" / "optimization_results.yaml").write_text(
        yaml.safe_dump({"best_params": worst["params"], "best_value": worst["value"]})
    )
    forged = repack(top, tmp_path / "forged.tar.gz")
    proc = cli("reproduce", str(forged), "--trust", "--runs-dir", str(tmp_path / "r1"))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1].startswith("DIVERGED: study.json does not hold")

    top = unpack(archive, tmp_path / "trimmed")
    meta = json.loads((top / "archive.json").read_text())
    for job in meta["jobs"][1:]:
        shutil.rmtree(top / "sweep" / job)
    meta["jobs"] = meta["jobs"][:1]
    (top / "archive.json").write_text(json.dumps(meta))
    trimmed = repack(top, tmp_path / "trimmed.tar.gz")
    proc = cli("reproduce", str(trimmed), "--trust", "--runs-dir", str(tmp_path / "r2"))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "which is not in the archived runs" in proc.stdout
