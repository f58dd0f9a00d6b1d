"""Summarise a sweep: per group of non-seed overrides, mean, std, min, max and a 95% CI.

    python -m reprotrain.tools.sweeps.sweep_summary multirun/<name>/<stamp>

Writes ``summary.json``, ``summary.md`` and ``summary.png``; also a Hydra callback at the end
of a ``--multirun`` that never fails the finished sweep. docs/sweeps-optuna.md.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from reprotrain import metric_names
from reprotrain.config import NON_IDENTITY_PREFIXES, is_identity
from reprotrain.errors import ReprotrainError
from reprotrain.loggers.mlflow_sink import end_sweep_run, start_sweep_run
from reprotrain.loggers.params import is_seed, override_key
from reprotrain.run.bounded import load_json
from reprotrain.run.directory import sweep_jobs
from reprotrain.run.readers import read_config, read_overrides
from reprotrain.run.record import (
    METRICS,
    RESOLVED_CONFIG,
    RUN_JSON,
    atomic_write_bytes,
    atomic_write_text,
    read_jsonl,
    strict_dumps,
    to_strict_json,
)
from reprotrain.shown import shown, warnings_shown
from reprotrain.tools import cli
from reprotrain.tools.sweeps import optuna_study, sweep_progress
from reprotrain.tools.sweeps.equivalence import mean_ci
from reprotrain.tools.sweeps.optuna_study import StudyView

SUMMARY_JSON, SUMMARY_MD, SUMMARY_PNG = "summary.json", "summary.md", "summary.png"
UNKNOWN_OVERRIDES = "(no .hydra/overrides.yaml)"


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def describe(values: list[Any], value_range: tuple[float, float] | None = None) -> dict[str, Any]:
    """Statistics of the finite values; NaN/inf and None counted apart; ``ci95`` clipped."""
    finite = [float(v) for v in values if _finite(v)]
    n, n_absent = len(finite), sum(v is None for v in values)
    out: dict[str, Any] = {"n": n, "n_nonfinite": len(values) - n - n_absent, "n_absent": n_absent}
    if n == 0:
        return {**out, "mean": None, "std": None, "min": None, "max": None, "ci95": None}
    ci = mean_ci(finite, 0.95)  # scipy's t: the same code as the statistical verdict
    clipped = False
    if ci is not None and value_range is not None:
        lo, hi = max(ci[0], value_range[0]), min(ci[1], value_range[1])
        clipped = (lo, hi) != tuple(ci)
        ci = (lo, hi)
    return {
        **out,
        "mean": statistics.fmean(finite),
        "std": statistics.stdev(finite) if n > 1 else 0.0,
        "min": min(finite),
        "max": max(finite),
        "ci95": list(ci) if ci is not None else None,
        "ci95_clipped": clipped,
    }


def changes_what_is_computed(override: str) -> bool:
    """Not a seed, and a key the config digest counts (``logger=...`` never splits a group)."""
    key = override_key(override)
    if is_seed(key) or not is_identity(key):
        return False
    return not any(key == prefix.rstrip(".") for prefix in NON_IDENTITY_PREFIXES)


@dataclass
class Job:
    run_dir: Path
    record: dict[str, Any]
    overrides: list[str] | None  # None: no .hydra/overrides.yaml (runs gathered by hand)
    epochs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def group(self) -> tuple[str, ...]:
        if self.overrides is None:
            return (UNKNOWN_OVERRIDES,)
        return tuple(sorted(o for o in self.overrides if changes_what_is_computed(o)))

    @property
    def seed_overrides(self) -> list[str]:
        return [o for o in self.overrides or [] if is_seed(override_key(o))]

    @property
    def status(self) -> str:
        return str(self.record.get("status", "unknown"))

    @property
    def final(self) -> dict[str, Any]:
        final = self.record.get("final_metrics")
        return final if isinstance(final, dict) else {}

    def outcome(self, metric: str) -> Any:
        """The final value of ``metric``: NaN if in ``nonfinite_fields``, else None if absent."""
        value = self.final.get(metric)
        flagged = self.record.get("nonfinite_fields") or []
        if value is None and f"final_metrics.{metric}" in flagged:
            return math.nan
        return value


def _load_json(path: Path) -> Any:
    try:
        return load_json(path.read_text(), str(path))  # lenient on NaN; bounded
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: {e}") from None


def find_jobs(sweep_dir: Path) -> tuple[list[Job], list[str]]:
    """Every run under the sweep dir, plus a note per run.json that could not be read."""
    jobs, problems = [], []
    for run_dir in sweep_jobs(sweep_dir):
        path = run_dir / RUN_JSON
        try:
            record = _load_json(path)
            if not isinstance(record, dict):
                raise ValueError(f"{path}: not a JSON object")
            overrides = read_overrides(run_dir)
        except Exception as e:  # one broken job must not hide the others
            problems.append(str(e).splitlines()[0])
            continue
        epochs = read_jsonl(run_dir / METRICS, torn_tail_ok=True)
        jobs.append(Job(run_dir, record, overrides, epochs))
    return jobs, problems


def outcome_metrics(jobs: list[Job]) -> list[str]:
    """Every split metric by name; step counts and the final lr are not outcomes."""
    return sorted(metric_names.outcome_keys(j.final for j in jobs), key=metric_names.sort_key)


def monitor_of(job: Job) -> tuple[str, str] | None:
    """(trainer.monitor, trainer.monitor_mode) from the resolved config, or None."""
    try:
        trainer = read_config(job.run_dir / RESOLVED_CONFIG).get("trainer") or {}
    except Exception:  # a summary without an objective beats no summary
        return None
    return str(trainer.get("monitor", "val_acc")), str(trainer.get("monitor_mode", "max"))


def objective(jobs: list[Job], groups: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The monitored metric, its direction and the group whose mean is best on it."""
    monitor = next((m for m in map(monitor_of, jobs) if m is not None), None)
    if monitor is None:
        return None
    metric, mode = monitor
    means = [(g["metrics"][metric]["mean"], g["label"]) for g in groups if metric in g["metrics"]]
    means = [(v, label) for v, label in means if v is not None]
    best = (max if mode == "max" else min)(means)[1] if means else None
    return {"metric": metric, "mode": mode, "source": "trainer.monitor", "best_group": best}


def group_labels(keys: list[tuple[str, ...]]) -> dict[tuple[str, ...], str]:
    """Name each group by the overrides that differ between groups (all, if only one)."""
    common = set.intersection(*(set(k) for k in keys)) if keys else set()
    return {k: " ".join(o for o in k if o not in common) or " ".join(k) or "all runs" for k in keys}


def epoch_curves(jobs: list[Job], metrics: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Per metric and epoch: describe() across the group's runs."""
    curves: dict[str, list[dict[str, Any]]] = {}
    for m in metrics:
        by_epoch: dict[int, list[Any]] = {}
        for j in jobs:
            for row in j.epochs:
                if m in row and isinstance(row.get("epoch"), int):
                    by_epoch.setdefault(row["epoch"], []).append(row[m])
        if by_epoch:
            curves[m] = [{"epoch": e, **describe(v)} for e, v in sorted(by_epoch.items())]
    return curves


def summarize(
    sweep_dir: Path, jobs: list[Job] | None = None, problems: list[str] | None = None
) -> dict[str, Any]:
    if jobs is None:
        jobs, problems = find_jobs(sweep_dir)
    metrics = outcome_metrics([j for j in jobs if j.status == "completed"])
    keys = sorted({j.group for j in jobs})
    labels = group_labels(keys)
    curve_metrics = sorted(  # losses first, then every other metric
        metric_names.outcome_keys(r for j in jobs for r in j.epochs),
        key=lambda k: (not k.endswith("_loss"), metric_names.sort_key(k)),
    )
    groups = []
    for key in keys:
        members = [j for j in jobs if j.group == key]
        done = [j for j in members if j.status == "completed"]
        groups.append(
            {
                "label": labels[key],
                "overrides": list(key),
                "n_runs": len(members),
                "n_completed": len(done),
                "statuses": dict(sorted(Counter(j.status for j in members).items())),
                "runs": [_run_entry(j, metrics, labels[key]) for j in members],
                "metrics": {
                    m: describe([j.outcome(m) for j in done], metric_names.value_range(m))
                    for m in metrics
                },
                "curves": epoch_curves(done, curve_metrics),
            }
        )
    summary: dict[str, Any] = {
        "sweep_dir": str(sweep_dir),
        "grouped_by": "Hydra overrides without seed / seed.* (from .hydra/overrides.yaml)",
        "ci95": "95% t confidence interval of the mean across seeds (null below 2 runs), cut"
        " to the metric's range (ci95_clipped)",
        "plot_band": "summary.png: per-epoch mean ± 1 std across seeds, per group",
        "metric_names": metrics,
        "objective": objective([j for j in jobs if j.status == "completed"], groups),
        "groups": groups,
        "runs": [r for g in groups for r in g["runs"]],
        "unreadable": problems or [],
    }
    if len(groups) == 1:  # one group: its statistics are the sweep's (never pooled across)
        summary["metrics"] = groups[0]["metrics"]
    study = read_study(sweep_dir)
    if study is not None and "storage_agrees" in study:  # the journal as it is now
        summary["storage_agrees"] = study["storage_agrees"]
    return summary


def _run_entry(job: Job, metrics: list[str], label: str) -> dict[str, Any]:
    return {
        "run_dir": str(job.record.get("run_dir") or job.run_dir),
        "group": label,
        "seed": (job.record.get("seeds") or {}).get("base"),
        "seed_overrides": job.seed_overrides,
        "status": job.status,
        **{m: job.outcome(m) for m in metrics},
    }


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4f}" if math.isfinite(v) else "NaN" if math.isnan(v) else str(v)
    return "—" if v is None else str(v)


def _ci(stats: dict[str, Any]) -> str:
    ci = stats.get("ci95")
    return f"[{ci[0]:.4f}, {ci[1]:.4f}]" if ci else "—"


def _row(cells: list[str]) -> str:
    """A table row; each cell (labels, statuses, seeds from the records) escaped."""
    return "| " + " | ".join(shown(c, 500) for c in cells) + " |"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return [_row(head), "|---" * len(head) + "|", *map(_row, rows)]


def _cells(run: dict[str, Any], metrics: list[str]) -> list[str]:
    """A run's seed (its overrides, else its seed), status and final value of each metric."""
    seed = " ".join(run["seed_overrides"]) or _fmt(run["seed"])
    return [seed, run["status"], *(_fmt(run[m]) for m in metrics)]


#: A decimal with more digits than a reader takes in (``0.012345678901234567``, what an
#: Optuna sampler draws): shown to :data:`DIGITS` significant digits in labels and tables.
_LONG_NUMBER = re.compile(r"(?<![\w.])-?\d+\.\d{5,}(?:[eE][-+]?\d+)?(?![\w.])")
DIGITS = 4


def short_numbers(text: str) -> str:
    """``text`` with each long decimal cut to :data:`DIGITS` digits (summary.json keeps them)."""
    return _LONG_NUMBER.sub(lambda m: f"{float(m.group()):.{DIGITS}g}", text)


def one_run_each(summary: dict[str, Any]) -> bool:
    """Every group is one run (an Optuna study of one seed): no mean, spread or interval."""
    return all(g["n_runs"] <= 1 for g in summary["groups"])


def read_study(sweep_dir: Path) -> dict[str, Any] | None:
    """The sweep's study.json (an Optuna study: ``optuna_study.record``), or None; a study
    kept in the sweep's journal has ``storage_agrees`` checked again, against the journal as
    it is now (a torn or edited journal does not agree)."""
    path = Path(sweep_dir) / optuna_study.STUDY_JSON
    try:
        study = _load_json(path) if path.is_file() else None
    except ValueError:  # a summary without the trials table beats no summary
        return None
    if not (isinstance(study, dict) and isinstance(study.get("trials"), list)):
        return None
    if study.get("optuna_storage") == optuna_study.JOURNAL:
        journal = Path(sweep_dir) / optuna_study.JOURNAL
        keys = ("number", "params", "value", "status")
        trials = [t for t in study["trials"] if isinstance(t, dict) and all(k in t for k in keys)]
        name = study.get("study_name")
        study["storage_agrees"] = optuna_study.storage_agrees(journal, name, trials)
    return study


def trials_table(study: dict[str, Any]) -> list[str]:
    """The study's trials, best value first, one column per searched key."""
    metric, mode = str(study.get("metric", "value")), str(study.get("metric_mode", "max"))
    trials = [t for t in study["trials"] if isinstance(t, dict)]
    keys = sorted({k for t in trials for k in (t.get("params") or {})})
    valued = [t for t in trials if _finite(t.get("value"))]
    ranked = sorted(valued, key=lambda t: t["value"], reverse=mode == "max")
    ranked += [t for t in trials if not _finite(t.get("value"))]
    rows = []
    for t in ranked:
        params = t.get("params") or {}
        values = [short_numbers(str(params[k])) if k in params else "—" for k in keys]
        cells = [_fmt(t.get("number")), *values, _fmt(t.get("value")), str(t.get("status"))]
        rows.append([*cells, str(t.get("job", "—"))])
    head = ["trial", *keys, metric, "status", "run"]
    title = f"## Optuna trials, by {shown(metric)} ({mode}, best first)"
    return [title, "", *_table(head, rows), ""]


def _headline(summary: dict[str, Any], metrics: list[str]) -> list[str]:
    """A row per group: its runs and, per metric, mean ± std (n) (one run: its value)."""
    rows = []
    for g in summary["groups"]:
        cells = [short_numbers(g["label"]), f"{g['n_completed']}/{g['n_runs']}"]
        for m in metrics:
            s = g["metrics"][m]
            text = "—" if s["mean"] is None else f"{s['mean']:.4f}"
            if s["mean"] is not None and s["n"] > 1:  # one run has no spread to show
                text += f" ± {s['std']:.4f}"
            text += f" (n={s['n']}"
            if s["n_nonfinite"]:
                text += f", {s['n_nonfinite']} non-finite"
            if s.get("n_absent"):
                text += f", {s['n_absent']} absent"
            text += ")"
            cells.append(text)
        rows.append(cells)
    return _table(["group", "runs", *(f"{m} mean ± std" for m in metrics)], rows)


def _runs_table(summary: dict[str, Any], metrics: list[str]) -> list[str]:
    """Groups of one run each: one table of the runs' final values, no statistics."""
    rows = [[short_numbers(r["group"]), *_cells(r, metrics)] for r in summary["runs"]]
    return ["## Runs", "", *_table(["group", "seed", "status", *metrics], rows)]


def _group_sections(summary: dict[str, Any], metrics: list[str]) -> list[str]:
    """Per group its runs; the statistics below them where there are two runs or more."""
    out: list[str] = []
    for g in summary["groups"]:
        out += ["", f"## {shown(short_numbers(g['label']))}", ""]
        failed = {s: n for s, n in g["statuses"].items() if s != "completed"}
        if failed:
            out += [
                "Not completed (left out of the statistics): "
                + ", ".join(f"{n} {shown(s)}" for s, n in failed.items()),
                "",
            ]
        rows = [_cells(r, metrics) for r in g["runs"]]
        if g["n_completed"] >= 2:  # one value: its mean, min and max are itself, no std or CI
            stats = g["metrics"]
            for k in ("mean", "std", "min", "max"):
                rows.append([f"**{k}**", "", *(_fmt(stats[m][k]) for m in metrics)])
            rows.append(["**95% CI**", "", *(_ci(stats[m]) for m in metrics)])
        out += _table(["seed", "status", *metrics], rows)
    return out


def to_markdown(summary: dict[str, Any], png_name: str | None = None) -> str:
    metrics: list[str] = summary["metric_names"]
    single = one_run_each(summary)
    out = [f"# Sweep summary: {shown(summary['sweep_dir'])}", ""]
    how = (
        "One run per group: each value is that run's (no mean, spread or interval across"
        " seeds); non-finite: the run diverged; absent: the run has no such value."
        if single
        else "Mean ± std over the completed runs' finite values (n: how many); non-finite: the"
        " run diverged; absent: the run has no such value (e.g. no best_test_* when the best"
        " epoch was the last). 95% CI: t interval of the mean, cut to the metric's range."
    )
    out += [f"Grouped by {summary['grouped_by']}.", how, ""]
    goal = summary.get("objective")
    if goal:
        group = short_numbers(str(goal["best_group"]))
        best = f"; best group: {shown(group)}" if goal["best_group"] else ""
        out += [f"Objective: {shown(goal['metric'])} ({goal['mode']}, trainer.monitor){best}.", ""]
    study = read_study(Path(summary["sweep_dir"]))
    if study is not None:
        out += trials_table(study)
    if summary.get("storage_agrees") is False:
        out += [
            f"The study's journal ({optuna_study.JOURNAL}) does not hold these trials "
            "(storage_agrees: false): it is torn, edited or another study's.",
            "",
        ]
    if png_name:
        what = "value of each group's one run" if single else "mean ± 1 std across seeds"
        out += [f"![per-epoch {what}, per group]({png_name})", ""]
    if single:  # a row per run is a row per group: one table
        out += _runs_table(summary, metrics)
    else:
        out += _headline(summary, metrics) + _group_sections(summary, metrics)
    if summary.get("unreadable"):
        out += ["", "Unreadable run records: " + "; ".join(map(shown, summary["unreadable"]))]
    return "\n".join(out) + "\n"


def sweep_png(summary: dict[str, Any], jobs: list[Job]) -> bytes | None:
    """Per metric, one band per group; each completed run of the group as a faint line."""
    from reprotrain.run.plots import Band, plot_sweep

    panels: dict[str, list[Band]] = {}
    for g in summary["groups"]:
        members = [j for j in jobs if j.status == "completed" and j.group == tuple(g["overrides"])]
        for metric, points in g["curves"].items():
            epochs = [p["epoch"] for p in points]
            panels.setdefault(metric, []).append(
                Band(
                    label=short_numbers(g["label"]),
                    epochs=epochs,
                    mean=[p["mean"] for p in points],
                    lo=[_shift(p["mean"], p["std"], -1) for p in points],
                    hi=[_shift(p["mean"], p["std"], +1) for p in points],
                    n=[p["n"] for p in points],
                    runs=[[_epoch_value(j.epochs, e, metric) for e in epochs] for j in members],
                )
            )
    if not panels:
        return None
    n_loss = sum(m.endswith("_loss") for m in panels)
    note = (
        "line: each group's one run (one seed: no mean or spread across seeds)"
        if one_run_each(summary)
        else "line: mean across seeds · band: ±1 std across seeds · faint: each seed"
        " (95% CIs of the final metrics are in summary.md)"
    )
    return plot_sweep(
        f"Sweep: {summary['sweep_dir']}", panels, max(n_loss, len(panels) - n_loss), note
    )


def _shift(mean: float | None, std: float | None, sign: int) -> float | None:
    return None if mean is None or std is None else mean + sign * std


def _epoch_value(rows: list[dict[str, Any]], epoch: int, metric: str) -> Any:
    return next((r.get(metric) for r in rows if r.get("epoch") == epoch), None)


def write_summary(sweep_dir: Path) -> dict[str, Any]:
    """summary.json (strict), summary.png (when any epoch was recorded) and summary.md."""
    sweep_dir = Path(sweep_dir)
    jobs, problems = find_jobs(sweep_dir)
    summary = summarize(sweep_dir, jobs, problems)
    with warnings_shown():  # matplotlib names a group's or metric's characters raw
        png = sweep_png(summary, jobs)
    if png is not None:
        atomic_write_bytes(sweep_dir / SUMMARY_PNG, png)
    else:
        (sweep_dir / SUMMARY_PNG).unlink(missing_ok=True)  # never leave a stale plot
    clean, nonfinite = to_strict_json(summary)
    clean["nonfinite"] = nonfinite
    atomic_write_text(sweep_dir / SUMMARY_JSON, strict_dumps(clean, indent=2))
    atomic_write_text(sweep_dir / SUMMARY_MD, to_markdown(summary, SUMMARY_PNG if png else None))
    return summary


class SweepSummaryCallback(Callback):
    """Hydra callback: the Optuna study, the summary, and with ``logger=mlflow`` a parent run."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        view = StudyView.of(config.hydra, config.get("trainer"), config.get("seed"))
        optuna_study.prepare(view)  # refuses before any trial: nothing logged yet
        sweep_dir, name = Path(config.hydra.sweep.dir), str(config.get("name"))
        start_sweep_run(config.get("logger"), sweep_dir, name, list(view.task))

    def on_job_end(self, config: DictConfig, **kwargs: Any) -> None:
        # "sweep <dir>: 3/8 runs done (38%)"
        sweep_progress.job_done(StudyView.of(OmegaConf.select(config, "hydra")))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        optuna_study.record(StudyView.of(config.hydra, config.get("trainer"), config.get("seed")))
        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            summary = write_summary(sweep_dir)
        except Exception as e:  # the sweep itself finished: report, do not fail it
            end_sweep_run(config.get("logger"), sweep_dir)  # the parent run, without a summary
            print(
                f"warning: no sweep summary ({type(e).__name__}: {e}); retry with "
                f"`python -m reprotrain.tools.sweeps.sweep_summary {sweep_dir}`",
                file=sys.stderr,
            )
            return
        end_sweep_run(config.get("logger"), sweep_dir)  # the summary as the parent run's artifacts
        print(f"sweep summary ({len(summary['runs'])} runs): {sweep_dir / SUMMARY_MD}")
        print(to_markdown(summary))


@cli.entry_point
def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("reprotrain.tools.sweeps.sweep_summary", __doc__)
    parser.add_argument("sweep_dir", type=cli.user_path, metavar="SWEEP_DIR")
    sweep_dir = parser.parse_args(argv).sweep_dir
    if not sweep_dir.is_dir():
        raise ReprotrainError(f"{sweep_dir} is not a directory; give a sweep directory")
    if (sweep_dir / RUN_JSON).exists():  # nothing of a sweep's is written into a run
        raise ReprotrainError(
            f"{sweep_dir} is a run directory, not a sweep; give the sweep directory "
            "(multirun/...), or make report RUN=<run> for one run"
        )
    if not sweep_jobs(sweep_dir):
        raise ReprotrainError(f"no {RUN_JSON} under {sweep_dir}; is this a sweep dir?")
    try:
        summary = write_summary(sweep_dir)
    except OSError as e:
        raise ReprotrainError(f"cannot write the summary into {sweep_dir}: {e}") from None
    print(to_markdown(summary))
    if not any(g["n_completed"] for g in summary["groups"]):
        print(f"error: no completed run under {sweep_dir}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
