"""Choosing the checkpoint to resume from, and refusing a resume that would silently drift.

Closes: resume drift from a changed config (refused, naming the differing keys; only
extending ``trainer.epochs`` and options that do not touch the numbers are allowed), from a
corrupt or truncated newest checkpoint (``resume=auto`` falls back to the previous valid
one and says so), and from a different torch / device type / world size (allowed with a
warning, recorded in run.json, since bitwise equality is then no longer promised).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from reprotrain.config import flatten, is_identity
from reprotrain.errors import CheckpointError, ResumeError
from reprotrain.repro import checkpoint, comparability
from reprotrain.repro.record import CHECKPOINTS, now_iso

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
    checkpoint.remove_partial_writes(run_dir / CHECKPOINTS)
    if resume == "auto":
        path, state, skipped = checkpoint.latest_valid(run_dir / CHECKPOINTS)
        for reason in skipped:
            log.warning("%s; falling back to the previous checkpoint", reason)
        if path is None:
            if skipped:
                raise CheckpointError(f"no valid checkpoint in {run_dir / CHECKPOINTS}")
            return None
        point = ResumePoint(path, state, skipped)
    else:
        path = Path(resume)
        point = ResumePoint(path, checkpoint.load(path))
    _check_config(point, current)
    return point


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


def resume_entry(point: ResumePoint, env: dict, device: torch.device) -> dict[str, Any]:
    """The run.json history line for this resume, with any lost bitwise guarantee."""
    mismatch = comparability.differences(point.state["env"], env)
    if mismatch:
        msg = (
            f"checkpoint written with different {'; '.join(mismatch)}: bitwise equality "
            "with an uninterrupted run is no longer guaranteed"
        )
        log.warning(msg)
    return {
        "at": now_iso(),
        "checkpoint": point.path.name,
        "epoch": point.state["loop"]["epoch"],
        "step": point.state["loop"]["step"],
        "global_step": point.state["loop"]["global_step"],
        "skipped_checkpoints": point.skipped,
        "environment": {
            k: env[k] for k in ("python", "torch", "cuda", "cudnn", "device", "num_threads")
        },
        "bitwise_guarantee": not mismatch,
        "mismatch": mismatch,
    }
