"""The run directory: the one reader/writer of run.json and its sibling files.

Closes (as records): "it lived only in a terminal". Layout::

    run.json              identity, seeds, determinism, env, git, data, weights, status
    config.resolved.yaml  the composed config with every interpolation resolved
    metrics.jsonl         one line per epoch
    fingerprints.jsonl    one line per epoch: weights sha256 + step losses and their sha256
    checkpoints/          step-XXXXXXXX.pt (last K) and best.pt
    git.diff              uncommitted changes (only when the tree is dirty)
    environment.txt       torch.utils.collect_env output
    .hydra/, train.log    Hydra's own record and the log

Every write is atomic (temp file, fsync, rename), so a kill at any instant leaves either
the old or the new file, never a half-written one that parses.
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

RUN_JSON = "run.json"
METRICS = "metrics.jsonl"
FINGERPRINTS = "fingerprints.jsonl"
RESOLVED_CONFIG = "config.resolved.yaml"
CHECKPOINTS = "checkpoints"
STATUSES = ("running", "completed", "failed", "interrupted")
_UMASK = os.umask(0)
os.umask(_UMASK)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp's 0600 would make records unreadable to a team
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Rewrite a whole jsonl file atomically (used per epoch and on resume)."""
    atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def read_jsonl(path: Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class RunRecord:
    """run.json as a dict that is written atomically on every update."""

    def __init__(self, run_dir: Path, data: dict[str, Any] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.data: dict[str, Any] = data or {}

    @classmethod
    def load(cls, run_dir: Path) -> RunRecord:
        return cls(run_dir, json.loads((Path(run_dir) / RUN_JSON).read_text()))

    def update(self, **fields: Any) -> None:
        if "status" in fields and fields["status"] not in STATUSES:
            raise ValueError(f"bad status {fields['status']!r}")
        self.data.update(fields)
        atomic_write_text(self.run_dir / RUN_JSON, json.dumps(self.data, indent=2, sort_keys=True))

    def __getitem__(self, key: str) -> Any:
        return self.data[key]
