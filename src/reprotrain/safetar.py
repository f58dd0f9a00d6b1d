"""The one rule for which tar members may be extracted, and how much an archive may unpack.

Shared by every reader of archives (dataset downloads and ``make reproduce``): a relative path
inside the target naming a regular file or a directory; links, devices, fifos and sparse files
are refused before a byte is written. :class:`Limits` (count, sizes, ratio) are checked from
the headers, on the decompressed stream (:func:`stream_cap`) and while bytes stream
(:class:`Budget`). Defaults and why: docs/archive-and-reproduce.md.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import lzma
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

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
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def read_members(tar: tarfile.TarFile, limits: Limits) -> list[tarfile.TarInfo]:
    """The headers, refusing as soon as there are more than ``limits.max_members``."""
    out = []
    while (m := tar.next()) is not None:
        out.append(m)
        if len(out) > limits.max_members:
            raise ArchiveLimitError(
                f"the archive has more than {limits.max_members} members (limit "
                "--max-members); nothing extracted"
            )
    return out


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

    def stream(self, tar: tarfile.TarFile, m: tarfile.TarInfo) -> Iterator[bytes]:
        """``m``'s bytes in 1 MiB chunks, each counted before it is handed on."""
        so_far = 0
        with tar.extractfile(m) as f:
            while chunk := f.read(1 << 20):
                so_far += len(chunk)
                self.total += len(chunk)
                if so_far > min(m.size, self.limits.max_member_bytes):
                    raise ArchiveLimitError(
                        f"member {m.name!r} streams more bytes than its header says"
                    )
                if self.total > self.limits.max_total_bytes:
                    raise ArchiveLimitError(
                        f"the archive streamed more than {human(self.limits.max_total_bytes)}"
                    )
                yield chunk


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


#: The most a GNU long-name/long-link or pax extended header may hold (names are < 4 KiB).
MAX_HEADER_BYTES = 1 << 20
_EXTENDED = (b"L", b"K", b"x", b"g", b"X")  # tarfile.GNUTYPE_LONG{NAME,LINK}, pax, Solaris
#: (magic bytes, name, opener of the decompressed stream); none of them: a plain tar.
_COMPRESSIONS = (
    (b"\x1f\x8b", "gzip", lambda f: gzip.GzipFile(fileobj=f, mode="rb")),
    (b"BZh", "bz2", bz2.BZ2File),
    (b"\xfd7zXZ\x00", "xz", lzma.LZMAFile),
)


class _CappedHeaders(tarfile.TarInfo):
    """A TarInfo whose extended headers are size-checked before their body is read."""

    def _proc_member(self, tarfile_: tarfile.TarFile):  # tarfile's own hook, per header
        if self.type in _EXTENDED and self.size > MAX_HEADER_BYTES:
            raise ArchiveLimitError(
                f"an extended (long-name or pax) header claims {human(self.size)}, over "
                f"{human(MAX_HEADER_BYTES)}; nothing extracted"
            )
        return super()._proc_member(tarfile_)


def compression(path: Path) -> str:
    """``gzip``, ``bz2``, ``xz`` or ``none``, from the file's first bytes."""
    with open(path, "rb") as f:
        head = f.read(6)
    return next((name for magic, name, _ in _COMPRESSIONS if head.startswith(magic)), "none")


def stream_cap(packed_bytes: int, limits: Limits) -> int:
    """The most the decompressed stream of a ``packed_bytes`` archive may hold: the total
    and ratio limits on the members, plus 512-byte headers and padding for each member."""
    by_ratio = max(limits.ratio_floor_bytes, limits.max_ratio * packed_bytes)
    return int(min(limits.max_total_bytes, by_ratio)) + 1024 * (limits.max_members + 2)


class CappedStream:
    """A decompressed stream that refuses to read or seek past ``cap`` bytes."""

    def __init__(self, inner: BinaryIO, cap: int, name: str) -> None:
        self.inner, self.cap, self.name = inner, cap, name

    def _refuse(self) -> ArchiveLimitError:
        return ArchiveLimitError(
            f"{self.name} inflates past {human(self.cap)} (limits --max-unpacked-bytes / "
            "--max-ratio); nothing extracted"
        )

    def read(self, n: int | None = -1) -> bytes:
        room = self.cap + 1 - self.inner.tell()
        data = self.inner.read(room if n is None or n < 0 or n > room else n)
        if self.inner.tell() > self.cap:
            raise self._refuse()
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        target = {0: offset, 1: self.inner.tell() + offset}.get(whence)
        if target is None or target > self.cap:
            raise self._refuse()
        return self.inner.seek(target)

    def tell(self) -> int:
        return self.inner.tell()


@contextlib.contextmanager
def open_stream(path: Path, limits: Limits) -> Iterator[CappedStream]:
    """The archive's decompressed bytes, capped at :func:`stream_cap`."""
    path = Path(path)
    name = compression(path)
    opener = next((o for _, each, o in _COMPRESSIONS if each == name), None)
    with open(path, "rb") as raw:
        inner = opener(raw) if opener is not None else raw
        try:
            yield CappedStream(inner, stream_cap(path.stat().st_size, limits), str(path))
        finally:
            inner.close()


@contextlib.contextmanager
def open_tar(path: Path, limits: Limits) -> Iterator[tarfile.TarFile]:
    """``tarfile.open(path)`` for reading, any compression, bounded as the module says."""
    with (
        open_stream(path, limits) as stream,
        tarfile.open(fileobj=stream, mode="r:", tarinfo=_CappedHeaders) as tar,
    ):
        yield tar
