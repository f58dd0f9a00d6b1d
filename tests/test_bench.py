"""make bench: its arithmetic, its report, its end-to-end smoke run, and the GPU check's
refusal on a machine without CUDA. No timings are asserted: speed is the bench's output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import stats
from benchmarks.results import COLUMNS, markdown_table, table_rows, write_outputs
from benchmarks.training import BenchRunError, steady_images_per_s

REPO = Path(__file__).resolve().parents[1]


# --- stats -----------------------------------------------------------------------------------
def test_median_of_odd_and_even_counts():
    assert stats.median([3.0, 1.0, 2.0]) == 2.0
    assert stats.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    with pytest.raises(ValueError):
        stats.median([])


def test_ratio_refuses_an_empty_denominator():
    assert stats.ratio(3.0, 2.0) == 1.5
    with pytest.raises(ZeroDivisionError):
        stats.ratio(1.0, 0.0)


def test_interleave_alternates_the_sides_a_b_a_b():
    calls: list[str] = []

    def side(name: str, value: float):
        def measure() -> float:
            calls.append(name)
            return value + len(calls)

        return measure

    values = stats.interleave({"a": side("a", 0.0), "b": side("b", 100.0)}, repeats=3)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert values == {"a": [1.0, 3.0, 5.0], "b": [102.0, 104.0, 106.0]}
    with pytest.raises(ValueError):
        stats.interleave({"a": side("a", 0.0)}, repeats=0)


def test_compare_takes_the_median_of_paired_ratios_not_the_ratio_of_medians():
    # The machine slows down 2x in repeat 2: pairing cancels that, medians do not.
    a, b = [90.0, 45.0, 90.0], [100.0, 50.0, 100.0]
    r = stats.compare(a, b)
    assert r["paired_ratios"] == [0.9, 0.9, 0.9]
    assert r["ratio"] == pytest.approx(0.9)
    assert r["a_median"] == 90.0 and r["b_median"] == 100.0
    assert r["best_ratio"] == pytest.approx(0.9)


def test_best_ratio_takes_the_fastest_repeat_of_each_side():
    rates = stats.compare([50.0, 100.0], [80.0, 40.0])  # images/s: higher is better
    assert rates["best_ratio"] == pytest.approx(100.0 / 80.0)
    times = stats.compare([2.0, 1.0], [4.0, 3.0], higher_is_better=False)  # seconds
    assert times["best_ratio"] == pytest.approx(1.0 / 3.0)
    with pytest.raises(ValueError):
        stats.paired_ratios([1.0], [1.0, 2.0])


def test_steady_images_per_s_skips_the_warmup_epoch():
    rows = [
        {"epoch": 1, "images_per_s": 10.0},
        {"epoch": 2, "images_per_s": 100.0},
        {"epoch": 3, "images_per_s": 120.0},
    ]
    assert steady_images_per_s(rows) == 110.0
    with pytest.raises(BenchRunError):
        steady_images_per_s(rows[:1])


# --- report ----------------------------------------------------------------------------------
def fake_results() -> dict:
    def cmp(a: float, b: float) -> dict:
        return stats.compare([a, a], [b, b])

    return {
        "suite": "quick",
        "device": "cpu",
        "P1": {"strict": cmp(95.0, 100.0), "fast": cmp(99.0, 100.0)},
        "P2": {"device_vs_torchvision": cmp(50000.0, 10000.0), "images_per_s": {}},
        "P3": {
            "template_strict_over_fast_step_time": cmp(110.0, 100.0),
            "fill_uninitialized_memory_step_time": cmp(101.0, 100.0),
        },
        "P4": {**cmp(0.010, 0.004), "bit_identical": True, "batch_size": 512},
        "P5": {
            **cmp(0.5, 400.0),
            "steps_per_epoch": 97,
            "widths": [64, 128, 256, 512],
            "params": 11_173_962,
            "epoch_is_estimate": True,
        },
        "logger": {"skipped": "logger=none | rejected"},
    }


def test_table_has_one_row_per_ratio_with_the_paired_median():
    rows = table_rows(fake_results())
    by_figure = {r["figure"]: r for r in rows}
    assert [r["figure"] for r in rows] == [
        "P1 strict",
        "P1 fast",
        "P2 device",
        "P3 strict/fast",
        "P3 fill",
        "P4",
        "P5",
        "logger",
    ]
    assert by_figure["P1 strict"]["ratio"] == "0.950"
    assert by_figure["P2 device"]["ratio"] == "5.000"
    assert by_figure["P4"]["ratio"] == "2.500"
    p5 = by_figure["P5"]["measure"]
    assert "ESTIMATED" in p5 and "11.2M params" in p5
    assert by_figure["P5"]["ratio"] == "0.0013"
    assert by_figure["logger"]["ratio"] == "skipped"


def test_markdown_table_escapes_pipes_so_columns_stay_aligned():
    md = markdown_table(table_rows(fake_results()))
    lines = md.strip().splitlines()
    assert lines[0].startswith("| figure | measure | ratio |")
    widths = {line.replace("\\|", "").count("|") for line in lines}
    assert widths == {len(COLUMNS) + 1}, md  # same columns on every line, escaped '|' too


def test_outputs_are_json_and_markdown(tmp_path):
    json_path, md_path = write_outputs(tmp_path / "b", fake_results())
    assert json.loads(json_path.read_text())["P1"]["strict"]["ratio"] == pytest.approx(0.95)
    assert "| P1 strict |" in md_path.read_text()


# --- command line ----------------------------------------------------------------------------
def run_script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*args], cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_the_p5_checkpoint_is_what_the_trainer_writes_and_resumes_from(tmp_path):
    """P5 times the trainer's own checkpoint (TrainerState, gathered as the Saver does),
    not a hand-listed copy: same parts, per-rank RNG entry, restored by the trainer."""
    from benchmarks.checkpoint_cost import resume_state
    from reprotrain.repro import checkpoint
    from reprotrain.state import TrainerState

    def trainer_state() -> TrainerState:
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        return TrainerState(model, opt, sched, scaler, torch.device("cpu"))

    torch.manual_seed(5)
    written = trainer_state()
    path = tmp_path / "step-00000001.pt"
    checkpoint.save(path, checkpoint.serialise(resume_state(written)))
    expected = torch.rand(3)  # the draw right after the checkpoint
    loaded = checkpoint.load(path)  # weights_only
    assert set(written.parts()) <= set(loaded) and loaded["rng"]["world_size"] == 1
    torch.manual_seed(9)
    trainer_state().load_state_dict(loaded)  # the trainer's own restore
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_bench_on_cuda_without_a_gpu_fails_in_one_line():
    proc = run_script(sys.executable, "scripts/bench.py", "--device", "cuda")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error: ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_gpu_check_without_cuda_fails_in_one_clear_line():
    proc = run_script("bash", "scripts/gpu_check.sh")
    assert proc.returncode != 0
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: gpu_check:") and "CUDA" in lines[0]


@pytest.mark.slow
def test_smoke_bench_writes_every_figure(tmp_path):
    """End to end at toy sizes: the numbers mean nothing, the plumbing must hold."""
    out = tmp_path / "bench"
    proc = run_script(sys.executable, "scripts/bench.py", "--smoke", "--out", str(out), timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"bench.json: {out / 'bench.json'}" in proc.stdout
    data = json.loads((out / "bench.json").read_text())
    assert {"P1", "P2", "P3", "portable", "P4", "P5", "logger", "replay"} <= set(data)
    assert data["replay"]["ratio"] > 0 and len(data["replay"]["paired_ratios"]) >= 1
    assert set(data["P1"]) == {"strict", "fast"}
    for level in ("strict", "fast"):
        assert data["P1"][level]["ratio"] > 0
    assert data["P2"]["device_vs_torchvision"]["ratio"] > 0
    assert {
        "template_strict_over_fast_step_time",
        "fill_uninitialized_memory_step_time",
    } <= set(data["P3"])
    assert data["P4"]["bit_identical"] is True
    assert data["P5"]["epoch_is_estimate"] is True and data["P5"]["ratio"] > 0
    assert "| P1 strict |" in (out / "bench.md").read_text()
