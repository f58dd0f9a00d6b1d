"""The optimisation step over micro-batches, one epoch, evaluation, cross-rank reduction.

The task computes what a (micro-)batch means (loss and metric sums, see tasks/); this
module does everything around it. The micro-batch is the unit of work, the step the unit
of optimisation: a step's batch is split into ``microbatch_size`` pieces whose gradients
accumulate (DDP: no gradient sync until the last one) before one optimizer step.

Closes: global RNGs in user code. Each micro-batch's forward and backward run with python
``random``, numpy's global RNG and torch's CPU/GPU generators seeded from
``(train seed, global step, global micro-batch index)`` and restored afterwards; each
evaluation batch from ``(train seed, global step, batch, "eval", split)``. Dropout, a task's
``np.random.beta`` or ``random.random()`` draw a pure function of those counters, and
nothing drawn in one micro-batch moves what the next one sees.

No per-step host sync: the step returns device tensors; losses, metric sums and the
non-finite guard accumulate on the device and are read once per epoch (and every
``trainer.nonfinite_check_every`` steps for the guard). The per-step losses are gathered
as one tensor at the epoch end: the fingerprint's float64 values are the same bits as a
per-step ``loss.item()``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from reprotrain import batches, fault_injection
from reprotrain.errors import ReprotrainError
from reprotrain.repro import op_trace
from reprotrain.repro.seeding import microbatch_seed, scoped_globals
from reprotrain.state import EpochProgress, LoopState, MetricSums, TrainerState
from reprotrain.tasks.base import StepContext, StepOutput

__all__ = ["EpochProgress", "LoopState", "NonFiniteError", "Stepper", "TrainerState"]


class NonFiniteError(ReprotrainError):
    """Training produced a NaN/inf loss or gradient norm (trainer.on_nonfinite=stop)."""

    def __init__(self, event: dict, message: str) -> None:
        super().__init__(message)
        self.record = {"nonfinite_events": [event]}  # what run.json keeps of the failure


def reduce_across_ranks(progress: EpochProgress) -> None:
    """Under DDP: the epoch's metric sums, sample count and step losses over the global
    batch, once per epoch. The one place ranks are combined: each rank's step loss is the
    mean over an equal share, so the global step loss is the mean of the ranks' losses."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    world = dist.get_world_size()
    if progress.step_losses:
        losses = torch.stack(progress.step_losses)
        dist.all_reduce(losses)
        progress.step_losses = list((losses / world).unbind())
    for total in progress.metrics.sums.values():
        dist.all_reduce(total)
    progress.metrics.samples *= world


def autocast(device: torch.device, enabled: bool, dtype: str):
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16)


@dataclass
class Stepper:
    """What one optimisation step touches: the trainer's state, the forward module (the
    DDP/compiled wrapper of ``state.model``) and the task, with the step's settings."""

    state: TrainerState
    forward: nn.Module
    task: Any
    amp: tuple[bool, str] = (False, "bf16")
    grad_clip_norm: float = 0.0
    microbatch_size: int | None = None  # None: the whole (per-rank) batch in one piece
    train_seed: int = 0

    global_sums = False  # True: step() returns sums over the whole global batch

    def optimizer_step(self) -> torch.Tensor | None:
        """Clip (if asked), step the optimizer through the scaler, step the schedule; the
        gradient norm when clipping, else None."""
        state, norm = self.state, None
        if self.grad_clip_norm:
            state.scaler.unscale_(state.optimizer)
            norm = torch.nn.utils.clip_grad_norm_(state.model.parameters(), self.grad_clip_norm)
        state.scaler.step(state.optimizer)
        state.scaler.update()
        state.scheduler.step()
        return norm

    def samples(self, batch: Any) -> int:
        """The samples the step's metric sums cover (this rank's share)."""
        return batches.batch_size(batch)

    def seeded(self, global_step: int, index: int):
        """The global RNGs for micro-batch ``index`` (global over ranks), restored after."""
        seed = microbatch_seed(self.train_seed, global_step, index)
        return scoped_globals(seed, self.state.loop.device)

    def pieces(self, n: int) -> int:
        """Micro-batches in a step of ``n`` samples (on this rank)."""
        size = self.microbatch_size or n
        if n % size:
            raise ReprotrainError(
                f"trainer.microbatch_size={size} does not divide the per-rank batch of {n}; "
                "pick a divisor of trainer.batch_size / world size"
            )
        return n // size

    def step(self, batch: Any, global_step: int) -> tuple[torch.Tensor, dict, torch.Tensor | None]:
        """One optimisation step; (step loss, metric sums, grad norm or None), on the device."""
        state, device = self.state, self.state.loop.device
        n = batches.batch_size(batch)
        k = self.pieces(n)
        size = n // k
        step_loss = None
        sums = MetricSums(device)
        first = _rank() * k  # this rank's first micro-batch, counted over the global batch
        for i in range(k):
            micro = batch if k == 1 else batches.narrow(batch, i * size, size)
            ctx = StepContext(
                device, global_step=global_step, microbatch=i, microbatches=k,
                train_seed=self.train_seed,
            )  # fmt: skip
            # DDP: gradients are all-reduced only in the last micro-batch's backward.
            sync = i == k - 1 or not hasattr(self.forward, "no_sync")
            no_sync = contextlib.nullcontext() if sync else self.forward.no_sync()
            with no_sync, self.seeded(global_step, first + i):
                with autocast(device, *self.amp):
                    out = StepOutput(*self.task.training_step(self.forward, micro, ctx))
                if i == 0:
                    state.optimizer.zero_grad(set_to_none=True)
                # Each micro-batch's loss weighs its share of the step's samples, so k pieces
                # give the gradient of the whole batch's mean (no op when k == 1).
                loss = out.loss if k == 1 else out.loss * (size / n)
                state.scaler.scale(loss).backward()
            if k > 1:
                step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
                sums.add(out.sums, size)
                if i < k - 1:
                    fault_injection.hook("microbatch", global_step + 1)
        norm = self.optimizer_step()
        if k == 1:
            return loss.detach(), out.sums, norm
        return step_loss, sums.sums, norm


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def run_epoch(
    stepper: Stepper,
    batches_: Iterator[tuple[int, Any]],
    *,
    check_every: int,
    on_nonfinite: str,
    after_step: Callable[[int], None],
    any_rank: Callable[[bool], bool] = bool,
    saving: Callable[[int], bool] = lambda global_step: False,
) -> float:
    """Train over ``(step, batch)`` pairs from the loop's position; returns seconds spent
    in training steps.

    ``after_step(next_step)`` runs after every step (signals, cadence checkpoints, hooks);
    it may end the process. The non-finite guard is an on-device flag read every
    ``check_every`` steps: ``stop`` raises naming the first bad step, ``warn`` records it.
    Under DDP ``any_rank`` all-reduces the flag, so every rank stops at the same step.
    """
    state = stepper.state.loop
    optimizer = stepper.state.optimizer
    stepper.forward.train()
    bad = torch.zeros((), dtype=torch.bool, device=state.device)
    t0 = time.perf_counter()
    for step, batch in batches_:
        lr = optimizer.param_groups[0]["lr"]
        with op_trace.step(state.global_step, batch):  # make bisect: per-op hashes, if asked
            loss, sums, norm = stepper.step(batch, state.global_step)
        state.progress.add(loss, sums, stepper.samples(batch), lr)
        bad |= ~torch.isfinite(loss) if norm is None else ~(loss.isfinite() & norm.isfinite())
        state.global_step += 1
        state.step = step + 1
        # Read the flag every k steps, and always before a checkpoint could be written, so
        # no checkpoint ever holds weights that a non-finite step produced.
        due = state.global_step % check_every == 0 or saving(state.global_step)
        if due and any_rank(bool(bad)):
            _nonfinite(stepper.state, on_nonfinite)
            bad.zero_()
        after_step(step + 1)
    seconds = time.perf_counter() - t0
    if any_rank(bool(bad)):
        _nonfinite(stepper.state, on_nonfinite)
    return seconds


def _nonfinite(trainer: TrainerState, on_nonfinite: str) -> None:
    state = trainer.loop
    losses = state.progress.losses()
    first = next((i for i, v in enumerate(losses) if not math.isfinite(v)), len(losses) - 1)
    event = {
        "epoch": state.epoch,
        "step": first,
        "global_step": state.global_step - len(losses) + first + 1,
        "lr": trainer.scheduler.get_last_lr()[0],
        "loss": losses[first] if math.isfinite(losses[first]) else None,
        "what": "loss" if not math.isfinite(losses[first]) else "gradient norm",
    }
    state.nonfinite_events.append(event)
    if on_nonfinite == "stop":
        raise NonFiniteError(
            event,
            f"non-finite {event['what']} at epoch {event['epoch']} step {event['step']} "
            f"(global step {event['global_step']}, lr {event['lr']:.4g}); try a lower "
            "optimizer.lr, trainer.grad_clip_norm=1.0, or trainer.on_nonfinite=warn",
        )


@torch.no_grad()
def evaluate(
    task: Any,
    model: nn.Module,
    batches_: Iterator[Any],
    *,
    prefix: str,
    device: torch.device,
    amp: tuple[bool, str] = (False, "bf16"),
    global_step: int = 0,
    train_seed: int = 0,
) -> dict[str, float]:
    """``<prefix>_<name>`` for each metric the task computes over ``batches_``: sums added
    on the device, read once at the end."""
    model.eval()
    totals = MetricSums(device)
    for i, batch in enumerate(batches_):
        ctx = StepContext(
            device, global_step=global_step, microbatch=i, train_seed=train_seed, training=False
        )
        seed = microbatch_seed(train_seed, global_step, i, "eval", prefix)
        with scoped_globals(seed, device), autocast(device, *amp):
            sums = task.evaluation_step(model, batch, ctx)
        totals.add(sums, batches.batch_size(batch))
    if not totals.samples:
        raise ReprotrainError(f"the {prefix} split yielded no batches; it cannot be evaluated")
    return {f"{prefix}_{k}": v for k, v in task.compute(totals.host()).items()}


def epoch_metrics(task: Any, progress: EpochProgress) -> dict[str, float]:
    """``train_<name>`` for each metric the task computes over the epoch's (reduced) sums."""
    return {f"train_{k}": v for k, v in task.compute(progress.metrics.host()).items()}
