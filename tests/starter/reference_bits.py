"""The six reference runs' bits: ``final_weights_sha256`` of each, one line per run.

    .venv/bin/python tests/starter/reference_bits.py [--out DIR]

The reference job is the user's room (experiment=smoke), so this lives beside its tests.

A refactor of the loop must leave every line unchanged on the same machine: smoke, smoke with
micro-batches and clipping, world-size invariant at W=1 and W=2 (the same hash twice), DDP at
W=2, and the two worked steps (EMA, SAM); with each, the test loss (EMA's comes
from its shadow weights). Small but real configs: each run takes seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "experiment=smoke",
    "logger=none",
    "dataset.num_train=1024",
    "dataset.num_test=256",
    "trainer.epochs=2",
]
INVARIANT = ["trainer.batch_size=128", "trainer.microbatch_size=32", "repro.num_threads=1"]
RUNS = {
    "smoke": (1, [*SMALL, "repro.num_threads=2"]),
    "smoke-micro-clip": (
        1,
        [*SMALL, "repro.num_threads=2", "trainer.microbatch_size=32", "trainer.grad_clip_norm=1.0"],
    ),
    "invariant-W1": (1, [*SMALL, *INVARIANT, "trainer.world_size_invariant=true"]),
    "invariant-W2": (2, [*SMALL, *INVARIANT, "trainer.world_size_invariant=true"]),
    "ddp-W2": (2, [*SMALL, "repro.num_threads=1"]),
    "step-ema": (1, [*SMALL, "repro.num_threads=2", "step=ema", "step.decay=0.9"]),
    "step-sam": (1, [*SMALL, "repro.num_threads=2", "step=sam"]),
}


def run(name: str, nproc: int, overrides: list[str], out: Path) -> str:
    run_dir = out / name
    cmd = [sys.executable, "-m", "reprotrain", "train", "--nproc", str(nproc), *overrides]
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPROTRAIN_TEST")}
    env["PYTHONHASHSEED"] = "0"
    proc = subprocess.run(
        [*cmd, f"hydra.run.dir={run_dir}"], cwd=REPO, env=env, capture_output=True, text=True
    )
    if proc.returncode:
        return f"FAILED (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"
    record = json.loads((run_dir / "run.json").read_text())
    # The weights' bits; test_loss too, since EMA evaluates with its own (shadow) weights.
    return f"{record['final_weights_sha256']}  test_loss={record['final_metrics']['test_loss']!r}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="keep the run dirs here")
    parser.add_argument("runs", nargs="*", default=list(RUNS), help="a subset, by name")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        for name in args.runs:
            nproc, overrides = RUNS[name]
            print(f"{name:18} {run(name, nproc, overrides, out)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
