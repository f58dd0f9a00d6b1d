"""Parameter groups for the optimizer, and the project's lr schedules: ``LambdaLR`` over the
global step (a resume continues exactly), driven per step, on the metric or not at all
(:func:`schedule_kind`; docs/configuration.md).
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import nn


def param_groups(model: nn.Module, no_decay_norm_bias: bool) -> list[dict]:
    """All parameters, or two groups: biases and norm weights (ndim <= 1) get weight_decay 0."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not no_decay_norm_bias:
        return [{"params": params}]
    return [
        {"params": [p for p in params if p.ndim > 1]},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
    ]


def _factor(step: int, total: int, warmup_fraction: float, floor: float) -> float:
    warmup = int(warmup_fraction * total)
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def onecycle(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_fraction: float = 0.25
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to the optimizer's lr over ``warmup_fraction`` of all steps, cosine to 0."""
    return cosine(optimizer, total_steps, warmup_fraction)


def cosine(
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    warmup_fraction: float = 0.0,
    final_lr_fraction: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """Optional linear warmup, then cosine decay to lr * final_lr_fraction."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: _factor(step, total_steps, warmup_fraction, final_lr_fraction)
    )


def constant(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


class NoSchedule:
    """``scheduler=none``: the lr is the optimizer's, changed only by the run's callbacks."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step(self) -> None:
        """After each optimizer step: the lr stays what it is."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """No state: the lr is restored with the optimizer's param groups."""


class MetricSchedule:
    """A scheduler whose ``step`` takes the monitored value (``ReduceLROnPlateau``), stepped
    by :func:`epoch_end` before the epoch's checkpoint, which so holds its state."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def step(self) -> None:
        """After each optimizer step: nothing (the schedule moves on epoch ends)."""

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)


def required_step_args(scheduler: Any) -> list[str]:
    """The arguments ``scheduler.step`` cannot do without (a metric-driven one: one)."""
    try:
        params = inspect.signature(scheduler.step).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: assume step()
        return []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in positional and p.default is p.empty]


def schedule_kind(scheduler: Any) -> str:
    """``"none"``, ``"metric"`` (stepped at epoch end) or ``"step"`` (after every step)."""
    if isinstance(scheduler, NoSchedule):
        return "none"
    if isinstance(scheduler, MetricSchedule):
        return "metric"
    return "step"


def for_loop(scheduler: Any) -> Any:
    """The scheduler as the loop drives it: a ``step(metrics)`` one in :class:`MetricSchedule`."""
    return MetricSchedule(scheduler) if required_step_args(scheduler) == ["metrics"] else scheduler


def unwrapped(scheduler: Any) -> Any:
    """The user's scheduler (a :class:`MetricSchedule`'s own), for its name and checks."""
    return scheduler.scheduler if isinstance(scheduler, MetricSchedule) else scheduler


def peak_lr(scheduler: Any, optimizer: torch.optim.Optimizer) -> float | None:
    """The run's lr as a hyperparameter: the highest the schedule sets, read before any step
    (``OneCycleLR``'s ``max_lr``, ``CyclicLR``'s ``max_lrs``; the project's schedules and
    the plateau start from the optimizer's lr, the most their factor gives: 1)."""
    group = optimizer.param_groups[0]
    peak = getattr(unwrapped(scheduler), "max_lrs", None) or [group.get("max_lr")]
    return peak[0] if peak[0] is not None else group.get("initial_lr", group["lr"])


def epoch_end(scheduler: Any, value: float | None) -> None:
    """At an epoch's end: a metric-driven schedule steps on ``value`` (``trainer.monitor``'s;
    None: not evaluated this epoch); a per-step one has already moved."""
    if isinstance(scheduler, MetricSchedule) and value is not None:
        scheduler.scheduler.step(value)


def check_schedule(scheduler: Any, target: str, monitor: str, monitor_mode: str) -> str | None:
    """At preflight: why ``scheduler`` cannot be driven (one line), or None: its ``step`` needs
    more than the metric, or it improves the other way than ``trainer.monitor``."""
    scheduler = unwrapped(scheduler)
    needed = required_step_args(scheduler)
    if needed not in ([], ["metrics"]):
        return (
            f"scheduler {target}: its step() needs {', '.join(needed)}; the trainer steps a "
            "scheduler with nothing (after every optimizer step) or with the monitored metric "
            "(step(metrics), at epoch end, like ReduceLROnPlateau): wrap it in one that does"
        )
    mode = getattr(scheduler, "mode", None)
    if needed and mode in ("min", "max") and mode != monitor_mode:
        return (
            f"scheduler.mode={mode} but it steps on trainer.monitor={monitor}, which is "
            f"better when {'higher' if monitor_mode == 'max' else 'lower'} "
            f"(trainer.monitor_mode={monitor_mode}); set scheduler.mode={monitor_mode}"
        )
    return None
