"""Confusion matrix, precision, recall and F1 (binary, macro, micro): exact over a split.

Closes: metrics that are not means of per-batch values: each batch adds int64 counts (exact
in any order, on any world size, across a resume); ``f1_scores`` gives scikit-learn's numbers
(``zero_division=0``, every class in the macro mean as with ``labels=``).
"""

from __future__ import annotations

import numpy as np
import torch


def confusion_counts(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``[C, C]`` int64 counts, row = true class, column = predicted (scikit-learn's layout),
    by an accumulating ``index_put_`` on the device (no host sync; exact on CUDA too)."""
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
    """``f1_macro`` (mean over classes) and ``f1_micro`` (pooled counts) of a split."""
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
