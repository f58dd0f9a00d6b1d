"""The one rule for which tar members may be extracted, shared by every reader of archives
(dataset downloads, ``data.download``, and ``make reproduce``): a relative path that stays
inside the target, naming a regular file or a directory. Absolute paths, ``..``, links, devices,
fifos and sparse files are refused before a single byte is written.

And how much an archive may unpack (:class:`Limits`): member count, per-member size, total
size and compression ratio, checked from the headers before extraction (the member count
while the headers are read, so 200,000 empty members are refused after the first 20,001,
not held in memory), and again while the bytes stream (:class:`Budget`). The defaults fit
a run archived with its checkpoints (an 11M-parameter model's checkpoint is ~130 MB and compresses
~1.1x; source, records and logs compress ~3-10x) and refuse a bomb; each is overridable.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath

from reprotrain.errors import ReprotrainError

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class ArchiveLimitError(ReprotrainError):
    """An archive would unpack more than the limits allow; nothing was extracted."""


@dataclass(frozen=True)
class Limits:
    max_members: int = 20_000
    max_member_bytes: int = 4 << 30
    max_total_bytes: int = 16 << 30
    #: unpacked / compressed bytes; only checked once the total exceeds ``ratio_floor_bytes``
    #: (a few MB of JSON lines may compress 50x and is harmless).
    max_ratio: float = 100.0
    ratio_floor_bytes: int = 64 << 20


def parse_bytes(text: str) -> int:
    """``"4G"``, ``"512M"``, ``"1024"`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgGtT]?)i?[bB]?\s*", text)
    if not m:
        raise ValueError(text)
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def read_members(tar: tarfile.TarFile, limits: Limits) -> list[tarfile.TarInfo]:
    """The headers, refusing as soon as there are more than ``limits.max_members``."""
    out = []
    for m in _iter(tar):
        out.append(m)
        if len(out) > limits.max_members:
            raise ArchiveLimitError(
                f"the archive has more than {limits.max_members} members (limit "
                "--max-members); nothing extracted"
            )
    return out


def _iter(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    while (m := tar.next()) is not None:
        yield m


def check_sizes(members: list[tarfile.TarInfo], compressed_bytes: int, limits: Limits) -> int:
    """Refuse from the headers alone; returns the total bytes the members unpack to."""
    total = 0
    for m in members:
        if m.size > limits.max_member_bytes:
            raise ArchiveLimitError(
                f"member {m.name!r} unpacks to {human(m.size)}, over the per-member limit of "
                f"{human(limits.max_member_bytes)} (--max-member-bytes); nothing extracted"
            )
        total += m.size
    if total > limits.max_total_bytes:
        raise ArchiveLimitError(
            f"the archive unpacks to {human(total)}, over the limit of "
            f"{human(limits.max_total_bytes)} (--max-unpacked-bytes); nothing extracted"
        )
    ratio = total / max(compressed_bytes, 1)
    if total > limits.ratio_floor_bytes and ratio > limits.max_ratio:
        raise ArchiveLimitError(
            f"the archive unpacks to {human(total)} from {human(compressed_bytes)} (ratio "
            f"{ratio:.0f}, limit {limits.max_ratio:g}, --max-ratio): a compression bomb? "
            "nothing extracted"
        )
    return total


class Budget:
    """Counts bytes as they stream: a member may not exceed its header's size or the
    per-member limit, and all of them together not the total limit."""

    def __init__(self, limits: Limits) -> None:
        self.limits, self.total = limits, 0

    def take(self, m: tarfile.TarInfo, so_far: int, n: int) -> None:
        self.total += n
        if so_far + n > min(m.size, self.limits.max_member_bytes):
            raise ArchiveLimitError(f"member {m.name!r} streams more bytes than its header says")
        if self.total > self.limits.max_total_bytes:
            raise ArchiveLimitError(
                f"the archive streamed more than {human(self.limits.max_total_bytes)}"
            )


def clash(paths: dict[str, bool]) -> str | None:
    """{relative path: is a directory} -> a path used both as a file and as a directory."""
    for rel in paths:
        parts = rel.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            if paths.get(parent) is False:
                return parent
    return None


def unsafe_reason(m: tarfile.TarInfo) -> str | None:
    """Why ``m`` may not be extracted, or None when it is a plain file or directory."""
    p = PurePosixPath(m.name)
    if m.name.startswith(("/", "\\")) or p.is_absolute() or re.match(r"^[A-Za-z]:", m.name):
        return "absolute path"
    if ".." in p.parts or "\\" in m.name:
        return "path leaves the target"
    if m.issym():
        return f"symlink to {m.linkname!r}"
    if m.islnk():
        return f"hard link to {m.linkname!r}"
    if m.ischr() or m.isblk():
        return "device file"
    if m.isfifo():
        return "fifo"
    if m.issparse():
        return "sparse file"
    if not (m.isreg() or m.isdir()):
        return "not a plain file or directory"
    return None
