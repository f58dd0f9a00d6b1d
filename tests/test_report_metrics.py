"""Reports and plots follow the task's metric names, not a fixed loss/acc pair."""

from __future__ import annotations

import json
from pathlib import Path

from reprotrain.run import report
from reprotrain.run.plots import metric_names


def regression_run(run_dir: Path, epochs: int = 3, steps: int = 4) -> Path:
    run_dir.mkdir(parents=True)
    rows, fps, g = [], [], 0
    for e in range(1, epochs + 1):
        g += steps
        rows.append(
            {
                "epoch": e, "global_step": g, "train_loss": 1.0 / e, "train_rmse": 1.0 / e,
                "train_r2": 1 - 1.0 / e, "val_loss": 1.1 / e, "val_rmse": 1.05 / e,
                "val_r2": 0.9 - 1.0 / e, "lr": 0.1, "seconds": 1.0, "images_per_s": 10.0,
            }
        )  # fmt: skip
        fps.append({"epoch": e, "global_step": g, "step_losses": [1.0 / e] * steps})
    final = {**rows[-1], "test_loss": 0.4, "test_rmse": 0.63, "test_r2": 0.71}
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "fingerprints.jsonl").write_text("".join(json.dumps(r) + "\n" for r in fps))
    (run_dir / "run.json").write_text(json.dumps({"status": "completed", "final_metrics": final}))
    return run_dir


def test_metric_names_come_from_the_split_prefixed_keys():
    keys = {"epoch": 1, "val_r2": 0, "train_rmse": 0, "train_loss": 0, "lr": 0, "test_r2": 0}
    assert metric_names(keys) == ["loss", "r2", "rmse"]


def test_a_regression_report_has_its_own_columns_and_panels(tmp_path):
    run = regression_run(tmp_path / "run")
    md_path, png_path = report.write_report(run)
    md = md_path.read_text()
    assert "![loss, rmse, r2 and learning rate](curves.png)" in md
    assert "| epoch | step | train loss | train r2 | train rmse | val loss | val r2 |" in md
    assert "| test_rmse | 0.6300 |" in md and "acc" not in md
    assert png_path.read_bytes()[:4] == b"\x89PNG"
    columns = report.epoch_columns(json.loads(line) for line in (run / "metrics.jsonl").open())
    assert columns[:3] == ["epoch", "global_step", "train_loss"]
    assert columns[-3:] == ["lr", "seconds", "images_per_s"]
