"""reprotrain.data.download: the generic fetch/check/unpack/unpickle a dataset module uses."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest

from reprotrain.data import download as dl
from reprotrain.errors import DataMissingError

TOP = "payload"
FILES = ["a.bin", "b.bin"]


def _archive(path: Path, members: dict[str, bytes], link: str | None = None) -> str:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        if link:
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tf.addfile(info)
    return hashlib.md5(path.read_bytes()).hexdigest()


def test_download_verifies_and_lands_atomically(tmp_path: Path) -> None:
    src = tmp_path / "src.tar.gz"
    md5 = _archive(src, {f"{TOP}/{n}": n.encode() for n in FILES})
    root = tmp_path / "data"
    final = root / "x.tar.gz"

    def not_found(why: str) -> DataMissingError:
        return DataMissingError(f"missing: {why}")

    with pytest.raises(DataMissingError, match="corrupt") as err:
        dl.download(src.as_uri(), final, "0" * 32, 5.0, not_found)
    assert "\n" not in str(err.value) and os.listdir(root) == []  # no partial file left
    with pytest.raises(DataMissingError, match="missing: "):
        dl.download((tmp_path / "absent").as_uri(), final, md5, 5.0, not_found)
    dl.download(src.as_uri(), final, md5, 5.0, not_found)
    assert final.read_bytes() == src.read_bytes() and os.listdir(root) == ["x.tar.gz"]
    dl.verify_md5(final, md5)
    with pytest.raises(DataMissingError, match="corrupt"):
        dl.verify_md5(final, "f" * 32)


def test_extract_dir_commits_by_rename_and_refuses_unsafe_members(tmp_path: Path) -> None:
    good = tmp_path / "good.tar.gz"
    _archive(good, {f"{TOP}/{n}": n.encode() for n in FILES})
    dl.extract_dir(good, tmp_path, TOP, FILES, "test archive")
    assert sorted(os.listdir(tmp_path / TOP)) == FILES
    assert not [p for p in os.listdir(tmp_path) if p.startswith(f".{TOP}-extract-")]

    for bad, members, link in (
        ("escape", {f"{TOP}/a.bin": b"a", "../evil": b"x"}, None),
        ("link", {f"{TOP}/a.bin": b"a"}, f"{TOP}/b.bin"),
    ):
        root = tmp_path / bad
        root.mkdir()
        archive = root / "bad.tar.gz"
        _archive(archive, members, link)
        with pytest.raises(DataMissingError, match="refusing to extract"):
            dl.extract_dir(archive, root, TOP, FILES, "test archive")
        assert os.listdir(root) == ["bad.tar.gz"]

    short = tmp_path / "short"
    short.mkdir()
    _archive(short / "s.tar.gz", {f"{TOP}/a.bin": b"a"})
    with pytest.raises(DataMissingError, match=r"lacks payload/b.bin; it is not the test archive"):
        dl.extract_dir(short / "s.tar.gz", short, TOP, FILES, "test archive")
    assert not (short / TOP).exists()


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_restricted_load_builds_arrays_and_refuses_any_other_global() -> None:
    arr = np.arange(6, dtype=np.uint8).reshape(2, 3)
    obj = dl.restricted_load(io.BytesIO(pickle.dumps({b"data": arr, b"labels": [1, 2]}, 2)))
    assert np.array_equal(obj[b"data"], arr) and obj[b"labels"] == [1, 2]
    with pytest.raises(dl.RefusedGlobal) as err:
        dl.restricted_load(io.BytesIO(pickle.dumps(_Evil(), 2)))
    assert err.value.qualname in ("posix.system", "nt.system", "os.system")
