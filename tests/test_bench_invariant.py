"""make bench's ``invariant`` figure: the step time of a world-size-invariant run over a plain
DDP run, both measured in this bench run, same W, micro-batch size and threads per rank.
No timing is asserted: speed is the bench's output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import invariance_cost
from benchmarks.invariance_cost import InvariantSetup, measure_invariant
from benchmarks.results import table_rows

REPO = Path(__file__).resolve().parents[1]


def fake_runner(calls: list[list[str]], rates: dict[bool, list[float]]):
    """Stands in for torchrun: records the command, writes that side's metrics.jsonl."""

    def run_checked(cmd: list[str], drop_env: tuple[str, ...] = ()) -> None:
        calls.append(cmd)
        invariant = "trainer.world_size_invariant=true" in cmd
        run_dir = Path(next(a for a in cmd if a.startswith("hydra.run.dir=")).split("=", 1)[1])
        run_dir.mkdir(parents=True)
        rows = [{"epoch": 1, "images_per_s": 1.0}, {"epoch": 2, "images_per_s": 0.0}]
        rows[1]["images_per_s"] = rates[invariant].pop(0)
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert "RANK" in drop_env and "WORLD_SIZE" in drop_env  # a child never inherits a rank

    return run_checked


def test_the_ratio_is_invariant_over_ddp_step_time_from_two_interleaved_runs(tmp_path, monkeypatch):
    calls: list[list[str]] = []
    rates = {False: [200.0, 100.0], True: [100.0, 40.0]}  # images/s; the machine slows 2x
    monkeypatch.setattr(invariance_cost, "run_checked", fake_runner(calls, rates))
    setup = InvariantSetup(world_size=2, batch_size=64, microbatch_size=16, repeats=2)
    counted: list[InvariantSetup] = []

    def count(s: InvariantSetup) -> dict:  # stands in for the in-process op count
        counted.append(s)
        sides = {
            "ddp": {"kernels": 200, "metadata": 90},
            "invariant": {"kernels": 210, "metadata": 120},
        }
        return {"microbatches_per_step": 4, "bench net": sides}

    lines: list[str] = []
    r = measure_invariant(setup, tmp_path / "runs", log=lines.append, count=count)

    # A, B, A, B: plain DDP then invariant, both under torchrun with 2 ranks x 1 thread
    assert ["trainer.world_size_invariant=true" in c for c in calls] == [False, True] * 2
    for cmd in calls:
        assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"]
        assert "--nproc-per-node=2" in cmd and "experiment=selfcheck" in cmd
        assert {"trainer.microbatch_size=16", "repro.num_threads=1"} <= set(cmd)
    assert {"model.widths=[16,32,64]", "model.convs_per_stage=1"} <= set(calls[0])
    differ = set(calls[0]) ^ set(calls[1])
    assert {a.split("=")[0] for a in differ} == {"trainer.world_size_invariant", "hydra.run.dir"}

    # step time invariant / plain = images/s plain / images/s invariant, paired per repeat
    assert r["paired_ratios"] == [2.0, 2.5] and r["ratio"] == pytest.approx(2.25)
    assert r["a"] == [200.0, 100.0] and r["b"] == [100.0, 40.0]
    assert len(r["runs"]["ddp"]) == len(r["runs"]["invariant"]) == 2
    assert (r["world_size"], r["microbatch_size"], r["microbatches_per_step"]) == (2, 16, 4)

    row, ops = table_rows({"invariant": r})
    assert counted == [setup]  # after the timed runs, the ops of both steps, side by side
    assert "ratio 2.250" in lines[-2] and "ddp 200 / invariant 210 (1.050)" in lines[-1]
    assert ops["figure"] == "invariant ops" and ops["ratio"] == "1.050"
    assert ops["sides"] == "ddp 200 / invariant 210 ops (views and allocations: 90 / 120)"
    assert "W=1, k=4, bench net" in ops["measure"]
    assert row["figure"] == "invariant" and row["ratio"] == "2.250"
    assert "W=2, micro-batch 16, k=4, 1 thread/rank" in row["measure"]
    assert row["sides"] == "ddp 150 / invariant 70 images/s"
    assert row["target"] == "<= 1.15 at W=2"  # shown beside the measurement


def test_a_world_size_that_does_not_divide_k_is_refused():
    with pytest.raises(ValueError, match="multiple of world_size=2"):
        InvariantSetup(world_size=2, batch_size=48, microbatch_size=16)  # k = 3
    assert invariance_cost.side_command(
        InvariantSetup(world_size=1, batch_size=64, microbatch_size=16), True, Path("r")
    )[1:3] == ["-m", "reprotrain.train"]  # W=1 (one GPU): no torchrun


@pytest.mark.slow
def test_smoke_bench_measures_invariant_and_plain_ddp_runs_at_two_ranks(tmp_path):
    """End to end: ``bench.py --smoke --only invariant`` runs both sides under torchrun."""
    out = tmp_path / "bench"
    cmd = [sys.executable, "scripts/bench.py", "--smoke", "--only", "invariant", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads((out / "bench.json").read_text())["invariant"]
    assert r["ratio"] > 0 and r["a_median"] > 0 and r["b_median"] > 0
    for side, invariant in (("ddp", False), ("invariant", True)):
        (run_dir,) = r["runs"][side]
        record = json.loads((Path(run_dir) / "run.json").read_text())
        assert record["world_size"] == 2 and record["world_size_invariant"] is invariant
        assert record["status"] == "completed"
    assert "| invariant |" in (out / "bench.md").read_text()


def load_bench_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_script", REPO / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("gpus", "ranks"), [(1, 1), (2, 2), (8, 2)])
def test_on_cuda_the_figure_uses_one_rank_per_gpu_at_most_two(monkeypatch, gpus, ranks):
    bench = load_bench_script()
    monkeypatch.setattr(bench.torch.cuda, "device_count", lambda: gpus)
    from reprotrain.selfcheck.net import WIDE

    for name in ("smoke", "quick", "full"):
        setup = bench.suite(name, "cuda", 2)["invariant"]
        assert setup.world_size == ranks and setup.device == "cuda"
        # the reference model's size, micro-batches of 128 that fill the GPU
        assert (setup.widths, setup.convs_per_stage) == (WIDE["widths"], WIDE["convs_per_stage"])
    cpu = bench.suite("quick", "cpu", 2)["invariant"]
    assert cpu.world_size == 2 and cpu.widths == (16, 32, 64)  # gloo: always 2, the small net


def test_the_gpu_check_reports_the_bench_ratio(tmp_path, monkeypatch):
    from benchmarks import gpu_check

    seen: list[list[str]] = []

    def fake_run(cmd, timeout, env=None, log=None):
        seen.append(cmd)
        out = Path(next(a for a in cmd if a.startswith("--out=")).split("=", 1)[1])
        out.mkdir(parents=True)
        ops = {
            "microbatches_per_step": 4,
            "resnet18": {
                "ddp": {"kernels": 9, "metadata": 1},
                "invariant": {"kernels": 8, "metadata": 2},
            },
        }
        figure = {"ratio": 1.5, "best_ratio": 1.4, "a_median": 300.0, "b_median": 200.0,
                  "world_size": 1, "microbatch_size": 128, "microbatches_per_step": 4,
                  "ops_per_step": ops}  # fmt: skip
        (out / "bench.json").write_text(json.dumps({"invariant": figure}))
        return 0, ""

    monkeypatch.setattr(gpu_check, "run", fake_run)
    result = gpu_check.check_invariant(tmp_path, gpu_check.Budget(600))
    (cmd,) = seen
    assert {"--device=cuda", "--only=invariant"} <= set(cmd)
    assert result["invariant_over_ddp_step_time"] == 1.5 and result["world_size"] == 1
    assert result["ddp_images_per_s"] == 300.0 and result["invariant_images_per_s"] == 200.0
    assert result["ops_per_step"]["resnet18"]["invariant"]["kernels"] == 8
    assert gpu_check.check_invariant(tmp_path, gpu_check.Budget(10)) == {"skipped": "time budget"}
