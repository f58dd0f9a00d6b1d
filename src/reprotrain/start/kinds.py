"""How a run starts, decided once from ``resume`` and the run directory (``begin``):

=========  ===============  ======================  ===============  ===================
start      record           seeds                   device           state
=========  ===============  ======================  ===============  ===================
Fresh      new identity     from ``seed``           as configured    initial weights
Resume     the run's own    the checkpoint's        the recorded     checkpoint, audited
Fork       new, + parent    the checkpoint's        as configured    checkpoint
=========  ===============  ======================  ===============  ===================

Only ``Resume`` checks the world size, appends to the record's ``resumes`` and proves itself
by replay (``resume/replay.py``; docs/resume.md). Closes: a resume that silently starts
over, or a fork that passes for a resume.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from reprotrain.config import config_sha256
from reprotrain.errors import ResumeError
from reprotrain.hashing import file_sha256, state_sha256
from reprotrain.reduction import Reduction
from reprotrain.repro import checkpoint
from reprotrain.repro import device as devices
from reprotrain.repro.seeding import Seeds, resolve_seeds
from reprotrain.resume import replay
from reprotrain.resume.guard import (
    ResumePoint,
    check_unrestored,
    find_resume_point,
    input_differences,
    resume_entry,
)
from reprotrain.run import record as rec
from reprotrain.start.provenance import (
    code_now,
    experiment_id,
    identity,
    imported_code,
    write_environment_text,
)
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
        identity(record, device, **facts)
        write_environment_text(record.run_dir)

    def record_data(self, record: rec.RunRecord, fingerprint: dict) -> None:
        record.update(data_fingerprint=fingerprint)

    def restore(self, state: TrainerState, record: rec.RunRecord, **_: Any) -> None:
        """Nothing to restore: record the initial weights (built from the ``init`` stream)."""
        record.update(initial_weights_sha256=state_sha256(state.model.state_dict()),
                      imported_code=imported_code())  # fmt: skip


@dataclass
class Fork(Fresh):
    """Another run's checkpoint continued in a new directory: a new record naming its
    parent, the parent's seeds and state; the device as this run configures it."""

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
        record.update(imported_code=imported_code())
        record_extension(record, self.point, container, device)
        rewrite_history(record.run_dir, state)
        log.info("forked from %s", self.point.path)


@dataclass
class Resume:
    """This run continued in place from its own checkpoint: its record, seeds and device;
    the world size checked, what the checkpoint could not restore audited, the resume
    appended to the record's history."""

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
        """Another world size: the reduction says whether it may (Exact: any world size
        dividing the micro-batches, which config checks)."""
        saved = (self.point.state.get("env") or {}).get("world_size", 1)
        refused = reduction.resume_check(saved, allow_change)
        if refused is not None:
            raise ResumeError(refused)
        if saved != reduction.world_size:
            log.info("world size %d -> %d", saved, reduction.world_size)

    def write_identity(self, record: rec.RunRecord, device: torch.device, **facts: Any) -> None:
        """The run keeps the identity it started with."""

    def record_data(self, record: rec.RunRecord, fingerprint: dict) -> None:
        """The data the run started with stays recorded; this resume's is compared with it
        in ``restore`` (a changed dataset is never silently re-recorded)."""
        self.data_now = fingerprint

    def restore(self, state: TrainerState, record: rec.RunRecord, *, env: dict,
                device: torch.device, container: dict, dist: Any = None,
                replay_state: Any = None, continuation: Any = None) -> None:  # fmt: skip
        """Replay up to the checkpoint and compare (``verify``), load it, audit, record; what
        the interrupted run logged after it is read into ``continuation`` to compare."""
        verified = self.verify(state, record, container, dist, replay_state)
        state.load_state_dict(self.point.state)  # after a verified replay: the same bits
        # What the checkpoint could not restore, named first (the audit's paths: the cause a
        # refusal names), then the replay's difference (its effect).
        unrestored = state.audit.unrestored()
        unrestored += [verified["line"]] if verified.get("identical") is False else []
        purity = record.data.get("sample_purity") or {}
        if purity.get("pure") is False:  # found at this run's start (data/purity.py)
            unrestored.append(f"samples are not a pure function of their key ({purity['reason']})")
        # What the run reads that changed since it started: the suspects a refusal names.
        code = code_now()
        inputs = input_differences(
            code=(record.data.get("code_sha256"), code),
            imported=(record.data.get("imported_code"), imported_code()),
            data=(record.data.get("data_fingerprint"), self.data_now),
        )
        check_unrestored(self.point, unrestored, container, record.run_dir, inputs)
        rewrite_history(record.run_dir, state)
        entry = resume_entry(self.point, env, device, container, unrestored, inputs=inputs,
                             code_sha256=code, verified=verified)  # fmt: skip
        entry["state_paths_compared"] = state.audit.compared if state.audit else None
        if continuation is not None:
            continuation.load(self.point.state["loop"]["global_step"])
            entry["continuation"] = continuation.entry(
                entry["bitwise_guarantee"], self.not_comparable(container, env)
            )
            # The bits are claimed only once the continuation it logged is compared too.
            entry["bitwise_guarantee"] &= continuation.steps is None
        record.update(resumes=[*record.data.get("resumes", []), entry])
        record_extension(record, self.point, container, device)  # the config that runs
        log.info("resumed from %s at epoch %d step %d", self.point.path.name,
                 state.loop.epoch, state.loop.epoch_step)  # fmt: skip

    def not_comparable(self, container: dict, env: dict) -> str | None:
        """Why the steps the interrupted run logged after its checkpoint are not this
        resume's to compare, or None: a stretched schedule or another world size computes
        them otherwise by design."""
        before = self.point.state["config"]["trainer"]["epochs"]
        if before != container["trainer"]["epochs"]:
            return (f"not compared: this resume extends trainer.epochs ({before} -> "
                    f"{container['trainer']['epochs']}), so the steps after the checkpoint "
                    "run under another schedule")  # fmt: skip
        saved = (self.point.state.get("env") or {}).get("world_size", 1)
        if saved != env.get("world_size", 1):
            return f"not compared: the world size changed ({saved} -> {env.get('world_size', 1)})"
        return None

    def verify(self, state: TrainerState, record: rec.RunRecord, container: dict, dist: Any,
               replay_state: Any) -> dict[str, Any]:  # fmt: skip
        """Restore the checkpoint before this one (or keep the run's start, which ``state``
        is), replay up to this one and compare; the evidence for the record. Every rank
        replays (a collective under DDP); rank 0 compares and its verdict is broadcast."""
        if not (container.get("trainer") or {}).get("verify_resume", True):
            return {"line": "not verified (trainer.verify_resume=false)", "identical": None}
        if replay_state is None:
            return {"line": "not verified (no replay for this entry point)", "identical": None}
        start = self.replay_start(record)
        if isinstance(start, str):
            return {"line": f"not verified ({start})", "identical": None}
        name, begin_state = start
        if begin_state is not None:
            state.load_state_dict(begin_state)
        first = state.loop.global_step + 1
        last = self.point.state["loop"]["global_step"]
        log.info("verifying the resume: replaying steps %d..%d from %s", first, last, name)
        t0 = time.perf_counter()
        # Steps taken before a resume that extends trainer.epochs ran under the old schedule.
        epochs = self.point.state["config"]["trainer"]["epochs"]
        replayed = replay_state(replay.position(self.point.state), epochs=epochs,
                                from_start=begin_state is None)  # fmt: skip
        seconds = time.perf_counter() - t0
        # The audit's digests are compared after the restore, against this process's own
        # construction (``ResumeAudit.unrestored``): the replay may run another schedule.
        difference = (replay.first_difference(_less_audit(self.point.state), _less_audit(replayed))
                      if replayed else None)  # fmt: skip
        if dist is not None:
            difference = dist.broadcast_object(difference)
        line = replay.verdict(name, first, last, difference)
        (log.info if difference is None else log.warning)("resume %s", line)
        return {"line": line, "identical": difference is None, "from": name,
                "first_step": first, "last_step": last, "seconds": round(seconds, 3),
                "first_difference": difference}  # fmt: skip

    def replay_start(self, record: rec.RunRecord) -> tuple[str, dict | None] | str:
        """(name, state) the replay starts from: the checkpoint before this one, else the
        run's start (None: ``state`` as built, or the fork's parent checkpoint); a string
        says why there is none."""
        found = replay.replay_start(self.point.path, self.point.state,
                                    record.run_dir / rec.CHECKPOINTS)  # fmt: skip
        if found is not None:
            return found[0].name, found[1]
        parent = record.data.get("forked_from")
        if parent is None:
            return "the run's start", None
        path = Path(parent["path"])
        if not path.is_file() or file_sha256(path) != parent.get("sha256"):
            return (f"no checkpoint before {self.point.path.name} is kept and the checkpoint "
                    f"the run was forked from ({path}) is gone or changed")  # fmt: skip
        return f"the fork's parent {path.name}", checkpoint.load(path)


Start = Fresh | Resume | Fork


def begin(resume: str | None, run_dir: Path, container: dict) -> Start:
    """The one decision: a fresh run, a resume of this run, or a fork of another's."""
    point = find_resume_point(resume, run_dir, container)
    if point is None:
        return Fresh()
    return Fork(point) if point.forked else Resume(point)


def record_extension(record: rec.RunRecord, point: ResumePoint, container: dict,
                     device: torch.device) -> None:  # fmt: skip
    """A resume (or fork) that extends ``trainer.epochs`` appends ``{"trainer.epochs":
    <before>, "global_step": <where>}`` to ``extended_from``, part of ``config_sha256``: the
    stretched schedule never shares the id of the longer run from scratch."""
    extended = list(record.data.get("extended_from") or [])
    before = point.state["config"]["trainer"]["epochs"]
    if before != container["trainer"]["epochs"]:
        extended.append({"trainer.epochs": before,
                         "global_step": point.state["loop"]["global_step"]})  # fmt: skip
        record.update(extended_from=extended)
    record.update(config_sha256=config_sha256(container, extended or None))
    record.update(experiment_id=experiment_id(record.data, device))


def _less_audit(state: dict) -> dict:
    return {k: v for k, v in state.items() if k != "audit"}


def rewrite_history(run_dir: Path, state: TrainerState) -> None:
    """metrics.jsonl and the fingerprints as the checkpoint has them (the files may have run
    ahead of it: killed after writing them)."""
    rec.write_jsonl(run_dir / rec.METRICS, state.loop.metrics)
    rec.write_jsonl(run_dir / rec.FINGERPRINTS, state.loop.fingerprints)
