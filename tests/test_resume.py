"""Exact resume: interrupted at any point, a resumed run ends bitwise equal to the
uninterrupted reference (``reference_run``: the micro config, checkpoints every 3 steps;
8 steps per epoch, 16 in all)."""

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import (
    MICRO,
    REPO,
    assert_ok,
    base_env,
    jsonl,
    metrics_without_timings,
    resume,
    run_json,
    train,
)
from reprotrain.errors import CheckpointError
from reprotrain.repro import checkpoint

CKPT_EVERY = "trainer.checkpoint_every_steps=3"


def assert_same_as_reference(run_dir, reference):
    got, ref = run_json(run_dir), run_json(reference)
    assert got["status"] == "completed"
    assert got["final_weights_sha256"] == ref["final_weights_sha256"]
    assert metrics_without_timings(run_dir) == metrics_without_timings(reference)
    assert jsonl(run_dir / "fingerprints.jsonl") == jsonl(reference / "fingerprints.jsonl")


def killed_run(tmp_path, spec, *overrides):
    run_dir = tmp_path / "run"
    proc = train(run_dir, CKPT_EVERY, *overrides, fault=spec)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert run_json(run_dir)["status"] == "running"  # a SIGKILL leaves no chance to record
    return run_dir


@pytest.mark.parametrize(
    "spec",
    [
        "step:5",  # mid-epoch: newest checkpoint is step 3, two steps are replayed
        "after-save:8",  # exactly at the epoch boundary, right after its checkpoint
        "in-save:12",  # halfway through writing a checkpoint: previous one (9) is used
    ],
)
def test_sigkill_then_resume_is_bitwise_equal(tmp_path, reference_run, spec):
    run_dir = killed_run(tmp_path, spec)
    if spec.startswith("in-save"):
        assert list((run_dir / "checkpoints").glob(".*partial.tmp"))  # the half-written file
    proc = resume(run_dir)
    assert_ok(proc)
    assert_same_as_reference(run_dir, reference_run)
    assert not list((run_dir / "checkpoints").glob(".*.tmp"))
    resumes = run_json(run_dir)["resumes"]
    assert len(resumes) == 1 and resumes[0]["bitwise_guarantee"] is True
    assert resumes[0]["code_sha256"] == run_json(run_dir)["code_sha256"]  # compared: the same
    expected_step = {"step:5": 3, "after-save:8": 8, "in-save:12": 9}[spec]
    assert resumes[0]["global_step"] == expected_step
    before = {"step:5": "the run's start", "after-save:8": "step-00000006.pt",
              "in-save:12": "step-00000008.pt"}[spec]  # fmt: skip
    first = {"step:5": 1, "after-save:8": 7, "in-save:12": 9}[spec]
    line = f"steps {first}..{expected_step} replayed from {before}, identical"
    assert resumes[0]["verified"] == line  # how the bits were established


def test_sigkill_on_the_loader_path_with_two_workers(tmp_path, reference_run):
    loader = ("trainer.pipeline=loader", "trainer.num_workers=2")
    run_dir = killed_run(tmp_path, "step:11", *loader)
    assert_ok(resume(run_dir))
    assert_same_as_reference(run_dir, reference_run)  # the device path's reference: same bits
    assert run_json(run_dir)["resumes"][0]["global_step"] == 9


def test_second_sigint_aborts_at_once_and_earlier_checkpoints_stay_valid(tmp_path, reference_run):
    run_dir = tmp_path / "run"
    proc = train(run_dir, CKPT_EVERY, fault="sigint2:5")
    assert proc.returncode == 130, proc.stderr[-2000:]
    record = run_json(run_dir)
    assert record["status"] == "interrupted" and "second SIGINT" in record["error"]
    assert not (run_dir / "checkpoints" / "step-00000005.pt").exists()  # no new checkpoint
    assert_ok(resume(run_dir))
    assert_same_as_reference(run_dir, reference_run)
    assert run_json(run_dir)["resumes"][0]["global_step"] == 3


def test_stop_flag_second_sigint_raises():
    from reprotrain.start import StopFlag

    flag = StopFlag()
    flag._handle(signal.SIGTERM, None)
    flag._handle(signal.SIGTERM, None)  # repeated SIGTERM: still a graceful stop
    assert flag.signal_name == "SIGTERM"
    interrupt = StopFlag()
    interrupt._handle(signal.SIGINT, None)
    assert interrupt.signal_name == "SIGINT"
    with pytest.raises(KeyboardInterrupt):
        interrupt._handle(signal.SIGINT, None)


def test_sigterm_checkpoints_marks_interrupted_and_resumes(tmp_path, reference_run):
    run_dir = tmp_path / "run"
    proc = train(run_dir, CKPT_EVERY, fault="sigterm:5")
    assert proc.returncode == 75, proc.stderr[-2000:]
    record = run_json(run_dir)
    assert record["status"] == "interrupted" and record["interrupted_by"] == "SIGTERM"
    assert (run_dir / "checkpoints" / "step-00000005.pt").is_file()
    assert_ok(resume(run_dir))
    assert_same_as_reference(run_dir, reference_run)
    (entry,) = run_json(run_dir)["resumes"]
    assert entry["global_step"] == 5
    # A preemption checkpoint at an arbitrary step is verified from the cadence one before.
    assert entry["verified"] == "steps 4..5 replayed from step-00000003.pt, identical"


def test_external_sigterm_with_two_loader_workers(tmp_path, reference_run):
    """A real signal from outside to the whole process group (workers included), on the
    DataLoader path, the way a scheduler or Ctrl-C delivers it."""
    run_dir = tmp_path / "run"
    overrides = [CKPT_EVERY, "trainer.pipeline=loader", "trainer.num_workers=2"]
    cmd = [sys.executable, "-m", "reprotrain.train", *MICRO, *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=base_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    deadline = time.time() + 120
    while not (run_dir / "checkpoints" / "step-00000003.pt").exists():
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-2000:]
    assert run_json(run_dir)["status"] == "interrupted"
    assert_ok(resume(run_dir))
    assert_same_as_reference(run_dir, reference_run)


def test_truncated_newest_checkpoint_falls_back_in_one_line(tmp_path, reference_run):
    run_dir = killed_run(tmp_path, "step:14")
    newest = checkpoint.list_step_checkpoints(run_dir / "checkpoints")[-1]
    assert newest.name == "step-00000012.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    proc = resume(run_dir)
    assert_ok(proc)
    notes = [line for line in proc.stdout.splitlines() if "falling back" in line]
    assert len(notes) == 1 and "step-00000012.pt" in notes[0] and "truncated" in notes[0]
    assert_same_as_reference(run_dir, reference_run)
    assert run_json(run_dir)["resumes"][0]["global_step"] == 9


def copy_of(run_dir, tmp_path):
    """A copy of a finished run to resume from: cheaper than training a new one."""
    return shutil.copytree(run_dir, tmp_path / "copy")


def test_changed_config_is_refused_naming_the_key(tmp_path, reference_run):
    run_dir = copy_of(reference_run, tmp_path)
    before = (run_dir / "run.json").read_bytes()
    proc = resume(run_dir, "optimizer.lr=0.5")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "optimizer.lr" in lines[0] and "Traceback" not in proc.stderr
    assert (run_dir / "run.json").read_bytes() == before  # the refused resume touched nothing


def test_extending_epochs_is_allowed(tmp_path, reference_run):
    run_dir = copy_of(reference_run, tmp_path)
    assert_ok(resume(run_dir, "trainer.epochs=3"))
    record = run_json(run_dir)
    assert record["status"] == "completed" and record["epochs_completed"] == 3
    assert [r["epoch"] for r in jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
    refused = resume(run_dir, "trainer.epochs=1")
    assert refused.returncode == 2 and "trainer.epochs=1" in refused.stderr


def test_other_torch_version_is_warned_and_recorded(tmp_path, reference_run):
    run_dir = copy_of(reference_run, tmp_path)
    record = run_json(run_dir)  # as a stop after step 15 leaves it: a completed run is
    record["status"] = "interrupted"  # never reopened from an older checkpoint (issue 45)
    (run_dir / "run.json").write_text(json.dumps(record))
    ckpt = run_dir / "checkpoints" / "step-00000015.pt"
    state = checkpoint.load(ckpt)
    state["env"]["torch"] = "1.0.0"
    checkpoint.save(run_dir / "checkpoints" / "other-torch.pt", checkpoint.serialise(state))
    proc = resume(run_dir, f"resume={run_dir / 'checkpoints' / 'other-torch.pt'}")
    assert_ok(proc)
    entry = run_json(run_dir)["resumes"][-1]
    assert entry["bitwise_guarantee"] is False and "torch" in entry["mismatch"][0]
    assert "no longer guaranteed" in proc.stdout
    assert_same_as_reference(run_dir, reference_run)  # here it still is: same torch really


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch EXPLOITED",))


def test_pickle_that_runs_code_is_refused(tmp_path):
    evil = tmp_path / "evil.pt"
    evil.write_bytes(pickle.dumps({"format_version": 1, "x": Exploit()}))
    with pytest.raises(CheckpointError, match="refused"):
        checkpoint.load(evil)
    torch.save({"format_version": 1, "x": Exploit()}, evil)  # the torch zip format too
    with pytest.raises(CheckpointError, match="refused"):
        checkpoint.load(evil)
    assert not (tmp_path / "EXPLOITED").exists() and not (REPO / "EXPLOITED").exists()


def test_resume_of_a_non_run_directory_is_one_line(tmp_path):
    proc = resume(tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "not a reprotrain run directory" in proc.stderr


def test_fp16_grad_scaler_state_survives_a_kill(tmp_path):
    """16-mixed: fp16 autocast (CPU here) with loss scaling. The scale starts too high (2**20) and
    halves on each overflowing step, which is skipped; a resume that forgot the GradScaler
    state would restart at 2**20, skip steps again and end with different weights."""
    amp = ("trainer.precision=16-mixed", "trainer.amp_init_scale=1048576")
    reference = tmp_path / "ref"
    assert_ok(train(reference, CKPT_EVERY, *amp))
    state = checkpoint.load(checkpoint.list_step_checkpoints(reference / "checkpoints")[-1])
    assert state["scaler"]["scale"] < 2.0**20  # overflow steps really were skipped
    run_dir = killed_run(tmp_path, "step:5", *amp)
    assert_ok(resume(run_dir))
    assert_same_as_reference(run_dir, reference)


def test_requeue_with_the_same_command_and_resume_auto(tmp_path, reference_run):
    """A scheduler requeue re-runs the exact same command line; resume=auto starts fresh the
    first time (no checkpoint yet) and continues the second time."""
    run_dir = killed_run(tmp_path, "step:5", "resume=auto")
    assert run_json(run_dir)["resumes"] == []
    assert_ok(train(run_dir, CKPT_EVERY, "resume=auto"))
    assert_same_as_reference(run_dir, reference_run)
    assert run_json(run_dir)["resumes"][0]["global_step"] == 3
