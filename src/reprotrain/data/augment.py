"""Counter-based augmentation: random crop 32 (zero padding 4) and horizontal flip.

Closes: augmentation randomness. The crop offsets and flips of step ``s`` in epoch ``e``
come from a generator seeded with ``(augment seed, e, s)``, so they do not depend on how
many steps ran before, on worker count, or on the device; resuming at ``(e, s)`` replays
them exactly. Applied to whole uint8 batches on the training device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from reprotrain.repro.seeding import counter_generator

PAD = 4


def augment_batch(x: torch.Tensor, seed: int, epoch: int, step: int) -> torch.Tensor:
    """Crop+flip a uint8 batch [B,C,H,W]; a pure function of (x, seed, epoch, step)."""
    b, c, h, w = x.shape
    g = counter_generator(seed, epoch, step)
    offsets = torch.randint(0, 2 * PAD + 1, (b, 2), generator=g).to(x.device)
    flips = (torch.rand(b, generator=g) < 0.5).to(x.device)
    padded = F.pad(x, (PAD, PAD, PAD, PAD))
    rows = (offsets[:, 0, None] + torch.arange(h, device=x.device))[:, None, :, None]
    cols = (offsets[:, 1, None] + torch.arange(w, device=x.device))[:, None, None, :]
    batch = torch.arange(b, device=x.device)[:, None, None, None]
    chans = torch.arange(c, device=x.device)[None, :, None, None]
    out = padded[batch, chans, rows, cols]
    return torch.where(flips[:, None, None, None], out.flip(3), out)


def normalize(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """uint8 [B,C,H,W] -> float32, scaled to [0,1] then standardised per channel."""
    return (x.float().div_(255) - mean) / std
