"""What a checkpoint could not restore, named: digests of the state no ``state_dict()`` holds
(docs/resume.md). Closes: a resume recorded as bitwise that is not.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import random
import sys
import sysconfig
import types
import typing
from typing import Any

import numpy as np
import torch
from torch import nn

from reprotrain import digest
from reprotrain.distributed import Dist
from reprotrain.repro import rng

# A module's code, not its state: what module_globals leaves out.
_CODE = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, functools.partial)
_CODE += (logging.Logger, typing.TypeVar)
BITWISE = "this resume cannot be bitwise"
_HELD_BY = {"model": "the model's state_dict()"} | dict.fromkeys(
    ("global", "class", "function", "environment"), "any state_dict()"
)  # by the path's first word


@functools.cache
def torch_own_attributes(base: type) -> frozenset[str]:
    """The attributes torch's ``base`` (Optimizer, LRScheduler) sets, lazy ones included."""
    param = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    param.grad = torch.zeros(1)
    optimizer.step()
    scheduler.step()
    optimizer.load_state_dict(optimizer.state_dict())
    scheduler.load_state_dict(scheduler.state_dict())
    if base is torch.optim.Optimizer:
        return frozenset(optimizer.__dict__)
    return frozenset(scheduler.__dict__) - {"lr_lambdas"}


def own_attributes(obj: Any) -> dict[str, Any]:
    """``instance_attributes`` less what torch's optimizer or scheduler base keeps itself."""
    attrs = digest.instance_attributes(obj)
    for base in (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler):
        if isinstance(obj, base):
            skip = torch_own_attributes(base)
            return {k: v for k, v in attrs.items() if k not in skip}
    return attrs


def user_modules(objects: list[Any]) -> tuple[list[types.ModuleType], list[str]]:
    """The user's code: the modules these objects' classes (or these functions) come from,
    every loaded module of those packages, and every user module their globals reach; and
    the other top-level modules reached (installed ones, the framework), whose own globals
    are not compared."""
    names = {getattr(x, "__module__", None) for obj in objects for x in (type(obj), obj)}
    start = [sys.modules.get(name) for name in names if isinstance(name, str)]
    roots = {m.__name__.split(".")[0] for m in start if m is not None and _user_module(m)}
    todo = [m for name, m in list(sys.modules.items()) if name.split(".")[0] in roots]
    found: dict[str, types.ModuleType] = {}
    beyond: set[str] = set()
    while todo:
        module = todo.pop()
        if not isinstance(module, types.ModuleType) or module.__name__ in found:
            continue
        if not _user_module(module):
            beyond.add(module.__name__.split(".")[0])
            continue
        found[module.__name__] = module
        for value in list(vars(module).values()):
            if isinstance(value, types.ModuleType):
                todo.append(value)
            elif isinstance(value, type | types.FunctionType):
                todo.append(sys.modules.get(getattr(value, "__module__", None) or ""))
    return [found[name] for name in sorted(found)], sorted(beyond - {"builtins"})


def user_state(modules: list[types.ModuleType]) -> dict[str, Any]:
    """Each user module's state by path: its data globals, its classes' own attributes, and
    what each of its functions and methods keeps between calls (:func:`function_state`)."""
    found: dict[str, Any] = {}
    for module in modules:
        for key, value in list(vars(module).items()):
            where = f"{module.__name__}.{key}"
            if key.startswith("__") or (
                isinstance(value, type | types.FunctionType) and value.__module__ != module.__name__
            ):
                continue  # imported code: its own module's
            if not isinstance(value, type):
                found |= _paths("global", where, value)
                continue
            for attr, item in list(vars(value).items()):
                if not attr.startswith("__") and not isinstance(item, property):
                    found |= _paths("class attribute", f"{where}.{attr}", item)
    return found


def _paths(place: str, where: str, value: Any) -> dict[str, Any]:
    """A value's path (a function's: one per part it keeps); none for code."""
    if isinstance(value, types.FunctionType | staticmethod | classmethod):
        return {f"function `{where}` {part}": v for part, v in digest.function_state(value).items()}
    return {} if isinstance(value, _CODE) else {f"{place} `{where}`": value}


# Variables the loggers' libraries set in the process when a run builds its loggers, which
# a resumed run does after its comparison.
LOGGER_ENV = ("WANDB_", "MLFLOW_")
# An address in this process that torch.compile's code loader publishes for its compiled
# modules: another value in every process, and no state of the run.
PROCESS_ADDRESS_ENV = "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"


def environment() -> dict[str, str]:
    """``os.environ`` by variable, less the loggers' own and torch.compile's address."""
    kept = [k for k in os.environ if not k.startswith(LOGGER_ENV) and k != PROCESS_ADDRESS_ENV]
    return {f"environment `{k}`": os.environ[k] for k in kept}


def _user_module(module: types.ModuleType) -> bool:
    file = getattr(module, "__file__", None)
    ours = module.__name__.split(".")[0] in ("reprotrain", "torch", "numpy")
    return bool(file) and not ours and not installed(file)


def installed(file: str) -> bool:
    """A file of the standard library or of an installed package, by its path or its target
    (the target looked up only where the path does not say: most modules are installed)."""
    return _installed_path(file) or _installed_path(os.path.realpath(file))


_SITE_DIRS = tuple(f"{os.sep}{name}{os.sep}" for name in ("site-packages", "dist-packages"))


def _installed_path(path: str) -> bool:
    return any(site in path for site in _SITE_DIRS) or path.startswith(_installed_roots())


@functools.cache
def _installed_roots() -> tuple[str, ...]:
    paths = [sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    return tuple(sorted({p + os.sep for p in (*paths, *map(os.path.realpath, paths))}))


# Values digested whole, never opened into their attributes' paths.
_WHOLE = (nn.Module, torch.Tensor, np.ndarray, random.Random, np.random.Generator, *_CODE)
_WHOLE += (np.random.RandomState, torch.Generator, types.MethodType)


def expanded(attrs: dict[str, Any], refs: dict[int, str], depth: int = 3) -> dict[str, Any]:
    """``attrs`` with each plain object opened into its attributes' dotted paths (``train_set.
    base.reads``), ``depth`` levels deep, so a difference names the value that changed; its
    class is a path of its own (``train_set.__class__``)."""
    out: dict[str, Any] = {}
    for name, value in attrs.items():
        if id(value) in refs:  # another owner (a wrapped scheduler's optimizer): compared
            out[name] = f"ref {refs[id(value)]}"  # there, by name here (its identity)
            continue
        opened = depth and hasattr(value, "__dict__")
        if not opened or isinstance(value, _WHOLE):
            out[name] = value
            continue
        out[f"{name}.__class__"] = type(value)
        inner = expanded(digest.instance_attributes(value), refs, depth - 1)
        out |= {f"{name}.{key}": item for key, item in inner.items()}
    return out


def not_compared(beyond: list[str], workers: int) -> list[str]:
    """What the digests cannot reach, for the record."""
    lines = [
        f"the own globals of the modules outside your code that it uses ({', '.join(beyond)}): "
        "installed packages and the framework, whose state is in its state_dicts",
        "the loggers and their variables (" + ", ".join(f"{p}*" for p in LOGGER_ENV) + "): "
        "built after the comparison, they only receive values",
        f"{PROCESS_ADDRESS_ENV}: an address torch.compile publishes, another in each process",
        "state no Python attribute holds: files your code writes, C libraries' own globals",
    ]
    if workers:
        lines.append(f"the datasets' copies in the {workers} loader worker processes")
    return lines


class ResumeAudit:
    """Digests at construction (before any restore or step), at each checkpoint, after a restore."""

    def __init__(self, task: Any, dataset: Any, model: nn.Module, device: torch.device,
                 step: Any = None, dist: Dist | None = None, trainer_state: Any = None,
                 pipeline: Any = None) -> None:  # fmt: skip
        # ``pipeline``: what serves the data (the splits and the datasets they wrap).
        self.owners = {"task": task, "dataset": dataset, "step": step, "data pipeline": pipeline}
        self.dist = dist or Dist()
        self.model, self.device = model, torch.device(device)
        # The optimizer, scheduler and callbacks, read at each digest (a replay may swap the
        # scheduler for the one the steps ran with).
        self.trainer_state = trainer_state
        self.digest = digest.Digester()
        self.recorded: dict[str, Any] | None = None
        self.compared: dict[str, int] | None = None  # paths the last comparison covered
        users = [*self._watched().values(), *self.model.modules()]
        scheduler = getattr(trainer_state, "scheduler", None)
        users += list(getattr(scheduler, "lr_lambdas", ()))
        # The user's modules, fixed here: a resumed process finds the same ones.
        self.modules, beyond = user_modules(users)
        self.not_compared = not_compared(beyond, getattr(pipeline, "num_workers", 0))
        self.baseline = self._attributes()

    def _watched(self) -> dict[str, Any]:
        """Every owner by the name its lines carry (``callback `name``` for a callback)."""
        owners = {k: v for k, v in self.owners.items() if v is not None}
        state = self.trainer_state
        if state is not None:
            owners |= {"optimizer": state.optimizer, "scheduler": state.scheduler}
            for name, callback in getattr(state.callbacks, "callbacks", {}).items():
                owners[f"callback `{name}`"] = callback
        return owners

    def _attributes(self) -> dict[str, tuple[str, str]]:
        """``{"task attribute `preds`": (digest, description)}`` for every watched path."""
        owners = self._watched()
        sha, found = self.digest, {}
        sha.refs = {id(obj): name for name, obj in owners.items()} | {id(self.model): "model"}
        for owner, obj in owners.items():
            for name, value in expanded(own_attributes(obj), sha.refs).items():
                found[f"{owner} attribute `{name}`"] = value
        for path, module in self.model.named_modules():
            for name, value in digest.module_attributes(module).items():
                found[f"model attribute `{f'{path}.{name}' if path else name}`"] = value
        found |= user_state(self.modules) | environment()
        return {key: (sha(value), digest.describe(value)) for key, value in found.items()}

    def _rngs(self) -> dict[str, str]:
        state = rng.capture(self.device)
        named = {"python": "python", "numpy": "numpy", "torch": "torch_cpu", "cuda": "cuda"}
        return {name: self.digest(state[key]) for name, key in named.items()}

    def state_dict(self) -> dict[str, Any]:
        """Changed-since-construction attributes (digest, description) and RNG digests."""
        now = self._attributes()
        changed = {k: list(v) for k, v in now.items() if self.baseline.get(k) != v}
        gone = [k for k in self.baseline if k not in now]
        return {"version": 2, "changed": changed, "removed": gone, "rngs": self._rngs()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recorded = state

    def unrestored(self) -> list[str]:
        """One line per difference from the checkpoint's digests (rank 0's, on every rank)."""
        return self.dist.broadcast_object(self._compare() if self.dist.is_main else [])

    def _compare(self) -> list[str]:
        if self.recorded is None:
            return []
        now, lines = self._attributes(), []
        changed = {k: tuple(v) for k, v in self.recorded["changed"].items()}
        removed = set(self.recorded["removed"])
        keys = sorted(set(changed) | set(now) | set(self.baseline))
        places = [key.split(" `")[0].removesuffix(" attribute") for key in keys]
        places += ["global RNG"] * len(self.recorded["rngs"])
        self.compared = dict(sorted(collections.Counter(places).items()))
        for key in keys:
            want = changed.get(key, None if key in removed else self.baseline.get(key))
            got = now.get(key)
            if (want and want[0]) == (got and got[0]):
                continue
            shown = (want or got)[1]
            where = _HELD_BY.get(key.split(" ", 1)[0], "its state_dict()")
            lines.append(f"{key} ({shown}) is not in {where}: {BITWISE}")
        drawn = "was drawn from outside the framework's seeded scopes and is not re-derived"
        for name, taken in self._rngs().items():
            if taken != self.recorded["rngs"][name]:
                lines.append(f"the global {name} RNG {drawn} on resume: {BITWISE}")
        return lines
