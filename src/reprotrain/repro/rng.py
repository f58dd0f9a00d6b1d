"""Global RNG states for an exact resume: python, numpy, torch CPU and the training GPU.

Closes: RNG drift across a resume. Dropout, ``torch.rand`` in user code and anything else
that draws from a global generator continues from the same state as an uninterrupted run.

Only the generator of the device this process trains on is saved, never every visible GPU:
a checkpoint written with 8 GPUs visible must resume where 1 is visible (restoring all 8
raised IndexError there), and a CPU run has no CUDA state at all (reading one would also
initialise CUDA for nothing). Under DDP each rank captures its own device's generator
(``state.RankRNG``, the trainer's part) and the reduction gathers them where the checkpoint
is built (``state.every_rank_entries``), so the checkpoint entry holds one state per rank::

    {"format": 2, "world_size": N, "ranks": [state_rank0, state_rank1, ...]}
    state = {"python": {...}, "numpy": {...}, "torch_cpu": ByteTensor,
             "cuda": {"device_index": i, "state": ByteTensor} | None}

Everything is ints, floats, None, lists and tensors, so ``torch.load(weights_only=True)``
reads it without allowing any code. The first format (``torch_cuda: [one tensor per
visible GPU]``, no ``format`` key) is still read: the training device's entry is taken,
and on a CPU run it is skipped with a warning.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

log = logging.getLogger("reprotrain")

FORMAT = 2


def _cuda_index(device: torch.device) -> int:
    """The ordinal behind ``cuda`` (no index means the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def capture(device: torch.device) -> dict[str, Any]:
    """This process's RNG states: python, numpy, torch CPU and ``device``'s CUDA generator."""
    device = torch.device(device)
    py = random.getstate()
    key, pos, has_gauss, cached = np.random.get_state()[1:]
    cuda = None
    if device.type == "cuda":
        index = _cuda_index(device)
        cuda = {"device_index": index, "state": torch.cuda.get_rng_state(index)}
    return {
        "python": {
            "version": py[0],
            "state": torch.tensor(py[1], dtype=torch.int64),
            "gauss_next": py[2],
        },
        "numpy": {
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch_cpu": torch.get_rng_state(),
        "cuda": cuda,
    }


def restore(state: dict[str, Any], device: torch.device, rank: int = 0) -> None:
    """Put the saved states back; ``state`` is a per-rank entry, one rank's state or the
    first format. The CUDA generator goes to ``device`` (its index may differ from the one
    recorded: what is restored is the stream, not the ordinal)."""
    device = torch.device(device)
    state = for_rank(state, rank)
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    n = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            n["key"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch_cpu"])
    cuda = _cuda_state(state, device)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, _cuda_index(device))


def _cuda_state(state: dict[str, Any], device: torch.device) -> torch.Tensor | None:
    """The saved CUDA generator state meant for ``device``, or None (with the reason)."""
    if "torch_cuda" in state:  # first format: one state per GPU that was visible
        saved = list(state["torch_cuda"])
        if device.type != "cuda":
            if saved:
                log.warning(
                    "checkpoint holds CUDA RNG states for %d GPU(s); this run is on %s, so "
                    "they are not restored",
                    len(saved),
                    device.type,
                )
            return None
        index = _cuda_index(device)
        if index >= len(saved):
            log.warning(
                "checkpoint holds CUDA RNG states for %d GPU(s), none for cuda:%d; "
                "the CUDA generator is not restored",
                len(saved),
                index,
            )
            return None
        return saved[index]
    cuda = state.get("cuda")
    if device.type != "cuda":
        if cuda is not None:
            log.warning(
                "checkpoint holds the CUDA RNG state of cuda:%d; this run is on %s, so it "
                "is not restored",
                cuda["device_index"],
                device.type,
            )
        return None
    if cuda is None:
        log.warning("checkpoint was written on a CPU run: no CUDA RNG state to restore")
        return None
    return cuda["state"]


def for_rank(entry: dict[str, Any], rank: int = 0) -> dict[str, Any]:
    """This rank's state from a checkpoint entry (per-rank or a single state)."""
    if "ranks" not in entry:
        return entry
    ranks = entry["ranks"]
    if rank < len(ranks):
        return ranks[rank]
    log.warning(
        "checkpoint holds RNG states for %d rank(s), none for rank %d (world size changed); "
        "rank 0's state is used",
        len(ranks),
        rank,
    )
    return ranks[0]
