"""``make selfcheck``: the framework's own job through ``make verify KILL=1`` (one run SIGKILLed
and resumed, bitwise equal to one uninterrupted, or exit 1); docs/project-layout.md."""

from __future__ import annotations

import sys
from pathlib import Path

from reprotrain.tools.runs import verify

# Two epochs of 8 steps with a checkpoint every 2: the kill lands mid-epoch, so the resume
# restores a partial epoch (data position, RNG states, partial sums), not just an epoch end.
JOB = ("experiment=selfcheck", "dataset.num_train=576", "dataset.num_test=256", "logger=none")
JOB += ("trainer.batch_size=64", "trainer.epochs=2", "trainer.checkpoint_every_steps=2")
OUT_DIR = Path("outputs") / "selfcheck"


def main(argv: list[str] | None = None) -> int:
    overrides = sys.argv[1:] if argv is None else argv
    return verify.main(["--out-dir", str(OUT_DIR), "--kill", *JOB, *overrides])


if __name__ == "__main__":
    sys.exit(main())
