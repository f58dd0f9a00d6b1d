"""Reproduce compares every record it reports: metrics.jsonl rows and ``final_metrics``
(``run_diff.with_metrics``), the config against run.json's ``config_sha256``, a sweep's
summary.json and a study's sampler. A difference is DIVERGED (or a refusal where the archive
contradicts itself), never a footnote to REPRODUCED. The end-to-end archives are in
test_archive.py (a forged metric) and test_study_check.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from reprotrain.config import config_sha256
from reprotrain.errors import ReproduceRefused
from reprotrain.tools.archive.archive_check import check_config_identity
from reprotrain.tools.reproduce.reproduce_sweep import summary_differences
from reprotrain.tools.reproduce.study_check import sampler_differences
from reprotrain.tools.runs.run_diff import compare_runs, with_metrics
from reprotrain.tools.sweeps import optuna_study, sweep_summary
from test_optuna_sweeps import fake_trial, settings


def fake_run(path: Path, val_rmse: float = 0.78) -> Path:
    path.mkdir(parents=True)
    fp = [{"epoch": e, "global_step": 2 * e, "weights_sha256": f"w{e}", "step_losses": [1.0, 0.5]}
          for e in (1, 2)]  # fmt: skip
    (path / "fingerprints.jsonl").write_text("".join(json.dumps(r) + "\n" for r in fp))
    rows = [{"epoch": e, "val_rmse": val_rmse + e, "seconds": 1.0} for e in (1, 2)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    final = {"val_rmse": val_rmse, "test_rmse": 0.8}
    record = {"status": "completed", "final_weights_sha256": "w2", "final_metrics": final}
    (path / "run.json").write_text(json.dumps(record))
    return path


def compared(a: Path, b: Path, epochs: int | None = None):
    return with_metrics(compare_runs(a, b, epochs=epochs), a, b, epochs)


def test_equal_records_are_identical_and_timings_do_not_count(tmp_path):
    a, b = fake_run(tmp_path / "a"), fake_run(tmp_path / "b")
    rows = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    (b / "metrics.jsonl").write_text("".join(json.dumps({**r, "seconds": 9.0}) + "\n"
                                             for r in rows))  # fmt: skip
    assert compared(a, b).identical


def test_a_forged_metric_row_diverges_naming_the_field_and_epoch(tmp_path):
    a, b = fake_run(tmp_path / "a"), fake_run(tmp_path / "b")
    rows = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    rows[1]["val_rmse"] = 0.0123
    (a / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = compared(a, b)
    assert not result.identical and result.divergent_epoch == 2
    assert "val_rmse 0.0123 vs 2.78" in result.verdict(), result.verdict()


def test_forged_final_metrics_diverge_over_the_whole_run_only(tmp_path):
    a, b = fake_run(tmp_path / "a"), fake_run(tmp_path / "b")
    record = json.loads((a / "run.json").read_text())
    record["final_metrics"]["val_rmse"] = 0.0123
    (a / "run.json").write_text(json.dumps(record))
    result = compared(a, b)
    assert not result.identical
    assert "final_metrics differ: val_rmse 0.0123 vs 0.78" in result.verdict()
    assert compared(a, b, epochs=1).identical, "a spot check of epoch 1 has no final metrics"


def test_a_row_more_or_less_diverges(tmp_path):
    a, b = fake_run(tmp_path / "a"), fake_run(tmp_path / "b")
    with (a / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"epoch": 3, "val_rmse": 0.1}) + "\n")
    result = compared(a, b)
    assert not result.identical and "metrics.jsonl has 3 vs 2 rows" in result.verdict()


def test_a_config_that_does_not_hash_to_its_record_is_refused():
    container = {"model": {"_target_": "m.M"}, "trainer": {"epochs": 2}}
    record = {"config_sha256": config_sha256(container)}
    check_config_identity(record, container, "run/config.resolved.yaml")
    forged = {**container, "callbacks": [{"_target_": "os.system", "command": "id"}]}
    with pytest.raises(ReproduceRefused, match="the archive contradicts itself"):
        check_config_identity(record, forged, "run/config.resolved.yaml")
    with pytest.raises(ReproduceRefused, match="records no config_sha256"):
        check_config_identity({}, forged, "x")  # the trainer always writes it: refused


def test_an_extended_runs_config_is_held_to_its_own_hash():
    """A resume that extended trainer.epochs hashes with its ``extended_from``: the archive
    of such a run is consistent, and the same config without the extension is not it."""
    container = {"model": {"_target_": "m.M"}, "trainer": {"epochs": 3}}
    extended = [{"trainer.epochs": 2, "global_step": 8}]
    record = {"config_sha256": config_sha256(container, extended), "extended_from": extended}
    check_config_identity(record, container, "run/config.resolved.yaml")
    with pytest.raises(ReproduceRefused, match="the archive contradicts itself"):
        check_config_identity({**record, "extended_from": None}, container, "x")


@pytest.fixture
def study_sweep(tmp_path) -> tuple[Path, dict]:
    sweep = tmp_path / "study"
    fake_trial(sweep, 0, {"optimizer.lr": 0.5}, [0.2, 0.4], "completed")
    fake_trial(sweep, 1, {"optimizer.lr": 0.05}, [0.6, 0.5], "completed")
    sampler = {"_target_": "optuna.samplers.TPESampler", "seed": 3}
    record = {"hydra": {"sweeper": {"sampler": sampler}}}
    (sweep / "multirun.yaml").write_text(yaml.safe_dump(record))
    study = optuna_study.write_study(sweep, settings(seed=3))
    return sweep, study


def test_a_forged_sampler_seed_is_a_difference(study_sweep):
    sweep, study = study_sweep
    assert sampler_differences(study, sweep) == []
    forged = {**study, "sampler": {**study["sampler"], "seed": 4}}
    assert sampler_differences(forged, sweep) == [
        "sampler seed: 4 in study.json, 3 in multirun.yaml (what the sweep ran with)"
    ]
    (sweep / "multirun.yaml").unlink()
    assert sampler_differences(forged, sweep) == [], "no record of it: the re-run decides"


def test_the_sampler_run_again_must_propose_the_archived_trials(tmp_path):
    """A forged seed in study.json and in multirun.yaml alike: the trials in the study's
    journal are not what that sampler proposes."""
    from reprotrain.tools.reproduce.study_check import proposal_differences
    from test_optuna_storage import FIXED, SPACE, FakeLauncher, runner

    sweep = tmp_path / "study"
    runner(sweep, FakeLauncher(), n_trials=4, n_jobs=2).run(FIXED)  # a journal, 2 batches
    record = {**settings(seed=7, n_startup_trials=2), "search_space": SPACE, "n_jobs": 2}
    assert proposal_differences(record, sweep) == []
    forged = {**record, "sampler": {**record["sampler"], "seed": 8}}
    (line,) = proposal_differences(forged, sweep)
    assert line.startswith("trial 0: the sampler of study.json (seed 8) proposes")
    evil = {**record, "sampler": {**record["sampler"], "class": "os.system"}}
    assert "not an optuna.samplers class" in proposal_differences(evil, sweep)[0]


def test_a_forged_summary_is_a_difference(study_sweep, tmp_path):
    sweep, _ = study_sweep
    for job in ("0", "1"):  # summaries read final_metrics from each run
        (sweep / job / "run.json").write_text(json.dumps(
            {"status": "completed", "final_metrics": {"val_acc": 0.5 + int(job) / 10},
             "seeds": {"base": int(job)}}))  # fmt: skip
    sweep_summary.write_summary(sweep)
    assert summary_differences(sweep) == []
    summary = json.loads((sweep / "summary.json").read_text())
    summary["groups"][0]["metrics"]["val_acc"]["mean"] = 0.99
    (sweep / "summary.json").write_text(json.dumps(summary))
    found = summary_differences(sweep)
    assert found and "val_acc: not what the archived runs give" in found[0], found
    shutil.rmtree(sweep / "1")
    (sweep / "summary.json").unlink()
    assert summary_differences(sweep) == [], "no summary: nothing claimed"


def test_a_summary_group_or_statistic_the_runs_do_not_give_is_a_difference(study_sweep):
    """What summary.json claims is checked; a statistic it lacks (a later version's) is not
    a claim."""
    sweep, _ = study_sweep
    for job in ("0", "1"):
        (sweep / job / "run.json").write_text(json.dumps(
            {"status": "completed", "final_metrics": {"val_acc": 0.5 + int(job) / 10},
             "seeds": {"base": int(job)}}))  # fmt: skip
    sweep_summary.write_summary(sweep)
    summary = json.loads((sweep / "summary.json").read_text())
    del summary["groups"][0]["metrics"]["val_acc"]["mean"]  # a statistic not claimed
    (sweep / "summary.json").write_text(json.dumps(summary))
    assert summary_differences(sweep) == []
    summary["groups"].append({**summary["groups"][0], "label": "lr=9"})
    (sweep / "summary.json").write_text(json.dumps(summary))
    assert summary_differences(sweep) == ["summary.json group lr=9 is not in the archived runs"]
