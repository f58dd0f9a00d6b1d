"""What an archive may unpack: refused from the headers (or the inflating stream) before a
byte is extracted, and a refused extraction leaves nothing behind. In-process, no training."""

from __future__ import annotations

import errno
import gzip
import tarfile
from pathlib import Path

import pytest

from reprotrain import safetar
from reprotrain.tools.archive import archive_check
from reprotrain.tools.reproduce import reproduce as repro
from test_bad_inputs import archive, members

_TEMPLATE = bytearray(tarfile.TarInfo("x").tobuf(format=tarfile.USTAR_FORMAT))


def header(name: bytes, size: int = 0) -> bytes:
    """A ustar header, built by hand: 200,000 of them through tarfile would take ~10 s."""
    h = bytearray(_TEMPLATE)
    h[0:100] = name.ljust(100, b"\0")
    h[124:136] = b"%011o\0" % size
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def error_line(capsys) -> str:
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def refused(path: Path, tmp_path: Path, capsys, *extra: str) -> str:
    rc = repro.main([str(path), "--extract-dir", str(tmp_path / "x"), *extra])
    line = error_line(capsys)
    assert rc == 2
    assert not (tmp_path / "x").exists(), "nothing extracted"
    return line


def test_a_bomb_is_refused_while_it_inflates_with_nothing_left(tmp_path, capsys):
    bomb = tmp_path / "bomb.tar.gz"
    with gzip.open(bomb, "wb") as f:
        f.write(header(b"top/MANIFEST.sha256"))
        f.write(header(b"top/zeros", 300 << 20))
        zeros = bytes(1 << 20)
        for _ in range(300):
            f.write(zeros)
        f.write(bytes(1024))
    assert bomb.stat().st_size < 1 << 20  # 300 MB of zeros in well under 1 MB
    for extra in ((), ("--verify-only",)):  # --verify-only needs no trust: limits still hold
        line = refused(bomb, tmp_path, capsys, *extra)
        assert "inflates past" in line and "nothing extracted" in line


def test_a_200000_member_archive_is_refused_from_its_headers(tmp_path, capsys):
    many = tmp_path / "many.tar.gz"
    with gzip.open(many, "wb", compresslevel=1) as f:
        f.write(header(b"top/MANIFEST.sha256"))
        f.write(b"".join(header(b"top/m/%d" % i) for i in range(200_000)))
        f.write(bytes(1024))
    line = refused(many, tmp_path, capsys, "--verify-only")
    assert f"more than {safetar.Limits().max_members} members" in line
    assert "--max-members" in line


def test_header_limits_per_member_total_and_ratio_are_overridable(tmp_path, capsys):
    archive(members(**{"run/big.bin": b"\0" * 4096}))(tmp_path)
    path = tmp_path / "a.tar.gz"
    assert repro.main([str(path), "--verify-only"]) == 0, "the defaults accept it"
    capsys.readouterr()
    line = refused(path, tmp_path, capsys, "--verify-only", "--max-member-bytes", "1K")
    assert "'top/run/big.bin' unpacks to 4.0 KiB, over the per-member limit of 1.0 KiB" in line
    line = refused(path, tmp_path, capsys, "--verify-only", "--max-unpacked-bytes", "2K")
    assert "over the limit of 2.0 KiB (--max-unpacked-bytes)" in line
    line = refused(path, tmp_path, capsys, "--verify-only", "--max-members", "3")
    assert "more than 3 members" in line
    tight = safetar.Limits(max_ratio=2, ratio_floor_bytes=1024)
    with pytest.raises(repro.ReproduceRefused, match="compression bomb"):
        archive_check.verify(path, tight)


def test_a_file_directory_clash_is_refused_up_front(tmp_path, capsys):
    archive(members(**{"run/git.diff": b"a file", "run/git.diff/x": b"and a dir"}))(tmp_path)
    line = refused(tmp_path / "a.tar.gz", tmp_path, capsys, "--verify-only")
    assert "'top/run/git.diff' is a file and also a directory" in line


def test_a_failed_extraction_removes_what_it_wrote(tmp_path, monkeypatch):
    archive()(tmp_path)
    checked = archive_check.check_record(archive_check.verify(tmp_path / "a.tar.gz"))
    real = archive_check._write_members

    def disk_full_halfway(checked, dest, root):
        (root / "run").mkdir()
        (root / "run" / "run.json").write_text("{}")
        raise OSError(errno.ENOSPC, "No space left on device", str(root / "run/metrics.jsonl"))

    monkeypatch.setattr(archive_check, "_write_members", disk_full_halfway)
    dest = tmp_path / "new" / "x"
    with pytest.raises(
        repro.ReproduceRefused, match=r"metrics.jsonl: No space left on device; nothing"
    ):
        archive_check.extract(checked, dest)
    assert not (tmp_path / "new").exists(), "the folders made for it are gone too"
    kept = tmp_path / "kept"
    kept.mkdir()
    with pytest.raises(repro.ReproduceRefused):
        archive_check.extract(checked, kept)
    assert kept.is_dir() and not any(kept.iterdir()), "a given empty dir stays, empty"
    monkeypatch.setattr(archive_check, "_write_members", real)
    assert (archive_check.extract(checked, kept) / "run" / "run.json").is_file()  # control


def test_parse_bytes():
    assert safetar.parse_bytes("4G") == 4 << 30 and safetar.parse_bytes("512MiB") == 512 << 20
    assert safetar.parse_bytes("100") == 100
    with pytest.raises(ValueError):
        safetar.parse_bytes("lots")


def test_extraction_is_refused_up_front_when_the_disk_has_no_room(tmp_path, monkeypatch):
    archive()(tmp_path)
    checked = archive_check.check_record(archive_check.verify(tmp_path / "a.tar.gz"))
    real = archive_check.shutil.disk_usage
    monkeypatch.setattr(archive_check.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=10))  # fmt: skip
    with pytest.raises(repro.ReproduceRefused, match="has 10 B free; nothing extracted"):
        archive_check.extract(checked, tmp_path / "new")
    assert not (tmp_path / "new").exists()
