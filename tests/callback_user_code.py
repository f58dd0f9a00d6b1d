"""A user callback that draws from every global generator in every hook, and keeps a count.

Not a test module: the trainer imports it in a subprocess (``PYTHONPATH=tests``). Without the
framework's RNG guard its draws would shift the `train` stream (dropout, user randomness)
and the run with the callback would train other weights than the run without.
"""

from __future__ import annotations

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
