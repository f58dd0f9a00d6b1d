"""Bounded for every compression: gzip, bz2, xz and plain tar are capped alike while they
stream, and an extended header (GNU long name/link, pax) that claims more than
``safetar.MAX_HEADER_BYTES`` is refused before tarfile reads its body into memory.
In-process, tiny crafted archives, no training."""

from __future__ import annotations

import bz2
import functools
import gzip
import lzma
import tracemalloc
from pathlib import Path

import pytest

from reprotrain import safetar
from reprotrain.tools.reproduce import reproduce as repro
from test_archive_limits import header

WRITERS = {
    "tar.gz": gzip.open,
    "tar.bz2": bz2.open,
    "tar.xz": functools.partial(lzma.open, preset=0),
    "tar": open,
}


def extended(kind: bytes, size: int) -> bytes:
    """A GNU long-name (``L``), long-link (``K``) or pax (``x``, ``g``) header claiming
    ``size`` bytes of body."""
    h = bytearray(header(b"././@LongLink", size))
    h[156:157] = kind
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def crafted(path: Path, *parts: bytes, zeros: int = 0) -> Path:
    with WRITERS[path.name.split(".", 1)[1]](path, "wb") as f:
        for part in parts:
            f.write(part)
        for _ in range(zeros >> 20):
            f.write(bytes(1 << 20))
        f.write(bytes(1024))
    return path


def refused(path: Path, tmp_path: Path, capsys, *extra: str) -> str:
    rc = repro.main([str(path), "--extract-dir", str(tmp_path / "x"), *extra])
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert not (tmp_path / "x").exists(), "nothing extracted"
    return lines[0]


@pytest.mark.parametrize("suffix", WRITERS)
def test_every_compression_is_capped_while_it_streams(tmp_path, capsys, suffix):
    """Was: only gzip was capped; xz, bz2 and plain tar streamed without a bound."""
    path = crafted(tmp_path / f"bomb.{suffix}", header(b"top/MANIFEST.sha256"),
                   header(b"top/zeros", 8 << 20), zeros=8 << 20)  # fmt: skip
    line = refused(path, tmp_path, capsys, "--max-unpacked-bytes", "1M", "--max-members", "4")
    assert "inflates past 1.0 MiB" in line and "nothing extracted" in line


def test_a_long_name_claiming_more_than_the_stream_cap_never_grows_the_process(tmp_path, capsys):
    """The reported case: a tiny .tar.xz whose long-name header claims (and holds) far more
    than the limits allow. Was: tarfile read the whole body (942 MiB for a 1 GiB claim)."""
    claim = 160 << 20
    path = crafted(tmp_path / "longname.tar.xz", extended(b"L", claim), zeros=claim)
    assert path.stat().st_size < 100 << 10
    tracemalloc.start()
    try:
        line = refused(path, tmp_path, capsys)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"peak {peak >> 20} MiB traced while refusing"
    assert "inflates past" in line


@pytest.mark.parametrize("kind", [b"L", b"K", b"x", b"g"])
@pytest.mark.parametrize("suffix", ["tar", "tar.xz"])
def test_an_oversized_extended_header_is_refused_before_its_body_is_read(
    tmp_path, capsys, monkeypatch, kind, suffix
):
    """Within the stream cap, but more than a header may hold: refused from the header."""
    claim = safetar.MAX_HEADER_BYTES + 512
    path = crafted(tmp_path / f"ext.{suffix}", extended(kind, claim), zeros=2 << 20)
    reads: list[int] = []
    original = safetar.CappedStream.read

    def counted(self, n=-1):
        data = original(self, n)
        reads.append(len(data))
        return data

    monkeypatch.setattr(safetar.CappedStream, "read", counted)
    with (
        pytest.raises(safetar.ArchiveLimitError, match=r"extended .* header claims 1\.0 MiB"),
        safetar.open_tar(path, safetar.Limits()) as tar,
    ):
        tar.getmembers()
    assert max(reads) <= 512, "only the header block was read, never the claimed body"
    line = refused(path, tmp_path, capsys)
    assert "extended (long-name or pax) header claims" in line


def test_the_stream_cap_counts_headers_and_the_limits():
    limits = safetar.Limits(max_total_bytes=10 << 20, max_members=8, ratio_floor_bytes=1 << 20,
                            max_ratio=4)  # fmt: skip
    assert safetar.stream_cap(1 << 20, limits) == (4 << 20) + 1024 * 10
    assert safetar.stream_cap(100 << 20, limits) == (10 << 20) + 1024 * 10
