"""The fan-out the loop talks to: every call RNG-neutral and failure-isolated (docs/loggers.md)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reprotrain.run.record import read_jsonl, strict_json, write_jsonl

if TYPE_CHECKING:
    from reprotrain.loggers.settings import LoggerSettings

log = logging.getLogger("reprotrain")
LOGGED = "logged.jsonl"
_OFF = "logger %s failed in %s (%s); switched off for this run (metrics.jsonl is unaffected)"


def switched_off(name: str, method: str, e: Exception) -> None:
    """The one warning of a logger that raised: it is switched off, the run goes on."""
    why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    log.warning(_OFF, name, method, why)


@dataclass
class History:
    """What the record says was logged up to a resumed checkpoint's step."""

    steps: list[int]
    series: dict[str, list[float | None]]
    epochs: list[tuple[int, int, dict[str, Any]]]  # (epoch, global step, metrics row)


@dataclass
class LoggerRun:
    """What a logger is told when the run starts (:meth:`Logger.start`)."""

    run_dir: Path  # the run directory (a logger may write its own files here)
    record: dict[str, Any]  # run.json's data as it stands: name, seed, config_sha256, ...
    params: dict[str, Any]  # the flattened resolved config and run.json's identity fields
    start_step: int = 0  # the global step a resumed run continues from (0: a fresh run)
    history: History | None = None  # what was logged up to ``start_step`` (the record's)
    settings: LoggerSettings | None = None  # the ``logger`` node, read once
    report: Any = None  # draws report.md and curves.png of a run dir into a folder


class Logger:
    """The base of a logger (``_target_`` it from ``conf/logger/``); a method that raises
    switches it off; the global generators are restored after each call. Rank 0 only."""

    name = "logger"

    def start(self, run: LoggerRun) -> None:
        """Once, before any value; after a resume ``run.history`` holds what was logged."""

    def describe(self) -> str:
        return self.name

    def log_steps(self, steps: list[int], series: dict[str, list[float | None]]) -> None:
        """Per-step series (``train_loss``, ``lr``), one value per step (``None``: absent)."""

    def end_batch(self, global_step: int) -> None:
        """No more values for the steps up to ``global_step``."""

    def log_epoch(self, epoch: int, global_step: int, row: dict[str, float | None]) -> None:
        """The epoch's metrics.jsonl row (numbers only) and what callbacks logged."""

    def log_final(self, metrics: dict[str, float | None]) -> None:
        """run.json's final metrics (final and test values), once at the end."""

    def close(self, status: str) -> None:
        """``completed``, ``interrupted`` or ``failed``."""


class Loggers:
    """Fan-out to the enabled backends; every call is RNG-neutral and failure-isolated."""

    def __init__(self, backends: list[Logger], configured: tuple[str, ...] = ()) -> None:
        self._backends = backends
        #: The backends the config chose, the same on every rank (only rank 0 has them).
        self.configured = tuple(configured) or tuple(b.name for b in backends)

    @property
    def names(self) -> list[str]:
        return [b.name for b in self._backends]

    def log_steps(self, global_steps: list[int], series: dict[str, list[float | None]]) -> None:
        """Per-step values (train_loss, lr) of the steps since the last call, one per step."""
        for key, values in series.items():
            if len(values) != len(global_steps):
                raise ValueError(f"series {key!r}: {len(values)} values, {len(global_steps)} steps")
        if global_steps:
            self._call("log_steps", list(global_steps), series)

    def end_batch(self, global_step: int) -> None:
        """The batch just logged is complete (W&B may write a row it held open)."""
        self._call("end_batch", global_step)

    def log_epoch(self, epoch: int, global_step: int, row: dict[str, Any]) -> None:
        """One metrics.jsonl row (train/val/test metrics, lr, timings) at the epoch's end."""
        self._call("log_epoch", epoch, global_step, numeric(row, skip=("epoch", "global_step")))

    def log_final(self, metrics: dict[str, Any]) -> None:
        self._call("log_final", numeric(metrics, skip=()))

    def close(self, status: str = "completed") -> None:
        self._call("close", status)
        self._backends = []

    def __enter__(self) -> Loggers:
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        self.close("completed" if exc_type is None else "failed")

    def _call(self, method: str, *args: Any) -> None:
        for backend in list(self._backends):
            try:
                with preserved_rng():
                    getattr(backend, method)(*args)
            except Exception as e:  # a dashboard failing must not end the training run
                switched_off(backend.name, method, e)
                self._backends.remove(backend)
                with contextlib.suppress(Exception), preserved_rng():
                    backend.close("failed")


def resumed_history(
    fingerprints: list[dict],
    metrics: list[dict],
    partial_losses: list[float],
    partial_lrs: list[float],
    global_step: int,
    logged: list[dict] | None = None,
) -> History:
    """The numbers the loop had logged before a resume: per-step series and epoch rows, with
    what callbacks logged (``logged``: :class:`CallbackLog`'s lines up to ``global_step``)."""
    steps: list[int] = []
    losses: list[float | None] = []
    lrs: list[float | None] = []
    for row in fingerprints:
        n = len(row.get("step_losses") or [])
        steps += range(row["global_step"] - n + 1, row["global_step"] + 1)
        losses += list(row.get("step_losses") or [])
        lrs += list(row.get("step_lrs") or [None] * n)[:n]
    steps += range(global_step - len(partial_losses) + 1, global_step + 1)
    losses += list(partial_losses)
    lrs += list(partial_lrs)
    by_step = {e["global_step"]: e["values"] for e in logged or [] if e["epoch"] is None}
    by_epoch = {e["epoch"]: e["values"] for e in logged or [] if e["epoch"] is not None}
    series = {"train_loss": losses, "lr": lrs}
    for name in dict.fromkeys(k for values in by_step.values() for k in values):
        series[name] = [by_step.get(s, {}).get(name) for s in steps]
    rows = [(r["epoch"], r["global_step"], by_epoch.get(r["epoch"], {}) | r) for r in metrics]
    return History(steps, series, rows)


class CallbackLog:
    """``logged.jsonl``: what callbacks logged (``ctx.log``), a line per global step or epoch
    row, appended as the loggers get it (rank 0; ``None``: another rank). The record never
    holds these values, so after a resume every logger gets them back from here."""

    def __init__(self, run_dir: Path | None, start_step: int = 0) -> None:
        self.path = None if run_dir is None else Path(run_dir) / LOGGED
        self.lines: list[dict] = []
        if self.path is not None and self.path.is_file():
            # A killed attempt's lines past the checkpoint are logged again as it recomputes.
            lines = read_jsonl(self.path, torn_tail_ok=True)
            self.lines = [e for e in lines if e["global_step"] <= start_step]
            write_jsonl(self.path, self.lines)

    def add(self, values: dict[int, dict[str, float]], epoch: int | None = None) -> None:
        """``values`` by global step: a step's (``epoch`` None) or the epoch row's."""
        lines = [{"global_step": s, "epoch": epoch, "values": v} for s, v in values.items() if v]
        if self.path is not None and lines:
            with self.path.open("a") as f:
                f.write("".join(strict_json(e, sort_keys=True) + "\n" for e in lines))


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore python, NumPy and torch CPU RNG state after third-party code ran.
    Closes: a logger's draw (a random run id) shifting the ``train`` stream. CUDA generators
    are left alone (logging code does not touch them; copying them would sync the device)."""
    import random

    import numpy as np
    import torch

    py, npy, th = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.random.set_rng_state(th)


def numeric(row: dict[str, Any], skip: tuple[str, ...]) -> dict[str, float]:
    """Numbers only; NaN/inf kept on purpose, so a diverged loss shows on the dashboard."""
    return {
        k: float(v)
        for k, v in row.items()
        if k not in skip and not isinstance(v, bool) and isinstance(v, int | float)
    }
