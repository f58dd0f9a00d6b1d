"""Validate the hashed locks offline: ``python -m reprotrain.tools.locks.check_lock``.

One ``error: ...`` line per problem and exit 1, or one ``ok: ...`` line and exit 0 (checks:
``repro/requirements_lock.py``). ``--record`` writes ``<lock>.sha256``; ``--record-files``
(network) writes ``<lock>.files``. docs/reproducing-elsewhere.md.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from reprotrain.repro import lock_platforms
from reprotrain.repro.requirements_lock import (
    ALL_PAIRS,
    DEFAULT_PAIRS,
    ParsedLock,
    check_agreement,
    check_in_satisfied,
    check_staleness,
    parse_lock,
    write_record,
)
from reprotrain.tools import cli


def check_locks(pairs: list[tuple[Path, Path]]) -> list[str]:
    """All lock checks over (lock, .in) pairs; returns one message per problem, [] when sound."""
    problems: list[str] = []
    parsed: list[ParsedLock] = []
    for lock_path, in_path in pairs:
        lock_path, in_path = Path(lock_path), Path(in_path)
        if not lock_path.exists():
            problems.append(f"{lock_path.name}: missing; run make lock")
            continue
        if not in_path.exists():
            problems.append(f"{in_path.name}: missing (the input of {lock_path.name})")
            continue
        lock = parse_lock(lock_path)
        parsed.append(lock)
        problems.extend(lock.problems)
        if not lock.entries:
            problems.append(f"{lock_path.name}: no pinned packages")
        problems.extend(check_staleness(lock_path, in_path))
        problems.extend(check_in_satisfied(lock, in_path))
        problems.extend(lock_platforms.check_lock_platforms(lock))
    problems.extend(check_agreement(parsed))
    return problems


def default_root() -> Path:
    """The repo root: the working directory when it holds the locks, else next to src/."""
    cwd = Path.cwd()
    return cwd if (cwd / DEFAULT_PAIRS[0][1]).exists() else Path(__file__).resolve().parents[4]


@cli.entry_point
def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("reprotrain.tools.locks.check_lock", __doc__)
    parser.add_argument("--root", type=Path, default=None, help="repo root (default: auto)")
    parser.add_argument("--lock", action="append", default=[], help="lock file (repeatable)")
    parser.add_argument(
        "--in", dest="ins", action="append", default=[], help=".in file, one per --lock"
    )
    parser.add_argument("--record", action="store_true", help="write <lock>.sha256 sidecars")
    files = "write <lock>.files from the package index (network)"
    parser.add_argument("--record-files", action="store_true", help=files)
    index = os.environ.get("PIP_INDEX_URL") or lock_platforms.DEFAULT_INDEX
    index_help = "simple index to read file names from (default: $PIP_INDEX_URL or PyPI)"
    parser.add_argument("--index-url", default=index, help=index_help)
    args = parser.parse_args(argv)

    root = args.root or default_root()
    if len(args.lock) != len(args.ins):
        print("error: give one --in per --lock", file=sys.stderr)
        return 2
    named = list(zip(args.lock, args.ins, strict=True)) or ALL_PAIRS
    pairs = [(root / lk, root / i) for lk, i in named]

    if args.record_files:
        for lock_path, _ in pairs:
            try:
                files = lock_platforms.fetch_files(parse_lock(lock_path), args.index_url)
            except (OSError, LookupError, ValueError) as exc:
                print(f"error: cannot list the files of {lock_path.name}: {exc}")
                return 1
            out = lock_platforms.write_files(lock_path, files)
            print(f"ok: recorded {out.name} ({len(files)} files)")
    if args.record:
        for lock_path, in_path in pairs:
            try:
                out = write_record(lock_path, in_path)
            except FileNotFoundError as exc:
                print(f"error: {exc}")
                return 1
            print(f"ok: recorded {out.name}")
    if args.record or args.record_files:
        return 0

    problems = check_locks(pairs)
    for problem in problems:
        print(f"error: {problem}")
    if problems:
        return 1
    print("ok: " + ", ".join(p[0].name for p in pairs) + " pinned, hashed, fresh and consistent")
    return 0


if __name__ == "__main__":
    sys.exit(main())
