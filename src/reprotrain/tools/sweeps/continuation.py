"""A killed sweep, continued in its own directory: ``make resume RUN=<sweep dir>``.

Closes: a grid or seed sweep (``-m optimizer=sgd,adamw seed.base=0,1,2``) killed midway that
no command could finish (a re-run is refused, ``make resume`` named no run). The continuation
re-runs the sweep's recorded overrides into its directory under ``hydra/sweeper=continued``
(an Optuna study under its own ``hydra.sweeper.resume=true``). Each job of the grid, numbered
as Hydra numbered it, then does what its directory says (:func:`pending`): a finished job is
left byte for byte, a killed one resumes in place (``resume=auto``, its ``.hydra/`` kept), one
that never started starts. docs/resume.md.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from reprotrain.errors import RecordError
from reprotrain.progress import say
from reprotrain.quoting import hydra_override
from reprotrain.run.bounded import read_json_lines
from reprotrain.run.readers import read_run_json, read_sweep_record
from reprotrain.run.record import RUN_JSON
from reprotrain.sweep_checks import is_optuna
from reprotrain.tools.sweeps.optuna_study import JOURNAL

#: The sweeper that continues a basic (grid or seed) sweep (src/hydra_plugins).
CONTINUED = "hydra/sweeper=continued"
#: Overrides a continuation sets itself (not copied from the sweep's record).
_OWN = ("hydra.sweep.dir", "hydra.sweeper.resume", "hydra.mode", "hydra/sweeper")
#: A job whose run ended: left as it is (a failed one would fail again; its record says why).
ENDED = ("completed", "failed")


def is_sweep_dir(path: Path) -> bool:
    """A sweep directory (Hydra's ``multirun.yaml``, read within bounds), not a run's."""
    return not (Path(path) / RUN_JSON).exists() and read_sweep_record(Path(path)) is not None


def continue_command(sweep_dir: Path, extra: list[str]) -> list[str]:
    """The trainer command that continues the sweep in ``sweep_dir``, then ``extra``: the
    recorded overrides (Hydra's and the task's) into the same directory."""
    saved = read_sweep_record(Path(sweep_dir))
    if saved is None:
        raise RecordError(f"{sweep_dir} holds no sweep record (multirun.yaml)")
    hydra_lines = [str(o) for o in OmegaConf.select(saved, "hydra.overrides.hydra", default=[])]
    task = [str(o) for o in OmegaConf.select(saved, "hydra.overrides.task", default=[])]
    kept = [o for o in hydra_lines if o.lstrip("+~").partition("=")[0] not in _OWN]
    study = is_optuna(OmegaConf.select(saved, "hydra.sweeper"))
    if study and (Path(sweep_dir) / JOURNAL).exists():  # torn: one line, before any launch
        read_json_lines(Path(sweep_dir) / JOURNAL, str(Path(sweep_dir) / JOURNAL))
    how = [] if study else [CONTINUED]
    train = [sys.executable, "-m", "reprotrain.train", "--multirun", *kept, *how, *task]
    here = hydra_override("hydra.sweep.dir", Path(sweep_dir))
    return [*train, here, "hydra.sweeper.resume=true", *extra]


def job_status(run_dir: Path) -> str | None:
    """The job's recorded status; None when it never wrote a record (or one that is unreadable:
    the trainer's resume decides, and refuses in one line)."""
    if not (Path(run_dir) / RUN_JSON).is_file():
        return None
    try:
        return str(read_run_json(run_dir).get("status"))
    except RecordError:
        return "unreadable"


def pending(
    jobs: Sequence[Sequence[str]], job_dir: Callable[[list[str], int], Path]
) -> list[tuple[int, list[str]]]:
    """(Hydra's job number, its overrides) of each job still to run: a killed job gets
    ``resume=auto`` (its ``.hydra/`` record kept), a job that never wrote a record starts."""
    out = []
    for number, overrides in enumerate(jobs):
        run_dir = job_dir(list(overrides), number)
        status = job_status(run_dir)
        if status in ENDED:
            say(f"sweep job {number}: {status}, left as it is ({run_dir})")
            continue
        extra = [] if status is None else ["resume=auto", "hydra.output_subdir=null"]
        what = "starts" if status is None else f"resumes ({status})"
        say(f"sweep job {number}: {what} in {run_dir}")
        out.append((number, [*overrides, *extra]))
    return out


def run_pending(
    jobs: Sequence[Sequence[str]],
    job_dir: Callable[[list[str], int], Path],
    launch: Callable[[list[list[str]], int], Sequence[Any]],
    batch_size: int | None = None,
) -> list[Sequence[Any]]:
    """Launch :func:`pending` jobs, each run of consecutive numbers as one batch (at most
    ``batch_size``) so the launcher numbers every job, and so names its directory, as before."""
    todo, returns = pending(jobs, job_dir), []
    while todo:
        first = todo[0][0]
        batch = [todo.pop(0)[1]]
        while todo and todo[0][0] == first + len(batch) and len(batch) != batch_size:
            batch.append(todo.pop(0)[1])
        results = launch(batch, first)
        for r in results:
            _ = r.return_value  # a failed job raises here, as in Hydra's basic sweeper
        returns.append(results)
    return returns
