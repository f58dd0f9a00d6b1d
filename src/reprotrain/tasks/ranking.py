"""AUROC and average precision, exact over a split, on 1 or N processes, across a resume.

Closes: ranking metrics computed from a part of the split. AUROC and average precision are
functions of every (score, label) pair of a split at once; they are not sums, and a list of
predictions kept in the task is neither checkpointed mid-epoch nor gathered across ranks.
Here each sample owns one slot of a fixed-size int64 vector, chosen by its sample index
(which the batch carries). A batch writes its samples' slots, every other slot stays 0, so
the framework's running sum of these vectors is the whole split: added on the device, all-
reduced across ranks (each sample is on one rank: a sum with zeros is the union), saved with
the partial sums at a mid-epoch checkpoint, restored, all exactly, because the slots hold
integers: ``(float32 bits of the score) << 2 | label << 1 | 1`` (the low bit: "seen").

``auroc`` and ``average_precision`` then read the split's scores once, on the CPU. AUROC is
the exact rank statistic (ties count one half) as a ratio of integers, rounded once;
average precision is scikit-learn's step-wise sum, each term a ratio of integers, summed
with ``math.fsum``. Both equal scikit-learn's values on the same scores to the last bit or
within its own floating-point rounding (``tests/test_exact_metrics.py``).

Cost: 8 bytes per sample of the largest split, in the metric sums and in every checkpoint.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from reprotrain.errors import ReprotrainError


def score_slots(
    scores: torch.Tensor, labels: torch.Tensor, index: torch.Tensor, num_samples: int
) -> torch.Tensor:
    """The batch's contribution to the split's slot vector (int64 ``[num_samples]``).

    ``scores``: one float per sample (a logit or a probability; only the order matters);
    ``labels``: 0/1; ``index``: each sample's index in its split (or dataset), below
    ``num_samples``. Runs on the device without a host sync.
    """
    bits = scores.detach().float().reshape(-1).contiguous().view(torch.int32).long()
    bits = bits & 0xFFFFFFFF  # the float's 32 bits as a non-negative int64
    code = (bits << 2) | (labels.reshape(-1).long().clamp(0, 1) << 1) | 1
    slots = torch.zeros(num_samples, dtype=torch.int64, device=scores.device)
    # An index out of range shares the last (or first) slot: refused as a repeat when the
    # split is read, instead of an indexing error mid-step (checking here would sync).
    index = index.reshape(-1).long().to(scores.device).clamp(0, num_samples - 1)
    return slots.index_put_((index,), code, accumulate=True)


def read_slots(slots: torch.Tensor, samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores float32, labels int64) of every sample the split wrote, in slot order.

    ``samples`` is the split's sample count: a slot written twice (a sample index that
    repeats within a split) or an index out of range is refused in one line.
    """
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
    """Cumulative (true positives, false positives) at each distinct score, from the highest
    down: scikit-learn's ``_binary_clf_curve``, in exact integers."""
    order = np.argsort(-scores.astype(np.float64), kind="stable")
    s, y = scores[order], labels[order].astype(np.int64)
    last = np.r_[np.flatnonzero(np.diff(s.astype(np.float64)) != 0), len(s) - 1]
    tps = np.cumsum(y)[last]
    fps = (last + 1) - tps
    return tps, fps


def auroc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve: P(score of a positive > score of a negative), ties counting
    one half. NaN when the split holds only one class."""
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
    """Σ over distinct thresholds of (recall step) x precision, as scikit-learn defines it.
    NaN when the split holds no positive."""
    if len(scores) == 0:
        return math.nan
    tps, fps = _curve(scores, labels)
    pos = int(tps[-1])
    if pos == 0:
        return math.nan
    steps = np.diff(np.r_[0, tps])
    terms = [
        int(d) * int(t) / ((int(t) + int(f)) * pos)
        for d, t, f in zip(steps, tps, fps, strict=True)
        if d
    ]
    return math.fsum(terms)
