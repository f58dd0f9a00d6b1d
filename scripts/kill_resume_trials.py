"""Preemption drill: SIGKILL a run at random moments, resume it, demand identical bits.

    python scripts/kill_resume_trials.py --trials 5 [overrides...]

Runs the config once uninterrupted, then for each trial starts it fresh, kills it with
SIGKILL after a random delay (seeded, printed), and runs `make resume RUN=...` until the run
completes (a kill can land before the first checkpoint: then resume starts it afresh).
Exit 0 only if every trial ends `completed` with the uninterrupted run's
final_weights_sha256.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT = ["experiment=smoke", "trainer.epochs=4", "trainer.checkpoint_every_steps=5"]


def run_json(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "kill-trials")
    parser.add_argument("overrides", nargs="*", default=DEFAULT)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    train = [sys.executable, "-m", "reprotrain.train", *args.overrides]
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")

    ref = args.out / stamp / "uninterrupted"
    t0 = time.perf_counter()
    subprocess.run(
        [*train, f"hydra.run.dir={ref}"], cwd=REPO, env=env, check=True, capture_output=True
    )
    duration = time.perf_counter() - t0
    expected = run_json(ref)["final_weights_sha256"]
    print(f"uninterrupted: {duration:.1f} s, final_weights_sha256 {expected[:16]}")

    rng, ok = random.Random(args.seed), True
    for trial in range(1, args.trials + 1):
        run_dir = args.out / stamp / f"trial{trial}"
        delay = rng.uniform(4.0, duration - 1.0)  # ~3.5 s is interpreter + import start-up
        proc = subprocess.Popen(
            [*train, f"hydra.run.dir={run_dir}"],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*.pt"))
        resumed = subprocess.run(
            ["make", "-s", "resume", f"RUN={run_dir}"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
        )
        record = run_json(run_dir) if (run_dir / "run.json").exists() else {}
        same = record.get("final_weights_sha256") == expected
        ok &= resumed.returncode == 0 and record.get("status") == "completed" and same
        print(
            f"trial {trial}: SIGKILL after {delay:.2f} s (newest checkpoint: "
            f"{ckpts[-1] if ckpts else 'none'}), resume exit {resumed.returncode}, "
            f"status {record.get('status')}, final weights "
            f"{'IDENTICAL' if same else 'DIFFERENT'}"
        )
    print("ALL TRIALS BITWISE EQUAL" if ok else "SOME TRIALS DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
