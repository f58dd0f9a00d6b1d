"""The run's start: validated config, the kind of start (``kinds.py``), record and identity
(``provenance.py``), controls and layout, decided once into the :class:`Run` later stages read.

Closes: determinism, seeds and threads set before anything is built; the config's identity
(``config_sha256``, ``oc.env`` values as digests) written before the first step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from reprotrain.config import TrainerSettings, microbatches_per_step, validate
from reprotrain.config_view import start_banner, task_overrides
from reprotrain.distributed import Dist
from reprotrain.loop import StopFlag
from reprotrain.reduction import Reduction, for_run
from reprotrain.repro import determinism, environment, secrets
from reprotrain.repro.seeding import Seeds
from reprotrain.run import record as rec
from reprotrain.start import provenance
from reprotrain.start.kinds import Fork, Fresh, Resume, begin
from reprotrain.state import TrainerState

log = logging.getLogger("reprotrain")


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
        self.kind.restore(state, self.record, env=self.env, device=self.device,
                          container=self.container, dist=self.dist,
                          replay_state=trainer.replay_state,
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
    stop = StopFlag()
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
    kind.write_identity(
        record, device, seeds=seeds, flags=flags, env=env,
        require_locked_env=repro.require_locked_env,
        name=OmegaConf.to_container(cfg, resolve=False)["name"],  # an oc.env stays text
        include_untracked=list(cfg.include_untracked),
    )  # fmt: skip
    k = microbatches_per_step(settings.pipeline.batch_size, settings.step.microbatch_size)
    provenance.layout(record, dist, device, reduction, k)
    log.info("experiment %s | repro=%s | seeds %s | device %s | world size %d",
             record["experiment_id"], flags["level"], seeds.as_dict(), device,
             dist.world_size)  # fmt: skip
    log.info("%s", start_banner(container, task_overrides(), run_dir / rec.RESOLVED_CONFIG))
    return Run(kind, record, settings, container, seeds, device, env, flags["level"],
               reduction, k, dist, stop)  # fmt: skip
