"""Batches of any shape: a pytree (tuples, lists, dicts, nested) whose leaves are tensors
that share their first dimension, the sample dimension.

The pipeline, the step and DDP sharding all go through these four functions, so a dataset
may yield ``(x, y)``, ``{"image": x, "meta": m, "label": y}`` or padded sequences with their
lengths, and nothing in the framework assumes which.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from reprotrain.errors import ReprotrainError

Batch = Any  # a pytree of tensors


def leaves(batch: Batch) -> list[torch.Tensor]:
    """The batch's tensors in a fixed (pytree) order; anything else is refused in one line."""
    found = pytree.tree_leaves(batch)
    for leaf in found:
        if not isinstance(leaf, torch.Tensor):
            raise ReprotrainError(
                f"a batch holds a {type(leaf).__name__}, not a tensor; batches must be tuples, "
                "lists or dicts of tensors (convert it in the dataset or its collate)"
            )
    if not found:
        raise ReprotrainError("a batch holds no tensors; the dataset or its collate is empty")
    return found


def batch_size(batch: Batch) -> int:
    """Samples in the batch: the first dimension its tensors share."""
    sizes = {t.shape[0] if t.dim() else None for t in leaves(batch)}
    if len(sizes) != 1 or None in sizes:
        raise ReprotrainError(
            "a batch's tensors disagree on the sample dimension "
            f"(sizes {sorted(map(str, sizes))}); put the samples first in every tensor"
        )
    return sizes.pop()


def to_device(batch: Batch, device: torch.device, non_blocking: bool = True) -> Batch:
    """The same structure with every tensor on ``device``."""
    return pytree.tree_map(lambda t: t.to(device, non_blocking=non_blocking), batch)


def narrow(batch: Batch, start: int, length: int) -> Batch:
    """Samples ``start .. start+length`` of every tensor (views, no copy)."""
    return pytree.tree_map(lambda t: t.narrow(0, start, length), batch)


def take(batch: Batch, index: torch.Tensor | int) -> Batch:
    """Samples ``index`` (a tensor of positions, or one position) of every tensor."""
    return pytree.tree_map(lambda t: t[index], batch)
