"""Callbacks, the lightning-hydra-template way: the ``callbacks`` config group (docs/callbacks.md),
with Lightning's early stopping, model checkpoint and lr monitor under Lightning's keys.

Closes: a callback that changes the run's bits by drawing randomness: every hook runs inside
a guard that restores python's, NumPy's and torch's global generators (CPU and GPU) after it;
and a callback's decision lost by a resume: what early stopping and model checkpoint hold
(best value, epochs without improvement, the checkpoints kept) is their ``state_dict``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reprotrain.errors import ReprotrainError
from reprotrain.repro.checkpoint import step_of, step_path
from reprotrain.run.record import atomic_write_bytes

log = logging.getLogger("reprotrain")
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
    # The values ``log`` collected for the loggers (bound by ``Callbacks.call``).
    logged: dict[str, float] = field(default_factory=dict)
    stop_reason: dict[str, Any] | None = None  # set by ``stop``

    def log(self, name: str, value: float) -> None:
        """Send ``value`` to the loggers as ``name``: in ``on_train_batch_end`` at this global
        step, elsewhere with the epoch's row; never recorded. Nothing while replaying: the
        value was logged when the step first ran."""
        if not self.replaying:
            self.logged[str(name)] = float(value)

    def stop(self, why: str, **details: Any) -> None:
        """End the run after this epoch (asked in ``on_epoch_end``; not after the last one):
        run.json's ``early_stopped`` is the epoch and ``details``, the log says ``why``."""
        self.stop_reason = {"why": why, **details}


class Callback:
    """The base of a callback: six hooks that do nothing, and no state. ``skips``: hooks an
    instance leaves out although its class defines them (read once, when built)."""

    skips: tuple[str, ...] = ()

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

    def on_checkpoint_written(self, ctx: CallbackContext, path: Path) -> None:
        """After ``on_checkpoint``'s checkpoint is on disk at ``path`` (never while replaying)."""

    def on_end(self, ctx: CallbackContext, final_metrics: dict[str, Any]) -> None:
        """Once, when the run completes, with run.json's ``final_metrics``."""


def _mode(mode: str) -> str:
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be min or max, not {mode!r}")
    return mode


def monitored(row: dict[str, Any], monitor: str, owner: str) -> float | None:
    """``row[monitor]``; None when its split was not evaluated this epoch; a name the run
    never logs is refused in one line (a typo would otherwise never stop or keep anything)."""
    if monitor in row:
        return row[monitor]
    split = monitor.partition("_")[0] + "_"
    if any(k.startswith(split) for k in row):
        names = ", ".join(k for k in row if k.partition("_")[0] in ("train", "val"))
        raise ReprotrainError(f"{owner}: monitor={monitor} is not a metric of this run: {names}")
    return None


class EarlyStopping(Callback):
    """Lightning's ``EarlyStopping``: stop after ``patience`` evaluated epochs in a row in
    which ``monitor`` did not improve on its best by more than ``min_delta``. Its best is
    its own (an improvement smaller than ``min_delta`` is none), so the epoch it names as
    best is the one its count started from."""

    def __init__(
        self, monitor: str, mode: str = "min", patience: int = 3, min_delta: float = 0.0
    ) -> None:
        if patience < 0 or not min_delta >= 0:
            raise ValueError(f"patience={patience} and min_delta={min_delta} must be >= 0")
        self.monitor, self.mode = monitor, _mode(mode)
        self.patience, self.min_delta = patience, min_delta
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.wait = 0  # evaluated epochs since the best

    def on_epoch_end(self, ctx: CallbackContext, row: dict[str, Any]) -> None:
        value = monitored(row, self.monitor, "EarlyStopping")
        if value is None:
            return
        sign = 1 if self.mode == "max" else -1
        gain = math.inf if self.best is None else (value - self.best) * sign
        if math.isfinite(value) and gain > self.min_delta:
            self.best, self.best_epoch, self.wait = value, ctx.epoch, 0
        else:
            self.wait += 1
        if self.wait >= self.patience and self.wait:
            by = f" by more than {self.min_delta:g}" if self.min_delta else ""
            why = f"{self.monitor} has not improved{by} for {self.wait} evaluated epochs; "
            ctx.stop(
                why + f"best {self.best} at epoch {self.best_epoch}", monitor=self.monitor,
                best=self.best, best_epoch=self.best_epoch, patience=self.patience,
                min_delta=self.min_delta,
            )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch, "wait": self.wait}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_epoch, self.wait = state["best"], state["best_epoch"], state["wait"]


class ModelCheckpoint(Callback):
    """Lightning's ``ModelCheckpoint``: the checkpoints kept as models, beside the step
    checkpoints a resume needs (``trainer.checkpoint_every_steps``/``keep_checkpoints``).
    Every ``every_n_epochs`` epochs, the epoch-end checkpoint is ``checkpoints/last.pt``
    (``save_last``) and ``checkpoints/epoch_<NNN>.pt`` while it is one of the ``save_top_k``
    best by ``monitor`` (-1: all; with no monitor, the newest)."""

    def __init__(
        self, monitor: str | None = None, mode: str = "min", save_top_k: int = 1,
        save_last: bool = True, every_n_epochs: int = 1,
    ) -> None:  # fmt: skip
        if save_top_k < -1 or every_n_epochs < 1:
            raise ValueError("save_top_k must be >= -1 and every_n_epochs >= 1")
        self.monitor, self.mode, self.save_top_k = monitor, _mode(mode), save_top_k
        self.save_last, self.every_n_epochs = save_last, every_n_epochs
        self.kept: list[dict[str, Any]] = []  # {epoch, global_step, value}, best first
        self.last: int | None = None  # the global step of last.pt's checkpoint

    def on_epoch_end(self, ctx: CallbackContext, row: dict[str, Any]) -> None:
        """Decided before the epoch's checkpoint (``ctx.global_step``), so the decision is in
        it; the files are placed once it is written."""
        if ctx.epoch % self.every_n_epochs:
            return
        self.last = ctx.global_step if self.save_last else None
        value = (
            ctx.epoch if self.monitor is None else monitored(row, self.monitor, "ModelCheckpoint")
        )
        if self.save_top_k == 0 or value is None or not math.isfinite(value):
            return
        self.kept.append({"epoch": ctx.epoch, "global_step": ctx.global_step, "value": value})
        sign = -1 if self.monitor is None or self.mode == "max" else 1  # best first
        self.kept.sort(key=lambda k: sign * k["value"])
        del self.kept[self.save_top_k if self.save_top_k > 0 else len(self.kept) :]

    def files(self) -> dict[str, int]:
        """The file names kept, each with the global step of the checkpoint it holds."""
        named = {f"epoch_{k['epoch']:03d}.pt": k["global_step"] for k in self.kept}
        return named | ({"last.pt": self.last} if self.last is not None else {})

    def on_checkpoint_written(self, ctx: CallbackContext, path: Path) -> None:
        if ctx.is_main:
            self.place(Path(path).parent, step_of(path))

    def on_start(self, ctx: CallbackContext) -> None:
        """After a resume: a file a kill kept from being placed is placed now."""
        if ctx.is_main and not ctx.replaying:
            self.place(ctx.run_dir / "checkpoints")

    def place(self, where: Path, step: int | None = None) -> None:
        """Copy the step checkpoints into the names kept (those of ``step``; None: any that
        is missing) and remove an ``epoch_<NNN>.pt`` no longer among the best."""
        for name, at in self.files().items():
            source, target = step_path(where, at), where / name
            if (at == step or (step is None and not target.exists())) and source.is_file():
                atomic_write_bytes(target, source.read_bytes())
        for old in where.glob("epoch_*.pt"):
            if re.fullmatch(r"epoch_\d{3,}\.pt", old.name) and old.name not in self.files():
                old.unlink(missing_ok=True)

    def state_dict(self) -> dict[str, Any]:
        return {"kept": [dict(k) for k in self.kept], "last": self.last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kept, self.last = [dict(k) for k in state["kept"]], state["last"]


class LearningRateMonitor(Callback):
    """Lightning's ``LearningRateMonitor``: each parameter group's lr (and momentum) to the
    loggers as ``lr/group<i>``, at every epoch's end or every step (``logging_interval``):
    the values the next step uses (it only reads the optimizer)."""

    def __init__(self, logging_interval: str = "epoch", log_momentum: bool = False) -> None:
        if logging_interval not in ("epoch", "step"):
            raise ValueError("logging_interval must be epoch or step")
        self.logging_interval, self.log_momentum = logging_interval, log_momentum
        self.skips = (BATCH_HOOK,) if logging_interval == "epoch" else ("on_epoch_end",)

    def on_epoch_end(self, ctx: CallbackContext, row: dict[str, Any]) -> None:
        self.log_groups(ctx)

    def on_train_batch_end(self, ctx: CallbackContext, step: int) -> None:
        self.log_groups(ctx)

    def log_groups(self, ctx: CallbackContext) -> None:
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
        self.logged: dict[str, float] = {}  # ctx.log's values for the epoch's row
        self.step_logged: dict[int, dict[str, float]] = {}  # ... and for each global step
        self.lr_set_by = lr_set_by  # the per-step schedule that overwrites a callback's lr, or None

    def call(self, hook: str, ctx: CallbackContext, *args: Any) -> CallbackContext:
        """Every callback's ``hook``, each inside the RNG guard; ``ctx`` (a stop asked)."""
        watched = self.lr_set_by is not None and hook != "on_end"  # after on_end: no step
        per_step = hook == BATCH_HOOK
        ctx.logged = self.step_logged.setdefault(ctx.global_step, {}) if per_step else self.logged
        for name, callback in (self.per_batch if per_step else self.callbacks).items():
            if hook in getattr(callback, "skips", ()):
                continue
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
        return ctx

    def take_logged(self) -> dict[str, Any]:
        """The values ``ctx.log`` collected for the epoch's row; none held after."""
        taken, self.logged = self.logged, {}
        return taken

    def take_steps(self, upto: int) -> dict[int, dict[str, float]]:
        """The values logged in ``on_train_batch_end`` at global steps up to ``upto``."""
        taken = {s: v for s, v in self.step_logged.items() if s <= upto and v}
        self.step_logged = {s: v for s, v in self.step_logged.items() if s > upto}
        return taken

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
    """Whether ``callback``'s class defines ``hook`` other than :class:`Callback`'s no-op,
    and the instance does not skip it."""
    defined = getattr(type(callback), hook, None) not in (None, getattr(Callback, hook))
    return defined and hook not in getattr(callback, "skips", ())


def _lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    return [float(group["lr"]) for group in optimizer.param_groups]


def _stateful(callback: Any) -> bool:
    return hasattr(callback, "state_dict") and hasattr(callback, "load_state_dict")


__all__ = ["Callback", "CallbackContext", "Callbacks", "EarlyStopping", "LearningRateMonitor"]
__all__ += ["ModelCheckpoint", "rng_guard"]
