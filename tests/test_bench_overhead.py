"""make bench's overhead figure: microseconds of template work per step on a null model
(template minus bare loop, paired per repeat). No timing is asserted: the figure is the
bench's output, the test checks that it is a number and how it is computed."""

from __future__ import annotations

import math

import pytest

from benchmarks import overhead
from benchmarks.results import markdown_table, table_rows
from benchmarks.training import BenchRunError


def test_seconds_per_step_skips_the_warmup_epoch_for_both_sides():
    template = [
        {"epoch": 1, "global_step": 100, "seconds": 9.0},
        {"epoch": 2, "global_step": 200, "seconds": 0.05},
        {"epoch": 3, "global_step": 300, "seconds": 0.07},
    ]
    assert overhead.seconds_per_step(template) == pytest.approx(0.0006)
    bare = [{"epoch": 1, "steps": 50, "seconds": 9.0}, {"epoch": 2, "steps": 50, "seconds": 0.01}]
    assert overhead.seconds_per_step(bare) == pytest.approx(0.0002)
    with pytest.raises(BenchRunError):
        overhead.seconds_per_step(template[:1])


def test_the_figure_is_the_median_of_paired_differences_in_microseconds(tmp_path, monkeypatch):
    calls: list[str] = []
    template = iter([400e-6, 800e-6, 420e-6])  # seconds per step; repeat 2 ran on a busy machine
    bare = iter([300e-6, 700e-6, 310e-6])
    monkeypatch.setattr(overhead, "run_template", lambda s, d: calls.append("t") or next(template))
    monkeypatch.setattr(overhead, "run_bare", lambda s, d: calls.append("b") or next(bare))
    result = overhead.measure_overhead(
        overhead.OverheadSetup(repeats=3), tmp_path, log=lambda m: None
    )
    assert calls == ["t", "b", "t", "b", "t", "b"]  # interleaved
    assert result["paired_us_per_step"] == pytest.approx([100.0, 100.0, 110.0])
    assert result["us_per_step"] == pytest.approx(100.0)
    assert result["best_us_per_step"] == pytest.approx(100.0)  # fastest template - fastest bare
    row = next(r for r in table_rows({"overhead": result}) if r["figure"] == "overhead")
    assert row["ratio"] == "100 us" and row["target"] == "<= 100 us (2-core CPU)"
    assert "| overhead |" in markdown_table([row])


@pytest.mark.slow  # default-tier sibling: the arithmetic and the table row above (in process)
def test_the_null_model_figure_reports_microseconds_per_step(tmp_path):
    """End to end on a few steps: both sides train the null model; a number comes out."""
    setup = overhead.OverheadSetup(steps=20, epochs=2, repeats=1)
    result = overhead.measure_overhead(setup, tmp_path, log=lambda m: None)
    assert math.isfinite(result["us_per_step"])
    assert result["template_us_per_step"] > 0 and result["bare_us_per_step"] > 0
    assert (tmp_path / "001-template" / "metrics.jsonl").is_file()
