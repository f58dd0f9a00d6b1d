"""CIFAR-10 loader and dataset fingerprint: offline, on tiny fixtures in the real format.

The fixtures are written exactly like the official archive (protocol-2 pickles of dicts with
bytes keys and a uint8 ``(n, 3072)`` array, tarred under ``cifar-10-batches-py/``), so the
parsing, checksum, extraction and download paths run for real, just on 7 + 5 images.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import struct
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from reprotrain import hashing as fingerprint
from reprotrain.errors import DataMissingError
from reprotrain.hashing import files_fingerprint
from starter import cifar10
from starter.cifar10 import (
    ARCHIVE_NAME,
    BATCHES_DIR,
    cifar10_files,
    load_cifar10,
)

N_TRAIN_PER_BATCH = 7
N_TEST = 5
BATCH_NAMES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
# One marked pixel: image 0 of data_batch_1, channel G (1), row 5, column 9.
MARK_C, MARK_R, MARK_W, MARK_VALUE = 1, 5, 9, 200


def _batch_arrays(batch_index: int, n: int) -> tuple[np.ndarray, list[int]]:
    """Known pixels and labels for batch ``batch_index`` (0..5) in the on-disk row layout."""
    rng = np.random.default_rng(batch_index)
    data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
    labels = [(batch_index * 3 + i) % 10 for i in range(n)]
    if batch_index == 0:
        data[0] = 0
        data[0, MARK_C * 1024 + MARK_R * 32 + MARK_W] = MARK_VALUE
    return data, labels


def _batch_pickle(batch_index: int, n: int) -> bytes:
    data, labels = _batch_arrays(batch_index, n)
    name = BATCH_NAMES[batch_index]
    entry = {
        b"batch_label": f"{name} fixture".encode(),
        b"labels": labels,
        b"data": data,
        b"filenames": [f"img_{batch_index}_{i}.png".encode() for i in range(n)],
    }
    return pickle.dumps(entry, protocol=2)


def _batch_sizes() -> list[int]:
    return [N_TRAIN_PER_BATCH] * 5 + [N_TEST]


def write_batches(directory: Path) -> None:
    """Write the six batch files (plus batches.meta) into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    for i, (name, n) in enumerate(zip(BATCH_NAMES, _batch_sizes(), strict=True)):
        (directory / name).write_bytes(_batch_pickle(i, n))
    meta = {b"label_names": [b"airplane"] * 10, b"num_cases_per_batch": N_TRAIN_PER_BATCH}
    (directory / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))


def _add_bytes(tf: tarfile.TarFile, name: str, payload: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    info.mtime = 1_300_000_000
    tf.addfile(info, io.BytesIO(payload))


def write_archive(path: Path, extra: list[tarfile.TarInfo | tuple[str, bytes]] = ()) -> str:
    """Write a fixture ``cifar-10-python.tar.gz`` (plus ``extra`` members last); return md5."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tf:
        top = tarfile.TarInfo(BATCHES_DIR)
        top.type = tarfile.DIRTYPE
        top.mode = 0o755
        tf.addfile(top)
        for i, (name, n) in enumerate(zip(BATCH_NAMES, _batch_sizes(), strict=True)):
            _add_bytes(tf, f"{BATCHES_DIR}/{name}", _batch_pickle(i, n))
        _add_bytes(tf, f"{BATCHES_DIR}/readme.html", b"<html></html>")
        for member in extra:
            if isinstance(member, tarfile.TarInfo):
                tf.addfile(member)
            else:
                _add_bytes(tf, *member)
    return hashlib.md5(path.read_bytes()).hexdigest()


def _py2_batch_pickle(data: np.ndarray, labels: list[int]) -> bytes:
    """A batch pickled the way the *original* files were: by Python 2 with numpy 1.x.

    Python 3 cannot write that byte-for-byte (py2 ``str`` is the BINSTRING opcode and the
    array comes from ``numpy.core.multiarray``), so the opcodes are spelled out here.
    """

    def short(s: bytes) -> bytes:
        return b"U" + bytes([len(s)]) + s

    n = data.shape[0]
    out = b"\x80\x02}q\x00(" + short(b"data")
    out += b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85" + short(b"b")
    out += b"\x87R(K\x01M" + struct.pack("<H", n) + b"M" + struct.pack("<H", 3072) + b"\x86"
    out += b"cnumpy\ndtype\n" + short(b"u1") + b"K\x00K\x01\x87R(K\x03" + short(b"|")
    out += b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb\x89"
    out += b"T" + struct.pack("<i", data.nbytes) + data.tobytes() + b"tb"
    out += short(b"labels") + b"](" + b"".join(b"K" + bytes([y]) for y in labels) + b"e"
    out += short(b"batch_label") + short(b"training batch 1 of 5") + b"u."
    return out


def _all_paths(base: Path) -> set[str]:
    return {str(p.relative_to(base)) for p in base.rglob("*")}


def _assert_fixture_tensors(result: tuple[torch.Tensor, ...]) -> None:
    train_x, train_y, test_x, test_y = result
    assert train_x.shape == (5 * N_TRAIN_PER_BATCH, 3, 32, 32)
    assert test_x.shape == (N_TEST, 3, 32, 32)
    assert train_x.dtype == torch.uint8 and test_x.dtype == torch.uint8
    assert train_y.dtype == torch.int64 and test_y.dtype == torch.int64
    assert train_y.shape == (5 * N_TRAIN_PER_BATCH,) and test_y.shape == (N_TEST,)

    # Channel / row / column mapping: the only non-zero pixel of image 0 lands at (G, 5, 9).
    nz = torch.nonzero(train_x[0]).tolist()
    assert nz == [[MARK_C, MARK_R, MARK_W]]
    assert train_x[0, MARK_C, MARK_R, MARK_W].item() == MARK_VALUE

    # Every image equals its raw row reshaped plane by plane, batches in file order.
    expected_x = [_batch_arrays(i, n)[0] for i, n in enumerate(_batch_sizes())]
    expected_y = [_batch_arrays(i, n)[1] for i, n in enumerate(_batch_sizes())]
    raw_train = np.concatenate(expected_x[:5])
    assert np.array_equal(train_x.numpy(), raw_train.reshape(-1, 3, 32, 32))
    assert np.array_equal(test_x.numpy(), expected_x[5].reshape(-1, 3, 32, 32))
    # Spot check without reshape: image 8 (data_batch_2, row 1), B channel, row 31, col 0.
    assert train_x[8, 2, 31, 0].item() == expected_x[1][1, 2 * 1024 + 31 * 32 + 0]
    assert train_y.tolist() == [y for ys in expected_y[:5] for y in ys]
    assert test_y.tolist() == expected_y[5]


# ------------------------------------------------------------------------------------------
# Parsing and the archive path
# ------------------------------------------------------------------------------------------


def test_parse_extracted_dir(tmp_path: Path) -> None:
    write_batches(tmp_path / BATCHES_DIR)
    result = load_cifar10(tmp_path, download=False)
    _assert_fixture_tensors(result)
    assert cifar10_files(tmp_path) == [tmp_path / BATCHES_DIR / n for n in BATCH_NAMES]


def test_parse_python2_pickles(tmp_path: Path) -> None:
    """The real batches are Python 2 pickles (str keys, numpy.core): they must load too."""
    batches = tmp_path / BATCHES_DIR
    write_batches(batches)
    for i, n in enumerate(_batch_sizes()):
        data, labels = _batch_arrays(i, n)
        (batches / BATCH_NAMES[i]).write_bytes(_py2_batch_pickle(data, labels))
    assert pickle.loads((batches / "data_batch_1").read_bytes(), encoding="latin1")["labels"]
    _assert_fixture_tensors(load_cifar10(tmp_path, download=False))


def test_archive_is_verified_and_extracted(tmp_path: Path) -> None:
    md5 = write_archive(tmp_path / ARCHIVE_NAME)
    result = load_cifar10(tmp_path, md5=md5, download=False)
    _assert_fixture_tensors(result)
    assert all(p.is_file() for p in cifar10_files(tmp_path))
    # Nothing but the archive and the final directory: no temp dirs left behind.
    assert {p.name for p in tmp_path.iterdir()} == {ARCHIVE_NAME, BATCHES_DIR}
    # Second call parses the extracted dir (archive no longer needed).
    (tmp_path / ARCHIVE_NAME).unlink()
    _assert_fixture_tensors(load_cifar10(tmp_path, download=False))


def test_incomplete_dir_is_replaced_from_archive(tmp_path: Path) -> None:
    md5 = write_archive(tmp_path / ARCHIVE_NAME)
    partial = tmp_path / BATCHES_DIR
    partial.mkdir()
    (partial / "data_batch_1").write_bytes(b"truncated")
    _assert_fixture_tensors(load_cifar10(tmp_path, md5=md5, download=False))
    assert {p.name for p in tmp_path.iterdir()} == {ARCHIVE_NAME, BATCHES_DIR}


def test_wrong_md5_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    archive = tmp_path / ARCHIVE_NAME
    actual = write_archive(archive)
    expected = "0" * 32

    def no_parse(root: Path) -> None:
        raise AssertionError("parsed a corrupt archive")

    monkeypatch.setattr(cifar10, "_parse_batches", no_parse)
    with pytest.raises(DataMissingError) as err:
        load_cifar10(tmp_path, md5=expected, download=True)
    msg = str(err.value)
    assert str(archive) in msg and expected in msg and actual in msg
    assert "corrupt" in msg and "\n" not in msg
    # Not extracted, not deleted (the user decides), nothing else written.
    assert {p.name for p in tmp_path.iterdir()} == {ARCHIVE_NAME}


def test_default_md5_is_the_published_one() -> None:
    assert cifar10.DEFAULT_MD5 == "c58f30108f718f92721af3b95e74349a"
    assert cifar10.DEFAULT_URL.endswith("/" + ARCHIVE_NAME)


# ------------------------------------------------------------------------------------------
# Download
# ------------------------------------------------------------------------------------------


def test_download_from_file_url(tmp_path: Path) -> None:
    src = tmp_path / "mirror" / ARCHIVE_NAME
    md5 = write_archive(src)
    root = tmp_path / "data"
    result = load_cifar10(root, url=src.as_uri(), md5=md5, timeout_s=5)
    _assert_fixture_tensors(result)
    assert (root / ARCHIVE_NAME).read_bytes() == src.read_bytes()
    assert {p.name for p in root.iterdir()} == {ARCHIVE_NAME, BATCHES_DIR}


def test_download_with_wrong_md5_leaves_nothing(tmp_path: Path) -> None:
    src = tmp_path / "mirror" / ARCHIVE_NAME
    write_archive(src)
    root = tmp_path / "data"
    with pytest.raises(DataMissingError, match="corrupt") as err:
        load_cifar10(root, url=src.as_uri(), md5="f" * 32)
    assert "\n" not in str(err.value)
    assert list(root.iterdir()) == []  # no partial archive under any name


def test_unreachable_url_fails_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    root = tmp_path / "data"
    with pytest.raises(DataMissingError) as err:
        load_cifar10(root, url="http://127.0.0.1:9/x.tar.gz", timeout_s=5)
    msg = str(err.value)
    assert "\n" not in msg
    assert "experiment=smoke" in msg and str(root) in msg and cifar10.DEFAULT_MD5 in msg
    assert msg.startswith(f"CIFAR-10 not found in {root} and could not be downloaded (")
    assert list(root.iterdir()) == []


def test_download_disabled_and_no_files(tmp_path: Path) -> None:
    with pytest.raises(DataMissingError, match="experiment=smoke") as err:
        load_cifar10(tmp_path / "nothing", download=False)
    assert "download disabled" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "nothing").exists()


# ------------------------------------------------------------------------------------------
# Unsafe inputs
# ------------------------------------------------------------------------------------------


class _SystemCall:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[override]
        return (os.system, (f"touch {self.marker}",))


class _EvalCall:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[override]
        return (eval, (f"open({str(self.marker)!r}, 'w').close()",))


@pytest.mark.parametrize("payload", [_SystemCall, _EvalCall], ids=["os.system", "eval"])
def test_malicious_pickle_is_refused_without_running(tmp_path: Path, payload: type) -> None:
    batches = tmp_path / BATCHES_DIR
    write_batches(batches)
    marker = tmp_path / "pwned"
    evil = {b"labels": [0], b"data": np.zeros((1, 3072), np.uint8), b"x": payload(marker)}
    (batches / "data_batch_3").write_bytes(pickle.dumps(evil, protocol=2))
    with pytest.raises(DataMissingError, match="refusing to load") as err:
        load_cifar10(tmp_path, download=False)
    msg = str(err.value)
    assert "data_batch_3" in msg and ("system" in msg or "eval" in msg)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        ({b"labels": [0, 1], b"data": np.zeros((2, 3071), np.uint8)}, "shape"),
        ({b"labels": [0, 10], b"data": np.zeros((2, 3072), np.uint8)}, "labels"),
        ({b"labels": [0], b"data": np.zeros((2, 3072), np.uint8)}, "2 images but 1 labels"),
        ({b"labels": [0], b"data": np.zeros((1, 3072), np.float32)}, "uint8"),
        ({b"labels": [0]}, "keys"),
        ([1, 2, 3], "expected dict"),
    ],
    ids=["row-size", "label-range", "length", "dtype", "keys", "not-dict"],
)
def test_malformed_batch_is_refused(tmp_path: Path, entry: object, needle: str) -> None:
    batches = tmp_path / BATCHES_DIR
    write_batches(batches)
    (batches / "test_batch").write_bytes(pickle.dumps(entry, protocol=2))
    with pytest.raises(DataMissingError, match="test_batch") as err:
        load_cifar10(tmp_path, download=False)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_truncated_batch_is_refused(tmp_path: Path) -> None:
    batches = tmp_path / BATCHES_DIR
    write_batches(batches)
    good = (batches / "data_batch_5").read_bytes()
    (batches / "data_batch_5").write_bytes(good[: len(good) // 2])
    with pytest.raises(DataMissingError, match=r"cannot read CIFAR-10 batch .*data_batch_5"):
        load_cifar10(tmp_path, download=False)


def _symlink(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.SYMTYPE
    info.linkname = target
    return info


def _device(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.CHRTYPE
    info.devmajor, info.devminor = 1, 3
    return info


@pytest.mark.parametrize(
    "kind", ["dotdot", "absolute", "symlink", "hardlink", "device", "outside-dir"]
)
def test_unsafe_archive_is_refused(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    outside.mkdir()
    extra: list[tarfile.TarInfo | tuple[str, bytes]]
    if kind == "dotdot":
        extra = [(f"{BATCHES_DIR}/../../outside/evil", b"x"), ("../evil", b"x")]
    elif kind == "absolute":
        extra = [(str(outside / "evil_abs"), b"x")]
    elif kind == "symlink":
        # The classic two-step: a link to outside, then a file written through it.
        extra = [_symlink(f"{BATCHES_DIR}/link", str(outside)), (f"{BATCHES_DIR}/link/evil", b"x")]
    elif kind == "hardlink":
        link = tarfile.TarInfo(f"{BATCHES_DIR}/hard")
        link.type = tarfile.LNKTYPE
        link.linkname = "/etc/passwd"
        extra = [link]
    elif kind == "device":
        extra = [_device(f"{BATCHES_DIR}/null")]
    else:
        extra = [("elsewhere/evil", b"x")]
    md5 = write_archive(root / ARCHIVE_NAME, extra)
    with tarfile.open(root / ARCHIVE_NAME) as tf:  # the fixture really holds the bad member
        names = [m.name for m in tf.getmembers()]
        assert len(names) == 1 + 6 + 1 + len(extra)
        if kind == "absolute":
            assert names[-1] == str(outside / "evil_abs")

    with pytest.raises(DataMissingError, match="refusing to extract") as err:
        load_cifar10(root, md5=md5, download=False)
    assert "\n" not in str(err.value)
    # Nothing written anywhere: not outside root, and inside root only the archive.
    assert _all_paths(tmp_path) == {"root", f"root/{ARCHIVE_NAME}", "outside"}


def test_archive_without_batches_is_refused(tmp_path: Path) -> None:
    archive = tmp_path / ARCHIVE_NAME
    with tarfile.open(archive, "w:gz") as tf:
        _add_bytes(tf, f"{BATCHES_DIR}/data_batch_1", _batch_pickle(0, 3))
    md5 = hashlib.md5(archive.read_bytes()).hexdigest()
    with pytest.raises(DataMissingError, match="lacks"):
        load_cifar10(tmp_path, md5=md5, download=False)
    assert {p.name for p in tmp_path.iterdir()} == {ARCHIVE_NAME}


# ------------------------------------------------------------------------------------------
# files_fingerprint
# ------------------------------------------------------------------------------------------


def _old_files(directory: Path, n: int = 3) -> list[Path]:
    """Files with an mtime well in the past, so the cache treats them as stable."""
    directory.mkdir(parents=True, exist_ok=True)
    past = time.time_ns() - 3600 * 10**9
    paths = []
    for i in range(n):
        p = directory / f"file_{i}.bin"
        p.write_bytes(bytes(range(i, i + 64)))
        os.utime(p, ns=(past, past))
        paths.append(p)
    return paths


def test_fingerprint_changes_with_one_byte(tmp_path: Path) -> None:
    paths = _old_files(tmp_path)
    cache = tmp_path / "cache.json"
    before = files_fingerprint(paths, cache)
    assert before == files_fingerprint(paths)
    st = paths[1].stat()
    data = bytearray(paths[1].read_bytes())
    data[10] ^= 1
    paths[1].write_bytes(bytes(data))
    os.utime(paths[1], ns=(st.st_atime_ns, st.st_mtime_ns + 1000))  # same size, new mtime
    after = files_fingerprint(paths, cache)
    assert after != before
    assert after == files_fingerprint(paths)  # the cached result matches a fresh hash


def test_fingerprint_order_and_location_independent(tmp_path: Path) -> None:
    a = _old_files(tmp_path / "a")
    b = _old_files(tmp_path / "b")
    assert files_fingerprint(a) == files_fingerprint(list(reversed(a)))
    assert files_fingerprint(a) == files_fingerprint(b)
    assert files_fingerprint(a) != files_fingerprint(a[:2])
    a[0].rename(a[0].with_name("renamed.bin"))
    assert files_fingerprint([a[0].with_name("renamed.bin"), *a[1:]]) != files_fingerprint(b)


def test_fingerprint_uses_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = _old_files(tmp_path / "d")
    cache = tmp_path / "cache" / "fingerprints.json"
    hashed: list[Path] = []
    real = fingerprint.file_sha256

    def counting(path: Path) -> str:
        hashed.append(path)
        return real(path)

    monkeypatch.setattr(fingerprint, "file_sha256", counting)
    first = files_fingerprint(paths, cache)
    assert len(hashed) == 3
    content = json.loads(cache.read_text())
    entries = content["entries"]
    assert set(entries) == {str(p.resolve()) for p in paths}
    for p in paths:
        e = entries[str(p.resolve())]
        st = p.stat()
        assert (e["size"], e["mtime_ns"]) == (st.st_size, st.st_mtime_ns)
        assert e["sha256"] == hashlib.sha256(p.read_bytes()).hexdigest()

    hashed.clear()
    assert files_fingerprint(list(reversed(paths)), cache) == first
    assert hashed == []  # nothing re-hashed
    assert not list(cache.parent.glob("*.tmp"))  # atomic write left no temp file

    # A corrupt cache is ignored (and rewritten), never fatal.
    cache.write_text("{not json")
    assert files_fingerprint(paths, cache) == first
    assert len(hashed) == 3
    assert json.loads(cache.read_text())["version"] == 1


def test_fingerprint_does_not_cache_racy_files(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh.bin"
    fresh.write_bytes(b"just written")
    cache = tmp_path / "cache.json"
    files_fingerprint([fresh], cache)
    entries = json.loads(cache.read_text())["entries"] if cache.exists() else {}
    assert str(fresh.resolve()) not in entries


def test_fingerprint_of_loaded_dataset(tmp_path: Path) -> None:
    write_batches(tmp_path / BATCHES_DIR)
    load_cifar10(tmp_path, download=False)
    files = cifar10_files(tmp_path)
    assert len(files) == 6
    assert len(files_fingerprint(files, tmp_path / "fp.json")) == 64
