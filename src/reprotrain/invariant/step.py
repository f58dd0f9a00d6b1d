"""The optimisation step of a world-size-invariant run.

Closes, per micro-batch, what the plain step leaves to the rank:

- randomness: every global RNG (python ``random``, numpy's ``np.random``, torch CPU and
  the GPU: dropout, a task's ``np.random.beta``) is seeded from
  ``(train seed, global step, global micro-batch index)`` around each micro-batch and put
  back afterwards (``Stepper.seeded``), and the task's ``ctx.generator`` and
  ``ctx.numpy_generator`` are keyed by the same global index, so no random state belongs
  to a rank and none is checkpointed;
- BatchNorm: normalisation over the micro-batch, running statistics once per step
  (``MicroBatchNorm``);
- reduction: each micro-batch's gradients, loss and metric sums are kept apart and summed
  exactly across micro-batches and ranks (``exact_sum``), in place of DDP's float
  all-reduce; every rank then holds the same gradients and takes the same optimizer step.

Rank r of W runs the micro-batches ``r*k/W .. (r+1)*k/W - 1`` of the step's k: its
contiguous share of the global batch (``shard_global_batch``) is exactly those.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from reprotrain import batches, fault_injection
from reprotrain.engine import Stepper, autocast
from reprotrain.invariant.batchnorm import MicroBatchNorm
from reprotrain.invariant.exact_sum import Reducer, exact_sum, no_reduce
from reprotrain.tasks.base import StepContext, StepOutput
from reprotrain.tasks.metrics import as_sum


@dataclass
class InvariantStepper(Stepper):
    """A ``Stepper`` whose every result is independent of the world size."""

    rank: int = 0
    world_size: int = 1
    reduce: Reducer = no_reduce
    bn: MicroBatchNorm | None = field(default=None, repr=False)

    global_sums = True  # the step's metric sums already cover the whole global batch

    def __post_init__(self) -> None:
        self.bn = MicroBatchNorm(self.state.model)

    def samples(self, batch: Any) -> int:
        return batches.batch_size(batch) * self.world_size

    def step(self, batch: Any, global_step: int) -> tuple[torch.Tensor, dict, torch.Tensor | None]:
        state, device = self.state, self.state.loop.device
        n = batches.batch_size(batch)
        k = self.pieces(n)
        size, total_k, first = n // k, k * self.world_size, self.rank * k
        weight = size / (n * self.world_size)  # this micro-batch's share of the global batch
        params = [p for p in state.model.parameters() if p.requires_grad]
        grads, scalars, names = [], [], None
        state.optimizer.zero_grad(set_to_none=True)
        for i in range(k):
            micro = batch if k == 1 else batches.narrow(batch, i * size, size)
            index = first + i
            ctx = StepContext(
                device, global_step=global_step, microbatch=index, microbatches=total_k,
                train_seed=self.train_seed,
            )  # fmt: skip
            with self.seeded(global_step, index), self.bn.micro_batch():
                with autocast(device, *self.amp):
                    out = StepOutput(*self.task.training_step(self.forward, micro, ctx))
                loss = out.loss * weight
                state.scaler.scale(loss).backward()
            grads.append([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
            for p in params:
                p.grad = None
            names = sorted(out.sums) if names is None else names
            scalars.append([loss.detach().float(), *(as_sum(out.sums[m]) for m in names)])
            if i < k - 1:
                fault_injection.hook("microbatch", global_step + 1)
        # One exact sum for gradients, loss and metric sums: one MAX and one SUM all-reduce
        # per step (each tensor keeps its own scale: the bits of separate calls).
        parts = [g + s for g, s in zip(grads, scalars, strict=True)]
        summed = exact_sum(parts, total_k, self.reduce)
        for p, g in zip(params, summed, strict=False):
            p.grad = g
        self.bn.end_step(self.reduce)
        step_loss, *sums = summed[len(params) :]
        return step_loss, dict(zip(names, sums, strict=True)), self.optimizer_step()
