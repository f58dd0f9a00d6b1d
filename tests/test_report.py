"""report.md and curves.png are drawn from a run directory alone, and never crash on one."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, assert_ok, train
from reprotrain.run import report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RECORD = {
    "experiment_id": "0123abcd-feedf00d-cpu",
    "name": "fake",
    "status": "completed",
    "seeds": {"base": 7, "source": "config", "init": 11, "data": 12, "augment": 13, "train": 14},
    "repro": {"level": "strict", "deterministic_algorithms": True},
    "git": {"commit": "a" * 40, "branch": "main", "dirty": True},
    "lock_sha256": "b" * 64,
    "config_sha256": "c" * 64,
}


def fake_run(
    run_dir: Path, epochs: int = 4, steps: int = 30, step_lrs: bool = True, nan_from: int = 0
) -> Path:
    """A run directory as the trainer writes it, with made-up but plausible numbers."""
    run_dir.mkdir(parents=True)
    rows, fps, g = [], [], 0
    for e in range(1, epochs + 1):
        losses = []
        for _ in range(steps):
            g += 1
            losses.append(None if nan_from and g >= nan_from else 2.3 * math.exp(-g / 40) + 0.1)
        finite = [v for v in losses if v is not None]
        row = {
            "epoch": e,
            "global_step": g,
            "train_loss": sum(finite) / len(finite) if len(finite) == steps else None,
            "train_acc": 1 - 0.9 * math.exp(-g / 40),
            "val_loss": 0.5 + 1 / e,
            "val_acc": 0.5 + e / 20,
            "lr": 0.1 / e,
            "seconds": 1.5,
            "images_per_s": 900.0,
        }
        if row["train_loss"] is None:
            row["nonfinite"] = ["train_loss"]
        rows.append(row)
        fp = {"epoch": e, "global_step": g, "step_losses": losses}
        if step_lrs:
            fp["step_lrs"] = [0.1 / e] * steps
        fps.append(fp)
    rows[-1].update(test_loss=0.61, test_acc=0.8125)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "fingerprints.jsonl").write_text("".join(json.dumps(r) + "\n" for r in fps))
    final = {k: v for k, v in rows[-1].items() if k not in ("seconds", "images_per_s")}
    (run_dir / "run.json").write_text(json.dumps({**RECORD, "final_metrics": final}))
    return run_dir


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "reprotrain.run.report", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_png(path: Path, min_bytes: int = 10_000) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > min_bytes, (path, len(data))


def test_report_names_the_identity_final_metrics_and_every_epoch(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "run")
    assert report.main([str(run)]) == 0
    md = (run / "report.md").read_text()
    for needle in [
        "0123abcd-feedf00d-cpu",  # experiment id
        "base `7`",  # seed
        "**strict**",  # determinism level
        "`" + "a" * 40 + "`",  # git commit
        "**dirty**",
        "`" + "b" * 64 + "`",  # lock sha256
        "| test_acc | 81.25% |",  # final metrics
        "![loss, accuracy and learning rate](curves.png)",
    ]:
        assert needle in md, needle
    table = md.split("## Epochs")[1].strip().splitlines()
    assert len(table) == 2 + 4  # header, rule, one line per epoch
    assert_png(run / "curves.png")


def test_nan_steps_and_null_metrics_become_gaps_not_crashes(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "run", nan_from=70)  # diverges in epoch 3
    assert report.main([str(run)]) == 0
    md = (run / "report.md").read_text()
    assert "| 3 | 90 | non-finite |" in md  # flagged null: shown as non-finite, not as missing
    steps, losses, _ = report.step_series(report.load_run(run))
    assert steps == list(range(1, 121)) and losses[69] is None and losses[68] is not None
    assert_png(run / "curves.png")


def test_without_per_step_lr_the_epoch_values_are_drawn(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "run", step_lrs=False)
    view = report.load_run(run)
    assert report.step_series(view)[2] == []
    c = report.curves(view)
    assert c.step_lr == [] and c.epoch_series["lr"] == [0.1, 0.05, 0.1 / 3, 0.025]
    assert report.main([str(run)]) == 0
    assert_png(run / "curves.png")


def test_a_run_killed_before_its_first_epoch_gets_a_report_but_no_plot(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({**RECORD, "status": "running"}))
    assert report.main([str(run)]) == 0
    assert "No epoch finished yet" in (run / "report.md").read_text()
    assert not (run / "curves.png").exists()


def test_out_writes_elsewhere_and_leaves_the_run_dir_untouched(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "run")
    before = sorted(p.name for p in run.iterdir())
    assert report.main([str(run), "--out", str(tmp_path / "elsewhere")]) == 0
    assert sorted(p.name for p in run.iterdir()) == before
    assert_png(tmp_path / "elsewhere" / "curves.png")


def test_help_exits_zero() -> None:
    proc = cli("--help")
    assert proc.returncode == 0 and "RUN_DIR" in proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("missing", "is not a directory"),
        ("no_run_json", "no run.json in"),
        ("bad_run_json", "run.json: invalid JSON at line 1"),
        ("bad_metrics_line", "metrics.jsonl line 2: invalid JSON"),
        ("metrics_not_objects", "metrics.jsonl line 1: expected a JSON object"),
    ],
)
def test_a_missing_or_corrupt_run_dir_is_one_line_exit_2(
    tmp_path: Path, damage: str, message: str
) -> None:
    run = tmp_path / "run"
    if damage != "missing":
        fake_run(run)
    if damage == "no_run_json":
        (run / "run.json").unlink()
    elif damage == "bad_run_json":
        (run / "run.json").write_text('{"status": ')
    elif damage == "bad_metrics_line":
        lines = (run / "metrics.jsonl").read_text().splitlines()
        (run / "metrics.jsonl").write_text(lines[0] + "\n" + lines[1][:20] + "\n")
    elif damage == "metrics_not_objects":
        (run / "metrics.jsonl").write_text("[1, 2]\n")
    proc = cli(str(run))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: "), proc.stderr
    assert message in proc.stderr
    assert not (run / "report.md").exists()


def test_report_of_a_real_training_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert_ok(train(run))
    proc = cli(str(run))
    assert proc.returncode == 0, proc.stderr
    record = json.loads((run / "run.json").read_text())
    md = (run / "report.md").read_text()
    assert record["experiment_id"] in md and record["lock_sha256"] in md
    assert f"{100 * record['final_metrics']['test_acc']:.2f}%" in md
    steps = report.step_series(report.load_run(run))[0]
    assert steps == list(range(1, record["final_metrics"]["global_step"] + 1))
    assert_png(run / "curves.png")


def test_report_and_curves_title_carry_the_runs_overrides(tmp_path: Path, monkeypatch) -> None:
    """A sweep job's own values (.hydra/overrides.yaml) under report.md's title and in the
    curves' title; a run without that file: its recorded command line without Hydra's
    settings; neither: said so."""
    from matplotlib.figure import Figure

    titles: list[str] = []
    real = Figure.suptitle
    monkeypatch.setattr(
        Figure, "suptitle", lambda fig, t, **kw: (titles.append(t), real(fig, t, **kw))[1]
    )
    run = fake_run(tmp_path / "job")
    (run / ".hydra").mkdir()
    (run / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=0.05\n- seed.base=1\n")
    assert report.main([str(run)]) == 0
    md = (run / "report.md").read_text()
    assert "**Overrides** (the hyperparameters given): `optimizer.lr=0.05` `seed.base=1`" in md
    assert "overrides: optimizer.lr=0.05 seed.base=1" in titles[-1]

    plain = fake_run(tmp_path / "plain")
    record = json.loads((plain / "run.json").read_text())
    record["command"] = ["python", "-m", "reprotrain.train", "experiment=smoke",
                         "optimizer.lr=0.2", "hydra.run.dir=outputs/x"]  # fmt: skip
    (plain / "run.json").write_text(json.dumps(record))
    assert report.main([str(plain)]) == 0
    assert "`experiment=smoke` `optimizer.lr=0.2`\n" in (plain / "report.md").read_text()
    assert "overrides: experiment=smoke optimizer.lr=0.2" in titles[-1]

    bare = fake_run(tmp_path / "bare")
    assert report.main([str(bare)]) == 0
    assert "the hyperparameters given): not recorded" in (bare / "report.md").read_text()
