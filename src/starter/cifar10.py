"""CIFAR-10 from the official python archive, loaded into uint8 tensors without torchvision.

Why not ``torchvision.datasets.CIFAR10``: it unpickles with plain ``pickle.load`` (a batch
file from an untrusted mirror can run code), extracts with a bare ``extractall`` and can leave
a half-downloaded archive or half-extracted directory that looks complete after a crash. This
module closes those holes and returns whole tensors in file order, which is what the
device-resident pipeline wants (order and augmentation are applied later by counter-based
generators, never here).

Flow of :func:`load_cifar10`:

1. ``root/cifar-10-batches-py/`` holds all six batch files -> parse them.
2. else ``root/cifar-10-python.tar.gz`` exists -> verify its md5, extract safely, parse.
3. else, if allowed, download to a temp file in ``root``, verify, rename into place, extract,
   parse.

Every failure a user can fix raises :class:`~reprotrain.errors.DataMissingError` with one line
that says what to do. The data drift control is :func:`cifar10_files` +
:func:`reprotrain.data.file_hashes.files_fingerprint`.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import logging
import os
import pickle
import shutil
import tarfile
import tempfile
import urllib.request
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch

from reprotrain.data.base import InMemoryImages
from reprotrain.errors import DataMissingError
from reprotrain.safetar import unsafe_reason

__all__ = [
    "ARCHIVE_NAME",
    "BATCHES_DIR",
    "DEFAULT_MD5",
    "DEFAULT_URL",
    "TEST_BATCH",
    "TRAIN_BATCHES",
    "cifar10_files",
    "load_cifar10",
]

log = logging.getLogger(__name__)

ARCHIVE_NAME = "cifar-10-python.tar.gz"
DEFAULT_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
# Published by the dataset authors; torchvision pins the same value.
DEFAULT_MD5 = "c58f30108f718f92721af3b95e74349a"
BATCHES_DIR = "cifar-10-batches-py"
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"

_CHUNK = 1 << 20
_ROW_BYTES = 3 * 32 * 32
_NUM_CLASSES = 10


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def cifar10_files(root: str | Path) -> list[Path]:
    """The six batch files (train 1..5, then test) under ``root``, in load order.

    Exposed so the trainer can fingerprint exactly the bytes it trained on (data drift).
    """
    batches = Path(root) / BATCHES_DIR
    return [batches / name for name in (*TRAIN_BATCHES, TEST_BATCH)]


def load_cifar10(
    root: str | Path,
    url: str = DEFAULT_URL,
    md5: str = DEFAULT_MD5,
    download: bool = True,
    timeout_s: float = 30.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(train_x, train_y, test_x, test_y)``, fetching the archive if needed.

    ``*_x`` are uint8 ``[N, 3, 32, 32]`` (channels R, G, B), ``*_y`` int64 ``[N]``, both in
    file order (data_batch_1..5 concatenated, then test_batch): no shuffling happens here so
    the data stream's randomness stays in the named ``data`` seed.

    ``md5`` guards both an archive found on disk and a download; ``timeout_s`` is the socket
    timeout of the download (per blocking operation, so a stalled server fails instead of
    hanging a job forever). Raises :class:`DataMissingError` with one actionable line when
    the data is absent and cannot be fetched, corrupt, or unsafe.
    """
    root = Path(root)
    if not _batches_complete(root / BATCHES_DIR):
        archive = root / ARCHIVE_NAME
        if archive.is_file():
            _verify_md5(archive, md5)
        elif download:
            _download(url, root, md5, timeout_s)
        else:
            raise _not_found(root, md5, "download disabled")
        _extract(archive, root)
    return _parse_batches(root)


# --------------------------------------------------------------------------------------------
# Fetching
# --------------------------------------------------------------------------------------------


def _batches_complete(batches: Path) -> bool:
    return all((batches / name).is_file() for name in (*TRAIN_BATCHES, TEST_BATCH))


def _one_line(text: object) -> str:
    """Collapse an exception's text to one line: the error contract is one line."""
    return " ".join(str(text).split()) or "unknown error"


def _not_found(root: Path, md5: str, reason: str) -> DataMissingError:
    return DataMissingError(
        f"CIFAR-10 not found in {root} and could not be downloaded ({_one_line(reason)}); "
        f"put {ARCHIVE_NAME} (md5 {md5}) in {root}/ or try experiment=smoke for synthetic data"
    )


def _md5_of(path: Path) -> str:
    with open(path, "rb") as f:  # md5: the published integrity check, not security
        return hashlib.file_digest(f, lambda: hashlib.md5(usedforsecurity=False)).hexdigest()


def _verify_md5(archive: Path, md5: str) -> None:
    """Refuse an archive whose md5 differs: a truncated or tampered file must never be
    extracted, and the user must decide whether to delete or replace it."""
    got = _md5_of(archive)
    if got != md5.lower():
        raise DataMissingError(
            f"the file at {archive} is corrupt (expected md5 {md5}, got {got}); "
            f"delete it to re-download or replace it with a good copy of {ARCHIVE_NAME}"
        )


def _download(url: str, root: Path, md5: str, timeout_s: float) -> None:
    """Download ``url`` to ``root/ARCHIVE_NAME``, atomically.

    Bytes go to a temp file in ``root`` (same filesystem, so the final rename is atomic) and
    the md5 is computed while streaming; only a verified file is renamed to the final name,
    so an interrupted or corrupt download never looks like a valid archive on the next run.
    """
    final = root / ARCHIVE_NAME
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=root, prefix=f".{ARCHIVE_NAME}.", suffix=".part")
    except OSError as exc:
        raise _not_found(root, md5, f"cannot write to {root}: {exc}") from exc
    tmp = Path(tmp_name)
    try:
        digest = hashlib.md5(usedforsecurity=False)
        try:
            log.info("downloading CIFAR-10 from %s to %s", url, final)
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout_s) as r:
                for chunk in iter(lambda: r.read(_CHUNK), b""):
                    digest.update(chunk)
                    out.write(chunk)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            # URLError, HTTPError, socket timeouts and disk errors are all OSError; a
            # malformed URL is a ValueError; a truncated HTTP body is an HTTPException.
            raise _not_found(root, md5, f"{url}: {exc}") from exc
        got = digest.hexdigest()
        if got != md5.lower():
            raise DataMissingError(
                f"the file downloaded from {url} is corrupt (expected md5 {md5}, got {got}) "
                f"and was deleted; retry, or put a good {ARCHIVE_NAME} in {root}/"
            )
        os.replace(tmp, final)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


# --------------------------------------------------------------------------------------------
# Safe extraction
# --------------------------------------------------------------------------------------------


def _checked_members(tf: tarfile.TarFile, archive: Path) -> list[tarfile.TarInfo]:
    """Every member must be a directory or regular file under ``cifar-10-batches-py/``.

    Anything else (absolute path, ``..``, symlink, hard link, device, fifo) refuses the whole
    archive before a single byte is written: a mirror or a hand-made archive must not be able
    to write outside ``root`` or plant links that later reads would follow.
    """
    members = []
    for m in tf.getmembers():
        name = m.name
        parts = PurePosixPath(name).parts
        bad = unsafe_reason(m)
        if bad is None and m.isdir() and parts in ((), (".",)):
            continue
        if bad is None and parts[0] != BATCHES_DIR:
            bad = f"outside {BATCHES_DIR}/"
        if bad:
            raise DataMissingError(
                f"refusing to extract {archive}: member {name!r} is unsafe ({bad}); "
                f"delete it and use the official {ARCHIVE_NAME}"
            )
        members.append(m)
    return members


def _extract(archive: Path, root: Path) -> None:
    """Extract into a temp dir in ``root``, then rename the batches dir into place.

    The rename is the commit point: a crash mid-extraction leaves only a ``.cifar-10-extract-*``
    temp dir, never a ``cifar-10-batches-py/`` that looks complete but is not.
    """
    target = root / BATCHES_DIR
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".cifar-10-extract-"))
    try:
        try:
            with tarfile.open(archive, "r:gz") as tf:
                members = _checked_members(tf, archive)
                tf.extractall(tmp, members=members, filter="data")  # Python >= 3.11.4
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise DataMissingError(
                f"cannot extract {archive} ({_one_line(exc)}); delete it and re-download"
            ) from exc
        staged = tmp / BATCHES_DIR
        if not _batches_complete(staged):
            missing = [n for n in (*TRAIN_BATCHES, TEST_BATCH) if not (staged / n).is_file()]
            raise DataMissingError(
                f"{archive} lacks {BATCHES_DIR}/{', '.join(missing)}; it is not the CIFAR-10 "
                f"python archive, delete it and put the official {ARCHIVE_NAME} in {root}/"
            )
        if target.exists() and not _batches_complete(target):
            # A partial copy left by hand; the verified archive supersedes it. Move it into
            # our temp dir (removed below) rather than deleting it in place.
            os.replace(target, tmp / "stale")
        try:
            os.rename(staged, target)
        except OSError:
            # Another process (a parallel sweep) won the race; fine if its copy is complete.
            if not _batches_complete(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Restricted unpickling and parsing
# --------------------------------------------------------------------------------------------


def _latin1_encode(obj: str, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    """Stand-in for ``codecs.encode``: protocol-2 pickles from Python 3 store ``bytes`` as
    ``_codecs.encode(text, 'latin1')``; no other codec (zlib, base64, ...) is needed."""
    if not isinstance(obj, str) or encoding.lower().replace("-", "") != "latin1":
        raise pickle.UnpicklingError(f"codecs.encode({type(obj).__name__}, {encoding!r})")
    return obj.encode("latin1", errors)


def _numpy_reconstruct() -> Any:
    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _numpy_reconstruct(),
    ("numpy._core.multiarray", "_reconstruct"): _numpy_reconstruct(),
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_encode,
    ("codecs", "encode"): _latin1_encode,
}


class _RefusedGlobal(pickle.UnpicklingError):
    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.qualname = f"{module}.{name}"


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the globals a pickled uint8 numpy array needs.

    A pickle is a program: ``find_class`` is the only way it can reach callables, so an
    allowlist here means a batch file can build a dict of lists and arrays and nothing else
    (``os.system`` via ``__reduce__`` is refused before it is even looked up).
    """

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise _RefusedGlobal(module, name) from None


def _load_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Unpickle and validate one batch; return ``(data [n,3,32,32] uint8, labels [n] int64)``."""
    fix = f"delete {path.parent} to re-extract it from {ARCHIVE_NAME}"
    try:
        with open(path, "rb") as f:
            # latin1: the original batches are Python 2 pickles (numpy's documented choice).
            obj = _RestrictedUnpickler(f, encoding="latin1").load()
    except _RefusedGlobal as exc:
        raise DataMissingError(
            f"refusing to load {path}: its pickle references {exc.qualname}, which a CIFAR-10 "
            f"batch never needs (the file may be malicious); {fix}"
        ) from None
    except Exception as exc:  # any malformed pickle: truncated, wrong opcodes, bad state
        raise DataMissingError(
            f"cannot read CIFAR-10 batch {path} ({type(exc).__name__}: {_one_line(exc)}); {fix}"
        ) from exc

    def bad(what: str) -> DataMissingError:
        return DataMissingError(f"CIFAR-10 batch {path} is malformed ({what}); {fix}")

    if not isinstance(obj, dict):
        raise bad(f"top level is {type(obj).__name__}, expected dict")
    # Python 2 str keys load as str with latin1, Python 3 bytes keys stay bytes: accept both.
    entry = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in obj.items()}
    if "data" not in entry or "labels" not in entry:
        raise bad(f"keys {sorted(map(str, entry))}, expected 'data' and 'labels'")
    data, labels = entry["data"], entry["labels"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
        raise bad(f"data is {type(data).__name__}/{getattr(data, 'dtype', None)}, expected uint8")
    if data.ndim != 2 or data.shape[1] != _ROW_BYTES:
        raise bad(f"data shape {tuple(data.shape)}, expected (n, {_ROW_BYTES})")
    if not isinstance(labels, list | tuple) or not all(
        type(y) is int and 0 <= y < _NUM_CLASSES for y in labels
    ):
        raise bad(f"labels must be a list of ints in 0..{_NUM_CLASSES - 1}")
    if len(labels) != data.shape[0]:
        raise bad(f"{data.shape[0]} images but {len(labels)} labels")
    # Row layout: 1024 R, then 1024 G, then 1024 B, each a row-major 32x32 plane.
    images = np.ascontiguousarray(data.reshape(-1, 3, 32, 32))
    return images, np.asarray(labels, dtype=np.int64).reshape(-1)


def _parse_batches(root: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    files = cifar10_files(root)
    train = [_load_batch(p) for p in files[:-1]]
    test_x, test_y = _load_batch(files[-1])
    train_x = np.concatenate([x for x, _ in train])
    train_y = np.concatenate([y for _, y in train])
    return (
        torch.from_numpy(train_x),
        torch.from_numpy(train_y),
        torch.from_numpy(test_x),
        torch.from_numpy(test_y),
    )


class CIFAR10(InMemoryImages):
    """CIFAR-10 as a config ``_target_`` (see conf/dataset/cifar10.yaml).

    ``root`` is relative to the repository unless absolute; the archive is downloaded and
    md5-checked there when missing.
    """

    num_classes = _NUM_CLASSES

    def __init__(
        self,
        root: str = "data",
        download: bool = True,
        url: str = DEFAULT_URL,
        md5: str = DEFAULT_MD5,
        **common: Any,
    ) -> None:
        super().__init__(**common)
        from reprotrain.data.datasets import data_root

        self.root, self.download, self.url, self.md5 = data_root(root), download, url, md5

    def load_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return load_cifar10(self.root, url=self.url, md5=self.md5, download=self.download)

    def fingerprint(self) -> dict:
        from reprotrain.data.file_hashes import files_fingerprint

        files = cifar10_files(self.root)
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            return {"kind": "files", "sha256": None, "missing": missing}
        sha = files_fingerprint(files, cache_file=self.root / ".fingerprint-cache.json")
        return {"kind": "files", "sha256": sha, "files": sorted(p.name for p in files)}
