"""How a run starts, decided once from ``resume`` and the run directory (``begin``):

=========  ===============  ======================  ===============  ===================
start      record           seeds                   device           state
=========  ===============  ======================  ===============  ===================
Fresh      new identity     from ``seed``           as configured    initial weights
Resume     the run's own    the checkpoint's        the recorded     checkpoint, audited
Fork       new, + parent    the checkpoint's        as configured    checkpoint
=========  ===============  ======================  ===============  ===================

The resume's own logic (the checkpoint, the guards, the replay, the audit) is
``reprotrain.resume``. Closes: a resume that silently starts over, a fork passing for one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from reprotrain import resume
from reprotrain.config import config_sha256
from reprotrain.errors import ResumeError
from reprotrain.hashing import file_sha256, state_sha256
from reprotrain.reduction import Reduction
from reprotrain.repro import device as devices
from reprotrain.repro.seeding import Seeds, resolve_seeds
from reprotrain.resume import ResumePoint
from reprotrain.run import record as rec
from reprotrain.start import provenance
from reprotrain.state import TrainerState

log = logging.getLogger("reprotrain")


class Fresh:
    """A new run in its own directory: a new record, the configured seeds and device."""

    def open_record(self, run_dir: Path) -> rec.RunRecord:
        return rec.RunRecord(run_dir)

    def seeds(self, seed_cfg: Any) -> Seeds:
        """The named streams from ``seed`` (``seed.base`` or entropy, per-stream pins)."""
        return resolve_seeds(seed_cfg)

    def device(self, record: rec.RunRecord, requested: str, allow_change: bool,
               local_rank: int | None) -> torch.device:  # fmt: skip
        return devices.resolve_for_resume(None, requested, allow_change, local_rank=local_rank)

    def check_world_size(self, reduction: Reduction, allow_change: bool) -> None:
        """A new run sets its world size."""

    def write_identity(self, record: rec.RunRecord, device: torch.device, **facts: Any) -> None:
        provenance.identity(record, device, **facts)
        provenance.write_environment_text(record.run_dir)

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
        resume.restore(self.point, state, record, now, container=container, device=device, **run)
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
    """A resume (or fork) that extends ``trainer.epochs`` appends to ``extended_from``, part
    of ``config_sha256``: a stretched schedule never shares the longer run's id."""
    extended = list(record.data.get("extended_from") or [])
    before = point.state["config"]["trainer"]["epochs"]
    if before != container["trainer"]["epochs"]:
        extended.append({"trainer.epochs": before,
                         "global_step": point.state["loop"]["global_step"]})  # fmt: skip
        record.update(extended_from=extended)
    record.update(config_sha256=config_sha256(container, extended or None))
    record.update(experiment_id=provenance.experiment_id(record.data, device))
