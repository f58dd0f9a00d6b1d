"""Metrics by name: a regression run's rmse and r2 (no accuracy anywhere) reach the sweep
summary and reproduce's tolerance check like accuracy and loss do, and the monitored one
(trainer.monitor) is the sweep's objective."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, assert_ok, base_env
from reprotrain import metric_names
from reprotrain.run.record import strict_loads
from reprotrain.tools.reproduce.reproduce import tolerance_report
from reprotrain.tools.runs.run_diff import compare_runs
from reprotrain.tools.sweeps import sweep_summary

slow = pytest.mark.slow  # a real sweep; the fake one below keeps the default tier fast
SPLIT_METRICS = {f"{s}_{m}" for s in ("train", "val", "test") for m in ("loss", "rmse", "r2")}


@pytest.fixture(scope="module")
def regression_sweep(tmp_path_factory) -> Path:
    """experiment=smoke_regression x seed.base=0,1, shrunk: seconds on 2 cores."""
    sweep = tmp_path_factory.mktemp("regression") / "sweep"
    cmd = [sys.executable, "-m", "reprotrain.train", "--multirun", "seed.base=0,1",
           "experiment=smoke_regression", "dataset.num_train=256", "dataset.num_test=128",
           "trainer.epochs=2", "logger=none", f"hydra.sweep.dir={sweep}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=base_env(), capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert_ok(proc)
    return sweep


@slow
def test_a_regression_sweep_summarises_rmse_and_r2_with_val_rmse_as_objective(regression_sweep):
    summary = strict_loads((regression_sweep / "summary.json").read_text())
    names = set(summary["metric_names"])  # no *_acc, no lr / step counts
    assert SPLIT_METRICS <= names <= SPLIT_METRICS | {f"best_{m}" for m in SPLIT_METRICS}
    (group,) = summary["groups"]
    for metric in ("val_rmse", "val_r2", "test_rmse", "test_r2"):
        assert group["metrics"][metric]["n"] == 2 and group["metrics"][metric]["ci95"]
        assert all(isinstance(r[metric], float) for r in group["runs"])
    assert {"val_rmse", "val_r2", "train_r2"} <= set(group["curves"])
    assert summary["objective"] == {
        "metric": "val_rmse",
        "mode": "min",
        "source": "trainer.monitor",
        "best_group": group["label"],
    }
    md = (regression_sweep / "summary.md").read_text()
    assert "Objective: val_rmse (min, trainer.monitor)" in md and "test_r2 mean ± std" in md


@slow
def test_reproduce_judges_rmse_and_r2_against_the_tolerance(regression_sweep):
    seed0, seed1 = regression_sweep / "0", regression_sweep / "1"
    diffs = compare_runs(seed0, seed1).metric_diffs  # two seeds: every metric differs
    judged = {k for row in diffs.values() for k in row if metric_names.is_outcome(k)}
    assert {"val_rmse", "val_r2", "train_rmse"} <= judged
    lines, within = tolerance_report(diffs, tolerance=0.0)
    assert not within and "val_rmse" in "".join(lines) and "OUT" in "".join(lines)
    lines, within = tolerance_report(diffs, tolerance=1e9)
    assert within and "val_r2" in "".join(lines) and "OUT" not in "".join(lines)


def test_only_split_metrics_are_outcomes_and_test_rmse_goes_like_val_rmse():
    assert metric_names.is_outcome("val_rmse", 0.5) and metric_names.is_outcome("best_test_r2")
    assert metric_names.is_outcome("test_f1", None)  # a non-finite value written as null
    for key, value in (("lr", 0.1), ("epoch", 2), ("best_epoch", 1), ("val_", 1.0)):
        assert not metric_names.is_outcome(key, value)
    assert not metric_names.is_outcome("val_note", "text")
    assert not metric_names.is_outcome("val_flag", True)
    assert metric_names.direction("test_rmse", "val_rmse", "min") == "min"
    assert metric_names.direction("val_r2", "val_rmse", "min") == "max"
    assert metric_names.direction("test_loss", "val_acc", "max") == "min"
    keys = ["test_r2", "val_rmse", "train_loss", "best_test_rmse", "val_loss", "lr"]
    assert sorted(keys[:-1], key=metric_names.sort_key) == [
        "train_loss", "val_loss", "val_rmse", "test_r2", "best_test_rmse",
    ]  # fmt: skip


def fake_regression_job(sweep: Path, num: int, lr: str, seed: int, rmse: float) -> None:
    """A completed regression job as the trainer leaves it, without training."""
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(f"- optimizer.lr={lr}\n- seed.base={seed}\n")
    (job / "config.resolved.yaml").write_text(
        "trainer:\n  monitor: val_rmse\n  monitor_mode: min\n"
    )
    row = {"epoch": 1, "global_step": 4, "lr": 0.1, "val_rmse": rmse, "val_r2": 1 - rmse}
    (job / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    final = {**row, "test_rmse": rmse + 0.01, "test_r2": 0.9 - rmse, "best_epoch": 1}
    record = {"run_dir": str(job), "status": "completed", "seeds": {"base": seed}}
    (job / "run.json").write_text(json.dumps({**record, "final_metrics": final}))


def test_the_summary_keeps_every_named_metric_and_the_lowest_val_rmse_group_wins(tmp_path):
    for num, (lr, seed, rmse) in enumerate([("0.1", 0, 0.5), ("0.1", 1, 0.6),
                                            ("0.2", 0, 0.3), ("0.2", 1, 0.4)]):  # fmt: skip
        fake_regression_job(tmp_path, num, lr, seed, rmse)
    summary = sweep_summary.write_summary(tmp_path)
    assert summary["metric_names"] == ["val_r2", "val_rmse", "test_r2", "test_rmse"]
    assert summary["objective"]["best_group"] == "optimizer.lr=0.2"  # min: lower rmse wins
    means = {g["label"]: g["metrics"]["val_rmse"]["mean"] for g in summary["groups"]}
    assert means == pytest.approx({"optimizer.lr=0.1": 0.55, "optimizer.lr=0.2": 0.35})
    assert set(summary["groups"][0]["curves"]) == {"val_rmse", "val_r2"}
    md = (tmp_path / "summary.md").read_text()
    assert "Objective: val_rmse (min, trainer.monitor); best group: optimizer.lr=0.2." in md
