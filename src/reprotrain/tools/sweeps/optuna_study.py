"""An Optuna study (``hydra/sweeper=optuna``): seeded, checked, and recorded in ``study.json``.

Closes: the sampler's own randomness (unseeded: ``seed.base``, recorded as ``seed_from``), a
study that optimises against ``trainer.monitor_mode``, and a search whose trials and winner
live only in a terminal (:func:`record`). docs/sweeps-optuna.md.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from reprotrain import sweep_checks
from reprotrain.errors import ReprotrainError
from reprotrain.run.bounded import load_yaml, read_json_lines
from reprotrain.run.directory import sweep_jobs
from reprotrain.run.readers import read_overrides
from reprotrain.run.record import (
    METRICS,
    RUN_JSON,
    atomic_write_text,
    parse_json_object,
    read_jsonl,
    strict_json,
)
from reprotrain.sweep_checks import OPTUNA_SWEEPER, is_optuna  # noqa: F401 (tests name it here)

STUDY_JSON = "study.json"
#: Written by the sweeper at the end of a study, from its storage: best_params, best_value.
OPTUNA_RESULTS = "optimization_results.yaml"
#: The study's storage in the sweep directory (unless hydra.sweeper.storage names another).
JOURNAL = "study.journal"
#: Sweep dirs whose sampler seed :func:`seed_sampler` set from seed.base (in this process).
_SEEDED_FROM_BASE: dict[str, str] = {}


@dataclass(frozen=True)
class StudyView:
    """What a sweep's study and progress read of the config, taken where Hydra hands it over."""

    sweeper: DictConfig | None  # hydra.sweeper, the live node: prepare() sets keys in it
    trainer: DictConfig | None  # monitor, monitor_mode
    seed: DictConfig | None  # seed.base: an unseeded sampler's seed
    sweep_dir: str | None  # hydra.sweep.dir
    task: tuple[str, ...]  # hydra.overrides.task: the command line's overrides
    mode: Any = None  # hydra.mode (RunMode.MULTIRUN, ...)
    name: str | None = None  # the config's name: a study's default study_name

    @classmethod
    def of(
        cls,
        hydra: DictConfig | None,
        trainer: DictConfig | None = None,
        seed: DictConfig | None = None,
        name: Any = None,
    ) -> StudyView:
        """The view of a config's ``hydra``, ``trainer`` and ``seed`` nodes and its name."""

        def pick(key: str) -> Any:
            return None if hydra is None else OmegaConf.select(hydra, key, default=None)

        task = tuple(str(o) for o in pick("overrides.task") or [])
        sweep_dir = None if pick("sweep.dir") is None else str(pick("sweep.dir"))
        name = None if name is None else str(name)
        return cls(pick("sweeper"), trainer, seed, sweep_dir, task, pick("mode"), name)


def _sweeper_settings(view: StudyView) -> dict[str, Any]:
    sweeper = OmegaConf.to_container(view.sweeper, resolve=True)
    assert isinstance(sweeper, dict)
    sampler = dict(sweeper.get("sampler") or {})
    direction = sweeper.get("direction")
    return {
        "sweeper": str(sweeper.get("_target_", "")),
        "study_name": sweeper.get("study_name"),
        "direction": direction if isinstance(direction, list) else str(direction),
        "metric": str(view.trainer.monitor),
        "metric_mode": str(view.trainer.monitor_mode),
        "n_trials": sweeper.get("n_trials"),
        "n_jobs": sweeper.get("n_jobs"),
        "storage": sweeper.get("storage"),
        "optuna_storage": sweeper.get("storage") or JOURNAL,
        "sampler": {"class": sampler.pop("_target_", None), **sampler},
        "seed_from": _SEEDED_FROM_BASE.get(str(view.sweep_dir)),
        "search_space": {**dict(sweeper.get("params") or {}), **command_line_space(view.task)},
    }


def command_line_space(task: Sequence[str]) -> dict[str, str]:
    """The sweeps on the command line (``hydra.overrides.task``): the sweeper searches them too."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides([str(o) for o in task])
    sweeps = [o for o in parsed if o.is_sweep_override()]
    return {o.get_key_element(): o.input_line.partition("=")[2] for o in sweeps}


def repeatable(settings: dict[str, Any]) -> tuple[bool, str]:
    """Whether the same study twice proposes the same trials, and why (one line)."""
    sampler = settings["sampler"]
    if sampler.get("seed") is None and not str(sampler.get("class")).endswith("GridSampler"):
        return False, "the sampler has no seed (hydra.sweeper.sampler.seed=null)"
    if settings.get("storage"):
        return False, "a storage of your own may hold trials of earlier runs of the study"
    return True, "seeded sampler, the study's own journal in the sweep directory"


def trial_value(job: Path, metric: str, mode: str) -> float | None:
    """The best finite ``metric`` in the run's metrics.jsonl (what Optuna was told), or None."""
    values = [r.get(metric) for r in read_jsonl(Path(job) / METRICS)]
    values = [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]
    return (max if mode == "max" else min)(values) if values else None


def best_trial(trials: list[dict[str, Any]], mode: str) -> dict[str, Any] | None:
    """The first completed trial to reach the best value, or None."""
    done = [t for t in trials if t["status"] == "completed" and t["value"] is not None]
    return (max if mode == "max" else min)(done, key=lambda t: t["value"]) if done else None


def _trial(job: Path, sweep_dir: Path, settings: dict[str, Any]) -> dict[str, Any]:
    searched = set(settings["search_space"])
    params: dict[str, Any] = {}
    for line in read_overrides(job) or []:
        key, _, value = str(line).partition("=")
        if key.lstrip("+~") in searched:
            params[key.lstrip("+~")] = load_yaml(value, str(job)) if value else value
    path = job / RUN_JSON
    record = parse_json_object(path.read_text(), str(path)) if path.is_file() else {}
    return {
        "number": int(job.name) if job.name.isdigit() else None,
        "job": job.relative_to(sweep_dir).as_posix(),
        "params": params,
        "value": trial_value(job, settings["metric"], settings["metric_mode"]),
        "status": record.get("status", "missing"),
    }


def summarise_study(sweep_dir: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """study.json's contents, from the sweep directory and the sweeper's settings."""
    sweep_dir = Path(sweep_dir)
    jobs = sorted(
        sweep_jobs(sweep_dir),
        key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name),
    )
    trials = [_trial(job, sweep_dir, settings) for job in jobs]
    best = best_trial(trials, settings["metric_mode"])
    ok, why = repeatable(settings)
    study = {
        **settings,
        "repeatable": ok,
        "repeatable_because" if ok else "not_repeatable_because": why,
        "trials": trials,
        "best": best,
    }
    optuna_best = sweep_dir / OPTUNA_RESULTS
    if optuna_best.is_file() and best is not None:
        theirs = load_yaml(optuna_best.read_text(), str(optuna_best)) or {}  # bounded
        same_value = theirs.get("best_value") == best["value"]
        study["optuna_best_agrees"] = same_value and theirs.get("best_params") == best["params"]
    journal = sweep_dir / JOURNAL
    if settings.get("optuna_storage") == JOURNAL and journal.is_file():
        study["storage_agrees"] = storage_agrees(journal, settings.get("study_name"), trials)
    return study


def open_journal(path: Path) -> Any:
    """The journal storage at ``path`` (created when absent), for ``optuna.load_study``; one
    that exists is read within bounds first (``read_json_lines``): a torn journal is one line."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

    if Path(path).exists():
        read_json_lines(Path(path), str(path))
    return JournalStorage(JournalFileBackend(str(path), lock_obj=JournalFileOpenLock(str(path))))


def storage_trials(journal: Path, study_name: str | None) -> dict[int, dict[str, Any]]:
    """{number: {params, value, state}} as the study's journal holds them."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = open_journal(journal)
    names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
    name = study_name if study_name in names else (names[0] if len(names) == 1 else study_name)
    trials = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    return {t.number: {"params": t.params, "value": t.value, "state": t.state.name} for t in trials}


#: A run's status, as the trial's state in the storage.
_STATE = dict.fromkeys(("running", "interrupted", "missing"), "RUNNING")
_STATE |= {"completed": "COMPLETE", "failed": "FAIL"}


def storage_agrees(journal: Path, study_name: str | None, trials: list[dict[str, Any]]) -> bool:
    """Whether the journal holds the run directories' trials: numbers, parameters, values."""
    try:
        stored = storage_trials(journal, study_name)
    except Exception:  # an unreadable or foreign journal does not agree
        return False
    if sorted(stored) != sorted(t["number"] for t in trials if t["number"] is not None):
        return False
    for t in trials:
        theirs = stored[t["number"]]
        state = _STATE.get(t["status"], "FAIL")
        if state == "COMPLETE" and t["value"] is None:
            state = "FAIL"
        value = t["value"] if state == "COMPLETE" else None
        if (theirs["params"], theirs["value"], theirs["state"]) != (t["params"], value, state):
            return False
    return True


def write_study(sweep_dir: Path, settings: dict[str, Any]) -> dict[str, Any]:
    study = summarise_study(sweep_dir, settings)
    # values are finite already: a non-finite run is no best
    atomic_write_text(Path(sweep_dir) / STUDY_JSON, strict_json(study, None, indent=2) + "\n")
    return study


def study_lines(study: dict[str, Any]) -> list[str]:
    seed = study["sampler"].get("seed")
    head = (
        f"optuna study {study['study_name']}: {len(study['trials'])} trial(s), "
        f"{study['direction']} {study['metric']}, sampler {study['sampler']['class']} seed {seed}"
    )
    lines, best = [head], study["best"]
    if best is not None:
        metric = f"{study['metric']}={best['value']}"
        lines.append(f"  best: trial {best['number']} {metric} {best['params']}")
    if not study["repeatable"]:
        lines.append(f"  not repeatable: {study['not_repeatable_because']}")
    return lines


def seed_sampler(sweeper: DictConfig, seed: DictConfig, sweep_dir: str | None) -> None:
    """A sampler without a seed gets ``seed.base``, in ``sweeper`` (``hydra.sweeper``)."""
    sampler = sweeper.sampler
    if "seed" not in sampler or sampler.seed is not None:
        return  # seeded already, or a sampler without randomness (GridSampler)
    with read_write(sweeper), open_dict(sweeper):
        sampler.seed = int(seed.base)
    _SEEDED_FROM_BASE[str(sweep_dir)] = "seed.base"


def prepare(view: StudyView) -> None:
    """``on_multirun_start`` of an Optuna study: refuse (one line, exit 2) or seed it."""
    if not is_optuna(view.sweeper):
        return
    assert view.sweeper is not None
    try:
        sweep_checks.check_study(view.sweeper, view.trainer, list(view.task))
    except ReprotrainError as e:  # before any trial runs
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
    if view.sweeper.direction is None:  # a default direction follows trainer.monitor_mode
        with read_write(view.sweeper):
            view.sweeper.direction = f"{view.trainer.monitor_mode}imize"
    seed_sampler(view.sweeper, view.seed, view.sweep_dir)
    # optuna imports alembic, whose plugin registry logs a line per plugin at INFO
    logging.getLogger("alembic").setLevel(logging.WARNING)


def record(view: StudyView) -> None:
    """``on_multirun_end`` of an Optuna study: write study.json and say what it found."""
    if not is_optuna(view.sweeper):
        return
    sweep_dir = Path(str(view.sweep_dir))
    try:
        study = write_study(sweep_dir, _sweeper_settings(view))
    except Exception as e:  # the study itself finished: report, do not fail it
        print(f"warning: no {STUDY_JSON} ({type(e).__name__}: {e})", file=sys.stderr)
        return
    print("\n".join(study_lines(study)))
    print(f"study record: {sweep_dir / STUDY_JSON}")
