"""Experiment loggers: sinks fed copies of the record's numbers on rank 0 (docs/loggers.md).
Closes: a logger changing a bit (every call RNG-neutral and failure-isolated, ``fanout``)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from hydra.utils import instantiate

from reprotrain.allowlist import allowing, targets_in
from reprotrain.errors import ReprotrainError
from reprotrain.extras import EXTRAS_INSTALL
from reprotrain.loggers.fanout import (
    CallbackLog,
    History,
    Logger,
    LoggerRun,
    Loggers,
    log,
    preserved_rng,
    resumed_history,
    switched_off,
)
from reprotrain.loggers.mlflow_sink import ReportHook
from reprotrain.loggers.params import run_params
from reprotrain.loggers.settings import LoggerConfig, LoggerSettings, check_extras
from reprotrain.loggers.shipped import SHIPPED
from reprotrain.loggers.wandb_sink import resolve_wandb_mode

__all__ = ["EXTRAS_INSTALL", "CallbackLog", "History", "Logger", "LoggerConfig", "LoggerRun"]
__all__ += ["LoggerSettings", "Loggers", "build_loggers", "check_extras", "resolve_wandb_mode"]
__all__ += ["resumed_history", "run_params"]


def build_loggers(
    node: Any,
    run_dir: Path,
    record: dict[str, Any],
    start_step: int = 0,
    history: History | None = None,
    report: ReportHook | None = None,
) -> Loggers:
    """The loggers the ``logger`` node chooses, built and started (rank 0 only)."""
    settings = check_extras(LoggerSettings.of(node))
    if _rank() != 0:
        return Loggers([], tuple(settings.backends))
    run_dir = Path(run_dir)
    params = run_params(run_dir, record)
    run = LoggerRun(run_dir, record, params, start_step, history, settings, report)
    backends: list[Logger] = []
    try:
        for name, entry in settings.chosen:
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
    return Loggers(backends, tuple(settings.backends))


def _built(name: str, entry: Any) -> Logger:
    """The logger of one entry: the shipped class for ``True``, else its ``_target_``."""
    if entry is True:
        return SHIPPED[name]()  # a user's entry is a _target_ node (LoggerSettings.of)
    where = f"logger.{name}"
    if not hasattr(entry, "get") or not entry.get("_target_"):
        raise ReprotrainError(f"{where} has no _target_; see conf/logger/ (docs/loggers.md)")
    try:
        with allowing(targets_in(entry)):  # Hydra 1.4's allowlist: what the entry names
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
    """Start ``logger``: one that raises is switched off; a ``ReprotrainError`` ends the run."""
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
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)
