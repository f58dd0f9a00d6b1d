"""Your own callbacks: a model summary and a metric history, as worked examples of the
``callbacks`` group (``callbacks=default``, ``conf/callbacks/default.yaml``).

A callback subclasses ``reprotrain.api.Callback`` and overrides the hooks it needs:
``on_start(ctx)``, ``on_epoch_end(ctx, row)``, ``on_checkpoint(ctx, path)`` and
``on_end(ctx, final_metrics)``. ``ctx`` hands the model, the optimizer, the epoch, the global
step, the run directory, ``is_main`` (rank 0) and ``replaying`` (a resume re-running steps to
prove its bits: skip side effects then). Give it ``state_dict()``/``load_state_dict()`` and
what it keeps is checkpointed, restored on resume and compared bit for bit by the resume's
replay, like the model's weights. The framework runs every hook inside an RNG guard, so a
callback that draws randomness never moves the training streams.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from reprotrain.api import Callback

log = logging.getLogger(__name__)


class ModelSummary(Callback):
    """At the start of training: each module down to ``max_depth`` with its type and its
    parameter count, and the total (trainable and frozen), logged once per process."""

    def __init__(self, max_depth: int = 1) -> None:
        self.max_depth = max_depth  # 0: the whole model only; 1: its children; ...

    def rows(self, model: Any) -> list[tuple[str, str, int]]:
        """(name, type, parameters) of the model and its modules down to ``max_depth``."""
        out = []
        for name, module in model.named_modules():
            depth = 0 if not name else name.count(".") + 1
            if depth <= self.max_depth:
                params = sum(p.numel() for p in module.parameters())
                out.append((name or "(model)", type(module).__name__, params))
        return out

    def on_start(self, ctx) -> None:
        if not ctx.is_main or ctx.replaying:  # a resume's replay runs on_start too
            return
        rows = self.rows(ctx.model)
        width = max(len(name) for name, _, _ in rows)
        lines = [f"  {name:<{width}}  {kind:<20} {params:>12,}" for name, kind, params in rows]
        trainable = sum(p.numel() for p in ctx.model.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in ctx.model.parameters() if not p.requires_grad)
        lines.append(f"  {trainable:,} trainable, {frozen:,} frozen parameters")
        log.info("model summary:\n%s", "\n".join(lines))


class MetricHistory(Callback):
    """One metric of every epoch and its best (a callback with state): kept in every
    checkpoint, and written as ``metric_history.json`` in the run directory at the end."""

    def __init__(self, monitor: str = "train_loss", mode: str = "min") -> None:
        if mode not in ("min", "max"):
            raise ValueError("mode must be min or max")
        self.monitor, self.mode = monitor, mode
        self.values: list[float | None] = []
        self.best: float | None = None

    def on_epoch_end(self, ctx, row: dict) -> None:
        value = row.get(self.monitor)
        self.values.append(value)
        if value is not None and (
            self.best is None or (value < self.best if self.mode == "min" else value > self.best)
        ):
            self.best = value

    def on_end(self, ctx, final_metrics: dict) -> None:
        if ctx.is_main:
            record = {"monitor": self.monitor, "values": self.values, "best": self.best}
            Path(ctx.run_dir, "metric_history.json").write_text(json.dumps(record, indent=2))

    def state_dict(self) -> dict:
        return {"values": list(self.values), "best": self.best}

    def load_state_dict(self, state: dict) -> None:
        self.values, self.best = list(state["values"]), state["best"]
