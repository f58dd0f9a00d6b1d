"""One epoch of training and one pass of evaluation.

The per-epoch accumulators live in ``EpochProgress`` (plain python numbers) so that a
mid-epoch checkpoint can save them and a resumed run reports the same epoch metrics, and
so that every step's loss is kept for the epoch fingerprint.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field

import torch
from torch import nn


@dataclass
class EpochProgress:
    step_losses: list[float] = field(default_factory=list)
    loss_sum: float = 0.0
    correct: int = 0
    seen: int = 0

    def add(self, loss: float, correct: int, n: int) -> None:
        self.step_losses.append(loss)
        self.loss_sum += loss * n
        self.correct += correct
        self.seen += n

    def as_dict(self) -> dict:
        return asdict(self)


def autocast(device: torch.device, enabled: bool, dtype: str):
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16)


def train_step(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
    loss_fn: nn.Module,
    amp: tuple[bool, str],
) -> tuple[float, int]:
    """One optimisation step; returns (loss, correct predictions) as python numbers."""
    with autocast(x.device, *amp):
        logits = model(x)
        loss = loss_fn(logits.float(), y)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    return loss.item(), int((logits.argmax(1) == y).sum())


@torch.no_grad()
def evaluate(model: nn.Module, batches, loss_fn: nn.Module, amp: tuple[bool, str]) -> dict:
    model.eval()
    loss_sum, correct, seen = 0.0, 0, 0
    for x, y in batches:
        with autocast(x.device, *amp):
            logits = model(x).float()
        loss_sum += float(loss_fn(logits, y)) * len(y)
        correct += int((logits.argmax(1) == y).sum())
        seen += len(y)
    return {"test_loss": loss_sum / seen, "test_acc": correct / seen}
