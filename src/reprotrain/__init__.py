"""reprotrain: same code, same lock, same config, same machine -> the same bits.

The names a user's package imports are ``reprotrain.api``'s, re-exported here:
``from reprotrain import Task, Step, InMemoryImages``. They load on first use, so importing
a framework module (``reprotrain.repro.hashseed`` before torch) stays cheap.
"""

import importlib
from pathlib import Path
from typing import Any

__version__ = "0.1.0"

# Where the repository's pieces are, found from this file (inside an archived source
# snapshot too, which keeps the same src/ + conf/ layout).
REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = REPO_ROOT / "conf"

# reprotrain.api's names (its __all__; a test keeps the two equal). Any other attribute is a
# submodule, which ``from reprotrain import events`` must import, not the face.
FACE = (
    "Batch", "Callback", "Classification", "DataMissingError", "InMemoryImages", "InMemoryTensors",
    "Logger", "ReprotrainError", "SampleData", "Splits", "Step", "StepContext", "StepOutput",
    "Subset", "Task", "data_root", "download_and_verify", "files_fingerprint", "load_pickle",
    "mean_sum", "val_indices",
)  # fmt: skip


def __getattr__(name: str) -> Any:
    if name not in FACE:
        raise AttributeError(f"module 'reprotrain' has no attribute {name!r}")
    return getattr(importlib.import_module("reprotrain.api"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *FACE])
