"""What differs between world size 1 and 2 at the same global batch (README, Scaling out).

Runs the self-check config (the framework's own job) for 3 epochs as one process and as two
torchrun ranks (gloo), twice each, and (with 2 GPUs) with synchronised BatchNorm, and prints a
table: first differing step loss, final test accuracy, largest absolute weight difference.

    .venv/bin/python scripts/world_size_diff.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
BASE = ["experiment=selfcheck", "trainer.epochs=3", "repro.num_threads=1", "logger=none"]


def run(run_dir: Path, nproc: int, *extra: str) -> Path:
    entry = ["-m", "reprotrain.train"]
    if nproc > 1:
        entry = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *entry]
    cmd = [sys.executable, *entry, *BASE, *extra, f"hydra.run.dir={run_dir}"]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    return run_dir


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "fingerprints.jsonl").read_text().splitlines()]
    return [v for r in rows for v in r["step_losses"]]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    last = sorted((run_dir / "checkpoints").glob("step-*.pt"))[-1]
    return torch.load(last, weights_only=True)["model"]


def compare(a: Path, b: Path) -> tuple[str, str, str]:
    la, lb = losses(a), losses(b)
    first = next((i + 1 for i, (x, y) in enumerate(zip(la, lb, strict=True)) if x != y), None)
    wa, wb = weights(a), weights(b)
    diff = max(
        (wa[k].double() - wb[k].double()).abs().max().item()
        for k in wa
        if wa[k].is_floating_point()
    )
    acc = [json.loads((d / "run.json").read_text())["final_metrics"]["test_acc"] for d in (a, b)]
    return (
        "none (bitwise)" if first is None else f"step {first}",
        f"{acc[0]:.4f} vs {acc[1]:.4f}",
        f"{diff:.3g}",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="world-size-"))
    w1a, w1b = run(out / "w1a", 1), run(out / "w1b", 1)
    w2a, w2b = run(out / "w2a", 2), run(out / "w2b", 2)
    rows = [
        ("world 1 vs world 1", compare(w1a, w1b)),
        ("world 2 vs world 2", compare(w2a, w2b)),
        ("world 1 vs world 2", compare(w1a, w2a)),
    ]
    if torch.cuda.device_count() >= 2:  # SyncBatchNorm has no CPU kernel
        w2s = run(out / "w2sync", 2, "trainer.sync_batchnorm=true", "trainer.device=cuda")
        rows.append(("world 1 vs world 2, `sync_batchnorm=true`", compare(w1a, w2s)))
    print("| comparison | first differing step loss | final test_acc | max abs weight diff |")
    print("|---|---|---|---|")
    for name, (first, acc, diff) in rows:
        print(f"| {name} | {first} | {acc} | {diff} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
