"""Shared helpers: run the real trainer in fresh processes on a micro config.

Every training test goes through ``python -m reprotrain.train`` in a subprocess, exactly
as a user would, so process-level state (hash seed, thread count, global RNGs) is fresh.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Smoke family, shrunk: 8 steps per epoch (518 train after the 0.1 val split, 58 val),
# 2 epochs; about 4 s per run on 2 cores.
MICRO = [
    "experiment=smoke",
    "dataset.num_train=576",
    "dataset.num_test=256",
    "trainer.batch_size=64",
    "trainer.epochs=2",
]


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPROTRAIN_TEST")}
    env.update(PYTHONHASHSEED="0", **extra)
    return env


def train(
    run_dir: Path,
    *overrides: str,
    env: dict | None = None,
    micro: bool = True,
    timeout: float = 240,
) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "reprotrain.train",
        *(MICRO if micro else []),
        *overrides,
        f"hydra.run.dir={run_dir}",
    ]
    return subprocess.run(
        cmd, cwd=REPO, env=env or base_env(), capture_output=True, text=True, timeout=timeout
    )


def run_json(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "run.json").read_text())


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def metrics_without_timings(run_dir: Path) -> list[dict]:
    rows = jsonl(Path(run_dir) / "metrics.jsonl")
    return [{k: v for k, v in r.items() if k not in ("seconds", "images_per_s")} for r in rows]


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> Path:
    """One uninterrupted micro run with mid-epoch checkpoints every 3 steps."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    assert_ok(train(run_dir, "trainer.checkpoint_every_steps=3"))
    return run_dir
