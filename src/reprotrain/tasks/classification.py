"""Classification: a loss on logits (cross-entropy by default), top-1 accuracy, F1."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from reprotrain.errors import ReprotrainError
from reprotrain.tasks.base import StepContext, StepOutput, Task
from reprotrain.tasks.confusion import confusion_counts, f1_scores
from reprotrain.tasks.metrics import SAMPLES, mean_sum


class Classification(Task):
    """``model(inputs) -> logits [B, C]``; logs ``loss`` (``loss_fn``: the ``loss`` group)
    and ``acc``. ``inputs``/``targets``: the batch's positions or dict keys."""

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


class ClassificationF1(Classification):
    """``Classification`` plus ``f1_macro`` and ``f1_micro`` from the split's ``[C, C]``
    confusion counts (``confusion_matrix(sums)``: rows true class, columns predicted)."""

    metrics: ClassVar[dict[str, str]] = dict(Classification.metrics, f1_macro="max", f1_micro="max")

    def __init__(
        self,
        num_classes: int,
        loss_fn: nn.Module | None = None,
        inputs: int | str = 0,
        targets: int | str = 1,
    ) -> None:
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ReprotrainError(f"task.num_classes={num_classes!r}; give the class count (>= 2)")
        super().__init__(loss_fn, inputs, targets)
        self.num_classes = num_classes

    def sums(self, logits: torch.Tensor, loss: torch.Tensor, y: torch.Tensor) -> dict:
        sums = super().sums(logits, loss, y)
        sums["confusion"] = confusion_counts(logits.argmax(1), y, self.num_classes)
        return sums

    @staticmethod
    def confusion_matrix(sums: dict[str, Any]) -> torch.Tensor:
        return sums["confusion"].long()

    def compute(self, sums: dict[str, Any]) -> dict[str, float]:
        return {**super().compute(sums), **f1_scores(self.confusion_matrix(sums))}
