"""End-to-end: the reference trainer in fresh processes, on a micro smoke config."""

import json
import subprocess
import sys

import pytest

from conftest import (
    REFERENCE,
    REPO,
    assert_ok,
    base_env,
    env_without_hashseed,
    jsonl,
    metrics_without_timings,
    run_json,
    train,
)
from reprotrain import launchers

RUN_FILES = [
    "run.json",
    "config.resolved.yaml",
    "metrics.jsonl",
    "fingerprints.jsonl",
    "environment.txt",
    "train.log",
    ".hydra/config.yaml",
    ".hydra/overrides.yaml",
]
RUN_KEYS = [
    "experiment_id",
    "status",
    "seeds",
    "repro",
    "config_sha256",
    "git",
    "environment",
    "lock_sha256",
    "data_fingerprint",
    "initial_weights_sha256",
    "final_weights_sha256",
    "final_metrics",
    "started_at",
    "finished_at",
    "env_drift",
]


@pytest.fixture(scope="module")
def twin_runs(tmp_path_factory, reference_run):
    """The same config twice, in two fresh processes with different run dirs, both started
    without PYTHONHASHSEED (the entry re-execs): the first is the shared reference run."""
    b = tmp_path_factory.mktemp("twins") / "b"
    assert_ok(train(b, *REFERENCE, env=env_without_hashseed()))
    return reference_run, b


def test_same_config_twice_is_bitwise_identical(twin_runs):
    a, b = twin_runs
    ra, rb = run_json(a), run_json(b)
    assert ra["final_weights_sha256"] == rb["final_weights_sha256"]
    assert ra["initial_weights_sha256"] == rb["initial_weights_sha256"]
    assert jsonl(a / "fingerprints.jsonl") == jsonl(b / "fingerprints.jsonl")
    assert metrics_without_timings(a) == metrics_without_timings(b)
    assert ra["config_sha256"] == rb["config_sha256"] and ra["run_dir"] != rb["run_dir"]


def test_run_directory_is_a_complete_record(twin_runs):
    a, _ = twin_runs
    for name in RUN_FILES:
        assert (a / name).is_file(), name
    record = run_json(a)
    for key in RUN_KEYS:
        assert record.get(key) is not None, key
    assert record["status"] == "completed"
    assert set(record["seeds"]) >= {"base", "init", "data", "augment", "train"}
    assert record["repro"]["level"] == "strict" and record["repro"]["deterministic_algorithms"]
    assert record["repro"]["pythonhashseed"] == "0"  # set by the entry point's re-exec
    # ${cores_per_job:}: this host's cores (derived, not the development machine's 2)
    assert record["repro"]["num_threads"] == launchers.cores_per_job()
    assert len(record["lock_sha256"]) == 64 and record["data_fingerprint"]["sha256"]
    sha, commit = record["experiment_id"].split("-")[:2]
    assert record["config_sha256"].startswith(sha) and record["git"]["short"] in commit
    rows = jsonl(a / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [1, 2]
    assert {"train_loss", "train_acc", "val_acc", "lr", "seconds", "images_per_s"} <= set(rows[0])
    assert {"test_acc", "test_loss"} <= set(record["final_metrics"])
    fps = jsonl(a / "fingerprints.jsonl")
    assert [len(f["step_losses"]) for f in fps] == [8, 8]
    assert fps[-1]["weights_sha256"] == record["final_weights_sha256"]
    ckpts = sorted(p.name for p in (a / "checkpoints").iterdir())
    assert "best.pt" in ckpts and "step-00000016.pt" in ckpts


def test_different_base_seed_gives_different_weights(twin_runs, tmp_path):
    assert_ok(train(tmp_path / "s", "seed.base=7"))
    ref, other = run_json(twin_runs[0]), run_json(tmp_path / "s")
    assert other["initial_weights_sha256"] != ref["initial_weights_sha256"]
    assert other["final_weights_sha256"] != ref["final_weights_sha256"]


def test_changing_only_the_data_stream_keeps_init_and_changes_the_result(twin_runs, tmp_path):
    assert_ok(train(tmp_path / "d", "seed.data=7"))
    ref, other = run_json(twin_runs[0]), run_json(tmp_path / "d")
    assert other["initial_weights_sha256"] == ref["initial_weights_sha256"]
    assert other["final_weights_sha256"] != ref["final_weights_sha256"]
    assert other["seeds"]["init"] == ref["seeds"]["init"] and other["seeds"]["data"] == 7


def test_loader_path_is_independent_of_num_workers(twin_runs, tmp_path):
    for workers in (0, 2):
        assert_ok(
            train(
                tmp_path / f"w{workers}",
                "trainer.pipeline=loader",
                f"trainer.num_workers={workers}",
            )
        )
    w0, w2 = run_json(tmp_path / "w0"), run_json(tmp_path / "w2")
    assert w0["final_weights_sha256"] == w2["final_weights_sha256"]
    assert jsonl(tmp_path / "w0/fingerprints.jsonl") == jsonl(tmp_path / "w2/fingerprints.jsonl")
    # Same order, same counter-based augmentation: the device-resident path agrees too.
    assert w0["final_weights_sha256"] == run_json(twin_runs[0])["final_weights_sha256"]


def test_verify_passes_for_a_seeded_config_and_names_epoch_1_for_entropy(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "reprotrain.tools.runs.verify",
        "experiment=selfcheck",
        "dataset.num_train=256",
        "dataset.num_test=128",
        "trainer.batch_size=64",
        "trainer.epochs=1",
    ]
    ok = subprocess.run(cmd, cwd=tmp_path, env=base_env(), capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "IDENTICAL" in ok.stdout
    bad = subprocess.run(
        [*cmd, "seed=entropy"], cwd=tmp_path, env=base_env(), capture_output=True, text=True
    )
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "DIVERGED at epoch 1" in bad.stdout


def test_sweep_writes_a_summary_over_seeds(tmp_path):
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "reprotrain.train",
            "--multirun",
            "seed.base=0,1,2",
            "experiment=selfcheck",
            "dataset.num_train=256",
            "dataset.num_test=128",
            "trainer.batch_size=64",
            "trainer.epochs=1",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=REPO,
        env=base_env(),
        capture_output=True,
        text=True,
    )
    assert_ok(proc)
    summary = json.loads((sweep / "summary.json").read_text())
    assert sorted(r["seed"] for r in summary["runs"]) == [0, 1, 2]
    acc = summary["metrics"]["test_acc"]
    values = [r["test_acc"] for r in summary["runs"]]
    assert acc["n"] == 3 and acc["mean"] == pytest.approx(sum(values) / 3)
    assert acc["std"] > 0 and acc["ci95"][0] < acc["mean"] < acc["ci95"][1]
    assert "95% CI" in (sweep / "summary.md").read_text()
