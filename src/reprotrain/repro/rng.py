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
import json
import logging
import random
import struct
from typing import Any

import numpy as np
import torch

from reprotrain.errors import CheckpointError, ResumeError
from reprotrain.repro.seeding import numpy_seed_words

log = logging.getLogger("reprotrain")

FORMAT = 2


def _cuda_index(device: torch.device) -> int:
    """The ordinal behind ``cuda`` (no index means the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def capture(device: torch.device) -> dict[str, Any]:
    """This process's RNG states: python, numpy, torch CPU and ``device``'s CUDA generator."""
    device = torch.device(device)
    py = random.getstate()
    cuda = None
    if device.type == "cuda":
        index = _cuda_index(device)
        cuda = {"device_index": index, "state": torch.cuda.get_rng_state(index)}
    words = torch.tensor(py[1], dtype=torch.int64)
    python = {"version": py[0], "state": words, "gauss_next": py[2]}
    numpy = _numpy_state()
    return {"python": python, "numpy": numpy, "torch_cpu": torch.get_rng_state(), "cuda": cuda}


def _numpy_state() -> dict[str, Any]:
    """numpy's global RNG: MT19937's words (the default), or any other of numpy's own bit
    generators, which user code may install at any moment (``np.random.set_bit_generator``),
    by name and state (``weights_only`` loads it)."""
    cls = type(np.random.get_bit_generator())
    if cls is np.random.MT19937:
        key, pos, has_gauss, cached = np.random.get_state()[1:]
        numpy = {"key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos)}
        return numpy | {"has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    if _numpy_bit_generator(cls.__name__) is not cls:
        raise ResumeError(
            f"numpy's global bit generator is {cls.__module__}.{cls.__qualname__}, which a "
            "checkpoint cannot restore; install one of numpy's own "
            "(np.random.set_bit_generator(np.random.PCG64(seed))) or draw from your own Generator"
        )
    state = json.dumps(np.random.get_state(legacy=False), default=np.ndarray.tolist)
    return {"bit_generator": cls.__name__, "state": json.loads(state)}  # arrays as lists


def _numpy_bit_generator(name: str) -> type | None:
    """numpy's own bit generator class by name (a checkpoint names no other code)."""
    cls = getattr(np.random, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, np.random.BitGenerator) else None


def restore(state: dict[str, Any], device: torch.device, rank: int = 0) -> None:
    """Put a per-rank entry's (or one rank's) states back; the CUDA stream goes to ``device``,
    whatever ordinal it was recorded on; numpy's global bit generator is the saved one."""
    device = torch.device(device)
    state = for_rank(state, rank)
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    n = state["numpy"]
    name = n.get("bit_generator", "MT19937")
    if (cls := _numpy_bit_generator(name)) is None:
        raise CheckpointError(f"the checkpoint's numpy bit generator {name!r} is not numpy's")
    if type(np.random.get_bit_generator()) is not cls:
        np.random.set_bit_generator(cls())
    if "state" in n:
        np.random.set_state(n["state"])
    else:
        key = n["key"].numpy().astype(np.uint32)
        np.random.set_state(("MT19937", key, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch_cpu"])
    if (cuda := _cuda_state(state, device)) is not None:
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


# The guard copies states by memory, each layout checked once against the plain calls (any
# other layout takes the general route, tested the same):
# - Python's global ``random`` is a C object holding ``int index; uint32_t state[624]`` right
#   after its object header: saved and put back as 2,500 bytes.
# - numpy's global RNG is a legacy RandomState over MT19937: the bit generator's ``uint32_t
#   key[624]; int pos`` and the RandomState's cached Gaussian (``int has_gauss; double
#   gauss``). ``np.random.get_state``/``set_state`` copy the words one Python call at a time
#   (~50-100 us each way, more than a null model's whole step).
# - ``np.random.seed(words)`` is the same ``init_by_array`` over the same 32-bit words as
#   ``random.seed`` of their integer, so a spare Python ``Random`` seeded with it holds the
#   words numpy would (its index first, numpy's position last).
_PY_BYTES = 4 + 624 * 4
_MT_WORDS = 624 * 4 + 4
_GAUSS_BYTES = 16  # int has_gauss, padding, double gauss
_NO_GAUSS = bytes(_GAUSS_BYTES)  # what np.random.seed leaves: none cached
_SPARE = random.Random()


def _state_address(generator: random.Random) -> int | None:
    """Where a ``random.Random`` keeps its index and words, if laid out as described."""
    address = id(generator) + object.__basicsize__
    _, words, _ = generator.getstate()
    expected = struct.pack("=i624I", words[-1], *words[:-1])
    return address if ctypes.string_at(address, _PY_BYTES) == expected else None


def _gauss_address(state: np.random.RandomState) -> int | None:
    """Where the global RandomState keeps ``has_gauss`` and ``gauss``, found by setting a
    cached Gaussian and reading it back, then written and read back through ``get_state``."""
    if type(state._bit_generator) is not np.random.MT19937:  # set before this import
        return None
    saved, size = state.get_state(), type(state).__basicsize__
    probe, other = 1.2345678901234567, -7.654321098765432
    try:
        state.set_state((*saved[:3], 1, probe))
        at = ctypes.string_at(id(state), size).find(struct.pack("=d", probe)) - 8
        if at < object.__basicsize__ or at % 8:
            return None
        address = id(state) + at
        ctypes.memmove(address, struct.pack("=i4xd", 1, other), _GAUSS_BYTES)
        if state.get_state()[3:] != (1, other):
            return None
        state.set_state((*saved[:3], 0, 0.0))
        return address if ctypes.string_at(address, _GAUSS_BYTES) == _NO_GAUSS else None
    except (ValueError, TypeError):
        return None
    finally:
        state.set_state(saved)


def _mt_address(bit_generator: Any) -> int | None:
    """Where the global MT19937's words are, once they are checked to be laid out as
    ``get_state`` reads them; None (the general route) for any other generator."""
    if type(bit_generator) is not np.random.MT19937 or _GAUSS_AT is None:
        return None
    address = bit_generator.ctypes.state_address
    if _LAYOUTS.get(address) is None:
        _, key, pos, *_ = np.random.get_state()
        words = ctypes.string_at(address, _MT_WORDS)
        same = words[:-4] == key.astype(np.uint32).tobytes()
        _LAYOUTS[address] = same and int(np.frombuffer(words[-4:], np.int32)[0]) == pos
    return address if _LAYOUTS[address] else None


_PY_AT, _SPARE_AT = _state_address(random._inst), _state_address(_SPARE)
_GAUSS_AT = _gauss_address(np.random.mtrand._rand)
_LAYOUTS: dict[int, bool] = {}  # state address -> the words are where get_state reads them
_SPARE_CHECKED: dict[int, bool] = {}  # bit generator -> the spare gives np.random.seed's words
_CHECK_WORDS = (0x1234ABCD, 0x5EED)


def _save_numpy() -> tuple:
    """numpy's global RNG state, for :func:`_restore_numpy`: its bit generator, words and
    cached Gaussian by memory, else ``np.random.get_state()``."""
    bit_generator = np.random.get_bit_generator()
    if (address := _mt_address(bit_generator)) is None:
        return ("state", bit_generator, np.random.get_state(legacy=False))  # any generator
    words = ctypes.string_at(address, _MT_WORDS)
    return ("words", bit_generator, address, words, ctypes.string_at(_GAUSS_AT, _GAUSS_BYTES))


def _restore_numpy(saved: tuple) -> None:
    """What :func:`_save_numpy` saved put back: the same bit generator, words, position and
    cached Gaussian as ``np.random.set_state(np.random.get_state())`` would."""
    if np.random.get_bit_generator() is not saved[1]:  # the block swapped it
        np.random.set_bit_generator(saved[1])
    if saved[0] == "state":
        np.random.set_state(saved[2])
        return
    _, _, address, words, gauss = saved
    ctypes.memmove(address, words, _MT_WORDS)
    ctypes.memmove(_GAUSS_AT, gauss, _GAUSS_BYTES)


def _spare_into_numpy(address: int, lo: int, hi: int) -> None:
    """``np.random.seed([lo, hi])``'s state, through the spare: its words, position, no
    cached Gaussian."""
    _random.Random.seed(_SPARE, (hi << 32) | lo)
    ctypes.memmove(address, _SPARE_AT + 4, _MT_WORDS - 4)
    ctypes.memmove(address + _MT_WORDS - 4, _SPARE_AT, 4)  # the position: 624 in both
    ctypes.memmove(_GAUSS_AT, _NO_GAUSS, _GAUSS_BYTES)


def _spare_route(bit_generator: Any, address: int) -> bool:
    """Whether the spare gives ``np.random.seed``'s state for this generator: checked once
    per generator against the plain call (its state put back)."""
    if (ok := _SPARE_CHECKED.get(id(bit_generator))) is not None:
        return ok
    saved = _save_numpy()
    try:
        np.random.seed(np.array(_CHECK_WORDS, dtype=np.uint32))
        expected = np.random.get_state()
        np.random.standard_normal(size=3)  # off the seeded state, a Gaussian cached
        _spare_into_numpy(address, *_CHECK_WORDS)
        got = np.random.get_state()
        same = got[2:] == expected[2:] and bool((got[1] == expected[1]).all())
        _SPARE_CHECKED[id(bit_generator)] = same
    finally:
        _restore_numpy(saved)
    return _SPARE_CHECKED[id(bit_generator)]


def _seed_numpy(saved: tuple, seed: int) -> None:
    """numpy's global RNG as ``np.random.seed(numpy_seed_words(seed))`` leaves it."""
    lo, hi = numpy_seed_words(seed)
    # hi == 0: Python's key would be one word, numpy's two: numpy seeds itself.
    if hi and _SPARE_AT is not None and saved[0] == "words":
        bit_generator, address = saved[1], saved[2]
        if _spare_route(bit_generator, address):
            _spare_into_numpy(address, lo, hi)
            return
    np.random.seed(np.array((lo, hi), dtype=np.uint32))


class Scoped:
    """Every global RNG seeded from ``seed`` for the block, then restored as it was, by the
    cheapest exact routes (tested against the plain calls): the one guard of the global RNGs,
    per micro-batch and per batch.

    Closes: python ``random``, numpy's (``numpy_seed_words``) and torch's global RNGs (CPU,
    GPU ``device``)."""

    __slots__ = ("cuda", "saved", "seed")

    def __init__(self, seed: int, device: torch.device | None = None) -> None:
        self.seed = seed
        device = torch.device(device) if isinstance(device, str) else device
        self.cuda = device if device is not None and device.type == "cuda" else None

    def __enter__(self) -> None:
        seed, inst = self.seed, random._inst
        py = ctypes.string_at(_PY_AT, _PY_BYTES) if _PY_AT is not None else inst.getstate()
        numpy_state = _save_numpy()
        cpu = torch.default_generator.get_state()
        gpu = torch.cuda.get_rng_state(self.cuda) if self.cuda is not None else None
        self.saved = (py, inst.gauss_next, numpy_state, cpu, gpu)
        # The CPU and the training GPU only: torch.manual_seed's streams, at a hundredth of
        # its cost (it seeds every visible GPU).
        torch.default_generator.manual_seed(seed)
        if self.cuda is not None:
            with torch.cuda.device(self.cuda):
                torch.cuda.manual_seed(seed)
        _random.Random.seed(inst, seed)  # random.seed(seed), without its type checks
        inst.gauss_next = None
        _seed_numpy(numpy_state, seed)

    def __exit__(self, *exc: object) -> None:
        py, gauss, numpy_state, cpu, gpu = self.saved
        if _PY_AT is not None:
            ctypes.memmove(_PY_AT, py, _PY_BYTES)
            random._inst.gauss_next = gauss
        else:
            random.setstate(py)  # its cached gauss too
        _restore_numpy(numpy_state)
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
