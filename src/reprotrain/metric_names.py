"""Which recorded keys are outcome metrics, by name (``<split>_<name>``, ``best_test_<name>``)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

SPLITS = ("train", "val", "test")
BEST = "best_"


def split_of(key: str) -> str | None:
    """``train`` / ``val`` / ``test`` for ``<split>_<name>`` (or ``best_<split>_<name>``)."""
    split, _, name = key.removeprefix(BEST).partition("_")
    return split if split in SPLITS and name else None


def _name(key: str) -> str:
    """``acc`` of ``val_acc`` and of ``best_test_acc``."""
    return key.removeprefix(BEST).partition("_")[2]


def number_or_none(value: Any) -> bool:
    """A number (a bool is not one), or None: a non-finite value written as null."""
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


def is_outcome(key: str, value: Any = None) -> bool:
    """A split metric whose value is a number (or None: a non-finite value written as null)."""
    return split_of(key) is not None and number_or_none(value)


def outcome_keys(rows: Iterable[Mapping[str, Any]]) -> set[str]:
    """Every outcome metric any of the rows holds."""
    return {k for row in rows for k, v in row.items() if is_outcome(k, v)}


def sort_key(key: str) -> tuple[int, bool, bool, str]:
    """train, val, test, then best_test; in each split the loss first, then by name."""
    split = split_of(key)
    rank = SPLITS.index(split) if split is not None else len(SPLITS)
    return (rank, key.startswith(BEST), not key.endswith("_loss"), key)


def direction(metric: str, monitor: str, monitor_mode: str) -> str:
    """``max``/``min``: the monitor's mode for its name on any split, else min for a loss."""
    if _name(metric) == _name(monitor):
        return monitor_mode
    return "min" if metric.endswith("_loss") else "max"


def better(a: float, b: float, mode: str) -> bool:
    """Is ``a`` strictly better than ``b`` under ``mode``? A non-finite ``a`` never is."""
    return math.isfinite(a) and (a > b if mode == "max" else a < b)


# Metrics in [0, 1] and ones never negative: a confidence interval is cut to this range.
UNIT_INTERVAL = ("acc", "accuracy", "f1", "auroc", "ap", "precision", "recall", "iou", "dice")
NON_NEGATIVE = ("loss", "rmse", "mse", "mae", "ece")


def value_range(key: str) -> tuple[float, float]:
    """The values ``key`` can take, by its name: [0, 1], [0, inf), (-inf, 1] for r2, or all."""
    name = _name(key)
    head = name.split("_")[0]
    if head in UNIT_INTERVAL or name in UNIT_INTERVAL:
        return (0.0, 1.0)
    if head in NON_NEGATIVE or name.endswith("_loss"):
        return (0.0, math.inf)
    if head == "r2":
        return (-math.inf, 1.0)
    return (-math.inf, math.inf)
