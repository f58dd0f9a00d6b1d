"""Per-op hashes of chosen training steps: what ``make bisect`` compares between two runs.
Closes: "the runs differ, but where?" (docs/when-bits-differ.md). ``REPROTRAIN_TRACE_STEPS``
(0-based, comma-separated) writes ``<REPROTRAIN_TRACE_DIR>/step-<N>.jsonl``,
``REPROTRAIN_DIGEST_STEPS=<first>-<last>`` a line per step to ``digests.jsonl``. A dispatch
mode only observes (same bits); unset, :func:`step` is a shared null context."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from reprotrain.run.record import parse_jsonl, read_jsonl, write_jsonl

STEPS_VAR, DIR_VAR = "REPROTRAIN_TRACE_STEPS", "REPROTRAIN_TRACE_DIR"
DIGEST_VAR = "REPROTRAIN_DIGEST_STEPS"  # "<first>-<last>": one digest line per step
DIGESTS = "digests.jsonl"
BATCH = "batch"  # the ``op`` of a trace's first row: the hash of the step's input batch
#: Ops whose output is uninitialised memory: its bits say nothing about the run.
UNINITIALISED = ("aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty")


def _digest_steps_from_env() -> range:
    if not (text := os.environ.get(DIGEST_VAR, "").strip()):
        return range(0)
    first, _, last = text.partition("-")
    return range(int(first), int(last or first) + 1)


# Read once at import: the loop pays a set lookup per step.
_STEPS = frozenset(int(s) for s in os.environ.get(STEPS_VAR, "").split(",") if s.strip())
_DIGEST_STEPS = _digest_steps_from_env()


def trace_path(trace_dir: Path, global_step: int) -> Path:
    return Path(trace_dir) / f"step-{global_step:08d}.jsonl"


def _hashes(tree: Any) -> list[torch.Tensor]:
    if torch.distributed.is_available():
        importlib.import_module("torch.distributed.tensor")  # hash_tensor_fn checks DTensor
    from torch.utils._debug_mode import hash_tensor_fn

    return [hash_tensor_fn(x.detach()) for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


def batch_sha256(batch: Any) -> list[str]:
    """sha256 of each tensor's bytes, in order (data order is what it checks)."""
    out = []
    for x in tree_leaves(batch):
        if isinstance(x, torch.Tensor):
            data = x.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
            out.append(hashlib.sha256(data).hexdigest())
    return out


def compares_output(op: str) -> bool:
    """False for ops whose output bits are uninitialised memory (``aten.empty...``)."""
    return not op.startswith(UNINITIALISED)


class OpHashMode(TorchDispatchMode):
    """Records (op, module, phase, input hashes, output hashes) for every dispatched op."""

    def __init__(self, tracker: Any, light: bool = False) -> None:
        super().__init__()
        self.tracker, self.light = tracker, light
        self.rows: list[dict[str, Any]] = []
        self.backward_seen = False

    def module(self) -> str:
        """The innermost module running now (``layer3.1.conv2``); ``-`` outside any module."""
        if not (names := [n for n in self.tracker.parents if n != "Global"]):
            return "-"
        inner = max(names, key=lambda n: n.count("."))
        return inner.partition(".")[2] or inner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.light:  # a digest: the op and its outputs only
            out = func(*args, **kwargs)
            self.rows.append({"op": str(func), "outputs": _hashes(out)})
            return out
        inputs = _hashes((args, kwargs))  # before the op: an in-place op overwrites them
        out = func(*args, **kwargs)
        backward = self.tracker.is_bw
        self.backward_seen |= backward
        phase = "backward" if backward else "optimizer" if self.backward_seen else "forward"
        row = {"op": str(func), "module": self.module(), "phase": phase, "inputs": inputs}
        self.rows.append({**row, "outputs": _hashes(out)})
        return out


_UNTRACED = contextlib.nullcontext()


def step(global_step: int, batch: Any) -> contextlib.AbstractContextManager:
    """Trace or digest this step when the variables name it; else a shared null context."""
    if global_step not in _STEPS and global_step not in _DIGEST_STEPS:
        return _UNTRACED
    return _step(global_step, batch)


@contextlib.contextmanager
def _step(global_step: int, batch: Any) -> Iterator[None]:
    if int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    if global_step not in _STEPS:
        with digest(global_step, batch):
            yield
        return
    from torch.utils.module_tracker import ModuleTracker

    out_dir = Path(os.environ[DIR_VAR])
    batch_hashes = batch_sha256(batch)
    tracker = ModuleTracker()
    mode = OpHashMode(tracker)
    with tracker, mode:
        yield
    rows = [{"op": BATCH, "module": "-", "phase": "input", "inputs": [], "outputs": batch_hashes}]
    for row in mode.rows:
        rows.append({**row, **{k: [int(h.item()) for h in row[k]] for k in ("inputs", "outputs")}})
    indexed = [{**r, "index": i - 1} for i, r in enumerate(rows)]  # the batch -1, ops from 0
    write_jsonl(trace_path(out_dir, global_step), indexed)


@contextlib.contextmanager
def digest(global_step: int, batch: Any) -> Iterator[None]:
    """Append this step's digest line to ``<REPROTRAIN_TRACE_DIR>/digests.jsonl``."""
    batch_hashes = batch_sha256(batch)
    mode = OpHashMode(None, light=True)
    with mode:
        yield
    h = hashlib.sha256()
    for row in mode.rows:
        if compares_output(row["op"]):
            h.update(f"{row['op']}|{[int(x.item()) for x in row['outputs']]}\n".encode())
    out_dir = Path(os.environ[DIR_VAR])
    out_dir.mkdir(parents=True, exist_ok=True)
    line = {"step": global_step, "batch": batch_hashes, "ops": len(mode.rows)}
    with open(out_dir / DIGESTS, "a") as f:
        f.write(json.dumps({**line, "digest": h.hexdigest()}) + "\n")


def read_digests(trace_dir: Path) -> dict[int, dict[str, Any]]:
    """{global step: digest line} of a replay (empty when it wrote none)."""
    return {row["step"]: row for row in read_jsonl(Path(trace_dir) / DIGESTS)}


def read_trace(path: Path) -> list[dict[str, Any]]:
    return parse_jsonl(Path(path).read_text(), str(path))
