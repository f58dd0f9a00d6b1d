"""What one step of the reference job computes: the place to edit the step.

The framework does everything around these methods (autocast, backward, clipping,
accumulation over micro-batches, DDP, optimizer and scheduler steps, the non-finite guard,
adding up and logging the metrics). A step returns the loss to back-propagate and metric
*sums* over its batch; ``compute`` turns the split's totals into the logged values
(``train_acc``, ``val_loss``, ...). Select a task with ``task=<name>`` (conf/task/).

Three examples, each a README promise that a test runs:

- ``ImageClassification`` (``task=image_classification``, the default): cross-entropy and
  top-1 accuracy, exactly the reference job's arithmetic.
- ``Mixup`` (``task=mixup``): draws its permutation and mixing weight from ``ctx``, the
  step's counter-based stream, so it repeats and resumes bitwise.
- ``LogitPenalty`` (``task=aux_loss``): a second loss term, logged on its own.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from reprotrain.api import Classification, StepContext, StepOutput, mean_sum


class ImageClassification(Classification):
    """``(images, labels)`` -> logits; loss = ``loss_fn`` (the ``loss`` group); acc."""

    def training_step(self, model: nn.Module, batch, ctx: StepContext) -> StepOutput:
        images, labels = batch
        logits = model(images)
        loss = self.loss_fn(logits.float(), labels)
        sums = {"loss": mean_sum(loss, len(labels)), "correct": (logits.argmax(1) == labels).sum()}
        return StepOutput(loss, sums)


class Mixup(ImageClassification):
    """Train on convex mixes of sample pairs; evaluate on clean images (inherited).

    ``train_acc`` counts a sample as right when the prediction is the label that weighs
    more in its mix, so it is scored against what the model was shown.
    """

    def __init__(self, alpha: float = 0.2, loss_fn: nn.Module | None = None) -> None:
        super().__init__(loss_fn)
        self.alpha = alpha

    def training_step(self, model: nn.Module, batch, ctx: StepContext) -> StepOutput:
        images, labels = batch
        lam = float(np.random.default_rng(ctx.seed).beta(self.alpha, self.alpha))
        perm = torch.randperm(len(labels), generator=ctx.generator).to(labels.device)
        mixed = lam * images + (1 - lam) * images[perm]
        logits = model(mixed)
        loss = lam * self.loss_fn(logits.float(), labels) + (1 - lam) * self.loss_fn(
            logits.float(), labels[perm]
        )
        dominant = labels if lam >= 0.5 else labels[perm]
        sums = {
            "loss": mean_sum(loss, len(labels)),
            "correct": (logits.argmax(1) == dominant).sum(),
        }
        return StepOutput(loss, sums)


class LogitPenalty(ImageClassification):
    """Cross-entropy plus ``weight`` x the mean squared logit; logs both terms."""

    metrics: ClassVar[dict[str, str]] = {"loss": "min", "acc": "max", "ce": "min", "penalty": "min"}

    def __init__(self, weight: float = 0.01, loss_fn: nn.Module | None = None) -> None:
        super().__init__(loss_fn)
        self.weight = weight

    def terms(self, model: nn.Module, batch) -> tuple[torch.Tensor, ...]:
        images, labels = batch
        logits = model(images).float()
        ce = F.cross_entropy(logits, labels)
        penalty = logits.pow(2).mean()
        return logits, labels, ce, penalty, ce + self.weight * penalty

    def training_step(self, model: nn.Module, batch, ctx: StepContext) -> StepOutput:
        logits, labels, ce, penalty, loss = self.terms(model, batch)
        return StepOutput(loss, self.term_sums(logits, labels, ce, penalty, loss))

    def evaluation_step(self, model: nn.Module, batch, ctx: StepContext) -> dict:
        return self.term_sums(*self.terms(model, batch))

    @staticmethod
    def term_sums(logits, labels, ce, penalty, loss) -> dict:
        n = len(labels)
        return {
            "loss": mean_sum(loss, n),
            "correct": (logits.argmax(1) == labels).sum(),
            "ce": mean_sum(ce, n),
            "penalty": mean_sum(penalty, n),
        }

    def compute(self, sums: dict) -> dict[str, float]:
        n = sums["samples"]
        out = super().compute(sums)
        return out | {"ce": float(sums["ce"]) / n, "penalty": float(sums["penalty"]) / n}
