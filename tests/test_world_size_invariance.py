"""trainer.world_size_invariant: the same bits on 1, 2 and 4 processes (torchrun, gloo).

Every layout runs one thread per rank (the thread count is part of the bits) and the same
k = 4 micro-batches of 16 per step of 64; only the number of ranks that share them changes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import faults
from conftest import MICRO, REPO, assert_ok, base_env, jsonl, metrics_without_timings, run_json
from reprotrain.config import TrainerConfig
from reprotrain.errors import ReprotrainError
from reprotrain.repro import comparability

INVARIANT = [
    *MICRO,
    "trainer.microbatch_size=16",  # k = 64 / 16 = 4 micro-batches per step
    "trainer.world_size_invariant=true",
    "trainer.checkpoint_every_steps=2",
    "repro.num_threads=1",
    "logger=none",
]
DROPOUT = ["model.dropout=0.3"]  # draws from the global RNG: seeded per micro-batch
slow = pytest.mark.slow


def env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in base_env().items() if k not in drop}


def launch(nproc: int, run_dir: Path, *extra: str, fault: str | None = None):
    trainer = ["-m", "reprotrain.train", *INVARIANT, *extra, f"hydra.run.dir={run_dir}"]
    if fault:  # tests/faults.py runs the trainer (every rank) with the fault registered
        trainer = faults.command(fault, *trainer[1:])[1:]
    if nproc > 1:
        trainer = ["-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={nproc}", *trainer]  # fmt: skip
    return subprocess.run(
        [sys.executable, *trainer], cwd=REPO, env=env(),
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip


def resume(run_dir: Path, nproc: int):
    cmd = [
        sys.executable,
        "-m",
        "reprotrain.tools.runs.resume",
        str(run_dir),
        "--nproc",
        str(nproc),
    ]
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=900)


def assert_same_bits(a: Path, b: Path) -> None:
    ra, rb = run_json(a), run_json(b)
    assert ra["final_weights_sha256"] == rb["final_weights_sha256"]
    assert jsonl(a / "fingerprints.jsonl") == jsonl(b / "fingerprints.jsonl")  # every step loss
    assert metrics_without_timings(a) == metrics_without_timings(b)  # every metric
    assert ra["final_metrics"] == rb["final_metrics"]


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("invariant") / "w1"
    assert_ok(launch(1, run))
    return run


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("invariant") / "w2"
    assert_ok(launch(2, run))
    return run


def test_one_and_two_processes_give_the_same_weights_losses_and_metrics(one, two):
    assert run_json(one)["world_size"] == 1 and run_json(two)["world_size"] == 2
    assert run_json(two)["world_size_invariant"] is True
    assert run_json(two)["microbatches_per_step"] == 4
    assert_same_bits(one, two)


@slow
def test_four_processes_give_the_same_bits_and_without_the_mode_two_do_not(one, tmp_path):
    assert_ok(launch(4, tmp_path / "w4"))
    assert_same_bits(one, tmp_path / "w4")
    # The problem is real for this model: plain DDP at W=2 differs from one process.
    assert_ok(launch(2, tmp_path / "plain2", "trainer.world_size_invariant=false"))
    assert_ok(launch(1, tmp_path / "plain1", "trainer.world_size_invariant=false"))
    plain = [run_json(tmp_path / p)["final_weights_sha256"] for p in ("plain1", "plain2")]
    assert plain[0] != plain[1]


@slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_a_model_with_dropout_gives_the_same_bits_on_any_world_size(tmp_path, nproc, one):
    assert_ok(launch(1, tmp_path / "w1", *DROPOUT))
    assert_ok(launch(nproc, tmp_path / f"w{nproc}", *DROPOUT))
    assert_same_bits(tmp_path / "w1", tmp_path / f"w{nproc}")
    dropped = run_json(tmp_path / "w1")["final_weights_sha256"]
    assert dropped != run_json(one)["final_weights_sha256"]  # dropout did draw


def _kill_then_resume(tmp_path: Path, reference: Path, resume_on: int) -> None:
    run = tmp_path / "killed"
    killed = launch(2, run, fault="step:11")  # mid-epoch 2, after step 10's
    assert killed.returncode != 0 and run_json(run)["status"] == "running"
    resumed = resume(run, resume_on)
    assert_ok(resumed)
    record = run_json(run)
    assert record["resumes"][0]["global_step"] == 10
    assert record["resumes"][0]["bitwise_guarantee"] is True  # world size is not in the rule
    # The replay at the new world size, compared with the two-process checkpoint, is itself
    # the proof of invariance.
    assert record["resumes"][0]["verified"].endswith(", identical"), record["resumes"][0]
    assert_same_bits(reference, run)


def test_a_two_process_run_killed_mid_epoch_resumes_on_one_process_bitwise(tmp_path, one):
    _kill_then_resume(tmp_path, one, resume_on=1)


@slow
def test_a_two_process_run_killed_mid_epoch_resumes_on_four_processes_bitwise(tmp_path, one):
    _kill_then_resume(tmp_path, one, resume_on=4)


@slow
def test_reproduce_of_a_two_process_archive_on_one_process_is_bitwise(tmp_path, two):
    def tool(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", *args], cwd=tmp_path, env=env(), capture_output=True,
            text=True, timeout=900,
        )  # fmt: skip

    archived = tool("reprotrain.tools.archive.archive", str(two), "--out-dir", str(tmp_path / "a"))
    assert_ok(archived)
    (archive,) = (tmp_path / "a").glob("*.tar.gz")
    proc = tool("reprotrain.tools.reproduce.reproduce", str(archive), "--trust", "--runs-dir",
                str(tmp_path / "runs"))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("REPRODUCED (bitwise)")
    (replay,) = (tmp_path / "runs").iterdir()
    assert run_json(replay)["world_size"] == 1


def test_the_world_size_is_outside_the_bitwise_rule_only_for_an_invariant_run():
    a = {"device": {"type": "cpu"}, "world_size": 2, "torch": "2.14.1", "num_threads": 1}
    b = {**a, "world_size": 1}
    assert comparability.differences(a, b) == ["world size: 2 -> 1"]
    assert comparability.differences(a, b, world_size_invariant=True) == []


def test_a_world_size_that_does_not_divide_the_micro_batches_is_one_line():
    from reprotrain.config import check_layout

    settings = TrainerConfig(batch_size=64, microbatch_size=32, world_size_invariant=True)
    check_layout(settings, 2)  # k = 2: W = 1, 2 fine
    with pytest.raises(ReprotrainError, match=r"world size \(4\) to divide the 2 micro-batch"):
        check_layout(settings, 4)


def test_resume_on_a_world_size_that_does_not_divide_k_is_refused(tmp_path, two):
    import shutil

    run = Path(shutil.copytree(two, tmp_path / "copy"))
    record = json.loads((run / "run.json").read_text())
    (run / ".lock").unlink(missing_ok=True)
    proc = resume(run, 3)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not divide the run's 4 micro-batches" in lines[0]
    assert json.loads((run / "run.json").read_text()) == record  # nothing written
