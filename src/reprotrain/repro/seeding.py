"""Named random streams derived from one base seed (the table: docs/randomness.md).

Closes: Python ``random``, NumPy's global RNG, torch's CPU/CUDA global RNGs (seeded from the
``init`` and ``train`` streams), data order and augmentation (``data``/``augment`` feed
counter-based generators), and global RNGs drawn from by user code (``rng.Scoped``).
Derivation uses SHA-256, not Python's ``hash()``, which is salted per process.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import random
from dataclasses import asdict, dataclass
from typing import Any

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
    g = torch.Generator(device="cpu")
    g.manual_seed(stable_hash(seed, *counters))
    return g


def numpy_seed_words(seed: int) -> tuple[int, int]:
    """The legacy numpy seed (two 32-bit words) for ``seed``: all 63 bits kept (``seed % 2**32``
    would collide over millions of samples)."""
    derived = stable_hash(seed, "numpy")
    return derived & 0xFFFFFFFF, derived >> 32


# numpy's global RNG (a legacy RandomState over MT19937) is its 624 key words and position
# (``mt19937_state``: uint32 key[624]; int pos) plus a cached Gaussian held by the
# RandomState. ``np.random.get_state``/``set_state`` copy the words one Python call at a
# time (~50-100 us each way, more than a null model's whole step); the words are copied
# here as 2.5 KB through the bit generator's ctypes interface instead.
_MT_WORDS = 624 * 4 + 4


def _mt_address(bit_generator: Any) -> int | None:
    """Where the global MT19937's words are, once they are checked to be laid out as
    ``get_state`` reads them; None (the slow, general route) for any other generator."""
    if type(bit_generator) is not np.random.MT19937:
        return None
    address = bit_generator.ctypes.state_address
    if _layouts.get(address) is None:
        _, key, pos, *_ = np.random.get_state()
        words = ctypes.string_at(address, _MT_WORDS)
        same = words[:-4] == key.astype(np.uint32).tobytes()
        _layouts[address] = same and int(np.frombuffer(words[-4:], np.int32)[0]) == pos
    return address if _layouts[address] else None


_layouts: dict[int, bool] = {}  # state address -> the words are where get_state reads them


def _take_cached_gaussian(address: int) -> float | None:
    """Empty the legacy RandomState's cached Gaussian; its value, or None when it held none.
    ``standard_normal()`` returns a cached value without touching the words, else draws a
    pair from them and caches one (the second call then takes that one back out)."""
    words = ctypes.string_at(address, _MT_WORDS)
    value = float(np.random.standard_normal())
    if ctypes.string_at(address, _MT_WORDS) == words:
        return value
    np.random.standard_normal()
    return None


def save_numpy_global() -> tuple:
    """numpy's global RNG state, for :func:`restore_numpy_global` (which must follow: the
    cached Gaussian is taken out here, and the block is seeded afresh in between)."""
    bit_generator = np.random.get_bit_generator()
    address = _mt_address(bit_generator)
    if address is None:
        return ("state", np.random.get_state())
    words = ctypes.string_at(address, _MT_WORDS)
    return ("words", bit_generator, words, _take_cached_gaussian(address))


def restore_numpy_global(saved: tuple) -> None:
    """Put back what :func:`save_numpy_global` saved: the same words, position and cached
    Gaussian as ``np.random.set_state(np.random.get_state())`` would."""
    if saved[0] == "state":
        np.random.set_state(saved[1])
        return
    _, bit_generator, words, gaussian = saved
    # Rare: code outside any block drew an odd number of normals (a cached Gaussian), or
    # the block swapped the global bit generator (np.random.set_bit_generator).
    if gaussian is not None or np.random.get_bit_generator() is not bit_generator:
        key = np.frombuffer(words[:-4], np.uint32)
        pos = int(np.frombuffer(words[-4:], np.int32)[0])
        cached = (0, 0.0) if gaussian is None else (1, gaussian)
        np.random.set_state(("MT19937", key, pos, *cached))
        return
    address = bit_generator.ctypes.state_address
    _take_cached_gaussian(address)  # whatever the block left cached goes
    ctypes.memmove(address, words, _MT_WORDS)


def microbatch_seed(train_seed: int, global_step: int, index: int, *scope: object) -> int:
    """The global RNGs' seed for micro-batch ``index`` (global over ranks) of a step;
    ``scope`` (``"eval", split``) keys evaluation batches apart from training ones."""
    return stable_hash(train_seed, global_step, index, *scope, "global")
