"""Seeing a run from the loop: loggers as sinks, start/end lines, the non-finite guard,
`make eval`, debug presets."""

import json
import subprocess

from conftest import MICRO, REFERENCE, REPO, assert_ok, base_env, run_json, train
from reprotrain.config_view import config_lines
from reprotrain.run.record import strict_loads


def test_tensorboard_has_one_point_per_step_and_logger_none_keeps_the_bits(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert_ok(train(tmp_path / "tb", "trainer.epochs=1"))
    assert_ok(train(tmp_path / "none", "trainer.epochs=1", "logger=none"))
    events = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    events.Reload()
    steps = [e.step for e in events.Scalars("step/train_loss")]
    assert steps == list(range(1, 9))  # 8 steps, one point each
    assert not (tmp_path / "none" / "tensorboard").exists()
    a, b = run_json(tmp_path / "tb"), run_json(tmp_path / "none")
    assert a["final_weights_sha256"] == b["final_weights_sha256"]
    assert a["config_sha256"] == b["config_sha256"]  # a sink is not part of the identity


def test_first_line_names_the_run_dir_and_last_says_where_things_are(reference_run):
    log = (reference_run / "train.log").read_text().splitlines()
    assert f"run dir: {reference_run}" in log[0]
    assert "experiment " in log[1] and "repro=strict" in log[1] and "device cpu" in log[1]
    assert "checkpoints in" in log[-1] and "make report" in log[-1]


def test_the_start_shows_the_overrides_and_the_resolved_config_once(reference_run):
    """After the identity line: the command line's overrides, then one line per config group
    (wrapped), every group of config.resolved.yaml, with the values the run used."""
    import yaml

    text = (reference_run / "train.log").read_text()
    assert text.count("overrides: ") == 1 and text.count("config (resolved;") == 1
    assert f"overrides: {' '.join([*MICRO, *REFERENCE])}\n" in text
    resolved = yaml.safe_load((reference_run / "config.resolved.yaml").read_text())
    shown = text.split("config (resolved;", 1)[1].splitlines()
    assert str(reference_run / "config.resolved.yaml") in shown[0]
    groups = [line.split()[0] for line in shown[1:] if line.startswith("  ") and line[2] != " "]
    assert groups[: len(resolved)] == list(resolved)
    trainer = " ".join(line for line in shown if line.startswith(("  trainer ", " " * 6)))
    assert f"epochs={resolved['trainer']['epochs']}" in trainer
    assert f"batch_size={resolved['trainer']['batch_size']}" in trainer
    assert all(len(line) <= 100 for line in shown if line.startswith("  "))  # wrapped


def test_the_compact_config_names_the_target_first_dots_nested_keys_and_escapes_values():
    lines = config_lines(
        {
            "optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.05},
            "nested": {"a": {"b": 1}, "empty": "", "none": None, "list": [1, 2]},
            "name": "x\n[reprotrain][INFO] - fake",
        },
        width=60,
    )
    assert lines[0].split() == ["optimizer", "torch.optim.SGD", "lr=0.05"]
    assert lines[1].split() == ["nested", "a.b=1", "empty=''", "none=null", "list=[1,2]"]
    assert lines[2].split()[:2] == ["name", "x\\n[reprotrain][INFO]"] and len(lines) == 3
    assert all(len(line) <= 60 for line in lines)


def test_nonfinite_loss_stops_in_one_line_with_status_failed(tmp_path):
    proc = train(tmp_path / "nan", "optimizer.lr=1e6")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "non-finite" in lines[0] and "step" in lines[0]
    assert "Traceback" not in proc.stderr
    text = (tmp_path / "nan" / "run.json").read_text()
    record = json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    assert record["status"] == "failed" and record["nonfinite_events"]
    for line in (
        (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()
        if (tmp_path / "nan" / "metrics.jsonl").exists()
        else []
    ):
        json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))


def test_nonfinite_warn_records_and_goes_on_with_strict_json(tmp_path):
    assert_ok(train(tmp_path / "warn", "optimizer.lr=1e6", "trainer.on_nonfinite=warn"))
    text = (tmp_path / "warn" / "run.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    record = strict_loads(text)
    assert record["status"] == "completed" and record["nonfinite_events"][0]["global_step"] >= 1
    assert "final_metrics.train_loss" in record.get("nonfinite_fields", [])


def test_make_eval_prints_the_recorded_final_test_metrics_exactly(reference_run):
    proc = subprocess.run(
        ["make", "--no-print-directory", "eval", f"RUN={reference_run}"],
        cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert_ok(proc)
    final = run_json(reference_run)["final_metrics"]
    assert f"test_acc={final['test_acc']!r}" in proc.stdout
    assert f"test_loss={final['test_loss']!r}" in proc.stdout
    written = json.loads((reference_run / "eval.json").read_text())
    assert written["metrics"] == {"test_loss": final["test_loss"], "test_acc": final["test_acc"]}


def test_debug_fast_runs_at_most_ten_steps(tmp_path):
    assert_ok(train(tmp_path / "fast", "experiment=selfcheck", "debug=fast", micro=False))
    record = run_json(tmp_path / "fast")
    assert record["status"] == "completed" and record["final_metrics"]["global_step"] <= 10


def test_eval_of_an_ema_run_uses_the_ema_weights_and_reproduces_its_final_test_metrics(tmp_path):
    from reprotrain.tools.runs.eval import evaluate_run

    run = tmp_path / "ema"
    assert_ok(train(run, "trainer.epochs=1", "step=ema", "step.decay=0.9", "logger=none"))
    final = run_json(run)["final_metrics"]
    result = evaluate_run(run)
    assert result["evaluated_with"] == "EMA weights"
    assert result["metrics"] == {"test_loss": final["test_loss"], "test_acc": final["test_acc"]}
