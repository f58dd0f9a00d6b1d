"""AUROC and average precision, exact over a split, on 1 or N processes, across a resume.

Closes: ranking metrics computed from a part of the split. Each sample owns one int64 slot,
chosen by its sample index: ``(float32 bits of the score) << 2 | label << 1 | 1``. A batch
writes its samples' slots, all others 0, so the metric sum of the slot vectors is the whole
split, exactly, added, all-reduced and checkpointed like any sum (8 bytes per sample). The
metrics equal scikit-learn's (``tests/test_exact_metrics.py``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from reprotrain.errors import ReprotrainError


def score_slots(
    scores: torch.Tensor, labels: torch.Tensor, index: torch.Tensor, num_samples: int
) -> torch.Tensor:
    """The batch's int64 ``[num_samples]`` slot vector (on the device, no host sync):
    ``scores`` one float per sample (only the order matters), ``labels`` 0/1, ``index``
    each sample's index in its split, below ``num_samples``."""
    bits = scores.detach().float().reshape(-1).contiguous().view(torch.int32).long()
    bits = bits & 0xFFFFFFFF  # the float's 32 bits as a non-negative int64
    code = (bits << 2) | (labels.reshape(-1).long().clamp(0, 1) << 1) | 1
    slots = torch.zeros(num_samples, dtype=torch.int64, device=scores.device)
    # An index out of range shares the last (or first) slot: refused as a repeat when the
    # split is read, instead of an indexing error mid-step (checking here would sync).
    index = index.reshape(-1).long().to(scores.device).clamp(0, num_samples - 1)
    return slots.index_put_((index,), code, accumulate=True)


def read_slots(slots: torch.Tensor, samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores float32, labels int64) of every sample the split wrote, in slot order; a slot
    written twice or out of range (the count differs from ``samples``) is refused."""
    codes = slots.detach().cpu().long().numpy()
    seen = (codes & 1) == 1
    if int(seen.sum()) != samples:
        raise ReprotrainError(
            f"the split has {samples} samples but {int(seen.sum())} distinct sample indices "
            "were written: give each sample of a split its own index, below the task's "
            "num_samples"
        )
    written = codes[seen]
    scores = ((written >> 2) & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    if not np.isfinite(scores).all():
        raise ReprotrainError("a score is NaN or infinite; AUROC needs finite scores")
    return scores, (written >> 1) & 1


def _curve(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cumulative (tp, fp) at each distinct score, highest first, in exact integers (sklearn's)."""
    order = np.argsort(-scores.astype(np.float64), kind="stable")
    s, y = scores[order], labels[order].astype(np.int64)
    last = np.r_[np.flatnonzero(np.diff(s.astype(np.float64)) != 0), len(s) - 1]
    tps = np.cumsum(y)[last]
    fps = (last + 1) - tps
    return tps, fps


def auroc(scores: np.ndarray, labels: np.ndarray) -> float:
    """P(score of a positive > score of a negative), ties one half, as a ratio of integers
    rounded once. NaN when the split holds only one class."""
    if len(scores) == 0:
        return math.nan
    tps, fps = _curve(scores, labels)
    pos, neg = int(tps[-1]), int(fps[-1])
    if pos == 0 or neg == 0:
        return math.nan
    t = np.r_[0, tps].astype(object)  # python ints: no overflow
    f = np.r_[0, fps].astype(object)
    twice_area = int(np.sum((f[1:] - f[:-1]) * (t[1:] + t[:-1])))  # trapezoids, doubled
    return twice_area / (2 * pos * neg)


def average_precision(scores: np.ndarray, labels: np.ndarray) -> float:
    """scikit-learn's Σ (recall step) x precision, each term a ratio of integers, summed with
    ``math.fsum``. NaN when the split holds no positive."""
    if len(scores) == 0:
        return math.nan
    tps, fps = _curve(scores, labels)
    pos = int(tps[-1])
    if pos == 0:
        return math.nan
    terms = [
        int(d) * int(t) / ((int(t) + int(f)) * pos)
        for d, t, f in zip(np.diff(np.r_[0, tps]), tps, fps, strict=True)
        if d
    ]
    return math.fsum(terms)
