"""Dataset selection by config: the tensors to train on and the fingerprint that names them.

Closes (as a record): data drift. ``data_fingerprint`` identifies the exact data a run used
(sha256 of CIFAR-10's batch files, cached; or of the synthetic generation parameters) and
can be computed without loading the data, so reproduce can refuse drifted data up front.
"""

from __future__ import annotations

from pathlib import Path

import torch

from reprotrain.data.cifar10 import cifar10_files, load_cifar10
from reprotrain.data.fingerprint import files_fingerprint
from reprotrain.data.synthetic import load_synthetic, synthetic_fingerprint
from reprotrain.paths import REPO_ROOT


def data_root(cfg) -> Path:
    """Relative roots resolve against the repository, not the (per-run) working directory."""
    root = Path(cfg.root)
    return root if root.is_absolute() else REPO_ROOT / root


def _synthetic_params(cfg) -> tuple:
    return cfg.num_train, cfg.num_test, cfg.data_seed, cfg.noise


def load_data(cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train_x, train_y, test_x, test_y): uint8 [N,3,32,32] images and int64 labels."""
    if cfg.name == "synthetic":
        return load_synthetic(*_synthetic_params(cfg))
    return load_cifar10(data_root(cfg), url=cfg.url, md5=cfg.md5, download=cfg.download)


def data_fingerprint(cfg) -> dict:
    """What run.json records as the data's identity (call after ``load_data`` for cifar10)."""
    if cfg.name == "synthetic":
        return {
            "kind": "synthetic-params",
            "sha256": synthetic_fingerprint(*_synthetic_params(cfg)),
        }
    root = data_root(cfg)
    files = cifar10_files(root)
    missing = [p.name for p in files if not p.is_file()]
    if missing:
        return {"kind": "files", "sha256": None, "missing": missing}
    sha = files_fingerprint(files, cache_file=root / ".fingerprint-cache.json")
    return {"kind": "files", "sha256": sha, "files": sorted(p.name for p in files)}
