"""Counter-based augmentation: random crop 32 (zero padding 4) and horizontal flip.

Closes: augmentation randomness. The crop offsets and flips of step ``s`` in epoch ``e``
come from a generator seeded with ``(augment seed, e, s)``, so they do not depend on how
many steps ran before, on worker count, or on the device; resuming at ``(e, s)`` replays
them exactly. Applied to whole uint8 batches on the training device.

Two implementations of the same function: ``reference_augment_batch`` is the readable
specification (one fancy-index gather per pixel, then a flip); ``augment_batch`` is what
the pipelines call, a strided-window pick that moves the same bytes about 3x faster on CPU.
Both only copy pixels (no arithmetic), so they agree bit for bit; tests/test_augment.py
checks that on random batches and ``make bench`` (P4) measures the speed-up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from reprotrain.repro.seeding import counter_generator

PAD = 4


def _draws(x: torch.Tensor, seed: int, epoch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Crop offsets [B,2] in 0..2*PAD and flip flags [B] for ``(seed, epoch, step)``.

    The draw order (offsets, then flips) is part of the recorded bits: changing it changes
    every augmented batch and so every run's fingerprint.
    """
    b = x.shape[0]
    g = counter_generator(seed, epoch, step)
    offsets = torch.randint(0, 2 * PAD + 1, (b, 2), generator=g).to(x.device)
    flips = (torch.rand(b, generator=g) < 0.5).to(x.device)
    return offsets, flips


def augment_batch(x: torch.Tensor, seed: int, epoch: int, step: int) -> torch.Tensor:
    """Crop+flip a uint8 batch [B,C,H,W]; a pure function of (x, seed, epoch, step).

    Every (row, column) offset's window is a strided view of the padded batch (``unfold``),
    so a crop is one pick per sample instead of one index per pixel. A flipped crop at
    column offset ``ox`` is the unflipped-image crop of the mirrored padded batch at
    ``2*PAD - ox`` (the padding is symmetric), so the flip is folded into that same pick.
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
