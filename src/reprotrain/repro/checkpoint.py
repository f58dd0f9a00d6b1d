"""Checkpoints that hold everything an exact resume needs, written atomically.
Closes: resume drift. A checkpoint is the ``state_dict()`` of every Stateful part the trainer
names, plus the config and seeds; loaded with ``weights_only=True``. ``best.pt`` and pruning:
docs/run-directory.md."""

from __future__ import annotations

import io
import logging
import math
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol

import torch

from reprotrain import events
from reprotrain.errors import CheckpointError
from reprotrain.run.record import atomic_write_bytes, is_writer

log = logging.getLogger("reprotrain")
BEST = "best.pt"
FORMAT_VERSION = 2  # 2: one state_dict per Stateful part (model, optimizer, ..., rng, loop)
_STEP_FILE = re.compile(r"^step-(\d{8})\.pt$")


@dataclass(frozen=True)
class Meta:
    """What a run was started with, beside its state in each checkpoint (the resume guard
    compares it): the one place its keys are spelled. A new entry is a field here and its
    value where the run builds its Saver (``build.py``)."""

    config: dict[str, Any]
    config_sha256: str
    seeds: dict[str, int]
    env: dict[str, Any]


#: Checkpoint entries that are not state: ``Meta``'s and the file format's.
META_KEYS = frozenset({"format_version", *(f.name for f in fields(Meta))})


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def snapshot(parts: Stateful | dict[str, Stateful], meta: Meta) -> dict[str, Any]:
    """The checkpoint: each part's ``state_dict()`` under its name, plus ``meta``."""
    if isinstance(parts, dict):
        state = {k: p.state_dict() for k, p in parts.items()}
    else:
        state = parts.state_dict()
    return {"format_version": FORMAT_VERSION, **vars(meta), **state}


def step_path(ckpt_dir: Path, global_step: int) -> Path:
    return Path(ckpt_dir) / f"step-{global_step:08d}.pt"


def serialise(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def save(path: Path, data: bytes, global_step: int | None = None) -> None:
    """Write serialised bytes via temp + fsync + rename: a kill leaves old or new, never half."""
    events.fire("checkpoint-write", path=Path(path), data=data, global_step=global_step)
    atomic_write_bytes(path, data)


def step_of(path: Path) -> int | None:
    m = _STEP_FILE.match(Path(path).name)
    return int(m.group(1)) if m else None


def belongs(path: Path, seeds: dict | None) -> bool:
    """Whether ``path`` loads, holds ``seeds`` and the global step its name says."""
    try:
        state = load(path)
    except CheckpointError:
        return False
    at = (state.get("loop") or {}).get("global_step")
    return (seeds is None or state.get("seeds") == seeds) and at == step_of(path)


def is_best_of(state: dict[str, Any], best_epoch: int) -> bool:
    """Whether ``state`` is the epoch-end checkpoint of ``best_epoch`` (what best.pt holds)."""
    loop = state.get("loop") or {}
    return loop.get("epoch") == best_epoch + 1 and loop.get("epoch_step") == 0


def recorded_best_epoch(rows: list[dict], monitor: str, mode: str) -> int | None:
    """The best epoch by the loop's own rule (first strict improvement of a finite value)."""
    best, epoch = None, None
    for row in rows:
        value = row.get(monitor)
        if not isinstance(value, int | float) or not math.isfinite(value):
            continue
        if best is None or (value > best if mode == "max" else value < best):
            best, epoch = value, row.get("epoch")
    return epoch


def reconcile_best(ckpt_dir: Path, loop: dict[str, Any]) -> str | None:
    """Make best.pt agree with the resumed loop state; a one-line note when it had to."""
    ckpt_dir = Path(ckpt_dir)
    best, want = ckpt_dir / BEST, loop.get("best_epoch")
    if want is None:
        if best.is_file():
            best.unlink()
            return f"{best} was written after the checkpoint resumed from; removed"
        return None
    if best.is_file():
        try:
            if is_best_of(load(best), want):
                return None
        except CheckpointError:
            pass
    wrong = f"{best} did not hold the recorded best epoch {want}"
    for path in reversed(list_step_checkpoints(ckpt_dir)):
        try:
            if is_best_of(load(path), want):
                atomic_write_bytes(best, path.read_bytes())
                return f"{wrong}; rewritten from {path.name}"
        except CheckpointError:
            continue
    best.unlink(missing_ok=True)
    return f"{wrong} and no checkpoint of it is left; removed"


def list_step_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Step checkpoints, oldest first (by global step in the name, not mtime)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := _STEP_FILE.match(p.name))]
    return [p for _, p in sorted(found)]


def load(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load with ``weights_only=True``; every failure becomes a one-line CheckpointError."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # garbage read as pickle fails in many ways (KeyError, IndexError)
        raise _unreadable(path, e) from None
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} is not a reprotrain checkpoint (format {FORMAT_VERSION})")
    return state


def _unreadable(path: Path, e: Exception) -> CheckpointError:
    """Why ``torch.load(path, weights_only=True)`` failed, as one line."""
    text = str(e)
    names_code = isinstance(e, pickle.UnpicklingError) and "global" in text.lower()
    if not names_code and not isinstance(e, OSError) and not _starts_as_torch_save(path):
        return CheckpointError(f"{path} is not a checkpoint (not a file torch.save writes)")
    refused = names_code or "weights_only" in text or "Weights only" in text
    if isinstance(e, pickle.UnpicklingError) and refused:
        return CheckpointError(
            f"refused {path}: it asks to load code or objects outside the safe set "
            f"(not a reprotrain checkpoint, or tampered with)"
        )
    reason = text.splitlines()[0] if text else type(e).__name__
    return CheckpointError(f"checkpoint {path} is corrupt or truncated ({reason})")


def _starts_as_torch_save(path: Path) -> bool:
    """A zip or a pickle (PROTO opcode) by its first bytes, as torch.save writes."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head == b"PK\x03\x04" or head[:1] == b"\x80"


def remove_partial_writes(ckpt_dir: Path) -> None:
    """Delete temp files a killed write left behind; they never carry a checkpoint name."""
    for tmp in Path(ckpt_dir).glob(".*.tmp"):  # none where there is no directory
        tmp.unlink(missing_ok=True)


def latest_valid(ckpt_dir: Path) -> tuple[Path | None, dict | None, list[str]]:
    """Newest loadable step checkpoint; also the one-line reasons for each one skipped."""
    skipped: list[str] = []
    for path in reversed(list_step_checkpoints(ckpt_dir)):
        try:
            return path, load(path), skipped
        except CheckpointError as e:
            skipped.append(str(e))
    return None, None, skipped


class Saver:
    """Writes step checkpoints (newest K kept, never fewer than 2: a resume from the last
    replays from the one before) and best.pt. ``gather``: a collective turning this rank's
    snapshot into the checkpoint under DDP (reduction.py)."""

    def __init__(
        self,
        ckpt_dir: Path,
        parts: Stateful | dict,
        meta: Meta,
        keep: int,
        gather: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        self.dir, self.parts, self.meta, self.keep = ckpt_dir, parts, meta, max(keep, 2)
        self.gather = gather
        # The run's own checkpoints so far (a resume's): the only ones pruning may count.
        mine = list_step_checkpoints(ckpt_dir) if is_writer() else []
        self.own = [p for p in mine if belongs(p, meta.seeds)]

    def payload(self) -> dict[str, Any] | None:
        """The checkpoint as :meth:`save` would write it now (None on other ranks); a collective."""
        state = snapshot(self.parts, self.meta)
        if self.gather is not None:
            state = self.gather(state)
        return state if is_writer() else None

    def save(self, best: bool = False, model_state: dict | None = None) -> None:
        if (state := self.payload()) is None:
            return
        if model_state is not None:
            state["model"] = model_state  # the CPU copy already made for the fingerprint
        step = state["loop"]["global_step"]
        data = serialise(state)
        path = step_path(self.dir, step)
        save(path, data, step)
        if best:
            events.fire("before-best", global_step=step)
            save(self.dir / BEST, data)
        own = [*(p for p in self.own if p != path and step_of(p) < step), path]  # oldest first
        for stale in own[: -self.keep]:  # all but the newest K
            stale.unlink(missing_ok=True)
        self.own = own[-self.keep :]
