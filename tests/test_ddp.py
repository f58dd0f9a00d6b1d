"""Scale-out at the trainer level: torchrun DDP on gloo, one run dir, one writer.

- 2 nodes x 1 process (two torchrun agents, c10d rendezvous on 127.0.0.1) gives the same
  bits as 1 node x 2 processes: same global batches, same all-reduce (gloo, 2 ranks).
- A DDP run makes exactly one run directory and one run.json, with world_size 2.
- A second writer into a live run directory is refused in one line; after the first is
  SIGKILLed, `make resume` takes the lock over and completes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import faults
from conftest import MICRO, REPO, assert_ok, base_env, jsonl, metrics_without_timings, run_json

# One thread per rank in every layout: the thread count changes the bits (2 nodes x 1 process
# would otherwise give each process all the cores of its "node").
DDP = [*MICRO, "trainer.checkpoint_every_steps=5", "repro.num_threads=1"]
slow = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ddp_env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in base_env().items() if k not in drop}


def torchrun_one_node(run_dir: Path, nproc: int = 2, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "reprotrain.train",
        *DDP,
        *extra,
        f"hydra.run.dir={run_dir}",
    ]
    return subprocess.run(cmd, cwd=REPO, env=ddp_env(), capture_output=True, text=True, timeout=900)


def torchrun_two_nodes(run_dir: Path) -> list[subprocess.CompletedProcess]:
    """Two agents as two nodes would start them (the sbatch recipe in the README)."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=1",
                f"--node-rank={node}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id=reprotrain-{port}",
                "-m",
                "reprotrain.train",
                *DDP,
                f"hydra.run.dir={run_dir}",
            ],
            cwd=REPO,
            env=ddp_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=900)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def outputs_listing() -> set[str]:
    out = REPO / "outputs"
    return {str(p) for p in out.rglob("run.json")} if out.exists() else set()


def test_ddp_run_makes_one_run_dir_with_world_size_2_and_is_repeatable(tmp_path):
    before = outputs_listing()
    a, b = tmp_path / "a", tmp_path / "b"
    first = torchrun_one_node(a)
    assert_ok(first)
    assert_ok(torchrun_one_node(b))
    # The start's overrides and config: rank 0's, once on the console and once in the log.
    assert (first.stdout + first.stderr).count("config (resolved;") == 1
    assert (a / "train.log").read_text().count("overrides: ") == 1
    assert sorted(p.parent.name for p in tmp_path.rglob("run.json")) == ["a", "b"]
    assert outputs_listing() == before  # no per-rank ${now:} directories appeared
    ra, rb = run_json(a), run_json(b)
    assert ra["status"] == "completed" and ra["world_size"] == 2  # key name: the lead's
    assert ra["final_weights_sha256"] == rb["final_weights_sha256"]
    assert jsonl(a / "fingerprints.jsonl") == jsonl(b / "fingerprints.jsonl")


@slow
def test_two_nodes_of_one_process_equal_one_node_of_two(tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    assert_ok(torchrun_one_node(single))
    for agent in torchrun_two_nodes(multi):
        assert_ok(agent)
    rs, rm = run_json(single), run_json(multi)
    assert rm["status"] == "completed" and rm["world_size"] == 2
    assert rs["final_weights_sha256"] == rm["final_weights_sha256"]
    fs, fm = jsonl(single / "fingerprints.jsonl"), jsonl(multi / "fingerprints.jsonl")
    assert [f["weights_sha256"] for f in fs] == [f["weights_sha256"] for f in fm]
    assert [f["step_losses_sha256"] for f in fs] == [f["step_losses_sha256"] for f in fm]
    assert metrics_without_timings(single) == metrics_without_timings(multi)


def test_a_second_writer_is_refused_and_resume_after_sigkill_takes_the_lock_over(tmp_path):
    run_dir = tmp_path / "run"
    slow = ["trainer.checkpoint_every_steps=4"]
    first = subprocess.Popen(  # stopped (SIGSTOP) after step 5, step 4's checkpoint written
        faults.command("stop:5", "reprotrain.train", *MICRO, *slow, f"hydra.run.dir={run_dir}"),
        cwd=REPO,
        env=base_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 300
        while not list((run_dir / "checkpoints").glob("step-*.pt")):
            assert first.poll() is None, first.stderr.read()  # ended: its pipe is closed
            assert time.time() < deadline, "no checkpoint before step 5 (the run stops there)"
            time.sleep(0.2)
        hydra_files = {p: p.read_bytes() for p in (run_dir / ".hydra").iterdir()}
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "reprotrain.train",
                *MICRO,
                *slow,
                f"hydra.run.dir={run_dir}",
                "resume=auto",
            ],
            cwd=REPO,
            env=base_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert second.returncode != 0
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), second.stderr
        assert f"pid {first.pid}" in lines[0]
        assert {p: p.read_bytes() for p in (run_dir / ".hydra").iterdir()} == hydra_files
        assert json.loads((run_dir / "run.json").read_text())["status"] == "running"
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    resumed = subprocess.run(
        [sys.executable, "-m", "reprotrain.tools.runs.resume", str(run_dir)],
        cwd=REPO,
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert_ok(resumed)
    assert "taking over the lock" in resumed.stdout + resumed.stderr  # Hydra logs to stdout
    assert run_json(run_dir)["status"] == "completed"
    assert not (run_dir / ".lock").exists()


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("ddp") / "ref"
    assert_ok(torchrun_one_node(run))
    return run


def test_sigkill_of_a_ddp_job_then_make_resume_is_bitwise(tmp_path, ddp_reference):
    run = tmp_path / "killed"
    trainer = faults.command("step:12", "reprotrain.train", *DDP, f"hydra.run.dir={run}")[1:]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        *trainer,
    ]  # fmt: skip  (killed mid-epoch 2, after step 10's checkpoint)
    proc = subprocess.run(cmd, cwd=REPO, env=ddp_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode != 0 and run_json(run)["status"] == "running"
    resumed = subprocess.run(
        [sys.executable, "-m", "reprotrain.tools.runs.resume", str(run)],
        cwd=REPO, env=ddp_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert_ok(resumed)
    got, ref = run_json(run), run_json(ddp_reference)
    assert got["world_size"] == 2 and got["resumes"][0]["global_step"] == 10
    # Every rank replayed from the checkpoint before (epoch 1's end, step 8), rank 0 compared.
    assert got["resumes"][0]["verified"] == "steps 9..10 replayed from step-00000008.pt, identical"
    assert got["final_weights_sha256"] == ref["final_weights_sha256"]
    assert jsonl(run / "fingerprints.jsonl") == jsonl(ddp_reference / "fingerprints.jsonl")
    assert metrics_without_timings(run) == metrics_without_timings(ddp_reference)


def test_resume_with_another_world_size_is_refused_in_one_line(tmp_path, ddp_reference):
    import shutil

    run = Path(shutil.copytree(ddp_reference, tmp_path / "copy"))
    (run / ".lock").unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "reprotrain.tools.runs.resume", str(run), "--nproc", "1",
         "trainer.epochs=3"],
        cwd=REPO, env=ddp_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "world size 2" in lines[0] and "Traceback" not in proc.stderr


def test_sigusr2_checkpoints_marks_interrupted_and_resumes_bitwise(tmp_path, reference_run):
    from conftest import train

    run = tmp_path / "usr2"
    proc = train(run, "trainer.checkpoint_every_steps=3", fault="sigusr2:5")
    assert proc.returncode == 75, proc.stderr[-2000:]
    record = run_json(run)
    assert record["status"] == "interrupted" and record["interrupted_by"] == "SIGUSR2"
    resumed = subprocess.run(
        [sys.executable, "-m", "reprotrain.tools.runs.resume", str(run)],
        cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert_ok(resumed)
    assert run_json(run)["final_weights_sha256"] == run_json(reference_run)["final_weights_sha256"]
