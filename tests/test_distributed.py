"""reprotrain.distributed: one process, and two real processes under torchrun on gloo."""

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
import torch

from reprotrain import distributed
from reprotrain.distributed import Dist, init_from_env, shard_global_batch, threads_per_rank
from reprotrain.errors import ReprotrainError

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "ddp_selfcheck.py"


def torchrun(nproc: int, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(SCRIPT),
        *args,
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_node_agents(script_args: list[str], port: int) -> list[subprocess.Popen]:
    """2 nodes x 1 process on this machine: two torchrun agents meeting at a c10d endpoint."""
    return [
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
                f"--rdzv-id=reprotrain-test-{port}",
                *script_args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
        )
        for node in (0, 1)
    ]


def clean_env() -> dict[str, str]:
    drop = (*distributed.ENV_KEYS, "TORCHELASTIC_RUN_ID", "GROUP_RANK")
    return {k: v for k, v in os.environ.items() if k not in drop}


def ranks(out_dir: Path, n: int) -> list[dict]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(n)]


def test_without_torchrun_there_is_no_process_group_and_helpers_are_identities(monkeypatch):
    for key in distributed.ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    d = init_from_env("cpu")
    assert (d.enabled, d.is_main, d.world_size, d.backend) == (False, True, 1, None)
    assert not torch.distributed.is_initialized()
    assert d.broadcast_object("outputs/a") == "outputs/a"
    assert d.all_reduce_any(True) is True and d.all_reduce_any(False) is False
    assert d.gather_objects({"r": 0}) == [{"r": 0}]
    assert d.scatter_objects([{"r": 0}]) == {"r": 0}
    d.barrier()
    d.destroy()
    assert d.as_record()["world_size"] == 1


def test_shards_of_a_global_batch_are_contiguous_and_their_union_is_the_batch():
    batch = torch.randperm(1000, generator=torch.Generator().manual_seed(0))[:96]
    for world in (1, 2, 3, 4):
        parts = [shard_global_batch(batch, r, world) for r in range(world)]
        assert torch.equal(torch.cat(parts), batch)
        assert {len(p) for p in parts} == {96 // world}
    assert shard_global_batch(list(range(8)), 1, 2) == [4, 5, 6, 7]


def test_a_global_batch_not_divisible_by_the_world_size_is_one_line_error():
    with pytest.raises(ReprotrainError) as e:
        shard_global_batch(torch.arange(10), 0, 4)
    msg = str(e.value)
    assert "\n" not in msg and "not divisible by the world size 4" in msg
    with pytest.raises(ReprotrainError, match=r"trainer\.batch_size=10 "):
        distributed.check_divisible(10, 4)


@pytest.mark.parametrize("kind", ["device", "loader"])
def test_a_pipeline_built_directly_refuses_an_uneven_rank_share_at_its_first_batch(kind):
    """config.check_layout refuses it before a run; a caller that builds a pipeline itself
    (bench, tests) still gets the one line, from the one rule (shard_global_batch)."""
    from reprotrain.data.base import InMemoryTensors
    from reprotrain.data.pipeline import PipelineSpec, build_pipeline
    from reprotrain.repro.seeding import Seeds

    class Tensors(InMemoryTensors):
        def load_samples(self):
            return (torch.arange(40.0), torch.zeros(40)), (torch.arange(8.0), torch.zeros(8))

    data = Tensors()
    seeds = Seeds(base=0, init=1, data=2, augment=3, train=4, source="config")
    cpu = torch.device("cpu")
    spec = PipelineSpec(10, 8, cpu, seeds, rank=1, world_size=4)
    pipeline = build_pipeline(kind, data.splits(), data, 0, spec)
    with pytest.raises(ReprotrainError, match=r"^trainer\.batch_size=10 .*world size 4"):
        next(iter(pipeline.epoch(1)))


def test_threads_per_rank_never_oversubscribes_the_node():
    assert threads_per_rank(1, cores=16) == 16
    assert threads_per_rank(2, cores=16) == 8
    assert threads_per_rank(3, cores=16) == 5
    assert threads_per_rank(4, cores=2) == 1
    assert threads_per_rank(1) == distributed.available_cores()


def test_cuda_requested_without_a_gpu_is_one_line_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ReprotrainError, match="no CUDA device"):
        init_from_env("cuda")


def test_two_ranks_share_rank0s_run_dir_gather_rng_and_shard_the_global_batch(tmp_path):
    proc = subprocess.run(
        torchrun(2, str(tmp_path)), capture_output=True, text=True, timeout=240, env=clean_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = ranks(tmp_path, 2)
    assert r0["backend"] == r1["backend"] == "gloo" and r0["world_size"] == 2
    # Each rank made up its own dir (as ${now:} would); both now use rank 0's.
    assert r0["own_run_dir"] != r1["own_run_dir"]
    assert r0["run_dir"] == r1["run_dir"] == r0["own_run_dir"]
    # ${run_stamp:} agrees before any process group exists (Hydra makes the dir that early).
    assert r0["run_stamp"] == r1["run_stamp"]
    # Rank 0 holds every rank's RNG state in rank order; scatter gives each its own back.
    assert r0["gathered_ranks"] == [0, 1] and r1["gathered_ranks"] is None
    assert r0["rng_sha"] != r1["rng_sha"]
    assert r0["scatter_returns_own_state"] and r1["scatter_returns_own_state"]
    # The ranks' parts are disjoint, contiguous, and together the single-process batch.
    assert r0["union_of_parts"] == r1["union_of_parts"] == r0["global_batch"]
    assert r0["part"] == r0["global_batch"][:32] and r1["part"] == r0["global_batch"][32:]
    assert r0["any_false"] is False and r0["any_only_rank1"] is r1["any_only_rank1"] is True
    assert r0["record"] == {"world_size": 2, "backend": "gloo", "local_world_size": 2, "nnodes": 1}


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    proc = subprocess.Popen(
        torchrun(2, str(tmp_path), "--stop-loop"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    try:
        deadline = time.time() + 180
        while not (tmp_path / "pid1").exists() and time.time() < deadline:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            time.sleep(0.1)
        time.sleep(0.5)  # let the loop run a while
        os.kill(int((tmp_path / "pid1").read_text()), signal.SIGUSR2)  # rank 1 only
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    r0, r1 = ranks(tmp_path, 2)
    assert r1["signal_here"] == "SIGUSR2" and r0["signal_here"] is None
    assert r0["stopped_after_step"] == r1["stopped_after_step"] > 1


def test_dist_record_is_plain_json():
    d = Dist(rank=1, world_size=4, local_rank=1, local_world_size=2, backend="gloo")
    assert json.loads(json.dumps(d.as_record()))["nnodes"] == 2


def test_submitit_tasks_become_ddp_ranks_without_torchrun(tmp_path, monkeypatch):
    """hydra/launcher=submitit_slurm with tasks_per_node=N: each task is one rank (the local
    executor sets the same SUBMITIT_* variables the SLURM one derives from SLURM_*)."""
    import submitit  # in the base lock: the SLURM launcher

    for key in distributed.ENV_KEYS:
        monkeypatch.delenv(key, raising=False)

    def task() -> dict:
        from reprotrain.distributed import init_from_env

        d = init_from_env("cpu")
        try:
            return {
                "rank": d.rank,
                "world": d.world_size,
                "backend": d.backend,
                "run_dir": d.broadcast_object(f"dir-of-rank-{d.rank}"),
                "stop": d.all_reduce_any(d.rank == 1),
            }
        finally:
            d.destroy()

    executor = submitit.AutoExecutor(folder=tmp_path, cluster="local")
    executor.update_parameters(tasks_per_node=2, timeout_min=5, gpus_per_node=0)
    results = executor.submit(task).results()
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert {(r["world"], r["backend"], r["run_dir"], r["stop"]) for r in results} == {
        (2, "gloo", "dir-of-rank-0", True)
    }


def test_two_torchrun_agents_with_c10d_rendezvous_form_one_two_node_job(tmp_path):
    agents = two_node_agents([str(SCRIPT), str(tmp_path)], free_port())
    try:
        errs = [a.communicate(timeout=240)[1] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    assert [a.returncode for a in agents] == [0, 0], [e[-2000:] for e in errs]
    r0, r1 = ranks(tmp_path, 2)
    assert (
        r0["record"]
        == r1["record"]
        == {
            "world_size": 2,
            "backend": "gloo",
            "local_world_size": 1,
            "nnodes": 2,
        }
    )
    assert r0["run_dir"] == r1["run_dir"] == r0["own_run_dir"]
    assert r0["run_stamp"] == r1["run_stamp"]
    assert r0["union_of_parts"] == r0["global_batch"]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_sigkill_of_torchruns_process_group_leaves_no_worker_running(tmp_path):
    """torchrun puts workers in sessions of their own; die_with_parent takes them down with
    the agent, so a killed job cannot go on writing its run directory as orphans."""
    agent = subprocess.Popen(
        torchrun(2, str(tmp_path), "--stop-loop"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=clean_env(),
        start_new_session=True,  # its own process group, as a shell job or a batch step has
    )
    workers: list[int] = []
    try:
        deadline = time.time() + 180
        while len(workers) < 2 and time.time() < deadline:
            workers = [int(p.read_text()) for p in sorted(tmp_path.glob("pid*"))]
            time.sleep(0.1)
        assert len(workers) == 2
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
        deadline = time.time() + 10
        while any(_alive(w) for w in workers) and time.time() < deadline:
            time.sleep(0.05)
        assert not any(_alive(w) for w in workers)
    finally:
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
