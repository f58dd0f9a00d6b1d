"""The shipped loggers by their ``logger`` config key, and the CSV logger (docs/loggers.md)."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from reprotrain.loggers.fanout import Logger, LoggerRun, numeric
from reprotrain.loggers.mlflow_sink import MLflowLogger
from reprotrain.loggers.tensorboard_sink import TensorBoardLogger
from reprotrain.loggers.wandb_sink import WandBLogger
from reprotrain.run.paths import inside
from reprotrain.run.record import atomic_write_text


class CSVLogger(Logger):
    """``<run_dir>/<filename>``: one row per epoch, rewritten whole (atomically) each epoch."""

    name = "csv"

    def __init__(self, filename: str = "metrics.csv") -> None:
        self.filename = filename
        self.path: Path | None = None
        self.rows: list[dict[str, Any]] = []

    def describe(self) -> str:
        return f"csv ({self.path})"

    def start(self, run: LoggerRun) -> None:
        self.path = inside(run.run_dir, self.filename, "logger.csv.filename")
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
        atomic_write_text(self.path, text.getvalue())


SHIPPED: dict[str, type[Logger]] = {
    "tensorboard": TensorBoardLogger,
    "mlflow": MLflowLogger,
    "wandb": WandBLogger,
    "csv": CSVLogger,
}
