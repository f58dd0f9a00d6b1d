"""How one step's micro-batch results are combined: one strategy, chosen once.

Closes (Exact): the world size's effect on the bits (float sums of partial sums over different
subsets of micro-batches). The table and the method: docs/step.md, docs/scaling-out.md.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
from torch import nn

from reprotrain.config import ReductionSettings
from reprotrain.distributed import Dist
from reprotrain.errors import ReprotrainError
from reprotrain.invariant import exact_sum
from reprotrain.invariant.batchnorm import MicroBatchNorm
from reprotrain.state import EpochProgress, MetricSums, every_rank_entries, rank_entries
from reprotrain.tasks.metrics import as_sum

Sums = dict[str, torch.Tensor]


class Accumulator:
    """One pass over a step's micro-batches: ``add`` after each backward, ``finish`` once."""

    def add(self, loss: torch.Tensor, sums: Sums, size: int) -> None:
        raise NotImplementedError

    def finish(self) -> tuple[torch.Tensor, Sums]:
        raise NotImplementedError


_NOTHING = contextlib.nullcontext()  # one shared null context: nothing to build per use


class FloatSum(Accumulator):
    """Local and DDP: loss and metric sums added in micro-batch order (k = 1: no extra op)."""

    def __init__(self, k: int, device: torch.device) -> None:
        self.k, self.loss = k, None
        self.sums = MetricSums(device) if k > 1 else None  # k = 1: the step's own sums
        self.last: tuple[torch.Tensor, Sums] | None = None

    def add(self, loss: torch.Tensor, sums: Sums, size: int) -> None:
        if self.k == 1:
            self.last = (loss, sums)  # detached by the runner after the update, as before
            return
        self.loss = loss.detach() if self.loss is None else self.loss + loss.detach()
        self.sums.add(sums, size)

    def finish(self) -> tuple[torch.Tensor, Sums]:
        if self.k == 1:
            assert self.last is not None
            return self.last
        assert self.loss is not None
        return self.loss, self.sums.sums


class ExactSum(Accumulator):
    """Exact: micro-batch i's gradients (out of ``.grad``), loss and sums in row i of a
    ``[k, elements]`` buffer per dtype, summed exactly over every micro-batch of every rank."""

    def __init__(
        self, model: nn.Module, local: int, total: int, reduce, bn: MicroBatchNorm
    ) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.local, self.total, self.reduce, self.bn = local, total, reduce, bn
        self.buffers: list[torch.Tensor] = []  # exact_sum.stacked: row i = micro-batch i
        self.layout: exact_sum.Layout | None = None
        self.names: list[str] | None = None
        self.added = 0

    def add(self, loss: torch.Tensor, sums: Sums, size: int) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        for p in self.params:
            p.grad = None
        self.names = sorted(sums) if self.names is None else self.names
        part = [*grads, loss.detach().float(), *(as_sum(sums[m]) for m in self.names)]
        if self.layout is None:
            self.layout = exact_sum.layout_of(part)
            self.buffers = exact_sum.stacked(self.layout, self.local, loss.device)
        exact_sum.flatten(part, self.layout, [buffer[self.added] for buffer in self.buffers])
        self.added += 1

    def finish(self) -> tuple[torch.Tensor, Sums]:
        # One exact sum for gradients, loss and metric sums: one MAX and one SUM all-reduce
        # per step (each tensor keeps its own scale: the bits of separate calls).
        assert self.layout is not None and self.added == self.local
        summed = exact_sum.exact_sum_stacked(self.buffers, self.layout, self.total, self.reduce)
        self.buffers = []
        for p, g in zip(self.params, summed, strict=False):
            p.grad = g
        self.bn.end_step(self.reduce)
        step_loss, *sums = summed[len(self.params) :]
        return step_loss, dict(zip(self.names or [], sums, strict=True))


class Reduction:
    """How micro-batch results are combined across micro-batches and ranks (see module)."""

    name: ClassVar[str] = "local"
    #: The same bits on any world size dividing the micro-batches per step.
    world_size_invariant: ClassVar[bool] = False
    #: Each step's loss and metric sums cover the global batch (else: this rank's share
    #: until ``end_epoch``), so per-step values may be logged as they come.
    step_values_are_global: ClassVar[bool] = True
    #: Whether a checkpoint holds per-rank state (RNG, partial sums).
    checkpoints_rank_state: ClassVar[bool] = True

    def __init__(self, dist: Dist | None = None) -> None:
        self.dist = dist or Dist()

    @property
    def rank(self) -> int:
        return self.dist.rank

    @property
    def world_size(self) -> int:
        return self.dist.world_size

    def prepare(self, model: nn.Module) -> tuple[nn.Module, nn.Module]:
        """(the bare model to optimise and checkpoint, the module that runs the forward)."""
        return model, model

    def loss_weight(self, size: int, n: int) -> float | None:
        """Factor on a micro-batch's loss (``size`` of ``n``) for the step's mean; None: k = 1."""
        return None if size == n else size / n

    def microbatch(self, forward: nn.Module, i: int, k: int) -> AbstractContextManager:
        """What wraps micro-batch ``i`` of this rank's ``k`` (forward and backward)."""
        return _NOTHING

    def accumulator(self, model: nn.Module, k: int, device: torch.device) -> Accumulator:
        return FloatSum(k, device)

    def samples(self, n: int) -> int:
        """The samples a step's metric sums cover, for ``n`` on this rank."""
        return n

    def microbatch_collate(self, microbatch_size: int) -> int:
        """Samples per collate call (per-sample path); 0: a rank's share of a step at once."""
        return 0

    def end_epoch(self, progress: EpochProgress) -> None:
        """Make the epoch's step losses and metric sums global (no-op when they are)."""

    def global_count(self, samples: int) -> int:
        """``samples`` counted by this rank's progress, over the whole job."""
        return samples

    def global_step_losses(self, losses: torch.Tensor) -> torch.Tensor:
        """The global loss of each step in ``losses`` (this rank's) for mid-epoch logging; a
        collective where step values are not global (every rank calls it at the same step)."""
        return losses

    def checkpoint(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with every rank's per-rank entries (RNG, partial sums) on rank 0."""
        ranks = self.dist.gather_objects(rank_entries(state))
        return every_rank_entries(state, ranks) if ranks is not None else state

    def record(self, microbatches_per_step: int) -> dict[str, Any]:
        """run.json's promise: the same bits on any world size dividing k, and k."""
        k, invariant = microbatches_per_step, self.world_size_invariant
        return {"world_size_invariant": invariant, "microbatches_per_step": k}

    def resume_check(self, saved_world_size: int, allow_change: bool) -> str | None:
        """Why a resume under this job's world size is refused (None: it may go on)."""
        if saved_world_size == self.world_size or allow_change:
            return None
        return (
            f"the checkpoint was written with world size {saved_world_size}, this run has "
            f"{self.world_size}; resume with NPROC={saved_world_size}, or pass "
            "trainer.allow_world_size_change=true (recorded as not bitwise)"
        )


class Local(Reduction):
    """One process: float sums in micro-batch order; the step before the seam, op for op."""


class DDP(Reduction):
    """DDP: gradients all-reduced in the last micro-batch's backward, sums once per epoch."""

    name = "ddp"
    step_values_are_global = False

    def __init__(self, dist: Dist, sync_batchnorm: bool = False) -> None:
        super().__init__(dist)
        self.sync_batchnorm = sync_batchnorm

    def prepare(self, model: nn.Module) -> tuple[nn.Module, nn.Module]:
        device = self.dist.device
        if self.sync_batchnorm:
            if device.type != "cuda":
                raise ReprotrainError(
                    "trainer.sync_batchnorm=true needs CUDA: torch's SyncBatchNorm has no CPU "
                    "kernel; leave it false on gloo"
                )
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        ids = [device.index] if device.type == "cuda" else None
        return model, torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)

    def microbatch(self, forward: nn.Module, i: int, k: int) -> AbstractContextManager:
        """No gradient sync until the last micro-batch's backward."""
        if i == k - 1 or not hasattr(forward, "no_sync"):
            return _NOTHING
        return forward.no_sync()

    def end_epoch(self, progress: EpochProgress) -> None:
        """Global step loss: the ranks' mean (equal shares); metric sums and counts add up."""
        world = self.world_size
        if progress.step_losses:
            losses = torch.stack(progress.step_losses)
            self.dist.all_reduce(losses)
            progress.step_losses = list((losses / world).unbind())
        for total in progress.metrics.sums.values():
            self.dist.all_reduce(total)
        progress.metrics.samples *= world

    def global_count(self, samples: int) -> int:
        return samples * self.world_size

    def global_step_losses(self, losses: torch.Tensor) -> torch.Tensor:
        """The ranks' mean, as ``end_epoch`` computes it, on a copy (one all-reduce)."""
        total = losses.clone()
        self.dist.all_reduce(total)
        return total / self.world_size


class Exact(Reduction):
    """World-size invariant: exact sums of every micro-batch over every rank, each step (rank
    r of W runs micro-batches ``r*k .. (r+1)*k - 1``: its ``shard_global_batch`` share)."""

    name = "exact"
    world_size_invariant = True
    checkpoints_rank_state = False

    def __init__(self, dist: Dist | None = None) -> None:
        super().__init__(dist)
        # one process (also torchrun with one rank): its parts are all the parts, so every
        # collective is the identity; none runs
        self.reduce = exact_sum.torch_reducer() if self.dist.world_size > 1 else exact_sum.no_reduce
        self.bn: MicroBatchNorm | None = None

    def prepare(self, model: nn.Module) -> tuple[nn.Module, nn.Module]:
        """BatchNorm normalises over each micro-batch; running statistics once per step."""
        self.bn = MicroBatchNorm(model)
        return model, model

    def loss_weight(self, size: int, n: int) -> float | None:
        return size / (n * self.world_size)  # this micro-batch's share of the global batch

    def microbatch(self, forward: nn.Module, i: int, k: int) -> AbstractContextManager:
        assert self.bn is not None, "Exact.prepare(model) runs before the first step"
        return self.bn.micro_batch()

    def accumulator(self, model: nn.Module, k: int, device: torch.device) -> Accumulator:
        assert self.bn is not None, "Exact.prepare(model) runs before the first step"
        return ExactSum(model, k, k * self.world_size, self.reduce, self.bn)

    def samples(self, n: int) -> int:
        return n * self.world_size

    def microbatch_collate(self, microbatch_size: int) -> int:
        """One micro-batch: padding and collate draws depend on its own samples alone."""
        return microbatch_size

    def checkpoint(self, state: dict[str, Any]) -> dict[str, Any]:
        return state  # every entry is the same on every rank

    def resume_check(self, saved_world_size: int, allow_change: bool) -> str | None:
        return None  # nothing in the checkpoint is per rank; config checks k % W


def for_run(settings: ReductionSettings, dist: Dist) -> Reduction:
    """The run's one reduction (the one place that reads the mode): Exact when invariance is
    asked for, DDP in a process group, else Local."""
    if settings.world_size_invariant:
        return Exact(dist)
    return DDP(dist, bool(settings.sync_batchnorm)) if dist.enabled else Local(dist)
