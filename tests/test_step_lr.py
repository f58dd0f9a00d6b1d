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


def test_a_non_finite_event_names_the_lr_of_the_step_that_produced_it():
    from reprotrain.step.runner import NonFiniteError
    from step_harness import Harness

    h = Harness()  # lr of step s: 0.2 / (1 + s)
    task, original = h.runner.task, h.runner.task.training_step

    def nan_at_step_two(model, batch, ctx):
        out = original(model, batch, ctx)
        return out._replace(loss=out.loss * float("nan")) if ctx.global_step == 2 else out

    task.training_step = nan_at_step_two
    with pytest.raises(NonFiniteError) as failed:
        h.run(4)
    event = failed.value.record["nonfinite_events"][0]
    # The third step (ctx.global_step 2; the record counts steps done: 3) used 0.2 / 3.
    assert event["step"] == 2 and event["global_step"] == 3
    assert event["lr"] == pytest.approx(0.2 / 3, rel=1e-12)
