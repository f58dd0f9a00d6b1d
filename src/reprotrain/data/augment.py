"""Counter-based augmentation of whole uint8 batches: random crop (zero padding 4) and flip.

Closes: augmentation randomness: step ``s`` of epoch ``e`` draws from a generator seeded
with ``(augment seed, e, s)``, whatever ran before, the workers or the device.
``reference_augment_batch`` is the readable specification ``augment_batch`` (about 3x
faster) equals bit for bit (tests/test_augment.py; ``make bench`` P4).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from reprotrain.repro.seeding import counter_generator

PAD = 4


def _draws(x: torch.Tensor, seed: int, epoch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Crop offsets [B,2] in 0..2*PAD and flip flags [B] for ``(seed, epoch, step)``; the
    draw order (offsets, then flips) is part of the recorded bits."""
    b = x.shape[0]
    g = counter_generator(seed, epoch, step)
    offsets = torch.randint(0, 2 * PAD + 1, (b, 2), generator=g).to(x.device)
    flips = (torch.rand(b, generator=g) < 0.5).to(x.device)
    return offsets, flips


def augment_batch(x: torch.Tensor, seed: int, epoch: int, step: int) -> torch.Tensor:
    """Crop+flip a uint8 batch [B,C,H,W]; a pure function of (x, seed, epoch, step).

    Each offset's window is a strided view of the padded batch (``unfold``): one pick per
    sample. A flipped crop at column ``ox`` is the mirrored padded batch's crop at
    ``2*PAD - ox`` (the padding is symmetric), so the flip is folded into that pick.
    """
    b, _, h, w = x.shape
    offsets, flips = _draws(x, seed, epoch, step)
    padded = F.pad(x, (PAD, PAD, PAD, PAD))
    both = torch.stack((padded, padded.flip(3)))  # [2,B,C,H+2P,W+2P]: as is, mirrored
    windows = both.unfold(3, h, 1).unfold(4, w, 1)  # [2,B,C,2P+1,2P+1,H,W], a view
    cols = torch.where(flips, 2 * PAD - offsets[:, 1], offsets[:, 1])
    batch = torch.arange(b, device=x.device)
    return windows[flips.long(), batch, :, offsets[:, 0], cols]


def reference_augment_batch(x: torch.Tensor, seed: int, epoch: int, step: int) -> torch.Tensor:
    """The specification ``augment_batch`` must equal bit for bit (the original gather)."""
    b, c, h, w = x.shape
    offsets, flips = _draws(x, seed, epoch, step)
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
