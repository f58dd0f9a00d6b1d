"""scripts/gpu_check.sh's plan and the bench's CUDA figures (issue 44), checked on the CPU:
the order that finds bugs first, the precision table docs/gpus.md cites, the targets the
bench prints. No GPU is needed: the runs are stood in for; what they would measure is not
asserted (speed and accuracy are the check's output)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import gpu_check, reference_model
from benchmarks.results import markdown_table, table_rows
from reprotrain.repro.precision import PRECISIONS


def fake_twin(run_dir: Path, weights: str, acc: float, ips: float) -> None:
    run_dir.mkdir(parents=True)
    final = {"test_acc": acc, "test_loss": 1 - acc}
    record = {"final_weights_sha256": weights, "final_metrics": final}
    (run_dir / "run.json").write_text(json.dumps(record))
    rows = [{"epoch": 1, "images_per_s": 1.0}, {"epoch": 2, "images_per_s": ips}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_gpu_check_runs_pytest_first_then_the_reference_job_then_the_figures(monkeypatch):
    order: list[str] = []

    def section(name, result):
        def check(*args, **kwargs):
            order.append(name)
            return result

        return check

    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "gpu_info", lambda: {})
    for name, result in [
        ("pytest", {"passed": True}),
        ("verify", {"identical": True, "runs": ["a", "b"]}),
        ("resume", {"identical": True}),
        ("precision", {"rows": {}}),
        ("bench", {}),
        ("invariant", {}),
    ]:
        monkeypatch.setattr(gpu_check, f"check_{name}", section(name, result))
    monkeypatch.setattr(gpu_check.time, "strftime", lambda fmt: "test-gpu-check-order")
    try:
        assert gpu_check.main([]) == 0
    finally:
        import shutil

        shutil.rmtree(gpu_check.REPO_ROOT / "outputs" / "gpu_check" / "test-gpu-check-order")
    assert order == ["pytest", "verify", "resume", "precision", "bench", "invariant"]


def test_the_precision_table_has_each_precisions_twins_and_the_projection(tmp_path, monkeypatch):
    """tf32's twins are the verify pair; every other precision gets two runs of the
    reference job; each row: identical bits or not, both twins' test loss and accuracy."""
    seen: list[list[str]] = []

    def fake_run(cmd, timeout, env=None, log=None):
        seen.append(cmd)
        run_dir = Path(next(a for a in cmd if a.startswith("hydra.run.dir=")).split("=", 1)[1])
        fake_twin(run_dir, "w-" + run_dir.name[:-2], 0.5, 20_000.0)
        return 0, ""

    monkeypatch.setattr(gpu_check, "run", fake_run)
    pair = [tmp_path / "verify-a", tmp_path / "verify-b"]
    for run_dir in pair:
        fake_twin(run_dir, "w-tf32", 0.6, 33_750.0)
    result = gpu_check.check_precision(tmp_path, gpu_check.Budget(600), ["job=x"], pair)
    rows = result["rows"]
    assert list(rows) == ["tf32", *(p for p in PRECISIONS if p != "tf32")]
    assert all(r["identical"] for r in rows.values())
    assert rows["tf32"]["test_acc"] == [0.6, 0.6] and rows["32-true"]["test_loss"] == [0.5, 0.5]
    assert len(seen) == 2 * (len(PRECISIONS) - 1)
    assert {f"trainer.precision={p}" for p in PRECISIONS if p != "tf32"} == {
        a for cmd in seen for a in cmd if a.startswith("trainer.precision=")
    }
    projected = result["projected_reference_recipe"]
    assert projected["seconds"] == pytest.approx(30 * 45_000 / 33_750.0, abs=0.1)
    assert projected["target_seconds"] == 60
    short = gpu_check.check_precision(tmp_path / "s", gpu_check.Budget(10), ["job=x"], pair)
    assert short["rows"]["bf16-mixed"] == {"skipped": "time budget"}


def test_twins_that_differ_fail_the_gpu_check_row(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    fake_twin(a, "one", 0.5, 1.0)
    fake_twin(b, "two", 0.5, 1.0)
    assert gpu_check.precision_row([a, b])["identical"] is False


def test_the_bench_prints_the_reference_targets_and_the_strict_cost_table():
    pair = {"ratio": 1.05, "best_ratio": 1.04, "a_median": 33_000.0, "b_median": 31_000.0,
            "paired_ratios": [1.05, 1.06]}  # fmt: skip
    results = {
        "reference": {
            "setting": "ResNet-18, batch 512, tf32, channels_last",
            "P1": {"strict": pair, "fast": pair},
            "P3": pair,
            "recipe": {"epochs": 30, "seconds": 41.0, "images_per_s": 33_000.0},
        },
        "strict_cost": {"batch": 512, "rows": [
            {"precision": "tf32", "deterministic": True, "cudnn_benchmark": False,
             "layout": "channels_last", "images_per_s": 33_378.0}]},
    }  # fmt: skip
    table = markdown_table(table_rows(results))
    assert "P3 reference" in table and "<= 1.10" in table
    assert "projected 30 epochs" in table and "<= 60 s on one H200" in table
    assert "tf32, deterministic on, cuDNN benchmark off, channels_last" in table
    assert "33378 images/s" in table


def test_on_the_cpu_the_reference_figures_are_skipped_with_the_reason(tmp_path):
    out = reference_model.measure(set(reference_model.FIGURES), "cpu", 2, "quick", None,
                                  tmp_path, log=lambda m: None)  # fmt: skip
    assert "CUDA only" in out["reference"]["skipped"]
    assert "CUDA only" in out["strict_cost"]["skipped"]
    assert "skipped" in markdown_table(table_rows(out))


def test_the_reference_figures_run_the_reference_job_and_the_bare_loop_at_its_setting(
    tmp_path, monkeypatch
):
    """P1/P3 on the reference model: both sides at ResNet-18, batch 512, tf32 and
    channels_last, strict and fast interleaved; the recipe projected from strict."""
    calls: list[list[str]] = []
    rates = {"template": 30_000.0, "bare": 32_000.0}

    def fake_run_checked(cmd, timeout=1800, drop_env=()):
        calls.append(cmd)
        if "-m" in cmd:  # the template: a run directory
            run_dir = Path(next(a for a in cmd if a.startswith("hydra.run.dir="))[14:])
            path, rate = run_dir / "metrics.jsonl", rates["template"]
        else:
            path, rate = Path(next(a for a in cmd if a.startswith("--out="))[6:]), rates["bare"]
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = [{"epoch": 1, "images_per_s": 1.0}, {"epoch": 2, "images_per_s": rate}]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    monkeypatch.setattr(reference_model, "run_checked", fake_run_checked)
    setup = reference_model.ReferenceSetup(repeats=1)
    result = reference_model.measure_reference(setup, tmp_path, log=lambda m: None)
    templates = [c for c in calls if "-m" in c]
    bares = [c for c in calls if "-m" not in c]
    assert len(templates) == len(bares) == 2
    for cmd in templates:
        assert {"experiment=cifar10_resnet18", "dataset=synthetic", "trainer.batch_size=512",
                "trainer.precision=tf32", "trainer.channels_last=true"} <= set(cmd)  # fmt: skip
    for cmd in bares:
        assert {"--model=resnet18", "--batch-size=512", "--precision=tf32",
                "--channels-last"} <= set(cmd)  # fmt: skip
    assert {a for c in calls for a in c if "level" in a} >= {"repro.level=strict",
                                                           "--level=fast"}  # fmt: skip
    assert result["P1"]["strict"]["ratio"] == pytest.approx(30_000 / 32_000)
    assert result["P3"]["ratio"] == pytest.approx(1.0)
    assert result["recipe"]["seconds"] == pytest.approx(30 * 45_000 / 30_000)
