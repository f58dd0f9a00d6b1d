"""The training loop's progress bar: the running loss on a terminal, nothing on a pipe."""

from __future__ import annotations

import io

import torch

from reprotrain import loop
from reprotrain.state import EpochProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def progress_with_losses(values: list[float]) -> EpochProgress:
    progress = EpochProgress(torch.device("cpu"))
    for v in values:
        progress.add(torch.tensor(v), {}, 1, 0.1)
    return progress


def test_on_a_terminal_the_bar_shows_the_mean_loss_of_the_last_steps(monkeypatch):
    err = Terminal()
    monkeypatch.setattr("sys.stderr", err)
    bar = loop.EpochBar(enabled=True, every=2)
    bar.start(epoch=3, total=4, done=0)
    progress = progress_with_losses([9.0, 1.0, 3.0])
    bar.step(progress, global_step=2)  # reads the last two losses: (1 + 3) / 2
    bar.close()
    out = err.getvalue()
    assert "epoch 3" in out and "loss=2" in out


def test_off_a_terminal_the_bar_writes_nothing_and_reads_no_loss(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    bar = loop.EpochBar(enabled=True, every=1)
    bar.start(epoch=1, total=2, done=0)

    class Unreadable(list):
        def __getitem__(self, item):
            raise AssertionError("the bar read a loss off a terminal")

    progress = progress_with_losses([1.0])
    progress.step_losses = Unreadable(progress.step_losses)
    bar.step(progress, global_step=1)
    bar.close()
    assert err.getvalue() == ""
