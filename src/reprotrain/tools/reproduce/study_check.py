"""``make reproduce`` of an Optuna study archive: study.json is checked against the runs.

Closes: a study record nothing checked (a forged best, deleted trials). :func:`differences`
recomputes the study with the code that wrote it and lists every way the record differs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from reprotrain.errors import RecordError, ReproduceRefused
from reprotrain.metric_names import number_or_none
from reprotrain.run.bounded import load_json
from reprotrain.run.readers import parse_json_object, parse_yaml_config
from reprotrain.shown import shown
from reprotrain.tools.archive.archive_check import CheckedArchive

STUDY = "sweep/study.json"
#: study.json keys summarise_study needs, with the test each must pass.
_SETTINGS = {
    "metric": lambda v: isinstance(v, str) and bool(v),
    "metric_mode": lambda v: v in ("max", "min"),
    "search_space": lambda v: isinstance(v, dict),
    "sampler": lambda v: isinstance(v, dict),
    "trials": lambda v: isinstance(v, list) and all(isinstance(t, dict) for t in v),
    "best": lambda v: v is None or isinstance(v, dict),
}
_TRIAL = {"job": str, "params": dict, "status": str}  # and a number or None as "value"
DAMAGED = "the study record was edited or damaged"


def archived_study(checked: CheckedArchive) -> dict[str, Any] | None:
    """The archive's study.json, checked for shape (ReproduceRefused), or None."""
    data = checked.member(STUDY)
    if data is None:
        return None
    label = checked.label(STUDY)
    try:
        study = parse_json_object(data.decode("utf-8"), label)
    except UnicodeDecodeError:
        raise ReproduceRefused(f"{label}: not UTF-8 text") from None
    for key, ok in _SETTINGS.items():
        if not ok(study.get(key)):
            raise ReproduceRefused(f"{label}: {key} is missing or malformed; {DAMAGED}")
    for i, t in enumerate(study["trials"]):
        shaped = all(isinstance(t.get(k), expected) for k, expected in _TRIAL.items())
        if not (shaped and number_or_none(t.get("value"))):
            what = "a trial (job, params, value, status)"
            raise ReproduceRefused(f"{label}: trials[{i}] is not {what}; {DAMAGED}")
    n_trials = study.get("n_trials")
    if n_trials is not None and (not isinstance(n_trials, int) or isinstance(n_trials, bool)):
        raise ReproduceRefused(f"{label}: n_trials {shown(n_trials, 40)} is not an integer")
    return study


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _trial_text(t: dict[str, Any]) -> str:
    return f"trial {shown(t.get('number'), 20)} ({shown(t.get('job'), 60)})"


def _said(what: str, a: Any, b: Any, where: str, width: int = 80) -> str:
    """``what``: ``a`` in study.json, ``b`` in ``where``."""
    return f"{what} {shown(a, width)} in study.json, {shown(b, width)} in {where}"


def _compare_trials(recorded: dict, found: dict, keys: tuple[str, ...], where: str) -> list[str]:
    out = []
    for job in sorted(set(recorded) - set(found)):
        out.append(f"study.json names {_trial_text(recorded[job])}, which is not in {where}")
    for job in sorted(set(found) - set(recorded)):
        out.append(f"{_trial_text(found[job])} is in {where} but not in study.json")
    for job in sorted(set(recorded) & set(found)):
        for key in keys:
            a, b = recorded[job].get(key), found[job].get(key)
            if not _same(a, b):
                out.append(_said(f"{_trial_text(recorded[job])}: {key}", a, b, where))
    return out


def _compare_best(said: dict | None, got: dict | None, fields: tuple[str, ...], where: str):
    if said is None or got is None:
        differs = (said is None) != (got is None)
    else:
        differs = any(not _same(said.get(f), got.get(f)) for f in fields)
    if not differs:
        return []
    a = "none" if said is None else _trial_text(said)
    b = "none" if got is None else _trial_text(got)
    return [f"best: study.json says {a}, {where} say {b}"]


def differences(
    study: dict[str, Any], archived: Path, replay: Path | None = None, values: bool = True
) -> list[str]:
    """How ``study`` differs from archived (and ``replay``) runs' study; ``values``: bits too."""
    from reprotrain.tools.sweeps import optuna_study

    keys = ("storage", "optuna_storage", "study_name", "search_space", "metric", "metric_mode")
    settings = {k: study.get(k) for k in keys}
    settings["sampler"] = study["sampler"]
    here = optuna_study.summarise_study(Path(archived), settings)
    recorded = {t["job"]: t for t in study["trials"]}
    found = {t["job"]: t for t in here["trials"]}
    where = "the archived runs"
    out = _compare_trials(recorded, found, ("params", "status", "value"), where)
    n_trials = study.get("n_trials")
    if isinstance(n_trials, int) and len(found) < n_trials:
        out.append(f"the study ran n_trials={n_trials}; the archive holds {len(found)} trial(s)")
    out += _compare_best(study.get("best"), here.get("best"), ("job", "params", "value"), where)
    results = Path(archived) / optuna_study.OPTUNA_RESULTS
    if results.is_file() and here.get("optuna_best_agrees") is False:
        out.append(f"{optuna_study.OPTUNA_RESULTS} does not agree with the best archived run")
    out += sampler_differences(study, Path(archived))
    out += proposal_differences(study, Path(archived))
    if here.get("storage_agrees") is False:
        what = "the archived trials (their parameters, values and states)"
        out.append(f"the study's storage ({optuna_study.JOURNAL}) does not hold {what}")
    if replay is None:
        return out
    metric, mode = settings["metric"], settings["metric_mode"]
    replayed = {}
    for job, t in found.items():
        status = _status(Path(replay) / job / "run.json")
        value = optuna_study.trial_value(Path(replay) / job, metric, mode) if status else None
        replayed[job] = {**t, "status": status or "missing", "value": value}
    keys = ("status", *(("value",) if values else ()))
    out += _compare_trials(recorded, replayed, keys, "the replay")
    if values:
        best = optuna_study.best_trial(list(replayed.values()), mode)
        out += _compare_best(study.get("best"), best, ("job", "value"), "the replayed runs")
    return list(dict.fromkeys(out))


def sampler_differences(study: dict[str, Any], archived: Path) -> list[str]:
    """study.json's sampler against the one ``multirun.yaml`` says the sweep ran with."""
    from reprotrain.sweep_checks import SWEEP_RECORD

    path = archived / SWEEP_RECORD
    if not path.is_file():  # nothing records the sampler but study.json: the re-run decides
        return []
    try:
        record = parse_yaml_config(path.read_text(), SWEEP_RECORD)
    except (RecordError, OSError, UnicodeDecodeError) as e:
        return [f"{SWEEP_RECORD} cannot be read ({shown(e, 200)})"]
    node = OmegaConf.select(record, "hydra.sweeper.sampler", default=None)
    if node is None:  # not written by the sweeper: nothing to hold study.json to
        return []
    ran = OmegaConf.to_container(node) if OmegaConf.is_config(node) else node
    if not isinstance(ran, dict):
        return [f"{SWEEP_RECORD}: hydra.sweeper.sampler is not a mapping"]
    ran = {"class": ran.pop("_target_", None), **ran}
    said, where = study["sampler"], f"{SWEEP_RECORD} (what the sweep ran with)"
    keys = [k for k in sorted(set(said) | set(ran), key=str) if not _same(said.get(k), ran.get(k))]
    return [_said(f"sampler {shown(k, 40)}:", said.get(k), ran.get(k), where, 60) for k in keys]


def proposal_differences(study: dict[str, Any], archived: Path) -> list[str]:
    """The sampler run again, seeded per trial as the sweeper seeds it: every archived trial must
    be what it proposes. Only an ``optuna.samplers`` class is built (the archive's ``class``
    is code); no journal, unseeded or grid: not re-run."""
    import optuna

    from reprotrain.tools.sweeps.optuna_study import JOURNAL
    from reprotrain.tools.sweeps.optuna_sweeper import make_sampler, open_journal

    settings = dict(study["sampler"])
    cls = settings.pop("class", None)
    name = cls.rsplit(".", 1)[-1] if isinstance(cls, str) else ""
    journal = archived / JOURNAL
    if study.get("storage") or not journal.is_file() or settings.get("seed") is None:
        return []
    known = isinstance(getattr(optuna.samplers, name, None), type)
    if not (known and cls == f"optuna.samplers.{name}"):
        not_rerun = "is not an optuna.samplers class: its proposals were not re-run"
        return [f"sampler {shown(cls, 80)} {not_rerun}"]
    if name == "GridSampler":
        return []
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        stored = optuna.load_study(
            study_name=study.get("study_name"), storage=open_journal(journal)
        ).get_trials(deepcopy=False)
        replay = optuna.create_study(direction=str(study.get("direction")))
    except Exception as e:  # a foreign journal: storage_agrees says it does not hold
        return [f"the sampler was not re-run: {type(e).__name__}: {shown(e, 120)}"]
    n_jobs = study.get("n_jobs") if isinstance(study.get("n_jobs"), int) else 1
    target, seed = {"_target_": cls, **settings}, shown(settings["seed"], 20)
    ordered, size = sorted(stored, key=lambda t: t.number), max(1, n_jobs)
    for batch in (ordered[i : i + size] for i in range(0, len(ordered), size)):
        asked = []
        for trial in batch:
            replay.sampler = make_sampler(target, trial.number, trial.distributions)
            asked.append(replay.ask(fixed_distributions=dict(trial.distributions)))
        for new, trial in zip(asked, batch, strict=True):
            if new.params != trial.params:
                ran = f"the archived trial ran {shown(trial.params, 120)}"
                proposes = f"the sampler of study.json (seed {seed}) proposes"
                return [f"trial {trial.number}: {proposes} {shown(new.params, 120)}, {ran}"]
            if trial.state.name == "COMPLETE":
                replay.tell(new.number, trial.value)
            else:
                replay.tell(new.number, state=optuna.trial.TrialState.FAIL)
    return []


def _status(record: Path) -> str | None:
    try:
        status = load_json(record.read_text(), str(record)).get("status")  # bounded
    except (OSError, ValueError, AttributeError, RecordError):
        return None
    return status if isinstance(status, str) else None
