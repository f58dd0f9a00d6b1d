"""Batches of any shape: a pytree of tensors sharing their first (sample) dimension.

A step's batch is one pytree, cut into micro-batches by ``micro_batch`` (views), or
``MicroBatches``, collated one by one (docs/step.md, docs/scaling-out.md).
On the ground floor: every stage may import it; it imports no stage (tests/test_layering.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from reprotrain.errors import ReprotrainError

Batch = Any  # a pytree of tensors


def _flat(batch: Batch) -> bool:
    """A non-empty tuple or list of plain tensors: its leaves are its items (no pytree walk)."""
    return (
        type(batch) in (tuple, list) and bool(batch) and all(type(t) is torch.Tensor for t in batch)
    )


def _map(fn: Any, batch: Batch) -> Batch:
    """``pytree.tree_map(fn, batch)``, without the walk for a flat batch."""
    return type(batch)(map(fn, batch)) if _flat(batch) else pytree.tree_map(fn, batch)


def leaves(batch: Batch) -> list[torch.Tensor]:
    """The batch's tensors in a fixed (pytree) order; anything else is refused in one line."""
    if _flat(batch):
        return list(batch)
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


class MicroBatches:
    """A step's batch as its micro-batches, each collated alone (a pytree node: ``to_device``,
    hashing and ``leaves`` see every micro-batch's tensors, in order). Micro-batch ``i`` is
    ``self[i]``; all hold the same number of samples, their other dimensions may differ."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[Batch]) -> None:
        self.parts = list(parts)

    def __len__(self) -> int:
        return len(self.parts)

    def __getitem__(self, i: int) -> Batch:
        return self.parts[i]

    def __iter__(self):
        return iter(self.parts)

    def __repr__(self) -> str:
        return f"MicroBatches({len(self.parts)} micro-batches)"


pytree.register_pytree_node(
    MicroBatches,
    lambda mb: (mb.parts, None),
    lambda parts, _: MicroBatches(list(parts)),
    serialized_type_name="reprotrain.batches.MicroBatches",
)


def batch_size(batch: Batch) -> int:
    """Samples in the batch: the first dimension its tensors share (all of a MicroBatches')."""
    if isinstance(batch, MicroBatches):
        return sum(batch_size(part) for part in batch)
    sizes = {t.shape[0] if t.dim() else None for t in leaves(batch)}
    if len(sizes) != 1 or None in sizes:
        raise ReprotrainError(
            "a batch's tensors disagree on the sample dimension "
            f"(sizes {sorted(map(str, sizes))}); put the samples first in every tensor"
        )
    return sizes.pop()


def to_device(batch: Batch, device: torch.device, non_blocking: bool = True) -> Batch:
    """The same structure with every tensor on ``device``."""
    return _map(
        lambda t: t if t.device == device else t.to(device, non_blocking=non_blocking), batch
    )


def narrow(batch: Batch, start: int, length: int) -> Batch:
    """Samples ``start .. start+length`` of every tensor (views, no copy)."""
    return _map(lambda t: t.narrow(0, start, length), batch)


def take(batch: Batch, index: torch.Tensor | int) -> Batch:
    """Samples ``index`` (a tensor of positions, or one position) of every tensor
    (``index_select``: the same copy as ``t[index]``, a third of its cost per call)."""
    if isinstance(index, torch.Tensor) and index.dim() == 1:
        return _map(lambda t: t.index_select(0, index), batch)
    return _map(lambda t: t[index], batch)  # one position (an int of any kind)


def microbatch_count(batch: Batch, microbatch_size: int | None, n: int | None = None) -> int:
    """How many micro-batches a step's ``batch`` holds: a ``MicroBatches``' own, else its
    samples (``n``, when the caller has counted them) in pieces of ``microbatch_size`` (None:
    one piece; it divides the batch, as ``config.check_layout`` checks)."""
    if isinstance(batch, MicroBatches):
        sizes = {batch_size(part) for part in batch}
        if len(sizes) != 1:
            raise ReprotrainError(
                f"a step's micro-batches hold different sample counts ({sorted(sizes)}); each "
                "must hold trainer.microbatch_size samples"
            )
        return len(batch)
    n = batch_size(batch) if n is None else n
    return n // (microbatch_size or n)


def micro_batch(batch: Batch, i: int, k: int) -> Batch:
    """Micro-batch ``i`` of the ``k`` in ``batch``: a ``MicroBatches``' own part, else a view
    of samples ``i*n/k .. (i+1)*n/k`` (the whole batch when ``k`` is 1, no op at all)."""
    if isinstance(batch, MicroBatches):
        return batch[i]
    if k == 1:
        return batch
    size = batch_size(batch) // k
    return narrow(batch, i * size, size)
