"""Compare the running interpreter's distributions with the locks: ``make env-check``.

One ``error: ...`` line per drifting package and exit 1, or ``ok: ...`` and exit 0; the project
itself is never drift; pip, setuptools and wheel are compared like everything else.
"""

from __future__ import annotations

import sys
from pathlib import Path

from reprotrain.repro.requirements_lock import env_drift, installed_versions
from reprotrain.tools import cli
from reprotrain.tools.locks.check_lock import default_root

FIX = "fix: rm -rf .venv && make install"


@cli.entry_point
def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("reprotrain.tools.locks.env_check", __doc__)
    parser.add_argument("--root", type=Path, default=None, help="repo root (default: auto)")
    root = parser.parse_args(argv).root or default_root()

    drift = env_drift(root)
    if drift["status"] == "no-lock":
        print(f"error: no requirements.lock / requirements-dev.lock under {root}")
        return 1
    locks = " + ".join(drift["locks"])
    if drift["status"] == "ok":
        print(f"ok: {sys.prefix} matches {locks}")
        return 0
    installed = installed_versions()
    for name in drift["missing"]:
        print(f"error: missing: {name} is locked but not installed")
    project = drift["project"]["name"]
    for name in drift["extra"]:
        if name == project:  # the project itself, installed as a copy, not editable
            print(f"error: project: {name} is installed as a copy, not editable (make install)")
            continue
        print(f"error: extra: {name} {installed.get(name, '?')} is installed but not locked")
    for d in drift["different"]:
        print(f"error: different: {d['name']} locked {d['locked']}, installed {d['installed']}")
    n = len(drift["missing"]) + len(drift["extra"]) + len(drift["different"])
    print(f"error: {sys.prefix} drifts from {locks} in {n} package(s); {FIX}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
