"""The run directory: the one reader/writer of run.json and its sibling files.
Closes (as records): "it lived only in a terminal" (layout: docs/run-directory.md). Every
write is atomic (temp, fsync, rename); every record is strict JSON (a non-finite float
becomes ``null``, its path listed in ``nonfinite``: jq, JavaScript and Go reject ``NaN``)."""

from __future__ import annotations

import errno
import json
import math
import numbers
import os
import secrets
import stat
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from reprotrain import events
from reprotrain.errors import RecordError
from reprotrain.run.bounded import load_json

RUN_JSON = "run.json"
METRICS = "metrics.jsonl"
FINGERPRINTS = "fingerprints.jsonl"
RESOLVED_CONFIG = "config.resolved.yaml"
CHECKPOINTS = "checkpoints"
STATUSES = ("running", "completed", "failed", "interrupted")
# What a run leaves beside run.json: found without one, someone's record a start would
# overwrite. Not Hydra's ``.hydra/`` and log: Hydra writes them before the trainer looks.
_OTHERS = "environment.txt git.diff tensorboard report.md curves.png eval.json evals"
RUN_FILES = (METRICS, FINGERPRINTS, RESOLVED_CONFIG, *_OTHERS.split())
_writer = True  # False on DDP ranks > 0: rank 0 is the one writer of the run directory


def set_writer(is_writer: bool) -> None:
    """Make every write below a no-op in processes that must not write (DDP ranks > 0)."""
    global _writer
    _writer = is_writer


def is_writer() -> bool:
    return _writer


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def refuse_special(path: Path) -> None:
    """OSError for a FIFO, a device, a socket or a directory at ``path``: never replaced."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return
    if not stat.S_ISREG(mode):
        raise OSError(errno.EEXIST, "not a regular file; refusing to replace it", str(path))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """The project's one atomic writer: temp file, fsync, rename, fsync the directory. The
    temp file is mode 0666 so the user's umask applies (mkstemp's 0600 would hide records)."""
    if not _writer:
        return
    path = Path(path)
    refuse_special(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            events.fire("file-write", path=Path(path))
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        # a failed write names no file: name the one being written
        if isinstance(e, OSError) and e.filename is None:
            raise OSError(e.errno, e.strerror or str(e), str(path)) from None
        raise
    fd = os.open(path.parent, os.O_RDONLY)  # the rename itself, durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_in_place(path: Path, data: bytes) -> None:
    """Disk full: overwrite ``path`` in its own blocks (not atomic; only to record a failure)."""
    if not _writer:
        return
    with open(path, "r+b" if Path(path).exists() else "wb") as f:
        f.write(data)
        f.truncate()
        f.flush()
        os.fsync(f.fileno())


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def to_strict_json(obj: Any) -> tuple[Any, list[str]]:
    """A copy of ``obj`` with non-finite floats ``None``, and their paths (``metrics[3].loss``)."""
    bad: list[str] = []
    return _walk(obj, "", bad), bad


def _walk(obj: Any, path: str, bad: list[str]) -> Any:
    if isinstance(obj, bool | int | str) or obj is None:
        return obj
    if isinstance(obj, float | numbers.Real) and not isinstance(obj, numbers.Integral):
        if math.isfinite(value := float(obj)):
            return value
        bad.append(path or "$")
        return None
    if isinstance(obj, numbers.Integral):  # NumPy integers
        return int(obj)
    if isinstance(obj, dict):
        return {k: _walk(v, f"{path}.{k}" if path else str(k), bad) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_walk(v, f"{path}[{i}]", bad) for i, v in enumerate(obj)]
    return obj  # anything else: json.dumps decides (and raises on what it cannot write)


def strict_dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` that refuses non-finite numbers instead of writing ``NaN``."""
    return json.dumps(obj, allow_nan=False, **kwargs)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite JSON constant {name} (strict JSON has no NaN/Infinity)")


def strict_loads(text: str | bytes) -> Any:
    """``json.loads`` that rejects ``NaN``, ``Infinity`` and ``-Infinity`` literals."""
    return json.loads(text, parse_constant=_reject_constant)


def strict_json(obj: Any, flag: str | None = "nonfinite", **kw: Any) -> str:
    """JSON without NaN/inf: they become null, listed under ``flag`` when obj is a dict."""
    clean, found = to_strict_json(obj)
    if found and flag and isinstance(clean, dict):
        clean[flag] = found
    return strict_dumps(clean, **kw)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Rewrite a whole jsonl file atomically (used per epoch and on resume)."""
    atomic_write_text(path, "".join(strict_json(r, sort_keys=True) + "\n" for r in rows))


DAMAGED_HINT = "the run record is damaged; restore it from a copy or start a new run"


def parse_json_object(text: str, label: str) -> dict[str, Any]:
    """A JSON object, or RecordError naming line and column (lenient on NaN: writers are strict)."""
    try:
        data = load_json(text, label)
    except json.JSONDecodeError as e:
        raise RecordError(
            f"{label}: invalid JSON at line {e.lineno} column {e.colno} ({e.msg}); {DAMAGED_HINT}"
        ) from None
    if not isinstance(data, dict):
        raise RecordError(f"{label}: expected a JSON object, found {type(data).__name__}")
    return data


def parse_jsonl(text: str, label: str, *, torn_tail_ok: bool = False) -> list[dict[str, Any]]:
    """One JSON object per line, or RecordError naming the line; ``torn_tail_ok`` drops a last
    line that does not parse (a run killed mid-write)."""
    lines = text.splitlines()
    rows = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(parse_json_object(line, f"{label} line {n}"))
        except RecordError:
            if torn_tail_ok and n == len(lines):
                break
            raise
    return rows


def read_text(path: Path) -> str:
    """The file's text, or RecordError when it is missing, unreadable, or not UTF-8."""
    path = Path(path)
    label = str(path)
    if not path.exists():
        raise RecordError(f"{label}: no such file")
    if not path.is_file():
        raise RecordError(f"{label}: not a regular file")
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as e:
        raise RecordError(f"cannot read {label}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise RecordError(f"{label}: not UTF-8 text (byte {e.start}); {DAMAGED_HINT}") from None


def read_jsonl(path: Path, *, torn_tail_ok: bool = False) -> list[dict[str, Any]]:
    """The one reader of metrics.jsonl / fingerprints.jsonl ([] when absent)."""
    if not Path(path).exists():
        return []
    return parse_jsonl(read_text(path), str(path), torn_tail_ok=torn_tail_ok)


class RunRecord:
    """run.json as a dict that is written atomically on every update."""

    def __init__(self, run_dir: Path, data: dict[str, Any] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.data: dict[str, Any] = data or {}

    @classmethod
    def load(cls, run_dir: Path) -> RunRecord:
        path = Path(run_dir) / RUN_JSON
        return cls(run_dir, parse_json_object(path.read_text(), str(path)))

    def update(self, **fields: Any) -> None:
        if "status" in fields and fields["status"] not in STATUSES:
            raise ValueError(f"bad status {fields['status']!r}")
        self.data.update(fields)
        text = strict_json(self.data, flag="nonfinite_fields", indent=2, sort_keys=True)
        atomic_write_text(self.run_dir / RUN_JSON, text)

    def __getitem__(self, key: str) -> Any:
        return self.data[key]
