"""The template costs nothing per step beyond the user's step: no extra tensor op in a step,
no host read and no collective between the loop's sync points (every
``trainer.nonfinite_check_every`` steps, before a checkpoint, at the epoch's end). What this
saves is measured by ``make bench`` (the overhead figure); here, only what runs is counted.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from reprotrain import events
from reprotrain.config import GuardSettings, LoopSettings
from reprotrain.loop import Interrupted, LossFeed, Trainer
from reprotrain.step.runner import NonFiniteError, train_step
from step_harness import Harness, batch


class Ops(TorchDispatchMode):
    """Every aten op that runs, by name; ``syncs``: host reads (``.item()``, ``bool()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    @property
    def syncs(self) -> int:
        return self.ops.count("aten._local_scalar_dense.default")


def test_a_step_runs_the_users_step_and_the_epoch_sums_and_nothing_else():
    """train_step's ops are the user's step's (the runner's) plus the epoch's running sums:
    no non-finite flag is computed on the device per step (the guard reads the losses at
    its sync points)."""
    framework, bare = Harness(), Harness()
    for h in (framework, bare):  # the first step's sums start as copies; count a later one
        train_step(h.runner, 0, batch(0))
    with Ops() as step:
        train_step(framework.runner, 1, batch(1))
    with Ops() as user:
        _, sums, _ = bare.runner.step(batch(1), global_step=1)
    sums_ops = ["aten.add_.Tensor"] * len(sums)  # MetricSums.add: one in-place add each
    assert sorted(step.ops) == sorted(user.ops + sums_ops)
    assert step.syncs == 0


class FakeDDP:
    """Rank 0 of 2 whose collectives are counted (the other rank agrees with it)."""

    enabled, rank, world_size, is_main = True, 0, 2, True

    def __init__(self) -> None:
        self.collectives = 0

    def all_reduce_any(self, flag: bool) -> bool:
        self.collectives += 1
        return bool(flag)

    def all_reduce_flags(self, *flags: bool) -> tuple[bool, ...]:
        self.collectives += 1
        return tuple(bool(f) for f in flags)


class Steps:
    """A pipeline of ``steps`` steps of the harness's batches."""

    def __init__(self, steps: int) -> None:
        self.steps_per_epoch = steps

    def epoch(self, epoch: int, start: int = 0):
        return ((s, batch(s)) for s in range(start, self.steps_per_epoch))


class Saver:
    def __init__(self, root: Path) -> None:
        self.dir, self.saved = root / "checkpoints", []

    def save(self, **kw) -> None:
        self.saved.append(kw)


def trainer(tmp_path: Path, dist, steps: int = 30, every: int = 10) -> Trainer:
    h = Harness()
    record = SimpleNamespace(run_dir=tmp_path, data={}, update=lambda **kw: None)
    stop = SimpleNamespace(signal_name=None)
    settings, guard = LoopSettings(epochs=1, progress=False), GuardSettings("stop", every)
    logger = SimpleNamespace(log_every_steps=0)
    run = SimpleNamespace(record=record, stop=stop, dist=dist,
                          settings=SimpleNamespace(loop=settings, guard=guard))  # fmt: skip
    parts = SimpleNamespace(runner=h.runner, pipeline=Steps(steps), saver=Saver(tmp_path),
                            schedule=None)  # fmt: skip
    t = Trainer(run, parts, logger)
    t.out.feed = LossFeed(SimpleNamespace(close=lambda status: None), t.loop)
    return t


def test_under_ddp_the_ranks_talk_once_per_sync_point_never_per_step(tmp_path):
    dist = FakeDDP()
    t = trainer(tmp_path, dist, steps=30, every=10)
    with Ops() as ops:
        t.run_epoch(until=25)
    assert dist.collectives == 2  # steps 10 and 20: non-finite flag and stop signal together
    assert ops.syncs == 2  # the guard's two reads


def test_one_process_stops_after_the_signalled_step_ddp_at_the_next_sync_point(tmp_path):
    def signal_at_step_3(t: Trainer):
        def handler(global_step: int) -> None:
            if global_step == 3:
                t.stop.signal_name = "SIGTERM"

        return events.on("step", handler)

    for dist, stopped_at in ((SimpleNamespace(enabled=False, is_main=True), 3), (FakeDDP(), 10)):
        t = trainer(tmp_path, dist)
        forget = signal_at_step_3(t)
        try:
            with pytest.raises(Interrupted):
                t.run_epoch()
        finally:
            forget()
        assert t.loop.global_step == stopped_at and len(t.saver.saved) == 1


def test_a_non_finite_loss_is_caught_at_the_next_sync_point(tmp_path):
    t = trainer(tmp_path, FakeDDP(), steps=30, every=10)
    losses = t.loop.progress.step_losses

    def poison(global_step: int) -> None:
        if global_step == 4:
            losses[-1] = torch.tensor(float("nan"))

    forget = events.on("step", poison)
    try:
        with pytest.raises(NonFiniteError, match="epoch 1 step 3"):
            t.run_epoch()
    finally:
        forget()
    assert t.loop.global_step == 10
