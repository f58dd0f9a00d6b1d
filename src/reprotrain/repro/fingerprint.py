"""Bitwise fingerprints of weights and of the loss trajectory.

Closes nothing by itself: it is how a run proves it matched another. ``weights_sha256``
hashes every parameter *and buffer* (BatchNorm running stats included) by name, dtype,
shape and raw bytes; ``losses_sha256`` hashes an epoch's step losses as exact float64 bytes,
so verify can point at the first step whose loss differs.
"""

from __future__ import annotations

import hashlib
import struct

import torch
from torch import nn


def state_sha256(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def weights_sha256(model: nn.Module) -> str:
    """sha256 of every parameter and buffer in ``model.state_dict()``."""
    return state_sha256(model.state_dict())


def losses_sha256(losses: list[float]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(losses)}d", *losses)).hexdigest()
