"""The training step, one epoch, evaluation, and the loop state they share.

No per-step host sync: the step returns device tensors; losses, correct counts and the
non-finite guard accumulate on the device and are read once per epoch (and every
``trainer.nonfinite_check_every`` steps for the guard). The per-step losses are gathered
as one tensor at the epoch end: the fingerprint's float64 values are the same bits as a
per-step ``loss.item()``.

``LoopState`` is everything about the loop's position and history that a resume needs,
as a Stateful (``state_dict``/``load_state_dict``), like the model and optimizer beside it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from reprotrain.errors import ReprotrainError
from reprotrain.repro import op_trace


class NonFiniteError(ReprotrainError):
    """Training produced a NaN/inf loss or gradient norm (trainer.on_nonfinite=stop)."""

    def __init__(self, event: dict, message: str) -> None:
        super().__init__(message)
        self.record = {"nonfinite_events": [event]}  # what run.json keeps of the failure


class EpochProgress:
    """Per-epoch sums kept on the training device; ``summary`` is the one host read."""

    def __init__(self, device: torch.device) -> None:
        # float64 sums give the same numbers as python floats; mps has no float64.
        self.dtype = torch.float32 if device.type == "mps" else torch.float64
        self.device = device
        self.loss_sum = torch.zeros((), dtype=self.dtype, device=device)
        self.correct = torch.zeros((), dtype=torch.int64, device=device)
        self.step_losses: list[torch.Tensor] = []
        self.step_lrs: list[float] = []  # the lr each step used (python floats: no sync)
        self.seen = 0

    def add(self, loss: torch.Tensor, correct: torch.Tensor, n: int, lr: float) -> None:
        self.step_losses.append(loss)
        self.step_lrs.append(lr)
        self.loss_sum += loss.to(self.dtype) * n
        self.correct += correct
        self.seen += n

    def losses(self) -> list[float]:
        """Every step loss of the epoch so far, as python floats (one host sync)."""
        if not self.step_losses:
            return []
        return torch.stack(self.step_losses).double().tolist()

    def state_dict(self) -> dict[str, Any]:
        """This rank's partial sums; under DDP every rank's (a collective), since a
        mid-epoch resume must give each rank back its own share."""
        import torch.distributed as dist

        mine = {
            "step_losses": self.losses(),
            "step_lrs": self.step_lrs,
            "loss_sum": float(self.loss_sum),
            "correct": int(self.correct),
            "seen": self.seen,
        }
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return mine
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        return {"ranks": ranks}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if "ranks" in sd:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            sd = sd["ranks"][min(rank, len(sd["ranks"]) - 1)]
        self.step_losses = [
            torch.tensor(v, dtype=torch.float32, device=self.device) for v in sd["step_losses"]
        ]
        self.step_lrs = list(sd["step_lrs"])
        self.loss_sum.fill_(sd["loss_sum"])
        self.correct.fill_(sd["correct"])
        self.seen = sd["seen"]


@dataclass
class LoopState:
    """Position ``(epoch, step)`` of the next step, history, and the best monitored value."""

    device: torch.device
    epoch: int = 1
    step: int = 0
    global_step: int = 0
    best: float | None = None
    best_epoch: int | None = None
    metrics: list[dict] = field(default_factory=list)
    fingerprints: list[dict] = field(default_factory=list)
    nonfinite_events: list[dict] = field(default_factory=list)
    progress: EpochProgress = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.progress = EpochProgress(self.device)

    def next_epoch(self) -> None:
        self.epoch, self.step, self.progress = self.epoch + 1, 0, EpochProgress(self.device)

    def improved(self, value: float | None, mode: str) -> bool:
        if value is None or not math.isfinite(value):
            return False
        if self.best is not None and (value <= self.best if mode == "max" else value >= self.best):
            return False
        self.best, self.best_epoch = value, self.epoch
        return True

    def state_dict(self) -> dict[str, Any]:
        keys = ("epoch", "step", "global_step", "best", "best_epoch", "metrics", "fingerprints")
        return {
            **{k: getattr(self, k) for k in keys},
            "nonfinite_events": self.nonfinite_events,
            "progress": self.progress.state_dict(),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for key in ("epoch", "step", "global_step", "best", "best_epoch", "metrics"):
            setattr(self, key, sd[key])
        self.fingerprints = sd["fingerprints"]
        self.nonfinite_events = sd.get("nonfinite_events", [])
        self.progress.load_state_dict(sd["progress"])


def reduce_across_ranks(progress: EpochProgress) -> None:
    """Under DDP: the epoch's sums and step losses over the global batch (one all-reduce
    each, once per epoch). Each rank's loss is the mean over an equal share, so the global
    step loss is the mean of the ranks' losses."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    world = dist.get_world_size()
    if progress.step_losses:
        losses = torch.stack(progress.step_losses)
        dist.all_reduce(losses)
        progress.step_losses = list((losses / world).unbind())
    dist.all_reduce(progress.loss_sum)
    dist.all_reduce(progress.correct)
    progress.seen *= world


def autocast(device: torch.device, enabled: bool, dtype: str):
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16)


@dataclass
class StepParts:
    """What one optimisation step touches; built once by the trainer."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    loss_fn: nn.Module
    amp: tuple[bool, str]
    grad_clip_norm: float = 0.0


def train_step(p: StepParts, x: torch.Tensor, y: torch.Tensor):
    """One optimisation step; (loss, correct count, grad norm or None), all on the device."""
    with autocast(x.device, *p.amp):
        logits = p.model(x)
        loss = p.loss_fn(logits.float(), y)
    p.optimizer.zero_grad(set_to_none=True)
    p.scaler.scale(loss).backward()
    norm = None
    if p.grad_clip_norm:
        p.scaler.unscale_(p.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(p.model.parameters(), p.grad_clip_norm)
    p.scaler.step(p.optimizer)
    p.scaler.update()
    p.scheduler.step()
    return loss.detach(), (logits.argmax(1) == y).sum(), norm


def run_epoch(
    p: StepParts,
    state: LoopState,
    batches: Iterator[tuple[int, torch.Tensor, torch.Tensor]],
    *,
    check_every: int,
    on_nonfinite: str,
    after_step: Callable[[int], None],
    any_rank: Callable[[bool], bool] = bool,
    saving: Callable[[int], bool] = lambda global_step: False,
) -> float:
    """Train over ``batches`` from ``state.step``; returns seconds spent in training steps.

    ``after_step(next_step)`` runs after every step (signals, cadence checkpoints, hooks);
    it may end the process. The non-finite guard is an on-device flag read every
    ``check_every`` steps: ``stop`` raises naming the first bad step, ``warn`` records it.
    Under DDP ``any_rank`` all-reduces the flag, so every rank stops at the same step.
    """
    p.model.train()
    bad = torch.zeros((), dtype=torch.bool, device=state.device)
    t0 = time.perf_counter()
    for step, x, y in batches:
        lr = p.optimizer.param_groups[0]["lr"]
        with op_trace.step(state.global_step, (x, y)):  # make bisect: per-op hashes, if asked
            loss, correct, norm = train_step(p, x, y)
        state.progress.add(loss, correct, len(y), lr)
        bad |= ~torch.isfinite(loss) if norm is None else ~(loss.isfinite() & norm.isfinite())
        state.global_step += 1
        state.step = step + 1
        # Read the flag every k steps, and always before a checkpoint could be written, so
        # no checkpoint ever holds weights that a non-finite step produced.
        due = state.global_step % check_every == 0 or saving(state.global_step)
        if due and any_rank(bool(bad)):
            _nonfinite(p, state, on_nonfinite)
            bad.zero_()
        after_step(step + 1)
    seconds = time.perf_counter() - t0
    if any_rank(bool(bad)):
        _nonfinite(p, state, on_nonfinite)
    return seconds


def _nonfinite(p: StepParts, state: LoopState, on_nonfinite: str) -> None:
    losses = state.progress.losses()
    first = next((i for i, v in enumerate(losses) if not math.isfinite(v)), len(losses) - 1)
    event = {
        "epoch": state.epoch,
        "step": first,
        "global_step": state.global_step - len(losses) + first + 1,
        "lr": p.scheduler.get_last_lr()[0],
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
    model: nn.Module, batches, loss_fn: nn.Module, amp: tuple[bool, str], prefix: str
) -> dict:
    """Mean loss and accuracy over ``batches``, summed on the device, read once."""
    model.eval()
    loss_sum = correct = None
    seen = 0
    for x, y in batches:
        with autocast(x.device, *amp):
            logits = model(x).float()
        batch_loss = loss_fn(logits, y).double() * len(y)
        batch_correct = (logits.argmax(1) == y).sum()
        loss_sum = batch_loss if loss_sum is None else loss_sum + batch_loss
        correct = batch_correct if correct is None else correct + batch_correct
        seen += len(y)
    return {f"{prefix}_loss": float(loss_sum) / seen, f"{prefix}_acc": int(correct) / seen}
