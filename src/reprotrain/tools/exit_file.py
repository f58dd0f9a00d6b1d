"""``reprotrain --exit-file PATH``: where the job's exit code goes, checked before the job.

Closes: an exit file that replaced what stood at its path, or failed after the job ran.
:func:`checked` runs before the job (a regular file, or creatable: one line, exit 2 else);
:func:`write` after it, one line if it fails. docs/cli.md.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import tempfile
from pathlib import Path

from reprotrain.errors import ReprotrainError
from reprotrain.tools.cli import describe_os_error

__all__ = ["ExitFileError", "checked", "write"]


class ExitFileError(ReprotrainError):
    """``--exit-file`` names a path the command must not (or cannot) write."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _probe(directory: Path) -> None:
    """Create, write, sync and remove a small file in ``directory`` (raises OSError)."""
    fd, name = tempfile.mkstemp(prefix=".exit-file-probe-", dir=directory)
    try:
        os.write(fd, b"0\n")
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(name)


def checked(path: Path) -> Path:
    """The path the exit code will be written to (a symlink resolved), or ExitFileError."""
    path = Path(path).expanduser()
    hint = "give a regular file or a new file's path (e.g. --exit-file rc.txt)"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise ExitFileError(f"--exit-file {path}: {describe_os_error(e)}; {hint}") from None
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            raise ExitFileError(f"--exit-file {path} is {_kind(st.st_mode)}; {hint}")
        path = path.resolve()
    parent = path.parent
    if not parent.is_dir():
        raise ExitFileError(f"--exit-file {path}: no such directory {parent}; {hint}")
    if st is not None and not os.access(path, os.W_OK):
        raise ExitFileError(f"--exit-file {path}: not writable; {hint}")
    try:
        _probe(parent)
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise ExitFileError(
            f"--exit-file {path}: cannot write in {parent} ({why}); {hint}"
        ) from None
    return path


def write(path: Path, code: int) -> bool:
    """Write ``code`` atomically; False and one stderr line if that failed."""
    from reprotrain.run.record import atomic_write_text  # light: no torch

    try:
        if path.exists() and not path.is_file():  # it changed while the job ran
            raise OSError(errno.EEXIST, "no longer a regular file", str(path))
        atomic_write_text(path, f"{code}\n")  # a reader never sees half a number
    except OSError as e:
        print(f"error: --exit-file {path}: the exit code {code} was not written "
              f"({describe_os_error(e)})", file=sys.stderr, flush=True)  # fmt: skip
        return False
    return True
