"""What a run computed after its last checkpoint, kept so a resume compares its continuation.

Closes: a resume recorded as bitwise whose continuation differs from what the interrupted
run computed at the same steps (docs/resume.md, "A resume compares its continuation").
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reprotrain.run import record as rec
from reprotrain.step import batches
from reprotrain.tasks.metrics import sum_dtype

log = logging.getLogger("reprotrain")
FILE = "continuation.jsonl"


def batch_rows(batch: Any) -> list[torch.Tensor]:
    """Each tensor's per-sample sums, on its device (no host sync): all that runs per step,
    one op per tensor. A sample's bits as 64-bit words, summed modulo 2**64 (exact, in any
    order; any changed bit changes it) where its layout allows the view, else its values
    summed in float64. A tensor of one value per sample is its own row, copied (a buffer the
    pipeline or the step reuses would otherwise digest later values)."""
    rows = []
    for t in batches.leaves(batch):
        t = t.detach() if t.requires_grad else t
        if t.dim() > 1:
            dims, words = tuple(range(1, t.dim())), _as_words(t)
            rows.append(words.sum(dims) if words is not None else t.sum(dims, dtype=sum_dtype(t)))
        else:  # a sample is one value (or the tensor is one): the values themselves
            rows.append((t if t.dim() == 1 else t.reshape(-1)).clone())
    return rows


def _as_words(t: torch.Tensor) -> torch.Tensor | None:
    """A contiguous ``t``'s bytes as int64 words in its shape but the last dimension (a view),
    or None where there is no such view (a channels-last batch, an odd row)."""
    size = t.element_size()
    if not t.is_contiguous() or (t.shape[-1] * size) % 8 or (t.storage_offset() * size) % 8:
        return None
    return t.view(torch.int64)


def digests(steps: list[list[torch.Tensor]]) -> list[list[str]]:
    """Each step's batch digest: per tensor, its rows' bit patterns summed modulo 2**64,
    plain and weighted by the sample's place (exact in any order; a changed bit changes the
    plain sum, two samples swapped the weighted one), as 32 hex digits; one host read per row
    length, device and dtype, summed on the host."""
    flat = [rows for step in steps for rows in step]
    found = [""] * len(flat)
    groups: dict[tuple, list[int]] = {}
    for i, rows in enumerate(flat):
        groups.setdefault((rows.numel(), rows.device, rows.dtype), []).append(i)
    for (n, _, _), which in groups.items():
        stacked = torch.stack([flat[i] for i in which])  # (rows, n)
        bits = stacked.view(_INTS.get(stacked.element_size(), torch.int64))  # any dtype
        host = bits.cpu().numpy().astype(np.int64, copy=False)
        words = host.reshape(len(which), n, -1).sum(axis=2)  # a wider value: its words added
        text = (words @ _weights(n)).astype("<i8").tobytes().hex()  # (rows, 2), wrapped
        for j, i in enumerate(which):
            found[i] = text[32 * j : 32 * j + 32]
    out, at = [], 0
    for step in steps:
        out.append(found[at : at + len(step)])
        at += len(step)
    return out


_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # by element size


@functools.cache
def _weights(n: int) -> np.ndarray:
    """``(n, 2)``: each sample's weight in the plain sum (1) and the weighted one (its place)."""
    return np.stack([np.ones(n, dtype=np.int64), np.arange(1, n + 1, dtype=np.int64)], axis=1)


def _json_line(line: dict) -> str:
    """``json.dumps(line) + "\\n"`` for a line of ints and hex strings, at a tenth of its cost."""
    batch = ", ".join(f'"{digest}"' for digest in line["batch"])
    return (
        f'{{"global_step": {line["global_step"]}, "loss": "{line["loss"]}", "batch": [{batch}]}}\n'
    )


class Continuation:
    """The steps since the last checkpoint, written at the loop's host reads and compared
    with the interrupted run's on a resume; ``path`` None: a rank that writes nothing."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.pending: list[tuple[int, torch.Tensor, list[torch.Tensor]]] = []
        self.expected: dict[int, dict] = {}  # global step -> the interrupted run's line
        self.steps: tuple[int, int] | None = None  # first and last expected step
        self.compared = 0
        self.difference: str | None = None
        self.claim = False  # the resume's bitwise verdict before the continuation
        self.done = True  # nothing left to compare
        self._file: Any = None  # the file, open for appending between checkpoints

    def add(self, global_step: int, loss: torch.Tensor, batch: Any) -> None:
        """Step ``global_step``'s loss and batch rows, kept on the device."""
        if self.path is not None:
            loss = loss.detach() if loss.requires_grad else loss
            self.pending.append((global_step, loss, batch_rows(batch)))

    def flush(self) -> list[dict]:
        """Write the pending steps and compare them with the interrupted run's; the lines."""
        if self.path is None or not self.pending:
            return []
        steps = [step for step, _, _ in self.pending]
        losses = torch.stack([loss for _, loss, _ in self.pending]).tolist()  # exact floats
        batch = digests([rows for _, _, rows in self.pending])
        self.pending = []
        lines = [
            {"global_step": s, "loss": float(loss).hex(), "batch": d}
            for s, loss, d in zip(steps, losses, batch, strict=True)
        ]
        for line in lines:
            self._compare(line)
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (kept open)
        self._file.write("".join(map(_json_line, lines)))
        self._file.flush()  # in the file before the next step: a SIGKILL keeps these lines
        return lines

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def restart(self) -> None:
        """At a checkpoint: the steps up to it are in the checkpoint; the file starts again."""
        if self.path is not None:
            self.flush()
            self._close_file()
            rec.atomic_write_text(self.path, "")

    def close(self) -> None:
        """At the run's end: nothing is left to continue, so no file is left either."""
        if self.path is not None:
            self._close_file()
            self.path.unlink(missing_ok=True)

    def _compare(self, line: dict) -> None:
        want = self.expected.pop(line["global_step"], None)
        if want is None or self.difference is not None:
            return
        self.compared += 1
        step = line["global_step"]
        for what, prefix in (("batch", "digest "), ("loss", "")):
            if want.get(what) != line[what]:
                was = f"{prefix}{want.get(what)} in the interrupted run, {line[what]} now"
                self.difference = f"step {step}: the {what} differs ({was})"
                return

    def load(self, after: int) -> None:
        """The interrupted run's steps after global step ``after`` (a cut line left out); the
        file then starts again."""
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
        self._close_file()
        rec.atomic_write_text(self.path, "")

    def entry(self, claim: bool, not_comparable: str | None = None) -> dict[str, Any]:
        """The resume record's ``continuation`` at the restore: what will be compared, or why
        nothing can be (``not_comparable``)."""
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
        pending = "pending: compared as the resumed run recomputes them"
        return {"steps": list(self.steps), "compared": 0, "identical": None, "reason": pending}

    def verdict(self, stopped: bool = False) -> dict[str, Any] | None:
        """The record's ``continuation`` once every expected step was compared (or
        ``stopped``), else None."""
        if self.done or self.path is None or self.steps is None:
            return None
        if self.expected and self.difference is None and not stopped:
            return None
        self.done = True
        first, last = self.steps
        out: dict[str, Any] = {"steps": [first, last], "compared": self.compared}
        out |= {"identical": self.difference is None, "first_difference": self.difference}
        if self.expected and self.difference is None:
            left = f"{min(self.expected)}..{last}"
            out["reason"] = f"the resumed run stopped before recomputing steps {left}"
        return out


def record_verdict(record: rec.RunRecord, verdict: dict[str, Any], claim: bool) -> None:
    """The newest resume entry with its continuation's verdict (bitwise only if all matched)."""
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


__all__ = ["FILE", "Continuation", "batch_rows", "digests", "record_verdict"]
