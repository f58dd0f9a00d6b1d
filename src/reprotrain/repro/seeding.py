"""Named random streams derived from one base seed.

Closes: Python ``random``, NumPy's global RNG and torch's CPU/CUDA global RNGs (seeded from
the ``init`` stream before the model is built and from ``train`` before the loop), and the
data-order / augmentation randomness (``data`` and ``augment`` feed counter-based generators:
each draw is a pure function of ``(stream seed, epoch, step)``, never of hidden state).

Derivation uses SHA-256, not Python's ``hash()``, which is salted per process.
"""

from __future__ import annotations

import hashlib
import os
import random
from dataclasses import asdict, dataclass

import numpy as np
import torch

STREAMS = ("init", "data", "augment", "train")
# The derivation's salt: a fixed string, never the package's or project's name, so the same
# config gives the same seeds (and bits) in the template and in every project made from it.
SEED_SALT = "reprotrain"
_MASK63 = (1 << 63) - 1


def stable_hash(*parts: object) -> int:
    """A 63-bit integer from the SHA-256 of ``parts``: stable across processes and machines."""
    text = "/".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & _MASK63


@dataclass(frozen=True)
class Seeds:
    base: int
    init: int
    data: int
    augment: int
    train: int
    source: str  # "config" or "entropy"

    def as_dict(self) -> dict:
        return asdict(self)


def resolve_seeds(seed_cfg) -> Seeds:
    """Base seed (from config or OS entropy) plus each stream, derived unless pinned."""
    if seed_cfg.from_entropy and seed_cfg.base is None:
        base, source = int.from_bytes(os.urandom(4), "little"), "entropy"
    else:
        base, source = int(seed_cfg.base), "config"
    streams = {
        name: int(getattr(seed_cfg, name))
        if getattr(seed_cfg, name) is not None
        else stable_hash(SEED_SALT, base, name)
        for name in STREAMS
    }
    return Seeds(base=base, source=source, **streams)


def seed_globals(seed: int) -> None:
    """Seed every global RNG: python, numpy, torch CPU and every CUDA device."""
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)  # also seeds all CUDA devices (lazily if CUDA is not yet up)


def counter_generator(seed: int, *counters: int) -> torch.Generator:
    """A fresh CPU generator for ``(seed, *counters)``: same inputs, same draws, anywhere.

    Always on the CPU so the sample order and augmentation do not depend on the device
    the model trains on; draws are tiny and copied to the device afterwards.
    """
    g = torch.Generator(device="cpu")
    g.manual_seed(stable_hash(seed, *counters))
    return g
