"""TensorBoard: event files in the run dir, linked from the project's ``tb/`` (docs/loggers.md)."""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

from reprotrain import metric_names
from reprotrain.loggers.fanout import Logger, LoggerRun, numeric
from reprotrain.loggers.params import (
    RESOLVED_CONFIG,
    hparam_values,
    is_seed,
    monitor_of,
    relative_name,
    sweep_dir_of,
    swept_keys,
)
from reprotrain.loggers.settings import project_root, require_module
from reprotrain.metric_names import split_of
from reprotrain.run.paths import inside

log = logging.getLogger("reprotrain")

STATUS = {"completed": "STATUS_SUCCESS", "interrupted": "STATUS_ABORTED"}


class TensorBoardLogger(Logger):
    name = "tensorboard"

    def start(self, run: LoggerRun) -> None:
        require_module("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        settings, run_dir = run.settings, Path(run.run_dir)
        self.log_dir = inside(run_dir, settings.tensorboard_dir, "logger.tensorboard_dir")
        self.last_step = run.start_step
        self.hparams = hparam_values(run_dir)
        self.monitor, self.swept = monitor_of(run_dir), swept_keys(sweep_dir_of(run_dir))
        self.best: float | None = None  # the best monitored value so far
        if run.start_step:
            # A resume: an earlier attempt's events may stop short of the checkpoint or run
            # past it; the stream starts again from the record.
            for old in self.log_dir.glob("events.out.tfevents.*"):
                old.unlink()
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        ident = {k: v for k, v in run.params.items() if k.startswith("run.")}
        table = "\n".join(f"| {k[4:]} | `{v}` |" for k, v in sorted(ident.items()))
        self.writer.add_text("run", "| field | value |\n|---|---|\n" + table, 0)
        config = run_dir / RESOLVED_CONFIG
        if config.is_file():
            indented = "\n".join("    " + line for line in config.read_text().splitlines())
            self.writer.add_text("config", indented, 0)  # markdown: indented = code block
        if self.hparams:
            self.writer.file_writer.add_summary(session_start(self.hparams))
        if run.start_step and run.history is not None:
            self.log_steps(run.history.steps, run.history.series)
            for epoch, global_step, row in run.history.epochs:
                self.log_epoch(epoch, global_step, numeric(row, skip=("epoch", "global_step")))
        root = project_root()
        if settings.tensorboard_index and run_dir.resolve().is_relative_to(root):
            index = inside(root, settings.tensorboard_index, "logger.tensorboard_index", root.name)
            link_run(index, relative_name(run_dir, root), self.log_dir)

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
        tags = []
        if self.monitor and self.best is not None:
            tags.append(f"best/{self.monitor[0]}")
            self.writer.add_scalar(tags[-1], self.best, self.last_step)
        # val and test outcomes (best_test_acc too), not train metrics nor bookkeeping
        shown = [k for k, v in metrics.items() if v is not None and split_of(k) in ("val", "test")]
        tags += [f"final/{k}" for k in sorted(shown, key=metric_names.sort_key)]
        if self.hparams:
            self.writer.file_writer.add_summary(experiment(self.hparams, tags, self.swept))

    def close(self, status: str) -> None:
        self.writer.file_writer.add_summary(session_end(status))
        self.writer.close()


def session_start(hparams: dict[str, bool | int | float | str]):
    """The HParams plugin's session-start summary: one run's hyperparameter values."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    info = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
    for key, value in hparams.items():
        if isinstance(value, bool):
            info.hparams[key].bool_value = value
        elif isinstance(value, int | float):
            info.hparams[key].number_value = float(value)
        else:
            info.hparams[key].string_value = str(value)
    return _plugin_summary("SESSION_START_INFO_TAG", session_start_info=info)


def experiment(
    hparams: dict[str, bool | int | float | str],
    metric_tags: list[str],
    swept: set[str] | frozenset[str] = frozenset(),
):
    """The HParams plugin's experiment summary: hyperparameters (``swept`` ones, and
    ``group`` when any is, marked as differing) and the metric columns."""
    from tensorboard.plugins.hparams import api_pb2

    def kind(value: object) -> int:
        if isinstance(value, bool):
            return api_pb2.DATA_TYPE_BOOL
        number = isinstance(value, int | float)
        return api_pb2.DATA_TYPE_FLOAT64 if number else api_pb2.DATA_TYPE_STRING

    differing = set(swept) | ({"group"} if any(not is_seed(k) for k in swept) else set())
    infos = [
        api_pb2.HParamInfo(name=k, type=kind(v), differs=k in differing) for k, v in hparams.items()
    ]
    metrics = [api_pb2.MetricInfo(name=api_pb2.MetricName(tag=t)) for t in metric_tags]
    exp = api_pb2.Experiment(hparam_infos=infos, metric_infos=metrics)
    return _plugin_summary("EXPERIMENT_TAG", experiment=exp)


def session_end(status: str):
    """The HParams plugin's session-end summary: completed, interrupted or failed."""
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    code = api_pb2.Status.Value(STATUS.get(status, "STATUS_FAILURE"))
    info = plugin_data_pb2.SessionEndInfo(status=code, end_time_secs=time.time())
    return _plugin_summary("SESSION_END_INFO_TAG", session_end_info=info)


def _plugin_summary(tag: str, **data: object):
    """One summary of the HParams plugin; ``tag``: the name of its tag in ``metadata``."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2

    content = metadata.create_summary_metadata(plugin_data_pb2.HParamsPluginData(**data))
    value = Summary.Value(tag=getattr(metadata, tag), metadata=content, tensor=metadata.NULL_TENSOR)
    return Summary(value=[value])


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
