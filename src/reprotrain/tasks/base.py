"""The task protocol: what one (micro-)batch computes, and what the framework does around it.

A task forwards the model on a batch and returns the loss to back-propagate and named metric
sums. The framework owns the rest (autocast, backward, clipping, optimizer and scheduler
steps, micro-batches, DDP, the non-finite guard, adding and reducing the sums, logging
``train_``/``val_``/``test_<name>`` for every name in ``metrics``; docs/task.md).

Closes: task randomness: a step draws from ``ctx.generator``, ``ctx.numpy_generator`` or
``ctx.seed``, keyed by ``(train seed, global step, micro-batch)`` and made on first use;
the global RNGs are seeded from the same counters around every micro-batch.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from reprotrain.repro.seeding import SeededGenerators, stable_hash
from reprotrain.tasks.metrics import SAMPLES


class StepOutput(NamedTuple):
    """What a training step returns: the loss to back-propagate, and metric sums."""

    loss: torch.Tensor
    sums: dict[str, torch.Tensor]


class StepContext(SeededGenerators):
    """What the framework tells a step: where it runs and which (micro-)batch it is.

    - ``training``: True in a training step, False in evaluation.
    - ``global_step``: the optimizer step (0 first); in evaluation, the weights' step.
    - ``microbatch``: the *global* index of this micro-batch in the step over every rank
      (rank r of W runs ``r*k .. r*k + k-1``): the same samples on any world size; 0 in eval.
    - ``microbatches``: the micro-batches in the step over all ranks (``k*W``); 1 in eval.
    - ``eval_batch``: the batch's index within the split in evaluation; 0 in training.
    - ``train_seed``: the ``train`` stream's seed, from which ``seed`` derives.
    """

    __slots__ = ("_generator", "_seed", "device", "global_step", "microbatch", "microbatches")
    __slots__ += ("_numpy_generator", "eval_batch", "train_seed", "training")

    def __init__(
        self,
        device: torch.device,
        *,
        global_step: int,
        microbatch: int = 0,
        microbatches: int = 1,
        eval_batch: int = 0,
        train_seed: int = 0,
        training: bool = True,
    ) -> None:
        self.device, self.training = device, training
        self.global_step, self.microbatch, self.microbatches = global_step, microbatch, microbatches
        self.eval_batch, self.train_seed = eval_batch, train_seed
        self._seed: int | None = None
        self._generator = self._numpy_generator = None  # SeededGenerators makes them on use

    @property
    def seed(self) -> int:
        """A 63-bit seed for this (micro-)batch: ``(train seed, global step, micro-batch)``;
        evaluation: ``(train seed, global step, eval batch, "eval")``. For numpy:
        ``np.random.default_rng(ctx.seed)``."""
        if self._seed is None:
            index = (self.microbatch,) if self.training else (self.eval_batch, "eval")
            self._seed = stable_hash(self.train_seed, self.global_step, *index)
        return self._seed


class Task:
    """Base class of a task: override ``training_step`` (and ``evaluation_step`` if it
    differs) and declare in ``metrics`` each logged name and which way is better (``"min"``
    or ``"max"``; ``trainer.monitor`` is checked against it). The default ``compute`` gives
    ``sums[name] / sums["samples"]``. State kept across steps goes in
    ``state_dict``/``load_state_dict``, which the trainer checkpoints.
    """

    metrics: ClassVar[dict[str, str]] = {"loss": "min"}

    def training_step(self, model: nn.Module, batch: Any, ctx: StepContext) -> StepOutput:
        raise NotImplementedError(f"{type(self).__name__} does not define training_step")

    def evaluation_step(self, model: nn.Module, batch: Any, ctx: StepContext) -> dict:
        """Metric sums of one evaluation batch (under ``no_grad`` and ``model.eval()``)."""
        return self.training_step(model, batch, ctx).sums

    def compute(self, sums: dict[str, Any]) -> dict[str, float]:
        """The logged values of a split from its summed metrics and ``sums["samples"]``."""
        n = sums[SAMPLES]
        return {name: float(sums[name]) / n for name in self.metrics}
