"""``make selfcheck``: the framework checks itself in this checkout, template or project.

Runs the framework's own tiny job (``experiment=selfcheck``: its conv net on its synthetic
images, never the user's code) through ``make verify KILL=1``: run a trains uninterrupted;
run b is SIGKILLed as soon as its first checkpoint is on disk, resumed, and must end with
the same bits as a (every epoch's fingerprint, the step losses, the final weights). Exit 0
only then: seeding, the counter-based data order, the determinism level, checkpointing
and resume all work on this machine with this lock. Tens of seconds on a laptop CPU.
Extra Hydra overrides (``make selfcheck ARGS="repro=portable"``) go to both runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from reprotrain.tools.runs import verify

# Two epochs of 8 steps with a checkpoint every 2: the kill lands mid-epoch, so the resume
# restores a partial epoch (data position, RNG states, partial sums), not just an epoch end.
JOB = (
    "experiment=selfcheck",
    "dataset.num_train=576",
    "dataset.num_test=256",
    "trainer.batch_size=64",
    "trainer.epochs=2",
    "trainer.checkpoint_every_steps=2",
    "logger=none",
)
OUT_DIR = Path("outputs") / "selfcheck"


def main(argv: list[str] | None = None) -> int:
    overrides = sys.argv[1:] if argv is None else argv
    return verify.main(["--out-dir", str(OUT_DIR), "--kill", *JOB, *overrides])


if __name__ == "__main__":
    sys.exit(main())
