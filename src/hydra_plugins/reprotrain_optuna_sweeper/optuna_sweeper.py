"""The ``hydra/sweeper=optuna`` config nodes and the Sweeper Hydra instantiates from them.

Imported by Hydra's plugin scan at every start, so no optuna import here. The samplers are
optuna's own; a null ``seed`` is ``seed.base`` (docs/sweeps-optuna.md).
"""

# No `from __future__ import annotations`: Hydra's plugin scan runs this module before it is
# in sys.modules, where dataclasses cannot resolve string annotations.
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import MISSING, DictConfig, OmegaConf

PROVIDER = "reprotrain"


@dataclass
class TPESamplerConf:
    """optuna.samplers.TPESampler: random for the first ``n_startup_trials``, then each
    proposal is drawn from models of the better and the worse trials so far."""

    _target_: str = "optuna.samplers.TPESampler"
    seed: int | None = None
    n_startup_trials: int = 10
    n_ei_candidates: int = 24
    multivariate: bool | None = None  # null: optuna's default (multivariate, one objective)
    group: bool = False
    constant_liar: bool = True  # trials still running count as bad (n_jobs > 1)


@dataclass
class RandomSamplerConf:
    _target_: str = "optuna.samplers.RandomSampler"
    seed: int | None = None


@dataclass
class CmaEsSamplerConf:
    _target_: str = "optuna.samplers.CmaEsSampler"
    seed: int | None = None
    x0: dict[str, Any] | None = None
    sigma0: float | None = None
    n_startup_trials: int = 1
    popsize: int | None = None
    with_margin: bool = False
    lr_adapt: bool = False


@dataclass
class NSGAIISamplerConf:
    _target_: str = "optuna.samplers.NSGAIISampler"
    seed: int | None = None
    population_size: int = 50
    mutation_prob: float | None = None
    crossover_prob: float = 0.9
    swapping_prob: float = 0.5


@dataclass
class QMCSamplerConf:
    _target_: str = "optuna.samplers.QMCSampler"
    seed: int | None = None
    qmc_type: str = "sobol"
    scramble: bool = False


@dataclass
class GridSamplerConf:
    """Every combination once; null ``search_space``: the grid of the searched values."""

    _target_: str = "optuna.samplers.GridSampler"
    seed: int | None = None
    search_space: dict[str, Any] | None = None


@dataclass
class OptunaSweeperConf:
    _target_: str = "hydra_plugins.reprotrain_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    _recursive_: bool = False  # the sampler stays a config: one is built per trial
    defaults: list[Any] = field(default_factory=lambda: [{"sampler": "tpe"}])
    sampler: Any = MISSING
    # minimize | maximize; null: trainer.monitor_mode's (a trial's value is the best
    # trainer.monitor of its run)
    direction: str | None = None
    # null: the journal file <sweep dir>/study.journal; or a URL (sqlite:///study.db) or a
    # journal file path of your own
    storage: str | None = None
    study_name: str | None = None  # null: the config's name
    n_trials: int = 20
    n_jobs: int = 1  # trials asked at once, before any of them is told
    params: dict[str, str] | None = None  # key: search range, e.g. tag(log, interval(0.01, 1))
    resume: bool = False  # continue the study in hydra.sweep.dir (make resume RUN=<sweep dir>)


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(group="hydra/sweeper", name="optuna", node=OptunaSweeperConf, provider=PROVIDER)
    samplers = {"tpe": TPESamplerConf, "random": RandomSamplerConf, "cmaes": CmaEsSamplerConf}
    samplers |= {"nsgaii": NSGAIISamplerConf, "qmc": QMCSamplerConf, "grid": GridSamplerConf}
    for name, node in samplers.items():
        cs.store(group="hydra/sweeper/sampler", name=name, node=node, provider=PROVIDER)


register()


class OptunaSweeper(Sweeper):
    """Hydra's Sweeper interface around ``reprotrain.tools.sweeps.optuna_sweeper``."""

    def __init__(self, **settings: Any) -> None:
        self.settings = settings  # what Hydra passed; setup() reads the config itself

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context = hydra_context
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> Any:
        import sys
        from functools import partial

        from reprotrain.errors import ReprotrainError
        from reprotrain.tools.sweeps import optuna_sweeper as impl
        from reprotrain.tools.sweeps.optuna_study import StudyView

        assert self.config is not None and self.hydra_context is not None
        master = self.config  # the whole config enters here (and in setup), nowhere below
        settings = OmegaConf.to_container(master.hydra.sweeper, resolve=True)
        assert isinstance(settings, dict)
        view = StudyView.of(master.hydra, master.get("trainer"), master.get("seed"),
                            master.get("name"))  # fmt: skip
        load = partial(self.hydra_context.config_loader.load_sweep_config, master)
        runner = impl.StudyRunner(
            settings, view, launch=self.launcher.launch,
            job_dir=lambda overrides, n: impl.job_dir_of(load, overrides, n),
            validate=self.validate_batch_is_legal,
            save_record=lambda path: OmegaConf.save(master, path),
        )  # fmt: skip
        try:
            return runner.run(arguments)
        except ReprotrainError as e:  # one line, like every refusal; the trials run are kept
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(e.exit_code)
