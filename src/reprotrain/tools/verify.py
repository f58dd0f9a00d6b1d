"""``make verify``: run one config twice in fresh processes and demand identical bits.

    python -m reprotrain.tools.verify experiment=smoke

Each run gets its own directory (outputs/verify/<stamp>/a and b). Exit 0 only when every
epoch's fingerprint (weights sha256 and step losses) and the final weights match; else
print the first divergent epoch (and step) and exit 1. Exit 2 when a run itself failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from reprotrain.tools.compare import compare_runs


def run_once(overrides: list[str], run_dir: Path) -> int:
    cmd = [sys.executable, "-m", "reprotrain.train", *overrides, f"hydra.run.dir={run_dir}"]
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    return subprocess.call(cmd, env={**os.environ, "PYTHONHASHSEED": "0"})


def main(argv: list[str] | None = None) -> int:
    overrides = list(sys.argv[1:] if argv is None else argv)
    base = Path("outputs") / "verify" / f"{time.strftime('%Y-%m-%d_%H-%M-%S')}-{os.getpid()}"
    dirs = [base / "a", base / "b"]
    for run_dir in dirs:
        rc = run_once(overrides, run_dir)
        if rc != 0:
            print(
                f"error: run in {run_dir} failed (exit {rc}); nothing to compare", file=sys.stderr
            )
            return 2
    result = compare_runs(*dirs)
    print(result.verdict())
    for epoch, diffs in sorted(result.metric_diffs.items()):
        shown = ", ".join(f"{k}: {a} vs {b}" for k, (a, b) in diffs.items())
        print(f"  epoch {epoch}: {shown}")
    print(f"runs: {dirs[0]}  {dirs[1]}")
    return 0 if result.identical else 1


if __name__ == "__main__":
    sys.exit(main())
