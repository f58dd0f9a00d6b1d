"""Weights & Biases: a run under ``<run_dir>/wandb``, offline unless a key is configured, its
id derived from the run dir so a resume continues it (docs/loggers.md)."""

from __future__ import annotations

import netrc
import os
import shutil
import tempfile
from pathlib import Path

from reprotrain.loggers.fanout import Logger, LoggerRun
from reprotrain.loggers.params import record_files, run_key, run_name, sweep_dir_of
from reprotrain.loggers.settings import require_module


def resolve_wandb_mode(mode: str) -> str:
    """``auto``: online only when W&B credentials exist (env or ``wandb login``'s netrc; never
    read out), else offline."""
    if mode != "auto" or os.environ.get("WANDB_API_KEY"):
        return mode if mode != "auto" else "online"
    try:
        found = netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        found = False
    return "online" if found else "offline"


class WandBLogger(Logger):
    name = "wandb"

    def start(self, run: LoggerRun) -> None:
        wandb = require_module("wandb", "wandb")
        self.mode = resolve_wandb_mode(run.settings.wandb_mode)
        run_dir = Path(run.run_dir)
        self.run_dir, self.report, self.key = run_dir, run.report, run_key(run_dir, run.record)
        sweep = sweep_dir_of(run_dir)
        self._open: tuple[int, dict[str, float]] | None = None  # (step, its row so far)
        self.run = wandb.init(
            project=run.settings.wandb_project,
            entity=run.settings.wandb_entity or None,
            name=run_name(run_dir, run.record),
            id=self.key,
            resume="allow",
            dir=str(run_dir),
            mode=self.mode,
            group=sweep.name if sweep else None,
            config=run.params,  # with their types
            tags=[str(t) for t in run.record.get("tags") or []] or None,
        )

    def describe(self) -> str:
        return f"wandb ({self.mode}, {self.run.dir})"

    def log_steps(self, steps: list[int], series: dict[str, list[float | None]]) -> None:
        """Each step's row written as it comes but the last, which its epoch's row may join."""
        self._write_open()
        for i, step in enumerate(steps):
            point = {f"step/{k}": v[i] for k, v in series.items() if v[i] is not None}
            if point and i < len(steps) - 1:
                self.run.log(point, step=step, commit=True)
            elif point:
                self._open = (step, point)

    def end_batch(self, global_step: int) -> None:
        self._write_open()

    def log_epoch(self, epoch: int, global_step: int, row: dict[str, float | None]) -> None:
        point = {f"epoch/{k}": v for k, v in row.items() if v is not None}
        if self._open is not None and self._open[0] == global_step:
            point = {**self._open[1], **point}  # the epoch's last step: one row
            self._open = None
        self._write_open()
        self.run.log({"epoch/epoch": epoch, **point}, step=global_step, commit=True)

    def _write_open(self) -> None:
        """Write the row held open for its epoch's values, if any."""
        if self._open is not None:
            step, point = self._open
            self._open = None
            self.run.log(point, step=step, commit=True)

    def log_final(self, metrics: dict[str, float | None]) -> None:
        self.run.summary.update({f"final/{k}": v for k, v in metrics.items() if v is not None})

    def close(self, status: str) -> None:
        try:
            self._write_open()
            self.log_artifacts()
        finally:
            self.run.finish(exit_code=0 if status == "completed" else 1)

    def log_artifacts(self) -> None:
        """The run's record files: the Files tab and one ``run-record`` artifact."""
        import wandb

        files = Path(self.run.dir) / "record"
        files.mkdir(parents=True, exist_ok=True)
        artifact = wandb.Artifact(f"run-{self.key}", type="run-record")
        with tempfile.TemporaryDirectory(prefix="reprotrain-wandb-") as tmp:
            for path in record_files(self.run_dir, self.report, Path(tmp), "wandb"):
                shutil.copyfile(path, files / path.name)  # W&B's Files tab: the run's dir
                artifact.add_file(str(files / path.name), name=path.name)
        self.run.save(str(files / "*"), base_path=self.run.dir, policy="now")
        self.run.log_artifact(artifact)
