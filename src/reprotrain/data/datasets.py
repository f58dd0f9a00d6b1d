"""Where a dataset's files live: relative roots resolve against the repository.

The dataset itself is built, and fingerprinted, in the build room (``build.build_dataset``,
``build.data_fingerprint``).
"""

from __future__ import annotations

from pathlib import Path

from reprotrain import REPO_ROOT


def data_root(root: str | Path) -> Path:
    """Relative roots resolve against the repository, not the (per-run) working directory."""
    root = Path(root)
    return root if root.is_absolute() else REPO_ROOT / root
