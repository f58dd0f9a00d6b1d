"""The checkpoint to resume from, and the refusals and records of one that would drift.
Closes: resume drift (config, checkpoint, environment, code, data; docs/resume.md).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reprotrain.config import is_identity
from reprotrain.errors import CheckpointError, ReprotrainError, ResumeError
from reprotrain.quoting import flatten, hydra_override
from reprotrain.repro import checkpoint, comparability, levels
from reprotrain.run import record as rec

log = logging.getLogger("reprotrain")

# Options that change how the run executes, not its numbers (trainer.epochs may only grow).
MAY_DIFFER = ("trainer.num_workers", "trainer.checkpoint_every_steps", "trainer.keep_checkpoints")
FORK_KEEPS = "a fork continues its parent's config (only trainer.epochs may be extended)"
RECORDED_ENV = ("python", "torch", "cuda", "cudnn", "device", "num_threads")  # in each resume


@dataclass
class ResumePoint:
    path: Path
    state: dict[str, Any]
    skipped: list[str] = field(default_factory=list)
    forked: bool = False  # a checkpoint of another run: this run dir starts a new record
    # run.json and the resolved config before this resume wrote: a refusal puts them back.
    files_before: dict[Path, bytes | None] = field(default_factory=dict)

    @property
    def epochs(self) -> int:
        """The ``trainer.epochs`` the checkpoint's steps ran under (their schedule's length)."""
        return self.state["config"]["trainer"]["epochs"]

    def extends(self, container: dict) -> bool:
        """Whether this resume runs under another ``trainer.epochs`` than the checkpoint's
        (never below the epochs done: ``_check_config``): the one home of that decision."""
        return self.epochs != container["trainer"]["epochs"]


class AlreadyCompleted(ResumeError):
    """Nothing to resume: the run finished its schedule. Not an error (exit 0)."""

    exit_code = 0


def config_differences(recorded: dict, current: dict) -> list[str]:
    return list(_config_changes(recorded, current))


def _config_changes(recorded: dict, current: dict) -> dict[str, tuple[Any, Any]]:
    """``{key: (recorded, current)}`` of each identity key that differs and may not."""
    a, b = flatten(recorded), flatten(current)
    allowed = (*MAY_DIFFER, "trainer.epochs")
    keys = [k for k in sorted(set(a) | set(b)) if is_identity(k) and k not in allowed]
    return {k: (a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)}


def find_resume_point(resume: str | None, run_dir: Path, current: dict) -> ResumePoint | None:
    """None for a fresh start; else the checkpoint to continue from, after the guards."""
    if resume is None:
        return None
    record, ckpts = _recorded(run_dir), run_dir / rec.CHECKPOINTS
    if resume == "auto":
        path, state, skipped = checkpoint.latest_valid(ckpts)
        for reason in skipped:
            log.warning("%s; falling back to the previous checkpoint", reason)
        if path is None:
            if skipped:
                raise CheckpointError(f"no valid checkpoint in {ckpts}")
            _refuse_fresh_start_over(run_dir, record)
            return None
        if record is None:
            fork = "fork one into a new run dir with resume=<path to a checkpoint>"
            raise ResumeError(f"{run_dir} has checkpoints but no run.json; {fork}")
        point = ResumePoint(path, state, skipped)
    else:
        path = Path(resume).expanduser().resolve()
        inside = path.parent == ckpts.resolve()
        if not inside and record is not None:
            held = f"{run_dir} already holds a run"
            fix = "fork into a new, empty run dir (hydra.run.dir=<new dir>)"
            raise ResumeError(f"resume={path} belongs to another run, and {held}; {fix}")
        point = ResumePoint(path, checkpoint.load(path), forked=not inside)
    _check_config(point, current)
    files = (run_dir / rec.RUN_JSON, run_dir / rec.RESOLVED_CONFIG)
    point.files_before = {f: f.read_bytes() if f.is_file() else None for f in files}
    completed = not point.forked and record is not None and record.get("status") == "completed"
    if completed:
        refuse_reopening(point, record, run_dir)
    if completed and (why := already_completed(point.state["loop"], current["trainer"])):
        raise AlreadyCompleted(f"{run_dir} is already completed ({why}); nothing to resume")
    if rec.is_writer():
        checkpoint.remove_partial_writes(ckpts)
        note = None if point.forked else checkpoint.reconcile_best(ckpts, point.state["loop"])
        if note:
            log.warning(note)  # a kill between step-N.pt and best.pt
    return point


#: A new stamped run dir holds no record: ``resume=<checkpoint>`` there is a fork.
NO_RUN_DIR = Path(os.devnull)


def resume_before_hydra(resume: str, run_dir: Path | None, redacted: Callable[[], dict]) -> bool:
    """Whether ``resume`` continues the run in ``run_dir``: :func:`find_resume_point`, read-only,
    before Hydra writes (a refusal raises; the trainer decides again under the run's lock)."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        current = redacted()
    except OmegaConfBaseException:  # a value only Hydra's runtime resolves: the trainer decides
        return False
    writer, was_disabled = rec.is_writer(), log.disabled
    log.disabled = True  # the trainer logs its own notes
    rec.set_writer(False)  # read only: no partial write removed, no best.pt re-derived
    try:
        point = find_resume_point(resume, run_dir or NO_RUN_DIR, current)
    finally:
        rec.set_writer(writer)
        log.disabled = was_disabled
    return point is not None and not point.forked


def refuse_reopening(point: ResumePoint, record: dict, run_dir: Path) -> None:
    """A completed run continues only from the checkpoint it ended with, never an older one."""
    loop = point.state["loop"]
    ended = _epochs_done(record, run_dir)
    if loop["epoch_step"] == 0 and loop["epoch"] - 1 == ended:
        return
    raise ResumeError(
        f"{run_dir} is a completed run ({ended} epoch(s)) and {point.path.name} is not the "
        f"checkpoint it ended with (it is at epoch {loop['epoch']} step "
        f"{loop['epoch_step']}); a completed run is never reopened: "
        f"fork it into a new directory with {hydra_override('resume', point.path)} "
        "hydra.run.dir=<new dir>"
    )


def already_completed(loop: dict, trainer: dict) -> str | None:
    """Why a completed run has nothing left to run under ``trainer``, or None (it asks more)."""
    done = loop["epoch"] - 1
    if loop.get("early_stopped"):
        return f"early stopping ended it after epoch {done}"
    epochs, stop = trainer["epochs"], trainer.get("stop_after_epoch")
    if (min(epochs, stop) if stop else epochs) > done:
        return None
    why = f", trainer.stop_after_epoch={stop}" if stop and done < epochs else ""
    return f"{done} of {epochs} epochs done{why}"


def _recorded(run_dir: Path) -> dict | None:
    path = run_dir / rec.RUN_JSON
    if not path.is_file():
        return None
    try:
        return rec.parse_json_object(rec.read_text(path), str(path))  # bounded
    except ReprotrainError as e:
        raise ResumeError(f"{path} is unreadable ({e}); it cannot be resumed") from None


def _epochs_done(record: dict, run_dir: Path) -> int:
    return record.get("epochs_completed") or len(rec.read_jsonl(run_dir / rec.METRICS))


def _refuse_fresh_start_over(run_dir: Path, record: dict | None) -> None:
    """resume=auto without a checkpoint: fresh only if nothing was recorded yet."""
    if record is None:
        return
    done = _epochs_done(record, run_dir)
    if record.get("status") == "completed" or done:
        where = f"no checkpoint in {run_dir / rec.CHECKPOINTS} to resume from"
        why = f"the run already recorded {done or 'its'} epoch(s)"
        raise ResumeError(f"{where}, and {why}; start a new run in a new directory")


def _check_config(point: ResumePoint, current: dict) -> None:
    if diffs := _config_changes(point.state["config"], current):
        shown = ", ".join(f"{k} ({was!r} -> {now!r})" for k, (was, now) in diffs.items())
        differs = f"config differs from the recorded one in {shown}"
        if point.forked:  # docs/resume.md: a fork continues its parent's config
            fix = f"{FORK_KEEPS}; to train with another config, start a new run"
            raise ResumeError(f"refusing to fork {point.path}: {differs}; {fix}")
        fix = "start a new run instead (only trainer.epochs may be extended)"
        raise ResumeError(f"refusing to resume {point.path}: {differs}; {fix}")
    done, epochs = point.state["loop"]["epoch"] - 1, current["trainer"]["epochs"]
    if epochs < done:
        completed = f"the {done} epochs already completed in {point.path}"
        raise ResumeError(f"trainer.epochs={epochs} is below {completed}")


def _changes(recorded: dict, current: dict) -> dict[str, dict[str, Any]]:
    """``{key: {"from", "to"}}`` this resume changed (where-to-look keys left out)."""
    a, b = flatten(recorded), flatten(current)
    skip = ("resume", "dataset.root", "trainer.progress", "trainer.stop_at_global_step")
    keys = [k for k in sorted(set(a) | set(b)) if k not in skip and not k.startswith("logger.")]
    return {k: {"from": a.get(k), "to": b.get(k)} for k in keys if a.get(k) != b.get(k)}


def check_unrestored(
    point: ResumePoint, unrestored: list[str], current: dict, inputs: list[str]
) -> None:
    """A resume that cannot be bitwise is refused (run.json put back) where the level says
    so (strict, portable), else warned and recorded."""
    if not unrestored:
        return
    for line in unrestored:
        log.warning(line)
    trainer = current.get("trainer") or {}
    chosen = levels.level(current["repro"]["level"])
    if not chosen.refuses_unrestorable_resume or trainer.get("allow_unrestored_state"):
        return
    if rec.is_writer():
        for path, data in point.files_before.items():
            if data is not None:
                rec.atomic_write_bytes(path, data)
    more = f" (and {len(unrestored) - 1} more)" if len(unrestored) > 1 else ""
    fix = "give the object state_dict()/load_state_dict() that cover it"
    if inputs:
        fix = f"what the run reads changed since it started ({'; '.join(inputs)}): put it back"
    raise ResumeError(
        f"refusing to resume {point.path.name} under repro={chosen.name}: {unrestored[0]}{more}; "
        f"{fix}, or pass trainer.allow_unrestored_state=true (recorded as not bitwise)"
    )


def resume_entry(point: ResumePoint, env: dict, current: dict, unrestored: list[str],
                 inputs: list[str], now: dict, verified: dict) -> dict:  # fmt: skip
    """The run.json history line for this resume, with whether it keeps the bits."""
    invariant = bool((point.state["config"].get("trainer") or {}).get("world_size_invariant"))
    mismatch = comparability.differences(point.state["env"], env, invariant) + inputs
    if mismatch:
        lost = "bitwise equality with an uninterrupted run is no longer guaranteed"
        log.warning("checkpoint written with different %s: %s", "; ".join(mismatch), lost)
    loop = point.state["loop"]
    return {
        "at": rec.now_iso(),
        "overrides": _changes(point.state["config"], current),
        "checkpoint": point.path.name,
        "epoch": loop["epoch"],
        "step": loop["epoch_step"],
        "global_step": loop["global_step"],
        "skipped_checkpoints": point.skipped,
        "environment": {k: env[k] for k in RECORDED_ENV},
        "code_sha256": now["code_sha256"],
        "bitwise_guarantee": not mismatch and not unrestored and bool(verified.get("identical")),
        "verified": verified["line"],
        "replay": {k: v for k, v in verified.items() if k != "line"},
        "mismatch": mismatch,
        "unrestored": unrestored,
        "audited": "audit" in point.state,
    }


def input_differences(start: dict, now: dict) -> list[str]:
    """What the run reads (code, imported code, data) that changed since it started."""
    code = code_differences(start.get("code_sha256"), now["code_sha256"])
    imported = imported_differences(start.get("imported_code"), now["imported_code"])
    data = data_differences(start.get("data_fingerprint"), now["data_fingerprint"])
    return code + imported + data


def data_differences(at_start: dict | None, now: dict | None) -> list[str]:
    """The dataset's fingerprint now against the start's, which stays recorded."""
    before, after = (at_start or {}).get("sha256"), (now or {}).get("sha256")
    if before is None:
        return ["data: the run's start recorded no data fingerprint, so its data was not compared"]
    if before != after:
        changed = f"fingerprint sha256 {before[:12]} -> {str(after)[:12]}"
        return [f"data: the dataset changed since the run started ({changed})"]
    return []


def imported_differences(
    at_start: dict | None, now: dict, since: str = "since the run started"
) -> list[str]:
    """Each module from outside the snapshot (``imported_code``) changed, added or gone."""
    if at_start is None:
        unseen = "so modules imported from outside src/ were not compared"
        return [f"code: the run's start recorded no imported_code, {unseen}"]
    changed = sorted(k for k in set(at_start) | set(now) if at_start.get(k) != now.get(k))
    if not changed:
        return []
    shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
    return [f"code: imported from outside src/ and changed {since}: {shown}"]


def code_differences(at_start: str | None, now: str) -> list[str]:
    """The source digest (``code_sha256`` of src/, conf/, the locks...) now against the start's."""
    if at_start is None:
        return ["code: the run's start recorded no code_sha256, so its code was not compared"]
    if at_start != now:
        source = "the source (src/, conf/, pyproject.toml, Makefile, the locks)"
        digest = f"code_sha256 {at_start[:12]} -> {now[:12]}"
        return [f"code: {source} changed since the run started ({digest})"]
    return []
