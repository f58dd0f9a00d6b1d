"""Sweep summary: grouped by non-seed overrides, strict JSON, a plot, and no crash on NaN."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import REPO, assert_ok, base_env
from reprotrain.run import plots
from reprotrain.run.record import strict_loads
from reprotrain.tools.sweeps import sweep_summary as ss

NAN = float("nan")


def fake_job(
    sweep: Path,
    num: int,
    overrides: list[str] | None,
    seed: float,
    final: dict,
    status: str = "completed",
    epochs: int = 3,
) -> Path:
    """One job directory as Hydra's multirun and the trainer leave it."""
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    if overrides is not None:
        (job / ".hydra" / "overrides.yaml").write_text(
            "".join(f"- {o}\n" for o in overrides) if overrides else "[]\n"
        )
    rows = [
        {
            "epoch": e,
            "global_step": 8 * e,
            **{k: (v * e / epochs if k.endswith("acc") else v) for k, v in final.items()},
        }
        for e in range(1, epochs + 1)
    ]
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = {
        "run_dir": str(job),
        "status": status,
        "seeds": {"base": seed},
        "final_metrics": {"epoch": epochs, "global_step": 8 * epochs, "lr": 0.0, **final},
    }
    (job / "run.json").write_text(json.dumps(record))  # NaN literals, as an old trainer wrote
    return job


def lr_sweep(sweep: Path) -> None:
    """optimizer.lr=0.1,0.2 x seed.base=0,1,2: accuracy depends on lr, a little on seed."""
    num = 0
    for lr, level in (("0.1", 0.6), ("0.2", 0.9)):
        for seed in range(3):
            overrides = ["experiment=selfcheck", f"optimizer.lr={lr}", f"seed.base={seed}"]
            fake_job(sweep, num, overrides, seed, {"test_acc": level + 0.01 * seed})
            num += 1


def test_runs_are_grouped_by_non_seed_overrides_and_never_pooled(tmp_path: Path) -> None:
    lr_sweep(tmp_path)
    summary = ss.write_summary(tmp_path)
    groups = {g["label"]: g for g in summary["groups"]}
    assert sorted(groups) == ["optimizer.lr=0.1", "optimizer.lr=0.2"]
    for label, level in (("optimizer.lr=0.1", 0.6), ("optimizer.lr=0.2", 0.9)):
        acc = groups[label]["metrics"]["test_acc"]
        assert acc["n"] == 3 and acc["mean"] == pytest.approx(level + 0.01)
        assert acc["ci95"][0] < acc["mean"] < acc["ci95"][1]
        assert sorted(r["seed"] for r in groups[label]["runs"]) == [0, 1, 2]
    assert "metrics" not in summary  # two groups: no sweep-wide number that mixes them
    md = (tmp_path / "summary.md").read_text()
    assert "| optimizer.lr=0.1 | 3/3 | 0.6100 ± 0.0100 (n=3) |" in md
    assert "95% CI" in md and "![per-epoch mean" in md


def test_overrides_that_keep_the_config_digest_never_split_a_group(tmp_path: Path) -> None:
    """A logger choice (or num_workers) is not what a run computes: the config digest leaves
    it out, so it is no group label ("logger=[tensorboard,mlflow,wandb]" was one)."""
    for num, (logger, seed) in enumerate((("tensorboard", 0), ("[tensorboard,mlflow]", 1))):
        overrides = ["optimizer.lr=0.1", f"logger={logger}", "trainer.num_workers=2",
                     "logger.log_every_steps=5", f"seed.base={seed}"]  # fmt: skip
        fake_job(tmp_path, num, overrides, seed, {"test_acc": 0.5 + 0.1 * seed})
    summary = ss.write_summary(tmp_path)
    assert [g["label"] for g in summary["groups"]] == ["optimizer.lr=0.1"]
    assert summary["groups"][0]["metrics"]["test_acc"]["n"] == 2


def test_a_group_of_one_run_shows_no_spread(tmp_path: Path) -> None:
    fake_job(tmp_path, 0, ["optimizer.lr=0.1", "seed.base=0"], 0, {"test_acc": 0.5})
    fake_job(tmp_path, 1, ["optimizer.lr=0.2", "seed.base=0"], 0, {"test_acc": 0.7})
    ss.write_summary(tmp_path)
    md = (tmp_path / "summary.md").read_text()
    assert "| optimizer.lr=0.1 | seed.base=0 | completed | 0.5000 |" in md and "± 0.0000" not in md


def test_a_nan_seed_or_nan_metric_keeps_the_summary_and_writes_strict_json(
    tmp_path: Path,
) -> None:
    fake_job(tmp_path, 0, ["seed.base=0"], 0, {"test_acc": 0.5, "test_loss": 1.0})
    fake_job(tmp_path, 1, ["seed.base=1"], 1, {"test_acc": NAN, "test_loss": NAN})
    fake_job(tmp_path, 2, ["seed.base=2"], NAN, {"test_acc": 0.7, "test_loss": 0.9})
    proc = subprocess.run(
        [sys.executable, "-m", "reprotrain.tools.sweeps.sweep_summary", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    summary = strict_loads((tmp_path / "summary.json").read_text())  # NaN would raise here
    acc = summary["metrics"]["test_acc"]
    assert acc["n"] == 2 and acc["n_nonfinite"] == 1 and acc["mean"] == pytest.approx(0.6)
    assert "runs[1].test_acc" in summary["nonfinite"] and "runs[2].seed" in summary["nonfinite"]
    assert summary["runs"][1]["test_acc"] is None
    assert "(n=2, 1 non-finite)" in (tmp_path / "summary.md").read_text()


def test_one_run_has_no_interval_rather_than_a_nan_one(tmp_path: Path) -> None:
    fake_job(tmp_path, 0, ["seed.base=0"], 0, {"test_acc": 0.5})
    summary = ss.write_summary(tmp_path)
    assert summary["metrics"]["test_acc"]["ci95"] is None
    strict_loads((tmp_path / "summary.json").read_text())


def test_runs_that_did_not_complete_are_listed_but_left_out_of_the_statistics(
    tmp_path: Path,
) -> None:
    fake_job(tmp_path, 0, ["seed.base=0"], 0, {"test_acc": 0.5})
    fake_job(tmp_path, 1, ["seed.base=1"], 1, {"test_acc": 0.7})
    fake_job(tmp_path, 2, ["seed.base=2"], 2, {"test_acc": 0.1}, status="failed")
    summary = ss.write_summary(tmp_path)
    (group,) = summary["groups"]
    assert group["n_runs"] == 3 and group["n_completed"] == 2
    assert group["metrics"]["test_acc"]["mean"] == pytest.approx(0.6)
    assert (
        "Not completed (left out of the statistics): 1 failed"
        in (tmp_path / "summary.md").read_text()
    )


def test_an_unreadable_job_is_noted_and_the_others_are_summarised(tmp_path: Path) -> None:
    lr_sweep(tmp_path)
    (tmp_path / "0" / "run.json").write_text('{"status": "compl')
    summary = ss.write_summary(tmp_path)
    assert sum(g["n_runs"] for g in summary["groups"]) == 5
    assert len(summary["unreadable"]) == 1 and "0/run.json" in summary["unreadable"][0]


def test_the_plot_has_one_band_per_group_per_metric(tmp_path: Path, monkeypatch) -> None:
    lr_sweep(tmp_path)
    seen = {}
    real = plots.plot_sweep

    def spy(title, panels, cols, note):
        seen.update(panels)
        return real(title, panels, cols, note)

    monkeypatch.setattr(plots, "plot_sweep", spy)
    ss.write_summary(tmp_path)
    assert list(seen) == ["test_acc"]
    bands = seen["test_acc"]
    assert [b.label for b in bands] == ["optimizer.lr=0.1", "optimizer.lr=0.2"]
    assert all(b.epochs == [1, 2, 3] and len(b.runs) == 3 for b in bands)
    assert bands[1].mean[-1] == pytest.approx(0.91)
    assert bands[1].lo[-1] < bands[1].mean[-1] < bands[1].hi[-1]
    png = (tmp_path / "summary.png").read_bytes()
    assert png[:4] == b"\x89PNG" and len(png) > 10_000


def test_help_and_bad_input_never_print_a_traceback(tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "reprotrain.tools.sweeps.sweep_summary", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )

    ok = cli("--help")
    assert ok.returncode == 0 and "SWEEP_DIR" in ok.stdout
    for target, message in [
        (tmp_path / "missing", "is not a directory"),
        (tmp_path, "no run.json under"),
    ]:
        proc = cli(str(target))
        assert proc.returncode == 2 and proc.stderr.startswith("error: "), proc.stderr
        assert message in proc.stderr and proc.stderr.count("\n") == 1
    assert not (tmp_path / "summary.json").exists()


def test_the_hydra_callback_reports_a_problem_instead_of_failing_the_sweep(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    def broken(sweep_dir):
        raise RuntimeError("disk full")

    monkeypatch.setattr(ss, "write_summary", broken)
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    ss.SweepSummaryCallback().on_multirun_end(config)
    assert "warning: no sweep summary (RuntimeError: disk full)" in capsys.readouterr().err


def test_a_real_seed_sweep_leaves_a_summary_and_a_plot(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "reprotrain.train",
            "--multirun",
            "seed.base=0,1",
            "experiment=selfcheck",
            "dataset.num_train=256",
            "dataset.num_test=128",
            "trainer.batch_size=64",
            "trainer.epochs=2",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=REPO,
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert_ok(proc)
    summary = strict_loads((sweep / "summary.json").read_text())
    (group,) = summary["groups"]
    assert group["n_completed"] == 2 and "experiment=selfcheck" in group["overrides"]
    assert not any(o.startswith("seed") for o in group["overrides"])
    assert [p["epoch"] for p in group["curves"]["val_acc"]] == [1, 2]
    png = (sweep / "summary.png").read_bytes()
    assert png[:4] == b"\x89PNG" and len(png) > 10_000


def test_summary_tells_absent_from_nonfinite_and_gives_n_beside_each_mean(tmp_path: Path) -> None:
    # Two runs whose best epoch was the last have no best_test_loss (absent, not diverged);
    # one run's best_test_loss is non-finite, written as null and flagged by strict JSON.
    fake_job(tmp_path, 0, ["seed.base=0"], 0, {"test_acc": 0.5, "test_loss": 1.0})
    fake_job(tmp_path, 1, ["seed.base=1"], 1, {"test_acc": 0.6, "test_loss": 1.1})
    job = fake_job(
        tmp_path, 2, ["seed.base=2"], 2, {"test_acc": 0.7, "test_loss": 0.9, "best_test_loss": 2.0}
    )
    job3 = fake_job(
        tmp_path, 3, ["seed.base=3"], 3, {"test_acc": 0.7, "test_loss": 0.9, "best_test_loss": 2.5}
    )
    record = json.loads((job3 / "run.json").read_text())
    record["final_metrics"]["best_test_loss"] = None
    record["nonfinite_fields"] = ["final_metrics.best_test_loss"]
    (job3 / "run.json").write_text(json.dumps(record))
    assert job.is_dir()
    summary = ss.write_summary(tmp_path)
    best = summary["metrics"]["best_test_loss"]
    assert (best["n"], best["n_nonfinite"], best["n_absent"]) == (1, 1, 2)
    md = (tmp_path / "summary.md").read_text()
    assert "2.0000 (n=1, 1 non-finite, 2 absent)" in md
    assert "(n=4)" in md  # test_acc: all four runs


def test_an_interval_stays_inside_the_metrics_range(tmp_path: Path) -> None:
    for i, acc in enumerate([0.0, 0.0, 0.1]):  # mean 0.033: the t interval reaches below 0
        fake_job(tmp_path, i, [f"seed.base={i}"], i, {"test_acc": acc, "test_loss": 2.3})
    acc = ss.write_summary(tmp_path)["metrics"]["test_acc"]
    assert acc["ci95"][0] == 0.0 and acc["ci95_clipped"] is True
    assert ss.describe([0.0, 0.0, 0.1])["ci95"][0] < 0  # the raw t interval did reach below 0
    loss = ss.describe([2.3, 2.3, 2.4], (0.0, float("inf")))
    assert loss["ci95_clipped"] is False


# An Optuna sampler's draws, as the job's overrides spell them.
DRAWN = ("0.012345678901234567", "0.23456789012345678", "0.0034567890123456789")


def optuna_study_of_one_seed(sweep: Path) -> None:
    """Three trials of one seed each, drawn learning rates, and the study.json Optuna's
    record leaves (trial 2 failed: no value)."""
    trials = []
    for num, (lr, acc) in enumerate(zip(DRAWN, (0.61, 0.83, 0.4), strict=True)):
        status = "failed" if num == 2 else "completed"
        overrides = ["experiment=selfcheck", f"optimizer.lr={lr}", f"optimizer.weight_decay={lr}"]
        fake_job(sweep, num, overrides, 0, {"val_acc": acc}, status=status)
        trials.append({"number": num, "job": str(num), "value": None if num == 2 else acc,
                       "params": {"optimizer.lr": float(lr)}, "status": status})  # fmt: skip
    study = {"metric": "val_acc", "metric_mode": "max", "direction": "maximize", "trials": trials}
    (sweep / "study.json").write_text(json.dumps(study))


def test_an_optuna_study_lists_its_trials_by_the_objective_best_first(tmp_path: Path) -> None:
    optuna_study_of_one_seed(tmp_path)
    ss.write_summary(tmp_path)
    md = (tmp_path / "summary.md").read_text()
    table = md.split("## Optuna trials, by val_acc (max, best first)\n\n")[1].split("\n\n")[0]
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    assert [r[0] for r in rows] == ["| 1", "| 0", "| 2"]  # 0.83, 0.61, then the failed one
    assert [r[1] for r in rows] == ["0.2346", "0.01235", "0.003457"]  # 4 significant digits
    assert rows[2][2:4] == ["—", "failed"]
    summary = strict_loads((tmp_path / "summary.json").read_text())
    assert any(DRAWN[0] in g["label"] for g in summary["groups"])  # every digit kept there


def test_a_one_seed_study_shows_each_runs_value_without_statistics_per_group(
    tmp_path: Path, monkeypatch
) -> None:
    """n=1 per group: no "mean ± std" heading, no mean/std/CI rows per group, no per-group
    sections; one table of the runs; the plot's note does not speak of a mean across seeds."""
    optuna_study_of_one_seed(tmp_path)
    notes = []
    real = plots.plot_sweep
    monkeypatch.setattr(plots, "plot_sweep", lambda *a: (notes.append(a[3]), real(*a))[1])
    ss.write_summary(tmp_path)
    md = (tmp_path / "summary.md").read_text()
    assert "mean ± std" not in md and "**mean**" not in md and "95% CI" not in md
    assert "One run per group" in md and md.count("\n## ") == 2  # the trials, the runs
    runs = md.split("## Runs\n\n")[1].splitlines()
    assert len(runs) == 2 + 3 and sum("| failed |" in line for line in runs) == 1
    assert "mean across seeds" not in notes[0] and "one run" in notes[0]
    assert "across seeds" not in md.split("![")[1].split("]")[0]  # the image's alt text
    assert "(n=1)" not in md  # each value is the run's own, in one table


def test_a_group_of_several_seeds_still_has_its_statistics_beside_one_of_one(tmp_path) -> None:
    lr_sweep(tmp_path)
    fake_job(tmp_path, 6, ["experiment=selfcheck", "optimizer.lr=0.3", "seed.base=0"], 0,
             {"test_acc": 0.5})  # fmt: skip
    ss.write_summary(tmp_path)
    md = (tmp_path / "summary.md").read_text()
    sections = md.split("\n## ")[1:]
    assert [s.splitlines()[0] for s in sections] == [
        "optimizer.lr=0.1", "optimizer.lr=0.2", "optimizer.lr=0.3"]  # fmt: skip
    assert all("**95% CI**" in s for s in sections[:2]) and "**mean**" not in sections[2]


def test_the_legend_of_long_drawn_values_fits_in_the_figure(tmp_path: Path, monkeypatch) -> None:
    """Six groups named by two 17-digit draws each: the labels are shortened and the legend
    (wrapped, fewer columns) lies inside the figure."""
    for num in range(6):
        lr, wd = f"0.0{num + 1}2345678901234567", f"0.000{num + 1}2345678901234567"
        overrides = [f"optimizer.lr={lr}", f"optimizer.weight_decay={wd}", "seed.base=0"]
        fake_job(tmp_path, num, overrides, 0, {"test_acc": 0.5 + num / 20})
    figures = []
    real = plots._png
    monkeypatch.setattr(plots, "_png", lambda fig: (figures.append(fig), real(fig))[1])
    ss.write_summary(tmp_path)
    (fig,) = figures
    (legend,) = fig.legends
    texts = [t.get_text() for t in legend.get_texts()]
    assert texts[0] == "optimizer.lr=0.01235 optimizer.weight_decay=0.0001235  (n=1)"
    box, page = legend.get_window_extent(), fig.bbox
    assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0, (box, page)


def test_long_decimals_are_shortened_and_other_text_is_left_alone() -> None:
    text = "lr=0.012345678901234567 wd=1.5e-05 seed.base=3 v1.2.12345 x=-2.000001 n=0.1234"
    assert ss.short_numbers(text) == "lr=0.01235 wd=1.5e-05 seed.base=3 v1.2.12345 x=-2 n=0.1234"
