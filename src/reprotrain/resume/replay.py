"""A resume proves its bits by replay: re-run the interval before the checkpoint, compare.

Before a resume continues from checkpoint k, the run goes back to the checkpoint before k
(or to its own start when k is the first), re-runs the steps up to k as the run did, and
compares the whole state it reaches with what k holds, bit for bit: model, optimizer,
scheduler, GradScaler, loop position and history, the epoch's partial sums, the RNG states,
the task's, the step's and the callbacks' ``state_dict()`` (the resume audit's digests are
compared after the restore, ``audit.py``). Only an identical
state lets the resume record ``bitwise_guarantee: true``; a difference is named by its first
entry (``model.fc.weight: 12 of 640 elements differ``).

Why a replay and not a list: user objects keep state everywhere (a non-persistent buffer, a
private counter, a closure in a scheduler, a dataset's own generator in a loader worker).
No inventory of it is complete; re-executing and comparing needs none. A replay from the
run's start rebuilds every such state exactly, so the resumed run continues with it; a
replay from an earlier checkpoint starts from the state that checkpoint could restore, so
state it could not restore shows up as a difference at k.

:func:`first_difference` is the one comparison of two checkpoint states: the resume's
replay, ``make verify KILL=1`` and ``make drill`` all use it.

Closes: a resume recorded as bitwise with other weights. The claim is a comparison, with its
evidence (``verified: steps 40..60 replayed from step-00000040.pt, identical``) in run.json.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import torch

from reprotrain.errors import CheckpointError
from reprotrain.repro import checkpoint

# Checkpoint entries that are not state: what the run was started with (compared by the
# resume guard: config, seeds, environment) and the file format.
META = frozenset({"format_version", "config", "config_sha256", "seeds", "env"})
# The loop's metric rows hold wall-clock measurements beside the numbers.
TIMINGS = frozenset({"seconds", "images_per_s"})


def position(state: dict[str, Any]) -> tuple[int, int]:
    """A checkpoint's place in the loop: ``(epoch, epoch_step)`` of its next step."""
    loop = state["loop"]
    return loop["epoch"], loop.get("epoch_step", loop.get("step"))


def first_difference(saved: dict[str, Any], replayed: dict[str, Any]) -> str | None:
    """The first entry in which two checkpoint states differ bit for bit, as one line
    (``optimizer.state.3.momentum_buffer: 7 of 64 elements differ (max |a-b| 2.4e-07)``);
    None when every entry is identical. Tensors compare by dtype, shape and bytes (NaN equals
    NaN with the same bits), floats by their IEEE bits, everything else by value."""
    a = {k: v for k, v in saved.items() if k not in META}
    b = {k: v for k, v in replayed.items() if k not in META}
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
        return (
            f"{where}: {a.dtype} {list(a.shape)} in the checkpoint, "
            f"{b.dtype} {list(b.shape)} in the replay"
        )
    x, y = _bytes(a), _bytes(b)
    if torch.equal(x, y):
        return None
    if a.is_floating_point() and a.numel():
        differ = (x.reshape(a.numel(), -1) != y.reshape(a.numel(), -1)).any(dim=1).sum().item()
        gap = (a.detach().cpu().double() - b.detach().cpu().double()).abs().nan_to_num(nan=0.0)
        return (
            f"{where}: {differ} of {a.numel()} elements differ (max |a-b| {gap.max().item():.3g})"
        )
    return f"{where}: {list(a.shape)} {a.dtype} values differ"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (a flat uint8 view on the CPU)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{type(value).__name__} ({text[:40]}...)"


def replay_start(
    point_path: Path, point_state: dict[str, Any], ckpt_dir: Path
) -> tuple[Path, dict[str, Any]] | None:
    """Where a replay of ``point_state`` starts: the newest of the run's own step
    checkpoints before it that loads (same seeds); None: the run's own start."""
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


def verdict(start: str, first: int, last: int, difference: str | None) -> str:
    """The record's one line of evidence for a replay."""
    steps = f"steps {first}..{last} replayed from {start}"
    return f"{steps}, identical" if difference is None else f"{steps}, differ: {difference}"


__all__ = ["first_difference", "position", "replay_start", "verdict"]
