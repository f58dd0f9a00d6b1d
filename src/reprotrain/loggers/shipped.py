"""The shipped loggers as ``_target_`` classes (``conf/logger/*.yaml``): TensorBoard, MLflow
and W&B, each opening its sink at :meth:`Logger.start` from the ``logger`` settings (where
it writes: ``settings``), and the CSV logger (``metrics.csv``, one row per epoch).

A user's logger is the same kind of thing: a :class:`reprotrain.api.Logger` subclass named
by ``_target_`` in a YAML of the user's own (docs/loggers.md).
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import Any

from reprotrain.loggers.fanout import Logger, LoggerRun, numeric
from reprotrain.loggers.params import (
    RESOLVED_CONFIG,
    hparam_values,
    monitor_of,
    relative_name,
    sweep_dir_of,
    swept_keys,
)
from reprotrain.loggers.settings import project_root


class Shipped(Logger):
    """A shipped backend: its sink is opened at ``start`` and every call is handed on."""

    def __init__(self) -> None:
        self.sink: Logger | None = None

    def open(self, run: LoggerRun) -> Logger:
        raise NotImplementedError

    def start(self, run: LoggerRun) -> None:
        self.sink = self.open(run)

    def __getattr__(self, name: str) -> Any:
        """The sink's own attributes (``run_id``, ``writer``), once it is open."""
        sink = self.__dict__.get("sink")
        if sink is None:
            raise AttributeError(name)
        return getattr(sink, name)

    def describe(self) -> str:
        return self.sink.describe() if self.sink is not None else self.name

    def log_steps(self, steps: list[int], series: dict[str, list[float | None]]) -> None:
        self.sink.log_steps(steps, series)

    def end_batch(self, global_step: int) -> None:
        self.sink.end_batch(global_step)

    def log_epoch(self, epoch: int, global_step: int, row: dict[str, float | None]) -> None:
        self.sink.log_epoch(epoch, global_step, row)

    def log_final(self, metrics: dict[str, float | None]) -> None:
        self.sink.log_final(metrics)

    def close(self, status: str) -> None:
        if self.sink is not None:
            self.sink.close(status)


class TensorBoardLogger(Shipped):
    """Event files in ``<run_dir>/<logger.tensorboard_dir>``, a link in ``tb/``."""

    name = "tensorboard"

    def open(self, run: LoggerRun) -> Logger:
        from reprotrain.loggers.tensorboard_sink import TensorBoardSink, link_run

        settings, run_dir = run.settings, Path(run.run_dir)
        log_dir = run_dir / settings.tensorboard_dir
        config = run_dir / RESOLVED_CONFIG
        sink = TensorBoardSink(
            log_dir,
            run.start_step,
            run.params,
            run.history,
            hparams=hparam_values(run_dir),
            config_text=config.read_text() if config.is_file() else "",
            monitor=monitor_of(run_dir),
            swept=swept_keys(sweep_dir_of(run_dir)),
        )
        root = project_root()
        if settings.tensorboard_index and run_dir.resolve().is_relative_to(root):
            link_run(root / settings.tensorboard_index, relative_name(run_dir, root), log_dir)
        return sink


class MLflowLogger(Shipped):
    """The project's MLflow store (``logger.mlflow_tracking_uri``)."""

    name = "mlflow"

    def open(self, run: LoggerRun) -> Logger:
        from reprotrain.loggers.mlflow_sink import MLflowSink

        run_dir = Path(run.run_dir)
        return MLflowSink(run.settings, run_dir, run.record, run.params, run.report, run.start_step)


class WandBLogger(Shipped):
    """W&B in ``<run_dir>/wandb``, offline unless a key is configured."""

    name = "wandb"

    def open(self, run: LoggerRun) -> Logger:
        from reprotrain.loggers.wandb_sink import WandBSink

        return WandBSink(run.settings, Path(run.run_dir), run.record, run.params, run.report)


class CSVLogger(Logger):
    """``<run_dir>/<filename>``: one row per epoch, the numbers of its metrics.jsonl row and
    what callbacks logged (``ctx.log``), a column per name in the order first seen. The file
    is rewritten whole at each epoch (atomically), so a resumed run's file has every epoch
    once: the epochs before the checkpoint come from the record."""

    name = "csv"

    def __init__(self, filename: str = "metrics.csv") -> None:
        self.filename = filename
        self.path: Path | None = None
        self.rows: list[dict[str, Any]] = []

    def describe(self) -> str:
        return f"csv ({self.path})"

    def start(self, run: LoggerRun) -> None:
        self.path = Path(run.run_dir) / self.filename
        epochs = run.history.epochs if run.history is not None else []
        self.rows = [
            self._row(e, s, numeric(r, skip=("epoch", "global_step"))) for e, s, r in epochs
        ]
        if self.rows:
            self._write()

    def log_epoch(self, epoch: int, global_step: int, row: dict[str, float | None]) -> None:
        self.rows.append(self._row(epoch, global_step, row))
        self._write()

    @staticmethod
    def _row(epoch: int, global_step: int, row: dict[str, Any]) -> dict[str, Any]:
        return {"epoch": epoch, "global_step": global_step, **row}

    def _write(self) -> None:
        columns = list(dict.fromkeys(k for row in self.rows for k in row))
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.rows)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(text.getvalue())
        os.replace(partial, self.path)


#: The shipped loggers by their key in the ``logger`` config (``logger.<name>: true`` or a
#: ``_target_`` node).
SHIPPED: dict[str, type[Logger]] = {
    "tensorboard": TensorBoardLogger,
    "mlflow": MLflowLogger,
    "wandb": WandBLogger,
    "csv": CSVLogger,
}
