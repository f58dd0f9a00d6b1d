"""Experiment loggers: TensorBoard, MLflow, W&B or none, as sinks of the run record.

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

The config group is ``conf/logger/``: each option switches one backend on, and a list
combines them (``logger=[tensorboard,mlflow]``); ``logger=none`` switches all off. MLflow
and W&B are optional extras (``make install EXTRAS=mlflow,wandb``, hashed locks), imported
only when chosen. One module per backend: ``tensorboard_sink``, ``mlflow_sink``,
``wandb_sink``; where each writes: ``settings``; what they are told: ``params``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reprotrain.errors import ReprotrainError
from reprotrain.loggers.fanout import (
    Backend,
    History,
    Loggers,
    log,
    numeric,
    preserved_rng,
    resumed_history,
)
from reprotrain.loggers.mlflow_sink import ReportHook
from reprotrain.loggers.params import (
    RESOLVED_CONFIG,
    hparam_values,
    monitor_of,
    relative_name,
    run_params,
    sweep_dir_of,
    swept_keys,
)
from reprotrain.loggers.settings import (
    EXTRAS_INSTALL,
    LoggerConfig,
    check_logger_config,
    enabled_backends,
    project_root,
)
from reprotrain.loggers.wandb_sink import resolve_wandb_mode, wandb_key_configured

__all__ = [
    "EXTRAS_INSTALL",
    "Backend",
    "History",
    "LoggerConfig",
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
    """The loggers chosen in ``cfg`` (a ``LoggerConfig`` or the ``logger`` DictConfig).

    ``record`` is run.json's data (identity fields are sent as parameters; the environment
    is not). ``start_step``: the global step a resumed run continues from; TensorBoard
    rewrites its event files from ``history`` (the record up to that step), so curves have
    neither gaps nor doubles. ``report``: draws report.md and curves.png of a run dir into a
    folder (``run.report.write_report``), for MLflow's and W&B's artifacts at the
    end; without it, the ones ``make report`` already wrote are attached. Non-zero ranks get
    an empty ``Loggers``.
    """
    check_logger_config(cfg)
    if _rank() != 0:
        return Loggers([], cfg.log_every_steps, tuple(enabled_backends(cfg)))
    run_dir = Path(run_dir)
    params = run_params(run_dir, record)
    factories: dict[str, Callable[[], Backend]] = {
        "tensorboard": lambda: _tensorboard(cfg, run_dir, start_step, params, history),
        "mlflow": lambda: _mlflow(cfg, run_dir, record, params, report, start_step),
        "wandb": lambda: _wandb(cfg, run_dir, record, params, report),
    }
    backends: list[Backend] = []
    try:
        for name in enabled_backends(cfg):
            with preserved_rng():
                backends.append(factories[name]())
    except ReprotrainError:
        for b in backends:
            b.close("failed")
        raise
    if backends:
        log.info("logging to %s", ", ".join(b.describe() for b in backends))
    return Loggers(backends, cfg.log_every_steps, tuple(enabled_backends(cfg)))


def _tensorboard(cfg: Any, run_dir: Path, start_step: int, params: dict, history) -> Backend:
    from reprotrain.loggers.tensorboard_sink import TensorBoardSink, link_run

    log_dir = run_dir / cfg.tensorboard_dir
    config = run_dir / RESOLVED_CONFIG
    sink = TensorBoardSink(
        log_dir,
        start_step,
        params,
        history,
        hparams=hparam_values(run_dir),
        config_text=config.read_text() if config.is_file() else "",
        monitor=monitor_of(run_dir),
        swept=swept_keys(sweep_dir_of(run_dir)),
    )
    root = project_root()
    if cfg.tensorboard_index and run_dir.resolve().is_relative_to(root):
        link_run(root / cfg.tensorboard_index, relative_name(run_dir, root), log_dir)
    return sink


def _mlflow(cfg: Any, run_dir: Path, record: dict, params: dict, report, start: int) -> Backend:
    from reprotrain.loggers.mlflow_sink import MLflowSink

    return MLflowSink(cfg, run_dir, record, params, report, start)


def _wandb(cfg: Any, run_dir: Path, record: dict, params: dict, report) -> Backend:
    from reprotrain.loggers.wandb_sink import WandBSink

    return WandBSink(cfg, run_dir, record, params, report)


def _rank() -> int:
    """Rank of this process: torch.distributed when initialised, else the launcher's env."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass
    return int(os.environ.get("RANK", "0") or 0)
