"""Early stopping (``callbacks=early_stopping``, Lightning's ``EarlyStopping`` and keys) on the
monitored metric: recorded in run.json, kept in the checkpoint (its state), so a run killed
around the stop resumes to the same bits and the same stop; the epoch it names as best is
the one its count started from, and its message agrees with its numbers (issue 53)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.conftest import assert_ok, jsonl, run_json, train

# 2 steps per epoch, up to 6 epochs. train_loss falls every epoch but never by 100, so
# epochs 2 and 3 are "not better by more than min_delta": patience 2 stops after epoch 3.
STOPPING = [
    "trainer.epochs=6",
    "trainer.limit_train_steps=2",
    "trainer.limit_eval_batches=1",
    "logger=none",
    "trainer.monitor=train_loss",
    "trainer.monitor_mode=min",
    "callbacks=early_stopping",
    "callbacks.early_stopping.patience=2",
    "callbacks.early_stopping.min_delta=100",
]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("early") / "run"
    assert_ok(train(run, *STOPPING))
    return run


def test_a_run_stops_after_patience_epochs_without_improvement_and_says_so(stopped):
    """No epoch after the first improved by more than min_delta: the best is epoch 1's value
    (the loop's own best, for best.pt, is epoch 3's lower loss), and the line says so."""
    record = run_json(stopped)
    assert record["status"] == "completed"
    rows = jsonl(stopped / "metrics.jsonl")
    assert [row["epoch"] for row in rows] == [1, 2, 3]
    first = rows[0]["train_loss"]
    why = "train_loss has not improved by more than 100 for 2 evaluated epochs; "
    why += f"best {first} at epoch 1"
    assert record["early_stopped"] == {
        "epoch": 3, "monitor": "train_loss", "best": first, "best_epoch": 1, "patience": 2,
        "min_delta": 100, "why": why,
    }  # fmt: skip
    assert f"early stopping after epoch 3: {why}" in (stopped / "train.log").read_text()
    assert record["epochs_completed"] == 3
    # The schedule still spans trainer.epochs: the last step's lr is far from the end of
    # the one-cycle schedule (which decays towards 0 at step 12).
    lrs = jsonl(stopped / "fingerprints.jsonl")[-1]["step_lrs"]
    assert lrs[-1] > 0.01


def test_off_by_default_and_a_real_improvement_resets_the_count(tmp_path):
    run = tmp_path / "run"
    no_delta = [o for o in STOPPING if "callbacks" not in o]  # callbacks: none by default
    assert_ok(train(run, *no_delta, "trainer.epochs=3"))
    assert run_json(run)["early_stopped"] is None  # train_loss improves every epoch
    assert len(jsonl(run / "metrics.jsonl")) == 3


def test_killed_after_the_stopping_epochs_checkpoint_the_resume_stops_with_the_same_bits(
    stopped, tmp_path
):
    run = tmp_path / "run"
    killed = train(run, *STOPPING, fault="after-save:6")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert_ok(train(run, *STOPPING, "resume=auto"))
    record, reference = run_json(run), run_json(stopped)
    assert len(jsonl(run / "metrics.jsonl")) == 3  # no epoch 4 after the stop
    assert record["early_stopped"] == reference["early_stopped"]
    assert record["final_weights_sha256"] == reference["final_weights_sha256"]


@pytest.mark.slow
def test_killed_before_the_stop_the_resume_counts_on_and_stops_at_the_same_epoch(stopped, tmp_path):
    run = tmp_path / "run"
    killed = train(run, *STOPPING, fault="after-save:4")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert_ok(train(run, *STOPPING, "resume=auto"))
    record, reference = run_json(run), run_json(stopped)
    assert record["early_stopped"] == reference["early_stopped"]
    assert record["final_weights_sha256"] == reference["final_weights_sha256"]


def test_a_negative_patience_is_one_line_and_exit_2(tmp_path):
    proc = train(tmp_path / "run", *STOPPING, "callbacks.early_stopping.patience=-1")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: callbacks.early_stopping ")
    assert "patience=-1 and min_delta=100 must be >= 0" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # its unit: test_resume_edges.py::test_what_a_completed_run_has_left_to_run
def test_an_early_stopped_run_is_never_resumed_and_nothing_is_rewritten(stopped, tmp_path):
    """It was re-evaluated and its run.json rewritten (issue 34.5): early stopping ended it."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    proc = train(run, *STOPPING, "resume=auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "already completed (early stopping ended it after epoch 3)" in proc.stderr
    assert {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == before
