"""The task protocol: what one (micro-)batch computes, and what the framework does around it.

A task owns the step's arithmetic: forward the model on a batch, return the loss to
back-propagate and named metric sums. The framework owns everything around it: autocast,
GradScaler, ``zero_grad``, backward, clipping, optimizer and scheduler steps, micro-batch
accumulation and DDP gradient sync, the non-finite guard, adding the sums on the device,
reducing them across ranks, checkpointing partial sums, and logging ``train_<name>``,
``val_<name>``, ``test_<name>`` for every name in ``metrics``.

Closes: task randomness. A step that draws (mixup, random masking, a sampled auxiliary
loss) draws from ``ctx.generator`` (torch), ``ctx.numpy_generator`` (numpy) or ``ctx.seed``,
counter-based streams keyed by ``(train seed, global step, micro-batch index)``: the same
draws after any resume, with any ``num_workers``, never from hidden global state. Each is
created on first use, so a task that does not draw costs nothing. A step that draws from
the global RNGs instead (``np.random.beta``, ``random.random``, ``torch.rand``) is covered
too: the engine seeds them from the same counters around every micro-batch.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch
from torch import nn

from reprotrain.repro.seeding import stable_hash
from reprotrain.tasks.metrics import SAMPLES


class StepOutput(NamedTuple):
    """What a training step returns: the loss to back-propagate, and metric sums."""

    loss: torch.Tensor
    sums: dict[str, torch.Tensor]


class StepContext:
    """What the framework tells a step: where it runs and which (micro-)batch it is.

    One meaning per field:

    - ``training``: True in a training step, False in evaluation.
    - ``global_step``: training: the optimizer step this micro-batch belongs to (0 for the
      first step of the run); evaluation: the step the weights come from.
    - ``microbatch``: training: the *global* index of this micro-batch within the step,
      counted over every rank (rank r of W runs ``r*k .. r*k + k-1`` of the step's ``k*W``),
      so it names the same samples on any world size; always 0 in evaluation.
    - ``microbatches``: training: the micro-batches in the step over all ranks (``k*W``);
      1 in evaluation.
    - ``eval_batch``: evaluation: the batch's index within the split; always 0 in training.
    - ``train_seed``: the ``train`` stream's seed, which ``seed`` and the generators derive
      from together with the indices above.
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
        self._generator: torch.Generator | None = None
        self._numpy_generator: np.random.Generator | None = None

    @property
    def seed(self) -> int:
        """A 63-bit seed for this (micro-)batch: ``(train seed, global step, micro-batch)``;
        evaluation: ``(train seed, global step, eval batch, "eval")``. For numpy:
        ``np.random.default_rng(ctx.seed)``."""
        if self._seed is None:
            if self.training:
                self._seed = stable_hash(self.train_seed, self.global_step, self.microbatch)
            else:
                self._seed = stable_hash(self.train_seed, self.global_step, self.eval_batch, "eval")
        return self._seed

    @property
    def generator(self) -> torch.Generator:
        """A fresh CPU ``torch.Generator`` seeded with ``seed``; draw on the CPU and move the
        (small) result to ``device``, as the data path does, so the draws never depend on
        the device type."""
        if self._generator is None:
            self._generator = torch.Generator(device="cpu")
            self._generator.manual_seed(self.seed)
        return self._generator

    @property
    def numpy_generator(self) -> np.random.Generator:
        """A fresh ``numpy.random.Generator`` seeded with ``seed`` (``default_rng(seed)``):
        e.g. ``lam = ctx.numpy_generator.beta(a, a)`` for mixup."""
        if self._numpy_generator is None:
            self._numpy_generator = np.random.default_rng(self.seed)
        return self._numpy_generator


class Task:
    """Base class of a task. Subclass it, override ``training_step`` (and, if evaluation
    differs, ``evaluation_step``), and declare what ``compute`` returns in ``metrics``.

    ``metrics`` maps each logged name to the direction that is better (``"min"`` or
    ``"max"``): ``trainer.monitor`` and ``trainer.monitor_mode`` are checked against it
    before the run. The default ``compute`` reports each declared name as a per-sample
    mean, ``sums[name] / sums["samples"]``.

    A task that keeps state across steps (an EMA of something, a curriculum position)
    gives it ``state_dict``/``load_state_dict``; the trainer then checkpoints it.
    """

    metrics: ClassVar[dict[str, str]] = {"loss": "min"}

    def training_step(self, model: nn.Module, batch: Any, ctx: StepContext) -> StepOutput:
        raise NotImplementedError(f"{type(self).__name__} does not define training_step")

    def evaluation_step(self, model: nn.Module, batch: Any, ctx: StepContext) -> dict:
        """Metric sums of one evaluation batch (under ``no_grad`` and ``model.eval()``)."""
        return self.training_step(model, batch, ctx).sums

    def compute(self, sums: dict[str, Any]) -> dict[str, float]:
        """The logged values of a split from its summed metrics (CPU tensors) and
        ``sums["samples"]`` (an int)."""
        n = sums[SAMPLES]
        return {name: float(sums[name]) / n for name in self.metrics}
