"""debug=fast / overfit / profile: what each preset promises, checked on a real run.

The presets set trainer keys that the training loop implements (limit_train_steps,
limit_eval_batches, overfit_batches, profile_steps); these tests fail until the loop has
them and conf/train.yaml has the ``- debug: null`` default.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from conftest import REPO, assert_ok, base_env, jsonl, train

PRESETS = REPO / "conf" / "debug"


def test_presets_are_global_overrides_of_trainer_keys_only() -> None:
    assert sorted(p.stem for p in PRESETS.glob("*.yaml")) == ["fast", "overfit", "profile"]
    for path in PRESETS.glob("*.yaml"):
        assert path.read_text().startswith("# @package _global_\n"), path
        assert set(yaml.safe_load(path.read_text())) == {"trainer"}, path
    fast = yaml.safe_load((PRESETS / "fast.yaml").read_text())["trainer"]
    assert fast["epochs"] == 1 and 0 < fast["limit_train_steps"] <= 10


def test_debug_fast_composes_over_an_experiment() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "reprotrain.train",
            "--cfg",
            "job",
            "experiment=selfcheck",
            "debug=fast",
        ],
        cwd=REPO,
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    trainer = yaml.safe_load(proc.stdout)["trainer"]
    assert trainer["epochs"] == 1 and trainer["limit_train_steps"] == 10


def test_debug_fast_runs_at_most_ten_steps_and_one_eval(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert_ok(train(run, "experiment=selfcheck", "debug=fast", micro=False))
    (row,) = jsonl(run / "metrics.jsonl")
    assert row["global_step"] <= 10
    assert any(k.endswith("_acc") and k != "train_acc" for k in row)  # the one evaluation


def test_debug_overfit_drives_the_loss_down_on_one_batch(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert_ok(train(run, "experiment=selfcheck", "debug=overfit", micro=False))
    losses = [x for fp in jsonl(run / "fingerprints.jsonl") for x in fp["step_losses"]]
    assert len(losses) == 50
    # Measured on the smoke data: about 0.24x with augmentation on, 0.015x without.
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, (losses[:5], losses[-5:])


def test_debug_profile_leaves_a_trace_and_a_top_ops_table(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = train(run, "experiment=selfcheck", "debug=profile", micro=False)
    assert_ok(proc)
    assert (run / "profile" / "steps.pt.trace.json.gz").stat().st_size > 1000
    table = (run / "profile" / "top_ops.txt").read_text()
    assert "over 10 profiled steps" in table and "aten::" in table
    assert json.loads((run / "run.json").read_text())["status"] == "completed"
