"""Dataset from config, and the fingerprint that names the exact data a run used.

Closes (as a record): data drift. ``data_fingerprint`` identifies the data without loading it
(sha256 of the files, cached; or of the generation parameters), so reproduce can refuse
drifted data before it trains.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from reprotrain import REPO_ROOT


def data_root(root: str | Path) -> Path:
    """Relative roots resolve against the repository, not the (per-run) working directory."""
    root = Path(root)
    return root if root.is_absolute() else REPO_ROOT / root


def build_dataset(cfg: DictConfig):
    """The dataset object named by ``cfg._target_`` (cheap: files are read by ``splits``)."""
    from reprotrain.components import build

    return build("dataset", cfg)


def data_fingerprint(cfg: DictConfig) -> dict:
    """What run.json records as the data's identity."""
    return build_dataset(cfg).fingerprint()
