"""The trainer's state: one Stateful whose ``state_dict`` is the checkpoint (docs/resume.md).

Closes: resume drift of the partial epoch: its metric sums, step losses and lrs are in the
checkpoint as exact values. Per-rank entries (RNG, partial sums) are gathered by the reduction.
On the ground floor: every stage may import it; it imports no stage (tests/test_layering.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from reprotrain.errors import CheckpointError
from reprotrain.repro import rng
from reprotrain.tasks.metrics import SAMPLES, as_sum


class MetricSums:
    """Named running sums on one device, added without a host sync; read once per split."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums: dict[str, torch.Tensor] = {}
        self.samples = 0  # a python int: batch sizes are known on the host

    def add(self, sums: dict[str, torch.Tensor], samples: int) -> None:
        for name, value in sums.items():
            total = self.sums.get(name)
            if total is None:
                self.sums[name] = as_sum(value).clone()
            else:
                total += value if value.dtype == total.dtype else value.to(total.dtype)
        self.samples += samples

    def host(self) -> dict[str, Any]:
        """The totals on the CPU (one host read), with ``samples`` as an int."""
        return {**{k: v.detach().cpu() for k, v in self.sums.items()}, SAMPLES: self.samples}

    def state_dict(self) -> dict[str, Any]:
        return {"sums": {k: v.detach().cpu() for k, v in self.sums.items()}, SAMPLES: self.samples}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sums = {k: v.to(self.device) for k, v in sd["sums"].items()}
        self.samples = sd[SAMPLES]


class EpochProgress:
    """The current epoch so far: metric sums, per-step losses and lrs, all on the device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.metrics = MetricSums(device)
        self.step_losses: list[torch.Tensor] = []
        self.step_lrs: list[float] = []  # the lr each step used (python floats: no sync)

    @property
    def seen(self) -> int:
        return self.metrics.samples

    def add(self, loss: torch.Tensor, sums: dict, n: int, lr: float) -> None:
        self.step_losses.append(loss)
        self.step_lrs.append(lr)
        self.metrics.add(sums, n)

    def losses(self) -> list[float]:
        """Every step loss of the epoch so far, as python floats (one host sync)."""
        if not self.step_losses:
            return []
        return torch.stack(self.step_losses).double().tolist()

    def state_dict(self) -> dict[str, Any]:
        """This rank's partial sums (no collective: see :func:`every_rank_entries`)."""
        losses, metrics = self.losses(), self.metrics.state_dict()
        return {"step_losses": losses, "step_lrs": self.step_lrs, "metrics": metrics}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """This rank's entry (``TrainerState`` picks it out of a per-rank checkpoint)."""
        self.step_losses = [
            torch.tensor(v, dtype=torch.float32, device=self.device) for v in sd["step_losses"]
        ]
        self.step_lrs = list(sd["step_lrs"])
        self.metrics.load_state_dict(sd["metrics"])


@dataclass
class LoopState:
    """Position ``(epoch, epoch_step)`` of the next step, history, and the best monitored
    value. ``epoch_step`` counts the steps done in this epoch; ``global_step`` all of them."""

    device: torch.device
    epoch: int = 1
    epoch_step: int = 0
    global_step: int = 0
    best: float | None = None
    best_epoch: int | None = None
    metrics: list[dict] = field(default_factory=list)
    fingerprints: list[dict] = field(default_factory=list)
    nonfinite_events: list[dict] = field(default_factory=list)
    early_stopped: dict | None = None  # a callback's stop (early stopping): why, when
    progress: EpochProgress = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.progress = EpochProgress(self.device)

    def next_epoch(self) -> None:
        self.epoch, self.epoch_step = self.epoch + 1, 0
        self.progress = EpochProgress(self.device)

    def improved(self, value: float | None, mode: str) -> bool:
        """Whether ``value`` is a new best (best.pt): any finite strict improvement."""
        if value is None or not math.isfinite(value):
            return False
        if self.best is not None and (value <= self.best if mode == "max" else value >= self.best):
            return False
        self.best, self.best_epoch = value, self.epoch
        return True

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in LOOP_KEYS} | {"progress": self.progress.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for key in LOOP_KEYS:
            setattr(self, key, sd[key])
        self.progress.load_state_dict(sd["progress"])


LOOP_KEYS = tuple(f.name for f in fields(LoopState) if f.name not in ("device", "progress"))


class RankRNG:
    """This rank's global RNGs as a part; the checkpoint holds every rank's (``repro/rng.py``)."""

    def __init__(self, device: torch.device, rank: int = 0) -> None:
        self.device, self.rank = torch.device(device), rank

    def state_dict(self) -> dict[str, Any]:
        return rng.capture(self.device)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        rng.restore(state_dict, self.device, self.rank)


def rank_entries(state: dict[str, Any]) -> dict[str, Any]:
    """The per-rank entries of one rank's ``TrainerState.state_dict()``."""
    return {"rng": state.get("rng"), "progress": state["loop"]["progress"]}


def every_rank_entries(state: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """``state`` with every rank's per-rank entries (RNG always a list; sums when several)."""
    out = {**state, "loop": dict(state["loop"])}
    if state.get("rng") is not None:
        states = [r["rng"] for r in ranks]
        out["rng"] = {"format": rng.FORMAT, "world_size": len(ranks), "ranks": states}
    if len(ranks) > 1:
        out["loop"]["progress"] = {"ranks": [r["progress"] for r in ranks]}
    return out


def entry_for_rank(entry: dict[str, Any], rank: int) -> dict[str, Any]:
    """Rank ``rank``'s share of a per-rank entry (the last one when fewer were saved)."""
    if "ranks" not in entry:
        return entry
    return entry["ranks"][min(rank, len(entry["ranks"]) - 1)]


class TrainerState:
    """Everything a resume restores, as one Stateful (the checkpoint is its state_dict);
    ``rng_state=False``: no RNG belongs to a rank (the Exact reduction). The task and the
    user's step are the runner's (``StepRunner`` sets them): parts when they have state."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        scaler: torch.amp.GradScaler,
        device: torch.device,
        *,
        rng_state: bool = True,
        rank: int = 0,
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.scaler = scaler
        self.loop = LoopState(device)
        self.rng = RankRNG(device, rank) if rng_state else None
        self.rank, self.task, self.user_step = rank, None, None
        self.audit: Any = None  # resume/audit.py's digests of what a checkpoint cannot restore
        self.callbacks: Any = None  # a part when one of them has state

    def parts(self) -> dict[str, Any]:
        """The checkpointed parts by name, in restore order (rng last, then the audit)."""
        named = {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler}
        named |= {"scaler": self.scaler, "loop": self.loop}
        for name in ("task", "user_step"):
            part = getattr(self, name)
            if hasattr(part, "state_dict") and hasattr(part, "load_state_dict"):
                named[name] = part
        if self.callbacks is not None and self.callbacks.has_state():
            named["callbacks"] = self.callbacks
        named |= {"rng": self.rng} if self.rng is not None else {}
        return named | ({"audit": self.audit} if self.audit is not None else {})

    def state_dict(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self.parts().items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Each part's entry; a checkpoint without one of them (written before a part or a
        loop field existed) is refused in one line, never half loaded."""
        loop = state_dict.get("loop") or {}
        missing = [name for name in self.parts() if name not in state_dict]
        missing += [f"loop.{key}" for key in (*LOOP_KEYS, "progress") if key not in loop]
        if missing:
            raise CheckpointError(
                f"the checkpoint has no {', '.join(missing)}: an older reprotrain wrote it; "
                "resume it with that version (run.json's git commit), or start a new run"
            )
        progress = entry_for_rank(loop["progress"], self.rank)
        state_dict = {**state_dict, "loop": {**loop, "progress": progress}}
        for name, part in self.parts().items():
            part.load_state_dict(state_dict[name])
