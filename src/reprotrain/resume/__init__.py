"""Resuming a run: :func:`find_resume_point` decides (``guard.py``), :func:`restore` replays
(``replay.py``), loads, audits (``audit.py``), guards and records. Closes: a resume that
drifts silently, and one recorded as bitwise that is not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from reprotrain.distributed import Dist
from reprotrain.repro.checkpoint import Saver
from reprotrain.resume import guard, replay
from reprotrain.resume.continuation import Continuation
from reprotrain.resume.guard import AlreadyCompleted, ResumePoint, find_resume_point
from reprotrain.run import record as rec
from reprotrain.state import TrainerState


class HoldsState(Protocol):
    state: TrainerState


class Resumable(Protocol):
    """What the resume's round trip uses of the Trainer (``loop.Trainer``, a floor above:
    typed here by what it offers, not imported)."""

    runner: HoldsState
    dist: Dist
    saver: Saver
    continuation: Continuation
    replay_state: Callable[..., dict | None]


log = logging.getLogger("reprotrain")

__all__ = ["AlreadyCompleted", "Resumable", "ResumePoint", "find_resume_point", "restore"]
__all__ += ["rewrite_history"]


def restore(point: ResumePoint, run: Any, trainer: Resumable, now: dict) -> None:
    """Replay up to ``point`` with ``trainer``, load, audit, guard, record; ``run``: the
    ``start.Run`` (record, env, config); ``now``: this process's inputs."""
    state, record, env, container = trainer.runner.state, run.record, run.env, run.container
    verified = replay.verify(point, state, record, container, trainer.dist, trainer.replay_state)
    state.load_state_dict(point.state)  # after a verified replay: the same bits
    # What the checkpoint could not restore, named first (the audit's paths: the cause a
    # refusal names), then the replay's difference (its effect).
    unrestored = state.audit.unrestored()
    unrestored += [verified["line"]] if verified.get("identical") is False else []
    purity = record.data.get("sample_purity") or {}
    if purity.get("pure") is False:  # found at this run's start (data/purity.py)
        unrestored.append(f"samples are not a pure function of their key ({purity['reason']})")
    inputs = guard.input_differences(record.data, now)  # the suspects a refusal names
    guard.check_unrestored(point, unrestored, container, inputs)
    rewrite_history(record.run_dir, state)
    entry = guard.resume_entry(point, env, container, unrestored, inputs, now, verified)
    compared = state.audit.compared  # None: the checkpoint holds no state digests
    entry["state_paths_compared"] = sum((compared or {}).values())
    entry["state_compared"] = compared or {}
    entry["state_not_compared"] = list(state.audit.not_compared)
    if compared is None:  # nothing compared is no evidence: never bitwise
        entry["state_not_compared"].insert(0, "all of it: the checkpoint holds no state digests")
        entry["bitwise_guarantee"] = False
    continuation = trainer.continuation
    continuation.load(point.state["loop"]["global_step"])
    why_not = not_comparable(point, container, env)
    entry["continuation"] = continuation.entry(entry["bitwise_guarantee"], why_not)
    # The bits are claimed only once the continuation it logged is compared too.
    entry["bitwise_guarantee"] &= continuation.steps is None
    record.update(resumes=[*record.data.get("resumes", []), entry])
    loop = state.loop
    log.info("resumed from %s at epoch %d step %d", point.path.name, loop.epoch, loop.epoch_step)


def not_comparable(point: ResumePoint, container: dict, env: dict) -> str | None:
    """Why the steps logged after the checkpoint are not this resume's to compare, or None."""
    if point.extends(container):
        grown = f"{point.epochs} -> {container['trainer']['epochs']}"
        extends = f"this resume extends trainer.epochs ({grown}), so the steps after"
        return f"not compared: {extends} the checkpoint run under another schedule"
    saved, world = point.state["env"]["world_size"], env["world_size"]
    if saved != world:
        return f"not compared: the world size changed ({saved} -> {world})"
    return None


def rewrite_history(run_dir: Path, state: Any) -> None:
    """metrics.jsonl and the fingerprints as the checkpoint has them (a kill may leave more)."""
    rec.write_jsonl(run_dir / rec.METRICS, state.loop.metrics)
    rec.write_jsonl(run_dir / rec.FINGERPRINTS, state.loop.fingerprints)
