"""TensorBoard: event files in the run dir, linked from the project's ``tb/`` under the run's
name; HParams through tensorboard's own summary API (docs/loggers.md)."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

from reprotrain import metric_names
from reprotrain.loggers.fanout import Logger, LoggerRun, numeric
from reprotrain.loggers.params import RESOLVED_CONFIG, hparam_values, monitor_of, run_name
from reprotrain.loggers.settings import project_root, require_module
from reprotrain.metric_names import split_of
from reprotrain.run.paths import inside

log = logging.getLogger("reprotrain")
#: The HParams session's own folder in the run's: its hyperparameters and the outcomes (the
#: table's columns), apart from the curves, which would each be a column beside them.
SESSION = "hparams"


class TensorBoardLogger(Logger):
    name = "tensorboard"

    def start(self, run: LoggerRun) -> None:
        require_module("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        settings, run_dir = run.settings, Path(run.run_dir)
        self.log_dir = inside(run_dir, settings.tensorboard_dir, "logger.tensorboard_dir")
        self.last_step = run.start_step
        self.hparams = hparam_values(run_dir)
        self.monitor = monitor_of(run_dir)
        self.best: float | None = None  # the best monitored value so far
        if run.start_step:
            # A resume: an earlier attempt's events may stop short of the checkpoint or run
            # past it; the stream starts again from the record.
            for old in [*self.log_dir.glob("events.out.tfevents.*"),
                        *self.log_dir.glob(f"{SESSION}/events.out.tfevents.*")]:  # fmt: skip
                old.unlink()
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        # Each run writes its hyperparameters only (no experiment summary: TensorBoard takes
        # the first it finds for every run below a root, so the others' keys would be lost).
        self.session = SummaryWriter(log_dir=str(self.log_dir / SESSION))
        self.session.file_writer.add_summary(hparams_pb(self.hparams))
        ident = {k: v for k, v in run.params.items() if k.startswith("run.")}
        table = "\n".join(f"| {k[4:]} | `{v}` |" for k, v in sorted(ident.items()))
        self.writer.add_text("run", "| field | value |\n|---|---|\n" + table, 0)
        config = run_dir / RESOLVED_CONFIG
        if config.is_file():
            indented = "\n".join("    " + line for line in config.read_text().splitlines())
            self.writer.add_text("config", indented, 0)  # markdown: indented = code block
        if run.start_step and run.history is not None:
            self.log_steps(run.history.steps, run.history.series)
            for epoch, global_step, row in run.history.epochs:
                self.log_epoch(epoch, global_step, numeric(row, skip=("epoch", "global_step")))
        root = project_root()
        if settings.tensorboard_index and run_dir.resolve().is_relative_to(root):
            index = inside(root, settings.tensorboard_index, "logger.tensorboard_index", root.name)
            name = run_name(run_dir, run.record).replace(os.sep, "_").lstrip(".")
            link_run(index, name, self.log_dir)

    def describe(self) -> str:
        return f"tensorboard ({self.log_dir})"

    def log_steps(self, steps: list[int], series: dict[str, list[float | None]]) -> None:
        for key, values in series.items():
            for step, value in zip(steps, values, strict=True):
                if value is not None:
                    self.writer.add_scalar(f"step/{key}", value, step)
        self.last_step = max([self.last_step, *steps])

    def log_epoch(self, epoch: int, global_step: int, row: dict[str, float | None]) -> None:
        self.writer.add_scalar("epoch/epoch", epoch, global_step)
        self._track_best(row)
        for key, value in row.items():
            if value is not None:
                self.writer.add_scalar(f"epoch/{key}", value, global_step)
        self.last_step = max(self.last_step, global_step)
        self.writer.flush()

    def _track_best(self, row: dict[str, float | None]) -> None:
        """The best monitored value so far (the first finite one, then only a better one)."""
        value = row.get(self.monitor[0]) if self.monitor else None
        if value is None or not math.isfinite(value):
            return
        if self.best is None or metric_names.better(value, self.best, self.monitor[1]):
            self.best = value

    def log_final(self, metrics: dict[str, float | None]) -> None:
        for key, value in sorted(metrics.items()):
            if value is not None:
                self.writer.add_scalar(f"final/{key}", value, self.last_step)
        rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(metrics.items()))
        self.writer.add_text("final_metrics", "| metric | value |\n|---|---|\n" + rows, 0)
        # The session's columns: the best monitored value, the val and test outcomes
        # (best_test_acc too), not train metrics nor bookkeeping.
        if self.monitor and self.best is not None:
            self.session.add_scalar(f"best/{self.monitor[0]}", self.best, self.last_step)
        shown = [k for k, v in metrics.items() if v is not None and split_of(k) in ("val", "test")]
        for key in sorted(shown, key=metric_names.sort_key):
            self.session.add_scalar(f"final/{key}", metrics[key], self.last_step)

    def close(self, status: str) -> None:
        """Both writers closed (the run's status is run.json's: tensorboard's session-end
        summary is only in its TensorFlow API, ``hparams.summary``)."""
        self.session.close()
        self.writer.close()


def hparams_pb(hparams: dict[str, bool | int | float | str]):
    """The HParams session-start summary of one run, by tensorboard's own summary API."""
    from tensorboard.plugins.hparams import summary_v2

    return summary_v2.hparams_pb(hparams)


def link_run(index_dir: Path, name: str, log_dir: Path) -> Path | None:
    """``<index_dir>/<name>`` -> ``log_dir`` (relative symlink); anything else there is left
    alone (warned). Returns the link, or None."""
    link = Path(index_dir) / name
    target: str | None = None
    try:
        link.parent.mkdir(parents=True, exist_ok=True)
        target = os.path.relpath(Path(log_dir).resolve(), link.parent.resolve())
        if link.is_symlink() and os.readlink(link) == target:
            return link
        if link.exists() or link.is_symlink():
            log.warning("tensorboard: %s exists and is not a link to this run; not linked", link)
            return None
        link.symlink_to(target, target_is_directory=True)
    except OSError as e:
        log.warning("tensorboard: cannot link %s -> %s (%s); not in %s", link, target, e, index_dir)
        return None
    return link
