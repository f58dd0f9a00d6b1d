"""Every sha256 the project takes: of text, of files (cached), of tensors and of losses.

One home for hashing, so that "the same bytes" means the same thing wherever a record, a
lock, an archive or a resume compares them. Files (:func:`files_fingerprint`) close *data
drift*: the same code, lock and config on other dataset files (a re-download, a truncated
copy) is told apart before a weight is compared. Each file's content hash is cached by
(absolute path, size, mtime_ns), as ``git status`` does; like git's "racy" entries, a file
modified in the last few seconds is hashed but not cached.
"""

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

__all__ = [
    "file_sha256",
    "files_fingerprint",
    "losses_sha256",
    "state_sha256",
    "text_sha256",
    "weights_sha256",
]

_CACHE_VERSION = 1
# Files modified this recently are not cached: their mtime could still be shared with a
# later same-size rewrite on filesystems with coarse timestamps.
_RACY_WINDOW_NS = 2_000_000_000


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's content, streamed so large files never sit in memory."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _read_cache(cache_file: Path | None) -> dict[str, dict]:
    """Load the per-file hash cache; a missing or unreadable cache is simply empty.

    The cache is an optimisation only, so a corrupt one must never fail a run.
    """
    if cache_file is None:
        return {}
    try:
        raw = json.loads(Path(cache_file).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict) or raw.get("version") != _CACHE_VERSION:
        return {}
    entries = raw.get("entries")
    return entries if isinstance(entries, dict) else {}


def _write_cache(cache_file: Path, entries: dict[str, dict]) -> None:
    """Atomically, so a crash or a concurrent run never leaves half a JSON file behind."""
    text = json.dumps({"version": _CACHE_VERSION, "entries": entries}, indent=1, sort_keys=True)
    atomic_write_text(Path(cache_file), text + "\n")


def files_fingerprint(paths: list[Path], cache_file: Path | None = None) -> str:
    """Return a hex sha256 over ``paths``: for each file, its name, size and content sha256.

    Files are taken in sorted order (by name, then full path) so the fingerprint does not
    depend on the order the caller listed them in. Only the base name enters the hash, not
    the directory, so the same dataset fingerprints the same wherever it is stored.

    With ``cache_file``, content hashes are reused for files whose (absolute path, size,
    mtime_ns) are unchanged since they were hashed, and the cache is updated atomically.
    A missing file raises ``FileNotFoundError``.
    """
    files = sorted((Path(p) for p in paths), key=lambda p: (p.name, str(p)))
    cache = _read_cache(cache_file)
    dirty = False
    now_ns = time.time_ns()
    overall = hashlib.sha256()
    for path in files:
        st = path.stat()
        key = str(path.resolve())
        entry = cache.get(key)
        if (
            isinstance(entry, dict)
            and entry.get("size") == st.st_size
            and entry.get("mtime_ns") == st.st_mtime_ns
            and isinstance(entry.get("sha256"), str)
        ):
            content = entry["sha256"]
        else:
            content = file_sha256(path)
            if cache_file is not None and now_ns - st.st_mtime_ns > _RACY_WINDOW_NS:
                cache[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": content}
                dirty = True
            elif key in cache:
                del cache[key]
                dirty = True
        overall.update(f"{path.name}\0{st.st_size}\0{content}\n".encode())
    if cache_file is not None and dirty:
        _write_cache(Path(cache_file), cache)
    return overall.hexdigest()


def text_sha256(text: str) -> str:
    """Hex sha256 of ``text`` as UTF-8."""
    return hashlib.sha256(text.encode()).hexdigest()


# Tensors and losses: how a run proves it matched another. Closes nothing by itself.


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
    """sha256 of every parameter *and buffer* in ``model.state_dict()`` (BatchNorm's running
    statistics included)."""
    return state_sha256(model.state_dict())


def losses_sha256(losses: list[float]) -> str:
    """sha256 of the step losses as exact float64 bytes, so verify can point at the first
    step whose loss differs."""
    return hashlib.sha256(struct.pack(f"<{len(losses)}d", *losses)).hexdigest()
