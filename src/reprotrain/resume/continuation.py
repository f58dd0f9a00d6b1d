"""What a run computed after its last checkpoint, kept so a resume compares its continuation.

Closes: a resume recorded as bitwise whose continuation differs from what the interrupted
run computed at the same steps (docs/resume.md, "A resume compares its continuation").
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reprotrain import batches
from reprotrain.errors import ReprotrainError
from reprotrain.run import record as rec
from reprotrain.run.bounded import load_json

log = logging.getLogger("reprotrain")
FILE = "continuation.jsonl"


def batch_rows(batch: Any) -> list[tuple[str, torch.Tensor]]:
    """Each tensor's header (dtype and shape) and its samples' keyed hashes, on its device (no
    host sync): all that runs per step, one product and one sum per tensor. A sample is its
    bytes as signed 32-bit words ``x_i``; its row holds, per lane ``k`` of two, the sum of
    ``W_k[i] * x_i`` modulo 2**64 with pseudo-random 64-bit weights by place (docs/resume.md,
    "How strong the batch digest is"). The product is a new tensor, so a buffer the pipeline
    or the step fills again cannot change a step that already ran."""
    rows = []
    for t in batches.leaves(batch):
        t = t.detach() if t.requires_grad else t
        words = _words(t)
        if words.device.type == "cpu":
            found = torch.from_numpy(host_sums(words.numpy()))
        else:
            found = (words.unsqueeze(1) * _sample_weights(words.shape[1], words.device)).sum(-1)
        rows.append((_header(t.dtype, t.shape), found))
    return rows


def host_sums(words: np.ndarray) -> np.ndarray:
    """``(samples, 2)`` int64: each sample's words times each lane's weights, summed modulo
    2**64, by numpy on the host (half torch's time on a CPU): einsum for a long row, a dot
    product (less to set up) for a short one; the same integers as the device's sums."""
    lanes = _host_weights(words.shape[1])
    if words.shape[1] <= _SHORT:
        return np.dot(words, lanes.T)
    return np.einsum("si,ki->sk", words, lanes)


_SHORT = 64  # words in a row below which numpy's dot is cheaper to start than einsum


@functools.lru_cache(maxsize=64)
def _header(dtype: torch.dtype, shape: torch.Size) -> str:
    """A tensor's dtype and shape as its row is labelled (``torch.float32[8, 3, 32, 32]``)."""
    return f"{dtype}{list(shape)}"


_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}  # by element size


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as ``(samples, words)`` int32, a sample per first index (a 0-dim tensor is
    one sample): a view where each sample's bytes fill whole words, else each element widened
    to its own word by its bits (a bool, an odd row of bytes or halves; a one-to-one map)."""
    t = t.contiguous()  # a channels-last batch: its values in their logical order
    samples = t.shape[0] if t.dim() else 1
    flat = t.reshape(samples, t.numel() // samples if samples else 0)
    flat = flat.view(torch.uint8) if flat.dtype == torch.bool else flat
    size = flat.element_size()
    if flat.shape[1] * size % 4 == 0:
        return flat.view(torch.int32)
    return flat.view(_INTS[size]).to(torch.int32)


def splitmix64(stream: int, n: int) -> np.ndarray:
    """``n`` pseudo-random 64-bit words (int64), the ``i``-th a function of ``(stream, i)``
    alone (SplitMix64's finaliser of a Weyl sequence): fixed forever, so a resume in another
    process, and a longer list, get the same weights at the same places."""
    with np.errstate(over="ignore"):
        z = (np.arange(n, dtype=np.uint64) + np.uint64(stream << 40)) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))).view(np.int64)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SAMPLE_LANES, _BATCH_LANES = (1, 2), (3, 4)  # the streams of each level's two lanes


@functools.lru_cache(maxsize=16)
def _sample_weights(n: int, device: torch.device) -> torch.Tensor:
    """``(2, n)`` int64 on ``device``: the two lanes' weights of a sample's ``n`` words
    (contiguous: a strided slice of a longer list costs the product twice its time)."""
    return torch.from_numpy(np.stack([splitmix64(k, n) for k in _SAMPLE_LANES])).to(device)


@functools.lru_cache(maxsize=16)
def _host_weights(n: int) -> np.ndarray:
    """``(2, n)`` int64: the sample level's weights as numpy holds them on the host."""
    return np.stack([splitmix64(k, n) for k in _SAMPLE_LANES])


@functools.cache
def _header_words(header: str) -> np.ndarray:
    """A tensor's dtype and shape as 8 signed 32-bit words (its sha256): what the same bits
    as another dtype or shape differ in."""
    return np.frombuffer(hashlib.sha256(header.encode()).digest(), dtype="<i4")


def digests(steps: list[list[tuple[str, torch.Tensor]]]) -> list[list[str]]:
    """Each step's batch digest, one per tensor: per lane, the tensor's header words then each
    sample's row value as two 32-bit words, weighted by place and summed modulo 2**64 (the
    sample level's keyed sum one level up), the two lanes as 32 hex digits; one host read
    and one numpy product per sample count and device."""
    flat = [entry for step in steps for entry in step]
    groups: dict[tuple, list[int]] = {}
    for i, (_, rows) in enumerate(flat):
        groups.setdefault((rows.shape[0], rows.device), []).append(i)
    found = [""] * len(flat)
    for (n, _), which in groups.items():
        rows = torch.stack([flat[i][1] for i in which]).cpu().numpy()  # (tensors, n, 2)
        words = rows.view("<i4").reshape(len(which), n, 2, 2).transpose(2, 0, 1, 3)
        heads = np.stack([_header_words(flat[i][0]) for i in which])  # (tensors, 8)
        parts = [np.stack([heads, heads]), words.reshape(2, len(which), 2 * n)]
        z = np.concatenate(parts, axis=2).astype(np.int64)  # lane, tensor, word
        lanes = z.view(np.uint64) @ _batch_weights(z.shape[2])[:, :, None]  # (2, tensors, 1)
        text = lanes[:, :, 0].T.astype(">u8").tobytes().hex()  # wrapped modulo 2**64
        for j, i in enumerate(which):
            found[i] = text[32 * j : 32 * j + 32]
    out, at = [], 0
    for step in steps:
        out.append(found[at : at + len(step)])
        at += len(step)
    return out


@functools.lru_cache(maxsize=64)
def _batch_weights(n: int) -> np.ndarray:
    """``(2, n)`` uint64: the batch level's two lanes of weights."""
    return np.stack([splitmix64(k, n) for k in _BATCH_LANES]).view(np.uint64)


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
        self.pending: list[tuple[int, torch.Tensor, list[tuple[str, torch.Tensor]]]] = []
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
        for what, prefix in (("batch", "digest "), ("loss", "")):
            if want.get(what) != line[what]:
                was = f"{prefix}{want.get(what)} in the interrupted run, {line[what]} now"
                self.difference = f"step {line['global_step']}: the {what} differs ({was})"
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
                    line = load_json(text, str(self.path))  # bounded: an archive's file
                    step = int(line["global_step"])
                except (ValueError, KeyError, TypeError, ReprotrainError):
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
