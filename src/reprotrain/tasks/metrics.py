"""Metric sums: the on-device form every task metric takes between steps (docs/task.md).
Floating sums are float64 (float32 on mps, which has none), integer sums int64.
"""

from __future__ import annotations

import torch

SAMPLES = "samples"  # reserved: the framework counts the samples of a split itself


def sum_dtype(value: torch.Tensor) -> torch.dtype:
    """float64 where ``value``'s device has it (a python float accumulation's number)."""
    return torch.float32 if value.is_mps else torch.float64


def mean_sum(mean: torch.Tensor, n: int) -> torch.Tensor:
    """A batch mean turned back into the batch's sum, in the sum dtype: ``mean * n``."""
    return mean.detach().to(sum_dtype(mean)) * n


def as_sum(value: torch.Tensor) -> torch.Tensor:
    """``value`` in the dtype its running sum keeps (int64 counts, float64 values)."""
    if value.dtype.is_floating_point or value.dtype.is_complex:
        return value.detach().to(sum_dtype(value))
    return value.detach().to(torch.int64)
