"""Write report.md and curves.png for a run, from its run directory alone: ``python -m
reprotrain.run.report RUN_DIR [--out DIR]`` (or ``make report RUN=RUN_DIR``). What it reads and
how gaps show: docs/seeing-a-run.md. A missing or corrupt record is one ``error:`` line, exit 2."""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reprotrain.errors import ReprotrainError
from reprotrain.run.readers import read_overrides, read_run_json
from reprotrain.run.record import FINGERPRINTS, METRICS, RUN_JSON, atomic_write_bytes, read_jsonl
from reprotrain.run.schema import STREAMS
from reprotrain.shown import say, shown, warnings_shown

REPORT_MD = "report.md"
CURVES_PNG = "curves.png"
#: A table cell longer than this is cut (a value from the record, escaped: tools/shown.py).
CELL_LIMIT = 500
# Column order of the epoch table: position, then each split's metrics (whatever the task
# logs, loss first, then by name), then the schedule and timings; any other key follows.
HEAD_COLUMNS = ["epoch", "global_step"]
SPLITS = ("train", "val", "test")
TAIL_COLUMNS = ["lr", "seconds", "images_per_s"]
HEADERS = {"global_step": "step", "images_per_s": "img/s", "seconds": "s"}
#: The determinism flags shown beside the level.
SHOWN_FLAGS = ("deterministic_algorithms", "cudnn_deterministic", "precision", "num_threads")


@dataclass
class RunView:
    run_dir: Path
    record: dict[str, Any]
    metrics: list[dict[str, Any]]
    fingerprints: list[dict[str, Any]]


def load_run(run_dir: Path) -> RunView:
    """The run's record, or a one-line ``ReprotrainError`` naming what is missing."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReprotrainError(f"{run_dir} is not a directory; give a run directory (outputs/...)")
    if not (run_dir / RUN_JSON).is_file():
        raise ReprotrainError(f"no {RUN_JSON} in {run_dir}; is this a run directory?")
    record = read_run_json(run_dir)
    metrics, fingerprints = read_jsonl(run_dir / METRICS), read_jsonl(run_dir / FINGERPRINTS)
    return RunView(run_dir, record, metrics, fingerprints)


#: Arguments of a recorded command that are not the run's hyperparameters.
NOT_HYPERPARAMETERS = ("hydra.", "--", "resume=")


def run_overrides(view: RunView) -> list[str] | None:
    """The run's overrides: ``.hydra/overrides.yaml``, else the command line run.json records
    without Hydra's settings; None when neither can be read."""
    with contextlib.suppress(ReprotrainError):
        if (overrides := read_overrides(view.run_dir)) is not None:
            return overrides
    command = view.record.get("command")
    if not isinstance(command, list) or "-m" not in command:
        return None
    args = command[command.index("-m") + 2 :]  # after `python -m <module>`
    return [str(a) for a in args if not str(a).startswith(NOT_HYPERPARAMETERS)]


def overrides_text(overrides: list[str] | None) -> str:
    if overrides is None:
        return "not recorded"
    return " ".join(overrides) or "none (the defaults)"


def _num(v: Any) -> float | None:
    return None if isinstance(v, bool) or not isinstance(v, int | float) else float(v)


def step_series(view: RunView) -> tuple[list[int], list[Any], list[Any]]:
    """Per-step (global step, loss, lr) from the fingerprints; lr is [] when not recorded."""
    steps, losses, lrs = [], [], []
    have_lr = all(isinstance(fp.get("step_lrs"), list) for fp in view.fingerprints)
    for fp in view.fingerprints:
        step_losses = fp.get("step_losses")
        end = fp.get("global_step")
        if not isinstance(step_losses, list) or not isinstance(end, int):
            return [], [], []
        steps += range(end - len(step_losses) + 1, end + 1)
        losses += step_losses
        if have_lr:
            lrs += list(fp["step_lrs"])[: len(step_losses)]
    return steps, losses, (lrs if have_lr and len(lrs) == len(steps) else [])


def curves(view: RunView):
    from reprotrain.run.plots import RunCurves

    rec = view.record
    rows = view.metrics
    epochs = [int(r.get("epoch", i + 1)) for i, r in enumerate(rows)]
    epoch_steps = [r.get("global_step") for r in rows]
    if not all(isinstance(s, int) for s in epoch_steps):  # no step axis recorded: use epochs
        epoch_steps = list(epochs)
        steps, losses, lrs = [], [], []
    else:
        steps, losses, lrs = step_series(view)
    keys = {k for r in rows for k in r}
    seeds = rec.get("seeds") or {}
    level = (rec.get("repro") or {}).get("level", "?")
    return RunCurves(
        title=f"{rec.get('name', 'run')} · {rec.get('experiment_id', view.run_dir.name)}"
        f" · {rec.get('status', 'unknown status')}",
        subtitle=f"seed {seeds.get('base', '?')} · repro={level} · {view.run_dir}",
        overrides=overrides_text(run_overrides(view)),
        epochs=epochs,
        epoch_steps=epoch_steps,
        epoch_series={k: [r.get(k) for r in rows] for k in keys},
        steps=steps,
        step_loss=losses,
        step_lr=lrs,
    )


def fmt(key: str, v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool) or not isinstance(v, int | float):
        return str(v)
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if key.endswith("_acc"):
        return f"{100 * v:.2f}%"
    if key in ("epoch", "global_step") or isinstance(v, int):
        return str(v)
    return format(v, {"seconds": ".1f", "images_per_s": ".0f", "lr": ".4g"}.get(key, ".4f"))


def _cell(row: dict[str, Any], key: str) -> str:
    """A null that the writer flagged in the row's ``nonfinite`` list was NaN/inf, not absent."""
    if row.get(key) is None and key in (row.get("nonfinite") or []):
        return "non-finite"
    return fmt(key, row.get(key))


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(shown(h, CELL_LIMIT) for h in header) + " |",  # metric names too
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(shown(c, CELL_LIMIT) for c in r) + " |" for r in rows),
    ]


def _code(v: Any) -> str:
    return f"`{v}`" if v not in (None, "") else "—"


def git_state(git: dict[str, Any], diff_written: bool | None) -> str:
    """The code's state in one phrase; git.diff named only when ``diff_written`` (None: unknown)."""
    if not git.get("dirty"):
        return "clean"
    untracked = [u for u in git.get("untracked") or [] if not u.get("included")]
    parts = ["tracked changes in git.diff"] if diff_written else []
    if untracked:
        parts.append(f"{len(untracked)} untracked file(s) by name and sha256 in run.json")
    if diff_written is False and not untracked:
        parts.append("no git.diff in the run directory")
    return "**dirty**" + (f" ({'; '.join(parts)})" if parts else "")


def identity_rows(view: RunView) -> list[list[str]]:
    rec, diff = view.record, view.run_dir / "git.diff"
    seeds, repro, git = rec.get("seeds") or {}, rec.get("repro") or {}, rec.get("git") or {}
    env = rec.get("environment") or {}
    device, data = env.get("device") or {}, rec.get("data_fingerprint") or {}
    streams = ", ".join(f"{k} {seeds[k]}" for k in STREAMS if k in seeds) or "—"
    flags = ", ".join(f"{k}={repro[k]}" for k in SHOWN_FLAGS if k in repro) or "flags not recorded"
    git_text = "—"
    if git:
        state = git_state(git, diff.is_file() and diff.stat().st_size > 0)
        git_text = f"{_code(git.get('commit'))} on {_code(git.get('branch'))}, {state}"
    epochs = rec.get("epochs_completed") or len(view.metrics)
    status = f"{rec.get('status', '?')} ({epochs} epochs recorded)"
    if rec.get("error"):
        status += f": {rec['error']}"
    nondet = rec.get("nondeterministic_ops")
    base = f"base {_code(seeds.get('base'))} ({seeds.get('source', '?')})"
    machine = f"{device.get('type', '?')} {device.get('name', '')}"
    rows = [
        ["experiment id", _code(rec.get("experiment_id"))],
        ["name", str(rec.get("name", "—"))],
        ["status", status],
        ["started / finished", f"{rec.get('started_at', '—')} / {rec.get('finished_at', '—')}"],
        ["seeds", f"{base}; {streams}"],
        ["determinism level", f"**{repro.get('level', '?')}** ({flags})"],
        ["git", git_text],
        ["lock sha256", _code(rec.get("lock_sha256"))],
        ["config sha256", _code(rec.get("config_sha256"))],
        ["data fingerprint", f"{data.get('kind', '—')} {_code(data.get('sha256'))}"],
        ["initial weights sha256", _code(rec.get("initial_weights_sha256"))],
        ["final weights sha256", _code(rec.get("final_weights_sha256"))],
        ["device", f"{machine}, torch {env.get('torch', '?')}, python {env.get('python', '?')}"],
        ["nondeterministic ops", ", ".join(map(str, nondet)) if nondet else "none recorded"],
        ["resumes", str(len(rec.get("resumes") or []))],
    ]
    if rec.get("nonfinite"):
        rows.append(["non-finite values (written as null)", ", ".join(map(str, rec["nonfinite"]))])
    return rows


def epoch_columns(rows: list[dict[str, Any]]) -> list[str]:
    present = {k for r in rows for k, v in r.items() if v is None or _num(v) is not None}
    cols = [k for k in HEAD_COLUMNS if k in present]
    for split in SPLITS:
        mine = [k for k in present if k.startswith(f"{split}_")]
        cols += sorted(mine, key=lambda k: (k != f"{split}_loss", k))
    cols += [k for k in TAIL_COLUMNS if k in present]
    return cols + sorted(present - set(cols))


def render_markdown(view: RunView, png_name: str | None) -> str:
    from reprotrain.run.plots import metric_label, metric_names

    rec = view.record
    title = shown(rec.get("experiment_id") or view.run_dir.name)
    out = [
        f"# Run report: {title}",
        "",
        f"Drawn from `{view.run_dir}` alone by `python -m reprotrain.run.report` "
        "(run.json, metrics.jsonl, fingerprints.jsonl).",
        "",
    ]
    overrides = run_overrides(view)
    given = " ".join(f"`{shown(o)}`" for o in overrides or []) or overrides_text(overrides)
    out += [f"**Overrides** (the hyperparameters given): {given}", ""]
    if png_name:
        names = [metric_label(n) for n in metric_names({k: 0 for r in view.metrics for k in r})]
        plotted = ", ".join(["loss", *(shown(n) for n in names if n != "loss")])
        out += [f"![{plotted} and learning rate]({png_name})", ""]
    else:
        out += ["_No epoch finished yet: nothing to plot._", ""]
    out += ["## Identity", "", *_table(["field", "value"], identity_rows(view))]
    final = rec.get("final_metrics") or (view.metrics[-1] if view.metrics else {})
    out += ["", "## Final metrics", ""]
    if final:
        keys = epoch_columns([final])
        out += _table(["metric", "value"], [[k, fmt(k, final.get(k))] for k in keys])
    else:
        out.append("_None recorded._")
    out += ["", "## Epochs", ""]
    if view.metrics:
        cols = epoch_columns(view.metrics)
        out += _table(
            [HEADERS.get(c, c.replace("_", " ")) for c in cols],
            [[_cell(r, c) for c in cols] for r in view.metrics],
        )
    else:
        out.append("_None recorded._")
    return "\n".join(out) + "\n"


def write_report(run_dir: Path, out_dir: Path | None = None) -> tuple[Path, Path | None]:
    """Write report.md (and curves.png when an epoch finished); returns their paths."""
    from reprotrain.run.plots import plot_run

    view = load_run(run_dir)
    out_dir = Path(out_dir) if out_dir else view.run_dir
    png_path = None
    if view.metrics:
        png_path = out_dir / CURVES_PNG
        with warnings_shown():  # matplotlib names a metric name's characters raw
            atomic_write_bytes(png_path, plot_run(curves(view)))
    md_path = out_dir / REPORT_MD
    atomic_write_bytes(md_path, render_markdown(view, png_path.name if png_path else None).encode())
    return md_path, png_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m reprotrain.run.report",
        description="Write report.md and curves.png (loss, metrics, lr) for a run directory, "
        "from its records alone.",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory")
    out_help = "write here instead of into RUN_DIR (read-only runs)"
    parser.add_argument("--out", type=Path, default=None, help=out_help)
    args = parser.parse_args(argv)
    try:
        md, png = write_report(args.run_dir, args.out)
    except ReprotrainError as e:
        say(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # e.g. a read-only archive: say where to write instead
        say(f"error: cannot write the report ({e}); pass --out DIR", file=sys.stderr)
        return 2
    say(f"wrote {md}" + (f" and {png}" if png else " (no epoch finished: no plot)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
