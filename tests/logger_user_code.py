"""A user's logger, the way a Comet/Neptune/Aim logger would be written in a project's own
room: a ``reprotrain.api.Logger`` subclass named by ``_target_``. It draws from python's,
NumPy's and torch's global generators in every hook (as a tracker's client drawing a run id
would) and writes what it was given to ``<run_dir>/user_logger.jsonl``.

Not a test module: the trainer imports it in a subprocess (``PYTHONPATH=tests``).
"""

from __future__ import annotations

import json
import random

import numpy as np
import torch

from reprotrain.api import Logger


class RandomDrawing(Logger):
    name = "drawing"

    def __init__(self, filename: str = "user_logger.jsonl") -> None:
        self.filename = filename
        self.path = None

    def _draw(self) -> float:
        return random.random() + float(np.random.rand()) + float(torch.rand(()))

    def _write(self, **entry) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")

    def start(self, run) -> None:
        self._draw()
        self.path = run.run_dir / self.filename
        self._write(hook="start", start_step=run.start_step)

    def log_steps(self, steps, series) -> None:
        self._draw()
        self._write(hook="log_steps", steps=steps)

    def end_batch(self, global_step) -> None:
        self._draw()

    def log_epoch(self, epoch, global_step, row) -> None:
        self._draw()
        self._write(hook="log_epoch", epoch=epoch, row=row)

    def log_final(self, metrics) -> None:
        self._draw()
        self._write(hook="log_final", metrics=metrics)

    def close(self, status) -> None:
        self._draw()
        self._write(hook="close", status=status)


class Unreachable(RandomDrawing):
    """A tracker whose server is out of reach when the run starts."""

    def start(self, run) -> None:
        self._draw()
        raise ConnectionError("tracker.example: connection refused")
