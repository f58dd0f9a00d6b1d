"""The imbalanced binary example (experiment=smoke_binary: src/starter/imbalanced.py with
task=binary): AUROC, average precision and F1 logged per split, and the same numbers after
a mid-epoch stop and resume, and on two processes as on one (world-size-invariant mode).
Exactness against scikit-learn: tests/test_exact_metrics.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, assert_ok, base_env, jsonl, metrics_without_timings, train

BINARY = [
    "experiment=smoke_binary",
    "dataset.num_train=640",  # 576 train after the val split: 9 steps of 64 per epoch
    "dataset.num_test=256",
    "trainer.checkpoint_every_steps=3",
    "repro.num_threads=1",
    "logger=none",
]
INVARIANT = ["trainer.microbatch_size=16", "trainer.world_size_invariant=true"]


@pytest.mark.slow
def test_a_binary_run_stopped_mid_epoch_and_resumed_logs_the_same_exact_metrics(tmp_path):
    whole, leg = tmp_path / "whole", tmp_path / "leg"
    assert_ok(train(whole, *BINARY, micro=False))
    rows = jsonl(whole / "metrics.jsonl")
    assert {"train_auroc", "val_auroc", "val_ap", "val_f1", "val_f1_macro", "val_tp"} <= set(
        rows[0]
    )
    assert 0.5 < rows[-1]["val_auroc"] <= 1.0
    stopped = train(leg, *BINARY, "trainer.stop_at_global_step=4", micro=False)
    assert stopped.returncode == 75, stopped.stderr[-2000:]  # mid-epoch 1, checkpointed there
    assert_ok(train(leg, *BINARY, "resume=auto", micro=False))
    assert metrics_without_timings(leg) == metrics_without_timings(whole)


@pytest.mark.slow
def test_a_binary_run_on_two_processes_logs_the_same_exact_metrics_as_on_one(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    assert_ok(train(one, *BINARY, *INVARIANT, micro=False))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "reprotrain.train", *BINARY, *INVARIANT, f"hydra.run.dir={two}"]  # fmt: skip
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in base_env().items() if k not in drop}
    assert_ok(subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900))
    assert jsonl(two / "metrics.jsonl")[0]["train_auroc"] is not None
    assert metrics_without_timings(one) == metrics_without_timings(two)
