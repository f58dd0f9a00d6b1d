"""``make verify``: run one config twice in fresh processes and demand identical bits.

    python -m reprotrain.tools.verify [--out-dir outputs/verify] experiment=smoke ...

Each run gets its own directory (<out-dir>/<stamp>/a and b). Exit 0 only when every
epoch's fingerprint (weights sha256 and step losses) and the final weights match; else
print the first divergent epoch (and step) and the ``make bisect`` line that
names the first divergent op, and exit 1. Exit 2 when a run was refused (the
trainer's own one-line error is shown, not repeated) or failed.

The run directories are chosen here, so ``hydra.run.dir`` and ``--multirun`` are refused.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path

from reprotrain.errors import ReprotrainError
from reprotrain.quoting import hydra_override
from reprotrain.tools import cli
from reprotrain.tools.bisect import bisect_command
from reprotrain.tools.run_diff import compare_runs

_OWN = ("hydra.run.dir=", "hydra.sweep.dir=", "hydra.mode=")


def check_overrides(overrides: list[str]) -> None:
    for o in overrides:
        if o.lstrip("+~").startswith(_OWN):
            raise ReprotrainError(
                f"verify chooses the run directories itself; drop {o.split('=', 1)[0]} "
                "(use --out-dir to choose where they go)"
            )
        if o in ("-m", "--multirun"):
            raise ReprotrainError("verify runs one config twice; --multirun is not supported")


def run_once(overrides: list[str], run_dir: Path) -> tuple[int, str | None]:
    cmd = [sys.executable, "-m", "reprotrain.train", *overrides]
    cmd.append(hydra_override("hydra.run.dir", run_dir))
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    return cli.run_forwarding_errors(cmd, env={**os.environ, "PYTHONHASHSEED": "0"})


@cli.entry_point
def main(argv: list[str] | None = None) -> int:
    p = cli.parser("reprotrain.tools.verify", __doc__)
    p.add_argument("--out-dir", type=cli.user_path, default=Path("outputs") / "verify")
    args, overrides = p.parse_known_args(argv)
    unknown = [o for o in overrides if o.startswith("--") and o != "--multirun"]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    check_overrides(overrides)
    for parent in (args.out_dir, *args.out_dir.parents):
        if parent.exists() and not parent.is_dir():
            raise ReprotrainError(
                f"--out-dir {args.out_dir}: {parent}: {os.strerror(errno.ENOTDIR)}"
            )
    base = args.out_dir / f"{time.strftime('%Y-%m-%d_%H-%M-%S')}-{os.getpid()}"
    dirs = [base / "a", base / "b"]
    for run_dir in dirs:
        rc, error_line = run_once(overrides, run_dir)
        if rc != 0:
            if error_line is None:  # the trainer did not say why: say what we know
                print(f"error: run in {run_dir} failed (exit {rc}); nothing to compare",
                      file=sys.stderr)  # fmt: skip
            return 2
    result = compare_runs(*dirs)
    print(result.verdict())
    for epoch, diffs in sorted(result.metric_diffs.items()):
        shown = ", ".join(f"{k}: {a} vs {b}" for k, (a, b) in diffs.items())
        print(f"  epoch {epoch}: {shown}")
    print(f"runs: {dirs[0]}  {dirs[1]}")
    if not result.identical:
        print(f"first divergent op: {bisect_command(*dirs)}")
    return 0 if result.identical else 1


if __name__ == "__main__":
    sys.exit(main())
