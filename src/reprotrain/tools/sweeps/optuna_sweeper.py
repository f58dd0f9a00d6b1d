"""The study behind ``hydra/sweeper=optuna``: ask, launch, tell, on a current optuna.

Closes: a study nobody else can open (an Optuna storage, each trial carrying its ``run_dir``),
a killed study that cannot continue, and a sampler whose state lives in one process (a fresh
sampler per trial, seeded by :func:`trial_seed`). Why our own: docs/design.md, "Large rooms".
"""

from __future__ import annotations

import logging
import math
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from reprotrain.allowlist import allowing, targets_in
from reprotrain.errors import ReprotrainError
from reprotrain.progress import say
from reprotrain.quoting import hydra_value
from reprotrain.repro.seeding import stable_hash
from reprotrain.run.readers import read_run_json
from reprotrain.run.record import RUN_JSON, atomic_write_text
from reprotrain.sweep_checks import SWEEP_RECORD
from reprotrain.tools.sweeps.optuna_study import (
    JOURNAL,
    OPTUNA_RESULTS,
    StudyView,
    open_journal,
    trial_value,
)

log = logging.getLogger(__name__)

RUN_DIR_ATTR = "run_dir"  # a trial's user attribute: its run directory
GRID = "optuna.samplers.GridSampler"
_PLAIN = re.compile(r"[A-Za-z_][\w.\-/]*")


class StudyError(ReprotrainError):
    """A study that cannot start or continue as asked; nothing was launched."""


def distribution(override: Any) -> Any:
    """One parsed sweep override's Optuna distribution (docs/sweeps-optuna.md), None if plain."""
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    value = override.value()
    if isinstance(value, IntervalSweep):
        log_scale = "log" in value.tags
        if "int" in value.tags:
            return IntDistribution(int(value.start), int(value.end), log=log_scale)
        return FloatDistribution(float(value.start), float(value.end), log=log_scale)
    if isinstance(value, RangeSweep):
        values = list(override.sweep_iterator())
        if not values:
            raise StudyError(f"{override.input_line}: the range is empty; give range(lo, hi)")
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            step = values[1] - values[0] if len(values) > 1 else 1
            return IntDistribution(values[0], values[-1], step=step)
        return CategoricalDistribution(values)
    if isinstance(value, ChoiceSweep):
        values = list(value.list)
        odd = [v for v in values if not isinstance(v, bool | int | float | str) or v is None]
        if odd:
            raise StudyError(
                f"{override.input_line}: Optuna's choices are numbers, booleans or text, not "
                f"{odd[0]!r}; quote it as text ({override.get_key_element()}=choice('...'))"
            )
        return CategoricalDistribution(values)
    if override.is_sweep_override():
        raise StudyError(
            f"{override.input_line}: Optuna searches interval(...), range(...) and choice(...)"
        )
    return None


def search_space(
    params: Mapping[str, Any] | None, arguments: Sequence[str]
) -> tuple[dict[str, Any], list[str]]:
    """(distributions by key, fixed overrides): ``hydra.sweeper.params``, the command line wins."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    lines = [f"{k}={v}" for k, v in (params or {}).items()]
    space: dict[str, Any] = {}
    fixed: dict[str, str] = {}
    for line in [*lines, *arguments]:
        override = parser.parse_override(str(line))
        key = override.get_key_element()
        found = distribution(override)
        space.pop(key, None)
        fixed.pop(key, None)
        if found is None:
            fixed[key] = override.input_line
        else:
            space[key] = found
    return space, list(fixed.values())


def override_text(key: str, value: Any) -> str:
    """A suggested value as an override Hydra and YAML parse back to the same value."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float):
        text = repr(value)
        mantissa, e, exponent = text.partition("e")
        if e and "." not in mantissa:  # 1e-05 is text to YAML; 1.0e-05 is a float
            text = f"{mantissa}.0e{exponent}"
    elif isinstance(value, int):
        text = str(value)
    else:
        text = str(value) if _PLAIN.fullmatch(str(value)) else hydra_value(str(value))
    return f"{key}={text}"


def grid_of(space: Mapping[str, Any]) -> dict[str, list]:
    """GridSampler's grid: every value of each searched key (no interval: a grid has none)."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    grid: dict[str, list] = {}
    for key, dist in space.items():
        if isinstance(dist, CategoricalDistribution):
            grid[key] = list(dist.choices)
        elif isinstance(dist, IntDistribution) and not dist.log:
            grid[key] = list(range(dist.low, dist.high + 1, dist.step))
        else:
            raise StudyError(
                f"hydra/sweeper/sampler=grid cannot search {key} (an interval has no grid); "
                f"give its values: {key}=choice(...) or range(...)"
            )
    return grid


def trial_seed(seed: int | None, number: int) -> int | None:
    """The seed of the sampler that proposes trial ``number`` (NumPy's range: 32 bits)."""
    return None if seed is None else stable_hash("optuna-sampler", int(seed), int(number)) % 2**32


def make_sampler(sampler: DictConfig | Mapping, number: int, space: Mapping[str, Any]) -> Any:
    """A fresh sampler for trial ``number``, seeded per trial (a grid's keeps the study's seed)."""
    from hydra.utils import instantiate

    conf = OmegaConf.create(OmegaConf.to_container(OmegaConf.create(dict(sampler)), resolve=True))
    kwargs: dict[str, Any] = {}
    grid = conf.get("_target_") == GRID
    if "seed" in conf and not grid:  # the grid's seed shuffles the grid: one for the study
        kwargs["seed"] = trial_seed(conf.seed, number)
    if grid and conf.get("search_space") is None:
        kwargs["search_space"] = grid_of(space)
    with allowing(targets_in(conf)):  # Hydra 1.4's allowlist: the sampler class named
        return instantiate(conf, **kwargs)


def storage_of(storage: str | None, sweep_dir: Path) -> tuple[Any, str]:
    """(the Optuna storage, how study.json names it): the sweep's journal, a URL or a path."""
    if storage and "://" in storage:
        return storage, storage
    path = Path(storage) if storage else Path(sweep_dir) / JOURNAL
    path.parent.mkdir(parents=True, exist_ok=True)
    return open_journal(path), (JOURNAL if not storage else str(path))


class StudyRunner:
    """One study: ask, ``launch(batch, first)``, tell; ``job_dir`` names each trial's run."""

    def __init__(
        self,
        settings: Mapping[str, Any],
        view: StudyView,
        launch: Callable[[list[list[str]], int], Sequence[Any]],
        job_dir: Callable[[list[str], int], Path],
        validate: Callable[[list[list[str]]], None] | None = None,
        save_record: Callable[[Path], None] | None = None,
    ) -> None:
        self.settings, self.launch, self.job_dir = dict(settings), launch, job_dir
        self.validate = validate or (lambda batch: None)
        self.save_record = save_record or (lambda path: None)
        self.sweep_dir = Path(str(view.sweep_dir))
        trainer = view.trainer if view.trainer is not None else {}
        self.metric = str(trainer.get("monitor", "val_loss"))
        self.mode = str(trainer.get("monitor_mode", "min"))
        self.direction = str(settings.get("direction") or f"{self.mode}imize")
        self.study_name = str(settings.get("study_name") or view.name or "study")

    def n_trials(self, space: Mapping[str, Any]) -> int:
        n = int(self.settings.get("n_trials") or 1)
        sampler = self.settings.get("sampler") or {}
        if sampler.get("_target_") == GRID and sampler.get("search_space") is None:
            n = min(n, math.prod(len(v) for v in grid_of(space).values()))
        return n

    def open_study(self, space: Mapping[str, Any]) -> Any:
        """Create the study in its storage, or (``resume``) load the one there, checked."""
        import optuna
        from optuna.exceptions import DuplicatedStudyError

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        storage, named = storage_of(self.settings.get("storage"), self.sweep_dir)
        sampler = make_sampler(self.settings["sampler"], 0, space)
        where = {"storage": storage, "sampler": sampler, "study_name": self.study_name}
        resume = self.settings.get("resume")
        try:
            if resume:
                study = optuna.load_study(**where)
            else:
                study = optuna.create_study(**where, direction=self.direction)
        except DuplicatedStudyError:
            raise StudyError(
                f"{named} already holds a study named {self.study_name}: continue it with "
                "hydra.sweeper.resume=true (make resume RUN=<its sweep dir>), or choose "
                "another hydra.sweeper.study_name"
            ) from None
        except KeyError:  # load_study: no study of that name
            raise StudyError(
                f"hydra.sweeper.resume=true, but {named} holds no study named "
                f"{self.study_name}: nothing to continue (start it without resume)"
            ) from None
        name_metric(study, self.metric)
        if resume:
            self._check_continued(study, space)
        return study

    def _check_continued(self, study: Any, space: Mapping[str, Any]) -> None:
        stored, name = study.direction.name.lower(), self.study_name
        if stored != self.direction:
            why = f"this continuation would {self.direction}; continue it as it started"
            raise StudyError(f"the study {name} was run to {stored}, {why}")
        for trial in study.get_trials(deepcopy=False):
            if dict(trial.distributions) != dict(space):
                theirs = ", ".join(sorted(trial.distributions))
                raise StudyError(
                    f"the search space differs from the one the study {self.study_name} ran "
                    f"(trial {trial.number} searched {theirs}); continue it with the same "
                    "hydra.sweeper.params and command-line ranges"
                )

    def run(self, arguments: Sequence[str]) -> list[Any]:
        """The whole study: finish what a killed one left running, then ask for the rest."""
        from optuna.trial import TrialState

        space, fixed = search_space(self.settings.get("params"), arguments)
        if not space:
            raise StudyError("hydra/sweeper=optuna has no search space")
        study = self.open_study(space)
        if not self.settings.get("resume"):  # a continuation keeps the record of the start
            self.sweep_dir.mkdir(parents=True, exist_ok=True)
            self.save_record(self.sweep_dir / SWEEP_RECORD)
        returns: list = []
        running = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.RUNNING]
        for trial in running:
            returns += self._continue_trial(study, trial, fixed)
        total = self.n_trials(space)
        batch_size = max(1, int(self.settings.get("n_jobs") or 1))
        while (asked := len(study.get_trials(deepcopy=False))) < total:
            trials = [self._ask(study, space) for _ in range(min(batch_size, total - asked))]
            returns += self._launch(study, trials, fixed)
        self._write_results(study)
        return returns

    def _ask(self, study: Any, space: Mapping[str, Any]) -> Any:
        number = len(study.get_trials(deepcopy=False))
        study.sampler = make_sampler(self.settings["sampler"], number, space)
        return study.ask(fixed_distributions=dict(space))

    def _overrides(self, fixed: list[str], params: Mapping[str, Any]) -> list[str]:
        return [*fixed, *(override_text(k, v) for k, v in params.items())]

    def _launch(self, study: Any, trials: list, fixed: list[str], extra=()) -> list:
        batch = [[*self._overrides(fixed, t.params), *extra] for t in trials]
        self.validate(batch)
        self._note_run_dirs(trials, batch)
        returns = list(self.launch(batch, trials[0].number))
        failed = None
        for trial, ret in zip(trials, returns, strict=True):
            try:
                value = ret.return_value
            except Exception as e:  # the job raised: the trial failed, the study stops
                _fail(study, trial.number)
                failed = failed or e
                continue
            self._tell(study, trial.number, value)
        if failed is not None:
            raise failed
        return returns

    def _note_run_dirs(self, trials: list, batch: list[list[str]]) -> None:
        """Each asked trial's run directory as its user attribute ``run_dir``, before it runs."""
        from optuna.trial import Trial

        for trial, overrides in zip(trials, batch, strict=True):
            if isinstance(trial, Trial):
                trial.set_user_attr(RUN_DIR_ATTR, str(self.job_dir(overrides, trial.number)))

    def _tell(self, study: Any, number: int, value: Any) -> None:
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            _no_grid_stop(study)
            study.tell(number, float(value))
        else:  # no finite value of trainer.monitor: a failed trial, the study goes on
            log.warning("trial %d: no finite %s (%r), told as failed", number, self.metric, value)
            _fail(study, number)

    def _continue_trial(self, study: Any, trial: Any, fixed: list[str]) -> list:
        """A RUNNING trial of a killed study: told from its finished run, else resumed in place."""
        run_dir = Path(self.job_dir(self._overrides(fixed, trial.params), trial.number))
        ran = (run_dir / RUN_JSON).is_file()
        try:
            status = read_run_json(run_dir).get("status") if ran else None
        except ReprotrainError:
            status = None
        if status == "completed":
            self._tell(study, trial.number, trial_value(run_dir, self.metric, self.mode))
            return []
        if status == "failed":
            _fail(study, trial.number)
            return []
        extra = ["resume=auto", *(["hydra.output_subdir=null"] if status else [])]
        say(f"optuna study {self.study_name}: continuing trial {trial.number} in {run_dir}")
        return self._launch(study, [trial], fixed, extra)

    def _write_results(self, study: Any) -> None:
        import yaml

        try:
            best = study.best_trial
        except ValueError:  # no completed trial
            return
        found = {"name": "optuna", "best_params": dict(best.params), "best_value": best.value}
        atomic_write_text(self.sweep_dir / OPTUNA_RESULTS, yaml.safe_dump(found, sort_keys=False))


def name_metric(study: Any, metric: str) -> None:
    """The objective's name (``trainer.monitor``) in the study, for Optuna's plots."""
    from optuna.exceptions import ExperimentalWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)  # set_metric_names: since 3.2
        study.set_metric_names([metric])


def _no_grid_stop(study: Any) -> None:
    """GridSampler's ``study.stop()`` raises outside ``study.optimize``; we stop at its size."""
    from optuna.samplers import GridSampler, RandomSampler

    if isinstance(study.sampler, GridSampler):
        study.sampler = RandomSampler()


def _fail(study: Any, number: int) -> None:
    from optuna.trial import TrialState

    _no_grid_stop(study)
    study.tell(number, state=TrialState.FAIL)


def job_dir_of(load: Callable[[list[str]], DictConfig], overrides: list[str], number: int) -> Path:
    """Where the launcher puts job ``number`` (``hydra.sweep.subdir`` of ``load(overrides)``)."""
    cfg = load(list(overrides))
    with open_dict(cfg):
        cfg.hydra.job.id = cfg.hydra.job.num = number
    return Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
