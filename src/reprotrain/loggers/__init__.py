"""Experiment loggers: TensorBoard, MLflow, W&B, CSV, a user's or none, as sinks of the
run record.

``metrics.jsonl`` and ``fingerprints.jsonl`` are the truth; a logger receives copies of the
same numbers so a run can be watched live, and nothing it does may change the bits:

- it gets python numbers the loop has already synced (in batches, at the logging cadence
  and at epoch ends), so it never adds a host sync per step to the hot path;
- the global RNGs (python, NumPy, torch CPU) are saved before and restored after every
  call into a backend, because third-party code may draw from them (run ids, sampling)
  and the `train` stream would then diverge from a run without that logger;
- a backend that fails mid-run (network, full disk) is reported once and switched off:
  losing a dashboard must not lose a training run;
- only rank 0 logs; every other rank gets a no-op, so N processes do not write N copies;
- after a resume, TensorBoard's event stream is rebuilt from the record up to the
  checkpoint's step (:class:`History`) and continues from there, so every step appears
  exactly once, whatever an earlier attempt had or had not flushed before it was killed.

The config group is ``conf/logger/``: each option is a ``_target_`` entry naming a logger
class (``shipped``: TensorBoard, MLflow, W&B, CSV; a user's ``reprotrain.api.Logger``
subclass under ``logger.sinks``), and a list combines them (``logger=[tensorboard,mlflow]``);
``logger=none`` switches all off. MLflow and W&B are optional extras (``make install
EXTRAS=mlflow,wandb``, hashed locks), imported only when chosen. One module per backend:
``tensorboard_sink``, ``mlflow_sink``, ``wandb_sink``; their ``_target_`` classes and the CSV
logger: ``shipped``; where each writes: ``settings``; what they are told: ``params``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from hydra.utils import instantiate

from reprotrain.errors import ReprotrainError
from reprotrain.loggers.fanout import (
    History,
    Logger,
    LoggerRun,
    Loggers,
    log,
    numeric,
    preserved_rng,
    resumed_history,
    switched_off,
)
from reprotrain.loggers.mlflow_sink import ReportHook
from reprotrain.loggers.params import run_params
from reprotrain.loggers.settings import (
    EXTRAS_INSTALL,
    SHIPPED_KEYS,
    LoggerConfig,
    check_logger_config,
    chosen_loggers,
    enabled_backends,
)
from reprotrain.loggers.shipped import SHIPPED, CSVLogger
from reprotrain.loggers.wandb_sink import resolve_wandb_mode, wandb_key_configured

__all__ = [
    "EXTRAS_INSTALL",
    "CSVLogger",
    "History",
    "Logger",
    "LoggerConfig",
    "LoggerRun",
    "Loggers",
    "build_loggers",
    "check_logger_config",
    "enabled_backends",
    "numeric",
    "preserved_rng",
    "resolve_wandb_mode",
    "resumed_history",
    "run_params",
    "wandb_key_configured",
]


def build_loggers(
    cfg: Any,
    run_dir: Path,
    record: dict[str, Any],
    start_step: int = 0,
    history: History | None = None,
    report: ReportHook | None = None,
) -> Loggers:
    """The loggers chosen in ``cfg`` (a ``LoggerConfig`` or the ``logger`` DictConfig),
    each built from its ``_target_`` (``True``: the shipped class) and started.

    ``record`` is run.json's data (identity fields are sent as parameters; the environment
    is not). ``start_step``: the global step a resumed run continues from; TensorBoard and
    CSV rewrite their files from ``history`` (the record up to that step), so curves have
    neither gaps nor doubles. ``report``: draws report.md and curves.png of a run dir into a
    folder (``run.report.write_report``), for MLflow's and W&B's artifacts at the
    end; without it, the ones ``make report`` already wrote are attached. Non-zero ranks get
    an empty ``Loggers``.
    """
    check_logger_config(cfg)
    if _rank() != 0:
        return Loggers([], cfg.log_every_steps, tuple(enabled_backends(cfg)))
    run_dir = Path(run_dir)
    run = LoggerRun(run_dir, record, run_params(run_dir, record), start_step, history, cfg,
                    report)  # fmt: skip
    backends: list[Logger] = []
    try:
        for name, entry in chosen_loggers(cfg).items():
            with preserved_rng():
                logger = _built(name, entry)
                if _started(name, logger, run):
                    backends.append(logger)
    except ReprotrainError:
        for b in backends:
            b.close("failed")
        raise
    if backends:
        log.info("logging to %s", ", ".join(b.describe() for b in backends))
    return Loggers(backends, cfg.log_every_steps, tuple(enabled_backends(cfg)))


def _built(name: str, entry: Any) -> Logger:
    """The logger of one entry: the shipped class for ``True``, else its ``_target_``."""
    if entry is True:
        if name not in SHIPPED:
            raise ReprotrainError(f"logger.sinks.{name} must be a _target_ node, not true")
        return SHIPPED[name]()
    where = f"logger.{name}" if name in SHIPPED_KEYS else f"logger.sinks.{name}"
    if not hasattr(entry, "get") or not entry.get("_target_"):
        raise ReprotrainError(f"{where} has no _target_; see conf/logger/ (docs/loggers.md)")
    try:
        logger = instantiate(entry, _convert_="all")
    except Exception as e:
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ReprotrainError(f"{where}: cannot build {entry.get('_target_')}: {cause}") from e
    missing = [m for m in LOGGER_METHODS if not callable(getattr(logger, m, None))]
    if missing:
        raise ReprotrainError(
            f"{where}: {type(logger).__qualname__} lacks {', '.join(missing)}; subclass "
            "reprotrain.api.Logger"
        )
    return logger


def _started(name: str, logger: Logger, run: LoggerRun) -> bool:
    """Start ``logger`` (config key ``name``); one that raises (a store out of reach) is
    switched off with one warning and the run goes on, as when it fails later. A
    ``ReprotrainError`` (an extra not installed) ends the run before its first step."""
    try:
        logger.start(run)
        return True
    except ReprotrainError:
        raise
    except Exception as e:  # a dashboard failing must not end the training run
        switched_off(name, "start", e)
        with contextlib.suppress(Exception):
            logger.close("failed")
        return False


#: What the fan-out calls on a logger (``reprotrain.api.Logger`` has them all).
LOGGER_METHODS = ("start", "describe", "log_steps", "end_batch", "log_epoch", "log_final", "close")


def _rank() -> int:
    """Rank of this process: torch.distributed when initialised, else the launcher's env."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass
    return int(os.environ.get("RANK", "0") or 0)
