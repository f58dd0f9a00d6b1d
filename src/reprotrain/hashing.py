"""The sha256 of text, of files (cached), of tensors and of losses (of a Python object's
content: ``digest.py``). One home, so "the same bytes" means one thing everywhere. Files
close *data drift*; a file's hash is cached by (absolute path, size, mtime_ns), as ``git
status`` does, and like git's "racy" entries a file modified in the last few seconds is
hashed but not cached."""

from __future__ import annotations

import hashlib
import json
import struct
import time
from pathlib import Path
from typing import TYPE_CHECKING

from reprotrain.run.record import atomic_write_text

if TYPE_CHECKING:
    import torch
    from torch import nn

_CACHE_VERSION = 1
# Files modified this recently are not cached: their mtime could still be shared with a
# later same-size rewrite on filesystems with coarse timestamps.
_RACY_WINDOW_NS = 2_000_000_000


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's content, streamed so large files never sit in memory."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _read_cache(cache_file: Path | None) -> dict[str, dict]:
    """The per-file hash cache; empty when missing or unreadable (it must never fail a run)."""
    try:
        raw = json.loads(Path(cache_file).read_text(encoding="utf-8")) if cache_file else {}
    except (OSError, ValueError):
        return {}
    ours = isinstance(raw, dict) and raw.get("version") == _CACHE_VERSION
    entries = raw.get("entries") if ours else None
    return entries if isinstance(entries, dict) else {}


def files_fingerprint(paths: list[Path], cache_file: Path | None = None) -> str:
    """Hex sha256 over each file's base name, size and content sha256 (sorted; cached)."""
    cache = _read_cache(cache_file)
    dirty = False
    now_ns = time.time_ns()
    overall = hashlib.sha256()
    for path in sorted((Path(p) for p in paths), key=lambda p: (p.name, str(p))):
        st = path.stat()
        key = str(path.resolve())
        entry, stamp = cache.get(key), {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        fresh = isinstance(entry, dict) and stamp.items() <= entry.items()  # same size and mtime
        if fresh and isinstance(entry.get("sha256"), str):
            content = entry["sha256"]
        else:
            content = file_sha256(path)
            if cache_file is not None and now_ns - st.st_mtime_ns > _RACY_WINDOW_NS:
                cache[key] = {**stamp, "sha256": content}
                dirty = True
            elif key in cache:
                del cache[key]
                dirty = True
        overall.update(f"{path.name}\0{st.st_size}\0{content}\n".encode())
    if cache_file is not None and dirty:
        text = json.dumps({"version": _CACHE_VERSION, "entries": cache}, indent=1, sort_keys=True)
        atomic_write_text(Path(cache_file), text + "\n")
    return overall.hexdigest()


def text_sha256(text: str) -> str:
    """Hex sha256 of ``text`` as UTF-8."""
    return hashlib.sha256(text.encode()).hexdigest()


def state_sha256(state: dict[str, torch.Tensor]) -> str:
    """sha256 over a name -> tensor map, by name, dtype, shape and raw bytes (sorted names)."""
    import torch

    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def weights_sha256(model: nn.Module) -> str:
    """sha256 of every parameter *and buffer* in ``model.state_dict()``."""
    return state_sha256(model.state_dict())


def losses_sha256(losses: list[float]) -> str:
    """sha256 of the step losses as exact float64 bytes."""
    return hashlib.sha256(struct.pack(f"<{len(losses)}d", *losses)).hexdigest()
