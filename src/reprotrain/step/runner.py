"""The optimisation step over micro-batches, one training step of the loop, evaluation.

Closes: global RNGs in user code: each micro-batch runs with every global RNG seeded from
``(train seed, global step, micro-batch)`` and restored after; evaluation from ``(train
seed, global step, batch, "eval", split)`` (docs/randomness.md, docs/step.md).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from reprotrain import batches, events
from reprotrain.config import StepSettings
from reprotrain.errors import ReprotrainError
from reprotrain.reduction import Local, Reduction
from reprotrain.repro import op_trace, rng
from reprotrain.repro import precision as float_math
from reprotrain.repro.seeding import microbatch_seed
from reprotrain.state import EpochProgress, LoopState, MetricSums, TrainerState
from reprotrain.step import PlainStep, Step
from reprotrain.tasks.base import StepContext, StepOutput


class NonFiniteError(ReprotrainError):
    """Training produced a NaN/inf loss or gradient norm (trainer.on_nonfinite=stop)."""

    def __init__(self, event: dict, message: str) -> None:
        super().__init__(message)
        self.record = {"nonfinite_events": [event]}  # what run.json keeps of the failure


def autocast(device: torch.device, enabled: bool, dtype: str):
    """Autocast to torch's ``dtype`` when ``enabled`` (``precision.autocast``'s pair)."""
    if not enabled:
        return _NO_AUTOCAST
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


_NO_AUTOCAST = contextlib.nullcontext()  # one shared null context: nothing to build per use


class StepRunner:
    """Runs one optimizer step: the user's step object drives ``gradients()`` and ``apply()``.
    Micro-batch ``i`` of this rank's ``k`` is ``rank * k + i`` of the step's: its RNG key."""

    def __init__(
        self,
        state: TrainerState,
        task: Any,
        *,
        forward: nn.Module | None = None,
        reduction: Reduction | None = None,
        settings: StepSettings | None = None,
        train_seed: int = 0,
        user_step: Step | None = None,
    ) -> None:
        self.state, self.task, self.train_seed = state, task, train_seed
        self.settings = settings or StepSettings()
        self.forward = state.model if forward is None else forward
        self.reduction = reduction or Local()
        self.user_step = user_step or PlainStep()
        state.task, state.user_step = task, self.user_step  # checkpointed if they have state
        self.global_step = 0
        self.samples = 0  # this rank's samples in the current step's batch
        self._batch: Any = None
        self._first: tuple[torch.Tensor, dict] | None = None
        self._norm: torch.Tensor | None = None
        self._applied = False
        self.amp = float_math.autocast(self.settings.precision)  # (autocast on, its dtype)
        self.device = state.loop.device

    @property
    def model(self) -> nn.Module:
        """The bare model (no DDP/compile wrapper): the weights a step may read or change."""
        return self.state.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.state.optimizer

    def step(self, batch: Any, global_step: int) -> tuple[torch.Tensor, dict, torch.Tensor | None]:
        """One step by the user's step object: (first ``gradients()``'s loss and sums, norm)."""
        self.global_step, self.samples = global_step, batches.batch_size(batch)
        self._batch = batch  # counted: gradients() of this batch need not count it again
        self._first, self._norm, self._applied = None, None, False
        self.user_step(self, batch)
        name = type(self.user_step).__name__
        if self._first is None or not self._applied:
            missing = "runner.gradients(batch)" if self._first is None else "runner.apply()"
            raise ReprotrainError(f"step {name} did not call {missing}; a step calls both")
        loss, sums = self._first
        return loss.detach(), sums, self._norm

    def seeded(self, global_step: int, index: int) -> rng.Scoped:
        """The global RNGs for micro-batch ``index``, restored after."""
        return rng.Scoped(microbatch_seed(self.train_seed, global_step, index), self.device)

    def gradients(self, batch: Any) -> tuple[torch.Tensor, dict]:
        """Zero the gradients, forward and backward every micro-batch of ``batch``, combine
        through the reduction: (loss, metric sums) on the device (the first call recorded)."""
        state, device, reduction = self.state, self.state.loop.device, self.reduction
        global_step = self.global_step
        n = self.samples if batch is self._batch else batches.batch_size(batch)
        k = batches.microbatch_count(batch, self.settings.microbatch_size, n)  # k divides n
        size = n // k
        weight = reduction.loss_weight(size, n)
        sums = reduction.accumulator(state.model, k, device)
        for i in range(k):
            micro = batches.micro_batch(batch, i, k)  # a view, or collated alone
            index = reduction.rank * k + i
            ctx = StepContext(
                device, global_step=global_step, microbatch=index,
                microbatches=k * reduction.world_size, train_seed=self.train_seed,
            )  # fmt: skip
            with reduction.microbatch(self.forward, i, k), self.seeded(global_step, index):
                with autocast(device, *self.amp):
                    out = StepOutput(*self.task.training_step(self.forward, micro, ctx))
                if i == 0:  # after the first forward: the plain step's op order, kept
                    state.optimizer.zero_grad(set_to_none=True)
                # Each micro-batch's loss weighs its share of the step's samples, so the k
                # pieces give the gradient of the whole batch's mean.
                loss = out.loss if weight is None else out.loss * weight
                state.scaler.scale(loss).backward()
            sums.add(loss, out.sums, size)
            if i < k - 1:
                events.fire("microbatch", global_step=global_step + 1)
        result = sums.finish()
        if self._first is None:
            self._first = result
        return result

    def apply(self) -> torch.Tensor | None:
        """Clip (if asked), scaler + optimizer step, schedule step, once: the norm or None."""
        if self._applied:
            raise ReprotrainError(
                f"step {type(self.user_step).__name__} called runner.apply() twice in one step"
            )
        state, norm, clip = self.state, None, self.settings.grad_clip_norm
        if clip:
            state.scaler.unscale_(state.optimizer)  # returns at once when the scaler is off
            norm = torch.nn.utils.clip_grad_norm_(state.model.parameters(), clip)
        if state.scaler.is_enabled():  # 16-mixed only
            state.scaler.step(state.optimizer)
            state.scaler.update()
        else:
            state.optimizer.step()
        state.scheduler.step()
        self._norm, self._applied = norm, True
        return norm


def train_step(runner: StepRunner, step: int, batch: Any) -> torch.Tensor | None:
    """Step ``step`` of the epoch, added to its progress; the gradient norm or None (read
    later by :class:`NonFiniteFlags`: no host sync here)."""
    state = runner.state.loop
    lr = runner.state.optimizer.param_groups[0]["lr"]
    with op_trace.step(state.global_step, batch):  # make bisect: per-op hashes, if asked
        loss, sums, norm = runner.step(batch, state.global_step)
    state.progress.add(loss, sums, runner.reduction.samples(runner.samples), lr)
    state.global_step += 1
    state.epoch_step = step + 1
    return norm


class NonFiniteFlags:
    """The steps' losses and norms not yet checked for a non-finite value; :meth:`read`
    checks them in one host read at the loop's sync points."""

    def __init__(self, progress: EpochProgress) -> None:
        self.progress, self.checked = progress, len(progress.step_losses)
        self.norms: list[torch.Tensor] = []

    def add(self, norm: torch.Tensor | None) -> None:
        if norm is not None:
            self.norms.append(norm)

    def read(self) -> bool:
        """Whether a step since the last read had a non-finite loss or norm (one host sync)."""
        losses, norms = self.progress.step_losses[self.checked :], self.norms
        self.checked, self.norms = len(self.progress.step_losses), []
        finite = [torch.stack(values).isfinite().all() for values in (losses, norms) if values]
        if not finite:
            return False
        return not bool(finite[0] if len(finite) == 1 else finite[0] & finite[1])


def nonfinite(state: LoopState, on_nonfinite: str) -> None:
    """Record the epoch's first non-finite step; ``stop`` raises naming it, ``warn`` goes on."""
    losses = state.progress.losses()
    first = next((i for i, v in enumerate(losses) if not math.isfinite(v)), len(losses) - 1)
    event = {
        "epoch": state.epoch,
        "step": first,
        "global_step": state.global_step - len(losses) + first + 1,
        "lr": state.progress.step_lrs[first],  # the lr that step used
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
    amp: tuple[bool, str] = (False, "float32"),
    train_seed: int = 0,
    global_step: int = 0,
) -> dict[str, float]:
    """``<prefix>_<name>`` for each metric the task computes over ``batches_`` (one read);
    ``train_seed`` and ``global_step`` (the weights' step) key the batches' global RNGs."""
    model.eval()
    totals = MetricSums(device)
    for i, batch in enumerate(batches_):
        ctx = StepContext(
            device, global_step=global_step, eval_batch=i, train_seed=train_seed, training=False
        )
        seed = microbatch_seed(train_seed, global_step, i, "eval", prefix)
        with rng.Scoped(seed, device), autocast(device, *amp):
            sums = task.evaluation_step(model, batch, ctx)
        totals.add(sums, batches.batch_size(batch))
    if not totals.samples:
        raise ReprotrainError(f"the {prefix} split yielded no batches; it cannot be evaluated")
    return {f"{prefix}_{k}": v for k, v in task.compute(totals.host()).items()}


def epoch_metrics(task: Any, progress: EpochProgress) -> dict[str, float]:
    """``train_<name>`` for each metric the task computes over the epoch's (reduced) sums."""
    return {f"train_{k}": v for k, v in task.compute(progress.metrics.host()).items()}
