"""The ``hydra/sweeper=continued`` config node and the Sweeper Hydra instantiates from it.

Imported by Hydra's plugin scan at every start: nothing heavy here. The jobs are Hydra's basic
sweeper's, numbered as it numbered them; which run is ``continuation.pending``'s decision.
"""

# No `from __future__ import annotations`: Hydra's plugin scan runs this module before it is
# in sys.modules, where dataclasses cannot resolve string annotations.
from dataclasses import dataclass
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser


@dataclass
class ContinuedSweeperConf:
    _target_: str = "hydra_plugins.reprotrain_continued_sweeper.continued_sweeper.ContinuedSweeper"
    max_batch_size: int | None = None  # as hydra/sweeper=basic
    params: dict[str, str] | None = None  # as hydra/sweeper=basic
    resume: bool = True  # the sweep dir is this sweep's own (preflight: not a second sweep)


ConfigStore.instance().store(
    group="hydra/sweeper", name="continued", node=ContinuedSweeperConf, provider="reprotrain"
)


class ContinuedSweeper(BasicSweeper):
    """Hydra's basic sweeper, continuing: no new ``multirun.yaml``, only the pending jobs."""

    def __init__(self, max_batch_size: Any = None, params: Any = None, resume: bool = True):
        super().__init__(max_batch_size=max_batch_size, params=params)

    def sweep(self, arguments: list[str]) -> Any:
        import sys
        from functools import partial

        from reprotrain.errors import ReprotrainError
        from reprotrain.tools.sweeps.continuation import run_pending
        from reprotrain.tools.sweeps.optuna_sweeper import job_dir_of

        assert self.config is not None and self.hydra_context is not None
        assert self.launcher is not None
        lines = [f"{k}={v}" for k, v in (self.params or {}).items()] + list(arguments)
        parsed = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        jobs = self.split_arguments(parsed.parse_overrides(lines), None)[0]
        load = partial(self.hydra_context.config_loader.load_sweep_config, self.config)
        try:
            return run_pending(
                jobs, lambda overrides, n: job_dir_of(load, overrides, n), self.launcher.launch,
                self.max_batch_size,
            )  # fmt: skip
        except ReprotrainError as e:  # one line, like every refusal; the jobs run are kept
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(e.exit_code)
