"""Digests of any value's content: the ground floor's one digester of Python objects, which
the resume audit (``resume/audit.py``: what a checkpoint could not restore) and the sample
purity check (``data/purity.py``: a sample a pure function of its key) both compare by.
Stable across processes: an object by its attributes, a tensor by its bytes.
On the ground floor: every stage may import it; it imports no stage (tests/test_layering.py).
"""

from __future__ import annotations

import hashlib
import random
import struct
import types
from pathlib import PurePath
from typing import Any

import numpy as np
import torch
from torch import nn

# torch's own bookkeeping on every module (parameters, buffers, hooks, training flag).
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)
# Caches torch, DDP and torch.compile set on modules lazily.
_TORCH_CACHES = ("_torch", "_dynamo", "_ddp", "_compiled", "_orig_mod", "_is_full_backward")
_MAX_DEPTH = 6
_BIG_TENSOR = 1 << 20  # bytes: above this a tensor's digest is kept while it is unchanged


def describe(value: Any) -> str:
    """What a value is, for a person: ``list, 250 items``, ``Tensor [3, 4]``, ``int``."""
    name = type(value).__name__
    if isinstance(value, torch.Tensor | np.ndarray):
        return f"{name} {list(value.shape)}"
    if isinstance(value, list | tuple | dict | set | frozenset):
        return f"{name}, {len(value)} items"
    return name


class Digester:
    """sha256 of a value's content, stable across processes (objects by their attributes)."""

    def __init__(self) -> None:
        self._tensors: dict[int, tuple[torch.Tensor, int, str]] = {}
        # Objects digested by name where another one holds them (a scheduler's optimizer,
        # a callback's model): their state is compared where they are owners.
        self.refs: dict[int, str] = {}

    def __call__(self, value: Any) -> str:
        h = hashlib.sha256()
        self._feed(h, value, 0, set())
        return h.hexdigest()

    def _feed(self, h, value: Any, depth: int, seen: set[int]) -> None:
        h.update(type(value).__qualname__.encode() + b"\0")
        if value is None or isinstance(value, bool | int | float | complex | str | bytes):
            h.update(repr(value).encode() + b"\0")
        elif isinstance(value, torch.Tensor):
            h.update(self._tensor(value).encode())
        elif isinstance(value, np.ndarray):
            if value.dtype == object:
                self._feed(h, value.tolist(), depth + 1, seen)
            else:
                h.update(str((value.dtype.str, value.shape)).encode())
                h.update(np.ascontiguousarray(value).tobytes())
        elif isinstance(value, np.generic):
            h.update(repr(value.item()).encode())
        elif isinstance(value, PurePath):  # by its text (its slots cache what it computed)
            h.update(str(value).encode())
        elif isinstance(value, types.BuiltinFunctionType | type):
            h.update(getattr(value, "__qualname__", "").encode())  # code, not state
        elif isinstance(value, types.MethodType):
            h.update(value.__func__.__qualname__.encode())
        elif depth and id(value) in self.refs:
            h.update(f"ref {self.refs[id(value)]}".encode())
        elif id(value) not in seen and depth <= _MAX_DEPTH:
            self._contents(h, value, depth + 1, seen | {id(value)})

    def _contents(self, h, value: Any, depth: int, seen: set[int]) -> None:
        """What a container, generator, function or object holds (``depth``: its items')."""
        if isinstance(value, types.FunctionType):  # its code by name, what it keeps by value
            h.update(value.__qualname__.encode())
            self._feed(h, function_state(value), depth, seen)
        elif isinstance(value, random.Random):
            self._feed(h, value.getstate(), depth, seen)
        elif isinstance(value, np.random.Generator):
            self._feed(h, value.bit_generator.state, depth, seen)
        elif isinstance(value, np.random.RandomState):
            self._feed(h, value.get_state(legacy=False), depth, seen)
        elif isinstance(value, torch.Generator):
            h.update(value.get_state().numpy().tobytes())
        elif isinstance(value, dict):
            h.update(struct.pack("<q", len(value)))
            for k, v in value.items():
                self._feed(h, k, depth, seen)
                self._feed(h, v, depth, seen)
        elif isinstance(value, list | tuple):
            h.update(struct.pack("<q", len(value)))
            for v in value:
                self._feed(h, v, depth, seen)
        elif isinstance(value, set | frozenset):
            for item in sorted(self(v) for v in value):
                h.update(item.encode())
        elif isinstance(value, nn.Module):
            for path, module in value.named_modules():
                self._feed(h, path, depth, seen)
                self._feed(h, module_attributes(module), depth, seen)
            self._feed(h, dict(value.state_dict()), depth, seen)
        elif hasattr(value, "__dict__") or hasattr(type(value), "__slots__"):
            self._feed(h, instance_attributes(value), depth, seen)

    def _tensor(self, t: torch.Tensor) -> str:
        """A tensor's content digest; a big one unchanged (same object and version) is kept."""
        if t.is_sparse or t.is_quantized or t.is_meta:
            return f"{t.dtype}{list(t.shape)}:{t.layout}"
        big = t.numel() * t.element_size() > _BIG_TENSOR
        if big and (seen := self._tensors.get(id(t))) is not None:
            held, version, digest = seen
            if held is t and version == t._version:
                return digest
        raw = tensor_bytes(t).numpy().tobytes()
        digest = hashlib.sha256(f"{t.dtype}{list(t.shape)}".encode() + raw).hexdigest()
        if big:
            self._tensors[id(t)] = (t, t._version, digest)
        return digest


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's content as flat uint8 on the CPU: what two tensors' bits are compared by."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)


def instance_attributes(obj: Any) -> dict[str, Any]:
    """``__dict__`` and ``__slots__``, less the class's ``cache_attributes``."""
    skip = set(getattr(type(obj), "cache_attributes", ()))
    found = {k: v for k, v in getattr(obj, "__dict__", {}).items() if k not in skip}
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in skip and name != "__dict__" and hasattr(obj, name):
                found[name] = getattr(obj, name)
    return found


def module_attributes(module: nn.Module) -> dict[str, Any]:
    """A module's own attributes and non-persistent buffers, less torch's bookkeeping."""
    attrs = instance_attributes(module)
    own = [k for k in attrs if k not in _MODULE_INTERNALS and not k.startswith(_TORCH_CACHES)]
    found = {k: attrs[k] for k in own}
    for name in sorted(getattr(module, "_non_persistent_buffers_set", ())):
        if module._buffers.get(name) is not None:
            found[f"{name} [non-persistent buffer]"] = module._buffers[name]
    return found


def closure_cells(function: types.FunctionType) -> dict[str, Any]:
    """What a function's closure holds, by free variable name (a ``LambdaLR`` lambda's count)."""
    found = {}
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or (), strict=True):
        try:
            found[name] = cell.cell_contents
        except ValueError:  # an empty cell
            found[name] = None
    return found


def function_state(function: Any) -> dict[str, Any]:
    """What a function keeps between calls, by part: its defaults (a mutable default
    argument), keyword defaults, attributes (``f.count += 1``) and closure cells."""
    function = getattr(function, "__func__", function)  # a staticmethod's or classmethod's
    parts = {"defaults": function.__defaults__, "keyword defaults": function.__kwdefaults__}
    parts |= {f"attribute `{k}`": v for k, v in vars(function).items()}
    parts |= {f"closure `{k}`": v for k, v in closure_cells(function).items()}
    return {k: v for k, v in parts.items() if v is not None}
