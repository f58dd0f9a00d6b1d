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
        self.draws: list[float] = []

    def _draw(self) -> None:
        self.draws.append(random.random() + float(np.random.rand()) + float(torch.rand(())))

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
