"""Callbacks, the lightning-hydra-template way: the ``callbacks`` config group (docs/callbacks.md).

Closes: a callback that changes the run's bits by drawing randomness: every hook runs inside
a guard that restores python's, NumPy's and torch's global generators (CPU and GPU) after it.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reprotrain.errors import ReprotrainError

BATCH_HOOK = "on_train_batch_end"


@dataclass
class CallbackContext:
    """What a hook may read: the run as it stands (not a copy)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    epoch: int
    global_step: int
    run_dir: Path
    replaying: bool = False  # a resume re-running steps to verify itself: no side effects
    is_main: bool = True  # rank 0 (under DDP every rank calls the hooks; one writes)
    # The values ``log`` collected for the loggers (``Callbacks.logged``, bound by ``call``).
    logged: dict[str, float] = field(default_factory=dict)

    def log(self, name: str, value: float) -> None:
        """Send ``value`` to the loggers as ``name`` with the epoch's row; never recorded."""
        self.logged[str(name)] = float(value)


class Callback:
    """The base of a callback: five hooks that do nothing, and no state."""

    def on_start(self, ctx: CallbackContext) -> None:
        """Once per training process, after the restore (a replay runs it too)."""

    def on_epoch_end(self, ctx: CallbackContext, row: dict[str, Any]) -> None:
        """After the epoch's metrics row, before its checkpoint (also while replaying)."""

    def on_train_batch_end(self, ctx: CallbackContext, step: int) -> None:
        """After every optimizer step (``step``: global), only when some callback overrides it."""

    def on_checkpoint(self, ctx: CallbackContext, path: Path) -> None:
        """Before a step checkpoint is written to ``path`` (the file does not exist yet, so
        what the callback changes is in it), where an uninterrupted run writes one (also
        while replaying: ``path`` is then never written)."""

    def on_end(self, ctx: CallbackContext, final_metrics: dict[str, Any]) -> None:
        """Once, when the run completes, with run.json's ``final_metrics``."""


class LearningRateMonitor(Callback):
    """Each parameter group's lr (and momentum) at every epoch's end, to the loggers as
    ``lr/group<i>``: the values the next step uses (it only reads the optimizer)."""

    def __init__(self, log_momentum: bool = False) -> None:
        self.log_momentum = log_momentum

    def on_epoch_end(self, ctx: CallbackContext, row: dict[str, Any]) -> None:
        for i, group in enumerate(ctx.optimizer.param_groups):
            ctx.log(f"lr/group{i}", group["lr"])
            momentum = group.get("momentum", group.get("betas", (None,))[0])
            if self.log_momentum and momentum is not None:
                ctx.log(f"momentum/group{i}", momentum)


@contextlib.contextmanager
def rng_guard(device: torch.device) -> Iterator[None]:
    """Python's, NumPy's and torch's global generators (CPU, GPU ``device``) restored after."""
    cuda = [device] if torch.device(device).type == "cuda" else []
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


class Callbacks:
    """The run's callbacks by name, in config order: one Stateful part, one call per hook."""

    def __init__(self, callbacks: dict[str, Callback], device: torch.device, lr_set_by=None):
        self.callbacks, self.device = callbacks, device
        # Found once: without one the loop builds no context per step.
        self.per_batch = {n: cb for n, cb in callbacks.items() if overrides(cb, BATCH_HOOK)}
        self.logged: dict[str, float] = {}  # ctx.log's values, until the loggers take them
        self.lr_set_by = lr_set_by  # the per-step schedule that overwrites a callback's lr, or None

    def call(self, hook: str, ctx: CallbackContext, *args: Any) -> None:
        watched = self.lr_set_by is not None and hook != "on_end"  # after on_end: no step
        ctx.logged = self.logged
        chosen = self.per_batch if hook == BATCH_HOOK else self.callbacks
        for name, callback in chosen.items():
            before = _lrs(ctx.optimizer) if watched else None
            with rng_guard(self.device):
                getattr(callback, hook)(ctx, *args)
            if watched and (after := _lrs(ctx.optimizer)) != before:
                raise ReprotrainError(
                    f"callback {name} changed the lr in {hook} ({before[0]:.6g} -> "
                    f"{after[0]:.6g}), but the schedule {self.lr_set_by} sets the lr after "
                    "every step and would overwrite it: use scheduler=none (the callbacks own "
                    "the lr) or scheduler=plateau (it scales the lr they set)"
                )

    def take_logged(self, row: dict[str, Any] | None = None) -> dict[str, Any]:
        """``row`` plus the values ``ctx.log`` collected under names it lacks; none held after."""
        taken, self.logged = self.logged, {}
        row = dict(row or {})
        return row | {name: value for name, value in taken.items() if name not in row}

    def state_dict(self) -> dict[str, Any]:
        return {name: cb.state_dict() for name, cb in self.callbacks.items() if _stateful(cb)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, cb in self.callbacks.items():
            if _stateful(cb) and name in state:
                cb.load_state_dict(state[name])

    def has_state(self) -> bool:
        return any(_stateful(cb) for cb in self.callbacks.values())

    def __bool__(self) -> bool:
        return bool(self.callbacks)


def overrides(callback: Any, hook: str) -> bool:
    """Whether ``callback``'s class defines ``hook`` other than :class:`Callback`'s no-op."""
    return getattr(type(callback), hook, None) not in (None, getattr(Callback, hook))


def _lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    return [float(group["lr"]) for group in optimizer.param_groups]


def _stateful(callback: Any) -> bool:
    return hasattr(callback, "state_dict") and hasattr(callback, "load_state_dict")


__all__ = ["Callback", "CallbackContext", "Callbacks", "LearningRateMonitor", "rng_guard"]
