"""A resume proves its bits by replay: re-run the interval before the checkpoint, compare
(docs/resume.md). Closes: a resume recorded as bitwise with other weights.
"""

from __future__ import annotations

import logging
import struct
import time
from pathlib import Path
from typing import Any

import torch

from reprotrain.digest import tensor_bytes
from reprotrain.errors import CheckpointError
from reprotrain.hashing import file_sha256
from reprotrain.repro import checkpoint
from reprotrain.resume.guard import ResumePoint
from reprotrain.run.record import CHECKPOINTS, RunRecord

log = logging.getLogger("reprotrain")

# Checkpoint entries that are not state: what the run was started with (compared by the
# resume guard: config, seeds, environment) and the file format.
META = checkpoint.META_KEYS
# The loop's metric rows hold wall-clock measurements beside the numbers.
TIMINGS = frozenset({"seconds", "images_per_s"})


def position(state: dict[str, Any]) -> tuple[int, int]:
    """A checkpoint's place in the loop: ``(epoch, epoch_step)`` of its next step."""
    return state["loop"]["epoch"], state["loop"]["epoch_step"]


def first_difference(saved: dict, replayed: dict, skip: frozenset[str] = META) -> str | None:
    """The first entry in which two states differ bit for bit, as one line; None if none."""
    a = {k: v for k, v in saved.items() if k not in skip}
    b = {k: v for k, v in replayed.items() if k not in skip}
    return _difference(a, b, "")


def _difference(a: Any, b: Any, where: str) -> str | None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return _tensor_difference(a, b, where)
    if isinstance(a, dict) and isinstance(b, dict):
        skip = TIMINGS if where.startswith("loop.metrics.") else frozenset()
        for key in [*a, *(k for k in b if k not in a)]:
            if key in skip:
                continue
            name = f"{where}.{key}" if where else str(key)
            if key not in b:
                return f"{name}: in the checkpoint, not in the replay"
            if key not in a:
                return f"{name}: in the replay, not in the checkpoint"
            if (found := _difference(a[key], b[key], name)) is not None:
                return found
        return None
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return f"{where}: {len(a)} items in the checkpoint, {len(b)} in the replay"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if (found := _difference(x, y, f"{where}.{i}")) is not None:
                return found
        return None
    if isinstance(a, float) and isinstance(b, float):
        same = struct.pack("<d", a) == struct.pack("<d", b)
    else:
        same = type(a) is type(b) and a == b
    return None if same else f"{where}: {_shown(a)} in the checkpoint, {_shown(b)} in the replay"


def _tensor_difference(a: Any, b: Any, where: str) -> str | None:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return f"{where}: {_shown(a)} in the checkpoint, {_shown(b)} in the replay"
    if a.dtype != b.dtype or a.shape != b.shape:
        shapes = f"{a.dtype} {list(a.shape)} in the checkpoint, {b.dtype} {list(b.shape)}"
        return f"{where}: {shapes} in the replay"
    x, y = tensor_bytes(a), tensor_bytes(b)
    if torch.equal(x, y):
        return None
    if a.is_floating_point() and a.numel():
        differ = (x.reshape(a.numel(), -1) != y.reshape(a.numel(), -1)).any(dim=1).sum().item()
        gap = (a.detach().cpu().double() - b.detach().cpu().double()).abs().nan_to_num(nan=0.0)
        most = gap.max().item()
        return f"{where}: {differ} of {a.numel()} elements differ (max |a-b| {most:.3g})"
    return f"{where}: {list(a.shape)} {a.dtype} values differ"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{type(value).__name__} ({text[:40]}...)"


def replay_start(
    point_path: Path, point_state: dict[str, Any], ckpt_dir: Path
) -> tuple[Path, dict[str, Any]] | None:
    """The newest own step checkpoint before ``point_state`` that loads; None: the start."""
    target, seeds = position(point_state), point_state.get("seeds")
    for path in reversed(checkpoint.list_step_checkpoints(ckpt_dir)):
        if path.resolve() == Path(point_path).resolve():
            continue
        try:
            state = checkpoint.load(path)
        except CheckpointError:
            continue  # a damaged older checkpoint: replay from further back
        if state.get("seeds") == seeds and position(state) < target:
            return path, state
    return None


def start_of(point: ResumePoint, record: RunRecord) -> tuple[str, dict | None] | str:
    """(name, state) a replay starts from (state None: as built); a string says why none."""
    found = replay_start(point.path, point.state, record.run_dir / CHECKPOINTS)
    if found is not None:
        return found[0].name, found[1]
    parent = record.data.get("forked_from")
    if parent is None:
        return "the run's start", None
    path = Path(parent["path"])
    if not path.is_file() or file_sha256(path) != parent.get("sha256"):
        gone = f"the checkpoint the run was forked from ({path}) is gone or changed"
        return f"no checkpoint before {point.path.name} is kept and {gone}"
    return f"the fork's parent {path.name}", checkpoint.load(path)


def verify(
    point: ResumePoint, state: Any, record: RunRecord, container: dict, dist: Any, replay_state: Any
) -> dict[str, Any]:
    """Replay up to ``point`` and compare: the record's evidence (rank 0's verdict, broadcast)."""
    if not (container.get("trainer") or {}).get("verify_resume", True):
        return {"line": "not verified (trainer.verify_resume=false)", "identical": None}
    if replay_state is None:
        return {"line": "not verified (no replay for this entry point)", "identical": None}
    start = start_of(point, record)
    if isinstance(start, str):
        return {"line": f"not verified ({start})", "identical": None}
    name, begin_state = start
    if begin_state is not None:
        state.load_state_dict(begin_state)
    first, last = state.loop.global_step + 1, point.state["loop"]["global_step"]
    log.info("verifying the resume: replaying steps %d..%d from %s", first, last, name)
    t0 = time.perf_counter()
    # Steps taken before a resume that extends trainer.epochs ran under the old schedule.
    replayed = replay_state(
        position(point.state), epochs=point.epochs, from_start=begin_state is None
    )
    seconds = time.perf_counter() - t0
    # The audit's digests are compared after the restore (``ResumeAudit.unrestored``),
    # against this process's construction: the replay may run another schedule.
    difference = first_difference(point.state, replayed, META | {"audit"}) if replayed else None
    if dist is not None:
        difference = dist.broadcast_object(difference)
    line = verdict(name, first, last, difference)
    (log.info if difference is None else log.warning)("resume %s", line)
    found = {"line": line, "identical": difference is None, "from": name, "first_step": first}
    return found | {"last_step": last, "seconds": round(seconds, 3), "first_difference": difference}


def verdict(start: str, first: int, last: int, difference: str | None) -> str:
    """The record's one line of evidence for a replay."""
    steps = f"steps {first}..{last} replayed from {start}"
    return f"{steps}, identical" if difference is None else f"{steps}, differ: {difference}"
