"""``make resume RUN=<run dir>``: continue an interrupted run in place, with its own config.

The recorded ``config.resolved.yaml`` becomes the primary config (under the same schema,
so extra overrides are still type-checked), the run directory stays the same, and
``resume=auto`` picks the newest valid checkpoint. Extra overrides are allowed, but the
trainer refuses any that change the numbers (only ``trainer.epochs`` may grow).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from reprotrain.repro.record import RESOLVED_CONFIG, RUN_JSON, atomic_write_text

PRIMARY = "resume.yaml"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(
            "error: usage: python -m reprotrain.tools.resume <run dir> [overrides]", file=sys.stderr
        )
        return 2
    run_dir, overrides = Path(args[0]).resolve(), args[1:]
    recorded = run_dir / RESOLVED_CONFIG
    if not (run_dir / RUN_JSON).is_file() or not recorded.is_file():
        print(
            f"error: {run_dir} is not a reprotrain run directory (no {RUN_JSON} or "
            f"{RESOLVED_CONFIG})",
            file=sys.stderr,
        )
        return 2
    config_dir = run_dir / ".hydra"
    atomic_write_text(
        config_dir / PRIMARY,
        "# Written by `make resume`: the recorded config under the reprotrain schema.\n"
        "defaults:\n  - train_schema\n  - _self_\n\n" + recorded.read_text(),
    )
    cmd = [
        sys.executable,
        "-m",
        "reprotrain.train",
        f"--config-path={config_dir}",
        f"--config-name={PRIMARY.removesuffix('.yaml')}",
        f"hydra.run.dir={run_dir}",
        "hydra.output_subdir=null",  # keep the original .hydra/ record untouched
        *([] if any(o.startswith("resume=") for o in overrides) else ["resume=auto"]),
        *overrides,
    ]
    os.environ.setdefault("PYTHONHASHSEED", "0")
    os.execv(sys.executable, cmd)


if __name__ == "__main__":
    sys.exit(main())
