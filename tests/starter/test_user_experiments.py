"""The worked examples end to end: regression, variable-length sequences with a padding
collate, dict batches, and gradient accumulation. Each repeats bitwise in fresh processes
(``tools.verify``, what ``make verify`` runs) and, killed mid-epoch with SIGKILL, resumes
(``tools.resume``) to the same bits as its uninterrupted run. The sequence run is killed and
resumed with 2 loader workers and compared with the 0-worker run: the collate path does not
depend on the worker count. Shrunk to a few steps per epoch; checkpoints every 3 steps."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, assert_ok, base_env, jsonl, metrics_without_timings, run_json, train

CKPT_EVERY = "trainer.checkpoint_every_steps=3"
EXPERIMENTS = {  # 360 training samples after the val split
    "regression": ["experiment=smoke_regression", "dataset.num_train=400", CKPT_EVERY],
    "sequence": ["experiment=smoke_sequence", "dataset.num_train=300", CKPT_EVERY],
    "dict_microbatches": [
        "experiment=smoke_dict", "dataset.num_train=400", "trainer.microbatch_size=32",
        CKPT_EVERY,
    ],
}  # fmt: skip
KILL_AT = "step:4"  # epoch 1, one step after the step-3 checkpoint: a mid-epoch replay
# What the killed run adds to its config (and keeps on resume): the same bits are expected.
KILLED_RUN_EXTRA = {"sequence": ["trainer.pipeline=loader", "trainer.num_workers=2"]}


def verify(out_dir: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "reprotrain.tools.runs.verify", "--out-dir", str(out_dir),
         *overrides],
        cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=400,
    )  # fmt: skip


@pytest.fixture(scope="module")
def verified_runs(tmp_path_factory):
    """name -> (first run dir, the verify process) of two fresh runs; each made once."""
    made: dict[str, tuple[Path, subprocess.CompletedProcess]] = {}

    def get(name: str) -> tuple[Path, subprocess.CompletedProcess]:
        if name not in made:
            out = tmp_path_factory.mktemp(name)
            proc = verify(out, [*EXPERIMENTS[name], "logger=none"])
            runs = sorted(out.glob("*/a"))
            assert len(runs) == 1, proc.stdout + proc.stderr
            made[name] = runs[0], proc
        return made[name]

    return get


@pytest.fixture(params=list(EXPERIMENTS))
def verified(request, verified_runs) -> tuple[str, Path, subprocess.CompletedProcess]:
    return request.param, *verified_runs(request.param)


def test_two_fresh_runs_are_identical(verified):
    _, _, proc = verified
    assert_ok(proc)
    assert "IDENTICAL" in proc.stdout, proc.stdout


def test_sigkill_mid_epoch_then_resume_is_bitwise_equal(verified, tmp_path):
    name, reference, _ = verified
    run_dir = tmp_path / "run"
    overrides = [*EXPERIMENTS[name], *KILLED_RUN_EXTRA.get(name, []), "logger=none"]
    proc = train(run_dir, *overrides, fault=KILL_AT, micro=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    resumed = subprocess.run(
        [sys.executable, "-m", "reprotrain.tools.runs.resume", str(run_dir)],
        cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert_ok(resumed)
    got, ref = run_json(run_dir), run_json(reference)
    assert got["status"] == "completed" and got["resumes"][0]["global_step"] == 3
    assert got["final_weights_sha256"] == ref["final_weights_sha256"]
    assert metrics_without_timings(run_dir) == metrics_without_timings(reference)
    assert jsonl(run_dir / "fingerprints.jsonl") == jsonl(reference / "fingerprints.jsonl")


def test_regression_records_rmse_and_r2_and_no_accuracy(verified_runs):
    run_dir, _ = verified_runs("regression")
    record = run_json(run_dir)
    text = json.dumps(record) + (run_dir / "metrics.jsonl").read_text()
    assert "_acc" not in text
    rows = jsonl(run_dir / "metrics.jsonl")
    assert all({"train_rmse", "val_rmse", "val_r2"} <= set(r) for r in rows)
    best = min(rows, key=lambda r: r["val_rmse"])  # monitor val_rmse, mode min
    assert (run_dir / "checkpoints" / "best.pt").is_file()
    found = re.search(r"val_rmse=(\S+) \(best epoch (\d+)\)", (run_dir / "train.log").read_text())
    assert found and int(found[2]) == best["epoch"] and float(found[1]) == best["val_rmse"]
