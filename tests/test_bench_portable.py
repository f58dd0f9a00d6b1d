"""make bench's `portable` figure: repro=portable / strict step time, or a stated skip."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import stats, training
from benchmarks.results import table_rows


def test_the_portable_row_is_step_time_portable_over_strict():
    # images/s: strict 120, portable 100 -> a portable step takes 1.2x a strict one
    results = {"portable": stats.compare([120.0, 120.0], [100.0, 100.0])}
    (row,) = table_rows(results)
    assert row["figure"] == "portable" and row["measure"].endswith("portable / strict")
    assert row["ratio"] == "1.200" and row["sides"] == "strict 120 / portable 100 images/s"


def test_off_x86_64_the_portable_figure_is_skipped_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    ran: list = []
    monkeypatch.setattr(training, "run_template", lambda *a, **k: ran.append(a) or 1.0)
    result = training.measure_portable(training.TrainSetup(), Path(tmp_path))
    assert "this host is aarch64" in result["skipped"] and ran == []
    (row,) = table_rows({"portable": result})
    assert row["ratio"] == "skipped" and "aarch64" in row["sides"]


@pytest.mark.skipif(
    not training.portable_supported()[0], reason="repro=portable covers x86-64 CPUs with AVX2"
)
def test_the_portable_figure_measures_both_levels_interleaved(monkeypatch, tmp_path):
    seen: list[str] = []

    def fake_run(setup, run_dir, level, *more):
        seen.append(level)
        return {"strict": 120.0, "portable": 100.0}[level]

    monkeypatch.setattr(training, "run_template", fake_run)
    result = training.measure_portable(training.TrainSetup(repeats=2), Path(tmp_path), log=len)
    assert seen == ["strict", "portable", "strict", "portable"]
    assert result["ratio"] == pytest.approx(1.2)
