"""The run's start: the config validated, ``Fresh``, ``Resume`` or ``Fork`` decided once
(``begin``), record and identity (``provenance.py``), controls and layout: the :class:`Run`.

Closes: determinism, seeds and threads set before anything is built; the config's identity
written before the first step; a resume that starts over, or a fork passing for a resume.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from reprotrain import resume
from reprotrain.config import TrainerSettings, config_sha256, microbatches_per_step, validate
from reprotrain.config_view import start_banner, task_overrides
from reprotrain.distributed import Dist
from reprotrain.errors import ResumeError
from reprotrain.hashing import file_sha256, state_sha256
from reprotrain.loop import StopFlag
from reprotrain.reduction import Reduction, for_run
from reprotrain.repro import determinism, environment, secrets
from reprotrain.repro import device as devices
from reprotrain.repro.seeding import Seeds, resolve_seeds
from reprotrain.resume import ResumePoint
from reprotrain.run import record as rec
from reprotrain.start import provenance
from reprotrain.step.state import TrainerState

log = logging.getLogger("reprotrain")


class Fresh:
    """A new run in its own directory: a new record, the configured seeds and device."""

    def open_record(self, run_dir: Path) -> rec.RunRecord:
        return rec.RunRecord(run_dir)

    def seeds(self, seed_cfg: Any) -> Seeds:
        return resolve_seeds(seed_cfg)

    def device(self, record: rec.RunRecord, requested: str, allow_change: bool,
               local_rank: int | None) -> torch.device:  # fmt: skip
        return devices.resolve_for_resume(None, requested, allow_change, local_rank=local_rank)

    def check_world_size(self, reduction: Reduction, allow_change: bool) -> None:
        """A new run sets its world size."""

    def write_identity(self, record: rec.RunRecord, device: torch.device, **facts: Any) -> None:
        provenance.identity(record, device, **facts)

    def record_data(self, record: rec.RunRecord, fingerprint: dict) -> None:
        record.update(data_fingerprint=fingerprint)

    def restore(self, state: TrainerState, record: rec.RunRecord, **_: Any) -> None:
        """Nothing to restore: record the initial weights (built from the ``init`` stream)."""
        record.update(initial_weights_sha256=state_sha256(state.model.state_dict()),
                      imported_code=provenance.imported_code())  # fmt: skip


@dataclass
class Fork(Fresh):
    """Another run's checkpoint continued in a new directory: a new record naming its parent."""

    point: ResumePoint

    def seeds(self, seed_cfg: Any) -> Seeds:
        return Seeds(**self.point.state["seeds"])

    def write_identity(self, record: rec.RunRecord, device: torch.device, **facts: Any) -> None:
        super().write_identity(record, device, **facts)
        step = self.point.state["loop"]["global_step"]
        record.update(forked_from={"path": str(self.point.path), "global_step": step,
                                   "sha256": file_sha256(self.point.path)})  # fmt: skip

    def restore(self, state: TrainerState, record: rec.RunRecord, *, device: torch.device,
                container: dict, **_: Any) -> None:  # fmt: skip
        state.load_state_dict(self.point.state)
        record.update(imported_code=provenance.imported_code())
        record_extension(record, self.point, container, device)
        resume.rewrite_history(record.run_dir, state)
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

    def device(self, record: rec.RunRecord, requested: str, allow_change: bool,
               local_rank: int | None) -> torch.device:  # fmt: skip
        """The device the run started on, not a fresh ``auto``."""
        recorded = devices.recorded_device(record.data)
        return devices.resolve_for_resume(recorded, requested, allow_change, local_rank=local_rank)

    def check_world_size(self, reduction: Reduction, allow_change: bool) -> None:
        """Another world size: the reduction says whether it may."""
        saved = self.point.state["env"]["world_size"]
        refused = reduction.resume_check(saved, allow_change)
        if refused is not None:
            raise ResumeError(refused)
        if saved != reduction.world_size:
            log.info("world size %d -> %d", saved, reduction.world_size)

    def write_identity(self, record: rec.RunRecord, device: torch.device, **facts: Any) -> None:
        """The run keeps the identity it started with."""

    def record_data(self, record: rec.RunRecord, fingerprint: dict) -> None:
        """The start's stays recorded; this resume's is compared with it in ``restore``."""
        self.data_now = fingerprint

    def restore(self, state: TrainerState, record: rec.RunRecord, *, container: dict,
                device: torch.device, **run: Any) -> None:  # fmt: skip
        """Replay, load, audit and record (``resume.restore``); then the config that runs."""
        now = {**provenance.code_now(), "data_fingerprint": self.data_now}
        resume.restore(self.point, state, record, now, container=container, **run)
        record_extension(record, self.point, container, device)


Start = Fresh | Resume | Fork


def begin(resume_cfg: str | None, run_dir: Path, container: dict) -> Start:
    """The one decision: a fresh run, a resume of this run, or a fork of another's."""
    point = resume.find_resume_point(resume_cfg, run_dir, container)
    if point is None:
        return Fresh()
    return Fork(point) if point.forked else Resume(point)


def record_extension(record: rec.RunRecord, point: ResumePoint, container: dict,
                     device: torch.device) -> None:  # fmt: skip
    """An extended ``trainer.epochs`` enters ``extended_from`` and so ``config_sha256``."""
    extended = list(record.data.get("extended_from") or [])
    before, step = point.state["config"]["trainer"]["epochs"], point.state["loop"]["global_step"]
    if before != container["trainer"]["epochs"]:
        extended.append({"trainer.epochs": before, "global_step": step})
        record.update(extended_from=extended)
    record.update(config_sha256=config_sha256(container, extended or None))
    record.update(experiment_id=provenance.experiment_id(record.data, device))


@dataclass
class Run:
    """The run as started: what the build, the loop and the restore read."""

    kind: Fresh | Resume | Fork
    record: rec.RunRecord
    settings: TrainerSettings  # ``trainer.*`` by concern, frozen, built once here
    container: dict  # the resolved config, ``oc.env`` values as their text
    seeds: Seeds
    device: torch.device
    env: dict
    level: str  # the determinism level in force
    reduction: Reduction
    microbatches: int  # per optimizer step
    dist: Dist
    stop: StopFlag

    @property
    def run_dir(self) -> Path:
        return self.record.run_dir

    def restore(self, state: TrainerState, trainer: Any, saver: Any) -> None:
        """Fresh: record the initial weights; Resume: ``reprotrain.resume.restore``."""
        self.kind.restore(state, self.record, env=self.env, device=self.device, dist=self.dist,
                          container=self.container, replay_state=trainer.replay_state,
                          continuation=trainer.continuation)  # fmt: skip
        saver.meta["config_sha256"] = self.record["config_sha256"]  # a resume's extension


def start(cfg: DictConfig, run_dir: Path, dist: Dist) -> Run:
    """Validate (the batch layout against this job's world size: a submitit job exports
    ``WORLD_SIZE`` only once its tasks start), decide the kind once, open the record, then
    the controls (determinism, seeds, device) and the identity, in that order."""
    validate(cfg, dist.world_size)
    container, env_values = secrets.redact(cfg)
    kind = begin(cfg.resume, run_dir, container)  # Fresh | Resume | Fork, decided once
    log.info("run dir: %s", run_dir)  # after the refusals: a refused resume writes nothing
    record = kind.open_record(run_dir)
    provenance.open_run(record, container, env_values)
    stop = StopFlag()  # the signal handlers, from here on
    settings = TrainerSettings.from_config(cfg.trainer)  # each part goes to what reads it
    repro = cfg.repro
    flags = determinism.apply(repro.level, repro.num_threads, repro.fill_uninitialized_memory,
                              settings.step.precision)  # fmt: skip
    seeds = kind.seeds(cfg.seed)
    device = kind.device(record, settings.run.device, settings.run.allow_device_change,
                         dist.local_rank if dist.enabled else None)  # fmt: skip
    env = environment.capture(device)
    reduction = for_run(settings.reduction, dist)
    kind.check_world_size(reduction, settings.reduction.allow_world_size_change)
    name = OmegaConf.to_container(cfg, resolve=False)["name"]  # an oc.env stays text
    kind.write_identity(record, device, seeds=seeds, flags=flags, env=env, name=name,
                        require_locked_env=repro.require_locked_env,
                        include_untracked=list(cfg.include_untracked))  # fmt: skip
    k = microbatches_per_step(settings.pipeline.batch_size, settings.step.microbatch_size)
    provenance.layout(record, dist, device, reduction, k)
    log.info("experiment %s | repro=%s | seeds %s | device %s | world size %d",
             record["experiment_id"], flags["level"], seeds.as_dict(), device,
             dist.world_size)  # fmt: skip
    log.info("%s", start_banner(container, task_overrides(), run_dir / rec.RESOLVED_CONFIG))
    return Run(kind, record, settings, container, seeds, device, env, flags["level"],
               reduction, k, dist, stop)  # fmt: skip
