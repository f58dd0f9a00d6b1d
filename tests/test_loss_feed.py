"""The loggers' per-step feed: a batch every ``logger.log_every_steps`` steps, global values
only. Under DDP a step's loss is each rank's share until the epoch's end; a mid-epoch batch
is made global by one all-reduce of a copy, with the bits the epoch's end gives, and the
record's own per-step losses are left as they are. (The W&B rows of a real 2-process run:
test_loggers_stores.py::test_under_ddp_wandb_gets_step_rows_every_log_every_steps_as_they_happen.)"""

from __future__ import annotations

import torch

from reprotrain.loggers import Logger, Loggers
from reprotrain.loop import LossFeed
from reprotrain.reduction import DDP, Local
from reprotrain.state import LoopState


class Recorder(Logger):
    name = "recorder"

    def __init__(self) -> None:
        self.batches: list[tuple[list[int], list[float | None]]] = []

    def log_steps(self, steps: list[int], series: dict[str, list[float | None]]) -> None:
        self.batches.append((steps, series["train_loss"]))


class TwoRanks:
    """Rank 0 of 2: an all-reduce adds what rank 1 holds (its loss at each step: ``other``)."""

    enabled, rank, world_size = True, 0, 2

    def __init__(self, other: dict[int, float]) -> None:
        self.other, self.sent, self.calls = other, [], 0

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.calls += 1
        tensor += torch.tensor([self.other[s] for s in self.sent], dtype=tensor.dtype)


MINE = {1: 2.3, 2: 2.1, 3: 1.9, 4: 1.7, 5: 1.6, 6: 1.4}
THEIRS = {1: 2.2, 2: 2.0, 3: 1.95, 4: 1.8, 5: 1.5, 6: 1.3}


def train_steps(feed: LossFeed, state: LoopState, dist: TwoRanks | None, every: int) -> None:
    for step, loss in MINE.items():
        state.progress.add(torch.tensor(loss), {}, 1, 0.1)
        state.global_step = step
        if dist is not None:
            dist.sent = list(range(feed.sent + 1, step + 1))
        feed.every(every)


def test_under_ddp_a_batch_reaches_the_loggers_every_log_every_steps_with_global_values():
    state = LoopState(torch.device("cpu"))
    dist = TwoRanks(THEIRS)
    recorder = Recorder()
    feed = LossFeed(Loggers([recorder]), state, DDP(dist))
    train_steps(feed, state, dist, every=2)
    assert [steps for steps, _ in recorder.batches] == [[1, 2], [3, 4], [5, 6]]
    assert dist.calls == 3  # one all-reduce (and one host read) per batch, none per step
    logged = [v for _, values in recorder.batches for v in values]
    # The epoch's end computes the record's values from the same rank losses: equal bits.
    dist.sent = list(MINE)
    mine = [float(torch.tensor(v)) for v in MINE.values()]
    assert state.progress.losses() == mine  # the record's per-step losses are untouched
    DDP(dist).end_epoch(state.progress)
    assert logged == state.progress.losses()


def test_without_a_chosen_logger_there_is_no_collective_and_local_values_go_as_they_are():
    state = LoopState(torch.device("cpu"))
    dist = TwoRanks(THEIRS)
    feed = LossFeed(Loggers([], configured=()), state, DDP(dist))
    train_steps(feed, state, dist, every=1)
    assert dist.calls == 0  # logger=none: the same decision on every rank, no all-reduce
    state = LoopState(torch.device("cpu"))
    recorder = Recorder()
    feed = LossFeed(Loggers([recorder]), state, Local())
    train_steps(feed, state, None, every=4)
    assert recorder.batches == [([1, 2, 3, 4], [float(torch.tensor(v)) for v in MINE.values()][:4])]
