"""Optimizer and per-step learning-rate schedule from config.

All schedules are ``LambdaLR`` over the global step: their only state is the step count,
so a resumed run continues exactly, and extending ``trainer.epochs`` on resume simply
stretches the schedule to the new total (``OneCycleLR`` would refuse to step past its
original total instead). ``onecycle`` here is the lr shape only (linear warmup to the
peak, cosine anneal to zero); momentum stays fixed.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def build_optimizer(cfg, model: nn.Module) -> torch.optim.Optimizer:
    if cfg.name == "sgd":
        return torch.optim.SGD(
            model.parameters(),
            lr=cfg.lr,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
            weight_decay=cfg.weight_decay,
        )
    return torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay
    )


def lr_factor(name: str, step: int, total: int, warmup_fraction: float, final: float) -> float:
    """Multiplier of the peak lr at ``step`` (0-based) of ``total`` steps."""
    if name == "constant":
        return 1.0
    warmup = int(warmup_fraction * total)
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    floor = final if name == "cosine" else 0.0
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(cfg, optimizer: torch.optim.Optimizer, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(
            cfg.name, step, total_steps, cfg.warmup_fraction, cfg.final_lr_fraction
        ),
    )
