"""One learning rate per step: every view reports the lr that step used (issue 27).

metrics.jsonl's epoch row, the fingerprints' ``step_lrs`` and what the loggers receive (here
TensorBoard's event files, read back) agree; before, the epoch row held the lr of the *next*
step (the scheduler's after its step)."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import jsonl


def scalars(log_dir, tag: str) -> dict[int, float]:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_the_epoch_lr_is_the_lr_its_last_step_used_in_every_view(reference_run):
    rows = jsonl(reference_run / "metrics.jsonl")
    prints = jsonl(reference_run / "fingerprints.jsonl")
    per_step = scalars(reference_run / "tensorboard", "step/lr")
    per_epoch = scalars(reference_run / "tensorboard", "epoch/lr")
    assert len(rows) == len(prints) >= 2
    for row, fp in zip(rows, prints, strict=True):
        assert row["lr"] == fp["step_lrs"][-1]  # exact: the same python float
        assert per_step[row["global_step"]] == pytest.approx(row["lr"], rel=1e-6)  # float32
        assert per_epoch[row["global_step"]] == pytest.approx(row["lr"], rel=1e-6)
    steps = [lr for fp in prints for lr in fp["step_lrs"]]
    assert [per_step[s] for s in sorted(per_step)] == pytest.approx(steps, rel=1e-6)
    assert len(set(steps)) > 1  # the schedule moves, so a one-step shift would show
