"""A user callback that draws from every global generator in every hook, and keeps a count.

Not a test module: the trainer imports it in a subprocess (``PYTHONPATH=tests``). Without the
framework's RNG guard its draws would shift the `train` stream (dropout, user randomness)
and the run with the callback would train other weights than the run without.
"""

from __future__ import annotations

import json
import random

import numpy as np
import torch

from reprotrain.api import Callback


class RandomDrawing(Callback):
    def __init__(self) -> None:
        self.epochs_seen = 0

    def _draw(self) -> float:  # drawn, not kept (kept, it would be state to checkpoint)
        return random.random() + float(np.random.rand()) + float(torch.rand(()))

    def on_start(self, ctx) -> None:
        self._draw()

    def on_epoch_end(self, ctx, row) -> None:
        self.epochs_seen += 1
        self._draw()

    def on_checkpoint(self, ctx, path) -> None:
        self._draw()

    def on_end(self, ctx, final_metrics) -> None:
        self._draw()

    def state_dict(self) -> dict:
        return {"epochs_seen": self.epochs_seen}

    def load_state_dict(self, state: dict) -> None:
        self.epochs_seen = state["epochs_seen"]


class LossHistory(Callback):
    """Every epoch's train_loss (state), written as loss_history.json at the end."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_epoch_end(self, ctx, row) -> None:
        self.values.append(row["train_loss"])

    def on_end(self, ctx, final_metrics) -> None:
        if ctx.is_main:
            (ctx.run_dir / "loss_history.json").write_text(json.dumps(self.values))

    def state_dict(self) -> dict:
        return {"values": list(self.values)}

    def load_state_dict(self, state: dict) -> None:
        self.values = list(state["values"])


class LrDecay(Callback):
    """Sets the lr itself: a tenth of it after every epoch (what docs/callbacks.md offers)."""

    def on_epoch_end(self, ctx, row) -> None:
        for group in ctx.optimizer.param_groups:
            group["lr"] = group["lr"] * 0.1


class TwoArgumentScheduler:
    """A scheduler whose step() needs two values: nothing the trainer could give it."""

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer

    def step(self, metrics, other) -> None:
        """Would need a second value besides the monitored metric."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """No state."""


class EpochScheduler(TwoArgumentScheduler):
    """An old-style scheduler whose step() needs the epoch: not a metric to be given."""

    def step(self, epoch) -> None:
        """Would need the epoch number."""


class FreezeFirst(Callback):
    """Set-up in ``on_start``: the first convolution frozen (no state to checkpoint). A
    resume's replay must run it too, or it trains the frozen layer."""

    def on_start(self, ctx) -> None:
        first = next(m for m in ctx.model.modules() if isinstance(m, torch.nn.Conv2d))
        for p in first.parameters():
            p.requires_grad_(False)


class CheckpointCounter(Callback):
    """Counts ``on_checkpoint`` calls, with a complete ``state_dict``: a preemption that
    called the hook once more than an uninterrupted run would end with another count."""

    def __init__(self) -> None:
        self.count = 0

    def on_checkpoint(self, ctx, path) -> None:
        self.count += 1

    def on_end(self, ctx, final_metrics) -> None:
        if ctx.is_main:
            (ctx.run_dir / "checkpoint_count.json").write_text(json.dumps(self.count))

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


class EpochEnds(Callback):
    """An attribute changed in ``on_epoch_end`` that its ``state_dict`` leaves out."""

    def __init__(self) -> None:
        self.ends = 0
        self.kept: list[int] = []

    def on_epoch_end(self, ctx, row) -> None:
        self.ends += 1

    def state_dict(self) -> dict:
        return {"kept": list(self.kept)}

    def load_state_dict(self, state: dict) -> None:
        self.kept = list(state["kept"])


class EditWeights(Callback):
    """Edits the weights: +1 on every bias at each epoch end (before the checkpoint), x2 on
    the last layer's bias at the end (after the last checkpoint)."""

    def on_epoch_end(self, ctx, row) -> None:
        with torch.no_grad():
            for name, p in ctx.model.named_parameters():
                if name.endswith("bias"):
                    p.add_(1.0)

    def on_end(self, ctx, final_metrics) -> None:
        with torch.no_grad():
            last_bias(ctx.model).mul_(2)


def last_bias(model: torch.nn.Module) -> torch.Tensor:
    return [p for name, p in model.named_parameters() if name.endswith("bias")][-1]


class StepCounter(Callback):
    """The per-batch hook with state: counts the optimizer steps it saw, logs the count and
    a draw to the run's loggers (``ctx.log``), and draws from every generator every step."""

    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_end(self, ctx, step) -> None:
        self.steps += 1
        ctx.log("steps_seen", self.steps)
        ctx.log("noise", random.random() + float(np.random.rand()) + float(torch.rand(())))

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]


class EveryOtherStep(Callback):
    """Logs the global step at every second optimizer step (``ctx.log`` in the per-batch
    hook): the loggers get it at those steps, not once per epoch."""

    def on_train_batch_end(self, ctx, step) -> None:
        if step % 2 == 0:
            ctx.log("every_other", step)
