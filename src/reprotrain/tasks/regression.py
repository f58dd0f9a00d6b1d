"""Regression: a loss on real-valued predictions (MSE by default), RMSE and R² exact over a
split from its sums (squared error, Σy, Σy² per output). Several outputs: R² is the mean of
the per-output R² (scikit-learn's ``uniform_average``), RMSE pools every value.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import nn

from reprotrain.errors import ReprotrainError
from reprotrain.tasks.base import StepContext, StepOutput, Task
from reprotrain.tasks.metrics import SAMPLES, as_sum, mean_sum


class Regression(Task):
    """``model(inputs) -> predictions`` shaped like the targets (``[B]`` or ``[B, 1]`` for
    ``[B]`` targets); logs ``loss``, ``rmse`` and ``r2``."""

    metrics: ClassVar[dict[str, str]] = {"loss": "min", "rmse": "min", "r2": "max"}

    def __init__(
        self, loss_fn: nn.Module | None = None, inputs: int | str = 0, targets: int | str = 1
    ) -> None:
        self.loss_fn = loss_fn if loss_fn is not None else nn.MSELoss()
        self.inputs, self.targets = inputs, targets

    def predict(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        y = batch[self.targets].float()
        pred = model(batch[self.inputs]).float()
        if pred.shape != y.shape and pred.numel() == y.numel():
            pred = pred.reshape(y.shape)  # [B, 1] predictions of [B] targets
        if pred.shape != y.shape:
            raise ReprotrainError(
                f"task=regression: the model predicts {list(pred.shape)} for targets "
                f"{list(y.shape)}; give the model one output per target value"
            )
        return pred, y

    def training_step(self, model: nn.Module, batch: Any, ctx: StepContext) -> StepOutput:
        pred, y = self.predict(model, batch)
        loss = self.loss_fn(pred, y)
        return StepOutput(loss, self.sums(pred.detach(), y, loss))

    def evaluation_step(self, model: nn.Module, batch: Any, ctx: StepContext) -> dict:
        pred, y = self.predict(model, batch)
        return self.sums(pred, y, self.loss_fn(pred, y))

    @staticmethod
    def sums(pred: torch.Tensor, y: torch.Tensor, loss: torch.Tensor) -> dict:
        err, y64 = as_sum(pred) - as_sum(y), as_sum(y)
        return {
            "loss": mean_sum(loss, len(y)),
            "sse": (err * err).sum(0),  # per output
            "y_sum": y64.sum(0),
            "y_sq": (y64 * y64).sum(0),
        }

    def compute(self, sums: dict[str, Any]) -> dict[str, float]:
        n = sums[SAMPLES]
        sse, y_sum, y_sq = (sums[k].double().reshape(-1) for k in ("sse", "y_sum", "y_sq"))
        sst = y_sq - y_sum * y_sum / n  # total sum of squares about the split's mean
        r2 = [
            1.0 - float(e) / float(t) if float(t) > 0 else math.nan
            for e, t in zip(sse, sst, strict=True)
        ]
        return {
            "loss": float(sums["loss"]) / n,
            "rmse": math.sqrt(float(sse.sum()) / (n * sse.numel())),
            "r2": sum(r2) / len(r2),
        }
