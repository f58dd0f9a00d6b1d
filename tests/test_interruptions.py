"""Interruptions that are not a signal to the trainer: a SIGKILL mid-run seen from
TensorBoard, a killed DataLoader worker, a full disk. Each ends in one line, with a record
that says what happened and a checkpoint ``make resume`` continues bitwise."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from conftest import MICRO, REPO, assert_ok, base_env, jsonl, run_json, train

CKPT_EVERY = "trainer.checkpoint_every_steps=3"


def resume(run_dir: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "reprotrain.tools.runs.resume", str(run_dir)],
        cwd=REPO, env=env or base_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr[-3000:]
    return [x for x in stderr.splitlines() if x.startswith("error:")]


def raw_steps(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    """Every (step, value) of ``tag`` in every event file, as written: no purging."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    out = []
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.tag == tag:
                    number = (
                        value.simple_value
                        if value.HasField("simple_value")
                        else float(tensor_util.make_ndarray(value.tensor))
                    )
                    out.append((event.step, number))
    return out


def test_tensorboard_after_a_kill_and_resume_has_every_step_exactly_once(tmp_path):
    kill_at = random.Random().randint(4, 15)  # any step, mid-epoch or at the epoch's end
    run = tmp_path / "run"
    killed = train(run, CKPT_EVERY, fault=f"step:{kill_at}")
    assert killed.returncode == -9, (kill_at, killed.stderr[-2000:])
    assert_ok(resume(run))
    points = raw_steps(run / "tensorboard", "step/train_loss")
    steps = [s for s, _ in points]
    assert Counter(steps) == Counter(range(1, 17)), (kill_at, sorted(Counter(steps).items()))
    truth = [v for row in jsonl(run / "fingerprints.jsonl") for v in row["step_losses"]]
    assert [v for _, v in sorted(points)] == pytest.approx(truth, rel=1e-6), kill_at
    epochs = raw_steps(run / "tensorboard", "epoch/epoch")
    assert sorted(epochs) == [(8, 1.0), (16, 2.0)], kill_at


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_a_killed_loader_worker_ends_the_run_in_one_line_and_resumes_bitwise(
    tmp_path, reference_run
):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "reprotrain.train", *MICRO, CKPT_EVERY,
           "trainer.pipeline=loader", "trainer.num_workers=2", f"hydra.run.dir={run}"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=base_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "step-00000003.pt").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.05)
    workers = _children(proc.pid)
    while not workers and proc.poll() is None:
        time.sleep(0.05)
        workers = _children(proc.pid)
    assert workers, "the loader path has worker processes"
    os.kill(workers[0], signal.SIGKILL)  # what the OOM killer does
    try:
        _, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the trainer did not exit after its worker was killed") from None
    assert proc.returncode == 75, err[-3000:]
    (line,) = error_lines(err)
    assert "DataLoader worker" in line and "make resume" in line, line
    record = run_json(run)
    assert record["status"] == "interrupted" and "DataLoader worker" in record["error"]
    assert not [p for p in workers if Path(f"/proc/{p}").exists()], "no worker left behind"
    assert_ok(resume(run))
    final = run_json(run)
    assert final["status"] == "completed"
    assert final["final_weights_sha256"] == run_json(reference_run)["final_weights_sha256"]


@pytest.mark.parametrize("full", ["step-00000002.pt", "metrics.jsonl"])
def test_a_full_disk_names_the_path_and_leaves_the_run_failed(tmp_path, full):
    run = tmp_path / "run"
    proc = train(run, "trainer.epochs=1", "trainer.limit_train_steps=2", fault=f"enospc:{full}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = error_lines(proc.stderr)
    assert full in line and str(run) in line and "No space left on device" in line, line
    record = run_json(run)
    assert record["status"] == "failed" and full in record["error"]
    assert "No space left on device" in (run / "train.log").read_text()
    assert not list((run / "checkpoints").glob(".*.tmp")), "no half-written temp file"
