"""Hydra's own ``_target_`` allowlist, fed by what the trust gate admitted (Hydra 1.4 refuses a
target resolved outside one; 1.5 will). One home for every ``instantiate`` of the package:
the components' build, the loggers, the Optuna sampler, the sweep callbacks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import hydra
from hydra._internal.utils import _locate
from omegaconf import DictConfig, ListConfig, OmegaConf


def targets_in(node: Any) -> set[str]:
    """Every ``_target_`` a config node names, at any depth: all that building it may call."""
    if isinstance(node, DictConfig | ListConfig):
        node = OmegaConf.to_container(node, resolve=False)
    found, todo = set(), [node]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            found |= {str(v) for k, v in item.items() if k == "_target_"}
            todo += list(item.values())
        elif isinstance(item, list):
            todo += item
    return found


def allowing(targets: Iterable[str]) -> contextlib.AbstractContextManager:
    """Hydra's own ``_target_`` allowlist holding exactly ``targets`` around the instantiates
    inside (Hydra 1.4: ``execution_whitelist``; its first candidates: ``target_whitelist``;
    1.3 has none: a no-op). What goes in is what the trust gate decided on: a config from a
    directory is built only under its Permit, and the trainer's own config is the user's, so
    the allowlist is the gate's decision (``targets_in`` of what was admitted), not a second
    list written by hand. Hydra then refuses anything else a node could smuggle in."""
    policy = getattr(hydra.utils, "execution_whitelist", None)
    policy = policy or getattr(hydra.utils, "target_whitelist", None)
    if policy is None:
        return contextlib.nullcontext()
    names = set(targets)
    for name in list(names):  # Hydra 1.4 also checks what a name resolves to, and a callable
        try:  # result by its class: the same objects, under their canonical names
            found = _locate(name)
        except Exception:  # not importable: instantiate says so, in its own words
            continue
        names.add(f"{found.__module__}.{found.__qualname__}")
    return policy(sorted(names))
