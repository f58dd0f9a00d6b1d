"""The step room: one optimizer update. Here the ``step`` config group's base class a user can
own (docs/step.md); ``runner.py`` drives it over micro-batches and runs evaluation. What it
steps and splits lives on the ground floor, which every stage shares: the trainer's one
Stateful state (``reprotrain/state.py``) and the batch helpers (``reprotrain/batches.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn


class Step:
    """One gradient pass, one update: the default ``step``, and the base of a user's own."""

    evaluated_with = "model weights"  # what validation and test evaluate (run.json)

    def __call__(self, runner: Any, batch: Any) -> None:
        runner.gradients(batch)
        runner.apply()

    @contextlib.contextmanager
    def evaluation_weights(self, model: nn.Module) -> Iterator[None]:
        """The weights validation and test use, in ``model`` for the block: the model's own."""
        yield


class PlainStep(Step):
    """The default ``step`` (conf/step/plain.yaml): :class:`Step` as it is."""
