"""Choosing the checkpoint to resume from, and refusing a resume that would silently drift.

Closes: resume drift from a changed config (refused, naming the differing keys; only
extending ``trainer.epochs`` and options that do not touch the numbers are allowed), from a
corrupt or truncated newest checkpoint (``resume=auto`` falls back to the previous valid
one and says so), and from a different torch / device type / world size (allowed with a
warning, recorded in run.json, since bitwise equality is then no longer promised).

Closes too: a resume recorded as bitwise that cannot be. After the restore, the checkpoint's
digests of what it could not restore are compared (``resume_audit``); a difference is named
in the resume's record (``bitwise_guarantee: false`` with ``unrestored``), and under
``repro=strict`` the resume is refused in one line, leaving run.json and the config as they
were, unless ``trainer.allow_unrestored_state=true``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from reprotrain.config import is_identity
from reprotrain.errors import CheckpointError, ResumeError
from reprotrain.quoting import flatten, hydra_override
from reprotrain.repro import checkpoint, comparability
from reprotrain.run.record import (
    CHECKPOINTS,
    METRICS,
    RESOLVED_CONFIG,
    RUN_JSON,
    atomic_write_bytes,
    now_iso,
    read_jsonl,
)

log = logging.getLogger("reprotrain")

# Allowed to differ on resume: besides the non-identity keys, options that change how the
# run is executed, not its numbers (trainer.epochs is checked separately: it may only grow).
MAY_DIFFER = (
    "trainer.num_workers",
    "trainer.checkpoint_every_steps",
    "trainer.keep_checkpoints",
)


@dataclass
class ResumePoint:
    path: Path
    state: dict[str, Any]
    skipped: list[str] = field(default_factory=list)
    forked: bool = False  # a checkpoint of another run: this run dir starts a new record
    # run.json and the resolved config as they were before this resume wrote anything:
    # a resume refused after the restore puts them back (``refuse_unrestored``).
    files_before: dict[str, bytes | None] = field(default_factory=dict)


class AlreadyCompleted(ResumeError):
    """Nothing to resume: the run finished its schedule. Not an error (exit 0)."""

    exit_code = 0


def config_differences(recorded: dict, current: dict) -> list[str]:
    a, b = flatten(recorded), flatten(current)
    keys = sorted(set(a) | set(b))
    return [
        k
        for k in keys
        if is_identity(k) and k not in MAY_DIFFER and k != "trainer.epochs" and a.get(k) != b.get(k)
    ]


def find_resume_point(resume: str | None, run_dir: Path, current: dict) -> ResumePoint | None:
    """None for a fresh start; else the checkpoint to continue from, after the guards."""
    if resume is None:
        return None
    record = _recorded(run_dir)
    if resume == "auto":
        path, state, skipped = checkpoint.latest_valid(run_dir / CHECKPOINTS)
        for reason in skipped:
            log.warning("%s; falling back to the previous checkpoint", reason)
        if path is None:
            if skipped:
                raise CheckpointError(f"no valid checkpoint in {run_dir / CHECKPOINTS}")
            _refuse_fresh_start_over(run_dir, record)
            return None
        if record is None:
            raise ResumeError(
                f"{run_dir} has checkpoints but no run.json; fork one into a new run dir with "
                f"resume=<path to a checkpoint>"
            )
        point = ResumePoint(path, state, skipped)
    else:
        path = Path(resume).expanduser().resolve()
        inside = path.parent == (run_dir / CHECKPOINTS).resolve()
        if not inside and record is not None:
            raise ResumeError(
                f"resume={path} belongs to another run, and {run_dir} already holds a run; "
                "fork into a new, empty run dir (hydra.run.dir=<new dir>)"
            )
        point = ResumePoint(path, checkpoint.load(path), forked=not inside)
    _check_config(point, current)
    point.files_before = {
        name: (run_dir / name).read_bytes() if (run_dir / name).is_file() else None
        for name in (RUN_JSON, RESOLVED_CONFIG)
    }
    completed = not point.forked and record is not None and record.get("status") == "completed"
    if completed:
        refuse_reopening(point, record, run_dir)
    if completed and (why := already_completed(point.state["loop"], current["trainer"])):
        raise AlreadyCompleted(f"{run_dir} is already completed ({why}); nothing to resume")
    if checkpoint_writer():
        checkpoint.remove_partial_writes(run_dir / CHECKPOINTS)
        if not point.forked and (
            note := checkpoint.reconcile_best(run_dir / CHECKPOINTS, point.state["loop"])
        ):
            log.warning(note)  # a kill between step-N.pt and best.pt  # fmt: skip
    return point


def refuse_reopening(point: ResumePoint, record: dict, run_dir: Path) -> None:
    """A completed run is written once: it continues (``trainer.epochs=<more>``) only from
    the checkpoint it ended with, never from an older one of its own, which would set it
    back to running, cut its metrics.jsonl and drop its best.pt. Refused before anything is
    written; the older checkpoint can seed a fork into a new directory."""
    loop = point.state["loop"]
    ended = record.get("epochs_completed") or len(read_jsonl(run_dir / METRICS))
    if loop.get("epoch_step", loop.get("step")) == 0 and loop["epoch"] - 1 == ended:
        return
    raise ResumeError(
        f"{run_dir} is a completed run ({ended} epoch(s)) and {point.path.name} is not the "
        f"checkpoint it ended with (it is at epoch {loop['epoch']} step "
        f"{loop.get('epoch_step', loop.get('step'))}); a completed run is never reopened: "
        f"fork it into a new directory with {hydra_override('resume', point.path)} "
        "hydra.run.dir=<new dir>"
    )


def already_completed(loop: dict, trainer: dict) -> str | None:
    """Why a completed run's checkpoint has nothing left to run under ``trainer`` (the
    resume's settings), or None when they ask for more. Early stopping ended it for good;
    otherwise it ended at ``trainer.stop_after_epoch`` or ``trainer.epochs``, and only a
    resume that raises the one that stopped it (``trainer.epochs=<more>``,
    ``trainer.stop_after_epoch=0``) continues: a resume never re-trains or re-evaluates what
    finished, nor trains one more epoch past a deliberate stop."""
    done = loop["epoch"] - 1
    if loop.get("early_stopped"):
        return f"early stopping ended it after epoch {done}"
    target = trainer["epochs"]
    if trainer.get("stop_after_epoch"):
        target = min(target, trainer["stop_after_epoch"])
    if target <= done:
        return f"{done} of {trainer['epochs']} epochs done" + (
            f", trainer.stop_after_epoch={trainer['stop_after_epoch']}"
            if trainer.get("stop_after_epoch") and done < trainer["epochs"]
            else ""
        )
    return None


def checkpoint_writer() -> bool:
    from reprotrain.run.record import is_writer

    return is_writer()


def _recorded(run_dir: Path) -> dict | None:
    path = run_dir / RUN_JSON
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise ResumeError(f"{path} is unreadable ({e}); it cannot be resumed") from None


def _refuse_fresh_start_over(run_dir: Path, record: dict | None) -> None:
    """resume=auto without a checkpoint: fresh only if nothing was recorded yet (a requeued
    job that died before its first checkpoint); never over a run that made progress."""
    if record is None:
        return
    done = record.get("epochs_completed") or len(read_jsonl(run_dir / METRICS))
    if record.get("status") == "completed" or done:
        raise ResumeError(
            f"no checkpoint in {run_dir / CHECKPOINTS} to resume from, and the run already "
            f"recorded {done or 'its'} epoch(s); start a new run in a new directory"
        )


def _check_config(point: ResumePoint, current: dict) -> None:
    recorded = point.state["config"]
    diffs = config_differences(recorded, current)
    if diffs:
        a, b = flatten(recorded), flatten(current)
        shown = ", ".join(f"{k} ({a.get(k)!r} -> {b.get(k)!r})" for k in diffs)
        raise ResumeError(
            f"refusing to resume {point.path}: config differs from the recorded one in {shown}; "
            "start a new run instead (only trainer.epochs may be extended)"
        )
    done = point.state["loop"]["epoch"] - 1
    if current["trainer"]["epochs"] < done:
        raise ResumeError(
            f"trainer.epochs={current['trainer']['epochs']} is below the {done} epochs "
            f"already completed in {point.path}"
        )


def _changes(recorded: dict, current: dict) -> dict[str, tuple[Any, Any]]:
    """Config keys whose values this resume changed (where-to-look keys left out)."""
    a, b = flatten(recorded), flatten(current)
    skip = ("resume", "dataset.root", "trainer.progress", "trainer.stop_at_global_step")
    return {
        k: (a.get(k), b.get(k))
        for k in sorted(set(a) | set(b))
        if k not in skip and not k.startswith("logger.") and a.get(k) != b.get(k)
    }


def check_unrestored(
    point: ResumePoint,
    unrestored: list[str],
    current: dict,
    run_dir: Path,
    inputs: list[str] | None = None,
) -> None:
    """Under ``repro=strict`` a resume that cannot be bitwise is refused in one line, with
    run.json and the resolved config put back as they were, unless the user allowed it.
    ``inputs`` (:func:`input_differences`): what the run reads that changed since it
    started; when there is any, the line names it as the likely cause, not the state."""
    if not unrestored:
        return
    for line in unrestored:
        log.warning(line)
    trainer = current.get("trainer") or {}
    strict = (current.get("repro") or {}).get("level") == "strict"
    if not strict or trainer.get("allow_unrestored_state"):
        return
    if checkpoint_writer():
        for name, data in point.files_before.items():
            if data is not None:
                atomic_write_bytes(run_dir / name, data)
    more = f" (and {len(unrestored) - 1} more)" if len(unrestored) > 1 else ""
    fix = (
        f"what the run reads changed since it started ({'; '.join(inputs)}): put it back"
        if inputs
        else "give the object state_dict()/load_state_dict() that cover it"
    )
    raise ResumeError(
        f"refusing to resume {point.path.name} under repro=strict: {unrestored[0]}{more}; "
        f"{fix}, or pass trainer.allow_unrestored_state=true (recorded as not bitwise)"
    )


def resume_entry(
    point: ResumePoint,
    env: dict,
    device: torch.device,
    current: dict,
    unrestored: list[str] | None = None,
    inputs: list[str] | None = None,
    code_sha256: str | None = None,
    verified: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run.json history line for this resume, with any lost bitwise guarantee: an
    environment that differs, or code or data that changed (``mismatch``; ``inputs`` from
    :func:`input_differences`; ``code_sha256``: this process's) or state the checkpoint
    could not restore
    (``unrestored``, from the resume audit; ``audited: false`` for a checkpoint written
    before the audit existed), and the replay's verdict (``verified``: ``start.Resume.verify``;
    without an identical replay the resume is never bitwise)."""
    unrestored = list(unrestored or [])
    verified = verified or {"line": "not verified", "identical": None}
    if "audit" not in point.state:
        unrestored.append(
            f"{point.path.name} was written before the resume audit: state outside the "
            "state_dicts was not checked"
        )
    invariant = bool((point.state["config"].get("trainer") or {}).get("world_size_invariant"))
    mismatch = comparability.differences(point.state["env"], env, invariant) + list(inputs or [])
    if mismatch:
        msg = (
            f"checkpoint written with different {'; '.join(mismatch)}: bitwise equality "
            "with an uninterrupted run is no longer guaranteed"
        )
        log.warning(msg)
    changed = {
        key: {"from": before, "to": after}
        for key, (before, after) in _changes(point.state["config"], current).items()
    }
    return {
        "at": now_iso(),
        "overrides": changed,
        "checkpoint": point.path.name,
        "epoch": point.state["loop"]["epoch"],
        "step": point.state["loop"].get("epoch_step", point.state["loop"].get("step")),
        "global_step": point.state["loop"]["global_step"],
        "skipped_checkpoints": point.skipped,
        "environment": {
            k: env[k] for k in ("python", "torch", "cuda", "cudnn", "device", "num_threads")
        },
        "code_sha256": code_sha256,
        # Only a replay that found the state identical lets a resume claim the bits.
        "bitwise_guarantee": not mismatch and not unrestored and bool(verified.get("identical")),
        "verified": verified["line"],
        "replay": {k: v for k, v in verified.items() if k != "line"},
        "mismatch": mismatch,
        "unrestored": unrestored,
        "audited": "audit" in point.state,
    }


def input_differences(
    code: tuple[str | None, str],
    imported: tuple[dict | None, dict],
    data: tuple[dict | None, dict | None],
) -> list[str]:
    """What a run reads that changed since it started, each as (the start's, now): its
    source (``code_sha256``), modules from outside src/ (``imported_code``) and its data
    (the fingerprint). One line per change; none when all are the same."""
    return [*code_differences(*code), *imported_differences(*imported), *data_differences(*data)]


def data_differences(at_start: dict | None, now: dict | None) -> list[str]:
    """The data this resume trains on against the data the run started with (the dataset's
    fingerprint: sha256 of its files, or of the generation parameters). Image files edited
    between a kill and a resume were silently re-recorded; now the record keeps the start's
    and this line says what changed."""
    before, after = (at_start or {}).get("sha256"), (now or {}).get("sha256")
    if before is None:
        return ["data: the run's start recorded no data fingerprint, so its data was not compared"]
    if before != after:
        return [f"data: the dataset changed since the run started (fingerprint sha256 "
                f"{before[:12]} -> {str(after)[:12]})"]  # fmt: skip
    return []


def imported_differences(
    at_start: dict | None, now: dict, since: str = "since the run started"
) -> list[str]:
    """Modules imported from outside the snapshot paths (``PYTHONPATH``, links) at the run's
    start against this process's (``provenance.imported_code``): each changed, added or gone
    file by name. A resume compares with its own run's start, a reproduce's re-run with the
    archived run (``since="from the archived run's"``)."""
    if at_start is None:
        return ["code: the run's start recorded no imported_code, so modules imported from "
                "outside src/ were not compared"]  # fmt: skip
    changed = sorted(k for k in set(at_start) | set(now) if at_start.get(k) != now.get(k))
    if not changed:
        return []
    shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
    return [f"code: imported from outside src/ and changed {since}: {shown}"]


def code_differences(at_start: str | None, now: str) -> list[str]:
    """The code this resume runs against the code the run started with (``code_sha256`` of
    the snapshot paths: src/, conf/, the locks...). A run started before the digest was
    recorded cannot be compared, and its line says so instead of promising the bits."""
    if at_start is None:
        return ["code: the run's start recorded no code_sha256, so its code was not compared"]
    if at_start != now:
        return [f"code: the source (src/, conf/, pyproject.toml, Makefile, the locks) changed "
                f"since the run started (code_sha256 {at_start[:12]} -> {now[:12]})"]  # fmt: skip
    return []
