"""The one rule for which tar members may be extracted, shared by every reader of archives
(dataset downloads, ``data.download``, and ``make reproduce``): a relative path inside the
target, naming a regular file or a directory. Absolute paths, ``..``, links, devices and
fifos are refused before a single byte is written.
"""

from __future__ import annotations

import re
import tarfile
from pathlib import PurePosixPath


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
    if not (m.isreg() or m.isdir()):
        return "not a plain file or directory"
    return None
