"""In-process training of a tiny model with any step object and reduction (no subprocess).

``Harness`` builds what ``build.build_training`` builds (state, reduction, runner) around a
tiny BatchNorm + dropout model and synthetic batches; ``run(steps)`` trains through the
framework's own ``train_step`` (step/runner.py); ``checkpoint()`` / ``resumed(bytes)`` are
what a checkpoint written by the Saver and a resume in a new process do (weights_only load,
a fresh model from another seed, global RNGs moved), so "resumes bitwise" is checked in seconds.
"""

from __future__ import annotations

import io
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from reprotrain.hashing import state_sha256
from reprotrain.reduction import Exact, Local, Reduction
from reprotrain.repro import checkpoint
from reprotrain.step import PlainStep
from reprotrain.step.runner import (
    NonFiniteFlags,
    StepRunner,
    StepSettings,
    TrainerState,
    nonfinite,
    train_step,
)
from reprotrain.tasks import Classification

CPU = torch.device("cpu")
BATCH = 16


def tiny_model(seed: int, dropout: bool = True) -> nn.Module:
    """Linear, BatchNorm (running statistics), ReLU, dropout (a global RNG draw), Linear."""
    torch.manual_seed(seed)
    drop = nn.Dropout(0.2) if dropout else nn.Identity()
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), drop, nn.Linear(16, 3))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


REDUCTIONS: dict[str, Callable[[], Reduction]] = {"local": Local, "exact": Exact}


class Harness:
    def __init__(
        self,
        make_step: Callable[[nn.Module], Any] = lambda model: PlainStep(),
        *,
        reduction: str = "local",
        microbatch_size: int | None = None,
        seed: int = 0,
        dropout: bool = True,
        make_optimizer: Callable[[Any], torch.optim.Optimizer] = lambda params: torch.optim.SGD(
            params, lr=0.2, momentum=0.9
        ),
    ) -> None:
        self.reduction = REDUCTIONS[reduction]()
        model, forward = self.reduction.prepare(tiny_model(seed, dropout))
        opt = make_optimizer(model.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        task = Classification(nn.CrossEntropyLoss())
        self.user_step = make_step(model)
        rng_state = self.reduction.checkpoints_rank_state
        self.state = TrainerState(model, opt, sched, scaler, CPU, rng_state=rng_state)
        self.runner = StepRunner(self.state, task, forward=forward, reduction=self.reduction,
                                 settings=StepSettings(microbatch_size=microbatch_size),
                                 train_seed=7, user_step=self.user_step)  # fmt: skip

    def run(self, steps: int) -> Harness:
        loop = self.state.loop
        start = loop.epoch_step
        self.runner.forward.train()
        flags = NonFiniteFlags(loop.progress)
        for s in range(start, start + steps):  # the Trainer's epoch, guard read every step
            flags.add(train_step(self.runner, s, batch(s)))
            if flags.read():
                nonfinite(loop, "stop")
        return self

    def checkpoint(self) -> bytes:
        """What the Saver writes: every part's state, per-rank entries gathered."""
        return checkpoint.serialise(self.reduction.checkpoint(self.state.state_dict()))

    @classmethod
    def resumed(cls, data: bytes, make_step, **kw: Any) -> Harness:
        """A fresh process's resume: another initial model, moved global RNGs, then the load."""
        again = cls(make_step, seed=99, **kw)
        random.random(), np.random.rand(3), torch.rand(5)  # a new process draws differently
        again.state.load_state_dict(torch.load(io.BytesIO(data), weights_only=True))
        return again

    def bits(self) -> tuple[str, list[float], list[float]]:
        """(weights sha256, the epoch's step losses, the lrs the steps used)."""
        progress = self.state.loop.progress
        return state_sha256(self.state.model.state_dict()), progress.losses(), progress.step_lrs
