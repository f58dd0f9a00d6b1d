"""A ``--multirun`` is checked whole before anything is written: its sweeper and search space.

Closes: a sweep refused only once Hydra had started it (docs/sweeps-optuna.md).
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override
from omegaconf import DictConfig

from reprotrain.errors import ReprotrainError

#: The framework's own sweeper (src/hydra_plugins/reprotrain_optuna_sweeper), on optuna 5.
OPTUNA_SWEEPER = "hydra_plugins.reprotrain_optuna_sweeper.optuna_sweeper.OptunaSweeper"
#: A search range that works from the command line, shown in refusals.
EXAMPLE = "'optimizer.lr=tag(log,interval(0.01,1))'"


def is_optuna(sweeper: DictConfig | None) -> bool:
    """Whether the ``hydra.sweeper`` node is the framework's Optuna sweeper."""
    return sweeper is not None and sweeper.get("_target_") == OPTUNA_SWEEPER


def sweep_values(override: Override) -> list[str]:
    """The values preflight composes for a sweep override (an interval: its two ends)."""
    value = override.value()
    if isinstance(value, IntervalSweep):
        return [str(value.start), str(value.end)]
    return list(override.sweep_string_iterator())


def _searched(key: str) -> bool:
    return key == "repro" or key.startswith("repro.")


def _level_searched(key: str) -> ReprotrainError:
    return ReprotrainError(
        f"{key} cannot be searched: the determinism level is set once per process, before "
        "any trial starts; run one study per level (repro=strict, then repro=portable)"
    )


def check_study(sweeper: DictConfig, trainer: DictConfig, overrides: list[str]) -> None:
    """Refuse, in one line, an Optuna study that cannot run here (before any trial runs)."""
    parsed = OverridesParser.create().parse_overrides([str(o) for o in overrides])
    cli_sweeps = [o.get_key_element() for o in parsed if o.is_sweep_override()]
    mode = str(trainer.monitor_mode)
    direction = sweeper.get("direction")
    if isinstance(direction, str) and direction != f"{mode}imize":
        raise ReprotrainError(
            f"hydra.sweeper.direction={direction} but trainer.monitor_mode={mode}: a trial's "
            f"value is the best {trainer.monitor} of its run; set "
            f"hydra.sweeper.direction={mode}imize (or '${{trainer.monitor_mode}}imize')"
        )
    for key in ("n_trials", "n_jobs"):
        value = sweeper.get(key)
        if value is not None and (type(value) is not int or value < 1):
            raise ReprotrainError(
                f"hydra.sweeper.{key}={value}: give a positive whole number "
                f"(hydra.sweeper.{key}={8 if key == 'n_trials' else 1})"
            )
    searched = [str(k) for k in sweeper.get("params") or {}] + cli_sweeps
    if not searched:
        raise ReprotrainError(
            "hydra/sweeper=optuna has no search space: add +hparams_search=smoke_optuna, or "
            f"give a range on the command line, e.g. {EXAMPLE} or 'optimizer.lr=choice(0.01,0.1)'"
        )
    if (level := next((k for k in searched if _searched(k)), None)) is not None:
        raise _level_searched(level)


def check_sweep_overrides(overrides: list[str]) -> None:
    """Refuse a sweep of Hydra's own config (``hydra.*=a,b``), showing the form that works."""
    for o in OverridesParser.create().parse_overrides(overrides):
        key = o.get_key_element()
        if not (o.is_sweep_override() and key.startswith("hydra.")):
            continue
        value = o.input_line.partition("=")[2]
        if key.startswith("hydra.sweeper.params."):
            name = key.removeprefix("hydra.sweeper.params.")
            if _searched(name):
                raise _level_searched(name)
            raise ReprotrainError(
                f"{o.input_line}: Hydra does not sweep its own config; give the search range "
                f"as {name}'s own override with hydra/sweeper=optuna: '{name}={value}' "
                f"(e.g. {EXAMPLE})"
            )
        raise ReprotrainError(
            f"{o.input_line}: Hydra does not sweep its own config ({key}); give it one value"
        )


def check_sweep(sweeper: DictConfig, trainer: DictConfig, overrides: list[str]) -> None:
    """A ``--multirun``'s sweeper and search space, refused in one line before any write."""
    if is_optuna(sweeper):
        check_study(sweeper, trainer, overrides)
        return
    for o in OverridesParser.create().parse_overrides(overrides):
        if o.is_sweep_override() and isinstance(o.value(), IntervalSweep):
            raise ReprotrainError(
                f"{o.input_line} is a search range, which only Optuna samples: add "
                "hydra/sweeper=optuna, or list the values (e.g. optimizer.lr=0.01,0.1)"
            )


#: The sweep directory's record of the sweep (Hydra writes it when the sweep starts).
SWEEP_RECORD = "multirun.yaml"


def continues_study(values: dict[str, str | None]) -> bool:
    """Whether the command line continues a study (``hydra.sweeper.resume=true``)."""
    return str(values.get("hydra.sweeper.resume")).lower() == "true"


def check_continued_study(sweep_dir: str | None) -> None:
    """A study is continued in its own directory, given and holding the sweep's record."""
    if sweep_dir is None or "${" in sweep_dir:
        raise ReprotrainError(
            "hydra.sweeper.resume=true continues the study in hydra.sweep.dir: give its "
            "directory (hydra.sweep.dir=multirun/<name>/<stamp>), or make resume RUN=<it>"
        )
    path = Path(sweep_dir).expanduser()
    if not (path / SWEEP_RECORD).is_file():
        raise ReprotrainError(
            f"hydra.sweeper.resume=true: {path} holds no sweep ({SWEEP_RECORD}), so there is "
            "no study to continue; start it without hydra.sweeper.resume"
        )
