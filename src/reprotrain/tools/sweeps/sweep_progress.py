"""Runs done of a sweep, after each run: ``sweep multirun/x: 3/8 runs done (38%)``.

Counted from the sweep directory, not a counter (jobs may run in other processes); one line
per finished run (each run draws its own epoch bar).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig

from reprotrain.errors import RecordError
from reprotrain.loggers.params import sweep_record_overrides
from reprotrain.run.bounded import load_json
from reprotrain.run.directory import sweep_jobs
from reprotrain.run.record import RUN_JSON

if TYPE_CHECKING:
    from reprotrain.tools.sweeps.optuna_study import StudyView


def sweep_total(sweep_dir: Path, sweeper: DictConfig | None) -> int | None:
    """How many runs the sweep starts (None when it cannot be told, e.g. a glob sweep)."""
    if sweeper is not None and "n_trials" in sweeper:
        return int(sweeper.n_trials)
    overrides = sweep_record_overrides(sweep_dir)
    if overrides is None:
        return None
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        sizes = [len(list(o.sweep_string_iterator())) for o in parsed if o.is_sweep_override()]
    except Exception:  # a sweep Hydra expands only against the config tree (glob): unknown
        return None
    return math.prod(sizes)


def runs_done(sweep_dir: Path) -> int:
    done = 0
    for job in sweep_jobs(sweep_dir):
        try:  # bounded: a hostile record is skipped, never a stall
            record = load_json((job / RUN_JSON).read_text(), RUN_JSON)
        except (OSError, ValueError, RecordError):
            continue
        status = record.get("status") if isinstance(record, dict) else None
        done += status not in (None, "running")
    return done


def progress_line(sweep_dir: Path, done: int, total: int | None) -> str:
    if not total:
        return f"sweep {sweep_dir}: {done} run(s) done"
    return f"sweep {sweep_dir}: {done}/{total} runs done ({100 * done / total:.0f}%)"


def job_done(view: StudyView, emit: Callable[[str], None] | None = None) -> None:
    """``on_job_end``: one line with the sweep's runs done (a single run says nothing)."""
    if view.sweep_dir is None or str(getattr(view.mode, "name", view.mode)) != "MULTIRUN":
        return
    sweep_dir = Path(view.sweep_dir)
    line = progress_line(sweep_dir, runs_done(sweep_dir), sweep_total(sweep_dir, view.sweeper))
    if emit is None:
        print(line, file=sys.stderr, flush=True)
    else:
        emit(line)
