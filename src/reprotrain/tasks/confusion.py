"""Confusion matrix, precision, recall and F1 (binary, macro, micro): exact over a split.

Closes: metrics that are not means of per-batch values. A batch adds its confusion matrix,
integer counts in int64, to the split's running sum; the framework adds those on the device,
all-reduces them across ranks and checkpoints the partial sum mid-epoch like any metric sum.
Integer addition is exact in any order, so the matrix is the same on 1 or N processes and
after a mid-epoch resume, and ``f1_scores`` turns it into the same numbers scikit-learn
computes from the split's predictions (``zero_division=0``: a class never predicted and never
present scores 0 and still counts in the macro mean, as in scikit-learn with ``labels=``).
"""

from __future__ import annotations

import numpy as np
import torch


def confusion_counts(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``[C, C]`` int64 counts: row = true class, column = predicted class (scikit-learn's
    layout). An accumulating ``index_put_`` on the device: no host sync, and integer adds
    are exact in any order (deterministic on CUDA too)."""
    target, pred = target.reshape(-1).long(), pred.reshape(-1).long()
    cells = (target * num_classes + pred).to(pred.device)
    counts = torch.zeros(num_classes * num_classes, dtype=torch.int64, device=pred.device)
    counts.index_put_((cells,), torch.ones_like(cells), accumulate=True)
    return counts.reshape(num_classes, num_classes)


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` in float64, 0 where ``den`` is 0 (scikit-learn's ``zero_division=0``)."""
    num, den = num.double(), den.double()
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)


def per_class(confusion: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(precision, recall, F1) per class, float64, from a ``[C, C]`` count matrix."""
    m = confusion.long()
    tp = m.diagonal()
    predicted, actual = m.sum(0), m.sum(1)
    precision, recall = _ratio(tp, predicted), _ratio(tp, actual)
    f1 = _ratio(2 * tp, predicted + actual)  # = 2PR/(P+R), exact in counts
    return precision, recall, f1


def f1_scores(confusion: torch.Tensor) -> dict[str, float]:
    """``f1_macro`` (the unweighted mean over classes) and ``f1_micro`` (pooled counts: the
    accuracy for single-label data) of a split's confusion matrix."""
    m = confusion.long()
    _, _, f1 = per_class(m)
    tp, total = m.diagonal().sum(), m.sum()
    micro = _ratio(2 * tp, 2 * total)  # pooled precision = pooled recall = tp / total
    # numpy's mean, as scikit-learn takes it: the same bits for any class count
    return {"f1_macro": float(np.mean(f1.numpy())), "f1_micro": float(micro)}


def binary_scores(confusion: torch.Tensor) -> dict[str, float]:
    """Precision, recall and F1 of the positive class (1) of a ``[2, 2]`` matrix."""
    precision, recall, f1 = per_class(confusion)
    return {"precision": float(precision[1]), "recall": float(recall[1]), "f1": float(f1[1])}
