"""The run's start: the config validated, ``Fresh``, ``Resume`` or ``Fork`` decided once
(``begin``), record and identity (``provenance.py``), controls and layout: the :class:`Run`.

Closes: determinism, seeds and threads set before anything is built; the config's identity
written before the first step; a resume that starts over, or a fork passing for a resume.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from reprotrain import config, launchers, resume
from reprotrain.config import RunSettings, TrainerSettings, config_sha256
from reprotrain.config_view import start_banner, task_overrides
from reprotrain.distributed import Dist
from reprotrain.errors import ResumeError
from reprotrain.hashing import file_sha256, state_sha256
from reprotrain.reduction import Reduction, for_run
from reprotrain.repro import determinism, environment, secrets
from reprotrain.repro import device as devices
from reprotrain.repro.seeding import Seeds, resolve_seeds
from reprotrain.resume import Resumable, ResumePoint
from reprotrain.run import record as rec
from reprotrain.start import provenance
from reprotrain.state import TrainerState

log = logging.getLogger("reprotrain")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)  # SIGUSR2: SLURM/submitit


class StopFlag:
    """SIGTERM/SIGINT/SIGUSR2 ask the loop to stop after this step; a second SIGINT aborts."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.requeue = launchers.submitit_requeue_handler()  # inside submitit, else None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name
        log.warning("%s received: finishing this step, then checkpointing", self.signal_name)


class Fresh:
    """A new run in its own directory: a new record, the configured seeds and device."""

    def open_record(self, run_dir: Path) -> rec.RunRecord:
        return rec.RunRecord(run_dir)

    def seeds(self, seed_cfg: Any) -> Seeds:
        return resolve_seeds(seed_cfg)

    def device(self, record: rec.RunRecord, s: RunSettings, rank: int | None) -> torch.device:
        return devices.resolve_for_resume(None, s.device, s.allow_device_change, rank)

    def check_world_size(self, reduction: Reduction, allow_change: bool) -> None:
        """A new run sets its world size."""

    def write_identity(self, run: Run, *facts: Any) -> None:
        provenance.identity(run, *facts)

    def record_data(self, record: rec.RunRecord, fingerprint: dict) -> None:
        record.update(data_fingerprint=fingerprint)

    def restore(self, run: Run, trainer: Resumable) -> None:
        """Nothing to restore: record the initial weights (built from the ``init`` stream)."""
        initial = state_sha256(trainer.runner.state.model.state_dict())
        run.record.update(initial_weights_sha256=initial, imported_code=provenance.imported_code())


@dataclass
class Fork(Fresh):
    """Another run's checkpoint continued in a new directory: a new record naming its parent."""

    point: ResumePoint

    def seeds(self, seed_cfg: Any) -> Seeds:
        return Seeds(**self.point.state["seeds"])

    def write_identity(self, run: Run, *facts: Any) -> None:
        super().write_identity(run, *facts)
        path, step = self.point.path, self.point.state["loop"]["global_step"]
        parent = {"path": str(path), "global_step": step, "sha256": file_sha256(path)}
        run.record.update(forked_from=parent)

    def restore(self, run: Run, trainer: Resumable) -> None:
        state: TrainerState = trainer.runner.state
        state.load_state_dict(self.point.state)
        run.record.update(imported_code=provenance.imported_code())
        record_extension(run.record, self.point, run.container, run.device)
        resume.rewrite_history(run.run_dir, state)
        log.info("forked from %s", self.point.path)


@dataclass
class Resume:
    """This run continued in place from its own checkpoint: its record, seeds and device."""

    point: ResumePoint
    data_now: dict | None = None  # this resume's data fingerprint (record_data)

    def open_record(self, run_dir: Path) -> rec.RunRecord:
        return rec.RunRecord.load(run_dir)

    def seeds(self, seed_cfg: Any) -> Seeds:
        return Seeds(**self.point.state["seeds"])

    def device(self, record: rec.RunRecord, s: RunSettings, rank: int | None) -> torch.device:
        """The device the run started on, not a fresh ``auto``."""
        recorded = devices.recorded_device(record.data)
        return devices.resolve_for_resume(recorded, s.device, s.allow_device_change, rank)

    def check_world_size(self, reduction: Reduction, allow_change: bool) -> None:
        """Another world size: the reduction says whether it may."""
        saved = self.point.state["env"]["world_size"]
        refused = reduction.resume_check(saved, allow_change)
        if refused is not None:
            raise ResumeError(refused)
        if saved != reduction.world_size:
            log.info("world size %d -> %d", saved, reduction.world_size)

    def write_identity(self, run: Run, *facts: Any) -> None:
        """The run keeps the identity it started with."""

    def record_data(self, record: rec.RunRecord, fingerprint: dict) -> None:
        """The start's stays recorded; this resume's is compared with it in ``restore``."""
        self.data_now = fingerprint

    def restore(self, run: Run, trainer: Resumable) -> None:
        """Replay, load, audit and record (``resume.restore``); then the config that runs."""
        now = {**provenance.code_now(), "data_fingerprint": self.data_now}
        resume.restore(self.point, run, trainer, now)
        record_extension(run.record, self.point, run.container, run.device)


Start = Fresh | Resume | Fork


def begin(resume_cfg: str | None, run_dir: Path, container: dict) -> Start:
    """The one decision: a fresh run, a resume of this run, or a fork of another's."""
    point = resume.find_resume_point(resume_cfg, run_dir, container)
    if point is None:
        return Fresh()
    return Fork(point) if point.forked else Resume(point)


def record_extension(
    record: rec.RunRecord, point: ResumePoint, container: dict, device: torch.device
) -> None:
    """An extended ``trainer.epochs`` enters ``extended_from`` and so ``config_sha256``."""
    extended = list(record.data.get("extended_from") or [])
    if point.extends(container):
        step = point.state["loop"]["global_step"]
        extended.append({"trainer.epochs": point.epochs, "global_step": step})
        record.update(extended_from=extended)
    record.update(config_sha256=config_sha256(container, extended or None))
    record.update(experiment_id=provenance.experiment_id(record.data, device))


@dataclass
class Run:
    """The run as started: what the build, the loop and the restore read."""

    kind: Start
    record: rec.RunRecord
    settings: TrainerSettings  # ``trainer.*`` by concern, frozen, built once here
    container: dict  # the resolved config, ``oc.env`` values as their text
    seeds: Seeds
    device: torch.device
    env: dict
    flags: dict  # the determinism controls in force (``determinism.apply``)
    reduction: Reduction
    dist: Dist
    stop: StopFlag

    @property
    def run_dir(self) -> Path:
        return self.record.run_dir

    @property
    def level(self) -> str:
        return self.flags["level"]

    @property
    def microbatches(self) -> int:
        """Micro-batches per optimizer step (the layout ``start`` validated)."""
        pipeline, step = self.settings.pipeline, self.settings.step
        return config.microbatches_per_step(pipeline.batch_size, step.microbatch_size)

    def restore(self, trainer: Resumable) -> None:
        """Fresh: record the initial weights; Resume: ``reprotrain.resume.restore``."""
        self.kind.restore(self, trainer)
        sha = self.record["config_sha256"]  # an extension's, after the resume rewrote it
        trainer.saver.meta = replace(trainer.saver.meta, config_sha256=sha)


def start(cfg: DictConfig, run_dir: Path, dist: Dist) -> Run:
    """Validate (the batch layout against this job's world size: a submitit job exports
    ``WORLD_SIZE`` only once its tasks start), decide the kind once, open the record, then
    the controls (determinism, seeds, device) and the identity, in that order."""
    config.validate(cfg, dist.world_size)
    container, env_values = secrets.redact(cfg)
    kind = begin(cfg.resume, run_dir, container)  # Fresh | Resume | Fork, decided once
    log.info("run dir: %s", run_dir)  # after the refusals: a refused resume writes nothing
    record = kind.open_record(run_dir)
    provenance.open_run(record, container, env_values)
    stop = StopFlag()  # the signal handlers, from here on
    settings = TrainerSettings.from_config(cfg.trainer)  # each part goes to what reads it
    r, precision = cfg.repro, settings.step.precision
    flags = determinism.apply(r.level, r.num_threads, r.fill_uninitialized_memory, precision)
    seeds = kind.seeds(cfg.seed)
    device = kind.device(record, settings.run, dist.local_rank if dist.enabled else None)
    env = environment.capture(device)
    reduction = for_run(settings.reduction, dist)
    kind.check_world_size(reduction, settings.reduction.allow_world_size_change)
    run = Run(kind, record, settings, container, seeds, device, env, flags, reduction, dist, stop)
    name = OmegaConf.to_container(cfg, resolve=False)["name"]  # an oc.env stays text
    kind.write_identity(run, name, r.require_locked_env, list(cfg.include_untracked))
    provenance.layout(run)
    log.info(
        "experiment %s | repro=%s | seeds %s | device %s | world size %d",
        record["experiment_id"], flags["level"], seeds.as_dict(), device, dist.world_size,
    )  # fmt: skip
    log.info("%s", start_banner(container, task_overrides(), run_dir / rec.RESOLVED_CONFIG))
    return run
