"""What a run computed after its last checkpoint, kept so a resume compares its continuation.

A replay proves the interval *before* the checkpoint a resume starts from; state whose effect
lands later (a counter acting every N steps) passes it. So the run also keeps what it did
*after* each checkpoint: every step's loss (its float64 bits) and a digest of its batch,
held on the device while the step runs (no host sync per step) and appended to
``continuation.jsonl`` in the run directory at the points the loop already reads the device:
the non-finite check (every ``trainer.nonfinite_check_every`` steps), the epoch's end and
each checkpoint. Each checkpoint starts the file again, and a completed run removes it. A
SIGKILL loses at most the steps since the last of these points; a SIGTERM's checkpoint
keeps none (it is the checkpoint).

A resume reads the steps the interrupted run logged after its checkpoint; as the resumed
run recomputes them it compares each, at the same points, and the resume's record says what
was compared: ``continuation: {steps, compared, identical, first_difference}``
(``step 37: the loss differs (0x1.9p-1 in the interrupted run, 0x1.ap-1 now)``), or that
nothing could be compared and why. A difference makes the resume not bitwise.

Closes: a resume recorded as bitwise whose continuation differs from what the interrupted
run computed at the same steps (state a checkpoint could not restore, acting after the
replayed interval).
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
from pathlib import Path
from typing import Any

import torch

from reprotrain import batches
from reprotrain.run import record as rec

log = logging.getLogger("reprotrain")
FILE = "continuation.jsonl"


def batch_digest(batch: Any) -> torch.Tensor:
    """Two sums per tensor of the batch, on its device (no host sync): all values, and the
    per-sample sums weighted by the sample's place (a reordered batch differs). Two ops a
    tensor and one to join them: this runs every step."""
    parts: list[torch.Tensor] = []
    for t in batches.leaves(batch):
        flat = t.detach().reshape(t.shape[0] if t.dim() else 1, -1)
        wide = torch.float32 if t.device.type == "mps" else torch.float64  # mps: no float64
        rows = flat.sum(dim=1, dtype=wide)
        parts.append(rows @ _weights(rows.numel(), rows.dtype, rows.device))
    if not parts:
        return torch.zeros(0)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


@functools.lru_cache(maxsize=16)
def _weights(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[1, place]`` per sample, as an (n, 2) matrix: ``rows @ it`` is both sums at once."""
    place = torch.arange(1, n + 1, dtype=dtype, device=device)
    return torch.stack([torch.ones_like(place), place], dim=1)


def _hex(values: list[float]) -> list[str]:
    return [float(v).hex() for v in values]


class Continuation:
    """The steps since the last checkpoint: held on the device, written at the loop's host
    reads, compared with the interrupted run's when a resume recomputes them.

    ``path`` None: a rank that writes nothing (only rank 0 keeps the file and compares)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.expected: dict[int, dict] = {}  # global step -> the interrupted run's line
        self.steps: tuple[int, int] | None = None  # first and last expected step
        self.compared = 0
        self.difference: str | None = None
        self.claim = False  # the resume's bitwise verdict before the continuation
        self.done = True  # nothing left to compare

    # ------------------------------------------------------------------------- the run

    def add(self, global_step: int, loss: torch.Tensor, batch: Any) -> None:
        """Step ``global_step``'s loss and batch digest, kept on the device."""
        if self.path is not None:
            self.pending.append((global_step, loss.detach(), batch_digest(batch)))

    def flush(self) -> list[dict]:
        """Write the pending steps (one host read for all) and compare them with the
        interrupted run's; the lines written."""
        if self.path is None or not self.pending:
            return []
        steps = [step for step, _, _ in self.pending]
        losses = torch.stack([loss for _, loss, _ in self.pending]).double().tolist()
        ends = list(itertools.accumulate(d.numel() for _, _, d in self.pending))  # shapes
        flat = torch.cat([d for _, _, d in self.pending]).cpu().tolist()
        digests = [flat[a:b] for a, b in zip([0, *ends], ends, strict=False)]
        self.pending = []
        lines = [
            {"global_step": s, "loss": float(loss).hex(), "batch": _hex(d)}
            for s, loss, d in zip(steps, losses, digests, strict=True)
        ]
        for line in lines:
            self._compare(line)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(line) + "\n" for line in lines))
        return lines

    def restart(self) -> None:
        """At a checkpoint: the steps up to it are in the checkpoint; the file starts again."""
        if self.path is not None:
            self.flush()
            rec.atomic_write_text(self.path, "")

    def close(self) -> None:
        """At the run's end: nothing is left to continue, so no file is left either."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def _compare(self, line: dict) -> None:
        want = self.expected.pop(line["global_step"], None)
        if want is None or self.difference is not None:
            return
        self.compared += 1
        step = line["global_step"]
        if want.get("batch") != line["batch"]:
            self.difference = (f"step {step}: the batch differs (digest {want.get('batch')} in "
                               f"the interrupted run, {line['batch']} now)")  # fmt: skip
        elif want.get("loss") != line["loss"]:
            self.difference = (f"step {step}: the loss differs ({want.get('loss')} in the "
                               f"interrupted run, {line['loss']} now)")  # fmt: skip

    # ---------------------------------------------------------------------- the resume

    def load(self, after: int) -> None:
        """The interrupted run's steps after global step ``after`` (its checkpoint); the
        file then starts again for this run. A line cut by the kill is left out."""
        if self.path is None:
            return
        found: dict[int, dict] = {}
        if self.path.is_file():
            for text in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    line = json.loads(text)
                    step = int(line["global_step"])
                except (ValueError, KeyError, TypeError):
                    continue
                if step > after and isinstance(line, dict):
                    found[step] = line
        self.expected = found
        self.steps = (min(found), max(found)) if found else None
        self.done = not found
        rec.atomic_write_text(self.path, "")

    def entry(self, claim: bool, not_comparable: str | None = None) -> dict[str, Any]:
        """The resume record's ``continuation`` at the restore: what will be compared (the
        bitwise claim waits for it), or why nothing can be (``not_comparable``: this resume
        runs those steps otherwise, e.g. under a stretched schedule)."""
        self.claim = claim
        if self.path is None:
            return {"compared": 0, "reason": "compared by rank 0"}
        if not_comparable is not None:
            self.expected, self.steps, self.done = {}, None, True
            return {"compared": 0, "reason": not_comparable}
        if self.steps is None:
            return {
                "compared": 0,
                "reason": "the interrupted run logged no step after its checkpoint (a SIGKILL "
                "loses the steps since its last host read: every trainer.nonfinite_check_every "
                "steps and each checkpoint)",
            }
        return {"steps": list(self.steps), "compared": 0, "identical": None,
                "reason": "pending: compared as the resumed run recomputes them"}  # fmt: skip

    def verdict(self, stopped: bool = False) -> dict[str, Any] | None:
        """The record's ``continuation`` once every expected step was compared (or the run
        stopped first: ``stopped``), else None (still pending)."""
        if self.done or self.path is None or self.steps is None:
            return None
        if self.expected and self.difference is None and not stopped:
            return None
        self.done = True
        first, last = self.steps
        out: dict[str, Any] = {"steps": [first, last], "compared": self.compared,
                               "identical": self.difference is None,
                               "first_difference": self.difference}  # fmt: skip
        if self.expected and self.difference is None:
            out["reason"] = (f"the resumed run stopped before recomputing steps "
                             f"{min(self.expected)}..{last}")  # fmt: skip
        return out


def record_verdict(record: rec.RunRecord, verdict: dict[str, Any], claim: bool) -> None:
    """The newest resume entry with its continuation's verdict: bitwise only when the
    replay, the state and every compared step matched."""
    resumes = list(record.data.get("resumes") or [])
    if not resumes:
        return
    entry = dict(resumes[-1])
    entry["continuation"] = verdict
    entry["bitwise_guarantee"] = bool(claim and verdict["identical"])
    if not verdict["identical"]:
        line = f"the continuation differs from the interrupted run's: {verdict['first_difference']}"
        entry["unrestored"] = [*entry.get("unrestored", []), line]
        log.warning("resume %s", line)
    record.update(resumes=[*resumes[:-1], entry])


__all__ = ["FILE", "Continuation", "batch_digest", "record_verdict"]
