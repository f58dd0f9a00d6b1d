"""Named random streams derived from one base seed (the table: docs/randomness.md).

Closes: Python ``random``, NumPy's global RNG, torch's CPU/CUDA global RNGs (seeded from the
``init`` and ``train`` streams), data order and augmentation (``data``/``augment`` feed
counter-based generators), and global RNGs drawn from by user code (``rng.Scoped``).
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
    return _sha63("/".join(map(str, parts)))


def _sha63(text: str) -> int:
    """The low 63 bits of ``text``'s SHA-256 (little-endian): ``stable_hash``'s last step."""
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
    pinned = {name: getattr(seed_cfg, name) for name in STREAMS}
    streams = {
        k: stable_hash(SEED_SALT, base, k) if v is None else int(v) for k, v in pinned.items()
    }
    return Seeds(base=base, source=source, **streams)


def seed_globals(seed: int) -> None:
    """Seed every global RNG: python, numpy, torch CPU and every CUDA device."""
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)  # also seeds all CUDA devices (lazily if CUDA is not yet up)


def counter_generator(seed: int, *counters: int) -> torch.Generator:
    """A fresh CPU generator for ``(seed, *counters)``: same inputs, same draws, on any device
    the model trains on (draws are tiny and copied there afterwards)."""
    return torch.Generator(device="cpu").manual_seed(stable_hash(seed, *counters))


class SeededGenerators:
    """``generator`` and ``numpy_generator`` from ``self.seed``, each made on first use (the
    class holds ``seed`` and the slots ``_generator`` and ``_numpy_generator``, None until then)."""

    __slots__ = ()

    @property
    def generator(self) -> torch.Generator:
        """A CPU ``torch.Generator`` seeded with ``seed``: draw on the CPU, move the result to
        the device, so the draws never depend on the device type."""
        if self._generator is None:
            self._generator = torch.Generator(device="cpu").manual_seed(self.seed)
        return self._generator

    @property
    def numpy_generator(self) -> np.random.Generator:
        """``numpy.random.default_rng(seed)``: e.g. ``lam = ctx.numpy_generator.beta(a, a)``."""
        if self._numpy_generator is None:
            self._numpy_generator = np.random.default_rng(self.seed)
        return self._numpy_generator


def numpy_seed_words(seed: int) -> tuple[int, int]:
    """The legacy numpy seed (two 32-bit words) for ``seed``: all 63 bits kept (``seed % 2**32``
    would collide over millions of samples)."""
    derived = _sha63(f"{seed}/numpy")  # stable_hash(seed, "numpy"), per micro-batch
    return derived & 0xFFFFFFFF, derived >> 32


def microbatch_seed(train_seed: int, global_step: int, index: int, *scope: object) -> int:
    """The global RNGs' seed for micro-batch ``index`` (global over ranks) of a step;
    ``scope`` (``"eval", split``) keys evaluation batches apart from training ones."""
    if scope:
        return stable_hash(train_seed, global_step, index, *scope, "global")
    return _sha63(f"{train_seed}/{global_step}/{index}/global")  # per micro-batch: no join
