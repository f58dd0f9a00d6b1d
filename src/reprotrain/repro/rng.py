"""Global RNG states for an exact resume: python, numpy, torch CPU and the training GPU.

Closes: RNG drift across a resume (docs/resume.md). Only the training device's CUDA generator
is saved (a checkpoint from 8 visible GPUs resumes where 1 is visible), one state per rank::

    {"format": 2, "world_size": N, "ranks": [state_rank0, state_rank1, ...]}
    state = {"python": {...}, "numpy": {...}, "torch_cpu": ByteTensor,
             "cuda": {"device_index": i, "state": ByteTensor} | None}

All ints, floats, None, lists and tensors: ``torch.load(weights_only=True)`` reads it.
"""

from __future__ import annotations

import _random
import ctypes
import logging
import random
import struct
from typing import Any

import numpy as np
import torch

from reprotrain.repro.seeding import numpy_seed_words, restore_numpy_global, save_numpy_global

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
    words = torch.tensor(py[1], dtype=torch.int64)
    python = {"version": py[0], "state": words, "gauss_next": py[2]}
    numpy = {"key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos)}
    numpy |= {"has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return {"python": python, "numpy": numpy, "torch_cpu": torch.get_rng_state(), "cuda": cuda}


def restore(state: dict[str, Any], device: torch.device, rank: int = 0) -> None:
    """Put a per-rank entry's (or one rank's) states back; the CUDA stream goes to ``device``,
    whatever ordinal it was recorded on."""
    device = torch.device(device)
    state = for_rank(state, rank)
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    n = state["numpy"]
    key = n["key"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", key, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch_cpu"])
    cuda = _cuda_state(state, device)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, _cuda_index(device))


def _cuda_state(state: dict[str, Any], device: torch.device) -> torch.Tensor | None:
    """The saved CUDA generator state meant for ``device``, or None (with the reason)."""
    cuda = state.get("cuda")
    if device.type != "cuda":
        if cuda is not None:
            held = f"checkpoint holds the CUDA RNG state of cuda:{cuda['device_index']}"
            log.warning("%s; this run is on %s, so it is not restored", held, device.type)
        return None
    if cuda is None:
        log.warning("checkpoint was written on a CPU run: no CUDA RNG state to restore")
        return None
    return cuda["state"]


# Python's global ``random`` is a C object holding ``int index; uint32_t state[624]`` right
# after its object header; numpy's legacy MT19937 holds ``uint32_t key[624]; int pos``, and
# its seeding is the same ``init_by_array`` as Python's over the seed's 32-bit words. So a
# spare Python ``Random`` seeded with ``seed`` (numpy's key) gives the 2,500 bytes that
# ``random.seed`` (``np.random.seed``) would leave (:func:`seed_states`): :class:`Scoped`
# copies them in, and the states it saves out and back. The layouts are checked against
# ``getstate`` and ``np.random.seed`` first; any other takes the general route.
_PY_BYTES = 4 + 624 * 4
_SPARE = random.Random()


def _state_address(generator: random.Random) -> int | None:
    """Where a ``random.Random`` keeps its index and words, if laid out as described."""
    address = id(generator) + object.__basicsize__
    _, words, _ = generator.getstate()
    expected = struct.pack("=i624I", words[-1], *words[:-1])
    return address if ctypes.string_at(address, _PY_BYTES) == expected else None


_PY_AT, _SPARE_AT = _state_address(random._inst), _state_address(_SPARE)


def _seeded_bytes(key: int) -> bytes:
    """The spare's index and words once seeded with ``key``."""
    _random.Random.seed(_SPARE, key)
    return ctypes.string_at(_SPARE_AT, _PY_BYTES)


def seed_states(seed: int) -> tuple[int, bytes | None, bytes | None, tuple[int, int]]:
    """What :class:`Scoped` puts in for ``seed``: (seed, python's state bytes, numpy's MT19937
    bytes, numpy's two seed words); a None where that generator is seeded the general way."""
    lo, hi = numpy_seed_words(seed)
    if _SPARE_AT is None:
        return seed, None, None, (lo, hi)
    python = _seeded_bytes(seed) if _PY_AT is not None else None
    mt = None
    if hi:  # hi == 0: Python's key would be one word, numpy's two
        spare = _seeded_bytes((hi << 32) | lo)
        mt = spare[4:] + spare[:4]  # numpy keeps the position (624 in both) after the words
    return seed, python, mt, (lo, hi)


def _numpy_route(bit_generator: Any, mt: bytes | None) -> bool:
    """Whether ``mt`` may be copied into this generator: whether the spare's words give
    ``np.random.seed``'s state for it, checked once per generator (its state put back)."""
    ok = _SPARE_CHECKED.get(id(bit_generator))
    if mt is None or ok is not None:
        return bool(ok) and mt is not None
    saved, (_, _, check, words) = np.random.get_state(), seed_states(_CHECK_SEED)
    try:
        np.random.seed(np.array(words, dtype=np.uint32))
        expected = np.random.get_state()[1:3]
        np.random.standard_normal(size=3)  # move it off the seeded state
        ctypes.memmove(bit_generator.ctypes.state_address, check, _PY_BYTES)
        key, pos = np.random.get_state()[1:3]
        _SPARE_CHECKED[id(bit_generator)] = bool(pos == expected[1] and (key == expected[0]).all())
    finally:
        np.random.set_state(saved)
    return _SPARE_CHECKED[id(bit_generator)]


_CHECK_SEED = 0x5EED_1234_ABCD
_SPARE_CHECKED: dict[int, bool] = {}


class Scoped:
    """Every global RNG seeded from ``seed`` for the block, then restored as it was, by the
    cheapest exact routes (tested against the plain calls): the one guard of the global RNGs,
    per micro-batch and per batch.

    Closes: python ``random``, numpy's (``numpy_seed_words``) and torch's global RNGs (CPU,
    GPU ``device``)."""

    __slots__ = ("cuda", "saved", "states")

    def __init__(self, seed: int, device: torch.device | None = None) -> None:
        self.states = seed_states(seed)
        device = torch.device(device) if isinstance(device, str) else device
        self.cuda = device if device is not None and device.type == "cuda" else None

    def __enter__(self) -> None:
        (seed, python, mt, words), inst = self.states, random._inst
        py = ctypes.string_at(_PY_AT, _PY_BYTES) if _PY_AT is not None else inst.getstate()
        numpy_state, gauss = save_numpy_global(), inst.gauss_next
        cpu = torch.default_generator.get_state()
        gpu = torch.cuda.get_rng_state(self.cuda) if self.cuda is not None else None
        self.saved = (py, gauss, numpy_state, cpu, gpu)
        # The CPU and the training GPU only: torch.manual_seed's streams, at a hundredth of
        # its cost (it seeds every visible GPU).
        torch.default_generator.manual_seed(seed)
        if self.cuda is not None:
            with torch.cuda.device(self.cuda):
                torch.cuda.manual_seed(seed)
        if python is not None:
            ctypes.memmove(_PY_AT, python, _PY_BYTES)
        else:
            _random.Random.seed(inst, seed)  # random.seed(seed), without its type checks
        inst.gauss_next = None
        bit_generator = numpy_state[1] if numpy_state[0] == "words" else None
        if bit_generator is not None and _numpy_route(bit_generator, mt):
            ctypes.memmove(bit_generator.ctypes.state_address, mt, _PY_BYTES)
        else:
            np.random.seed(np.array(words, dtype=np.uint32))

    def __exit__(self, *exc: object) -> None:
        py, gauss, numpy_state, cpu, gpu = self.saved
        if _PY_AT is not None:
            ctypes.memmove(_PY_AT, py, _PY_BYTES)
            random._inst.gauss_next = gauss
        else:
            random.setstate(py)
        restore_numpy_global(numpy_state)
        torch.default_generator.set_state(cpu)
        if gpu is not None:
            torch.cuda.set_rng_state(gpu, self.cuda)


def for_rank(entry: dict[str, Any], rank: int = 0) -> dict[str, Any]:
    """This rank's state from a checkpoint entry (per-rank or a single state)."""
    if "ranks" not in entry:
        return entry
    ranks = entry["ranks"]
    if rank < len(ranks):
        return ranks[rank]
    held = f"checkpoint holds RNG states for {len(ranks)} rank(s), none for rank {rank}"
    log.warning("%s (world size changed); rank 0's state is used", held)
    return ranks[0]
