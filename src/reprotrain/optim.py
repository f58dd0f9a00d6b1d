"""Parameter groups for the optimizer, and the project's per-step lr schedules.

The schedules are ``LambdaLR`` over the global step: their only state is the step count, so
a resumed run continues exactly, and extending ``trainer.epochs`` on resume simply stretches
the schedule to the new total (``OneCycleLR`` would refuse to step past its original total).
Use them from YAML as ``_target_: reprotrain.optim.<name>`` with ``_partial_: true``; any
``torch.optim.lr_scheduler`` class works the same way.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def param_groups(model: nn.Module, no_decay_norm_bias: bool) -> list[dict]:
    """All parameters, or two groups: biases and norm weights (ndim <= 1) get weight_decay 0.

    Decaying BatchNorm scales and biases pulls them towards zero for no regularising gain;
    the split is by shape, so it also covers a user's own norm layers.
    """
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
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: _factor(step, total_steps, warmup_fraction, 0.0)
    )


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
