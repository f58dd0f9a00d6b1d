"""CIFAR-10 from the official python archive, loaded into uint8 tensors without torchvision.

Why not ``torchvision.datasets.CIFAR10``: it unpickles with plain ``pickle.load`` (a batch
file from an untrusted mirror can run code), extracts with a bare ``extractall`` and can leave
a half-downloaded archive or half-extracted directory that looks complete after a crash. The
framework's :mod:`reprotrain.data.download` closes those holes (atomic download, md5, safe
extraction, allowlisted unpickling); this module names CIFAR-10's files, checks what its
batches hold and returns whole tensors in file order, which is what the device-resident
pipeline wants (order and augmentation are applied later by counter-based generators).

Flow of :func:`load_cifar10`:

1. ``root/cifar-10-batches-py/`` holds all six batch files -> parse them.
2. else ``root/cifar-10-python.tar.gz`` exists -> verify its md5, extract safely, parse.
3. else, if allowed, download to a temp file in ``root``, verify, rename into place, extract,
   parse.

Every failure a user can fix raises :class:`~reprotrain.errors.DataMissingError` with one line
that says what to do. The data drift control is :func:`cifar10_files` +
:func:`reprotrain.hashing.files_fingerprint`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from reprotrain.api import (
    DataMissingError,
    InMemoryImages,
    data_root,
    download_and_verify,
    files_fingerprint,
    load_pickle,
)

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

ARCHIVE_NAME = "cifar-10-python.tar.gz"
DEFAULT_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
# Published by the dataset authors; torchvision pins the same value.
DEFAULT_MD5 = "c58f30108f718f92721af3b95e74349a"
BATCHES_DIR = "cifar-10-batches-py"
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"

_WHAT = "CIFAR-10 python archive"  # named when an archive lacks a batch file
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
    download_and_verify(
        url, root, ARCHIVE_NAME, md5, top=BATCHES_DIR, required=[*TRAIN_BATCHES, TEST_BATCH],
        not_found=lambda why: _not_found(root, md5, why), what=_WHAT, download=download,
        timeout_s=timeout_s,
    )  # fmt: skip
    return _parse_batches(root)


def one_line(text: object) -> str:
    """``text`` as one line: its non-blank lines, stripped, joined by ``; ``."""
    return "; ".join(p.strip() for p in str(text).strip().splitlines() if p.strip())


def _not_found(root: Path, md5: str, reason: str) -> DataMissingError:
    why = one_line(reason) or "unknown error"
    return DataMissingError(
        f"CIFAR-10 not found in {root} and could not be downloaded ({why}); "
        f"put {ARCHIVE_NAME} (md5 {md5}) in {root}/ or try experiment=smoke for synthetic data"
    )


def _load_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Unpickle and validate one batch; return ``(data [n,3,32,32] uint8, labels [n] int64)``."""
    fix = f"delete {path.parent} to re-extract it from {ARCHIVE_NAME}"
    try:
        # latin1: the original batches are Python 2 pickles (numpy's documented choice).
        obj = load_pickle(path, encoding="latin1", fix=fix)
    except DataMissingError:
        raise  # a refused global, named
    except Exception as exc:  # any malformed pickle: truncated, wrong opcodes, bad state
        why = one_line(exc) or "unknown error"
        raise DataMissingError(
            f"cannot read CIFAR-10 batch {path} ({type(exc).__name__}: {why}); {fix}"
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
        self.root, self.download, self.url, self.md5 = data_root(root), download, url, md5

    def load_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return load_cifar10(self.root, url=self.url, md5=self.md5, download=self.download)

    def fingerprint(self) -> dict:
        files = cifar10_files(self.root)
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            return {"kind": "files", "sha256": None, "missing": missing}
        sha = files_fingerprint(files, cache_file=self.root / ".fingerprint-cache.json")
        return {"kind": "files", "sha256": sha, "files": sorted(p.name for p in files)}
