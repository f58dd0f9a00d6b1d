"""Every sweep continues after a kill (``make resume RUN=<sweep dir>``, ``reprotrain resume``):
a killed job resumes bitwise, a job that never started starts, a finished job is left byte for
byte, and the sweep's summary then covers every job (``tools/sweeps/continuation.py``). The
kills are exact (``tests/sweep_kills.py``): inside the last job (default tier), before the
first job ends and between two jobs (slow tier)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import MICRO, REPO, TINY, assert_ok, base_env, resume, run_json, train

#: Each job: 3 steps of 32, a checkpoint after each (so a kill mid-job leaves one).
JOB = [*TINY, "trainer.checkpoint_every_steps=1"]


def sweep(sweep_dir: Path, *overrides: str, kill: str | None = None) -> subprocess.CompletedProcess:
    """A multirun of MICRO+JOB jobs into ``sweep_dir``; ``kill`` (tests/sweep_kills.py) fires."""
    args = ["--multirun", *MICRO, *JOB, *overrides, f"hydra.sweep.dir={sweep_dir}"]
    entry = ["-m", "reprotrain.train"]
    if kill:
        entry = [str(REPO / "tests" / "sweep_kills.py"), kill, *entry]
    return subprocess.run([sys.executable, *entry, *args], cwd=REPO, env=base_env(),
                          capture_output=True, text=True, timeout=900)  # fmt: skip


def files(job: Path) -> dict[str, bytes]:
    """Every file of a job directory, by relative path: what "left byte for byte" compares."""
    return {p.relative_to(job).as_posix(): p.read_bytes() for p in job.rglob("*") if p.is_file()}


def twin(tmp_path: Path, *overrides: str) -> dict:
    """The record of one uninterrupted run of a job's overrides."""
    run_dir = tmp_path / "twin" / "_".join(overrides).replace("=", "-")
    assert_ok(train(run_dir, *JOB, *overrides))
    return run_json(run_dir)


def continued(sweep_dir: Path, killed: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    proc = resume(sweep_dir)
    assert_ok(proc)
    return proc


def summary_runs(sweep_dir: Path) -> list[dict]:
    return json.loads((sweep_dir / "summary.json").read_text())["runs"]


def test_a_sweep_killed_inside_its_last_job_continues_and_leaves_the_finished_job(tmp_path):
    sweep_dir = tmp_path / "sweep"
    killed = sweep(sweep_dir, "seed.base=0,1", kill="job:1:step:2")
    assert run_json(sweep_dir / "0")["status"] == "completed"
    assert run_json(sweep_dir / "1")["status"] == "running"
    before = files(sweep_dir / "0")
    continued(sweep_dir, killed)
    assert files(sweep_dir / "0") == before, "a finished job is left byte for byte"
    got = run_json(sweep_dir / "1")
    assert got["status"] == "completed"
    assert got["final_weights_sha256"] == twin(tmp_path, "seed.base=1")["final_weights_sha256"]
    runs = summary_runs(sweep_dir)
    assert sorted(r["seed"] for r in runs) == [0, 1]
    assert {r["status"] for r in runs} == {"completed"}


@pytest.mark.slow
def test_a_grid_sweep_killed_before_its_first_job_ends_runs_every_job(tmp_path):
    sweep_dir = tmp_path / "sweep"
    killed = sweep(sweep_dir, "optimizer=sgd,adamw", "seed.base=0,1", kill="job:0:step:2")
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["0"]
    continued(sweep_dir, killed)
    for number in range(4):
        assert run_json(sweep_dir / str(number))["status"] == "completed"
    got = run_json(sweep_dir / "0")
    first = twin(tmp_path, "optimizer=sgd", "seed.base=0")
    assert got["final_weights_sha256"] == first["final_weights_sha256"], "resumed bitwise"
    assert len(summary_runs(sweep_dir)) == 4


@pytest.mark.slow
def test_a_sweep_killed_between_two_jobs_starts_the_next_one(tmp_path):
    sweep_dir = tmp_path / "sweep"
    killed = sweep(sweep_dir, "seed.base=0,1,2", kill=f"enter:{sweep_dir / '1'}")
    assert not (sweep_dir / "1" / "run.json").exists()
    before = files(sweep_dir / "0")
    continued(sweep_dir, killed)
    assert files(sweep_dir / "0") == before
    got = run_json(sweep_dir / "1")
    assert got["final_weights_sha256"] == twin(tmp_path, "seed.base=1")["final_weights_sha256"]
    assert sorted(r["seed"] for r in summary_runs(sweep_dir)) == [0, 1, 2]
