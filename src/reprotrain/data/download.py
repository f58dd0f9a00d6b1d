"""Where a dataset's files live; fetch, check and unpack its archive without trusting it;
read its pickles safely. Names no dataset (docs/bring-your-own.md).

Closes: a half-downloaded file that looks complete, a tampered archive, members outside the
directory or links, a pickle that runs code. Each fixable failure is one ``DataMissingError``.
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
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import IO, Any

import numpy as np

from reprotrain import REPO_ROOT
from reprotrain.errors import DataMissingError, one_line
from reprotrain.progress import Progress
from reprotrain.safetar import unsafe_reason

log = logging.getLogger(__name__)
_CHUNK = 1 << 20


def data_root(root: str | Path) -> Path:
    """Relative roots resolve against the repository, not the (per-run) working directory."""
    root = Path(root)
    return root if root.is_absolute() else REPO_ROOT / root


def verify_md5(archive: Path, md5: str) -> None:
    """Refuse an archive whose md5 differs (the user decides: delete or replace it)."""
    with open(archive, "rb") as f:  # md5: the published integrity check, not security
        got = hashlib.file_digest(f, lambda: hashlib.md5(usedforsecurity=False)).hexdigest()
    if got != md5.lower():
        raise DataMissingError(
            f"the file at {archive} is corrupt (expected md5 {md5}, got {got}); "
            f"delete it to re-download or replace it with a good copy of {archive.name}"
        )


def _download_progress(name: str, response: Any) -> Progress:
    """Bytes of ``Content-Length``: a bar on a terminal, else a log line per tenth."""
    length = response.headers.get("Content-Length") if response.headers else None
    total = int(length) if length and str(length).isdigit() else None
    return Progress(f"download {name}", total, in_bytes=True, emit=log.info)


def download(
    url: str, final: Path, md5: str, timeout_s: float, not_found: Callable[[str], DataMissingError]
) -> None:
    """Download ``url`` to ``final`` or raise ``not_found(reason)``: streamed through the md5
    to a temp file beside it, renamed only when verified. ``timeout_s``: per socket call."""
    root = final.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=root, prefix=f".{final.name}.", suffix=".part")
    except OSError as exc:
        raise not_found(f"cannot write to {root}: {exc}") from exc
    tmp = Path(tmp_name)
    try:
        digest = hashlib.md5(usedforsecurity=False)
        try:
            log.info("downloading %s to %s", url, final)
            with (
                os.fdopen(fd, "wb") as out,
                urllib.request.urlopen(url, timeout=timeout_s) as r,
                _download_progress(final.name, r) as progress,
            ):
                for chunk in iter(lambda: r.read(_CHUNK), b""):
                    digest.update(chunk)
                    out.write(chunk)
                    progress.update(len(chunk))
        except (OSError, http.client.HTTPException, ValueError) as exc:
            # OSError: URLError, HTTPError, timeouts, disk; ValueError: a malformed URL
            raise not_found(f"{url}: {exc}") from exc
        got = digest.hexdigest()
        if got != md5.lower():
            raise DataMissingError(
                f"the file downloaded from {url} is corrupt (expected md5 {md5}, got {got}) "
                f"and was deleted; retry, or put a good {final.name} in {root}/"
            )
        os.replace(tmp, final)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _complete(directory: Path, required: Iterable[str]) -> bool:
    return all((directory / name).is_file() for name in required)


def _checked_members(tf: tarfile.TarFile, archive: Path, top: str) -> list[tarfile.TarInfo]:
    """Every member a directory or regular file under ``top/``; anything else (absolute,
    ``..``, a link, a device) refuses the whole archive before a byte is written."""
    members = []
    for m in tf.getmembers():
        parts = PurePosixPath(m.name).parts
        bad = unsafe_reason(m)
        if bad is None and m.isdir() and parts in ((), (".",)):
            continue
        if bad is None and parts[0] != top:
            bad = f"outside {top}/"
        if bad:
            raise DataMissingError(
                f"refusing to extract {archive}: member {m.name!r} is unsafe ({bad}); "
                f"delete it and use the official {archive.name}"
            )
        members.append(m)
    return members


def extract_dir(archive: Path, root: Path, top: str, required: list[str], what: str) -> None:
    """Extract ``archive`` (a .tar.gz holding ``top/``) so that ``root/top`` holds ``required``:
    into a temp dir, then one rename (the commit point). ``what`` names a wrong archive."""
    target = root / top
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{top}-extract-"))
    try:
        try:
            with tarfile.open(archive, "r:gz") as tf:
                members = _checked_members(tf, archive, top)
                tf.extractall(tmp, members=members, filter="data")  # Python >= 3.11.4
        except (tarfile.TarError, EOFError, OSError) as exc:
            why = one_line(exc) or "unknown error"
            raise DataMissingError(
                f"cannot extract {archive} ({why}); delete it and re-download"
            ) from exc
        staged = tmp / top
        if missing := [n for n in required if not (staged / n).is_file()]:
            raise DataMissingError(
                f"{archive} lacks {top}/{', '.join(missing)}; it is not the {what}, "
                f"delete it and put the official {archive.name} in {root}/"
            )
        if target.exists() and not _complete(target, required):
            # A partial copy left by hand, superseded: into our temp dir (removed below).
            os.replace(target, tmp / "stale")
        try:
            os.rename(staged, target)
        except OSError:
            # Another process (a parallel sweep) won the race; fine if its copy is complete.
            if not _complete(target, required):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _latin1_encode(obj: str, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    """``codecs.encode`` for latin1 only: how protocol-2 pickles store ``bytes``."""
    if not isinstance(obj, str) or encoding.lower().replace("-", "") != "latin1":
        raise pickle.UnpicklingError(f"codecs.encode({type(obj).__name__}, {encoding!r})")
    return obj.encode("latin1", errors)


def _numpy_reconstruct() -> Any:
    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


# What a pickled numpy array (and the bytes in a protocol-2 pickle) needs, and nothing else.
NUMPY_ARRAY_GLOBALS: Mapping[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _numpy_reconstruct(),
    ("numpy._core.multiarray", "_reconstruct"): _numpy_reconstruct(),
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_encode,
    ("codecs", "encode"): _latin1_encode,
}


class RefusedGlobal(pickle.UnpicklingError):
    """The pickle asked for a global outside the allowlist (``qualname`` says which)."""

    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.qualname = f"{module}.{name}"


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the allowlisted globals: ``find_class`` is a pickle's only way to reach
    a callable, so ``os.system`` via ``__reduce__`` is refused before it is looked up."""

    def __init__(self, f: IO[bytes], allowed: Mapping[tuple[str, str], Any], **kw: Any) -> None:
        super().__init__(f, **kw)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise RefusedGlobal(module, name) from None


def restricted_load(
    f: IO[bytes],
    allowed: Mapping[tuple[str, str], Any] = NUMPY_ARRAY_GLOBALS,
    encoding: str = "ASCII",
) -> Any:
    """Unpickle ``f`` resolving only ``allowed`` globals; raises :class:`RefusedGlobal`."""
    return _RestrictedUnpickler(f, allowed, encoding=encoding).load()


_download = download  # the helper's ``download`` argument is the yes/no


def download_and_verify(
    url: str,
    root: str | Path,
    archive_name: str,
    md5: str,
    *,
    top: str,
    required: list[str],
    not_found: Callable[[str], DataMissingError],
    what: str = "expected archive",
    download: bool = True,
    timeout_s: float = 30.0,
) -> Path:
    """``root/top`` holding every file in ``required``, fetched if it does not yet: an archive
    at ``root/archive_name`` is md5-checked, else downloaded (when ``download``), then
    extracted safely. ``not_found(reason)``: the error for data absent and not fetchable."""
    root = Path(root)
    target = root / top
    if _complete(target, required):
        return target
    archive = root / archive_name
    if archive.is_file():
        verify_md5(archive, md5)
    elif download:
        _download(url, archive, md5, timeout_s, not_found)
    else:
        raise not_found("download disabled")
    extract_dir(archive, root, top, required, what)
    return target


def load_pickle(
    path: Path,
    *,
    encoding: str = "ASCII",
    allowed: Mapping[tuple[str, str], Any] = NUMPY_ARRAY_GLOBALS,
    fix: str = "",
) -> Any:
    """Unpickle ``path`` resolving only ``allowed`` globals (numpy arrays by default); any
    other is refused in one line (``fix``: what to do). Other failures raise as they are."""
    try:
        with open(path, "rb") as f:
            return restricted_load(f, allowed, encoding=encoding)
    except RefusedGlobal as exc:
        raise DataMissingError(
            f"refusing to load {path}: its pickle references {exc.qualname}, which this file "
            f"never needs (it may be malicious){'; ' + fix if fix else ''}"
        ) from None
