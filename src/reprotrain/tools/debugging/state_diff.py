"""Which parts of two checkpoints' training state differ, bit for bit.

``make bisect`` walks back from a step whose first differing op already had differing
inputs: the newest checkpoint at which both runs hold the same state is where a replay can
start and still find the op that made the difference. Compared: every part a resume restores
and the next steps compute from (model, optimizer, scheduler, scaler, task, RNG, ...); not the
run's description (config, environment, seeds) nor the loop's record of past steps (losses,
metric sums), which differ *because* the state differed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from reprotrain.repro import checkpoint

#: Checkpoint keys that describe the run or record its past, not state the next step reads.
NOT_STATE = ("format_version", "config", "config_sha256", "env", "seeds", "loop")


def _same(x: Any, y: Any) -> bool:
    """Bitwise equality of two pytrees (tensors by dtype, shape and bytes)."""
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            return False
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        bx = x.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        return torch.equal(bx, y.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, list | tuple) and isinstance(y, list | tuple):
        return len(x) == len(y) and all(_same(i, j) for i, j in zip(x, y, strict=True))
    return type(x) is type(y) and x == y


def state_differences(a: Path, b: Path) -> list[str]:
    """The training-state parts (``model``, ``optimizer``, ...) in which the checkpoints
    ``a`` and ``b`` differ; empty when a replay from either starts from the same bits."""
    sa, sb = checkpoint.load(a), checkpoint.load(b)
    parts = sorted((set(sa) | set(sb)) - set(NOT_STATE))
    return [k for k in parts if k not in sa or k not in sb or not _same(sa[k], sb[k])]
