"""Binary classification with the metrics of imbalanced data, each exact over the split."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from reprotrain.errors import ReprotrainError
from reprotrain.tasks.base import StepContext, StepOutput, Task
from reprotrain.tasks.confusion import binary_scores, confusion_counts, f1_scores
from reprotrain.tasks.metrics import SAMPLES, mean_sum
from reprotrain.tasks.ranking import auroc, average_precision, read_slots, score_slots


class BinaryClassification(Task):
    """``model(inputs) -> one logit per sample``, labels 0/1 (``BCEWithLogitsLoss`` by
    default); ``acc`` is logit > 0, ``precision``/``recall``/``f1`` of class 1. The batch
    carries each sample's index in its split (``index``); ``num_samples`` is at least the
    largest split's size."""

    metrics: ClassVar[dict[str, str]] = {
        "loss": "min", "acc": "max", "auroc": "max", "ap": "max", "f1": "max",
        "precision": "max", "recall": "max", "f1_macro": "max", "f1_micro": "max",
        "tn": "max", "fp": "min", "fn": "min", "tp": "max",
    }  # fmt: skip

    def __init__(
        self,
        num_samples: int,
        loss_fn: nn.Module | None = None,
        inputs: int | str = 0,
        targets: int | str = 1,
        index: int | str = 2,
    ) -> None:
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ReprotrainError(
                f"task.num_samples={num_samples!r}; give the largest split's size"
            )
        self.num_samples = num_samples
        self.loss_fn = loss_fn if loss_fn is not None else nn.BCEWithLogitsLoss()
        self.inputs, self.targets, self.index = inputs, targets, index

    def logits(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(one float logit per sample, the integer labels) of a batch."""
        y = batch[self.targets].reshape(-1)
        logit = model(batch[self.inputs]).float()
        if logit.numel() != y.numel():
            raise ReprotrainError(
                f"task=binary: the model gives {list(logit.shape)} for {y.numel()} labels; give "
                "it one output (a logit) per sample"
            )
        return logit.reshape(-1), y

    def training_step(self, model: nn.Module, batch: Any, ctx: StepContext) -> StepOutput:
        logit, y = self.logits(model, batch)
        loss = self.loss_fn(logit, y.float())
        return StepOutput(loss, self.sums(logit.detach(), y, loss, batch[self.index]))

    def evaluation_step(self, model: nn.Module, batch: Any, ctx: StepContext) -> dict:
        logit, y = self.logits(model, batch)
        return self.sums(logit, y, self.loss_fn(logit, y.float()), batch[self.index])

    def sums(
        self, logit: torch.Tensor, y: torch.Tensor, loss: torch.Tensor, index: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Integer counts and slots (exact in any order) plus the loss sum."""
        return {
            "loss": mean_sum(loss, len(y)),
            "confusion": confusion_counts((logit > 0).long(), y, 2),
            "slots": score_slots(logit, y, index, self.num_samples),
        }

    def compute(self, sums: dict[str, Any]) -> dict[str, float]:
        n = sums[SAMPLES]
        confusion = sums["confusion"].long()
        scores, labels = read_slots(sums["slots"], n)
        (tn, fp), (fn, tp) = confusion.tolist()
        return {
            "loss": float(sums["loss"]) / n,
            "acc": (tn + tp) / n,
            "auroc": auroc(scores, labels),
            "ap": average_precision(scores, labels),
            **binary_scores(confusion),
            **f1_scores(confusion),
            "tn": float(tn), "fp": float(fp), "fn": float(fn), "tp": float(tp),
        }  # fmt: skip
