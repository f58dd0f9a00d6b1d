"""Named random streams derived from one base seed.

Closes: Python ``random``, NumPy's global RNG and torch's CPU/CUDA global RNGs (seeded from
the ``init`` stream before the model is built and from ``train`` before the loop), and the
data-order / augmentation randomness (``data`` and ``augment`` feed counter-based generators:
each draw is a pure function of ``(stream seed, epoch, step)``, never of hidden state).

Closes too: global RNGs drawn from by user code during training. ``scoped_globals(seed)``
seeds python ``random``, numpy's global RNG and torch's CPU (and the training GPU's)
generator for one block (one sample's transform, one micro-batch, one evaluation batch) and
puts every one back afterwards, so a user's ``np.random.normal`` or ``random.random`` in a
transform or a task draws a pure function of the counters, and nothing leaks between blocks.

Derivation uses SHA-256, not Python's ``hash()``, which is salted per process.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
from collections.abc import Iterator
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


def numpy_seed_words(seed: int) -> np.ndarray:
    """The legacy numpy seed (two 32-bit words) for ``seed``: all 63 bits kept, so no two
    samples' streams collide the way ``seed % 2**32`` would over millions of samples."""
    derived = stable_hash(seed, "numpy")
    return np.array([derived & 0xFFFFFFFF, derived >> 32], dtype=np.uint32)


@contextlib.contextmanager
def scoped_globals(seed: int, device: torch.device | None = None) -> Iterator[None]:
    """Every global RNG seeded from ``seed`` for the block, then restored as it was.

    Closes: python ``random``, numpy's global RNG (``np.random.*``), torch's CPU generator
    and, when ``device`` is a GPU, its CUDA generator. torch and python take ``seed`` itself,
    numpy a derived seed (``numpy_seed_words``).
    """
    cuda = [device] if device is not None and torch.device(device).type == "cuda" else []
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=cuda):
        # The CPU and the training GPU only: the same streams as torch.manual_seed(seed),
        # at a hundredth of its cost (this runs once per sample and per micro-batch).
        torch.default_generator.manual_seed(seed)
        for gpu in cuda:
            with torch.cuda.device(gpu):
                torch.cuda.manual_seed(seed)
        random.seed(seed)
        np.random.seed(numpy_seed_words(seed))
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def microbatch_seed(train_seed: int, global_step: int, index: int, *scope: object) -> int:
    """The global RNGs' seed for micro-batch ``index`` (global over ranks) of a step;
    ``scope`` (``"eval", split``) keys evaluation batches apart from training ones."""
    return stable_hash(train_seed, global_step, index, *scope, "global")
