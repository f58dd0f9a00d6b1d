"""Classification: a loss on logits (cross-entropy by default) and top-1 accuracy."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from reprotrain.tasks.base import StepContext, StepOutput, Task
from reprotrain.tasks.metrics import SAMPLES, mean_sum


class Classification(Task):
    """``model(inputs) -> logits [B, C]``; logs ``loss`` (the mean of ``loss_fn``) and ``acc``.

    ``loss_fn`` is the ``loss`` config group, supplied by the trainer. The batch is
    ``(inputs, targets)`` by default; ``inputs``/``targets`` name other positions or dict
    keys (``task.inputs=image task.targets=label`` for a dict batch).
    """

    metrics: ClassVar[dict[str, str]] = {"loss": "min", "acc": "max"}

    def __init__(
        self, loss_fn: nn.Module | None = None, inputs: int | str = 0, targets: int | str = 1
    ) -> None:
        self.loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()
        self.inputs, self.targets = inputs, targets

    def split(self, batch: Any) -> tuple[Any, torch.Tensor]:
        """(what the model takes, the integer class labels) of a batch."""
        return batch[self.inputs], batch[self.targets]

    def training_step(self, model: nn.Module, batch: Any, ctx: StepContext) -> StepOutput:
        x, y = self.split(batch)
        logits = model(x)
        loss = self.loss_fn(logits.float(), y)
        return StepOutput(loss, self.sums(logits, loss, y))

    def evaluation_step(self, model: nn.Module, batch: Any, ctx: StepContext) -> dict:
        x, y = self.split(batch)
        logits = model(x).float()
        return self.sums(logits, self.loss_fn(logits, y), y)

    @staticmethod
    def sums(logits: torch.Tensor, loss: torch.Tensor, y: torch.Tensor) -> dict:
        return {"loss": mean_sum(loss, len(y)), "correct": (logits.argmax(1) == y).sum()}

    def compute(self, sums: dict[str, Any]) -> dict[str, float]:
        n = sums[SAMPLES]
        return {"loss": float(sums["loss"]) / n, "acc": int(sums["correct"]) / n}
