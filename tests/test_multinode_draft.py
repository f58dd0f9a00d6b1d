"""DRAFT (issue 9) for the lead: trainer-level checks that need DDP and the run lock wired
into train.py. Each test is skipped with the wiring it waits for; remove the skip when it lands.

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

from conftest import MICRO, REPO, assert_ok, base_env, jsonl, metrics_without_timings, run_json

DDP = [*MICRO, "trainer.checkpoint_every_steps=5"]
needs_ddp = pytest.mark.skip(reason="needs DDP in trainer")
needs_lock = pytest.mark.skip(reason="needs RunLock in trainer")


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


@needs_ddp
def test_ddp_run_makes_one_run_dir_with_world_size_2_and_is_repeatable(tmp_path):
    before = outputs_listing()
    a, b = tmp_path / "a", tmp_path / "b"
    assert_ok(torchrun_one_node(a))
    assert_ok(torchrun_one_node(b))
    assert sorted(p.parent.name for p in tmp_path.rglob("run.json")) == ["a", "b"]
    assert outputs_listing() == before  # no per-rank ${now:} directories appeared
    ra, rb = run_json(a), run_json(b)
    assert ra["status"] == "completed" and ra["world_size"] == 2  # key name: the lead's
    assert ra["final_weights_sha256"] == rb["final_weights_sha256"]
    assert jsonl(a / "fingerprints.jsonl") == jsonl(b / "fingerprints.jsonl")


@needs_ddp
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


@needs_lock
def test_a_second_writer_is_refused_and_resume_after_sigkill_takes_the_lock_over(tmp_path):
    run_dir = tmp_path / "run"
    slow = ["dataset.num_train=4096", "trainer.checkpoint_every_steps=4"]
    first = subprocess.Popen(
        [sys.executable, "-m", "reprotrain.train", *MICRO, *slow, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        env=base_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 300
        while not list((run_dir / "checkpoints").glob("step-*.pt")):
            assert first.poll() is None and time.time() < deadline, first.stderr.read()
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
        [sys.executable, "-m", "reprotrain.tools.resume", str(run_dir)],
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
