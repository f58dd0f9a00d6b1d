"""Callbacks, the lightning-hydra-template way: the ``callbacks`` config group.

``callbacks=default`` (``conf/callbacks/default.yaml``) is a mapping of names to
``_target_`` nodes, built like every other component; add your own the same way
(``+callbacks.my_name._target_=my_package.callbacks.MyCallback`` or a YAML of your own).
A callback subclasses :class:`Callback` and overrides any of five hooks:

- ``on_start(ctx)``: once per training process, after a resume's restore and replay (set-up,
  a model summary); a resume's replay runs it first too;
- ``on_epoch_end(ctx, row)``: after an epoch's metrics row (validation included), before
  its fingerprint and checkpoint, so what the callback keeps (or edits) is in both;
- ``on_train_batch_end(ctx, step)``: after every optimizer step (``step``: the global step
  just taken); called only when a callback overrides it, decided once when the callbacks
  are built, so a run without one pays nothing per step;
- ``on_checkpoint(ctx, path)``: before each step checkpoint is written (``path``), where an
  uninterrupted run writes one (a preemption's checkpoint elsewhere calls none);
- ``on_end(ctx, final_metrics)``: once, when the run completes, on the last weights.

``ctx.log(name, value)`` sends a number to the run's loggers (TensorBoard, MLflow, W&B, CSV,
a user's): it joins the epoch's row as the loggers receive it (``epoch/<name>``; a value
logged in ``on_end`` comes after the last row and is not sent). It never enters
metrics.jsonl, fingerprints.jsonl or a checkpoint, so it changes no bit of the record.

``ctx`` (:class:`CallbackContext`) hands the bare model, the optimizer, the loop position,
the run directory and ``replaying``: a resume re-runs the interval before its checkpoint to
prove its bits (docs/resume.md) and calls ``on_start``, ``on_epoch_end`` and
``on_checkpoint`` there too, so a callback's state evolves as it did; skip side effects
(printing, files) when ``ctx.replaying`` is true.

A callback with state gives ``state_dict()``/``load_state_dict()``: the callbacks are one
part of the trainer's state (``TrainerState.callbacks``), so their state is checkpointed,
restored on resume and compared bit for bit by the resume's replay like the model's.

A callback that sets the lr (``ctx.optimizer.param_groups[i]["lr"]``) owns it under
``scheduler=none``, and under a schedule stepped on the metric (``scheduler=plateau``: it
scales the lr the callback set); under a per-step schedule, which sets the lr after every
step and would silently overwrite it, the change is refused in one line naming the callback
and the hook (``optim.py`` has the three kinds).

Closes: a callback that changes the run's bits by drawing randomness. Every hook runs inside
a guard that restores python's, NumPy's and torch's global generators (CPU and the
training GPU) after it, so a callback that samples, shuffles or builds a tensor with
``torch.rand`` leaves the training streams where they were.
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
        """Send ``value`` to the run's loggers as ``name`` with the epoch's row (the last
        value of a name in an epoch; none from ``on_end``, after the last row). A name the
        row already has keeps the row's value. Never written to the record."""
        self.logged[str(name)] = float(value)


class Callback:
    """The base of a callback: five hooks that do nothing, and no state."""

    def on_start(self, ctx: CallbackContext) -> None:
        """Once per training process, after the restore (and a resume's replay, which runs
        it first too: ``ctx.replaying``)."""

    def on_epoch_end(self, ctx: CallbackContext, row: dict[str, Any]) -> None:
        """After the epoch's metrics row, before its checkpoint (also while replaying)."""

    def on_train_batch_end(self, ctx: CallbackContext, step: int) -> None:
        """After every optimizer step, ``step`` the global step just taken (also while
        replaying). Called only when some callback overrides it."""

    def on_checkpoint(self, ctx: CallbackContext, path: Path) -> None:
        """Before a step checkpoint is written to ``path`` (the file does not exist yet, so
        what the callback changes is in it), where an uninterrupted run writes one (also
        while replaying: ``path`` is then never written)."""

    def on_end(self, ctx: CallbackContext, final_metrics: dict[str, Any]) -> None:
        """Once, when the run completes, with run.json's ``final_metrics``."""


class LearningRateMonitor(Callback):
    """``conf/callbacks/lr_monitor.yaml``: each parameter group's lr (and momentum, the first
    beta for Adam) at every epoch's end, sent to the loggers with the epoch's row as
    ``lr/group<i>`` (``momentum/group<i>``): the optimizer's current values, which the next
    step uses (the row's ``lr`` is the one the epoch's last step used). It only reads the
    optimizer: no bit changes."""

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
    """Python's, NumPy's and torch's global generators (CPU and ``device`` when it is a GPU)
    as they were before the block."""
    cuda = [device] if torch.device(device).type == "cuda" else []
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


class Callbacks:
    """The run's callbacks by name, in config order: one Stateful part of the trainer's
    state (``state_dict`` holds each callback's that has one) and one call per hook."""

    optional = True  # a checkpoint written before callbacks existed loads without the part

    def __init__(self, callbacks: dict[str, Callback], device: torch.device,
                 lr_set_by: str | None = None) -> None:  # fmt: skip
        self.callbacks, self.device = callbacks, device
        # The callbacks that override the per-batch hook, found once here: without one the
        # loop never builds a context or calls a hook per step.
        self.per_batch = {n: cb for n, cb in callbacks.items() if overrides(cb, BATCH_HOOK)}
        self.logged: dict[str, float] = {}  # ctx.log's values, until the loggers take them
        # The per-step schedule that sets the lr after every step (optim.kind "step"), or
        # None (scheduler=none, or one stepped on the metric): who a callback's lr meets.
        self.lr_set_by = lr_set_by

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
        """A copy of ``row`` with the values ``ctx.log`` collected since the last call under
        the names it lacks (the row's own values win); none are held after."""
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
